#include "runner/model_runner.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/accumulate.h>

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "runner/checkpoint/param_shard_io.h"
#include "runner/checkpoint/state_io.h"
#include "runner/checkpoint/store.h"
#include "runner/dist/collectives.h"
#include "runner/dist/expert_parallel.h"
#include "runner/joint_call.h"
#include "runner/model/safetensors.h"
#include "runner/model/tiny_model.h"
#include "runner/model/weights.h"
#include "runner/sample/policy.h"
#include "runner/train_step.h"
#include "runner/util/blas_buffers.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/echo.h"
#include "runner/util/exception_status.h"
#include "runner/util/log.h"
#include "runner/util/memory_limit.h"
#include "runner/util/status_macros.h"
#include "runner/validate.h"

namespace tinkerd {
namespace {

// The one place per entry point where LibTorch exceptions become a Status (they never escape).
template <typename F>
auto Guarded(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (...) {
    return ExceptionStatus(what, std::current_exception());
  }
}

// "cpu" / "cuda[:N]" to a device this process can use: FAILED_PRECONDITION when LibTorch was
// built without CUDA or the GPU is not visible, rather than a crash at the first tensor.
absl::StatusOr<at::Device> ResolveDevice(const std::string& device) {
  ASSIGN_OR_RETURN(DeviceSpec d, ParseDevice(device));
  if (!d.cuda) return at::Device(at::kCPU);
  if (!at::hasCUDA()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runner: device ", device,
        " requested, but this LibTorch has no CUDA support or no GPU is "
        "visible (build with --preset cuda against a CUDA LibTorch; check CUDA_VISIBLE_DEVICES)"));
  }
  const int visible = at::detail::getCUDAHooks().getNumGPUs();
  if (d.index >= visible) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runner: device ", device, " requested, but only ", visible, " GPU(s) are visible"));
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.index));
}

// A trainable copy in the training dtype (fp32 masters under bf16/fp16 compute).
at::Tensor CloneTrainable(const at::Tensor& t, at::ScalarType train_dtype) {
  return t.detach().to(train_dtype, /*non_blocking=*/false, /*copy=*/true).set_requires_grad(true);
}

std::string Bytes(int64_t n) {
  if (n < (int64_t{1} << 20)) return absl::StrFormat("%.1f KiB", n / 1024.0);
  if (n < (int64_t{1} << 30)) return absl::StrFormat("%.1f MiB", n / 1048576.0);
  return absl::StrFormat("%.2f GiB", n / 1073741824.0);
}

// The memory account's capacity when no budget is configured: on the CPU, three quarters of what
// the process may still use once the base model is loaded (runner/util/memory_limit.h: physical
// memory, its cgroup's limit, RLIMIT_AS; less what it uses now), the last quarter left to the
// allocator's slack, request bodies, threads and LibTorch's caches; on a GPU, whose memory that
// limit does not describe, half the host's as before.
int64_t DefaultMemoryBudget(const MemoryLimit& limit, bool cuda) {
  if (cuda) return limit.bytes / 2;
  return std::max<int64_t>(0, limit.bytes - UsedBytes(limit)) / 4 * 3;
}

}  // namespace

struct ModelRunner::Impl {
  RunnerConfig config;
  ModelConfig model_config;
  BaseWeights base;
  // Under --shard_base: the frozen base's slices, each unit gathered while it runs; `base` then
  // holds no tensor (ParamShard::Placeholders).
  std::optional<ParamShard> base_shard;
  // How a policy's forward gathers that base (Policy::gathered): ForwardGatheredBase on this rank
  // alone, unless the server has the other ranks take part (SetGatherBase).
  std::shared_ptr<const GatherBase> gather_base;
  // Under --expert_parallel: how a policy's forward reaches the experts other ranks hold
  // (Policy::spread): ForwardSpreadExperts on this rank alone, unless the server has the other
  // ranks take part (SetSpreadExperts).
  std::shared_ptr<const SpreadExperts> spread;
  // On the ranks serving rank 0's sampling forwards: their experts of each frozen policy, by key
  // (Policy::experts_key), until rank 0 drops it. Touched by commands alone, which run in turn.
  absl::Mutex frozen_mu;
  std::map<int64_t, std::shared_ptr<const Policy>> frozen ABSL_GUARDED_BY(frozen_mu);
  // On rank 0: the keys of frozen policies no sampler holds any more, until the server sends them
  // to the other ranks (TakeDropped). Shared with the keys' deleters, which may outlive the runner.
  struct Dropped {
    absl::Mutex mu;
    std::vector<int64_t> keys ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<Dropped> dropped = std::make_shared<Dropped>();
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::shared_ptr<Collectives> collectives;
  // Under --shard=full --prefetch_layers: every rank again, as a group of its own, where the
  // layers' prefetched gathers run beside the main group's collectives.
  std::shared_ptr<Collectives> gathers;
  // Under --expert_parallel > 1: which experts this rank holds, and their exchange; `base` then
  // holds those experts alone.
  std::unique_ptr<ExpertParallel> experts;
  uint64_t base_fingerprint = 0;
  std::shared_ptr<RopeCache> rope;          // cos/sin rows shared by every model and policy
  std::shared_ptr<const TokenTexts> texts;  // the base's tokenizer, if its directory has one
  mutable absl::Mutex mu;
  std::map<std::string, ModelState> models ABSL_GUARDED_BY(mu);

  struct Stream {
    std::unique_ptr<CallStage> stage;
    ResolvedLoss loss;
    std::vector<Datum> buffered;
    int64_t buffered_tokens = 0;
    absl::Status failed;   // first error; the stream can then only be finished (with it) or aborted
    Reservation gradient;  // its staged gradient's memory, from BeginStream to the end
  };
  std::map<int64_t, Stream> streams ABSL_GUARDED_BY(mu);
  int64_t next_stream = 1;

