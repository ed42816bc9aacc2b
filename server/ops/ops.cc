#include "server/ops/ops.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "runner/checkpoint/manifest.h"
#include "runner/checkpoint/store.h"
#include "runner/model/safetensors.h"
#include "runner/model_runner.h"
#include "runner/util/echo.h"
#include "runner/util/hash.h"
#include "runner/util/log.h"
#include "runner/util/status_macros.h"
#include "server/core/checkpoint_paths.h"
#include "server/core/convert.h"
#include "server/core/replicated_runner.h"
#include "server/core/scheduler.h"

namespace tinkerd {

uint64_t PayloadHash(const google::protobuf::Message& m, uint64_t h) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);  // map order must not change the hash
    m.SerializeToCodedStream(&coded);
  }
  return Fnv64(bytes, h);
}

namespace {

// When the checkpoint in `dir` expires, if it does (kExpiryFile; unreadable reads as never).
std::optional<absl::Time> ReadExpiry(const std::string& dir) {
  auto text = ReadFileToString(dir + "/" + kExpiryFile);
  int64_t seconds = 0;
  if (!text.ok() || !absl::SimpleAtoi(*text, &seconds)) return std::nullopt;
  return absl::FromUnixSeconds(seconds);
}

// What decoded datums hold: their tokens and loss inputs (the vectors' own headers left out).
int64_t DatumBytes(const std::vector<Datum>& data) {
  int64_t bytes = 0;
  for (const Datum& d : data) {
    bytes += static_cast<int64_t>(d.tokens.capacity() * sizeof(int64_t));
    for (const auto& [name, t] : d.loss_fn_inputs) {
      bytes += static_cast<int64_t>(name.capacity() + t.shape.capacity() * sizeof(int64_t) +
                                    t.int64_data.capacity() * sizeof(int64_t) +
                                    t.float32_data.capacity() * sizeof(float));
    }
  }
  return bytes;
}

// Errors of checkpoint storage name files under the server's root, and clients know checkpoints
// by their tinker:// paths only: <tenant_root>/<model>/<kind>/<name>... becomes
// tinker://<model>/<kind>/<name>..., and any other mention of the root is masked.
absl::Status HidePaths(const absl::Status& st, const std::string& tenant_root,
                       const std::string& root) {
  if (st.ok()) return st;
  std::string m = absl::StrReplaceAll(st.message(), {{tenant_root + "/", "tinker://"}});
  m = absl::StrReplaceAll(m, {{root, "<checkpoint_root>"}});
  return absl::Status(st.code(), m);
}

// A training checkpoint to load: a tinker:// path of kind "weights".
absl::StatusOr<CheckpointPath> TrainingCheckpoint(const std::string& uri) {
  auto path = ParseCheckpointPath(uri);
  if (path.ok() && path->kind != "weights") {
    return absl::InvalidArgumentError(
        absl::StrCat("path: ", path->kind,
                     " (an export for sampling or download) cannot be loaded as "
                     "training state; load a weights/ checkpoint"));
  }
  return path;
}

// A forward(_backward) request from its queueing to its run, alone (JobSpec::run) or in a run
// shared with other models' (the joiner, JobSpec::join).
struct ForwardCall : JoinPart {
  v1::ForwardBackwardRequest request;
  absl::StatusOr<Batch> batch;
  Reservation memory;  // both of the above, from the queue until the call has run
  std::string tenant;
  bool backward = true;
};

// An optim_step request waiting for its run, alone or with other models' steps.
struct StepCall : JoinPart {
  v1::OptimStepRequest request;
};

JobResult AnswerStep(const absl::StatusOr<OptimStepResult>& r, Metrics* metrics) {
  if (!r.ok()) return r.status();
  metrics->AddOptimStep(r->skipped);
  v1::RetrieveResultResponse out;
  OptimStepToProto(*r, out.mutable_optim_step());
  return out;
}

// The job's result from the runner's: the request's memory released, its tokens counted.
JobResult Answer(ForwardCall& call, const absl::StatusOr<ForwardBackwardResult>& r,
                 Metrics* metrics) {
  call.memory = Reservation();
  if (!r.ok()) return r.status();
  if (call.backward) {
    metrics->AddTokens(call.tenant, static_cast<int64_t>(r->metrics.at("num_tokens:sum")));
  }
  v1::RetrieveResultResponse out;
  ResultToProto(*r, out.mutable_forward_backward());
  return out;
}

}  // namespace

