// shard_memory_bench: what a rank holds and how long a step takes when full fine-tuning runs
// data-parallel, with replicas (--shard=none) against sharded optimizer state (--shard=optimizer)
// and sharded parameters (--shard=full), at several world sizes, on real processes over Gloo
// (loopback). A sharding ending in "_serial" is the same without --prefetch_layers (each layer
// gathered when it is needed, not while the one before it computes).
//   shard_memory_bench [--worlds=1,2,4] [--steps=3] [--hidden=1024 ...] [--out_dir=DIR]
// The driver writes the model once, then for each world size and sharding runs that many copies
// of itself as ranks (torchrun's environment) and prints a markdown row:
//   state: resident memory a rank gained when the model was created (parameters, gradient sums
//          and moments, zero-filled, so every page is touched), the largest over ranks;
//   peak:  the resident set's peak over the steps, above what it was before the model existed
//          (state plus a step's transients: activations, the staged gradient, collectives);
//   step:  the median step (forward_backward of the batch + optim_step) on rank 0;
//   collective: the bytes rank 0 handed per step to the collectives that scale with the model
//          (world size 1 hands them too: its collectives are the identity);
//   resume: the resident set's peak while a second model is made from a checkpoint of the first
//          (CreateModelFromState, with the moments), above what it was before: the new model's
//          state plus what the read holds (a sharded model reads its slices only);
//   save:  the resident set's peak while the model is saved (SaveState, the moments with it),
//          above what it was before, the largest over ranks;
//   freeze: a sampler's copy of the model (FreezePolicy, on every rank as the server's command
//          runs it): the resident set's peak above what it was before, on rank 0 (which keeps
//          the copy) and the largest on the others (a sharded model's gathers only), and rank 0's
//          time.
// With --lora_rank=R the model is a LoRA adapter of that rank instead, and the runs compare the
// frozen base whole on every rank (--shard=full) against the base in slices (--shard=full
// --shard_base, "base" in the table): per rank the resident memory the base took at load, what
// the load read (/proc/self/io's rchar) and its peak above what the process held before, the
// model's state, the peak over the steps, the step and the collectives' bytes, and a merged
// sampler export (SaveWeightsForSampler, merged): rank 0's peak above what it held before, the
// largest other rank's, and rank 0's time (no save, resume or freeze: sampling a sharded base is
// not built).
// Not part of the test suite: it asserts nothing beyond "every call succeeded".
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/rss.h"
#include "runner/dist/c10d_collectives.h"
#include "runner/dist/dist_config.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/util/log.h"
#include "runner/util/rng.h"

ABSL_FLAG(std::string, out_dir, "/tmp/tinkerd_shard_bench", "model and per-rank results");
ABSL_FLAG(std::string, worlds, "1,2,4", "world sizes to run");
ABSL_FLAG(int, steps, 3, "steps per configuration (the median is reported)");
ABSL_FLAG(int, num_seqs, 4, "sequences per step");
ABSL_FLAG(int, seq_len, 256, "tokens per sequence");
ABSL_FLAG(int, threads, 1, "intra-op threads per rank");
ABSL_FLAG(int64_t, hidden, 1024, "hidden size");
ABSL_FLAG(int64_t, intermediate, 2816, "MLP intermediate size");
ABSL_FLAG(int64_t, layers, 4, "decoder layers");
ABSL_FLAG(int64_t, heads, 16, "attention heads");
ABSL_FLAG(int64_t, kv_heads, 4, "key/value heads");
ABSL_FLAG(int64_t, vocab, 32000, "vocabulary size");
ABSL_FLAG(int64_t, lora_rank, 0, "0: full fine-tuning; else a LoRA model of this rank");
// Set by the driver on the copies it starts.
ABSL_FLAG(std::string, rank_shard, "", "internal: run as one rank with this sharding");

namespace tinkerd::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string ModelDir() {
  return absl::GetFlag(FLAGS_out_dir) + "/model";
}

std::string ResultPath(int world, const std::string& shard, int rank) {
  return absl::StrCat(absl::GetFlag(FLAGS_out_dir), "/result.", world, ".", shard, ".", rank);
}