  // Runs what `s` has buffered, its memory reserved for the run. (Under --shard=full a failure
  // is every rank's, RunIf agreeing on it, so the ranks skip a failed stream's runs alike.)
  absl::Status RunStream(Stream& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto model = models.find(s.stage->model_id());
    if (model == models.end()) return absl::NotFoundError("stream: its model was deleted");
    absl::StatusOr<Reservation> memory = ReserveCall(Context(), model->second, s.buffered,
                                                     /*backward=*/true, /*staged_gradient=*/false);
    return s.stage->RunIf(memory.status(), s.buffered);
  }
  bool HasOpenStream(const std::string& model_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& [sid, st] : streams) {
      if (st.stage->model_id() == model_id) return true;
    }
    return false;
  }
  absl::Status NoOpenStream(const std::string& model_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!HasOpenStream(model_id)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_id, " has an open forward_backward stream"));
  }

  StepContext Context() const {
    return {&model_config, &base, collectives.get(), dtype, device, config.micro_batch_tokens,
            ForwardOptions{.recompute_layers = config.activation_checkpointing,
                           .compute_dtype = dtype,
                           .rope = rope.get(),
                           .expert_slots = experts ? experts->Slots() : nullptr},
            // On a GPU a call reserves nothing: runner/call_memory.h's estimate is the CPU
            // kernels' (several times what the ~1.1B bench row takes on an H100), and the
            // caching allocator's out-of-memory is the call's RESOURCE_EXHAUSTED there.
            device.is_cuda() ? nullptr : account.get(), experts.get(),
            base_shard ? &*base_shard : nullptr, gathers.get()};
  }
  absl::StatusOr<ModelState*> Find(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = models.find(id);
    if (it == models.end())
      return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(id), "'"));
    return &it->second;
  }
  // A policy made on each rank of rank 0's group (its experts' part, under `key`): rank 0 returns
  // it, holding the key, whose last owner queues the others' parts to be dropped; the other ranks
  // keep theirs until then, and return null.
  std::shared_ptr<const Policy> Spread(int64_t key, std::shared_ptr<Policy> policy) {
    if (collectives->rank() != 0) {
      absl::MutexLock lock(&frozen_mu);
      frozen[key] = std::move(policy);
      return nullptr;
    }
    policy->experts_key =
        std::shared_ptr<const int64_t>(new int64_t(key), [d = dropped](const int64_t* k) {
          absl::MutexLock lock(&d->mu);
          d->keys.push_back(*k);
          delete k;
        });
    return policy;
  }
  // This rank's experts of decoder layer `layer` as frozen under `key` (0: the base's), for the
  // rows rank 0 sends them (ExpertParallel::Serve).
  absl::StatusOr<kernels::ExpertFn> ServedExperts(int64_t layer, int64_t key) {
    if (layer < 0 || layer >= model_config.num_hidden_layers || !model_config.Routes(layer)) {
      return absl::InternalError(
          absl::StrCat("sample: rank 0 sent rows for layer ", layer, ", which routes none"));
    }
    std::shared_ptr<const Policy> p;
    if (key != 0) {
      absl::MutexLock lock(&frozen_mu);
      auto it = frozen.find(key);
      if (it == frozen.end()) {
        return absl::InternalError(absl::StrCat("sample: no frozen policy ", key, " here"));
      }
      p = it->second;
    }
    const BaseWeights& w = p ? p->weights : base;
    const LoraAdapter* lora = p && p->lora ? &*p->lora : nullptr;
    kernels::ExpertFn run =
        LayerExperts(model_config, w.layers[static_cast<size_t>(layer)], lora, layer);
    // `p` rides along: the policy stays whole while its experts run, even once dropped.
    return [run = std::move(run), p](int64_t e, const at::Tensor& x_ND) { return run(e, x_ND); };
  }
  // The modules this rank adapts (LoraAdapter::Keep): other ranks' experts are theirs.
  LoraAdapter::Keep Keep() const {
    if (experts == nullptr) return nullptr;
    return [e = experts.get()](const std::string& module) { return e->Keeps(module + "."); };
  }
  // What is not built yet for a server whose experts are spread over the ranks.
  absl::Status AllExperts(const char* what) const {
    if (experts == nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": this server spreads each layer's experts over groups of ", experts->size(),
        " ranks (--expert_parallel), and merged exports from it are not built yet: export the "
        "adapter (merged=false), or save_state the model and load that checkpoint into a server "
        "run without --expert_parallel to export it merged"));
  }
  // A policy's base: the tensors every policy on it shares, or a sharded base's placeholders and
  // the gather its forwards run through.
  void OnBase(Policy& p) const {
    p.weights = base;
    if (base_shard) p.gathered = gather_base;
    if (experts) p.spread = spread;
  }
  // What a rank holds while a sharded model is gathered a unit at a time: the largest unit whole,
  // and beside it the all-gather's staging: its bucket (at most 64 MiB) twice (Gloo stages a flat
  // copy of it) and the rank's own row of it, all in the slices' dtype (a base's may be bf16).
  int64_t GatherBytes(const ParamShard& s) const {
    const int64_t elem = s.units().front().param_C.element_size();
    const int64_t W = collectives->world_size(), bucket = int64_t{64} << 20;
    int64_t bytes = 0;
    for (const ShardedUnit& u : s.units()) {
      const int64_t whole = u.state.layout.chunk() * W * elem;
      bytes =
          std::max(bytes, whole + 2 * std::min(whole, bucket) + std::min(whole / W, bucket / W));
    }
    return bytes;
  }
  // `bytes` reserved on every rank before a collective that needs them, and agreed, so that one
  // rank refusing leaves no other waiting in the collective: all refuse, or none does.
  absl::StatusOr<Reservation> ReserveOnEveryRank(int64_t bytes, const std::string& what,
                                                 const std::string& hint,
                                                 absl::string_view op) const {
    absl::StatusOr<Reservation> reserved = account->Reserve(bytes, what, hint);
    bool ok = reserved.ok();
    if (collectives->world_size() > 1) RETURN_IF_ERROR(collectives->AllAgree(ok));
    if (!reserved.ok()) return reserved.status();
    if (!ok) {
      return absl::ResourceExhaustedError(
          absl::StrCat(op, ": another rank could not reserve its memory for it; retry later"));
    }
    return reserved;
  }
  // Memory a model's trainable state would take, counted before anything is allocated: each
  // trainable value is held four times (the parameter, its gradient sum, AdamW's two moments) in
  // the training dtype; under --shard=optimizer the parameter once and the other three a W-th
  // each. Activations are bounded by micro_batch_tokens, not counted here.
  absl::StatusOr<int64_t> StateBytes(const CreateModelOptions& options) const {
    int64_t values = 0;
    if (options.lora) {
      RETURN_IF_ERROR(LoraAdapter::Validate(*options.lora));
      values = LoraAdapter::CountValues(model_config, *options.lora, Keep());
    } else if (base_shard) {
      values = base_shard->values();
    } else {
      for (const auto& [name, w] : base.Named(model_config)) {
        values += w.numel();
      }
    }
    // Under --shard=optimizer a rank holds the parameters and 1/W of the other three; under
    // --shard=full, a full fine-tune 1/W of all four (a unit's slices rounded up: at most one
    // value per unit more).
    const int64_t W = collectives->world_size();
    const int64_t slice = (values + W - 1) / W;
    int64_t held = 4 * values;
    if (config.shard == ShardMode::kOptimizer) held = values + 3 * slice;
    if (config.shard == ShardMode::kFull) {
      // A LoRA model as under optimizer; a full fine-tune's slices are per unit.
      const int64_t units_slice = slice + model_config.num_hidden_layers + 1;
      held = options.lora ? values + 3 * slice : 4 * units_slice;
    }
    return held * at::elementSize(TrainDType());
  }
  // A policy's copy of the trainable model `t` (a full fine-tune's weights, or the base's with the
  // adapter) in the compute dtype, counted in its bytes; the runner's fields are set already.
  void Freeze(const ModelState& t, Policy& p) const;
  // SaveWeightsForSampler's adapter export with the experts spread over ranks, and a LoRA
  // model's merged export on the sharded base (defined with the other saves).
  absl::Status SaveAdapterOfExperts(const ModelState& t, const std::string& path, bool overwrite);
  absl::Status SaveMergedOnShardedBase(const ModelState& t, const std::string& path,
                                       bool overwrite);
  // Trainable tensors and their accumulators are at least fp32 (DESIGN.md §3).
  at::ScalarType TrainDType() const { return dtype == at::kDouble ? at::kDouble : at::kFloat; }
  // Admits a model of `bytes` within the per-model limit, and reserves them in the account.
  absl::StatusOr<Reservation> Admit(int64_t bytes) const {
    if (config.max_model_bytes > 0 && bytes > config.max_model_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "create_model: the model's trainable state (parameters, gradients, AdamW moments) "
          "would take ",
          Bytes(bytes), ", over the per-model limit of ", Bytes(config.max_model_bytes),
          " (a smaller lora.rank, or fewer adapted modules, fits)"));
    }
    return account->Reserve(bytes,
                            "create_model: the model's trainable state (parameters, gradients, "
                            "AdamW moments)",
                            ". Delete a model, or retry later");
  }
  // A sampler's policy's `bytes`, at world size 1 (Policy::memory says why not else).
  absl::StatusOr<std::shared_ptr<const Reservation>> ReservePolicy(int64_t bytes) const {
    if (collectives->world_size() > 1) return nullptr;
    ASSIGN_OR_RETURN(Reservation held,
                     account->Reserve(bytes, "create_sampler: the sampler's copy of the weights",
                                      ". Delete samplers or models, or retry later"));
    return std::make_shared<const Reservation>(std::move(held));
  }
  MemoryLimit memory_limit;  // what the process may use, and which bound says so
  // Models' state, training calls and (through the server's engine) samples reserve here; its
  // capacity is config.memory_budget_bytes, or DefaultMemoryBudget(); or config.account's.
  std::shared_ptr<MemoryAccount> account;
  Reservation base_memory;  // the base's weights, in a shared config.account

  // Whether checkpoint `s` fits model `t`. Under expert parallelism each rank checks the tensors
  // it holds and the count of the others', and drops the others' from `s` (AgreeOnLoad then
  // makes the outcome every rank's).
  absl::Status Check(const ModelState& t, LoadedState& s) const {
    if (t.sharded) return CheckShardedCompatible(t, s);
    if (experts == nullptr) return CheckCompatible(t, s);
    int64_t replicated = 0, held = 0;
    for (const auto& [name, p] : t.params)
      ++(ExpertParallel::ExpertOf(name) >= 0 ? held : replicated);
    const auto expected = static_cast<size_t>(replicated + held * experts->size());
    for (auto* m : {&s.params, &s.exp_avg, &s.exp_avg_sq, &s.grad_sum}) {
      if (m != &s.grad_sum && m->size() != expected && !m->empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint holds ", m->size(), " tensors where this model has ", expected));
      }
      std::erase_if(*m, [&](const auto& kv) { return !experts->Keeps(kv.first); });
    }
    absl::Status st =
        s.params.size() == t.params.size()
            ? CheckCompatible(t, s)
            : absl::FailedPreconditionError("checkpoint lacks tensors of this rank's experts");
    return st;
  }
  // Under expert parallelism a load's outcome is every rank's (each checked only its own
  // experts): the ranks agree on `local`, which every rank reaches whatever failed before it.
  absl::Status AgreeOnLoad(absl::Status local) const {
    if (experts == nullptr) return local;
    bool ok = local.ok();
    RETURN_IF_ERROR(collectives->AllAgree(ok));
    if (!ok && local.ok()) {
      return absl::FailedPreconditionError(
          "load_state: the checkpoint could not be loaded on another rank (its experts, or its "
          "read); nothing was loaded");
    }
    return local;
  }
  // Resolves, reads and verifies a training checkpoint in the training dtype, for `into` when it
  // is known: a sharded model's rank reads only its slices (SlicesOf).
  // `held` gets the reservation of what the read and its application hold (ReadTrainingState).
  absl::StatusOr<LoadedState> ReadState(const std::string& path, Reservation* held,
                                        const ModelState* into = nullptr) const;
  ModelLimits Limits() const {
    return {model_config.vocab_size, model_config.max_position_embeddings,
            texts != nullptr,        model_config.moe.num_experts,
            model_config.moe.top_k,  model_config.moe.RoutedLayers()};
  }
};

ModelRunner::ModelRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelRunner::~ModelRunner() = default;
const RunnerConfig& ModelRunner::config() const {
  return impl_->config;
}
uint64_t ModelRunner::base_fingerprint() const {
  return impl_->base_fingerprint;
}
std::shared_ptr<MemoryAccount> ModelRunner::memory_account() const {
  return impl_->account;
}
ModelLimits ModelRunner::limits() const {
  return impl_->Limits();
}

namespace {

// Under --expert_parallel > 1, the experts this rank holds (ExpertParallel::BlockOf); null
// otherwise. INVALID_ARGUMENT for a model without experts, or an E that does not divide.
absl::StatusOr<std::function<bool(int64_t)>> HeldExperts(const RunnerConfig& config,
                                                         const ModelConfig& model,
                                                         const Collectives& c) {
  if (config.expert_parallel == 1) return nullptr;
  if (model.moe.num_experts == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: --expert_parallel=", config.expert_parallel,
                     " needs a mixture of experts, and ", model.architecture, " has none"));
  }
  ASSIGN_OR_RETURN(const ExpertParallel::Block b,
                   ExpertParallel::BlockOf(c.rank(), c.world_size(), config.expert_parallel,
                                           model.moe.num_experts));
  return [b](int64_t e) { return e >= b.first && e < b.first + b.count; };
}

// Data-parallel ranks must hold the same base model in the same dtype and split training state
// the same way: ranks that differ in --shard would issue different collectives and never line up.
// Every rank calls this once, at start-up.
absl::Status AgreeOnSetup(Collectives& c, const RunnerConfig& config, uint64_t fingerprint) {
  if (c.world_size() == 1) return absl::OkStatus();
  const std::string mine = absl::StrFormat(
      "base model %016x, compute_dtype %s, shard %s%s%s, expert_parallel %d", fingerprint,
      ComputeDTypeName(config.compute_dtype), ShardModeName(config.shard),
      config.shard_base ? " with the base" : "",
      config.shard == ShardMode::kFull && config.prefetch_layers ? " prefetching layers" : "",
      config.expert_parallel);
  ASSIGN_OR_RETURN(std::vector<std::string> all, c.AllGatherBytes(mine));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "runner: every rank must run the same base model, compute dtype and shard mode, and "
          "expert_parallel; rank 0 "
          "has ",
          all[0], ", rank ", r, " has ", all[r]));
    }
  }
  return absl::OkStatus();
}

struct ShardedBase {
  ParamShard shard;
  uint64_t fingerprint;
};

