// The Tinker API's training endpoints onto the shared operations: create_model, get_info,
// unload_model, forward_backward (Tinker's protobuf), optim_step, save_weights, load_weights,
// save_weights_for_sampler, weights_info, copy_weights. Ordered calls take the model's seq_id, so a
// resend is recognized by the scheduler (Resend::kOperation); creations and unloads by their
// future.
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "server/core/checkpoint_paths.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"
#include "tinker_public/tinker_public.pb.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

namespace {

// `done`, once the checkpoint its response names has its lifetime (`ttl` from now; none: as it
// is). A checkpoint whose lifetime could not be set is the call's error, though it was saved.
template <typename Resp>
Done<Resp> AfterExpirySet(Ops* ops, const std::string& tenant, std::optional<absl::Duration> ttl,
                          Done<Resp> done) {
  if (!ttl) return done;
  return [ops, tenant, ttl, done = std::move(done)](absl::StatusOr<Resp> r) {
    if (r.ok()) {
      if (absl::Status st = ops->SetCheckpointExpiry(tenant, r->path(), absl::Now() + *ttl);
          !st.ok()) {
        r = st;
      }
    }
    done(std::move(r));
  };
}

}  // namespace

void TinkerApi::AddSessionModel(const std::string& tenant, const std::string& session_id,
                                int64_t model_seq_id, const std::string& model_id) {
  aliases_.Add(tenant, session_id, model_seq_id, model_id);
  sessions_.AddModel(session_id, model_id);
}

void TinkerApi::CreateModel(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string session_id = f.Str("session_id");
  const int64_t model_seq_id = f.Int("model_seq_id");
  const std::string base_model = f.Str("base_model");
  const Json* lora = f.Obj("lora_config");
  if (const Json* optimizer = f.Obj("optimizer_config")) {  // sent by newer SDKs
    Fields o(*optimizer);
    const std::string type = o.OptStr("type").value_or("adamw");
    if (!o.status().ok()) {
      return respond(Error(400, absl::StrCat("optimizer_config.", o.status().message())));
    }
    if (type != "adamw") {
      return respond(Error(400, absl::StrCat("optimizer_config.type: this server trains with "
                                             "AdamW only, not '",
                                             Echo(type), "'")));
    }
  }
  v1::CreateModelRequest req;
  // Tinker's losses are sums over tokens: the optimizer divides by nothing.
  req.set_loss_reduction("sum");
  if (lora != nullptr) {
    Fields l(*lora);
    const int64_t rank = l.Int("rank");
    req.set_seed(static_cast<uint64_t>(l.OptInt("seed").value_or(0)));
    req.mutable_lora()->set_rank(rank);
    req.mutable_lora()->set_train_attn(l.OptBool("train_attn").value_or(true));
    req.mutable_lora()->set_train_mlp(l.OptBool("train_mlp").value_or(true));
    req.mutable_lora()->set_train_unembed(l.OptBool("train_unembed").value_or(true));
    if (!l.status().ok()) {
      return respond(Error(400, absl::StrCat("lora_config.", l.status().message())));
    }
  }
  if (!f.status().ok()) return respond(Error(f.status()));
  if (auto base = ops_->BaseNamed(base_model, "base_model"); !base.ok()) {
    return respond(Error(base.status()));
  }
  req.set_base_model(base_model);
  if (auto st = sessions_.Check(tenant, session_id); !st.ok()) return respond(Error(st));
  // A retry of a creation is answered with the first one's future: creations have no seq_id
  // in the scheduler to catch them.
  const std::string request_id = absl::StrCat("create:", session_id, ":", model_seq_id);
  Ops* ops = ops_;
  CallIntoFuture<v1::ModelInfo>(
      &futures_, tenant, CallKey{request_id, JsonDigest("create_model", body), "model_seq_id"},
      Resend::kFuture,
      [ops, tenant, req](Done<v1::ModelInfo> done) {
        ops->CreateModel(tenant, req, std::move(done));
      },
      [this, tenant, session_id, model_seq_id](const v1::ModelInfo& m) {
        AddSessionModel(tenant, session_id, model_seq_id, m.model_id());
        return JsonResponse(Json{{"type", "create_model"}, {"model_id", m.model_id()}});
      },
      std::move(respond));
}

