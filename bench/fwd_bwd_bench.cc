// fwd_bwd_bench: training throughput of the runner (ForwardBackward + OptimStep) on a Llama-style
// model of a few tens of millions of parameters and a long-tailed, RL-like batch of sequences, with
// model FLOPs utilization (MFU) against a matrix-multiply rate measured in the same process.
//
// It also writes the model (--out_dir/model) and the batch (--out_dir/batch.bin) so that
// bench/torch_eager.py trains the very same model on the very same tokens in PyTorch eager; see
// bench/README.md for the FLOP convention and bench/run_fwd_bwd.sh for the whole comparison.
//
// Not part of the test suite: it asserts nothing beyond "every call succeeded".
//
// Batch file (all integers int64 little-endian):
//   bytes 0..7   magic "TKDBATCH"
//   int64        version (= 1)
//   int64        count N
//   N times:     int64 L, then L tokens, then L targets  (targets[t] is what tokens[..t] predicts)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#ifdef TINKERD_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "bench/rss.h"
#include "bench/trace.h"
#include "runner/dist/c10d_collectives.h"
#include "runner/dist/dist_config.h"
#include "runner/model/config.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/runner_config.h"
#include "runner/types.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "runner/util/rng.h"

namespace {

// The batch file is written with the host's byte order; the Python side reads little-endian.
static_assert(std::endian::native == std::endian::little, "batch.bin is defined little-endian");

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---------------------------------------------------------------------------------------------
// Flags. Parsed by hand (--name=value or --name value) so that the benchmark needs nothing beyond
// what the runner library already links.

struct Flags {
  std::string out_dir = "/tmp/tinkerd_fwd_bwd";
  // Model: ~26M parameters (17.7M in the decoder layers, 4.2M each in embedding and lm_head).
  int64_t vocab = 8192;
  int64_t hidden = 512;
  int64_t intermediate = 1408;
  int64_t layers = 6;
  int64_t heads = 8;
  int64_t kv_heads = 4;
  int64_t head_dim = 64;
  int64_t max_pos = 2048;
  uint64_t model_seed = 0;
  // > 0: a mixture of experts in Mixtral's layout, every layer routing each token to top_k of
  // `experts` SwiGLU experts of size --intermediate.
  int64_t experts = 0;
  int64_t top_k = 2;
  // Batch: stratified log-uniform lengths in [min_len, max_len]. The default of 12 sequences is
  // ~5k tokens and ~0.7 TFLOP per step, sized so that this program plus both eager modes finish
  // in about ten minutes on 2 cores; raise --num_seqs for a steadier number on a bigger machine.
  int64_t num_seqs = 12;
  int64_t min_len = 16;
  int64_t max_len = 2048;
  uint64_t seed = 1234;
  // Runner.
  int64_t micro_batch_tokens = 4096;
  int64_t num_threads = 2;  // 0 keeps LibTorch's default
  int64_t lora_rank = 32;
  double lora_alpha = 32;
  int64_t full_finetune = 0;  // 1: train every weight instead of a LoRA adapter
  std::string device = "cpu";
  std::string compute_dtype = "float32";
  std::string stored_dtype = "float32";  // of the written model's weights
  int64_t activation_checkpointing = 0;
  std::string shard = "none";  // none, optimizer or full (RunnerConfig::shard)
  // 1: the runner's collectives are c10d's in a world of one (NCCL on CUDA), so that the
  // data-parallel and sharded paths run on a single device; 0: no collectives at all.
  int64_t c10d = 0;
  int64_t warmup_steps = 1;
  int64_t steps = 3;
  std::string trace;  // set: one more step, untimed, under the profiler (bench/trace.h)
  // Matrix-multiply rate.
  int64_t matmul_n = 2048;
  int64_t matmul_reps = 5;
};

struct FlagDef {
  const char* name;
  const char* help;
  std::function<bool(std::string_view)> set;
  std::function<std::string()> get;
};

template <typename T>
FlagDef IntFlag(const char* name, T* v, const char* help) {
  return {name, help,
          [v](std::string_view s) {
            auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
            return ec == std::errc() && p == s.data() + s.size();
          },
          [v] { return std::to_string(*v); }};
}

FlagDef DoubleFlag(const char* name, double* v, const char* help) {
  return {name, help,
          [v](std::string_view s) {
            std::string str(s);
            char* end = nullptr;
            *v = std::strtod(str.c_str(), &end);
            return !str.empty() && end == str.c_str() + str.size();
          },
          [v] { return std::to_string(*v); }};
}

FlagDef StringFlag(const char* name, std::string* v, const char* help) {
  return {name, help,
          [v](std::string_view s) {
            *v = std::string(s);
            return true;
          },
          [v] { return *v; }};
}

std::vector<FlagDef> FlagTable(Flags* f) {
  return {
      StringFlag("out_dir", &f->out_dir, "where model/ and batch.bin are written"),
      IntFlag("vocab", &f->vocab, "vocabulary size"),
      IntFlag("hidden", &f->hidden, "hidden size"),
      IntFlag("intermediate", &f->intermediate, "MLP intermediate size"),
      IntFlag("layers", &f->layers, "decoder layers"),
      IntFlag("heads", &f->heads, "attention heads"),
      IntFlag("kv_heads", &f->kv_heads, "key/value heads (GQA)"),
      IntFlag("head_dim", &f->head_dim, "per-head dimension"),
      IntFlag("max_pos", &f->max_pos, "max_position_embeddings"),
      IntFlag("model_seed", &f->model_seed, "seed of the random base weights"),
      IntFlag("experts", &f->experts,
              "experts per layer (Mixtral layout, --intermediate each); 0: a dense model"),
      IntFlag("top_k", &f->top_k, "experts per token, with --experts"),
      IntFlag("num_seqs", &f->num_seqs, "sequences per step"),
      IntFlag("min_len", &f->min_len, "shortest sequence"),
      IntFlag("max_len", &f->max_len, "longest sequence (<= max_pos)"),
      IntFlag("seed", &f->seed, "seed of lengths and tokens"),
      IntFlag("micro_batch_tokens", &f->micro_batch_tokens, "runner micro-batch token budget"),
      IntFlag("num_threads", &f->num_threads, "intra-op threads (0: LibTorch default)"),
      IntFlag("lora_rank", &f->lora_rank, "LoRA rank (attn + mlp, no unembed)"),
      DoubleFlag("lora_alpha", &f->lora_alpha, "LoRA alpha"),
      IntFlag("full_finetune", &f->full_finetune, "1: full fine-tuning instead of LoRA"),
      StringFlag("device", &f->device, "cpu, cuda or cuda:N"),
      StringFlag("compute_dtype", &f->compute_dtype, "float32, bfloat16, float16 or float64"),
      StringFlag("stored_dtype", &f->stored_dtype,
                 "dtype of the written model's weights: float32, bfloat16, float16 or float64"),
      IntFlag("activation_checkpointing", &f->activation_checkpointing,
              "1: recompute each decoder layer in backward"),
      StringFlag("shard", &f->shard,
                 "none, optimizer (sharded gradient sums and moments) or full (and parameters)"),
      IntFlag("c10d", &f->c10d, "1: c10d collectives in a world of one (NCCL on CUDA)"),
      IntFlag("warmup_steps", &f->warmup_steps, "untimed steps first"),
      IntFlag("steps", &f->steps, "timed steps (median reported)"),
      StringFlag("trace", &f->trace,
                 "Chrome trace of one more step, after the timed ones (empty: none)"),
      IntFlag("matmul_n", &f->matmul_n, "size n of the n x n x n matmul probe (compute dtype)"),
      IntFlag("matmul_reps", &f->matmul_reps, "matmul probe repetitions (best taken)"),
  };
}

void PrintUsage(const std::vector<FlagDef>& table) {
  std::printf("usage: fwd_bwd_bench [--flag=value ...]\n");
  for (const auto& d : table) {
    std::printf("  --%-20s %s (default %s)\n", d.name, d.help, d.get().c_str());
  }
}

// Returns false (after printing why) on an unknown flag or a malformed value.
bool ParseFlags(int argc, char** argv, Flags* flags, bool* help) {
  auto table = FlagTable(flags);
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintUsage(table);
      *help = true;
      return true;
    }
    if (arg.substr(0, 2) != "--") {
      std::fprintf(stderr, "unexpected argument '%s'\n", argv[i]);
      return false;
    }
    arg.remove_prefix(2);
    std::string_view name = arg, value;
    bool has_value = false;
    if (auto eq = arg.find('='); eq != std::string_view::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    auto it =
        std::find_if(table.begin(), table.end(), [&](const FlagDef& d) { return name == d.name; });
    if (it == table.end()) {
      std::fprintf(stderr, "unknown flag --%.*s (try --help)\n", static_cast<int>(name.size()),
                   name.data());
      return false;
    }
    if (!has_value) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "flag --%s needs a value\n", it->name);
        return false;
      }
      value = argv[++i];
    }
    if (!it->set(value)) {
      std::fprintf(stderr, "bad value '%.*s' for --%s\n", static_cast<int>(value.size()),
                   value.data(), it->name);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Batch.

struct Sequence {
  std::vector<int64_t> tokens;
  std::vector<int64_t> targets;
};

// Lengths: sequence i draws from the i-th of N equal-probability slices of the log-uniform
// distribution on [min_len, max_len], then the order is shuffled. Log-uniform gives the RL-like
// shape (median ~180 of 16..2048, a long tail of long rollouts); stratifying makes a batch of only
// a dozen sequences still contain that tail, so the small default batch is representative and a
// different seed does not swing the step cost by 2x. The shuffle keeps long and short sequences
// interleaved, as rollouts arrive, so the padded baseline is not handed a pre-sorted batch.
std::vector<Sequence> MakeBatch(const Flags& f) {
  tinkerd::SplitMix64 len_rng(tinkerd::MixSeed(f.seed, "lengths"));
  tinkerd::SplitMix64 tok_rng(tinkerd::MixSeed(f.seed, "tokens"));
  const double lo = std::log(static_cast<double>(f.min_len));
  const double hi = std::log(static_cast<double>(f.max_len) + 1.0);
  std::vector<int64_t> lengths(f.num_seqs);
  for (int64_t i = 0; i < f.num_seqs; ++i) {
    double u = (static_cast<double>(i) + len_rng.Uniform()) / static_cast<double>(f.num_seqs);
    auto len = static_cast<int64_t>(std::floor(std::exp(lo + u * (hi - lo))));
    lengths[i] = std::clamp(len, f.min_len, f.max_len);
  }
  for (int64_t i = f.num_seqs - 1; i > 0; --i) {  // Fisher-Yates
    auto j = static_cast<int64_t>(len_rng.Next() % static_cast<uint64_t>(i + 1));
    std::swap(lengths[i], lengths[j]);
  }
  std::vector<Sequence> batch;
  batch.reserve(lengths.size());
  for (int64_t len : lengths) {
    // One stream of len+1 uniform tokens; the targets are the stream shifted by one, exactly as a
    // causal LM sees a document. Uniform tokens make the loss ~ln(vocab), which is all we need.
    std::vector<int64_t> stream(len + 1);
    for (auto& t : stream)
      t = static_cast<int64_t>(tok_rng.Next() % static_cast<uint64_t>(f.vocab));
    Sequence s;
    s.tokens.assign(stream.begin(), stream.end() - 1);
    s.targets.assign(stream.begin() + 1, stream.end());
    batch.push_back(std::move(s));
  }
  return batch;
}

absl::Status WriteBatch(const std::string& path, const std::vector<Sequence>& batch) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError("cannot open " + path);
  auto put = [&](int64_t v) { out.write(reinterpret_cast<const char*>(&v), sizeof(v)); };
  out.write("TKDBATCH", 8);
  put(1);
  put(static_cast<int64_t>(batch.size()));
  for (const auto& s : batch) {
    put(static_cast<int64_t>(s.tokens.size()));
    out.write(reinterpret_cast<const char*>(s.tokens.data()),
              static_cast<std::streamsize>(s.tokens.size() * sizeof(int64_t)));
    out.write(reinterpret_cast<const char*>(s.targets.data()),
              static_cast<std::streamsize>(s.targets.size() * sizeof(int64_t)));
  }
  out.close();
  if (!out) return absl::InternalError("short write to " + path);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// FLOP accounting (bench/README.md, "FLOP convention"; torch_eager.py computes the same numbers).

struct FlopCount {
  int64_t total_params = 0;  // every base weight, embedding included
  int64_t matmul_params =
      0;                    // weights used as matmul operands per token: layers' linears + lm_head
  int64_t lora_params = 0;  // adapter parameters on q,k,v,o,gate,up,down
  double linear_flops = 0;  // per step: 4·matmul_params·T + 6·(active lora params)·T
  double attn_flops = 0;    // per step: 12·layers·heads·head_dim·Σ L_i²
  double Total() const { return linear_flops + attn_flops; }
};

FlopCount CountFlops(const tinkerd::ModelConfig& c, int64_t rank, bool full_finetune,
                     const std::vector<Sequence>& batch) {
  const int64_t D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  // A mixture of experts (every layer routing, as --experts writes it) counts what a token uses:
  // its top_k experts and the router. Dense: one "expert" and no router.
  const int64_t E = std::max<int64_t>(c.moe.num_experts, 1);
  const int64_t k = c.moe.num_experts > 0 ? c.moe.top_k : 1;
  const int64_t router = c.moe.num_experts * D;
  const int64_t attn_linear = D * q + 2 * D * kv + q * D;
  const int64_t per_layer_linear = attn_linear + k * 3 * D * I + router;
  FlopCount f;
  // The lm_head matmul costs V·D per token whether or not it is tied to the embedding.
  f.matmul_params = c.num_hidden_layers * per_layer_linear + V * D;
  f.total_params = V * D + (c.tie_word_embeddings ? 0 : V * D) +
                   c.num_hidden_layers * (attn_linear + E * 3 * D * I + router + 2 * D) + D +
                   (c.attention_bias ? c.num_hidden_layers * (q + 2 * kv) : 0);
  // A rank-r adapter on a d_in -> d_out linear holds r·(d_in + d_out) parameters; every expert
  // holds its own, and a token trains its top_k experts'.
  const int64_t attn_lora = (D + q) + 2 * (D + kv) + (q + D), mlp_lora = 2 * (D + I) + (I + D);
  f.lora_params = full_finetune ? 0 : c.num_hidden_layers * rank * (attn_lora + E * mlp_lora);
  const int64_t active_lora =
      full_finetune ? 0 : c.num_hidden_layers * rank * (attn_lora + k * mlp_lora);
  double tokens = 0, sum_sq = 0;
  for (const auto& s : batch) {
    auto L = static_cast<double>(s.tokens.size());
    tokens += L;
    sum_sq += L * L;
  }
  // Frozen base: forward 2·N·T plus the input-gradient matmul 2·N·T; no weight gradient, so 4·N·T
  // rather than the full-training 6·N·T. The adapters are trained: 6 FLOPs per parameter per token.
  // Full fine-tuning adds the weight-gradient matmul: 6·N·T.
  f.linear_flops = (full_finetune ? 6.0 : 4.0) * static_cast<double>(f.matmul_params) * tokens +
                   6.0 * static_cast<double>(active_lora) * tokens;
  // Per layer and sequence the forward does Q·Kᵀ and P·V, 2·L²·head_dim each per head; backward is
  // twice that. Counted over the full L×L square (the usual convention), not the causal half.
  f.attn_flops = 12.0 * static_cast<double>(c.num_hidden_layers) *
                 static_cast<double>(c.num_attention_heads * c.head_dim) * sum_sq;
  return f;
}

// Best-of-k rate of one fp32 n×n·n×n matmul on the current thread setting: the "peak" that the
// MFU is measured against. Best, not median, because MFU should compare with what this machine's
// BLAS can actually sustain, not with a run disturbed by noise.
// Waits for queued device work; a no-op on the CPU.
void Sync(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// The best n×n×n matrix product rate in the compute dtype on the device, random operands.
double MeasureMatmulGflops(int64_t n, int64_t reps, at::ScalarType dtype, const at::Device& dev) {
  const at::TensorOptions to = at::TensorOptions().dtype(dtype).device(dev);
  at::Tensor a = at::randn({n, n}, to);
  at::Tensor b = at::randn({n, n}, to);
  at::Tensor c = at::empty({n, n}, to);
  at::mm_out(c, a, b);  // warm-up: BLAS thread pool start and packing buffers
  Sync(dev);
  double best = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    at::mm_out(c, a, b);
    Sync(dev);
    best = std::min(best, SecondsSince(t0));
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best /
         1e9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

using tinkerd::bench::PeakRssMB;
using tinkerd::bench::PeakRssSinceResetMB;
using tinkerd::bench::ResetPeakRss;

// The CUDA caching allocator's peak, from the matmul probe's end to the last training step.
void ResetPeakDeviceMemory(const at::Device& device) {
#ifdef TINKERD_BENCH_CUDA
  if (device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
#endif
}

double PeakDeviceMemoryMB(const at::Device& device) {
#ifdef TINKERD_BENCH_CUDA
  if (device.is_cuda()) {
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);
  }
#endif
  return 0.0;
}

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "fwd_bwd_bench: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

int Run(const Flags& f) {
  if (f.min_len < 1 || f.max_len < f.min_len || f.max_len > f.max_pos || f.num_seqs < 1 ||
      f.steps < 1 || f.warmup_steps < 0 || f.lora_rank < 1 || f.matmul_reps < 1) {
    std::fprintf(stderr,
                 "fwd_bwd_bench: need 1 <= min_len <= max_len <= max_pos, num_seqs >= 1, "
                 "steps >= 1, warmup_steps >= 0, lora_rank >= 1, matmul_reps >= 1\n");
    return 2;
  }
  tinkerd::InitLogging(0);
  if (f.num_threads > 0) at::set_num_threads(static_cast<int>(f.num_threads));

  // 1. The base model, from the ready-made Llama (or Mixtral) config with the sizes overridden.
  tinkerd::ModelConfig mc = tinkerd::TinyConfig(f.experts > 0 ? "mixtral" : "llama");
  if (f.experts > 0) {
    mc.moe.num_experts = f.experts;
    mc.moe.top_k = f.top_k;
    mc.moe.expert_intermediate_size = f.intermediate;
    mc.moe.layer_routes.assign(static_cast<size_t>(f.layers), true);
  }
  mc.vocab_size = f.vocab;
  mc.hidden_size = f.hidden;
  mc.intermediate_size = f.intermediate;
  mc.num_hidden_layers = f.layers;
  mc.num_attention_heads = f.heads;
  mc.num_key_value_heads = f.kv_heads;
  mc.head_dim = f.head_dim;
  mc.max_position_embeddings = f.max_pos;
  mc.tie_word_embeddings = false;
  mc.torch_dtype = "float32";
  const std::string model_dir = f.out_dir + "/model";
  std::error_code ec;
  std::filesystem::create_directories(model_dir, ec);
  if (ec) return Fail("create " + model_dir, absl::InternalError(ec.message()));
  tinkerd::TinyModelSpec spec;
  spec.config = mc;
  spec.seed = f.model_seed;
  spec.stored_dtype = f.stored_dtype;
  auto t_write = Clock::now();
  if (auto st = tinkerd::WriteTinyModel(model_dir, spec); !st.ok()) return Fail("write model", st);
  std::printf("model: %s (written in %.1f s)\n", mc.DebugString().c_str(), SecondsSince(t_write));

  // 2. The batch, also on disk for torch_eager.py.
  const std::vector<Sequence> batch = MakeBatch(f);
  const std::string batch_path = f.out_dir + "/batch.bin";
  if (auto st = WriteBatch(batch_path, batch); !st.ok()) return Fail("write batch", st);
  int64_t tokens_per_step = 0, longest = 0;
  for (const auto& s : batch) {
    tokens_per_step += static_cast<int64_t>(s.tokens.size());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(s.tokens.size()));
  }
  std::printf("batch: %lld sequences, %lld tokens, longest %lld -> %s\n",
              static_cast<long long>(batch.size()), static_cast<long long>(tokens_per_step),
              static_cast<long long>(longest), batch_path.c_str());

  // The runner's datums: cross_entropy with every weight 1, so the loss is Σ -logprob / T under the
  // model's default token_mean reduction, the same loss torch_eager.py uses.
  std::vector<tinkerd::Datum> data;
  data.reserve(batch.size());
  for (const auto& s : batch) {
    tinkerd::Datum d;
    d.tokens = s.tokens;
    d.loss_fn_inputs["target_tokens"] = tinkerd::TensorData::Int64(s.targets);
    d.loss_fn_inputs["weights"] =
        tinkerd::TensorData::Float32(std::vector<float>(s.tokens.size(), 1.0f));
    data.push_back(std::move(d));
  }

  // 3. The runner and one LoRA model (attn + mlp; lm_head frozen).
  tinkerd::RunnerConfig rc;
  rc.base_model_path = model_dir;
  auto dtype = tinkerd::ParseComputeDType(f.compute_dtype);
  if (!dtype.ok()) return Fail("compute_dtype", dtype.status());
  rc.compute_dtype = *dtype;
  rc.device = f.device;
  rc.activation_checkpointing = f.activation_checkpointing != 0;
  rc.micro_batch_tokens = f.micro_batch_tokens;
  rc.num_threads = static_cast<int>(f.num_threads);
  auto shard = tinkerd::ParseShardMode(f.shard);
  if (!shard.ok()) return Fail("shard", shard.status());
  rc.shard = *shard;
  if (f.c10d != 0) {
    tinkerd::DistConfig world_of_one;
    world_of_one.master_port = tinkerd::FreeLoopbackPort();
    tinkerd::C10dOptions c10d_options;
    c10d_options.cuda_gradients = at::Device(f.device).is_cuda();
    auto collectives = tinkerd::MakeC10dCollectives(world_of_one, c10d_options);
    if (!collectives.ok()) return Fail("c10d", collectives.status());
    rc.collectives = *std::move(collectives);
  }
  auto runner_or = tinkerd::ModelRunner::Create(rc);
  if (!runner_or.ok()) return Fail("ModelRunner::Create", runner_or.status());
  std::unique_ptr<tinkerd::ModelRunner> runner = std::move(runner_or).value();

  tinkerd::CreateModelOptions mo;
  tinkerd::LoraConfig lora;
  lora.rank = f.lora_rank;
  lora.alpha = f.lora_alpha;
  lora.train_attn = true;
  lora.train_mlp = true;
  lora.train_unembed = false;
  if (f.full_finetune == 0) mo.lora = lora;
  mo.loss_reduction = tinkerd::LossReduction::kTokenMean;
  mo.seed = 0;
  auto id_or = runner->CreateModel(mo);
  if (!id_or.ok()) return Fail("CreateModel", id_or.status());
  const std::string model_id = *id_or;

  FlopCount flops = CountFlops(mc, f.lora_rank, f.full_finetune != 0, batch);
  if (auto info = runner->GetInfo(model_id); info.ok()) {
    if (info->trainable_parameters != flops.lora_params) {
      std::printf("note: runner reports %lld trainable parameters, the FLOP count assumes %lld\n",
                  static_cast<long long>(info->trainable_parameters),
                  static_cast<long long>(flops.lora_params));
    }
  }

  // 4. The matmul rate, on the thread count the runner uses (the runner set it at Create too).
  if (f.num_threads > 0) at::set_num_threads(static_cast<int>(f.num_threads));
  const at::Device device(f.device);
  const at::ScalarType matmul_dtype = *dtype == tinkerd::ComputeDType::kBFloat16  ? at::kBFloat16
                                      : *dtype == tinkerd::ComputeDType::kFloat16 ? at::kHalf
                                      : *dtype == tinkerd::ComputeDType::kFloat64 ? at::kDouble
                                                                                  : at::kFloat;
  double matmul_gflops = MeasureMatmulGflops(f.matmul_n, f.matmul_reps, matmul_dtype, device);
  std::printf("matmul: %s %lldx%lldx%lld on %s, best of %lld: %.1f GFLOP/s (%d CPU threads)\n",
              f.compute_dtype.c_str(), static_cast<long long>(f.matmul_n),
              static_cast<long long>(f.matmul_n), static_cast<long long>(f.matmul_n),
              f.device.c_str(), static_cast<long long>(f.matmul_reps), matmul_gflops,
              at::get_num_threads());
  ResetPeakDeviceMemory(device);
  ResetPeakRss();

  // 5. Training steps: one ForwardBackward over the whole batch (the runner packs micro-batches
  // itself) and one OptimStep, exactly what a client's training step costs.
  const tinkerd::AdamParams adam;  // lr 1e-4, betas (0.9, 0.95), eps 1e-12, wd 0, no clipping
  std::vector<double> step_s, fb_s, optim_s;
  double first_loss = 0, last_loss = 0;
  for (int64_t step = 0; step < f.warmup_steps + f.steps; ++step) {
    auto t0 = Clock::now();
    auto fb = runner->ForwardBackward(model_id, data, "cross_entropy", {});
    if (!fb.ok()) return Fail("ForwardBackward", fb.status());
    const double t_fb = SecondsSince(t0);
    auto t1 = Clock::now();
    auto os = runner->OptimStep(model_id, adam);
    if (!os.ok()) return Fail("OptimStep", os.status());
    const double t_opt = SecondsSince(t1);
    const double t_step = SecondsSince(t0);
    // Mean token loss from the returned logprobs (every weight is 1).
    double nll = 0;
    for (const auto& out : fb->outputs) {
      for (float lp : out.logprobs) nll -= lp;
    }
    const double loss = nll / static_cast<double>(tokens_per_step);
    // Step 0 runs with the adapters' B = 0, i.e. the plain base model: torch_eager.py must print
    // the same first_loss, a cheap check that both sides train the same model on the same data.
    if (step == 0) first_loss = loss;
    last_loss = loss;
    const bool timed = step >= f.warmup_steps;
    std::printf(
        "step %lld%s: %.3f s (forward_backward %.3f s, optim_step %.3f s) loss %.6f "
        "%.0f tokens/s\n",
        static_cast<long long>(step), timed ? "" : " (warm-up)", t_step, t_fb, t_opt, loss,
        static_cast<double>(tokens_per_step) / t_step);
    if (timed) {
      step_s.push_back(t_step);
      fb_s.push_back(t_fb);
      optim_s.push_back(t_opt);
    }
  }

  // A second probe after training: the denominator is the best the machine showed in this run.
  const double peak_device_mb = PeakDeviceMemoryMB(device);
  matmul_gflops =
      std::max(matmul_gflops, MeasureMatmulGflops(f.matmul_n, f.matmul_reps, matmul_dtype, device));
  const double peak_rss_mb = PeakRssSinceResetMB();
  const double process_peak_rss_mb = PeakRssMB();
  // After the timed steps and the memory peaks, so that the profiler's overhead is in none of them.
  if (!f.trace.empty()) {
    const absl::Status st = tinkerd::bench::TraceStep(f.trace, device.is_cuda(), [&] {
      auto fb = runner->ForwardBackward(model_id, data, "cross_entropy", {});
      if (!fb.ok()) return fb.status();
      auto os = runner->OptimStep(model_id, adam);
      Sync(device);
      return os.ok() ? absl::OkStatus() : os.status();
    });
    // A diagnostic: its failure costs the trace, not the row's figures.
    if (st.ok()) {
      std::printf("trace of one step: %s (bench/trace_summary.py reads it)\n", f.trace.c_str());
    } else {
      std::printf("trace of one step: none: %s\n", st.ToString().c_str());
    }
  }
  std::printf(
      "memory: peak RSS over the training steps %.0f MB (whole process, set-up included: "
      "%.0f MB), peak device allocation %.0f MB\n",
      peak_rss_mb, process_peak_rss_mb, peak_device_mb);

  const double step_med = Median(step_s);
  const double tokens_per_s = static_cast<double>(tokens_per_step) / step_med;
  const double achieved_gflops = flops.Total() / step_med / 1e9;
  const double mfu = achieved_gflops / matmul_gflops;
  std::printf(
      "runner: median step %.3f s (forward_backward %.3f s, optim_step %.3f s) over %lld "
      "steps: %.1f tokens/s, %.1f model GFLOP/s = %.1f%% of %.1f GFLOP/s matmul\n",
      step_med, Median(fb_s), Median(optim_s), static_cast<long long>(f.steps), tokens_per_s,
      achieved_gflops, 100.0 * mfu, matmul_gflops);
  std::printf(
      "flops per step: %.1f GFLOP (linear %.1f, attention %.1f); params %lld "
      "(matmul %lld, lora %lld)\n",
      flops.Total() / 1e9, flops.linear_flops / 1e9, flops.attn_flops / 1e9,
      static_cast<long long>(flops.total_params), static_cast<long long>(flops.matmul_params),
      static_cast<long long>(flops.lora_params));
  std::printf(
      "{\"bench\":\"runner\",\"mode\":\"runner\",\"tokens_per_s\":%.3f,\"step_s\":%.6f,"
      "\"forward_backward_s\":%.6f,\"optim_step_s\":%.6f,\"mfu\":%.6f,\"matmul_gflops\":%.3f,"
      "\"model_gflops_per_s\":%.3f,\"params\":%lld,\"matmul_params\":%lld,\"lora_params\":%lld,"
      "\"tokens_per_step\":%lld,\"sequences\":%lld,\"flops_per_step\":%.6e,"
      "\"attn_flops_per_step\":%.6e,\"first_loss\":%.8f,\"last_loss\":%.8f,\"threads\":%d,"
      "\"micro_batch_tokens\":%lld,\"steps\":%lld,\"warmup_steps\":%lld,"
      "\"peak_rss_mb\":%.1f,\"process_peak_rss_mb\":%.1f,\"peak_device_mb\":%.1f,\"device\":\"%s\","
      "\"compute_dtype\":\"%s\",\"blas_core\":\"%s\","
      "\"activation_checkpointing\":%lld,\"full_finetune\":%lld,\"shard\":\"%s\","
      "\"c10d\":%lld}\n",
      tokens_per_s, step_med, Median(fb_s), Median(optim_s), mfu, matmul_gflops, achieved_gflops,
      static_cast<long long>(flops.total_params), static_cast<long long>(flops.matmul_params),
      static_cast<long long>(flops.lora_params), static_cast<long long>(tokens_per_step),
      static_cast<long long>(batch.size()), flops.Total(), flops.attn_flops, first_loss, last_loss,
      at::get_num_threads(), static_cast<long long>(f.micro_batch_tokens),
      static_cast<long long>(f.steps), static_cast<long long>(f.warmup_steps), peak_rss_mb,
      process_peak_rss_mb, peak_device_mb, f.device.c_str(), f.compute_dtype.c_str(),
      tinkerd::BlasCore().c_str(), static_cast<long long>(f.activation_checkpointing),
      static_cast<long long>(f.full_finetune), f.shard.c_str(), static_cast<long long>(f.c10d));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  Flags flags;
  bool help = false;
  if (!ParseFlags(argc, argv, &flags, &help)) return 2;
  if (help) return 0;
  return Run(flags);
}