// The base in slices (--shard_base, ParamShard::ReadFrozen): each rank reads its part of every
// tensor alone from the model directory, or cuts it from `generated` (the embedded model); and
// the base's fingerprint, from the final norm and the embedding's first values, read alone
// afterwards (no rank holds either whole).
absl::StatusOr<ShardedBase> ReadShardedBase(const RunnerConfig& config, const ModelConfig& model,
                                            at::ScalarType dtype, at::Device device,
                                            const Collectives& c, TensorMap generated) {
  const bool embedded = config.base_model_path == kEmbeddedDefaultModel;
  TensorMap like;
  if (embedded) {
    for (const auto& [name, t] : generated) {
      like[name] = at::empty(t.sizes(), t.options().device(at::kMeta));
    }
  } else {
    ASSIGN_OR_RETURN(like, SafetensorsDirShapes(config.base_model_path, dtype));
  }
  // Of each tensor the stretch `s` names: read alone from the files, or cut from `generated`.
  auto read = [&](const Stretch& s) -> absl::StatusOr<TensorMap> {
    if (!embedded) return LoadSafetensorsDirStretches(config.base_model_path, dtype, s);
    TensorMap parts;
    for (const auto& [name, t] : generated) {
      const auto [begin, length] = s(name, t.sizes());
      parts[name] = length < 0 ? at::Tensor() : t.reshape({-1}).narrow(0, begin, length).clone();
    }
    return parts;
  };
  const std::string norm = "model.norm.weight", embed = "model.embed_tokens.weight";
  // FingerprintedEmbedding's count, from the embedding's shape (a meta tensor).
  const int64_t head = like.count(embed) ? FingerprintedEmbedding(like.at(embed)).numel() : 0;
  ASSIGN_OR_RETURN(ParamShard shard,
                   ParamShard::ReadFrozen(model, std::move(like), read, c.world_size(), c.rank(),
                                          at::TensorOptions().dtype(dtype).device(device)));
  // The fingerprint's values (the final norm, the embedding's first ones), read alone.
  ASSIGN_OR_RETURN(
      const TensorMap sampled, read([&](const std::string& name, at::IntArrayRef shape) {
        return std::pair<int64_t, int64_t>(0, name == norm    ? c10::multiply_integers(shape)
                                              : name == embed ? head
                                                              : 0);
      }));
  const uint64_t fingerprint = BaseFingerprint(model, sampled.at(norm), sampled.at(embed));
  return ShardedBase{std::move(shard), fingerprint};
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const RunnerConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  return Guarded("loading base model", [&]() -> absl::StatusOr<std::unique_ptr<ModelRunner>> {
    auto impl = std::make_unique<Impl>();
    impl->config = config;
    switch (config.compute_dtype) {
      case ComputeDType::kFloat32:
        impl->dtype = at::kFloat;
        break;
      case ComputeDType::kFloat64:
        impl->dtype = at::kDouble;
        break;
      case ComputeDType::kBFloat16:
        impl->dtype = at::kBFloat16;
        break;
      case ComputeDType::kFloat16:
        impl->dtype = at::kHalf;
        break;
    }
    ASSIGN_OR_RETURN(impl->device, ResolveDevice(config.device));
    impl->collectives = config.collectives ? config.collectives : MakeLocalCollectives();
    impl->memory_limit = ProcessMemoryLimit();

    // Before any product runs: oneDNN reads its cap once (util/cpu_environment.h).
    const std::string onednn_isa = CapOneDnnIsa();
    if (config.num_threads > 0) at::set_num_threads(config.num_threads);
    // util/blas_buffers.h: OpenBLAS's buffers mapped now, while memory is plentiful, and before
    // the budget is sized from what the process holds.
    const int blas_calls = PreallocateBlasBuffers();
    TensorMap tensors;
    std::function<bool(int64_t expert)> holds;  // under expert parallelism: this rank's experts
    if (config.base_model_path == kEmbeddedDefaultModel) {
      TinyModelSpec spec{DefaultDemoConfig()};
      impl->model_config = spec.config;
      ASSIGN_OR_RETURN(holds, HeldExperts(config, impl->model_config, *impl->collectives));
      ASSIGN_OR_RETURN(tensors, GenerateTinyWeights(spec));
      for (auto& [name, t] : tensors) t = t.to(impl->dtype);
    } else {
      const auto cfg_path = std::filesystem::path(config.base_model_path) / "config.json";
      ASSIGN_OR_RETURN(std::string cfg_text, ReadFileToString(cfg_path.string()));
      auto parsed = ParseModelConfig(cfg_text);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(cfg_path.string(), ": ", parsed.status().message()));
      }
      impl->model_config = *parsed;
      // Hugging Face's generate stops at generation_config.json's eos_token_id where the file
      // names one, else config.json's; so does the sampler (unless a request ignores EOS).
      const auto gen_path =
          std::filesystem::path(config.base_model_path) / "generation_config.json";
      if (std::error_code ec; std::filesystem::exists(gen_path, ec)) {
        ASSIGN_OR_RETURN(std::string gen_text, ReadFileToString(gen_path.string()));
        ASSIGN_OR_RETURN(std::vector<int64_t> eos,
                         ParseGenerationEos(gen_text, impl->model_config.vocab_size));
        if (!eos.empty()) impl->model_config.eos_token_ids = std::move(eos);
      }
      // A rank reads only its own experts of the base (runner/dist/expert_parallel.h).
      ASSIGN_OR_RETURN(holds, HeldExperts(config, impl->model_config, *impl->collectives));
      TensorFilter keep;
      if (holds) {
        keep = [&holds](const std::string& name) {
          const int64_t e = ExpertParallel::ExpertOf(name);
          return e < 0 || holds(e);
        };
      }
      if (!config.shard_base) {
        ASSIGN_OR_RETURN(tensors, LoadSafetensorsDir(config.base_model_path, impl->dtype, keep));
      }
      // Only stop strings need it: a model without one (or with one tinkerd cannot read) still
      // trains and samples, and a request with stop strings is refused naming why.
      absl::StatusOr<TokenTexts> texts = TokenTexts::Load(config.base_model_path);
      if (texts.ok()) {
        TLOG_INFO("runner: tokenizer {} with {} tokens", texts->description(), texts->size());
        impl->texts = std::make_shared<const TokenTexts>(*std::move(texts));
      } else {
        TLOG_INFO("runner: no tokenizer, so stop strings are refused: {}",
                  texts.status().ToString());
      }
    }
    if (config.shard_base) {
      ASSIGN_OR_RETURN(ShardedBase sharded,
                       ReadShardedBase(config, impl->model_config, impl->dtype, impl->device,
                                       *impl->collectives, std::move(tensors)));
      impl->base_shard.emplace(std::move(sharded.shard));
      impl->base_fingerprint = sharded.fingerprint;
      impl->base = impl->base_shard->Placeholders();
      TLOG_INFO("runner: the base sharded over {} ranks, {} of its weights on this one",
                impl->collectives->world_size(), Bytes(impl->base_shard->bytes()));
    } else {
      // Loaded (or generated) on the host, then moved once; everything else follows the weights.
      for (auto& [name, t] : tensors) t = t.to(impl->device);
      ASSIGN_OR_RETURN(impl->base,
                       BaseWeightsFromTensors(impl->model_config, std::move(tensors), holds));
      impl->base_fingerprint = BaseFingerprint(impl->model_config, impl->base);
    }
    RETURN_IF_ERROR(AgreeOnSetup(*impl->collectives, config, impl->base_fingerprint));
    if (config.shard == ShardMode::kFull && config.prefetch_layers) {
      if (impl->device.is_cuda()) {
        // Both groups' NCCL streams would wait on the default stream in the order the two
        // threads happened to enqueue, which differs by rank: a cycle. Built once the prefetch
        // has a stream of its own, linked to the compute by events at each Take.
        TLOG_WARN(
            "runner: --prefetch_layers is not built on CUDA yet; layers are gathered as used");
      } else {
        std::vector<int> all(impl->collectives->world_size());
        std::iota(all.begin(), all.end(), 0);
        ASSIGN_OR_RETURN(impl->gathers, impl->collectives->Subgroup(all));
      }
    }
    if (holds) {
      ASSIGN_OR_RETURN(impl->experts,
                       ExpertParallel::Create(*impl->collectives, config.expert_parallel,
                                              impl->model_config.moe.num_experts));
      TLOG_INFO("runner: expert parallel over {} ranks, holding experts [{}, {}) of each layer",
                impl->experts->size(), impl->experts->first(),
                impl->experts->first() + impl->experts->count());
    }
    // Sized once the base model is resident, so that the default leaves it out. The default is
    // the smallest rank's: each rank's own differs with what it happens to hold, and ranks that
    // admitted a model differently would stop the job as diverged. (A --memory_budget_mb set
    // differently per rank is the operator's to keep consistent.)
    const int64_t W = impl->collectives->world_size();
    std::vector<int64_t> defaults(W, 0);
    defaults[impl->collectives->rank()] =
        DefaultMemoryBudget(impl->memory_limit, impl->device.is_cuda());
    if (W > 1) RETURN_IF_ERROR(impl->collectives->AllReduceSumCounts(defaults));
    if (config.account != nullptr) {
      // Another base's budget: sized once that base was resident, it leaves out that base alone,
      // so this one's weights are held in it.
      impl->account = config.account;
      int64_t bytes = impl->base_shard ? impl->base_shard->bytes() : 0;
      std::set<const void*> counted;  // tied embeddings are one tensor under two names
      for (const auto& [name, w] : impl->base.Named(impl->model_config)) {
        if (w.defined() && counted.insert(w.data_ptr()).second) {
          bytes += static_cast<int64_t>(w.nbytes());
        }
      }
      ASSIGN_OR_RETURN(
          impl->base_memory,
          impl->account->Reserve(
              bytes, absl::StrCat("the base model ", config.base_model_path, "'s weights"),
              ". Raise --memory_budget_mb, or serve fewer bases"));
    } else {
      impl->account = MemoryAccount::Create(
          config.memory_budget_bytes > 0 ? config.memory_budget_bytes
                                         : *std::min_element(defaults.begin(), defaults.end()),
          "--memory_budget_mb");
    }
    impl->rope = std::make_shared<RopeCache>(
        impl->model_config, at::TensorOptions().dtype(impl->dtype).device(impl->device));
    // See util/cpu_environment.h.
    const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
    const char* spin_count = std::getenv("GOMP_SPINCOUNT");
    const std::string blas_core = BlasCore();
    TLOG_INFO(
        "runner: {} | {} | memory limit {} ({}), budget for models, calls and samples {} | "
        "intra-op threads {}, "
        "OMP_WAIT_POLICY={}, GOMP_SPINCOUNT={}, BLAS buffers mapped by {} calls, OpenBLAS kernels "
        "{}, ONEDNN_MAX_CPU_ISA={}",
        config.DebugString(), impl->model_config.DebugString(), Bytes(impl->memory_limit.bytes),
        impl->memory_limit.source, Bytes(impl->account->capacity()), at::get_num_threads(),
        wait_policy != nullptr ? wait_policy : "(unset)",
        spin_count != nullptr ? spin_count : "(unset)", blas_calls,
        blas_core.empty() ? "(not OpenBLAS)" : blas_core, onednn_isa);
    auto runner = std::unique_ptr<ModelRunner>(new ModelRunner(std::move(impl)));
    if (runner->impl_->base_shard) {
      runner->impl_->gather_base =
          std::make_shared<const GatherBase>([r = runner.get()](const BaseForward& forward) {
            return r->ForwardGatheredBase(forward);
          });
    }
    if (runner->impl_->experts) {
      runner->impl_->spread =
          std::make_shared<const SpreadExperts>([r = runner.get()](const ExpertForward& forward) {
            return r->ForwardSpreadExperts(forward);
          });
    }
    return runner;
  });
}

absl::StatusOr<std::string> ModelRunner::NewModelId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  return absl::StrCat("model-", absl::BytesToHexString(absl::string_view(
                                    reinterpret_cast<const char*>(bytes), sizeof(bytes))));
}

