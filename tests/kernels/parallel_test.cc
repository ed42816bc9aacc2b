// kernels/parallel.h: a SpinningTeam's loops cover their range once, in the chunks LibTorch's
// at::parallel_for makes on as many threads, on the team's own threads; a chunk's exception
// reaches the caller; a loop inside a chunk runs inline; outside a Scope the loops are LibTorch's
// again. The kernels' results on the team are bitwise those on LibTorch's threads, and the token
// choice on float32 logits is that on the same logits in double.
#include "kernels/parallel.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/decode_attention.h"
#include "kernels/gemv.h"
#include "runner/sample/choose_rows.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

using Chunk = std::pair<int64_t, int64_t>;

// The chunks of one ParallelFor and the threads that ran them.
struct Record {
  std::mutex mu;
  std::vector<Chunk> chunks;
  std::set<std::thread::id> threads;

  kernels::LoopBody Body() {
    return [this](int64_t b, int64_t e) {
      std::lock_guard<std::mutex> lock(mu);
      chunks.emplace_back(b, e);
      threads.insert(std::this_thread::get_id());
    };
  }
  std::vector<Chunk> Sorted() {
    std::sort(chunks.begin(), chunks.end());
    return chunks;
  }
};

// The chunks LibTorch's own at::parallel_for makes of [begin, end) on `threads` threads: the
// oracle (ParallelFor outside a Scope is at::parallel_for).
std::vector<Chunk> LibTorchChunks(int64_t begin, int64_t end, int64_t grain, int threads) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  Record r;
  kernels::ParallelFor(begin, end, grain, r.Body());
  at::set_num_threads(before);
  return r.Sorted();
}

TEST(SpinningTeam, SplitsAsLibTorchOnItsOwnThreads) {
  for (int threads : {1, 2, 3, 4}) {
    kernels::SpinningTeam team(threads);
    ASSERT_EQ(team.threads(), threads);
    for (auto [begin, end, grain] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{0, 1, 1},
                                                            {0, 7, 1},
                                                            {3, 103, 1},
                                                            {0, 100, 30},
                                                            {0, 100, 100},
                                                            {5, 6, 0},
                                                            {0, 64, 0}}) {
      const std::vector<Chunk> want = LibTorchChunks(begin, end, grain, threads);
      // Control: the oracle tells splits apart; with a thread fewer it differs wherever there
      // are several chunks.
      const std::vector<Chunk> fewer = LibTorchChunks(begin, end, grain, std::max(threads - 1, 1));
      const kernels::SpinningTeam::Scope hot(team);
      Record r;
      kernels::ParallelFor(begin, end, grain, r.Body());
      EXPECT_EQ(r.Sorted(), want) << threads << " threads, [" << begin << ", " << end << "), grain "
                                  << grain;
      // Each chunk on its own thread: the caller's and the workers'.
      EXPECT_EQ(r.threads.size(), want.size())
          << threads << " threads, [" << begin << ", " << end << ")";
      if (want.size() > 1) {
        EXPECT_NE(r.Sorted(), fewer);
      }
    }
    const kernels::SpinningTeam::Scope hot(team);
    Record none;
    kernels::ParallelFor(4, 4, 1, none.Body());
    EXPECT_TRUE(none.chunks.empty());
  }
}

TEST(SpinningTeam, AChunksExceptionReachesTheCallerAndTheTeamGoesOn) {
  kernels::SpinningTeam team(2);
  const kernels::SpinningTeam::Scope hot(team);
  const std::thread::id caller = std::this_thread::get_id();
  // The second chunk runs on the worker.
  EXPECT_THROW(kernels::ParallelFor(0, 10, 1,
                                    [&](int64_t b, int64_t) {
                                      if (b > 0 && std::this_thread::get_id() != caller) {
                                        throw std::runtime_error("worker");
                                      }
                                    }),
               std::runtime_error);
  EXPECT_THROW(kernels::ParallelFor(0, 10, 1,
                                    [&](int64_t b, int64_t) {
                                      if (b == 0) throw std::runtime_error("caller");
                                    }),
               std::runtime_error);
  Record r;
  kernels::ParallelFor(0, 10, 1, r.Body());
  EXPECT_EQ(r.Sorted(), (std::vector<Chunk>{{0, 5}, {5, 10}}));
}