Ops::Ops(Bases* bases, Scheduler* scheduler, std::string checkpoint_root, Metrics* metrics,
         std::shared_ptr<MemoryAccount> account, bool join_steps)
    : bases_(bases),
      scheduler_(scheduler),
      checkpoint_root_(std::move(checkpoint_root)),
      metrics_(metrics),
      account_(std::move(account)) {
  // Queued calls of several models of one base, each checked at the edge, run in shared passes
  // over that base (ModelRunner::ForwardBackwardJoint): each gets what it would alone.
  for (const Bases::Served& base : bases_->all()) {
    ReplicatedRunner* runner = base.runner;
    for (const bool backward : {true, false}) {
      scheduler_->SetJoiner(
          Bases::JoinGroup(backward ? "ForwardBackward" : "Forward", base.base),
          [runner, metrics, backward](const std::vector<JoinPart*>& parts) {
            std::vector<v1::ForwardBackwardRequest> reqs;
            std::vector<Batch> batches;
            for (JoinPart* part : parts) {
              auto* call = static_cast<ForwardCall*>(part);
              reqs.push_back(std::move(call->request));
              batches.push_back(*std::move(call->batch));
            }
            auto results =
                runner->ForwardBackwardJoint(std::move(reqs), std::move(batches), backward);
            std::vector<JobResult> out;
            for (size_t i = 0; i < parts.size(); ++i) {
              out.push_back(Answer(*static_cast<ForwardCall*>(parts[i]), results[i], metrics));
            }
            return out;
          });
    }
    // Queued optim_steps of several models: their AdamW as one multi-tensor call (without a
    // joiner for the group, each runs alone).
    if (!join_steps) continue;
    scheduler_->SetJoiner(Bases::JoinGroup("OptimStep", base.base),
                          [runner, metrics](const std::vector<JoinPart*>& parts) {
                            std::vector<v1::OptimStepRequest> reqs;
                            for (JoinPart* part : parts) {
                              reqs.push_back(static_cast<StepCall*>(part)->request);
                            }
                            std::vector<JobResult> out;
                            for (const auto& r : runner->OptimStepJoint(std::move(reqs))) {
                              out.push_back(AnswerStep(r, metrics));
                            }
                            return out;
                          });
  }
}

std::vector<BaseModel> Ops::BaseModels() const {
  std::vector<BaseModel> out;
  for (const Bases::Served& s : bases_->all()) out.push_back(s.base);
  return out;
}

const BaseModel& Ops::BaseOfCheckpoint(const std::string& tenant, const std::string& uri) const {
  const absl::StatusOr<CheckpointPath> path = ParseCheckpointPath(uri);
  const Bases::Served* made = path.ok() ? bases_->Made(path->Fs(TenantRoot(tenant))) : nullptr;
  return made != nullptr ? made->base : bases_->first().base;
}

absl::StatusOr<BaseModel> Ops::BaseNamed(absl::string_view name, absl::string_view field) const {
  ASSIGN_OR_RETURN(const Bases::Served* s, bases_->Named(name, field));
  return s->base;
}

absl::Status Ops::CheckOwner(const std::string& model_id, const std::string& tenant) const {
  const std::optional<std::string> owner = scheduler_->Owner(model_id);
  if (owner.has_value() && *owner != tenant) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  return absl::OkStatus();
}