absl::StatusOr<std::string> ModelRunner::CreateModel(const CreateModelOptions& options,
                                                     const std::string& model_id) {
  std::string id = model_id;
  if (id.empty()) {
    ASSIGN_OR_RETURN(id, NewModelId());
  }
  absl::MutexLock lock(&impl_->mu);
  if (impl_->models.count(id)) {
    return absl::AlreadyExistsError(absl::StrCat("create_model: model ", Echo(id), " exists"));
  }
  if (static_cast<int>(impl_->models.size()) >= impl_->config.max_models) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "create_model: the server holds its maximum of ", impl_->config.max_models, " models"));
  }
  ASSIGN_OR_RETURN(const int64_t state_bytes, impl_->StateBytes(options));
  ASSIGN_OR_RETURN(Reservation memory, impl_->Admit(state_bytes));
  return Guarded("create_model", [&]() -> absl::StatusOr<std::string> {
    ModelState t;
    t.options = options;
    const at::ScalarType train_dtype = impl_->TrainDType();
    if (options.lora) {
      ASSIGN_OR_RETURN(LoraAdapter a,
                       LoraAdapter::Create(impl_->model_config, *options.lora, options.seed,
                                           train_dtype, impl_->device, impl_->Keep()));
      t.params = a.Parameters();
      t.lora = std::move(a);
    } else {
      const bool tied = impl_->model_config.tie_word_embeddings;
      const at::TensorOptions train = at::TensorOptions().dtype(train_dtype).device(impl_->device);
      if (impl_->base_shard) {
        // The base's own slices, in the training dtype: its units are the model's.
        t.sharded.emplace(impl_->base_shard->Trainable(train));
      } else if (impl_->config.shard == ShardMode::kFull) {
        // Every rank slices the same replicated base; nothing whole is kept.
        t.sharded.emplace(impl_->base, impl_->model_config, impl_->collectives->world_size(),
                          impl_->collectives->rank(), train);
      } else {
        BaseWeights own = impl_->base;  // shallow; every tensor is replaced below
        own.embed_VD = CloneTrainable(impl_->base.embed_VD, train_dtype);
        own.final_norm_D = CloneTrainable(impl_->base.final_norm_D, train_dtype);
        own.lm_head_VD = tied ? own.embed_VD : CloneTrainable(impl_->base.lm_head_VD, train_dtype);
        for (LayerWeights& L : own.layers) {
          for (at::Tensor* w : L.All()) {
            if (w->defined()) *w = CloneTrainable(*w, train_dtype);
          }
        }
        t.params = own.Named(impl_->model_config);
        t.full = std::move(own);
      }
    }
    if (!t.sharded && impl_->config.shard != ShardMode::kNone) {
      std::vector<int64_t> numels;
      for (const auto& [name, p] : t.params) numels.push_back(p.numel());
      t.shard.emplace(ShardLayout(std::move(numels), impl_->collectives->world_size(),
                                  impl_->collectives->rank()),
                      at::TensorOptions().dtype(train_dtype).device(impl_->device));
    } else {
      for (const auto& [name, p] : t.params) {
        t.grad_sum[name] = at::zeros_like(p).set_requires_grad(false);
        t.exp_avg[name] = at::zeros_like(p).set_requires_grad(false);
        t.exp_avg_sq[name] = at::zeros_like(p).set_requires_grad(false);
      }
    }
    t.id = id;
    t.memory = std::move(memory);
    impl_->models.emplace(id, std::move(t));
    TLOG_INFO("create_model {}: {} reduction={}", id,
              options.lora ? absl::StrCat("lora rank=", options.lora->rank) : "full",
              std::string(LossReductionName(options.loss_reduction)));
    return id;
  });
}

absl::Status ModelRunner::DeleteModel(const std::string& model_id) {
  absl::MutexLock lock(&impl_->mu);
  for (auto it = impl_->streams.begin(); it != impl_->streams.end();) {
    it = it->second.stage->model_id() == model_id ? impl_->streams.erase(it) : std::next(it);
  }
  if (impl_->models.erase(model_id) == 0) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  return absl::OkStatus();
}

std::vector<std::string> ModelRunner::ListModels() const {
  absl::MutexLock lock(&impl_->mu);
  std::vector<std::string> ids;
  for (const auto& [id, t] : impl_->models) ids.push_back(id);
  return ids;
}

absl::StatusOr<ModelInfo> ModelRunner::GetInfo(const std::string& model_id) const {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  ModelInfo info;
  info.model_id = t->id;
  info.base_model = impl_->config.base_model_path;
  info.architecture = impl_->model_config.architecture;
  info.is_lora = t->options.lora.has_value();
  if (info.is_lora) info.lora = *t->options.lora;
  info.loss_reduction = t->options.loss_reduction;
  info.step = t->step;
  info.accumulated_tokens = t->accumulated_tokens;
  info.accumulated_sequences = t->accumulated_sequences;
  info.skipped_steps = t->skipped_steps;
  // The whole model's: under expert parallelism every rank of a group holds as many experts.
  for (const auto& [n, p] : t->params) {
    const bool expert = impl_->experts && ExpertParallel::ExpertOf(n) >= 0;
    info.trainable_parameters += p.numel() * (expert ? impl_->experts->size() : 1);
  }
  if (t->sharded) info.trainable_parameters = t->sharded->values();
  info.vocab_size = impl_->model_config.vocab_size;
  info.max_context_length = impl_->model_config.max_position_embeddings;
  return info;
}

absl::StatusOr<ForwardBackwardResult> ModelRunner::Forward(const std::string& model_id,
                                                           const Batch& batch) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  return Guarded("forward", [&] {
    return RunForward(impl_->Context(), *t, batch.data(), batch.loss(), false);
  });
}

absl::StatusOr<ForwardBackwardResult> ModelRunner::ForwardBackward(const std::string& model_id,
                                                                   const Batch& batch) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  RETURN_IF_ERROR(impl_->NoOpenStream(model_id));
  return Guarded("forward_backward", [&] {
    return RunForward(impl_->Context(), *t, batch.data(), batch.loss(), true);
  });
}

std::vector<absl::StatusOr<ForwardBackwardResult>> ModelRunner::ForwardBackwardJoint(
    const std::vector<Call>& calls, bool backward) {
  absl::MutexLock lock(&impl_->mu);
  const char* what = backward ? "forward_backward" : "forward";
  std::vector<absl::StatusOr<ForwardBackwardResult>> results(
      calls.size(), absl::InternalError("joint call: not run"));
  // Which calls share passes; the others run alone after them, in order.
  std::vector<JointCall> joint;
  std::vector<size_t> joint_index, alone;
  std::set<std::string> seen;
  for (size_t i = 0; i < calls.size(); ++i) {
    absl::StatusOr<ModelState*> t = impl_->Find(calls[i].model_id);
    absl::Status st = t.status();
    if (st.ok() && backward) st = impl_->NoOpenStream(calls[i].model_id);
    if (!st.ok()) {
      results[i] = st;
    } else if ((*t)->lora && !(*t)->sharded && impl_->experts == nullptr && !impl_->base_shard &&
               calls[i].batch->loss().router_aux_loss_coef == 0 &&
               seen.insert(calls[i].model_id).second) {
      joint.push_back({*t, calls[i].batch});
      joint_index.push_back(i);
    } else {
      alone.push_back(i);
    }
  }
  auto run_alone = [&](const JointCall& call) {
    return Guarded(what, [&] {
      return RunForward(impl_->Context(), *call.model, call.batch->data(), call.batch->loss(),
                        backward);
    });
  };
  if (joint.size() == 1) {
    alone.insert(alone.begin(), joint_index.front());
    joint.clear();
  }
  if (!joint.empty()) {
    std::vector<absl::StatusOr<ForwardBackwardResult>> shared;
    try {
      shared = RunJoint(impl_->Context(), joint, backward, run_alone);
    } catch (...) {
      // Only before any call committed (RunJoint guards its commits): nothing was applied.
      shared.assign(joint.size(), ExceptionStatus(what, std::current_exception()));
    }
    for (size_t k = 0; k < joint.size(); ++k) results[joint_index[k]] = std::move(shared[k]);
  }
  std::sort(alone.begin(), alone.end());
  for (size_t i : alone) {
    // Found above; a model's second call runs after its first.
    ModelState* t = *impl_->Find(calls[i].model_id);
    results[i] = run_alone({t, calls[i].batch});
  }
  return results;
}

std::vector<absl::StatusOr<OptimStepResult>> ModelRunner::OptimStepJoint(
    const std::vector<Step>& steps) {
  absl::MutexLock lock(&impl_->mu);
  std::vector<absl::StatusOr<OptimStepResult>> results(steps.size(),
                                                       absl::InternalError("joint step: not run"));
  std::vector<JointStep> joint;
  std::vector<size_t> joint_index, alone;
  std::set<std::string> seen;
  for (size_t i = 0; i < steps.size(); ++i) {
    absl::StatusOr<ModelState*> t = impl_->Find(steps[i].model_id);
    absl::Status st = t.status();
    if (st.ok()) st = impl_->NoOpenStream(steps[i].model_id);
    if (!st.ok()) {
      results[i] = st;
    } else if (seen.insert(steps[i].model_id).second) {
      joint.push_back({*t, steps[i].params});
      joint_index.push_back(i);
    } else {
      alone.push_back(i);
    }
  }
  std::vector<absl::StatusOr<OptimStepResult>> shared = StepJoint(impl_->Context(), joint);
  for (size_t k = 0; k < joint.size(); ++k) results[joint_index[k]] = std::move(shared[k]);
  for (size_t i : alone) {
    ModelState* t = *impl_->Find(steps[i].model_id);
    results[i] = Guarded("optim_step",
                         [&] { return ApplyOptimStep(impl_->Context(), *t, steps[i].params); });
  }
  return results;
}

absl::StatusOr<ForwardBackwardResult> ModelRunner::Forward(
    const std::string& model_id, const std::vector<Datum>& data, const std::string& loss_fn,
    const std::map<std::string, double>& loss_fn_config) {
  ASSIGN_OR_RETURN(Batch batch, Batch::Check(data, loss_fn, loss_fn_config, limits()));
  return Forward(model_id, batch);
}

absl::StatusOr<ForwardBackwardResult> ModelRunner::ForwardBackward(
    const std::string& model_id, const std::vector<Datum>& data, const std::string& loss_fn,
    const std::map<std::string, double>& loss_fn_config) {
  ASSIGN_OR_RETURN(Batch batch, Batch::Check(data, loss_fn, loss_fn_config, limits()));
  return ForwardBackward(model_id, batch);
}

absl::StatusOr<OptimStepResult> ModelRunner::OptimStep(const std::string& model_id,
                                                       const AdamParams& params) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  RETURN_IF_ERROR(impl_->NoOpenStream(model_id));
  return Guarded("optim_step", [&] { return ApplyOptimStep(impl_->Context(), *t, params); });
}