// Forwards to the real collectives and counts the bytes this rank hands to the ones that scale
// with the model: the gradient all-reduce, the reduce-scatter and the all-gather (payload, not wire
// traffic: a ring all-reduce sends about twice its payload, a reduce-scatter or all-gather once).
class CountingCollectives final : public Collectives {
 public:
  // `total`: where the bytes are counted (a subgroup's in its world's); null: in `bytes`.
  explicit CountingCollectives(std::shared_ptr<Collectives> inner,
                               std::atomic<int64_t>* total = nullptr)
      : inner_(std::move(inner)), total_(total != nullptr ? total : &bytes) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllReduceSumGradients(std::vector<at::Tensor>& grads) override {
    for (const at::Tensor& g : grads) *total_ += static_cast<int64_t>(g.nbytes());
    return inner_->AllReduceSumGradients(grads);
  }
  absl::Status ReduceScatterSum(const at::Tensor& in_WK, at::Tensor& out_K) override {
    *total_ += static_cast<int64_t>(in_WK.nbytes());
    return inner_->ReduceScatterSum(in_WK, out_K);
  }
  absl::Status AllGather(const at::Tensor& in_K, at::Tensor& out_WK) override {
    *total_ += static_cast<int64_t>(out_WK.nbytes());
    return inner_->AllGather(in_K, out_WK);
  }
  absl::Status AllReduceSumCounts(std::vector<int64_t>& counts) override {
    return inner_->AllReduceSumCounts(counts);
  }
  absl::Status AllAgree(bool& ok) override { return inner_->AllAgree(ok); }
  absl::Status AllReduceSumDoubles(std::vector<double>& values) override {
    return inner_->AllReduceSumDoubles(values);
  }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) override {
    return inner_->AllGatherBytes(mine);
  }
  absl::Status BroadcastBytes(std::string& bytes_, int root) override {
    return inner_->BroadcastBytes(bytes_, root);
  }
  absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& in_ND,
                                      const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows) override {
    return inner_->AllToAll(in_ND, send_rows, recv_rows);
  }
  absl::StatusOr<std::shared_ptr<Collectives>> Subgroup(const std::vector<int>& ranks) override {
    auto group = inner_->Subgroup(ranks);
    if (!group.ok()) return group.status();
    return std::shared_ptr<Collectives>(std::make_shared<CountingCollectives>(*group, total_));
  }
  std::atomic<int64_t> bytes{0};  // the prefetch thread's gathers count here too

 private:
  std::shared_ptr<Collectives> inner_;
  std::atomic<int64_t>* total_;
};

int Fail(const char* what, const absl::Status& st) {
  std::fprintf(stderr, "shard_memory_bench: %s: %s\n", what, std::string(st.message()).c_str());
  return 1;
}