void Ops::CreateRegistered(const std::string& tenant, const Bases::Served& base,
                           std::function<absl::StatusOr<std::string>()> create,
                           Done<v1::ModelInfo> done) {
  ModelRunner* local = base.runner->local();
  // Noted before the scheduler lists the model, so that no op finds it on another base.
  auto noted = [create = std::move(create), bases = bases_,
                home = base.base]() -> absl::StatusOr<std::string> {
    absl::StatusOr<std::string> id = create();
    if (id.ok()) bases->Created(*id, home);
    return id;
  };
  scheduler_->CreateModel(tenant, std::move(noted),
                          [local, done = std::move(done)](const absl::StatusOr<std::string>& id) {
                            if (!id.ok()) return done(id.status());
                            auto info = local->GetInfo(*id);
                            if (!info.ok()) return done(info.status());
                            v1::ModelInfo out;
                            InfoToProto(*info, &out);
                            out.set_next_seq_id(1);
                            done(std::move(out));
                          });
}

void Ops::CreateModel(const std::string& tenant, v1::CreateModelRequest req,
                      Done<v1::ModelInfo> done) {
  // Checked here so that a bad request is never queued nor broadcast.
  if (auto opts = CreateOptionsFromProto(req); !opts.ok()) return done(opts.status());
  absl::StatusOr<const Bases::Served*> base = bases_->Named(req.base_model(), "base_model");
  if (!base.ok()) return done(base.status());
  auto request = std::make_shared<v1::CreateModelRequest>(std::move(req));
  ReplicatedRunner* runner = (*base)->runner;
  CreateRegistered(
      tenant, **base, [runner, request] { return runner->CreateModel(*request); }, std::move(done));
}

void Ops::CreateModelFromState(const std::string& tenant, v1::CreateModelFromStateRequest req,
                               Done<v1::ModelInfo> done) {
  auto path = TrainingCheckpoint(req.path());
  if (!path.ok()) return done(path.status());
  const std::string fs = path->Fs(TenantRoot(tenant)), tenant_root = TenantRoot(tenant),
                    root = checkpoint_root_;
  const Bases::Served* made = bases_->Made(fs);
  const Bases::Served& base = made != nullptr ? *made : bases_->first();
  ReplicatedRunner* runner = base.runner;
  const bool with_optimizer = req.with_optimizer();
  CreateRegistered(
      tenant, base,
      [runner, fs, with_optimizer, tenant_root, root]() -> absl::StatusOr<std::string> {
        auto id = runner->CreateModelFromState(fs, with_optimizer);
        if (!id.ok()) return HidePaths(id.status(), tenant_root, root);
        return id;
      },
      std::move(done));
}

void Ops::DeleteModel(const std::string& tenant, const std::string& model_id,
                      Done<v1::DeleteModelResponse> done) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return done(st);
  ReplicatedRunner* runner = bases_->Of(model_id).runner;
  scheduler_->DeleteModel(
      model_id, [runner, model_id] { return runner->DeleteModel(model_id); },
      [bases = bases_, model_id, done = std::move(done)](const absl::Status& st) {
        bases->Deleted(model_id);  // the scheduler forgot it, whether or not the runner did
        if (!st.ok()) return done(st);
        done(v1::DeleteModelResponse());
      });
}

absl::StatusOr<v1::ModelInfo> Ops::GetInfo(const std::string& tenant, const std::string& model_id) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return st;
  auto next = scheduler_->NextSeqId(model_id);
  if (!next.ok()) return next.status();
  auto info = bases_->Of(model_id).runner->local()->GetInfo(model_id);
  if (!info.ok()) return info.status();
  v1::ModelInfo out;
  InfoToProto(*info, &out);
  out.set_next_seq_id(*next);
  return out;
}

v1::ListModelsResponse Ops::ListModels(const std::string& tenant) {
  v1::ListModelsResponse out;
  for (const std::string& id : scheduler_->Models(tenant)) {  // others' models are invisible
    auto info = bases_->Of(id).runner->local()->GetInfo(id);
    auto next = scheduler_->NextSeqId(id);
    if (!info.ok() || !next.ok()) continue;  // deleted meanwhile
    v1::ModelInfo* m = out.add_models();
    InfoToProto(*info, m);
    m->set_next_seq_id(*next);
  }
  return out;
}