absl::StatusOr<int64_t> ModelRunner::BeginStream(
    const std::string& model_id, const std::string& loss_fn,
    const std::map<std::string, double>& loss_fn_config) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  RETURN_IF_ERROR(impl_->NoOpenStream(model_id));
  ASSIGN_OR_RETURN(ResolvedLoss loss, ResolveLoss(loss_fn, loss_fn_config));
  RETURN_IF_ERROR(CheckLossForModel(loss, limits()));
  // Its staged gradient, reserved where calls reserve theirs (the CPU's account).
  absl::StatusOr<Reservation> gradient = Reservation();
  if (MemoryAccount* account = impl_->Context().account) {
    int64_t bytes = 0;
    for (const auto& [name, p] : t->params) bytes += 2 * p.numel() * p.element_size();
    if (t->sharded) {
      for (const ShardedUnit& u : t->sharded->units()) bytes += u.param_C.nbytes();
    }
    gradient = account->Reserve(bytes, "forward_backward stream: its staged gradient",
                                ". Retry the stream later");
  }
  if (!gradient.ok()) return gradient.status();
  return Guarded("stream", [&]() -> absl::StatusOr<int64_t> {
    Impl::Stream s;
    s.gradient = *std::move(gradient);
    s.stage = std::make_unique<CallStage>(impl_->Context(), *t, loss, /*backward=*/true);
    s.loss = loss;
    const int64_t id = impl_->next_stream++;
    impl_->streams.emplace(id, std::move(s));
    return id;
  });
}

absl::Status ModelRunner::StreamAppend(int64_t stream_id, std::vector<Datum> data) {
  ResolvedLoss loss;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->streams.find(stream_id);
    if (it == impl_->streams.end()) return absl::NotFoundError("stream: unknown or closed stream");
    loss = it->second.loss;
  }
  ASSIGN_OR_RETURN(Batch batch, Batch::Check(std::move(data), std::move(loss), limits()));
  return StreamAppend(stream_id, std::move(batch));
}

absl::Status ModelRunner::StreamAppend(int64_t stream_id, Batch batch) {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->streams.find(stream_id);
  if (it == impl_->streams.end()) return absl::NotFoundError("stream: unknown or closed stream");
  Impl::Stream& s = it->second;
  RETURN_IF_ERROR(s.failed);
  if (!(batch.loss() == s.loss)) {
    return absl::InvalidArgumentError("loss_fn: not the loss the stream began with");
  }
  std::vector<Datum> data = std::move(batch).TakeData();
  for (Datum& d : data) {
    s.buffered_tokens += static_cast<int64_t>(d.tokens.size());
    s.buffered.push_back(std::move(d));
  }
  if (s.buffered_tokens < impl_->config.micro_batch_tokens) return absl::OkStatus();
  // A full budget is buffered: run it now (lazy intake) instead of holding it until the end.
  absl::Status st = impl_->RunStream(s);
  s.buffered.clear();
  s.buffered_tokens = 0;
  if (!st.ok()) s.failed = st;
  return st;
}

absl::StatusOr<ForwardBackwardResult> ModelRunner::FinishStream(int64_t stream_id) {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->streams.find(stream_id);
  if (it == impl_->streams.end()) return absl::NotFoundError("stream: unknown or closed stream");
  Impl::Stream s = std::move(it->second);
  impl_->streams.erase(it);
  absl::Status local = s.failed;
  if (local.ok() && !s.buffered.empty()) local = impl_->RunStream(s);
  // Every rank commits (or refuses) together, whatever happened locally.
  return Guarded("stream", [&] { return s.stage->Commit(local); });
}

void ModelRunner::AbortStream(int64_t stream_id) {
  absl::MutexLock lock(&impl_->mu);
  impl_->streams.erase(stream_id);
}

namespace {

// Rank 0 alone commits a checkpoint, and its outcome is every rank's: a save refused there (a
// name taken, a full disk) must not read as "rank 0 failed, the others succeeded", which would
// stop the job as diverged although a save changes no state.
absl::Status SendOutcome(Collectives& c, absl::Status st) {
  if (c.world_size() == 1) return st;
  std::string outcome = st.ok() ? "ok" : st.ToString();
  RETURN_IF_ERROR(c.BroadcastBytes(outcome, 0));
  return st;
}
absl::Status ReceiveOutcome(Collectives& c) {
  std::string outcome;
  RETURN_IF_ERROR(c.BroadcastBytes(outcome, 0));
  if (outcome == "ok") return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("on rank 0: ", outcome));
}

// A failure on any rank made every rank's: `mine`, or ABORTED with `others` where only another
// rank failed, so that the ranks agree on whether a step that changes their state succeeded.
absl::Status Agreed(Collectives& c, const absl::Status& mine, absl::string_view others) {
  bool ok = mine.ok();
  RETURN_IF_ERROR(c.AllAgree(ok));
  if (!mine.ok()) return mine;
  if (!ok) return absl::AbortedError(absl::StrCat(others, "; retry later"));
  return absl::OkStatus();
}

// A save every rank takes part in: rank 0 commits the checkpoint, running `first` in the
// directory it is committing; the other ranks run `others` with that directory once rank 0 has
// begun (and not at all when it could not begin: a name taken). Each step that can fail on one
// rank is followed by a collective that tells the others, so all ranks end with the same outcome:
// a failed save changes no state on any rank.
absl::Status SaveOnEveryRank(Collectives& c, const std::string& path, bool overwrite,
                             const std::function<absl::Status(const std::string& dir)>& first,
                             const std::function<absl::Status(const std::string& dir)>& others) {
  if (c.rank() != 0) {
    std::string dir;
    RETURN_IF_ERROR(c.BroadcastBytes(dir, 0));
    if (dir.empty()) return absl::AbortedError("rank 0 did not start the checkpoint");
    const absl::Status done = others(dir);
    RETURN_IF_ERROR(ReceiveOutcome(c));
    return done;
  }
  bool started = false;
  absl::Status st = CommitCheckpoint(path, overwrite, [&](const std::string& dir) {
    started = true;
    std::string shared = dir;
    RETURN_IF_ERROR(c.BroadcastBytes(shared, 0));
    return first(dir);
  });
  if (started) return SendOutcome(c, st);
  std::string none;  // the others wait for a directory, not an outcome
  RETURN_IF_ERROR(c.BroadcastBytes(none, 0));
  return st;
}

// Under --shard=optimizer every rank writes its own slices, in parallel, into the directory rank
// 0 is committing (the checkpoint root must be shared by all ranks, as loading already needs);
// rank 0 writes the parameters and, last, the manifest naming every rank's files.
absl::Status SaveSharded(Collectives& c, const ModelState& t, const CheckpointMeta& meta,
                         const std::string& path, const SaveStateOptions& options) {
  const bool sums = options.include_accumulated;
  // Writes this rank's files into `dir` and gathers every rank's digests, or every rank's failure.
  auto write_shards =
      [&](const std::string& dir) -> absl::StatusOr<std::map<std::string, FileDigest>> {
    auto mine = WriteStateShard(*t.shard, sums, meta.training_dtype, dir);
    std::string line = mine.ok() ? "ok" : absl::StrCat("failed: ", mine.status().message());
    if (mine.ok()) {
      for (const auto& [name, d] : *mine)
        absl::StrAppend(&line, " ", name, " ", d.bytes, " ", d.fnv64);
    }
    ASSIGN_OR_RETURN(std::vector<std::string> all, c.AllGatherBytes(line));
    std::map<std::string, FileDigest> files;
    for (size_t r = 0; r < all.size(); ++r) {
      std::vector<std::string> words = absl::StrSplit(all[r], ' ');
      if (words[0] != "ok") {
        return absl::InternalError(absl::StrCat("save_state: rank ", r, " ", all[r]));
      }
      for (size_t i = 1; i + 2 < words.size(); i += 3) {
        FileDigest& d = files[words[i]];
        if (!absl::SimpleAtoi(words[i + 1], &d.bytes) ||
            !absl::SimpleAtoi(words[i + 2], &d.fnv64)) {
          return absl::InternalError(absl::StrCat("save_state: rank ", r, " sent ", all[r]));
        }
      }
    }
    return files;
  };
  return SaveOnEveryRank(
      c, path, options.overwrite,
      [&](const std::string& dir) -> absl::Status {
        ASSIGN_OR_RETURN(auto files, write_shards(dir));
        return WriteShardedTrainingState(t, meta, sums, c.world_size(), files, dir);
      },
      [&](const std::string& dir) { return write_shards(dir).status(); });
}

// Under --shard=full every rank takes part in gathering each tensor whole, and rank 0 writes
// (runner/checkpoint/param_shard_io.h).
absl::Status SaveGathered(Collectives& c, const ModelState& t, const CheckpointMeta& meta,
                          const std::string& path, const SaveStateOptions& options) {
  const bool sums = options.include_accumulated;
  return SaveOnEveryRank(
      c, path, options.overwrite,
      [&](const std::string& dir) { return WriteGatheredTrainingState(c, t, meta, sums, dir); },
      [&](const std::string&) { return WriteGatheredTrainingState(c, t, meta, sums, ""); });
}

}  // namespace

absl::Status ModelRunner::SaveState(const std::string& model_id, const std::string& path,
                                    const SaveStateOptions& options) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  if (t->accumulated_tokens > 0 && !options.include_accumulated) {
    return absl::FailedPreconditionError(
        absl::StrCat("save_state: model ", model_id, " has ", t->accumulated_tokens,
                     " accumulated tokens not yet applied; call optim_step first or save with "
                     "include_accumulated"));
  }
  CheckpointMeta meta{options.last_seq_id, impl_->base_fingerprint, impl_->config.base_model_path,
                      impl_->dtype == at::kDouble ? "float64" : "float32"};
  // Files are written a tensor at a time (SaveSafetensorsFile); what a save holds beside the model
  // is the copy of its gradient sum it reduces over the ranks and saves and, under expert
  // parallelism, the other ranks' experts it gathers (parameters, moments and sums); a sharded
  // model's save gathers one unit whole at a time on every rank. The ranks agree on the
  // reservation, so that one refusing does not leave the others in a collective.
  Reservation held;
  if (!t->shard) {
    const int64_t elem = static_cast<int64_t>(at::elementSize(impl_->TrainDType()));
    int64_t bytes = 0, experts = 0;
    std::string what = "save_state: a copy of the gradient sum while it is saved";
    if (t->sharded) {
      bytes = impl_->GatherBytes(*t->sharded);
      what = "save_state: the largest unit of the sharded model, gathered whole while it is saved";
    } else {
      for (const auto& [name, p] : t->params) {
        const int64_t n = static_cast<int64_t>(p.numel()) * elem;
        if (options.include_accumulated) bytes += n;
        if (impl_->experts && ExpertParallel::ExpertOf(name) >= 0) experts += n;
      }
    }
    if (impl_->experts) {
      // GatherExperts holds every rank's experts of the group, its own included, per state.
      bytes += experts * impl_->experts->size() * (options.include_accumulated ? 4 : 3);
      what =
          "save_state: a copy of the gradient sum and the experts gathered from the other ranks "
          "while they are saved";
    }
    ASSIGN_OR_RETURN(
        held, impl_->ReserveOnEveryRank(bytes, what, ". Retry later, or save after optim_step",
                                        "save_state"));
  }
  return Guarded("save_state", [&]() -> absl::Status {
    if (t->shard) return SaveSharded(*impl_->collectives, *t, meta, path, options);
    if (t->sharded) return SaveGathered(*impl_->collectives, *t, meta, path, options);
    // Each rank holds its share of the gradient until optim_step reduces them (Note [Reduce once]
    // in runner/dist/collectives.h); a checkpoint holds their sum.
    std::map<std::string, at::Tensor> accumulated;
    if (options.include_accumulated) {
      std::vector<at::Tensor> sums;
      for (const auto& [name, g] : t->grad_sum) sums.push_back(accumulated[name] = g.clone());
      RETURN_IF_ERROR(ReduceGradients(impl_->Context(), t->grad_sum, sums));
    }
    // Under expert parallelism the checkpoint holds every expert: each group gathers its own
    // ranks' (every rank takes part), and rank 0 writes them.
    const ModelState* whole = t;
    ModelState gathered;
    if (impl_->experts) {
      gathered.id = t->id;
      gathered.options = t->options;
      gathered.step = t->step;
      gathered.skipped_steps = t->skipped_steps;
      gathered.accumulated_tokens = t->accumulated_tokens;
      gathered.accumulated_sequences = t->accumulated_sequences;
      ASSIGN_OR_RETURN(gathered.params, impl_->experts->GatherExperts(t->params));
      ASSIGN_OR_RETURN(gathered.exp_avg, impl_->experts->GatherExperts(t->exp_avg));
      ASSIGN_OR_RETURN(gathered.exp_avg_sq, impl_->experts->GatherExperts(t->exp_avg_sq));
      ASSIGN_OR_RETURN(accumulated, impl_->experts->GatherExperts(accumulated));
      whole = &gathered;
    }
    Collectives& c = *impl_->collectives;
    if (c.rank() != 0) return ReceiveOutcome(c);
    return SendOutcome(c, CommitCheckpoint(path, options.overwrite, [&](const std::string& dir) {
                         return WriteTrainingState(
                             *whole, meta, options.include_accumulated ? &accumulated : nullptr,
                             dir);
                       }));
  });
}