int RunRank(const std::string& shard_name) {
  auto dist = DistConfigFromEnv();
  if (!dist.ok()) return Fail("environment", dist.status());
  dist->timeout = std::chrono::seconds(600);
  InitLogging(dist->rank, spdlog::level::warn);
  auto c10d = MakeC10dCollectives(*dist);
  if (!c10d.ok()) return Fail("rendezvous", c10d.status());
  // "_serial": the same without prefetching the next layer's gather.
  const bool serial = absl::EndsWith(shard_name, "_serial");
  const std::string mode = serial ? shard_name.substr(0, shard_name.size() - 7) : shard_name;
  const bool shard_base = mode == "base";
  auto shard = ParseShardMode(shard_base ? "full" : mode);
  if (!shard.ok()) return Fail("--rank_shard", shard.status());
  RunnerConfig rc;
  rc.base_model_path = ModelDir();
  rc.num_threads = absl::GetFlag(FLAGS_threads);
  rc.micro_batch_tokens = absl::GetFlag(FLAGS_num_seqs) * absl::GetFlag(FLAGS_seq_len);
  auto counting = std::make_shared<CountingCollectives>(*c10d);
  rc.collectives = counting;
  rc.shard = *shard;
  rc.shard_base = shard_base;
  rc.prefetch_layers = !serial;
  malloc_trim(0);
  const double before_load = RssMB(), read_before = ReadMB();
  ResetPeakRss();
  auto runner = ModelRunner::Create(rc);
  if (!runner.ok()) return Fail("load", runner.status());
  ModelRunner& r = **runner;
  const double load_peak = PeakRssSinceResetMB() - before_load, read = ReadMB() - read_before;
  malloc_trim(0);
  const double base_mb = RssMB() - before_load;
  const int64_t lora_rank = absl::GetFlag(FLAGS_lora_rank);

  // Freed pages of the load (file buffers, conversions) go back to the kernel first, so that the
  // model's state cannot hide in them.
  malloc_trim(0);
  const double before = RssMB();
  ResetPeakRss();
  CreateModelOptions full;
  full.lora.reset();  // full fine-tuning
  if (lora_rank > 0) full.lora = LoraConfig{lora_rank, static_cast<double>(lora_rank)};
  auto id = r.CreateModel(full);
  if (!id.ok()) return Fail("create_model", id.status());
  const double state = RssMB() - before;

  SplitMix64 g(7);
  std::vector<double> step_s;
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    std::vector<Datum> data;
    for (int i = 0; i < absl::GetFlag(FLAGS_num_seqs); ++i) {
      Datum d;
      for (int t = 0; t < absl::GetFlag(FLAGS_seq_len); ++t) {
        d.tokens.push_back(static_cast<int64_t>(g.Next() % absl::GetFlag(FLAGS_vocab)));
      }
      std::vector<int64_t> targets(d.tokens.begin() + 1, d.tokens.end());
      targets.push_back(d.tokens.front());
      d.loss_fn_inputs["target_tokens"] = TensorData::Int64(std::move(targets));
      d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(d.tokens.size(), 1.0f));
      data.push_back(std::move(d));
    }
    const auto t0 = Clock::now();
    auto fb = r.ForwardBackward(*id, data, "cross_entropy", {});
    if (!fb.ok()) return Fail("forward_backward", fb.status());
    AdamParams adam;
    adam.learning_rate = 1e-5;
    auto os = r.OptimStep(*id, adam);
    if (!os.ok()) return Fail("optim_step", os.status());
    step_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double collective_mb_per_step =
      static_cast<double>(counting->bytes) / (1 << 20) / absl::GetFlag(FLAGS_steps);
  std::sort(step_s.begin(), step_s.end());
  const double peak = PeakRssSinceResetMB() - before;
  if (lora_rank > 0) {
    malloc_trim(0);
    const double before_export = RssMB();
    ResetPeakRss();
    const auto t0 = Clock::now();
    const absl::Status exported = r.SaveWeightsForSampler(
        *id,
        absl::StrCat(absl::GetFlag(FLAGS_out_dir), "/export.", dist->world_size, ".", shard_name),
        /*merged=*/true, /*overwrite=*/true);
    if (!exported.ok()) return Fail("save_weights_for_sampler", exported);
    const double export_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double export_peak = PeakRssSinceResetMB() - before_export;
    std::ofstream out(ResultPath(dist->world_size, shard_name, dist->rank));
    out << state << " " << peak << " " << step_s[step_s.size() / 2] << " " << collective_mb_per_step
        << " 0 " << export_peak << " " << export_s << " 0 " << base_mb << " " << read << " "
        << load_peak << "\n";
    return out.good() ? 0 : 1;
  }

  const std::string checkpoint =
      absl::StrCat(absl::GetFlag(FLAGS_out_dir), "/ckpt.", dist->world_size, ".", shard_name);
  SaveStateOptions overwrite;
  overwrite.overwrite = true;
  malloc_trim(0);
  const double before_save = RssMB();
  ResetPeakRss();
  if (auto st = r.SaveState(*id, checkpoint, overwrite); !st.ok()) return Fail("save_state", st);
  const double save = PeakRssSinceResetMB() - before_save;
  malloc_trim(0);
  const double before_resume = RssMB();
  ResetPeakRss();
  auto resumed = r.CreateModelFromState(checkpoint, /*with_optimizer=*/true);
  if (!resumed.ok()) return Fail("create_model_from_state", resumed.status());
  const double resume = PeakRssSinceResetMB() - before_resume;
  if (auto st = r.DeleteModel(*resumed); !st.ok()) return Fail("delete_model", st);

  // Every rank freezes, as the server's replicated command has them: a sharded model's copy is
  // gathered for rank 0 (the others take part and keep nothing); a replica's is rank 0's own.
  malloc_trim(0);
  const double before_freeze = RssMB();
  ResetPeakRss();
  const auto f0 = Clock::now();
  auto policy = r.FreezePolicy(*id);
  if (!policy.ok()) return Fail("freeze", policy.status());
  const double freeze_s = std::chrono::duration<double>(Clock::now() - f0).count();
  const double freeze = PeakRssSinceResetMB() - before_freeze;

  std::ofstream out(ResultPath(dist->world_size, shard_name, dist->rank));
  out << state << " " << peak << " " << step_s[step_s.size() / 2] << " " << collective_mb_per_step
      << " " << resume << " " << freeze << " " << freeze_s << " " << save << "\n";
  return out.good() ? 0 : 1;
}

