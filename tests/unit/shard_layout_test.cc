// The flat index space of sharded optimizer state (runner/dist/shard.h): every element owned by
// exactly one rank, chunks of equal size but the last ones, pieces that cut tensors at the right
// places, a shard that takes its slice of whole tensors and steps the parameters in place, and
// the flag's names.
#include "runner/dist/shard.h"
#include "runner/runner_config.h"

#include <gtest/gtest.h>

#include <numeric>

namespace tinkerd {
namespace {

TEST(ShardLayout, EveryElementHasExactlyOneOwner) {
  const std::vector<int64_t> numels{7, 1, 12, 3};  // N = 23
  for (int world : {1, 2, 3, 4, 5, 23, 30}) {
    std::vector<int> owners(23, 0);
    for (int r = 0; r < world; ++r) {
      ShardLayout l(numels, world, r);
      EXPECT_EQ(l.total(), 23);
      EXPECT_EQ(l.chunk(), (23 + world - 1) / world) << world;
      for (int64_t i = l.begin(r); i < l.end(r); ++i) ++owners[i];
      EXPECT_LE(l.owned(), l.chunk());
    }
    for (int i = 0; i < 23; ++i) EXPECT_EQ(owners[i], 1) << "world " << world << " element " << i;
  }
  // Past N the chunks are empty: 23 elements over 30 ranks leave the last 7 without any.
  ShardLayout l(numels, 30, 29);
  EXPECT_EQ(l.owned(), 0);
}

TEST(ShardLayout, PiecesCutTensorsAtTheirBoundaries) {
  ShardLayout l({7, 1, 12, 3}, 3, 0);  // tensors at [0,7) [7,8) [8,20) [20,23)
  auto pieces = l.Pieces(5, 10);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].tensor, 0u);
  EXPECT_EQ(pieces[0].tensor_offset, 5);
  EXPECT_EQ(pieces[0].offset, 0);
  EXPECT_EQ(pieces[0].length, 2);
  EXPECT_EQ(pieces[1].tensor, 1u);
  EXPECT_EQ(pieces[1].length, 1);
  EXPECT_EQ(pieces[2].tensor, 2u);
  EXPECT_EQ(pieces[2].tensor_offset, 0);
  EXPECT_EQ(pieces[2].offset, 3);
  EXPECT_EQ(pieces[2].length, 2);
  EXPECT_TRUE(l.Pieces(23, 23).empty());
  ASSERT_EQ(l.Pieces(20, 23).size(), 1u);
  EXPECT_EQ(l.Pieces(20, 23)[0].tensor, 3u);
}

TEST(ShardLayout, ReadAndWriteFlatAreInverse) {
  std::vector<at::Tensor> tensors{at::arange(7, at::kDouble).view({7}),
                                  at::arange(7, 19, at::kDouble).view({3, 4}),
                                  at::arange(19, 23, at::kDouble).view({2, 2})};
  ShardLayout l({7, 12, 4}, 2, 1);
  at::Tensor flat_K = at::empty({9}, at::kDouble);
  ReadFlat(l, tensors, 5, 14, flat_K);
  EXPECT_TRUE(flat_K.equal(at::arange(5, 14, at::kDouble)));
  WriteFlat(l, tensors, 5, 14, flat_K.neg());
  EXPECT_EQ(tensors[0][6].item<double>(), -6.0);
  EXPECT_EQ(tensors[1][1][2].item<double>(), -13.0);
  EXPECT_EQ(tensors[1][1][3].item<double>(), 14.0);  // just past the range: untouched
  EXPECT_EQ(tensors[0][4].item<double>(), 4.0);      // just before it
}

TEST(OptimizerShard, ScatterTakesTheRanksSliceAndViewsAreTheParameters) {
  std::vector<at::Tensor> whole{at::arange(15, at::kDouble).view({3, 5}),
                                at::arange(15, 19, at::kDouble)};
  // 19 values over 2 ranks: rank 1 owns [10, 19), the end of the first tensor and all the second.
  OptimizerShard shard(ShardLayout({15, 4}, 2, 1), at::TensorOptions().dtype(at::kDouble));
  ASSERT_EQ(shard.exp_avg_C.numel(), 9);
  shard.Scatter(whole, shard.exp_avg_C);
  EXPECT_TRUE(shard.exp_avg_C.equal(at::arange(10, 19, at::kDouble)));
  auto cut = shard.Cut(shard.exp_avg_C);
  ASSERT_EQ(cut.size(), 2u);
  EXPECT_EQ(cut[0].numel(), 5);
  // The views AdamW steps are the slices of the parameters themselves.
  auto views = shard.Views(whole);
  ASSERT_EQ(views.size(), 2u);
  views[0].fill_(-1.0);
  views[1].fill_(7.0);
  EXPECT_EQ(whole[0][1][4].item<double>(), 4 + 5);  // rank 0's last value: untouched
  EXPECT_EQ(whole[0][2][0].item<double>(), -1.0);
  EXPECT_TRUE(whole[1].equal(at::full({4}, 7.0, at::kDouble)));
}

TEST(ShardMode, NamesParseAndATypoIsNamed) {
  for (ShardMode m : {ShardMode::kNone, ShardMode::kOptimizer, ShardMode::kFull}) {
    EXPECT_EQ(*ParseShardMode(ShardModeName(m)), m);
  }
  auto typo = ParseShardMode("optimiser");
  EXPECT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("\"optimiser\""), absl::string_view::npos);
}

}  // namespace
}  // namespace tinkerd