namespace {

// Copies a checked checkpoint into a model. Called with the runner's lock held, after
// CheckCompatible, so it cannot fail halfway.
// `rank`: replicas put the checkpoint's gradient sum on rank 0 and zeros on the others (see
// SaveState). Shards take their slice of every whole tensor, the sum included (it is already
// reduced), so a checkpoint of any world size and sharding loads at any other.
// Under expert parallelism (`experts` set) an expert's sum goes to its holder in the first group.
void ApplyLoadedState(ModelState& t, const LoadedState& s, bool with_optimizer, int rank,
                      const ExpertParallel* experts) {
  if (t.sharded) return ScatterLoadedState(t, s, with_optimizer);
  at::NoGradGuard no_grad;
  const bool first_holder =
      experts == nullptr || experts->replicas() == nullptr || experts->replicas()->rank() == 0;
  std::vector<at::Tensor> avg, avg_sq, sums;  // whole tensors in name order
  for (auto& [name, p] : t.params) {
    p.copy_(s.params.at(name));
    avg.push_back(with_optimizer ? s.exp_avg.at(name) : at::zeros_like(p));
    avg_sq.push_back(with_optimizer ? s.exp_avg_sq.at(name) : at::zeros_like(p));
    auto g = s.grad_sum.find(name);
    const bool here =
        experts != nullptr && ExpertParallel::ExpertOf(name) >= 0 ? first_holder : rank == 0;
    sums.push_back(g != s.grad_sum.end() && (t.shard || here) ? g->second : at::zeros_like(p));
  }
  if (t.shard) {
    t.shard->Scatter(avg, t.shard->exp_avg_C);
    t.shard->Scatter(avg_sq, t.shard->exp_avg_sq_C);
    t.shard->Scatter(sums, t.shard->grad_sum_C);
  } else {
    size_t i = 0;
    for (const auto& [name, p] : t.params) {
      t.exp_avg[name].copy_(avg[i]);
      t.exp_avg_sq[name].copy_(avg_sq[i]);
      t.grad_sum[name].copy_(sums[i]);
      ++i;
    }
  }
  t.step = with_optimizer ? s.step : 0;
  t.skipped_steps = with_optimizer ? s.skipped_steps : 0;
  t.accumulated_tokens = s.grad_sum.empty() ? 0 : s.accumulated_tokens;
  t.accumulated_sequences = s.grad_sum.empty() ? 0 : s.accumulated_sequences;
}

}  // namespace

absl::StatusOr<LoadedState> ModelRunner::Impl::ReadState(const std::string& path, Reservation* held,
                                                         const ModelState* into) const {
  ASSIGN_OR_RETURN(std::string dir, ResolveCheckpoint(path));
  const at::ScalarType train = dtype == at::kDouble ? at::kDouble : at::kFloat;
  return Guarded("load_state", [&]() -> absl::StatusOr<LoadedState> {
    std::optional<ReadSlices> slices;
    if (into != nullptr && into->sharded) slices = SlicesOf(*into);
    return ReadTrainingState(
        dir, base_fingerprint, train,
        [&](int64_t bytes) -> absl::Status {
          ASSIGN_OR_RETURN(
              *held, account->Reserve(bytes, "load_state: the checkpoint's tensors while read",
                                      ". Delete a model, or retry later"));
          return absl::OkStatus();
        },
        slices ? &*slices : nullptr);
  });
}

absl::Status ModelRunner::LoadState(const std::string& model_id, const std::string& path,
                                    bool with_optimizer) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  RETURN_IF_ERROR(impl_->NoOpenStream(model_id));
  if (t->accumulated_tokens > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "load_state: model ", model_id, " has accumulated gradients; load into a fresh model"));
  }
  // Read and check everything before touching the model: a refused load changes nothing.
  Reservation held;
  absl::StatusOr<LoadedState> s = impl_->ReadState(path, &held, t);
  RETURN_IF_ERROR(impl_->AgreeOnLoad(s.ok() ? impl_->Check(*t, *s) : s.status()));
  return Guarded("load_state", [&]() -> absl::Status {
    ApplyLoadedState(*t, *s, with_optimizer, impl_->collectives->rank(), impl_->experts.get());
    return absl::OkStatus();
  });
}

absl::StatusOr<std::string> ModelRunner::CreateModelFromState(const std::string& path,
                                                              bool with_optimizer,
                                                              const std::string& model_id) {
  absl::StatusOr<LoadedState> s;
  Reservation held;
  // A full fine-tune under --shard=full is made first, from its manifest, so that each rank
  // reads only its slices into it (a corrupt file is then found after the model was admitted);
  // anything else is read and verified once, then applied to the new model.
  bool sharded = false;
  absl::StatusOr<CreateModelOptions> options = absl::UnknownError("not read");
  if (impl_->config.shard == ShardMode::kFull) {
    absl::StatusOr<std::string> dir = ResolveCheckpoint(path);
    options = dir.ok() ? ReadCheckpointOptions(*dir, impl_->base_fingerprint) : dir.status();
    sharded = options.ok() && !options->lora;
  }
  if (!sharded) {
    absl::MutexLock lock(&impl_->mu);
    s = impl_->ReadState(path, &held);
    options = s.ok() ? absl::StatusOr<CreateModelOptions>(s->options) : s.status();
  }
  absl::StatusOr<std::string> created =
      options.ok() ? CreateModel(*options, model_id) : options.status();
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<ModelState*> t = created.ok() ? impl_->Find(*created) : created.status();
  if (sharded && t.ok()) {
    s = impl_->ReadState(path, &held, *t);
    if (s.ok() &&
        (s->options.lora.has_value() || s->options.loss_reduction != options->loss_reduction)) {
      s = absl::FailedPreconditionError("load_state: the checkpoint changed while it was read");
    }
  }
  absl::Status st = impl_->AgreeOnLoad(!t.ok()   ? t.status()
                                       : !s.ok() ? s.status()
                                                 : impl_->Check(**t, *s));
  if (!created.ok()) return st;
  const std::string& id = *created;
  if (st.ok()) {
    st = Guarded("load_state", [&]() -> absl::Status {
      ApplyLoadedState(**t, *s, with_optimizer, impl_->collectives->rank(), impl_->experts.get());
      return absl::OkStatus();
    });
  }
  if (!st.ok()) {
    impl_->models.erase(id);
    return st;
  }
  return id;
}

absl::Status ModelRunner::SaveWeightsForSampler(const std::string& model_id,
                                                const std::string& path, bool merged,
                                                bool overwrite) {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  if (impl_->experts) {
    if (merged) return impl_->AllExperts("save_weights_for_sampler");
    return impl_->SaveAdapterOfExperts(*t, path, overwrite);
  }
  if (t->sharded) {
    // Every rank gathers the parameters a unit at a time, and rank 0 streams them into the file.
    if (!merged) {
      return absl::FailedPreconditionError(
          "a full fine-tune has no adapter; export it merged instead");
    }
    ASSIGN_OR_RETURN(
        Reservation gathering,
        impl_->ReserveOnEveryRank(
            impl_->GatherBytes(*t->sharded),
            "save_weights_for_sampler: the largest unit of the sharded model, gathered whole",
            ". Retry later", "save_weights_for_sampler"));
    Collectives& c = *impl_->collectives;
    return Guarded("save_weights_for_sampler", [&] {
      return SaveOnEveryRank(
          c, path, overwrite,
          [&](const std::string& dir) {
            return WriteGatheredMergedModel(c, *t, impl_->model_config, impl_->base_fingerprint,
                                            dir);
          },
          [&](const std::string&) {
            return WriteGatheredMergedModel(c, *t, impl_->model_config, impl_->base_fingerprint,
                                            "");
          });
    });
  }
  if (merged && t->lora && impl_->base_shard) {
    return impl_->SaveMergedOnShardedBase(*t, path, overwrite);
  }
  // A merged export makes each adapted weight as the file reaches it: the largest weight, the
  // adapter's product of its size, and their sum in float32, held at once.
  Reservation held;
  if (merged && t->lora) {
    int64_t largest = 0;
    for (const auto& [name, w] : impl_->base.Named(impl_->model_config)) {
      largest =
          std::max(largest, w.numel() * static_cast<int64_t>(at::elementSize(impl_->TrainDType())));
    }
    ASSIGN_OR_RETURN(
        held, impl_->account->Reserve(3 * largest, "save_weights_for_sampler: merging one weight",
                                      ". Retry later"));
  }
  return Guarded("save_weights_for_sampler", [&] {
    return CommitCheckpoint(path, overwrite, [&](const std::string& dir) {
      return merged ? WriteMergedModel(*t, impl_->model_config, impl_->base,
                                       impl_->base_fingerprint, dir)
                    : WritePeftAdapter(*t, impl_->config.base_model_path, impl_->base_fingerprint,
                                       dir);
    });
  });
}