// Starts `world` ranks of this binary and waits for them; false if any failed.
bool RunJob(int world, const std::string& shard, char* self) {
  const int port = FreeLoopbackPort();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      SetLocalRankEnvironment(rank, world, port);
      std::vector<std::string> args{self, "--rank_shard=" + shard};
      for (const char* f :
           {"out_dir", "steps", "num_seqs", "seq_len", "threads", "vocab", "lora_rank"}) {
        args.push_back(absl::StrCat("--", f, "=", absl::FindCommandLineFlag(f)->CurrentValue()));
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

int Drive(char* self) {
  TinyModelSpec spec;
  spec.config = TinyConfig("llama");
  spec.config.vocab_size = absl::GetFlag(FLAGS_vocab);
  spec.config.hidden_size = absl::GetFlag(FLAGS_hidden);
  spec.config.intermediate_size = absl::GetFlag(FLAGS_intermediate);
  spec.config.num_hidden_layers = absl::GetFlag(FLAGS_layers);
  spec.config.num_attention_heads = absl::GetFlag(FLAGS_heads);
  spec.config.num_key_value_heads = absl::GetFlag(FLAGS_kv_heads);
  spec.config.head_dim = absl::GetFlag(FLAGS_hidden) / absl::GetFlag(FLAGS_heads);
  spec.config.max_position_embeddings = 2048;
  spec.config.tie_word_embeddings = false;
  if (auto st = WriteTinyModel(ModelDir(), spec); !st.ok()) return Fail("write model", st);
  std::printf("model: %s\n", spec.config.DebugString().c_str());
  const bool lora = absl::GetFlag(FLAGS_lora_rank) > 0;
  if (lora) {
    std::printf(
        "| ranks | shard | base per rank MB | load read per rank MB | load peak per rank MB | "
        "state per rank MB | peak per rank MB | step s | collective MB | merged export: rank 0 "
        "peak MB | other ranks' peak MB | export s |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  } else {
    std::printf(
        "| ranks | shard | state per rank MB | peak per rank MB | step s | collective MB | resume "
        "peak per rank MB | sampler freeze: rank 0 peak MB | other ranks' peak MB | freeze s | "
        "save peak per rank MB |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_worlds), ',')) {
    int world = 0;
    if (!absl::SimpleAtoi(w, &world) || world < 1) return 2;
    const std::vector<std::string> shards =
        lora ? std::vector<std::string>{"full", "base", "base_serial"}
             : std::vector<std::string>{"none", "optimizer", "full", "full_serial"};
    for (const std::string& shard : shards) {
      if (!RunJob(world, shard, self)) {
        std::fprintf(stderr, "shard_memory_bench: a rank failed (world %d, %s)\n", world,
                     shard.c_str());
        return 1;
      }
      double state = 0, peak = 0, step = 0, traffic = 0, resume = 0, freeze0 = 0, freeze_others = 0,
             freeze_s = 0, save = 0, base = 0, read = 0, load_peak = 0;
      for (int rank = 0; rank < world; ++rank) {
        std::ifstream in(ResultPath(world, shard, rank));
        double s = 0, p = 0, t = 0, c = 0, l = 0, f = 0, fs = 0, v = 0, b = 0, rd = 0, lp = 0;
        in >> s >> p >> t >> c >> l >> f >> fs >> v >> b >> rd >> lp;
        base = std::max(base, b);
        read = std::max(read, rd);
        load_peak = std::max(load_peak, lp);
        state = std::max(state, s);
        peak = std::max(peak, p);
        resume = std::max(resume, l);
        save = std::max(save, v);
        if (rank == 0) {
          step = t;
          traffic = c;
          freeze0 = f;
          freeze_s = fs;
        } else {
          freeze_others = std::max(freeze_others, f);
        }
      }
      if (lora) {
        const std::string others = world > 1 ? absl::StrFormat("%.0f", freeze_others) : "-";
        std::printf(
            "| %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.0f | %.0f | %s | %.2f |\n",
            world, shard.c_str(), base, read, load_peak, state, peak, step, traffic, freeze0,
            others.c_str(), freeze_s);
        std::fflush(stdout);
        continue;
      }
      const std::string others = world > 1 ? absl::StrFormat("%.0f", freeze_others) : "-";
      std::printf("| %d | %s | %.0f | %.0f | %.2f | %.0f | %.0f | %.0f | %s | %.2f | %.0f |\n",
                  world, shard.c_str(), state, peak, step, traffic, resume, freeze0, others.c_str(),
                  freeze_s, save);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace tinkerd::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string shard = absl::GetFlag(FLAGS_rank_shard);
  return shard.empty() ? tinkerd::bench::Drive(argv[0]) : tinkerd::bench::RunRank(shard);
}