absl::StatusOr<std::vector<CheckpointEntry>> Ops::Checkpoints(const std::string& tenant,
                                                              const std::string& model_id) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return st;
  if (auto st = ValidateCheckpointName(model_id, "model_id"); !st.ok()) return st;
  // A model this tenant has now, or had checkpoints of; anything else, another tenant's model
  // included, is NOT_FOUND alike, so that no tenant can probe which ids exist.
  std::error_code ec;
  if (!scheduler_->HasModel(model_id) &&
      !std::filesystem::is_directory(TenantRoot(tenant) + "/" + model_id, ec)) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  std::vector<CheckpointEntry> out;
  for (const char* kind : kCheckpointKinds) {
    const std::string folder = absl::StrCat(TenantRoot(tenant), "/", model_id, "/", kind);
    for (const std::string& name : tinkerd::ListCheckpoints(folder)) {
      CheckpointEntry e;
      e.path = CheckpointPath{model_id, kind, name}.Uri();
      e.kind = CheckpointKindName(kind);
      auto dir = ResolveCheckpoint(folder + "/" + name);
      if (!dir.ok()) continue;  // deleted meanwhile
      namespace fs = std::filesystem;
      const auto written = fs::last_write_time(*dir, ec);
      if (!ec) {
        e.time = absl::FromChrono(std::chrono::time_point_cast<std::chrono::system_clock::duration>(
            std::chrono::file_clock::to_sys(written)));
      }
      for (const auto& f : fs::directory_iterator(*dir, ec)) {
        if (f.path().filename() == kExpiryFile) continue;
        std::error_code size_ec;
        const auto size = f.file_size(size_ec);
        if (!size_ec) e.size_bytes += static_cast<int64_t>(size);
      }
      e.expires_at = ReadExpiry(*dir);
      out.push_back(std::move(e));
    }
  }
  return out;
}

