// Sampling throughput of the runner's engine (runner/sample/engine.h) on the bench model, for
// bench/run_sample.sh, which runs the PyTorch-eager KV-cache loop (torch_eager_decode.py) on the
// same model, prompts and threads:
//   decode   greedy tokens/s at each --batches size: B prompts of --prompt_len tokens decode
//            --max_tokens tokens each; decode time = T(max_tokens) - T(1), so the prefill (and
//            the first token, which it yields) is not counted;
//   ttft     time to the first token of one --ttft_prompt_len-token prompt;
//   beside   decode tokens/s and training tokens/s while a LoRA model trains on the same thread,
//            --beside_steps decode steps (default 1) between training calls, or as many as
//            fill --beside_share of the time, as the server's scheduler alternates them
//            (--sample_steps_between_jobs, --sample_share), against each alone.
// Writes the model (Hugging Face layout) and prompts.json under --out_dir, prints readable lines
// and one JSON line (starts with '{').
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "runner/model/config.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/runner_config.h"
#include "runner/sample/engine.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "runner/util/rng.h"

ABSL_FLAG(std::string, out_dir, "/tmp/tinkerd_sample", "where model/ and prompts.json go");
ABSL_FLAG(int64_t, vocab, 8192, "vocabulary size");
ABSL_FLAG(int64_t, hidden, 512, "hidden size");
ABSL_FLAG(int64_t, intermediate, 1408, "MLP intermediate size");
ABSL_FLAG(int64_t, layers, 6, "decoder layers");
ABSL_FLAG(int64_t, heads, 8, "attention heads");
ABSL_FLAG(int64_t, kv_heads, 4, "key/value heads");
ABSL_FLAG(int64_t, head_dim, 64, "per-head dimension");
ABSL_FLAG(int64_t, max_pos, 4096, "max_position_embeddings");
ABSL_FLAG(std::string, batches, "1,8,64", "decode batch sizes");
ABSL_FLAG(int64_t, prompt_len, 128, "prompt tokens of each decode sample");
ABSL_FLAG(int64_t, max_tokens, 64, "tokens decoded per sample");
ABSL_FLAG(int64_t, ttft_prompt_len, 2048, "prompt tokens of the time-to-first-token run");
ABSL_FLAG(int64_t, reps, 3, "timed repetitions (median)");
ABSL_FLAG(int64_t, beside_batch, 8, "decode batch while training runs beside it");
ABSL_FLAG(int64_t, beside_max_tokens, 16, "tokens per sample decoded beside training");
ABSL_FLAG(int64_t, beside_steps, 1,
          "decode steps between two training calls beside training (the server's "
          "--sample_steps_between_jobs)");
ABSL_FLAG(double, beside_share, 0.5,
          "sampling's share of the time beside training (the server's --sample_share): after a "
          "training call of d seconds, decode steps go on for d * share / (1 - share)");
ABSL_FLAG(int64_t, train_tokens, 256, "tokens per training call (4 sequences)");
ABSL_FLAG(int64_t, num_threads, 2, "intra-op threads");
ABSL_FLAG(std::string, compute_dtype, "float32",
          "the runner's compute dtype: float32, bfloat16, float16 or float64 (the eager side "
          "runs float32)");
ABSL_FLAG(int64_t, adapters, 8, "LoRA adapters decoded together (one sample each); 0: skip");
ABSL_FLAG(uint64_t, seed, 7, "seed of the weights and prompts");

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "sample_bench: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

using PolicyPtr = std::shared_ptr<const tinkerd::Policy>;

