// Data parallelism on real processes over Gloo (loopback): 2 and 3 ranks must end where one
// process ends, for every reduction mode, with calls, streams, packing, unequal lengths and a rank
// that gets no datum. Two deliberately broken reductions must be caught.
//
// Tolerance: the runs differ only in how float64 sums are grouped (per rank, then all-reduced).
// As in accumulation_test.cc, that moves gradients by ~1e-11 relative; through two AdamW steps of
// lr 1e-2 parameters move by at most lr·(relative change)·(a few) ≈ 1e-12. kTol = 1e-9 absolute on
// parameters and losses of O(1)–O(100). The broken controls are off by O(1e-3) or more.
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "runner/dist/dist_config.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kTol = 1e-9;

// Runs `world` ranks to completion; returns each rank's output doubles.
std::vector<std::vector<double>> RunRanks(const std::string& model, const std::string& out,
                                          int world, const std::string& broken = "none") {
  const int port = FreeLoopbackPort();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string a1 = "--model_dir=" + model, a2 = "--out=" + out, a3 = "--broken=" + broken;
      execl(DIST_WORKER_BINARY, "dist_worker", a1.c_str(), a2.c_str(), a3.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<std::vector<double>> results;
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    waitpid(pids[rank], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status;
    std::ifstream f(out + "." + std::to_string(rank), std::ios::binary);
    std::vector<double> v;
    double x;
    while (f.read(reinterpret_cast<char*>(&x), sizeof(x))) v.push_back(x);
    results.push_back(std::move(v));
  }
  return results;
}

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    model_ = new std::string(WriteModel(*dir_, TinyConfig("qwen3")));
    reference_ = new std::vector<double>(RunRanks(*model_, dir_->Sub("ref"), 1)[0]);
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete model_;
    delete dir_;
  }
  static TempDir* dir_;
  static std::string* model_;
  static std::vector<double>* reference_;
};
TempDir* DataParallel::dir_ = nullptr;
std::string* DataParallel::model_ = nullptr;
std::vector<double>* DataParallel::reference_ = nullptr;

TEST_F(DataParallel, TwoAndThreeRanksEqualOneProcess) {
  ASSERT_GT(reference_->size(), 1000u);
  for (int world : {2, 3}) {
    auto ranks = RunRanks(*model_, dir_->Sub("w" + std::to_string(world)), world);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference_->size()) << "world " << world << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], *reference_), kTol) << "world " << world << " rank " << r;
      EXPECT_EQ(ranks[r], ranks[0]) << "ranks must hold identical replicas";
    }
  }
}

TEST_F(DataParallel, ForgettingTheWorldSizeFactorIsCaught) {
  auto ranks = RunRanks(*model_, dir_->Sub("nofactor"), 2, "no_world_size_factor");
  ASSERT_EQ(ranks[0].size(), reference_->size());
  EXPECT_GT(MaxAbsDiff(ranks[0], *reference_), 1e3 * kTol);
}

// Rank 1's replica is perturbed at the first optimizer step (tests/faulty_collectives.h):
// every rank must fail that step with "diverged" (each worker exits 0 only then). The control is
// TwoAndThreeRanksEqualOneProcess, where the same comparison runs at every step and never fires.
TEST_F(DataParallel, ADivergedReplicaIsCaughtAtTheStep) {
  RunRanks(*model_, dir_->Sub("diverge"), 2, "diverge_rank1");
}

TEST_F(DataParallel, ReducingTheAccumulatorTwiceIsCaught) {
  auto ranks = RunRanks(*model_, dir_->Sub("twice"), 2, "reduce_twice");
  ASSERT_EQ(ranks[0].size(), reference_->size());
  EXPECT_GT(MaxAbsDiff(ranks[0], *reference_), 1e3 * kTol);
}

}  // namespace
}  // namespace tinkerd::testing