// Each group gathers its ranks' experts' pairs (every rank takes part, its room for them reserved
// and agreed first), and rank 0 writes the whole adapter, as SaveState writes every expert.
absl::Status ModelRunner::Impl::SaveAdapterOfExperts(const ModelState& t, const std::string& path,
                                                     bool overwrite) {
  if (!t.options.lora) {
    return absl::FailedPreconditionError(
        "a full fine-tune has no adapter, and its merged export is not built with its experts "
        "spread over ranks (--expert_parallel): save_state it instead");
  }
  int64_t bytes = 0;
  for (const auto& [name, p] : t.params) {
    if (ExpertParallel::ExpertOf(name) >= 0) bytes += static_cast<int64_t>(p.nbytes());
  }
  ASSIGN_OR_RETURN(Reservation held,
                   ReserveOnEveryRank(bytes * experts->size(),
                                      "save_weights_for_sampler: the adapter's experts gathered "
                                      "from the other ranks while they are written",
                                      ". Retry later", "save_weights_for_sampler"));
  return Guarded("save_weights_for_sampler", [&]() -> absl::Status {
    ModelState whole;
    whole.id = t.id;
    whole.options = t.options;
    whole.step = t.step;
    ASSIGN_OR_RETURN(whole.params, experts->GatherExperts(t.params));
    Collectives& c = *collectives;
    if (c.rank() != 0) return ReceiveOutcome(c);
    return SendOutcome(c, CommitCheckpoint(path, overwrite, [&](const std::string& dir) {
                         return WritePeftAdapter(whole, config.base_model_path, base_fingerprint,
                                                 dir);
                       }));
  });
}

// Every rank gathers the base a unit at a time, and rank 0 merges each weight into the file as it
// reaches it: a rank holds the largest unit whole (GatherBytes), and rank 0 beside it one merged
// weight (the adapter's product and the sum, in the training dtype).
absl::Status ModelRunner::Impl::SaveMergedOnShardedBase(const ModelState& t,
                                                        const std::string& path, bool overwrite) {
  const ParamShard& base = *base_shard;
  const int64_t merging =
      2 * base.LargestTensorValues() * static_cast<int64_t>(at::elementSize(TrainDType()));
  ASSIGN_OR_RETURN(Reservation held,
                   ReserveOnEveryRank(GatherBytes(base) + merging,
                                      "save_weights_for_sampler: the largest unit of the "
                                      "sharded base, gathered whole, and one merged weight",
                                      ". Retry later", "save_weights_for_sampler"));
  Collectives& c = *collectives;
  auto write = [&](const std::string& dir) {
    return WriteGatheredMergedLora(c, t, base, model_config, base_fingerprint, dir);
  };
  return Guarded("save_weights_for_sampler", [&] {
    return SaveOnEveryRank(c, path, overwrite, write,
                           [&](const std::string&) { return write(""); });
  });
}

namespace {

// Every tensor copied (no graph) in the compute dtype; a tied head stays the embedding's alias.
// Every use of a weight casts it to the compute dtype (kernels/linear.h, rms_norm.h, the head and
// the embedding), so the copy is bitwise what the trainer reads from its fp32 masters under bf16,
// in half their memory, and a decode step casts nothing.
BaseWeights FrozenWeights(const BaseWeights& w, bool tied, at::ScalarType dtype, int64_t* bytes) {
  auto copy = [dtype, bytes](const at::Tensor& t) {
    if (!t.defined()) return t;
    at::Tensor c = t.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true);
    *bytes += static_cast<int64_t>(c.nbytes());
    return c;
  };
  BaseWeights out;
  out.embed_VD = copy(w.embed_VD);
  out.final_norm_D = copy(w.final_norm_D);
  out.lm_head_VD = tied ? out.embed_VD : copy(w.lm_head_VD);
  for (const LayerWeights& L : w.layers) {
    std::vector<at::Tensor> fields;
    for (const at::Tensor* t : L.All()) fields.push_back(copy(*t));
    out.layers.push_back(LayerWeights::FromAll(std::move(fields)));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Policy>> ModelRunner::FreezePolicy(const std::string& model_id,
                                                                        int64_t experts_key) const {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->experts && !model_id.empty() && experts_key <= 0) {
    return absl::InvalidArgumentError(
        "create_sampler: with the experts spread over ranks (--expert_parallel), every rank "
        "freezes a model under a key rank 0 draws");
  }
  auto policy = std::make_shared<Policy>();
  policy->config = impl_->model_config;
  policy->compute_dtype = impl_->dtype;
  policy->device = impl_->device;
  policy->rope = impl_->rope;
  policy->texts = impl_->texts;
  policy->model_id = model_id;
  if (model_id.empty()) {
    impl_->OnBase(*policy);
    return std::shared_ptr<const Policy>(std::move(policy));
  }
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  if (impl_->experts) return FreezeSpread(*t, experts_key, std::move(policy));
  if (t->sharded) {
    // Every rank gathers the parameters a unit at a time (ParamShard::GatherWhole); rank 0 keeps
    // them in the compute dtype, and its outcome is every rank's. The ranks agree before the first
    // gather that each has room for a unit whole, and rank 0 for the copy as well (held in the
    // account for the policy's life at world size 1 only, as every policy: Policy::memory).
    Collectives& c = *impl_->collectives;
    const bool keep = c.rank() == 0;
    const int64_t copy_bytes =
        t->sharded->values() * static_cast<int64_t>(at::elementSize(impl_->dtype));
    ASSIGN_OR_RETURN(policy->memory, impl_->ReservePolicy(copy_bytes));
    const bool copy_unheld = keep && c.world_size() > 1;
    ASSIGN_OR_RETURN(
        Reservation gathering,
        impl_->ReserveOnEveryRank(
            impl_->GatherBytes(*t->sharded) + (copy_unheld ? copy_bytes : 0),
            copy_unheld ? "create_sampler: the sampler's copy of the sharded model, and its "
                          "largest unit gathered whole"
                        : "create_sampler: the largest unit of the sharded model, gathered whole",
            ". Delete samplers or models, or retry later", "create_sampler"));
    absl::StatusOr<BaseWeights> w =
        Guarded("create_sampler", [&] { return t->sharded->GatherWhole(c, impl_->dtype, keep); });
    if (!keep) {
      RETURN_IF_ERROR(w.status());
      RETURN_IF_ERROR(ReceiveOutcome(c));
      return nullptr;
    }
    RETURN_IF_ERROR(SendOutcome(c, w.status()));
    policy->step = t->step;
    policy->weights = *std::move(w);
    policy->bytes = copy_bytes;
    return std::shared_ptr<const Policy>(std::move(policy));
  }
  // The copy is admitted before it is made.
  int64_t copy_bytes = 0;
  const int64_t element = static_cast<int64_t>(at::elementSize(impl_->dtype));
  if (t->full) {
    for (const auto& [name, w] : t->full->Named(impl_->model_config)) {
      copy_bytes += w.numel() * element;
    }
  }
  if (t->lora) {
    for (const auto& [name, p] : t->lora->Parameters()) copy_bytes += p.numel() * element;
  }
  ASSIGN_OR_RETURN(policy->memory, impl_->ReservePolicy(copy_bytes));
  return Guarded("freezing a policy", [&]() -> absl::StatusOr<std::shared_ptr<const Policy>> {
    impl_->Freeze(*t, *policy);
    return std::shared_ptr<const Policy>(std::move(policy));
  });
}

void ModelRunner::Impl::Freeze(const ModelState& t, Policy& p) const {
  p.step = t.step;
  if (t.full) {
    p.weights = FrozenWeights(*t.full, model_config.tie_word_embeddings, dtype, &p.bytes);
    if (experts) p.spread = spread;
  } else {
    OnBase(p);
  }
  if (t.lora) {
    p.lora = t.lora->Frozen(dtype);
    for (const auto& [name, pair] : p.lora->Parameters()) {
      p.bytes += static_cast<int64_t>(pair.nbytes());
    }
  }
}

absl::StatusOr<std::shared_ptr<const Policy>> ModelRunner::FreezeSpread(
    const ModelState& t, int64_t key, std::shared_ptr<Policy> policy) const {
  // Each rank of rank 0's group copies what it holds of the model (its experts, and every
  // replicated tensor); the others serve no forward and copy nothing. The ranks agree on the
  // outcome, so that a copy that failed on one fails on all.
  Collectives& c = *impl_->collectives;
  const bool copies = c.rank() < impl_->experts->size();
  absl::Status mine;
  if (copies) {
    mine = Guarded("freezing a policy", [&] {
      impl_->Freeze(t, *policy);
      return absl::OkStatus();
    });
  }
  RETURN_IF_ERROR(Agreed(c, mine, "create_sampler: another rank could not copy its experts"));
  if (!copies) return nullptr;
  return impl_->Spread(key, std::move(policy));
}

absl::StatusOr<std::shared_ptr<const Policy>> ModelRunner::LoadSpread(const std::string& path,
                                                                      int64_t key) const {
  if (key <= 0) {
    return absl::InvalidArgumentError(
        "create_sampler: with the experts spread over ranks (--expert_parallel), every rank "
        "loads an export under a key rank 0 draws");
  }
  // Each rank of rank 0's group reads its own experts' pairs and every replicated one; the ranks
  // agree on the outcome, as a bad path fails on all of them alike.
  Collectives& c = *impl_->collectives;
  const bool reads = c.rank() < impl_->experts->size();
  absl::StatusOr<std::shared_ptr<Policy>> made = nullptr;
  if (reads) {
    made = Guarded("loading a policy", [&]() -> absl::StatusOr<std::shared_ptr<Policy>> {
      ASSIGN_OR_RETURN(std::string dir, ResolveCheckpoint(path));
      // Refused before any tensor is read: a merged export holds every expert whole.
      std::error_code ec;
      if (!std::filesystem::exists(std::filesystem::path(dir) / "adapter_config.json", ec)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "path: ", path,
            " is not an adapter export; with its experts spread over ranks (--expert_parallel) "
            "this server samples adapter exports alone"));
      }
      ASSIGN_OR_RETURN(SamplerWeights w,
                       ReadSamplerWeights(dir, impl_->model_config, impl_->base_fingerprint,
                                          impl_->dtype, impl_->device, impl_->Keep()));
      if (!w.lora) {
        return absl::FailedPreconditionError(
            absl::StrCat("path: ", path,
                         " is a merged export, whose experts this server (--expert_parallel) "
                         "does not spread; sample an adapter export instead"));
      }
      auto policy = std::make_shared<Policy>();
      policy->config = w.config;
      policy->compute_dtype = impl_->dtype;
      policy->device = impl_->device;
      policy->rope = impl_->rope;
      policy->texts = impl_->texts;
      policy->step = w.step;
      impl_->OnBase(*policy);
      policy->lora = std::move(w.lora);
      for (const auto& [name, p] : policy->lora->Parameters()) {
        policy->bytes += static_cast<int64_t>(p.nbytes());
      }
      return policy;
    });
  }
  RETURN_IF_ERROR(Agreed(c, made.status(),
                         "create_sampler: another rank could not read its experts of the export"));
  if (!reads) return nullptr;
  return impl_->Spread(key, *std::move(made));
}

std::vector<int64_t> ModelRunner::TakeDropped() const {
  absl::MutexLock lock(&impl_->dropped->mu);
  return std::exchange(impl_->dropped->keys, {});
}

void ModelRunner::DropFrozen(const std::vector<int64_t>& keys) const {
  std::vector<std::shared_ptr<const Policy>> gone;  // freed once frozen_mu is released
  absl::MutexLock lock(&impl_->frozen_mu);
  for (int64_t key : keys) {
    auto it = impl_->frozen.find(key);
    if (it == impl_->frozen.end()) continue;
    gone.push_back(std::move(it->second));
    impl_->frozen.erase(it);
  }
}