// Runs one greedy sample of `max_tokens` per prompt to completion, prompt i from policies[i]
// (policies[0] when there are fewer); returns seconds, and the tokens of every sample in `tokens`
// when given. `steady`, when given, gets the seconds after the first step (the prefill, the first
// token and one decode step): max_tokens - 2 decode steps timed alone, without the prefill's
// variance.
double Run(tinkerd::SampleEngine& engine, const std::vector<PolicyPtr>& policies,
           const std::vector<std::vector<int64_t>>& prompts, int64_t max_tokens,
           std::vector<std::vector<int64_t>>* tokens = nullptr, double* steady = nullptr) {
  std::vector<std::vector<int64_t>> out(prompts.size());
  const Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    tinkerd::SampleRequest r;
    r.prompt = prompts[i];
    r.params.max_tokens = max_tokens;
    r.params.temperature = 0;
    const PolicyPtr& policy = i < policies.size() ? policies[i] : policies[0];
    absl::Status st = engine.Admit(policy, r, [&out, i](const auto& result) {
      if (result.ok()) out[i] = result->sequences[0].tokens;
    });
    if (!st.ok()) {
      std::fprintf(stderr, "admit: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  }
  bool more = engine.Step();
  const Clock::time_point t1 = Clock::now();
  while (more) more = engine.Step();
  const double s = Since(t0);
  if (steady != nullptr) *steady = Since(t1);
  if (tokens != nullptr) *tokens = std::move(out);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0);
  const int threads = static_cast<int>(absl::GetFlag(FLAGS_num_threads));
  at::set_num_threads(threads);
  const std::string out_dir = absl::GetFlag(FLAGS_out_dir);
  const int64_t prompt_len = absl::GetFlag(FLAGS_prompt_len);
  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  const int64_t reps = std::max<int64_t>(1, absl::GetFlag(FLAGS_reps));
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(b, &n) || n < 1) return Fail("--batches", absl::InvalidArgumentError(""));
    batches.push_back(n);
  }

  tinkerd::ModelConfig mc = tinkerd::TinyConfig("llama");
  mc.vocab_size = absl::GetFlag(FLAGS_vocab);
  mc.hidden_size = absl::GetFlag(FLAGS_hidden);
  mc.intermediate_size = absl::GetFlag(FLAGS_intermediate);
  mc.num_hidden_layers = absl::GetFlag(FLAGS_layers);
  mc.num_attention_heads = absl::GetFlag(FLAGS_heads);
  mc.num_key_value_heads = absl::GetFlag(FLAGS_kv_heads);
  mc.head_dim = absl::GetFlag(FLAGS_head_dim);
  mc.max_position_embeddings = absl::GetFlag(FLAGS_max_pos);
  mc.tie_word_embeddings = false;
  mc.torch_dtype = "float32";
  const std::string model_dir = out_dir + "/model";
  std::filesystem::create_directories(model_dir);
  tinkerd::TinyModelSpec spec;
  spec.config = mc;
  spec.seed = absl::GetFlag(FLAGS_seed);
  if (auto st = tinkerd::WriteTinyModel(model_dir, spec); !st.ok()) return Fail("model", st);

  // Prompts: one per sample of the largest batch, and the long one; written for the eager side.
  tinkerd::SplitMix64 rng(absl::GetFlag(FLAGS_seed) + 1);
  auto prompt = [&](int64_t n) {
    std::vector<int64_t> p(n);
    for (int64_t& t : p)
      t = static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(mc.vocab_size));
    return p;
  };
  std::vector<std::vector<int64_t>> prompts;
  const int64_t n_prompts =
      std::max(*std::max_element(batches.begin(), batches.end()), absl::GetFlag(FLAGS_adapters));
  for (int64_t i = 0; i < n_prompts; ++i) {
    prompts.push_back(prompt(prompt_len));
  }
  const std::vector<int64_t> long_prompt = prompt(absl::GetFlag(FLAGS_ttft_prompt_len));
  std::ofstream(out_dir + "/prompts.json")
      << nlohmann::json{{"prompts", prompts}, {"long_prompt", long_prompt}}.dump();

  tinkerd::RunnerConfig rc;
  rc.base_model_path = model_dir;
  auto dtype = tinkerd::ParseComputeDType(absl::GetFlag(FLAGS_compute_dtype));
  if (!dtype.ok()) return Fail("--compute_dtype", dtype.status());
  rc.compute_dtype = *dtype;
  rc.num_threads = threads;
  auto runner_or = tinkerd::ModelRunner::Create(rc);
  if (!runner_or.ok()) return Fail("ModelRunner::Create", runner_or.status());
  std::unique_ptr<tinkerd::ModelRunner> runner = std::move(runner_or).value();
  auto base = runner->FreezePolicy("");
  if (!base.ok()) return Fail("FreezePolicy", base.status());
  tinkerd::EngineLimits limits;
  limits.max_sequences = 1024;
  limits.kv_cache_bytes = int64_t{16} << 30;
  tinkerd::SampleEngine engine(limits);

  nlohmann::json result = {{"threads", at::get_num_threads()},
                           {"prompt_len", prompt_len},
                           {"max_tokens", max_tokens},
                           {"blas_core", tinkerd::BlasCore()},
                           {"compute_dtype", tinkerd::ComputeDTypeName(*dtype)}};
  Run(engine, {*base}, {prompts[0]}, 4);  // warm-up
  std::printf("decode (greedy, prompt %lld, %lld tokens per sample, median of %lld):\n",
              static_cast<long long>(prompt_len), static_cast<long long>(max_tokens),
              static_cast<long long>(reps));
  nlohmann::json decode = nlohmann::json::object();
  nlohmann::json steady_decode = nlohmann::json::object();
  nlohmann::json first_tokens = nlohmann::json::object();
  for (int64_t b : batches) {
    const std::vector<std::vector<int64_t>> batch(prompts.begin(), prompts.begin() + b);
    std::vector<double> one, full, steady;
    std::vector<std::vector<int64_t>> tokens;
    for (int64_t r = 0; r < reps; ++r) {
      one.push_back(Run(engine, {*base}, batch, 1));
      full.push_back(Run(engine, {*base}, batch, max_tokens, &tokens, &steady.emplace_back()));
    }
    const double s = Median(full) - Median(one);
    const double tps = static_cast<double>(b * (max_tokens - 1)) / s;
    const double steady_tps = static_cast<double>(b * (max_tokens - 2)) / Median(steady);
    std::printf(
        "  batch %3lld: %8.1f tokens/s (prefill + first token %.3f s, all %.3f s); "
        "steps after the first: %.1f tokens/s\n",
        static_cast<long long>(b), tps, Median(one), Median(full), steady_tps);
    decode[std::to_string(b)] = tps;
    steady_decode[std::to_string(b)] = steady_tps;
    first_tokens[std::to_string(b)] = tokens[0];
  }
  result["decode_tokens_per_s"] = decode;
  result["steady_decode_tokens_per_s"] = steady_decode;
  result["greedy_tokens"] = first_tokens;

  std::vector<double> ttft;
  for (int64_t r = 0; r < reps; ++r) ttft.push_back(Run(engine, {*base}, {long_prompt}, 1));
  result["ttft_s"] = Median(ttft);
  std::printf("time to first token, %zu-token prompt: %.3f s\n", long_prompt.size(), Median(ttft));

  // Across adapters: one sample from each of --adapters LoRA models (ranks 8, 16, 32, 64 in
  // turn), decoded in one forward per step, against each policy decoded on its own (one forward
  // per policy per step, as the engine did before it mixed adapters). Each adapter takes one
  // large step first: a fresh one (B = 0) is the base model, and equal tokens would show nothing.
  const int64_t n_adapters = absl::GetFlag(FLAGS_adapters);
  std::vector<PolicyPtr> adapters;
  for (int64_t i = 0; i < n_adapters; ++i) {
    tinkerd::CreateModelOptions mo;
    tinkerd::LoraConfig lora;
    lora.rank = int64_t{8} << (i % 4);
    lora.alpha = 32;
    mo.lora = lora;
    mo.seed = static_cast<uint64_t>(100 + i);
    auto id = runner->CreateModel(mo);
    if (!id.ok()) return Fail("CreateModel", id.status());
    std::vector<tinkerd::Datum> step(2);
    for (tinkerd::Datum& d : step) {
      d.tokens = prompt(32);
      d.loss_fn_inputs["target_tokens"] = tinkerd::TensorData::Int64(prompt(32));
      d.loss_fn_inputs["weights"] = tinkerd::TensorData::Float32(std::vector<float>(32, 1.f));
    }
    tinkerd::AdamParams adam;
    adam.learning_rate = 0.05;
    if (auto fb = runner->ForwardBackward(*id, step, "cross_entropy", {}); !fb.ok()) {
      return Fail("ForwardBackward", fb.status());
    }
    if (auto st = runner->OptimStep(*id, adam); !st.ok()) return Fail("OptimStep", st.status());
    auto policy = runner->FreezePolicy(*id);
    if (!policy.ok()) return Fail("FreezePolicy", policy.status());
    adapters.push_back(*policy);
  }
  if (n_adapters > 0) {
    const std::vector<std::vector<int64_t>> batch(prompts.begin(), prompts.begin() + n_adapters);
    std::vector<double> mixed_one, mixed_full, apart_one, apart_full;
    std::vector<std::vector<int64_t>> mixed_tokens, apart_tokens(n_adapters);
    for (int64_t r = 0; r < reps; ++r) {
      mixed_one.push_back(Run(engine, adapters, batch, 1));
      mixed_full.push_back(Run(engine, adapters, batch, max_tokens, &mixed_tokens));
      double one = 0, full = 0;
      for (int64_t i = 0; i < n_adapters; ++i) {
        std::vector<std::vector<int64_t>> tokens;
        one += Run(engine, {adapters[i]}, {batch[i]}, 1);
        full += Run(engine, {adapters[i]}, {batch[i]}, max_tokens, &tokens);
        apart_tokens[i] = tokens[0];
      }
      apart_one.push_back(one);
      apart_full.push_back(full);
    }
    const double tokens = static_cast<double>(n_adapters * (max_tokens - 1));
    const double mixed = tokens / (Median(mixed_full) - Median(mixed_one));
    const double apart = tokens / (Median(apart_full) - Median(apart_one));
    int64_t equal = 0, unlike_base = 0;
    for (int64_t i = 0; i < n_adapters; ++i) {
      equal += mixed_tokens[i] == apart_tokens[i];
      std::vector<std::vector<int64_t>> base_tokens;
      Run(engine, {*base}, {batch[i]}, max_tokens, &base_tokens);
      unlike_base += base_tokens[0] != apart_tokens[i];
    }
    std::printf(
        "across %lld LoRA adapters, one sample each: %.1f tokens/s in one forward per step, "
        "%.1f one forward per adapter (%.2fx); greedy tokens equal %lld/%lld (unlike the base "
        "model's: %lld/%lld)\n",
        static_cast<long long>(n_adapters), mixed, apart, mixed / apart,
        static_cast<long long>(equal), static_cast<long long>(n_adapters),
        static_cast<long long>(unlike_base), static_cast<long long>(n_adapters));
    result["adapters"] = {{"count", n_adapters},
                          {"mixed_tokens_per_s", mixed},
                          {"apart_tokens_per_s", apart},
                          {"greedy_equal", equal},
                          {"unlike_base", unlike_base}};
  }

  // Beside training: a LoRA model's forward_backward calls, alternating with decode steps.
  tinkerd::CreateModelOptions mo;
  tinkerd::LoraConfig lora;
  lora.rank = 32;
  lora.alpha = 32;
  mo.lora = lora;
  auto model = runner->CreateModel(mo);
  if (!model.ok()) return Fail("CreateModel", model.status());
  std::vector<tinkerd::Datum> data;
  const int64_t train_len = absl::GetFlag(FLAGS_train_tokens) / 4;
  for (int i = 0; i < 4; ++i) {
    tinkerd::Datum d;
    d.tokens = prompt(train_len);
    d.loss_fn_inputs["target_tokens"] = tinkerd::TensorData::Int64(prompt(train_len));
    d.loss_fn_inputs["weights"] = tinkerd::TensorData::Float32(std::vector<float>(train_len, 1.f));
    data.push_back(std::move(d));
  }
  auto train = [&] {
    auto r = runner->ForwardBackward(*model, data, "cross_entropy", {});
    if (!r.ok()) std::exit(Fail("ForwardBackward", r.status()));
  };
  const int64_t beside = absl::GetFlag(FLAGS_beside_batch);
  const int64_t beside_tokens = absl::GetFlag(FLAGS_beside_max_tokens);
  const std::vector<std::vector<int64_t>> batch(prompts.begin(), prompts.begin() + beside);
  // Alone: training calls back to back, and the decode rate measured above.
  train();
  Clock::time_point t0 = Clock::now();
  constexpr int kCalls = 4;
  for (int i = 0; i < kCalls; ++i) train();
  const double train_alone = static_cast<double>(kCalls * 4 * train_len) / Since(t0);
  // Together: admit, then alternate one decode step and one training call until the samples end.
  const double decode_alone = decode.value(std::to_string(beside), 0.0);
  int64_t calls = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    tinkerd::SampleRequest r;
    r.prompt = batch[i];
    r.params.max_tokens = beside_tokens;
    r.params.temperature = 0;
    (void)engine.Admit(*base, r, [](const auto&) {});
  }
  engine.Step();  // the prefill (and first token), not counted
  t0 = Clock::now();
  const int64_t steps_between = std::max<int64_t>(1, absl::GetFlag(FLAGS_beside_steps));
  const double share = std::clamp(absl::GetFlag(FLAGS_beside_share), 0.0, 0.95);
  // The scheduler's step budget (background_budget_) as a deadline: the same here, where steps
  // always have work.
  Clock::time_point until = t0;
  for (bool more = true; more;) {
    for (int64_t k = 0; more && (k < steps_between || Clock::now() < until); ++k) {
      more = engine.Step();
    }
    if (!more) break;
    const Clock::time_point began = Clock::now();
    train();
    ++calls;
    const Clock::time_point ended = Clock::now();
    until = ended +
            std::chrono::duration_cast<Clock::duration>((ended - began) * (share / (1 - share)));
  }
  const double both_s = Since(t0);
  const double decode_beside = static_cast<double>(beside * (beside_tokens - 1)) / both_s;
  const double train_beside = static_cast<double>(calls * 4 * train_len) / both_s;
  std::printf(
      "beside training (decode batch %lld, training calls of %lld tokens, %lld decode "
      "step(s) between two calls at least, sampling's share of the time %.2f):\n"
      "  decode %.1f tokens/s (alone %.1f), training %.1f tokens/s (alone %.1f)\n",
      static_cast<long long>(beside), static_cast<long long>(4 * train_len),
      static_cast<long long>(steps_between), share, decode_beside, decode_alone, train_beside,
      train_alone);
  result["beside"] = {{"batch", beside},
                      {"steps_between_calls", steps_between},
                      {"sample_share", share},
                      {"decode_tokens_per_s", decode_beside},
                      {"decode_alone_tokens_per_s", decode_alone},
                      {"train_tokens_per_s", train_beside},
                      {"train_alone_tokens_per_s", train_alone}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
