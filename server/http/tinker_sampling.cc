// The Tinker HTTP API's sampling endpoints onto server/ops/sampling.h. A Tinker sampling session is
// a tinkerd sampler: save_weights_for_sampler without a name freezes the model in its order (the
// SDK's save_weights_and_get_sampling_client), create_sampling_session freezes the base model or
// loads a sampler_weights export, and asample samples it. Retries find their first answer:
// asample by (sampling_session_id, seq_id), create_sampling_session by (session_id,
// sampling_session_seq_id), the unnamed save by the model's (model_id, seq_id).
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "runner/sample/sample_types.h"
#include "runner/util/echo.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"
#include "tinker_public/tinker_public.pb.h"

namespace tinkerd::http {
namespace {

using Json = TinkerApi::Json;

}  // namespace

void TinkerApi::CreateSamplingSession(const std::string& tenant, const Json& body,
                                      Respond respond) {
  Fields f(body);
  const std::string session_id = f.Str("session_id");
  const int64_t seq = f.Int("sampling_session_seq_id");
  const std::optional<std::string> base_model = f.OptId("base_model");
  const std::optional<std::string> model_path = f.OptId("model_path");
  if (!f.status().ok()) return respond(Error(f.status()));
  if (auto st = sessions_.Check(tenant, session_id); !st.ok()) return respond(Error(st));
  // With a model_path, the base the export was made on (the SDK sends base_model beside it).
  if (!model_path && base_model) {
    if (auto base = ops_->BaseNamed(*base_model, "base_model"); !base.ok()) {
      return respond(Error(base.status()));
    }
  }
  auto answer = [](const std::string& sampler_id) {
    return JsonResponse(
        Json{{"type", "create_sampling_session"}, {"sampling_session_id", sampler_id}});
  };
  std::string resent;  // the sampler of an earlier call that still samples
  auto alive = [this, &tenant](const std::string& sampler_id) {
    return sampling_->GetSampler(tenant, sampler_id).ok();
  };
  switch (sampling_sessions_.Begin(tenant, session_id, seq,
                                   JsonDigest("create_sampling_session", body), &respond, alive,
                                   &resent)) {
    case SamplingSessions::Turn::kConflict:
      return respond(Error(400, absl::StrCat("sampling_session_seq_id: ", seq,
                                             " of this session was used by a different request; "
                                             "a resend must repeat its request as it was")));
    case SamplingSessions::Turn::kAnswer:
      return respond(answer(resent));
    case SamplingSessions::Turn::kWait:
      return;  // a resend while it is made: answered with the first call
    case SamplingSessions::Turn::kMake:
      break;
  }
  v1::CreateSamplerRequest req;
  if (model_path) req.set_path(*model_path);
  // With a path, read only for an export whose manifest does not name its base.
  if (base_model) req.set_base_model(*base_model);
  sampling_->CreateSampler(
      tenant, req, [this, tenant, session_id, seq, answer](absl::StatusOr<v1::SamplerInfo> info) {
        // Kept for resends while the session lives; a failure is not: a resend tries again.
        std::vector<Respond> waiting =
            sampling_sessions_.Finish(tenant, session_id, seq, info.ok() ? info->sampler_id() : "");
        // Asked after the sampler is noted: a reaper that ends the session from now on finds it
        // there, and one that ended it already is seen here.
        const bool ended = info.ok() && !sessions_.IsOpen(session_id);
        if (ended) sampling_sessions_.Forget(tenant, session_id, seq, info->sampler_id());
        Response r;
        if (ended) {
          // The session ended (no heartbeats) while its sampler was made: it goes as the
          // session's other samplers went.
          sampling_->DeleteSampler(tenant, info->sampler_id()).IgnoreError();
          r = Error(410, absl::StrCat("session_id: session '", Echo(session_id),
                                      "' ended while its sampler was made; create a new session"));
        } else if (info.ok()) {
          r = answer(info->sampler_id());
        } else {
          // Sampling names the export `path`; the Tinker request calls it model_path.
          absl::string_view message = info.status().message();
          r = Error(absl::Status(info.status().code(), absl::ConsumePrefix(&message, "path: ")
                                                           ? absl::StrCat("model_path: ", message)
                                                           : std::string(message)));
        }
        for (Respond& w : waiting) w(r);
      });
}

void TinkerApi::SaveWeightsForSession(const std::string& tenant, const CallKey& key,
                                      const std::string& model_id, int64_t seq_id, bool inflight,
                                      Respond respond) {
  v1::CreateSamplerRequest req;
  req.set_model_id(model_id);
  req.set_seq_id(seq_id);
  if (seq_id <= 0) return respond(Error(400, "seq_id: must be positive"));
  tinkerd::Sampling* sampling = sampling_;
  CallIntoFuture<v1::SamplerInfo>(
      &futures_, tenant, key, Resend::kOperation,
      [sampling, tenant, req, inflight](Done<v1::SamplerInfo> done) {
        sampling->CreateSampler(tenant, req, std::move(done), inflight);
      },
      [](const v1::SamplerInfo& info) {
        return JsonResponse(
            Json{{"type", "save_weights_for_sampler"}, {"sampling_session_id", info.sampler_id()}});
      },
      std::move(respond));
}

void TinkerApi::GetSampler(const std::string& tenant, const std::string& sampler_id,
                           Respond respond) {
  auto info = sampling_->GetSampler(tenant, sampler_id);
  if (!info.ok()) return respond(Error(info.status()));
  Json out{{"sampler_id", info->sampler_id()}, {"base_model", info->base_model()}};
  out["model_path"] = info->path().empty() ? Json() : Json(info->path());
  respond(JsonResponse(out));
}

void TinkerApi::ASample(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::SampleRequest req;
  const std::optional<std::string> session = f.OptId("sampling_session_id");
  const std::optional<int64_t> seq_id = f.OptInt("seq_id");
  const std::optional<std::string> base_model = f.OptId("base_model");
  const std::optional<std::string> model_path = f.OptId("model_path");
  const int64_t num_samples = f.OptInt("num_samples").value_or(1);
  SampleAnswer asked;
  asked.prompt_logprobs = f.OptBool("prompt_logprobs").value_or(false);
  asked.topk_prompt_logprobs = f.OptInt("topk_prompt_logprobs").value_or(0);
  asked.topk_sample_logprobs = f.OptInt("topk_sample_logprobs").value_or(0);
  asked.prompt_alt_tokens_k = f.OptInt("prompt_alt_tokens_k").value_or(0);
  const int64_t last_n = f.OptInt("prompt_logprobs_last_n").value_or(0);
  const Json* prompt = f.Obj("prompt");
  const Json* params = f.Obj("sampling_params");
  const Json* target = f.Obj("target_prompt_logprobs");
  if (!f.status().ok()) return respond(Error(f.status()));
  const SampleLimits& limits = sampling_->request_limits();
  // The base it samples through, whose limits the checks below use: the session's sampler's, or
  // the named base's. A session without a sampler fails as the sample's future, an unserved
  // base_model where it is read below, each as before; the checks take the default's meanwhile.
  absl::StatusOr<BaseModel> base =
      sampling_->Target(tenant, session.value_or(""), "", session ? "" : base_model.value_or(""));
  const absl::Status unserved = session ? absl::OkStatus() : base.status();
  if (!base.ok()) base = ops_->BaseModels().front();
  absl::Status st = RefuseUnservedSampleFields(body);
  if (st.ok()) st = PromptFromTinker(prompt, req.mutable_prompt());
  if (st.ok()) st = SamplingParamsFromTinker(params, req.mutable_sampling_params());
  if (st.ok() && target != nullptr) {
    asked.target.emplace();
    st =
        TargetPromptFromTinker(*target, base->limits.max_context_length, limits.max_target_prompt_k,
                               req.mutable_target_prompt_logprobs(), &*asked.target);
  }
  // Answered now rather than as the future's error: the SDK then raises at the call.
  if (st.ok()) {
    st = CheckStopStringsMatchable(req.sampling_params().stop_strings_size(), base->limits);
  }
  if (!st.ok()) return respond(Error(st));
  // Checked here as well as by the sampler: the answer below lists one id per sample and pads
  // top-k rows to the widths asked.
  if (num_samples < 1 || num_samples > limits.max_num_samples) {
    return respond(Error(400, absl::StrCat("num_samples: must be in [1, ", limits.max_num_samples,
                                           "], got ", num_samples)));
  }
  for (const auto& [field, k, max] :
       {std::tuple<const char*, int64_t, int64_t>{
            "topk_prompt_logprobs", asked.topk_prompt_logprobs, limits.max_topk_prompt_logprobs},
        {"topk_sample_logprobs", asked.topk_sample_logprobs, limits.max_topk_sample_logprobs},
        {"prompt_alt_tokens_k", asked.prompt_alt_tokens_k, limits.max_prompt_alt_tokens_k}}) {
    if (k < 0 || k > max) {
      return respond(Error(400, absl::StrCat(field, ": must be in [0, ", max, "], got ", k)));
    }
  }
  if (last_n < 0 || last_n > std::numeric_limits<int32_t>::max()) {
    return respond(Error(400, absl::StrCat("prompt_logprobs_last_n: must be in [1, "
                                           "len(prompt) - 1], got ",
                                           last_n)));
  }
  req.set_num_samples(static_cast<int32_t>(num_samples));
  req.set_prompt_logprobs(asked.prompt_logprobs);
  req.set_topk_prompt_logprobs(static_cast<int32_t>(asked.topk_prompt_logprobs));
  req.set_topk_sample_logprobs(static_cast<int32_t>(asked.topk_sample_logprobs));
  req.set_prompt_alt_tokens_k(static_cast<int32_t>(asked.prompt_alt_tokens_k));
  req.set_prompt_logprobs_last_n(static_cast<int32_t>(last_n));
  std::string request_id, topic;
  if (session) {
    if (!seq_id) return respond(Error(400, "seq_id: required with sampling_session_id"));
    req.set_sampler_id(*session);
    request_id = absl::StrCat("sample:", *session, ":", *seq_id);
    topic = SampleTopic(*session, *seq_id / 1'000'000'000);
  } else if (model_path) {
    return respond(Error(400,
                         "model_path: sample through a sampling session "
                         "(create_sampling_client(model_path=...)), not per request"));
  } else {
    if (!unserved.ok()) return respond(Error(unserved));
    req.set_base_model(base->name);
    // The base model without a session has no retry key: each request is new.
    request_id = absl::StrCat("sample:base:", RandomHex());
  }
  // Newer SDKs (0.38) name each sample when it is submitted; the ids follow the result's order.
  Json ids = Json::array();
  for (int64_t i = 0; i < num_samples; ++i) ids.push_back(absl::StrCat(request_id, ":", i));
  Json accepted{{"sample_sequence_ids", ids}};
  tinkerd::Sampling* sampling = sampling_;
  CallIntoFuture<v1::SampleResponse>(
      &futures_, tenant, CallKey{request_id, JsonDigest("asample", body), "seq_id"},
      Resend::kFuture,
      [this, sampling, tenant, req, request_id](Done<v1::SampleResponse> done) {
        const SampleCancels::Flag cancelled = cancels_.Register(tenant, request_id);
        auto forget = [this, tenant, request_id, cancelled] {
          cancels_.Forget(tenant, request_id, cancelled);
        };
        try {
          sampling->Sample(
              tenant, req,
              [forget, done = std::move(done)](absl::StatusOr<v1::SampleResponse> r) {
                forget();
                done(std::move(r));
              },
              [cancelled](std::vector<SampleDelta>) { return !cancelled->load(); });
        } catch (...) {
          forget();
          throw;
        }
      },
      [asked](const v1::SampleResponse& r) {
        tinker_public::SampleResponse out;
        SampleResponseToTinker(r, asked, &out);
        return Response{200, "application/x-protobuf", out.SerializeAsString(), {}};
      },
      std::move(respond), std::move(accepted), topic);
}

void TinkerApi::JoinSamplingSession(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string session = f.Str("sampling_session_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  absl::StatusOr<int64_t> counter = sampling_->JoinSampler(tenant, session);
  if (!counter.ok()) return respond(Error(counter.status()));
  respond(JsonResponse(Json{{"type", "join_sampling_session"}, {"client_counter", *counter}}));
}

void TinkerApi::CancelFuture(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string request_id = f.Str("request_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  if (cancels_.Cancel(tenant, request_id)) return respond(JsonResponse(Json{{"cancelled", true}}));
  if (!futures_.Known(tenant, request_id)) {
    return respond(Error(404, absl::StrCat("request_id: no future '", Echo(request_id), "'")));
  }
  respond(JsonResponse(Json{{"cancelled", false}}));
}

}  // namespace tinkerd::http