bool ModelRunner::SpreadsExperts() const {
  return impl_->experts != nullptr;
}

void ModelRunner::SetSpreadExperts(SpreadExperts spread) {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->experts) impl_->spread = std::make_shared<const SpreadExperts>(std::move(spread));
}

absl::Status ModelRunner::ForwardSpreadExperts(const ExpertForward& forward) const {
  if (!impl_->experts) {
    return absl::FailedPreconditionError("expert_forward: this server holds every expert");
  }
  // Fixed since Create, as the collectives are: no lock (the server runs one command at a time).
  // Inference on every rank: a serving rank runs only the experts that received rows.
  at::NoGradGuard no_grad;
  const ExpertParallel& ep = *impl_->experts;
  Collectives& c = *impl_->collectives;
  absl::Status mine;
  if (c.rank() == 0) {
    if (forward) {
      const LeadSlots lead{[&ep](int64_t layer, int64_t key) { return ep.Leading(layer, key); }};
      mine = Guarded("sample", [&] {
        forward(lead);
        return absl::OkStatus();
      });
    }
    // Only a failed exchange is UNAVAILABLE: the group is out of step, and the job is broken.
    if (mine.code() == absl::StatusCode::kUnavailable) return mine;
    RETURN_IF_ERROR(ep.EndLead());
  } else if (c.rank() < ep.size()) {  // rank 0's group
    mine = ep.Serve([this](int64_t layer, int64_t key) { return impl_->ServedExperts(layer, key); },
                    at::TensorOptions().dtype(impl_->dtype).device(impl_->device),
                    impl_->model_config.hidden_size);
    if (mine.code() == absl::StatusCode::kUnavailable) return mine;
  }
  // Rank 0 then drops what the forward computed.
  return Agreed(c, mine, "sample: another rank could not run its experts for a forward");
}

bool ModelRunner::Gathers(const std::string& model_id) const {
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<ModelState*> t = impl_->Find(model_id);
  return t.ok() && (*t)->sharded.has_value();
}

void ModelRunner::SetGatherBase(GatherBase gather) {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->base_shard) impl_->gather_base = std::make_shared<const GatherBase>(std::move(gather));
}

absl::Status ModelRunner::ForwardGatheredBase(const BaseForward& forward) const {
  if (!impl_->base_shard) {
    return absl::FailedPreconditionError("base_forward: this server holds its base whole");
  }
  // Fixed since Create, as the collectives are: no lock, so the forward may take its time while
  // the ranks' commands wait for it (the server runs one command at a time).
  const ParamShard& s = *impl_->base_shard;
  Collectives& c = *impl_->collectives;
  const ShardedUnit& rest_unit = s.units().front();
  const int64_t rest_bytes =
      rest_unit.state.layout.chunk() * c.world_size() * rest_unit.param_C.element_size();
  ASSIGN_OR_RETURN(Reservation held,
                   impl_->ReserveOnEveryRank(
                       rest_bytes + impl_->GatherBytes(s),
                       "sample: the sharded base's embedding and head, and its largest layer, "
                       "gathered whole for a forward",
                       "; retry later", "sample"));
  ASSIGN_OR_RETURN(BaseWeights rest, s.GatherRest(c));
  // The layers are gathered in order, one per ask; those a failed forward did not reach are
  // gathered after it, so every rank runs the same collectives.
  const int64_t L = impl_->model_config.num_hidden_layers;
  int64_t next = 0;
  absl::Status gathers;
  LayerSource layers;
  layers.gather = [&](int64_t layer) {
    if (layer != next) {
      ThrowStatus(absl::InternalError(
          absl::StrCat("sample: layer ", layer, " asked for out of order (", next, " next)")));
    }
    absl::StatusOr<LayerWeights> w = s.GatherLayer(c, next++);
    if (!w.ok()) {
      gathers = w.status();
      ThrowStatus(gathers);
    }
    return *std::move(w);
  };
  absl::Status outcome;
  if (forward) {
    outcome = Guarded("sample", [&] {
      forward(rest, layers);
      return absl::OkStatus();
    });
  }
  RETURN_IF_ERROR(gathers);  // the ranks are out of step: the job is broken
  for (; next < L; ++next) RETURN_IF_ERROR(s.GatherLayer(c, next).status());
  if (c.rank() != 0) return ReceiveOutcome(c);
  return SendOutcome(c, outcome);
}

absl::StatusOr<std::shared_ptr<const Policy>> ModelRunner::LoadPolicy(const std::string& path,
                                                                      int64_t experts_key) const {
  if (impl_->experts) return LoadSpread(path, experts_key);
  ASSIGN_OR_RETURN(std::string dir, ResolveCheckpoint(path));
  // The files' tensors are admitted before they are read: in the compute dtype, the files' size
  // times the dtypes' ratio (they are stored in float32 or float64), three times over (an
  // adapter's tensors as read, as made into an adapter, and frozen); the policy's exact bytes
  // once it is made.
  int64_t file_bytes = 0;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    std::error_code size_ec;
    const uintmax_t size = f.file_size(size_ec);
    if (!size_ec && f.path().extension() == ".safetensors") {
      file_bytes += static_cast<int64_t>(size);
    }
  }
  const int64_t ratio =
      std::max<int64_t>(1, static_cast<int64_t>(at::elementSize(impl_->dtype)) / 4);
  ASSIGN_OR_RETURN(std::shared_ptr<const Reservation> reading,
                   impl_->ReservePolicy(3 * ratio * file_bytes));
  // No lock: this reads only the fields fixed at creation (above Impl::mu), so a load of many
  // GB holds up no training call.
  return Guarded("loading a policy", [&]() -> absl::StatusOr<std::shared_ptr<const Policy>> {
    ASSIGN_OR_RETURN(SamplerWeights w,
                     ReadSamplerWeights(dir, impl_->model_config, impl_->base_fingerprint,
                                        impl_->dtype, impl_->device));
    auto policy = std::make_shared<Policy>();
    policy->config = w.config;
    policy->compute_dtype = impl_->dtype;
    policy->device = impl_->device;
    policy->rope = impl_->rope;    // the architecture matches the base's, so do its tables
    policy->texts = impl_->texts;  // and its vocabulary, so the base's tokenizer decodes it
    policy->step = w.step;
    auto count = [&](const std::map<std::string, at::Tensor>& m) {
      for (const auto& [name, t] : m) policy->bytes += static_cast<int64_t>(t.nbytes());
    };
    if (w.weights) {
      policy->weights = *std::move(w.weights);
      count(policy->weights.Named(policy->config));
    } else {
      impl_->OnBase(*policy);
    }
    if (w.lora) {
      count(w.lora->Parameters());
      policy->lora = std::move(w.lora);
    }
    reading.reset();  // the read's bound, now that its exact bytes are known
    ASSIGN_OR_RETURN(policy->memory, impl_->ReservePolicy(policy->bytes));
    return std::shared_ptr<const Policy>(std::move(policy));
  });
}

namespace {

NamedValues Values(std::string name, const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kCPU, at::kDouble).contiguous();
  NamedValues v{std::move(name), d.sizes().vec(), {}};
  v.values.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  return v;
}

// Snapshot of a model under --shard=full: its parameters gathered whole (a collective), or this
// rank's slices of the sums and moments, each named by its tensor and range.
absl::StatusOr<std::vector<NamedValues>> SnapshotSharded(Collectives& c, const ParamShard& shard,
                                                         StateKind kind) {
  std::map<std::string, NamedValues> sorted;
  for (const ShardedUnit& u : shard.units()) {
    if (kind == StateKind::kParams) {
      ASSIGN_OR_RETURN(std::vector<at::Tensor> whole, u.Gather(c));
      for (size_t i = 0; i < whole.size(); ++i)
        sorted.emplace(u.names[i], Values(u.names[i], whole[i]));
      continue;
    }
    const at::Tensor& flat_C = kind == StateKind::kGrads        ? u.state.grad_sum_C
                               : kind == StateKind::kAdamExpAvg ? u.state.exp_avg_C
                                                                : u.state.exp_avg_sq_C;
    const ShardLayout& l = u.state.layout;
    for (const auto& piece : l.Pieces(l.begin(l.rank()), l.end(l.rank()))) {
      std::string name = absl::StrCat(u.names[piece.tensor], "[", piece.tensor_offset, ":",
                                      piece.tensor_offset + piece.length, "]");
      sorted.emplace(name, Values(name, flat_C.narrow(0, piece.offset, piece.length)));
    }
  }
  std::vector<NamedValues> out;
  for (auto& [name, v] : sorted) out.push_back(std::move(v));
  return out;
}

}  // namespace

absl::StatusOr<std::vector<NamedValues>> ModelRunner::Snapshot(const std::string& model_id,
                                                               StateKind kind) const {
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(ModelState * t, impl_->Find(model_id));
  const std::map<std::string, at::Tensor>* src = &t->params;
  if (kind == StateKind::kGrads) src = &t->grad_sum;
  if (kind == StateKind::kAdamExpAvg) src = &t->exp_avg;
  if (kind == StateKind::kAdamExpAvgSq) src = &t->exp_avg_sq;
  return Guarded("snapshot", [&]() -> absl::StatusOr<std::vector<NamedValues>> {
    std::vector<NamedValues> out;
    if (t->sharded) return SnapshotSharded(*impl_->collectives, *t->sharded, kind);
    if (t->shard && kind != StateKind::kParams) {
      const OptimizerShard& shard = *t->shard;
      const at::Tensor& flat_C = kind == StateKind::kGrads        ? shard.grad_sum_C
                                 : kind == StateKind::kAdamExpAvg ? shard.exp_avg_C
                                                                  : shard.exp_avg_sq_C;
      std::vector<std::string> names;
      for (const auto& [name, p] : t->params) names.push_back(name);
      const ShardLayout& l = shard.layout;
      for (const auto& piece : l.Pieces(l.begin(l.rank()), l.end(l.rank()))) {
        at::Tensor d = flat_C.narrow(0, piece.offset, piece.length).to(at::kCPU, at::kDouble);
        NamedValues v{absl::StrCat(names[piece.tensor], "[", piece.tensor_offset, ":",
                                   piece.tensor_offset + piece.length, "]"),
                      {piece.length},
                      {}};
        v.values.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
        out.push_back(std::move(v));
      }
      return out;
    }
    // Under expert parallelism every expert's, gathered over the group (a collective).
    std::map<std::string, at::Tensor> gathered;
    if (impl_->experts) {
      ASSIGN_OR_RETURN(gathered, impl_->experts->GatherExperts(*src));
      src = &gathered;
    }
    for (const auto& [name, tensor] : *src) {
      at::Tensor d = tensor.detach().to(at::kCPU, at::kDouble).contiguous();
      NamedValues v{name, d.sizes().vec(), {}};
      v.values.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
      out.push_back(std::move(v));
    }
    return out;
  });
}

}  // namespace tinkerd