std::vector<std::string> Ops::CheckpointedModels(const std::string& tenant) const {
  std::vector<std::string> ids;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(TenantRoot(tenant), ec)) {
    const std::string id = e.path().filename().string();
    // A real folder named as a model id could be: links and stray files are not the tenant's.
    if (e.is_directory(ec) && !e.is_symlink(ec) && ValidateCheckpointName(id, "model_id").ok()) {
      ids.push_back(id);
    }
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::StatusOr<v1::ListCheckpointsResponse> Ops::ListCheckpoints(const std::string& tenant,
                                                                 const std::string& model_id) {
  auto entries = Checkpoints(tenant, model_id);
  if (!entries.ok()) return entries.status();
  v1::ListCheckpointsResponse out;
  for (const CheckpointEntry& e : *entries) {
    v1::CheckpointInfo* c = out.add_checkpoints();
    c->set_path(e.path);
    c->set_kind(e.kind);
  }
  return out;
}

absl::Status Ops::DeleteCheckpoint(const std::string& tenant, const std::string& uri) {
  auto path = ParseCheckpointPath(uri);
  if (!path.ok()) return path.status();
  return HidePaths(tinkerd::DeleteCheckpoint(path->Fs(TenantRoot(tenant))), TenantRoot(tenant),
                   checkpoint_root_);
}

absl::Status Ops::SetCheckpointExpiry(const std::string& tenant, const std::string& uri,
                                      std::optional<absl::Time> at) {
  auto path = ParseCheckpointPath(uri);
  if (!path.ok()) return path.status();
  if (auto st = CheckOwner(path->model_id, tenant); !st.ok()) return st;
  const std::string tenant_root = TenantRoot(tenant);
  auto dir = ResolveCheckpoint(path->Fs(tenant_root));
  if (!dir.ok()) return HidePaths(dir.status(), tenant_root, checkpoint_root_);
  const std::string file = *dir + "/" + kExpiryFile;
  if (!at) {
    std::error_code ec;
    std::filesystem::remove(file, ec);
    if (ec) {
      return HidePaths(absl::UnavailableError(absl::StrCat("ttl of ", uri, ": ", ec.message())),
                       tenant_root, checkpoint_root_);
    }
    return absl::OkStatus();
  }
  return HidePaths(WriteFileAtomically(file, absl::StrCat(absl::ToUnixSeconds(*at))), tenant_root,
                   checkpoint_root_);
}

int Ops::ExpireCheckpoints(absl::Time now) {
  namespace fs = std::filesystem;
  int expired = 0;
  std::error_code ec;
  for (const auto& tenant : fs::directory_iterator(checkpoint_root_, ec)) {
    if (!tenant.is_directory(ec) || tenant.is_symlink(ec)) continue;
    for (const auto& model : fs::directory_iterator(tenant.path(), ec)) {
      if (!model.is_directory(ec) || model.is_symlink(ec)) continue;
      for (const char* kind : kCheckpointKinds) {
        const std::string folder = (model.path() / kind).string();
        for (const std::string& name : tinkerd::ListCheckpoints(folder)) {
          auto dir = ResolveCheckpoint(folder + "/" + name);
          if (!dir.ok()) continue;
          const std::optional<absl::Time> at = ReadExpiry(*dir);
          if (!at || *at > now) continue;
          const absl::Status st = tinkerd::DeleteCheckpoint(folder + "/" + name);
          if (st.ok()) {
            ++expired;
            TLOG_INFO("checkpoint {}/{}/{} of tenant {} expired: deleted",
                      model.path().filename().string(), kind, name,
                      tenant.path().filename().string());
          }
        }
      }
    }
  }
  return expired;
}

absl::StatusOr<std::string> Ops::CopyCheckpoint(const std::string& tenant, const std::string& uri) {
  auto source = ParseCheckpointPath(uri);
  if (!source.ok()) return source.status();
  if (auto st = CheckOwner(source->model_id, tenant); !st.ok()) return st;
  auto files = CheckpointFiles(tenant, uri);
  if (!files.ok()) return files.status();
  auto id = ModelRunner::NewModelId();
  if (!id.ok()) return id.status();
  const CheckpointPath copy{*id, source->kind, source->name};
  namespace fs = std::filesystem;
  const absl::Status st = CommitCheckpoint(
      copy.Fs(TenantRoot(tenant)), /*overwrite=*/false, [&](const std::string& tmp) {
        for (const CheckpointFile& f : *files) {
          const fs::path to = fs::path(tmp) / f.name;
          std::error_code ec;
          fs::create_directories(to.parent_path(), ec);
          if (!ec) fs::create_hard_link(f.path, to, ec);
          if (ec) {  // another file system, or one without links: a copy then
            ec.clear();
            fs::copy_file(f.path, to, ec);
          }
          if (ec) {
            return absl::UnavailableError(
                absl::StrCat("copy of ", uri, ": ", f.name, ": ", ec.message()));
          }
        }
        return absl::OkStatus();
      });
  if (!st.ok()) return HidePaths(st, TenantRoot(tenant), checkpoint_root_);
  return copy.Uri();
}

absl::StatusOr<std::vector<CheckpointFile>> Ops::CheckpointFiles(const std::string& tenant,
                                                                 const std::string& uri) {
  auto path = ParseCheckpointPath(uri);
  if (!path.ok()) return path.status();
  const std::string tenant_root = TenantRoot(tenant);
  auto dir = ResolveCheckpoint(path->Fs(tenant_root));
  if (!dir.ok()) return HidePaths(dir.status(), tenant_root, checkpoint_root_);
  namespace fs = std::filesystem;
  std::vector<CheckpointFile> out;
  std::error_code ec;
  // Symbolic links are skipped, not followed: a checkpoint's archive holds its own files only.
  for (auto it = fs::recursive_directory_iterator(*dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    std::error_code stat_ec;
    const fs::file_status st = it->symlink_status(stat_ec);
    if (stat_ec || !fs::is_regular_file(st)) continue;
    if (it->path().filename() == kExpiryFile && it.depth() == 0) continue;  // store metadata
    out.push_back({it->path().lexically_relative(*dir).string(), it->path().string()});
  }
  if (ec) {
    return HidePaths(absl::UnavailableError(absl::StrCat(
                         "checkpoint ", uri, ": cannot list its files: ", ec.message())),
                     tenant_root, checkpoint_root_);
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<v1::RetrieveResultResponse> Ops::RetrieveResult(const std::string& tenant,
                                                               const std::string& model_id,
                                                               int64_t seq_id) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return st;
  return scheduler_->Retrieve(model_id, seq_id);
}

absl::StatusOr<absl::Time> Ops::LastRequest(const std::string& tenant,
                                            const std::string& model_id) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return st;
  return scheduler_->LastRequest(model_id);
}

absl::StatusOr<v1::ModelInfo> Ops::CheckpointInfo(const std::string& tenant,
                                                  const std::string& uri) {
  auto path = TrainingCheckpoint(uri);
  if (!path.ok()) return path.status();
  const std::string tenant_root = TenantRoot(tenant);
  auto dir = ResolveCheckpoint(path->Fs(tenant_root));
  if (!dir.ok()) return HidePaths(dir.status(), tenant_root, checkpoint_root_);
  auto text = ReadFileToString(*dir + "/manifest.json");
  if (!text.ok()) return HidePaths(text.status(), tenant_root, checkpoint_root_);
  auto manifest = ParseTrainingManifest(*text);
  if (!manifest.ok()) return HidePaths(manifest.status(), tenant_root, checkpoint_root_);
  ModelInfo info;
  info.model_id = manifest->model_id;
  info.base_model = manifest->base_model;
  info.is_lora = manifest->options.lora.has_value();
  if (info.is_lora) info.lora = *manifest->options.lora;
  info.loss_reduction = manifest->options.loss_reduction;
  info.step = manifest->step;
  v1::ModelInfo out;
  InfoToProto(info, &out);
  return out;
}

void Ops::ForwardBackward(const std::string& tenant, v1::ForwardBackwardRequest* req, bool backward,
                          Done<v1::ForwardBackwardOutput> done) {
  if (auto st = CheckOwner(req->model_id(), tenant); !st.ok()) return done(st);
  // Decoded and checked once, here, before queueing; the runner and the other ranks take the
  // result as it is.
  JobSpec job;
  job.kind = backward ? "ForwardBackward" : "Forward";
  job.payload_hash = PayloadHash(*req);
  const std::string model_id = req->model_id();
  const int64_t seq_id = req->seq_id();
  const Bases::Served& base = bases_->Of(model_id);
  absl::StatusOr<Batch> batch = BatchFromProto(req->data(), req->loss_fn(), base.base.limits);
  // The job runs once; shared only because std::function must be copyable.
  auto pending = std::make_shared<ForwardCall>();
  if (account_ != nullptr && batch.ok()) {
    // Refused before the scheduler sees it, as a full queue is: its seq_id stays free to resend.
    // The model's next seq_id is never refused, as the scheduler always admits it: later ones,
    // queued and holding their share, wait for it (it runs unreserved, its call's own
    // activations reserved as it runs).
    const int64_t bytes = static_cast<int64_t>(req->SpaceUsedLong()) + DatumBytes(batch->data());
    absl::StatusOr<Reservation> memory =
        account_->Reserve(bytes, absl::StrCat(job.kind, ": the request while it is queued"),
                          "; send the same seq_id again when earlier calls have run");
    if (memory.ok()) {
      pending->memory = *std::move(memory);
    } else if (scheduler_->NextSeqId(model_id).value_or(-1) != seq_id) {
      return done(memory.status());
    }
  }
  pending->request.Swap(req);
  pending->tenant = tenant;
  pending->backward = backward;
  if (batch.ok()) {
    // A checked call may share its run with other models' (a refused one answers alone).
    for (const Datum& d : batch->data()) pending->tokens += static_cast<int64_t>(d.tokens.size());
    job.join_group = Bases::JoinGroup(job.kind, base.base);
    job.join = pending;
  }
  pending->batch = std::move(batch);
  ReplicatedRunner* runner = base.runner;
  Metrics* metrics = metrics_;
  job.run = [runner, pending, backward, metrics]() -> JobStep {
    if (!pending->batch.ok()) return {true, pending->batch.status()};
    auto r =
        runner->ForwardBackward(std::move(pending->request), *std::move(pending->batch), backward);
    return {true, Answer(*pending, r, metrics)};
  };
  scheduler_->Submit(model_id, seq_id, std::move(job),
                     [done = std::move(done)](const JobResult& r) {
                       if (!r.ok()) return done(r.status());
                       done(r->forward_backward());
                     });
}

template <typename Resp>
void Ops::SubmitOrdered(const std::string& model_id, int64_t seq_id, std::string kind,
                        uint64_t hash,
                        std::function<absl::StatusOr<v1::RetrieveResultResponse>()> run,
                        const Resp& (v1::RetrieveResultResponse::*field)() const, Done<Resp> done) {
  JobSpec job;
  job.kind = std::move(kind);
  job.payload_hash = hash;
  job.run = [run = std::move(run)]() -> JobStep { return {true, run()}; };
  scheduler_->Submit(model_id, seq_id, std::move(job),
                     [field, done = std::move(done)](const JobResult& r) {
                       if (!r.ok()) return done(r.status());
                       done(((*r).*field)());
                     });
}

absl::Status Ops::HideCheckpointPaths(const std::string& tenant, const absl::Status& st) const {
  return HidePaths(st, TenantRoot(tenant), checkpoint_root_);
}

void Ops::Refuse(const std::string& tenant, const std::string& model_id, int64_t seq_id,
                 std::string kind, uint64_t payload_hash, absl::Status error,
                 Done<v1::RetrieveResultResponse> done) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return done(st);
  JobSpec job;
  job.kind = std::move(kind);
  job.payload_hash = payload_hash;
  job.run = [error]() -> JobStep { return {true, error}; };
  scheduler_->Submit(model_id, seq_id, std::move(job),
                     [done = std::move(done)](const JobResult& r) { done(r); });
}

void Ops::OptimStep(const std::string& tenant, v1::OptimStepRequest req,
                    Done<v1::OptimStepResponse> done) {
  if (auto st = CheckOwner(req.model_id(), tenant); !st.ok()) return done(st);
  // Checked before the request is queued, hashed and broadcast.
  const absl::Status invalid = ValidateAdamParams(AdamFromProto(req.adam_params()));
  JobSpec job;
  job.kind = "OptimStep";
  job.payload_hash = PayloadHash(req);
  const std::string model_id = req.model_id();
  const int64_t seq_id = req.seq_id();
  auto pending = std::make_shared<StepCall>();
  pending->request = std::move(req);
  const Bases::Served& base = bases_->Of(model_id);
  if (invalid.ok()) {
    // A valid step may share its AdamW with other models' (it counts no tokens).
    job.join_group = Bases::JoinGroup(job.kind, base.base);
    job.join = pending;
  }
  ReplicatedRunner* runner = base.runner;
  Metrics* metrics = metrics_;
  job.run = [runner, pending, invalid, metrics]() -> JobStep {
    if (!invalid.ok()) return {true, invalid};
    return {true, AnswerStep(runner->OptimStep(pending->request), metrics)};
  };
  scheduler_->Submit(model_id, seq_id, std::move(job),
                     [done = std::move(done)](const JobResult& r) {
                       if (!r.ok()) return done(r.status());
                       done(r->optim_step());
                     });
}

void Ops::SaveState(const std::string& tenant, v1::SaveStateRequest req,
                    Done<v1::SaveStateResponse> done) {
  if (auto st = CheckOwner(req.model_id(), tenant); !st.ok()) return done(st);
  const absl::Status invalid = ValidateCheckpointName(req.name());
  const CheckpointPath path{req.model_id(), "weights", req.name()};
  const std::string fs = path.Fs(TenantRoot(tenant));
  const std::string tenant_root = TenantRoot(tenant), root = checkpoint_root_;
  ReplicatedRunner* runner = bases_->Of(req.model_id()).runner;
  auto request = std::make_shared<v1::SaveStateRequest>(std::move(req));
  SubmitOrdered<v1::SaveStateResponse>(
      request->model_id(), request->seq_id(), "SaveState", PayloadHash(*request),
      [invalid, runner, request, fs, path, tenant_root, root,
       metrics = metrics_]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        SaveStateOptions o;
        o.overwrite = request->overwrite();
        o.include_accumulated = request->include_accumulated();
        o.last_seq_id = request->seq_id();
        const auto t0 = std::chrono::steady_clock::now();
        if (auto st = runner->SaveState(request->model_id(), fs, o); !st.ok())
          return HidePaths(st, tenant_root, root);
        metrics->ObserveCheckpoint(
            "save", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        v1::RetrieveResultResponse out;
        out.mutable_save_state()->set_path(path.Uri());
        return out;
      },
      &v1::RetrieveResultResponse::save_state, std::move(done));
}

void Ops::LoadState(const std::string& tenant, v1::LoadStateRequest req,
                    Done<v1::LoadStateResponse> done) {
  if (auto st = CheckOwner(req.model_id(), tenant); !st.ok()) return done(st);
  auto path = TrainingCheckpoint(req.path());
  const absl::Status invalid = path.status();
  const std::string fs = invalid.ok() ? path->Fs(TenantRoot(tenant)) : "";
  const std::string tenant_root = TenantRoot(tenant), root = checkpoint_root_;
  ReplicatedRunner* runner = bases_->Of(req.model_id()).runner;
  auto request = std::make_shared<v1::LoadStateRequest>(std::move(req));
  SubmitOrdered<v1::LoadStateResponse>(
      request->model_id(), request->seq_id(), "LoadState", PayloadHash(*request),
      [invalid, runner, request, fs, tenant_root,
       root]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        if (auto st = runner->LoadState(request->model_id(), fs, request->with_optimizer());
            !st.ok())
          return HidePaths(st, tenant_root, root);
        v1::RetrieveResultResponse out;
        out.mutable_load_state()->set_path(request->path());
        return out;
      },
      &v1::RetrieveResultResponse::load_state, std::move(done));
}