TEST(SpinningTeam, ALoopInsideAChunkRunsOnItsThread) {
  at::set_num_threads(2);  // so that LibTorch's pool would take the inner loops, were they let
  kernels::SpinningTeam team(2);
  const kernels::SpinningTeam::Scope hot(team);
  std::atomic<int> inline_loops{0}, elsewhere{0};
  kernels::ParallelFor(0, 2, 1, [&](int64_t, int64_t) {
    const std::thread::id mine = std::this_thread::get_id();
    kernels::ParallelFor(0, 100, 1, [&](int64_t b, int64_t e) {
      (std::this_thread::get_id() == mine && b == 0 && e == 100 ? inline_loops : elsewhere)++;
    });
  });
  EXPECT_EQ(inline_loops.load(), 2);
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(SpinningTeam, OutsideAScopeTheLoopsAreLibTorchs) {
  at::set_num_threads(2);
  kernels::SpinningTeam team(2);
  std::set<std::thread::id> team_threads;
  {
    const kernels::SpinningTeam::Scope hot(team);
    Record r;
    kernels::ParallelFor(0, 2, 1, r.Body());
    team_threads = r.threads;
    ASSERT_EQ(team_threads.size(), 2u);
  }
  Record r;
  kernels::ParallelFor(0, 2, 1, r.Body());
  EXPECT_EQ(r.Sorted(), (std::vector<Chunk>{{0, 1}, {1, 2}}));
  ASSERT_EQ(r.threads.size(), 2u);
  // The caller is in both; LibTorch's worker is not the team's.
  team_threads.erase(std::this_thread::get_id());
  for (const std::thread::id& t : r.threads) EXPECT_EQ(team_threads.count(t), 0u);
  // Scopes nest: the inner one's end leaves the outer's team in use.
  const kernels::SpinningTeam::Scope outer(team);
  { const kernels::SpinningTeam::Scope inner(team); }
  Record again;
  kernels::ParallelFor(0, 2, 1, again.Body());
  again.threads.erase(std::this_thread::get_id());
  EXPECT_EQ(again.threads, team_threads);
}

TEST(SpinningTeam, KernelsGiveTheBitsTheyGiveOnLibTorchsThreads) {
  at::NoGradGuard no_grad;
  at::set_num_threads(2);
  if (!kernels::GemvRunsHere()) GTEST_SKIP() << "Gemv needs AVX2 or AVX-512";
  const at::Tensor x = Randn({64, 96}, 1).to(at::kFloat), w = Randn({300, 96}, 2).to(at::kFloat);
  const at::Tensor q = Randn({16, 4, 32}, 3).to(at::kFloat);
  kernels::DecodeAttentionParams p;
  p.q_SHd = q;
  for (int64_t s = 0; s < 16; ++s) {
    p.k_pieces.push_back({Randn({20 + s, 2, 32}, 10 + s).to(at::kFloat)});
    p.v_pieces.push_back({Randn({20 + s, 2, 32}, 40 + s).to(at::kFloat)});
    p.lengths.push_back(20 + s);
  }
  const at::Tensor y_omp = kernels::Gemv({x, w}), a_omp = kernels::DecodeAttention(p);
  kernels::SpinningTeam team(2);
  const kernels::SpinningTeam::Scope hot(team);
  EXPECT_TRUE(at::equal(kernels::Gemv({x, w}), y_omp));
  EXPECT_TRUE(at::equal(kernels::DecodeAttention(p), a_omp));
  // Control: the same product on other weights is told apart.
  EXPECT_FALSE(at::equal(kernels::Gemv({x, w.roll(1, 0)}), y_omp));
}

TEST(SpinningTeam, TheChoiceOnFloatLogitsIsTheChoiceOnThemInDouble) {
  constexpr int64_t S = 9, V = 1000;
  const at::Tensor z_SV = (Randn({S, V}, 5) * 3).to(at::kFloat);
  const at::Tensor wide_SV = z_SV.to(at::kDouble);
  std::vector<SamplingParams> params(S);
  for (int64_t s = 0; s < S; ++s) {
    params[s].temperature = s % 3 == 0 ? 0.0 : 0.5 + 0.25 * static_cast<double>(s % 4);
    params[s].top_k = s % 4 == 1 ? 50 : 0;
    params[s].top_p = s % 4 == 2 ? 0.9 : 1.0;
  }
  auto rows = [&] {
    std::vector<RowChoice> r(S);
    for (int64_t s = 0; s < S; ++s) {
      r[s].params = &params[s];
      r[s].rng = SplitMix64(100 + static_cast<uint64_t>(s));
    }
    return r;
  };
  kernels::SpinningTeam team(2);
  const kernels::SpinningTeam::Scope hot(team);
  std::vector<RowChoice> narrow = rows(), wide = rows(), other = rows();
  ChooseTokens(z_SV.data_ptr<float>(), V, narrow);
  ChooseTokens(wide_SV.data_ptr<double>(), V, wide);
  // Control: the logits of the next row.
  const at::Tensor rolled_SV = wide_SV.roll(1, 0).contiguous();
  ChooseTokens(rolled_SV.data_ptr<double>(), V, other);
  int64_t differ = 0;
  for (int64_t s = 0; s < S; ++s) {
    EXPECT_EQ(narrow[s].choice.token, wide[s].choice.token) << s;
    EXPECT_EQ(narrow[s].choice.logprob, wide[s].choice.logprob) << s;
    EXPECT_EQ(narrow[s].rng.Next(), wide[s].rng.Next()) << s;
    differ += other[s].choice.logprob != wide[s].choice.logprob;
  }
  EXPECT_EQ(differ, S);
}

}  // namespace
}  // namespace tinkerd::testing
