// Helpers shared by the test suites: temp dirs, tiny models, random batches, state comparison.
#pragma once

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kernels/gemv.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/util/rng.h"

namespace tinkerd::testing {

// A directory removed at scope exit.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = (std::filesystem::temp_directory_path() /
             ("tinkerd-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++)))
                .string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string WriteModel(const TempDir& dir, const ModelConfig& config, uint64_t seed = 1,
                              const std::string& name = "model") {
  TinyModelSpec spec;
  spec.config = config;
  spec.seed = seed;
  // Larger than the usual 0.02 so logits vary enough for gradients to be well above rounding.
  spec.init_std = 0.2;
  const std::string out = dir.Sub(name);
  absl::Status st = WriteTinyModel(out, spec);
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// A byte-level BPE tokenizer.json for a model of `vocab` tokens, in the model's directory: token i
// is two letters (i/2 in base 26), after a space when i is odd, in GPT-2's byte-level alphabet
// ('Ġ' for the space). Every token is distinct, so a sample's text decodes unambiguously.
inline std::string TestTokenText(int64_t i) {
  const int64_t k = i / 2;
  return std::string(i % 2 ? " " : "") + static_cast<char>('a' + (k / 26) % 26) +
         static_cast<char>('a' + k % 26);
}
inline void WriteTokenizerJson(const std::string& model_dir, int64_t vocab) {
  std::string entries;
  for (int64_t i = 0; i < vocab; ++i) {
    const std::string text = TestTokenText(i);
    // "\u0120" is 'Ġ', the byte-level character of the space byte.
    const std::string token = text[0] == ' ' ? "\u0120" + text.substr(1) : text;
    entries += (i ? ",\"" : "\"") + token + "\":" + std::to_string(i);
  }
  std::ofstream(model_dir + "/tokenizer.json")
      << R"({"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": {)" << entries
      << R"(}, "merges": []}, "decoder": {"type": "ByteLevel"}})";
}

// The device the suites run the model on: $TINKERD_TEST_DEVICE ("cuda", "cuda:1"), else "cpu".
// On a GPU machine, `TINKERD_TEST_DEVICE=cuda ctest -L numerics` runs the numerics on the GPU
// against the same float64 host references.
inline std::string TestDevice() {
  const char* d = std::getenv("TINKERD_TEST_DEVICE");
  return d != nullptr && *d != '\0' ? d : "cpu";
}

// Whether float32 training on this test device rounds a row by the rows beside it: on the CPU
// where Gemv does not run (no AVX2). Where it runs, Gemv takes a float32 layer's products forward
// and its input gradients backward (kernels::RowProduct), each row's sums in an order the other
// rows never change, so a shared pass or a packing gives each datum its solo run's bits. Without
// it the products are the BLAS's, and OpenBLAS's AVX2 (Zen) kernels round a row by its neighbours
// (tests/kernels/mixed_grad_test.cc reports it): there the tests that compare float32 gradients
// bit for bit run in float64 to 1e-12 or skip (docs/sampling.md).
inline bool CpuFloat32RoundsByRows() {
  return TestDevice() == "cpu" && !kernels::GemvRunsHere();
}

inline std::unique_ptr<ModelRunner> MakeRunner(const std::string& model_dir,
                                               ComputeDType dtype = ComputeDType::kFloat64,
                                               int64_t micro_batch_tokens = 4096,
                                               ShardMode shard = ShardMode::kNone,
                                               int64_t memory_budget_bytes = 0,
                                               bool activation_checkpointing = false) {
  RunnerConfig rc;
  rc.memory_budget_bytes = memory_budget_bytes;  // 0: the default
  rc.activation_checkpointing = activation_checkpointing;
  rc.base_model_path = model_dir;
  rc.compute_dtype = dtype;
  rc.micro_batch_tokens = micro_batch_tokens;
  rc.shard = shard;
  rc.device = TestDevice();
  auto r = ModelRunner::Create(rc);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(*r) : nullptr;
}

// Random datums with the inputs `loss` needs. Some weights/advantages are zero (masked), and for
// cross_entropy some weights are negative or fractional, as Tinker allows.
inline std::vector<Datum> RandomData(SplitMix64& g, const std::vector<int>& lengths,
                                     const std::string& loss, int64_t vocab) {
  std::vector<Datum> out;
  for (int len : lengths) {
    Datum d;
    std::vector<int64_t> targets;
    std::vector<float> w, logq, adv;
    for (int t = 0; t < len; ++t) {
      d.tokens.push_back(static_cast<int64_t>(g.Next() % vocab));
      targets.push_back(static_cast<int64_t>(g.Next() % vocab));
      const bool prompt = t < len / 4;  // masked "prompt" tokens
      w.push_back(prompt ? 0.0f : static_cast<float>(g.Uniform(-0.5, 1.5)));
      adv.push_back(prompt ? 0.0f : static_cast<float>(g.Uniform(-1.0, 1.0)));
      logq.push_back(
          static_cast<float>(-std::log(static_cast<double>(vocab)) + g.Uniform(-0.6, 0.6)));
    }
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(targets);
    if (loss == "cross_entropy") {
      d.loss_fn_inputs["weights"] = TensorData::Float32(w);
    } else {
      d.loss_fn_inputs["advantages"] = TensorData::Float32(adv);
      d.loss_fn_inputs["logprobs"] = TensorData::Float32(logq);
    }
    if (loss == "gspo") {  // the sampled positions, as tinker-cookbook marks them
      std::vector<float> in_ratio;
      for (int t = 0; t < len; ++t) in_ratio.push_back(t < len / 4 ? 0.0f : 1.0f);
      d.loss_fn_inputs["sequence_ratio_mask"] = TensorData::Float32(in_ratio);
    }
    out.push_back(std::move(d));
  }
  return out;
}

// cross_entropy's top-K form, as tinker-cookbook's off-policy distillation sends it: [T, K]
// targets and weights (a teacher's top-K ids and probabilities), prompt rows all zero, and in
// each row a padded slot of weight 0 that repeats the row's first target.
inline std::vector<Datum> RandomTopKData(SplitMix64& g, const std::vector<int>& lengths, int64_t K,
                                         int64_t vocab) {
  std::vector<Datum> out;
  for (int len : lengths) {
    Datum d;
    std::vector<int64_t> targets;
    std::vector<float> w;
    for (int t = 0; t < len; ++t) {
      d.tokens.push_back(static_cast<int64_t>(g.Next() % vocab));
      const bool prompt = t < len / 4;
      for (int64_t k = 0; k < K; ++k) {
        const bool pad = k == K - 1;
        targets.push_back(pad ? targets[targets.size() - k]
                              : static_cast<int64_t>(g.Next() % vocab));
        w.push_back(prompt || pad ? 0.0f : static_cast<float>(g.Uniform(0.0, 1.0)));
      }
    }
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(targets);
    d.loss_fn_inputs["target_tokens"].shape = {len, K};
    d.loss_fn_inputs["weights"] = TensorData::Float32(w);
    d.loss_fn_inputs["weights"].shape = {len, K};
    out.push_back(std::move(d));
  }
  return out;
}

// Column k of top-K datums: [T] targets and weights, as a one-target cross_entropy call.
inline std::vector<Datum> TopKColumn(const std::vector<Datum>& data, int64_t k) {
  std::vector<Datum> out;
  for (const Datum& d : data) {
    const TensorData& t = d.loss_fn_inputs.at("target_tokens");
    const TensorData& w = d.loss_fn_inputs.at("weights");
    const int64_t K = t.shape[1];
    std::vector<int64_t> tk;
    std::vector<float> wk;
    for (int64_t p = k; p < t.NumElements(); p += K) {
      tk.push_back(t.int64_data[p]);
      wk.push_back(w.float32_data[p]);
    }
    Datum c;
    c.tokens = d.tokens;
    c.loss_fn_inputs["target_tokens"] = TensorData::Int64(tk);
    c.loss_fn_inputs["weights"] = TensorData::Float32(wk);
    out.push_back(std::move(c));
  }
  return out;
}

inline std::vector<NamedValues> Snap(ModelRunner& r, const std::string& id, StateKind kind) {
  auto s = r.Snapshot(id, kind);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? *s : std::vector<NamedValues>{};
}

// Flattens a snapshot into one vector (names sorted, so two snapshots line up).
inline std::vector<double> Flat(const std::vector<NamedValues>& s) {
  std::vector<double> v;
  for (const auto& n : s) v.insert(v.end(), n.values.begin(), n.values.end());
  return v;
}

inline double MaxAbs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

inline double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

inline std::vector<double> Scaled(std::vector<double> v, double s) {
  for (double& x : v) x *= s;
  return v;
}

// Limits this process's address space (RLIMIT_AS) to what it maps now and `extra` bytes more:
// an allocation past that fails, as under a container's limit. For a test's own process (a death
// test's child): there is no raising it again. False when the limit cannot be set.
inline bool LimitAddressSpace(int64_t extra) {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0;
  if (!(statm >> pages)) return false;
  const rlim_t bytes = static_cast<rlim_t>(pages * sysconf(_SC_PAGESIZE) + extra);
  const rlimit as{bytes, bytes};
  return setrlimit(RLIMIT_AS, &as) == 0;
}

inline std::vector<Datum> Slice(const std::vector<Datum>& d, size_t begin, size_t end) {
  return std::vector<Datum>(d.begin() + begin, d.begin() + end);
}

}  // namespace tinkerd::testing