void Ops::SaveWeightsForSampler(const std::string& tenant, v1::SaveWeightsForSamplerRequest req,
                                Done<v1::SaveWeightsForSamplerResponse> done, bool external) {
  if (auto st = CheckOwner(req.model_id(), tenant); !st.ok()) return done(st);
  const absl::Status invalid = ValidateCheckpointName(req.name());
  const CheckpointPath path{req.model_id(), external ? "external_weights" : "sampler_weights",
                            req.name()};
  const std::string fs = path.Fs(TenantRoot(tenant));
  const std::string tenant_root = TenantRoot(tenant), root = checkpoint_root_;
  ReplicatedRunner* runner = bases_->Of(req.model_id()).runner;
  auto request = std::make_shared<v1::SaveWeightsForSamplerRequest>(std::move(req));
  SubmitOrdered<v1::SaveWeightsForSamplerResponse>(
      request->model_id(), request->seq_id(),
      external ? "SaveWeightsExternal" : "SaveWeightsForSampler", PayloadHash(*request),
      [invalid, runner, request, fs, path, tenant_root, root,
       external]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        bool merged = request->merged();
        if (external) {
          // On the scheduler thread, between jobs: the runner's lock is free.
          absl::StatusOr<ModelInfo> info = runner->local()->GetInfo(request->model_id());
          if (!info.ok()) return info.status();
          merged = !info->is_lora;
        }
        if (auto st = runner->SaveWeightsForSampler(request->model_id(), fs, merged,
                                                    request->overwrite());
            !st.ok())
          return HidePaths(st, tenant_root, root);
        v1::RetrieveResultResponse out;
        out.mutable_save_weights_for_sampler()->set_path(path.Uri());
        return out;
      },
      &v1::RetrieveResultResponse::save_weights_for_sampler, std::move(done));
}

}  // namespace tinkerd