void TinkerApi::GetInfo(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string model_id = f.Str("model_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  auto info = ops_->GetInfo(tenant, aliases_.Resolve(tenant, model_id));
  if (!info.ok()) return respond(Error(info.status()));
  const BaseModel& base = ops_->BaseOf(info->model_id());
  Json out{{"type", "get_info"},
           {"model_id", model_id},
           {"model_data", Json{{"arch", info->architecture()}, {"model_name", base.name}}},
           {"is_lora", info->is_lora()},
           {"model_name", base.name}};
  if (info->is_lora()) out["lora_rank"] = info->lora().rank();
  if (!base.tokenizer_id.empty()) out["model_data"]["tokenizer_id"] = base.tokenizer_id;
  respond(JsonResponse(out));
}

void TinkerApi::UnloadModel(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string model_id = f.Str("model_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::string request_id = absl::StrCat("unload:", model_id);
  Ops* ops = ops_;
  CallIntoFuture<v1::DeleteModelResponse>(
      &futures_, tenant, CallKey{request_id, JsonDigest("unload_model", body), "model_id"},
      Resend::kFuture,
      [ops, tenant, id = aliases_.Resolve(tenant, model_id)](Done<v1::DeleteModelResponse> done) {
        ops->DeleteModel(tenant, id, std::move(done));
      },
      [this, model_id, id = aliases_.Resolve(tenant, model_id)](const v1::DeleteModelResponse&) {
        sessions_.ForgetModel(id);
        return JsonResponse(Json{{"type", "unload_model"}, {"model_id", model_id}});
      },
      std::move(respond));
}

void TinkerApi::ForwardBackward(const std::string& tenant, const Request& req, Respond respond) {
  tinker_public::ForwardBackwardRequest in;
  if (!in.ParseFromString(req.body)) {
    return respond(Error(400, "body: not a tinker_public.ForwardBackwardRequest"));
  }
  const std::string model_id = aliases_.Resolve(tenant, in.model_id());
  if (auto st = sessions_.CheckModel(model_id); !st.ok()) return respond(Error(st));
  const int64_t seq_id = in.seq_id();
  const std::string request_id = absl::StrCat(in.model_id(), ":", seq_id);
  const bool forward_only = in.forward_only();
  const std::string kind = forward_only ? "Forward" : "ForwardBackward";
  const CallKey key{request_id, Digest(kind, req.body), "seq_id"};
  auto converted = FwdBwdFromTinker(&in, config_.max_body_bytes);
  if (!converted.ok()) {
    return RefuseOrdered(tenant, key, model_id, seq_id, kind, converted.status(),
                         std::move(respond));
  }
  Ops* ops = ops_;
  auto request = std::make_shared<v1::ForwardBackwardRequest>(std::move(converted->request));
  request->set_model_id(model_id);
  request->set_seq_id(seq_id);
  const std::string loss_fn = request->loss_fn().name();
  CallIntoFuture<v1::ForwardBackwardOutput>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, request, forward_only](Done<v1::ForwardBackwardOutput> done) {
        ops->ForwardBackward(tenant, request.get(), !forward_only, std::move(done));
      },
      [loss_fn](const v1::ForwardBackwardOutput& r) {
        tinker_public::ForwardBackwardOutput out;
        FwdBwdOutputToTinker(r, loss_fn, &out);
        return Response{200, "application/x-protobuf", out.SerializeAsString(), {}};
      },
      std::move(respond));
}

void TinkerApi::OptimStep(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::OptimStepRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  if (!f.status().ok()) return respond(Error(f.status()));
  // Past the model and seq_id, a refused field takes the seq_id (RefuseOrdered).
  Fields rest(body);
  const Json* adam = rest.Obj("adam_params");
  absl::Status refused = rest.status();
  if (adam != nullptr) {
    Fields a(*adam);
    v1::AdamParams* p = req.mutable_adam_params();
    if (auto v = a.OptNum("learning_rate")) p->set_learning_rate(*v);
    if (auto v = a.OptNum("beta1")) p->set_beta1(*v);
    if (auto v = a.OptNum("beta2")) p->set_beta2(*v);
    if (auto v = a.OptNum("eps")) p->set_eps(*v);
    if (auto v = a.OptNum("weight_decay")) p->set_weight_decay(*v);
    if (auto v = a.OptNum("grad_clip_norm")) p->set_grad_clip_norm(*v);
    if (!a.status().ok()) {
      refused = absl::InvalidArgumentError(absl::StrCat("adam_params.", a.status().message()));
    }
  }
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(aliases_.Resolve(tenant, req.model_id()));
  if (auto st = sessions_.CheckModel(req.model_id()); !st.ok()) return respond(Error(st));
  const CallKey key{request_id, JsonDigest("optim_step", body), "seq_id"};
  if (!refused.ok()) {
    return RefuseOrdered(tenant, key, req.model_id(), req.seq_id(), "OptimStep", std::move(refused),
                         std::move(respond));
  }
  Ops* ops = ops_;
  CallIntoFuture<v1::OptimStepResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, req](Done<v1::OptimStepResponse> done) {
        ops->OptimStep(tenant, req, std::move(done));
      },
      [](const v1::OptimStepResponse& r) {
        Json metrics = Json::object();
        for (const auto& [k, v] : r.metrics()) metrics[k] = v;
        return JsonResponse(Json{{"type", "optim_step"}, {"metrics", metrics}});
      },
      std::move(respond));
}

void TinkerApi::RefuseOrdered(const std::string& tenant, const CallKey& key,
                              const std::string& model_id, int64_t seq_id, const std::string& kind,
                              absl::Status error, Respond respond) {
  Ops* ops = ops_;
  CallIntoFuture<v1::RetrieveResultResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, model_id, seq_id, kind, hash = key.digest,
       error = std::move(error)](Done<v1::RetrieveResultResponse> done) {
        ops->Refuse(tenant, model_id, seq_id, kind, hash, error, std::move(done));
      },
      [](const v1::RetrieveResultResponse&) { return Response(); }, std::move(respond));
}

void TinkerApi::SaveWeights(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::SaveStateRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  if (!f.status().ok()) return respond(Error(f.status()));
  Fields rest(body);
  req.set_name(rest.Str("path"));
  req.set_overwrite(rest.OptBool("overwrite").value_or(false));
  // Tinker's save_state never refuses for pending gradients: they are saved with the weights.
  req.set_include_accumulated(true);
  const absl::StatusOr<std::optional<absl::Duration>> ttl = TtlFromTinker(body);
  const absl::Status refused = rest.status().ok() ? ttl.status() : rest.status();
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(aliases_.Resolve(tenant, req.model_id()));
  if (auto st = sessions_.CheckModel(req.model_id()); !st.ok()) return respond(Error(st));
  const CallKey key{request_id, JsonDigest("save_weights", body), "seq_id"};
  if (!refused.ok()) {
    return RefuseOrdered(tenant, key, req.model_id(), req.seq_id(), "SaveState", refused,
                         std::move(respond));
  }
  Ops* ops = ops_;
  CallIntoFuture<v1::SaveStateResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, req, ttl = *ttl](Done<v1::SaveStateResponse> done) {
        ops->SaveState(tenant, req, AfterExpirySet(ops, tenant, ttl, std::move(done)));
      },
      [](const v1::SaveStateResponse& r) {
        return JsonResponse(Json{{"type", "save_weights"}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::LoadWeights(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::optional<std::string> model_id = f.OptId("model_id");
  Ops* ops = ops_;
  if (!model_id) {
    // The session form: a new model made from the checkpoint (create_training_client_from_state).
    const std::string path = f.Str("path");
    const bool optimizer = f.OptBool("optimizer").value_or(false);
    const std::string session_id = f.Str("session_id");
    const int64_t model_seq_id = f.Int("model_seq_id");
    if (!f.status().ok()) return respond(Error(f.status()));
    if (auto st = sessions_.Check(tenant, session_id); !st.ok()) return respond(Error(st));
    const std::string request_id = absl::StrCat("create:", session_id, ":", model_seq_id);
    v1::CreateModelFromStateRequest req;
    req.set_path(path);
    req.set_with_optimizer(optimizer);
    // The key is create_model's too: a load_weights reusing a creation's key is refused.
    return CallIntoFuture<v1::ModelInfo>(
        &futures_, tenant, CallKey{request_id, JsonDigest("load_weights", body), "model_seq_id"},
        Resend::kFuture,
        [ops, tenant, req](Done<v1::ModelInfo> done) {
          ops->CreateModelFromState(tenant, req, std::move(done));
        },
        [this, tenant, session_id, model_seq_id, path](const v1::ModelInfo& m) {
          AddSessionModel(tenant, session_id, model_seq_id, m.model_id());
          return JsonResponse(
              Json{{"type", "load_weights"}, {"model_id", m.model_id()}, {"path", path}});
        },
        std::move(respond));
  }
  v1::LoadStateRequest req;
  req.set_model_id(aliases_.Resolve(tenant, *model_id));
  if (auto st = sessions_.CheckModel(req.model_id()); !st.ok()) return respond(Error(st));
  req.set_seq_id(f.Int("seq_id"));
  if (!f.status().ok()) return respond(Error(f.status()));
  // Past the model and seq_id, a refused field takes the seq_id (RefuseOrdered).
  Fields rest(body);
  req.set_path(rest.Str("path"));
  req.set_with_optimizer(rest.OptBool("optimizer").value_or(false));
  const CallKey key{absl::StrCat(*model_id, ":", req.seq_id()), JsonDigest("load_weights", body),
                    "seq_id"};
  if (!rest.status().ok()) {
    return RefuseOrdered(tenant, key, req.model_id(), req.seq_id(), "LoadState", rest.status(),
                         std::move(respond));
  }
  CallIntoFuture<v1::LoadStateResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, req](Done<v1::LoadStateResponse> done) {
        ops->LoadState(tenant, req, std::move(done));
      },
      [model_id = *model_id](const v1::LoadStateResponse& r) {
        return JsonResponse(
            Json{{"type", "load_weights"}, {"model_id", model_id}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::SaveWeightsForSampler(const std::string& tenant, const Json& body,
                                      Respond respond) {
  Fields f(body);
  v1::SaveWeightsForSamplerRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  if (!f.status().ok()) return respond(Error(f.status()));
  Fields rest(body);
  const std::optional<std::string> name = rest.OptId("path");
  const absl::StatusOr<bool> inflight = InflightFromTinker(body);
  const absl::StatusOr<std::optional<absl::Duration>> ttl = TtlFromTinker(body);
  absl::Status refused =
      !rest.status().ok() ? rest.status() : (inflight.ok() ? ttl.status() : inflight.status());
  if (refused.ok() && *inflight && name) {
    refused = absl::InvalidArgumentError(
        "kind: an inflight save makes a sampling session that follows the model's weights; it "
        "takes no path (a named save stores a snapshot)");
  }
  if (refused.ok() && *ttl && !name) {
    refused = absl::InvalidArgumentError(
        "ttl_seconds: a save without a path makes a sampler, not a stored checkpoint; it lives "
        "until --sampler_idle_s or eviction (give a path to store one with a lifetime)");
  }
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(aliases_.Resolve(tenant, req.model_id()));
  if (auto st = sessions_.CheckModel(req.model_id()); !st.ok()) return respond(Error(st));
  const CallKey key{request_id, JsonDigest("save_weights_for_sampler", body), "seq_id"};
  if (!refused.ok()) {
    return RefuseOrdered(tenant, key, req.model_id(), req.seq_id(), "SaveWeightsForSampler",
                         std::move(refused), std::move(respond));
  }
  Ops* ops = ops_;
  if (!name) {
    return SaveWeightsForSession(tenant, key, req.model_id(), req.seq_id(), *inflight,
                                 std::move(respond));
  }
  req.set_name(*name);
  CallIntoFuture<v1::SaveWeightsForSamplerResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, req, ttl = *ttl](Done<v1::SaveWeightsForSamplerResponse> done) {
        ops->SaveWeightsForSampler(tenant, req, AfterExpirySet(ops, tenant, ttl, std::move(done)));
      },
      [](const v1::SaveWeightsForSamplerResponse& r) {
        return JsonResponse(Json{{"type", "save_weights_for_sampler"}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::SaveWeightsExternal(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::SaveWeightsForSamplerRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  if (!f.status().ok()) return respond(Error(f.status()));
  Fields rest(body);
  req.set_name(rest.Str("path"));
  absl::StatusOr<std::optional<absl::Duration>> ttl = TtlFromTinker(body);
  if (!rest.status().ok()) ttl = rest.status();
  if (auto it = body.find("age_encryption_recipients");
      ttl.ok() && it != body.end() && !it->is_null() && (!it->is_array() || !it->empty())) {
    ttl = absl::InvalidArgumentError(
        "age_encryption_recipients: this server does not encrypt exports; send none, and "
        "encrypt the downloaded files yourself");
  }
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(aliases_.Resolve(tenant, req.model_id()));
  if (auto st = sessions_.CheckModel(req.model_id()); !st.ok()) return respond(Error(st));
  const CallKey key{request_id, JsonDigest("save_weights_external", body), "seq_id"};
  if (!ttl.ok()) {
    return RefuseOrdered(tenant, key, req.model_id(), req.seq_id(), "SaveWeightsExternal",
                         ttl.status(), std::move(respond));
  }
  Ops* ops = ops_;
  CallIntoFuture<v1::SaveWeightsForSamplerResponse>(
      &futures_, tenant, key, Resend::kOperation,
      [ops, tenant, req, ttl = *ttl](Done<v1::SaveWeightsForSamplerResponse> done) {
        ops->SaveWeightsForSampler(tenant, req, AfterExpirySet(ops, tenant, ttl, std::move(done)),
                                   /*external=*/true);
      },
      [ops, tenant](const v1::SaveWeightsForSamplerResponse& r) {
        Json out{{"type", "save_weights_external"}, {"path", r.path()}};
        if (auto files = ops->CheckpointFiles(tenant, r.path()); files.ok()) {
          int64_t bytes = 0;
          for (const CheckpointFile& file : *files) {
            std::error_code ec;
            const auto size = std::filesystem::file_size(file.path, ec);
            if (!ec) bytes += static_cast<int64_t>(size);
          }
          out["size_bytes"] = bytes;
        }
        return JsonResponse(out);
      },
      std::move(respond));
}

void TinkerApi::WeightsInfo(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string path = f.Str("tinker_path");
  if (!f.status().ok()) return respond(Error(f.status()));
  auto info = ops_->CheckpointInfo(tenant, path);
  if (!info.ok()) return respond(Error(info.status()));
  Json out{{"base_model", ops_->BaseOfCheckpoint(tenant, path).name}, {"is_lora", info->is_lora()}};
  if (info->is_lora()) {
    out["lora_rank"] = info->lora().rank();
    out["train_attn"] = info->lora().train_attn();
    out["train_mlp"] = info->lora().train_mlp();
    out["train_unembed"] = info->lora().train_unembed();
  }
  respond(JsonResponse(out));
}

// RestClient.copy_weights: the checkpoint again under a new run (Ops::CopyCheckpoint), answered
// at once with its path. A copy lands in `destination_project_id`, or in session `session_id`
// as its model `model_seq_id` (listed with the session, and addressable by that alias); the
// SDK requires one of them. Resends carry the first request's X-Idempotency-Key and get the
// first copy (copies.h).
void TinkerApi::CopyWeights(const std::string& tenant, const std::string& idempotency_key,
                            const Json& body, Respond respond) {
  Fields f(body);
  const std::string source = f.Str("source_path");
  const std::optional<std::string> session_id = f.OptId("session_id");
  const std::optional<int64_t> model_seq_id = f.OptInt("model_seq_id");
  const std::optional<std::string> project = f.OptId("destination_project_id");
  const std::optional<std::string> token = f.OptStr("weights_access_token");
  if (!f.status().ok()) return respond(Error(f.status()));
  const absl::StatusOr<std::optional<absl::Duration>> ttl = TtlFromTinker(body);
  if (!ttl.ok()) return respond(Error(ttl.status()));
  if (token) {
    return respond(Error(400,
                         "weights_access_token: a copy is of the caller's own checkpoints only; "
                         "this server has no cross-account access tokens"));
  }
  if (session_id.has_value() != model_seq_id.has_value()) {
    return respond(Error(400, "session_id and model_seq_id: give both, or neither"));
  }
  if (!session_id && !project) {
    return respond(Error(400, "destination_project_id: required without session_id"));
  }
  if (session_id) {
    if (auto st = sessions_.Check(tenant, *session_id); !st.ok()) return respond(Error(st));
  }
  absl::StatusOr<std::string> path = copies_.Once(
      tenant, idempotency_key, JsonDigest("copy_weights", body),
      [&]() -> absl::StatusOr<std::string> {
        // The copy's own lifetime: never the source's.
        absl::StatusOr<std::string> copy = ops_->CopyCheckpoint(tenant, source);
        if (!copy.ok() || !*ttl) return copy;
        if (absl::Status st = ops_->SetCheckpointExpiry(tenant, *copy, absl::Now() + **ttl);
            !st.ok()) {
          ops_->DeleteCheckpoint(tenant, *copy).IgnoreError();
          return st;
        }
        return copy;
      });
  if (!path.ok()) return respond(Error(path.status()));
  if (session_id) {
    auto copy = ParseCheckpointPath(*path);
    if (copy.ok()) AddSessionModel(tenant, *session_id, *model_seq_id, copy->model_id);
  }
  respond(JsonResponse(Json{{"tinker_path", *path}}));
}

}  // namespace tinkerd::http
