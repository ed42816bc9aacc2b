// The Tinker HTTP API on a real server on loopback, spoken to as the Tinker SDK does (JSON,
// Tinker's protobuf, futures with long polls). The SDK itself drives it in tests/sdk.
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/raw_http_client.h"
#include "tinker_public/tinker_public.pb.h"

namespace tinkerd::testing {
namespace {

using Json = nlohmann::json;

struct Reply {
  int status = 0;
  std::string content_type;
  std::string body;
  Json json() const { return Json::parse(body, nullptr, false); }
};

constexpr char kAlice[] = "tml-alice-0000000000";
constexpr char kBob[] = "tml-bob-00000000000000";

class TinkerHttp : public ::testing::Test {
 protected:
  void SetUp() override { Start(absl::Seconds(30)); }

  // With API keys (alice and bob) by default; without, gRPC calls of LiveServer work too.
  void Start(absl::Duration long_poll, bool keys = true,
             absl::Duration session_idle = absl::ZeroDuration()) {
    ServerConfig sc;
    sc.tinker_http.session_idle = session_idle;
    sc.metrics_port = 0;
    if (keys) {
      const std::string file = keys_dir_.Sub("keys");
      std::ofstream(file) << "alice " << kAlice << "\nbob " << kBob << "\n";
      sc.api_keys = *ApiKeys::LoadFile(file);
    }
    sc.tinker_http.listen = "127.0.0.1:0";
    sc.tinker_http.served_model_name = "tiny-llama";
    sc.tinker_http.futures.long_poll = long_poll;
    sc.tinker_http.futures.keep = keep_;
    sc.tinker_http.futures.max_entries = max_futures_;
    sc.tinker_http.archive = archive_;
    sc.tinker_http.peek_bytes = peek_bytes_;
    sc.sampling.max_samplers_per_tenant = max_samplers_;
    live_ = std::make_unique<LiveServer>(sc, 4096, ComputeDType::kFloat64, false, memory_budget_,
                                         family_);
    port_ = live_->server->tinker_http_port();
    ASSERT_GT(port_, 0);
  }

  Reply Send(const std::string& method, const std::string& path, const std::string& body,
             const std::string& type = "application/json", const std::string& key = kAlice,
             httplib::Headers extra = {}) {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(60, 0);
    httplib::Headers h = std::move(extra);
    if (!key.empty()) h.emplace("X-API-Key", key);
    httplib::Result r = method == "GET"      ? cli.Get(path, h)
                        : method == "DELETE" ? cli.Delete(path, h)
                        : method == "PUT"    ? cli.Put(path, h, body, type)
                                             : cli.Post(path, h, body, type);
    EXPECT_TRUE(r) << method << " " << path << ": no answer: " << httplib::to_string(r.error());
    if (!r) return {};
    return {r->status, r->get_header_value("Content-Type"), r->body};
  }
  Reply Post(const std::string& endpoint, const Json& body, const std::string& key = kAlice) {
    return Send("POST", "/api/v1/" + endpoint, body.dump(), "application/json", key);
  }

  // Polls a future until it has an answer (the server long-polls; no sleeping here), as the SDK
  // does: a result announced by its size (complete_metadata) is polled again without the peek.
  Reply Await(const std::string& request_id, const std::string& key = kAlice) {
    bool peek = true;
    for (int i = 0; i < 100; ++i) {
      Reply r =
          Post("retrieve_future", {{"request_id", request_id}, {"allow_metadata_only", peek}}, key);
      const bool json = r.status == 200 && r.content_type == "application/json";
      if (json && peek && r.json().value("status", "") == "complete_metadata") {
        peek = false;
        continue;
      }
      if (!json || r.json().value("type", "") != "try_again") return r;
    }
    ADD_FAILURE() << "future " << request_id << " never finished";
    return {};
  }
  // Submits a call that answers with a future and waits for its result.
  Reply Call(const std::string& endpoint, const Json& body) {
    Reply r = Post(endpoint, body);
    EXPECT_EQ(r.status, 200) << endpoint << ": " << r.body;
    return Await(r.json().value("request_id", ""));
  }

  std::string Session(const std::string& key = kAlice) {
    Reply r = Post("create_session", {{"tags", Json::array()}, {"sdk_version", "0.25.0"}}, key);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().value("session_id", "");
  }
  std::string CreateModel(uint64_t seed = 5, std::string session = "") {
    if (session.empty()) session = Session();
    Reply r = Call("create_model", {{"session_id", session},
                                    {"model_seq_id", 0},
                                    {"base_model", "tiny-llama"},
                                    {"lora_config", {{"rank", 4}, {"seed", seed}}}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().value("model_id", "");
  }

  // The same batch as Tinker's protobuf.
  static std::string TinkerBatch(const std::string& model, int64_t seq,
                                 const std::vector<Datum>& data, bool forward_only = false) {
    tinker_public::ForwardBackwardRequest req;
    req.set_model_id(model);
    req.set_seq_id(static_cast<int32_t>(seq));
    req.set_loss_fn("cross_entropy");
    req.set_forward_only(forward_only);
    for (const Datum& d : data) {
      tinker_public::Datum* out = req.add_data();
      std::vector<int32_t> tokens(d.tokens.begin(), d.tokens.end());
      out->add_model_input()->mutable_encoded_text()->set_tokens(
          std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4));
      for (const auto& [key, t] : d.loss_fn_inputs) {
        tinker_public::Tensor& pt = (*out->mutable_loss_fn_inputs())[key];
        if (t.dtype == TensorData::DType::kInt64) {
          pt.set_dtype(tinker_public::DTYPE_INT64);
          pt.set_dense(std::string(reinterpret_cast<const char*>(t.int64_data.data()),
                                   t.int64_data.size() * 8));
        } else {
          pt.set_dtype(tinker_public::DTYPE_FLOAT32);
          pt.set_dense(std::string(reinterpret_cast<const char*>(t.float32_data.data()),
                                   t.float32_data.size() * 4));
        }
        pt.add_shape(static_cast<int64_t>(d.tokens.size()));
      }
    }
    return req.SerializeAsString();
  }
  Reply SubmitBatch(const std::string& bytes, const std::string& key = kAlice) {
    return Send("POST", "/api/v1/forward_backward", bytes, "application/x-protobuf", key);
  }

  std::vector<Datum> Batch(uint64_t seed, std::vector<int> lengths = {5, 9, 3}) {
    SplitMix64 g(seed);
    return RandomData(g, lengths, "cross_entropy", live_->server->runner()->limits().vocab_size);
  }

  int64_t NextSeqId(const std::string& model) {
    return *live_->server->scheduler()->NextSeqId(model);
  }
  int64_t AccumulatedTokens(const std::string& model) {
    return live_->server->runner()->GetInfo(model)->accumulated_tokens;
  }

  // A Tinker sampling session (create_sampling_session) of the base model.
  Reply SamplingSession(const std::string& session, int64_t seq) {
    return Post(
        "create_sampling_session",
        {{"session_id", session}, {"sampling_session_seq_id", seq}, {"base_model", "tiny-llama"}});
  }
  // Two steps of one batch through HTTP, gRPC and a runner in process: the same bits.
  void ExpectTheSameStepsEverywhere();

  std::string Metrics() {
    httplib::Client cli("127.0.0.1", live_->server->metrics_port());
    auto r = cli.Get("/metrics");
    EXPECT_TRUE(r);
    return r ? r->body : "";
  }

  absl::Duration keep_ = absl::Minutes(10);
  size_t max_futures_ = 100000;
  int max_samplers_ = 32;
  http::ArchiveConfig archive_;
  int64_t peek_bytes_ = 1 << 20;
  int64_t memory_budget_ = 0;     // the runner's (0: the default)
  std::string family_ = "llama";  // of the served model (still named tiny-llama)
  TempDir keys_dir_;
  std::unique_ptr<LiveServer> live_;
  int port_ = 0;
};

TEST_F(TinkerHttp, BadRequestsGetAStatusAndABodyNamingTheReasonAndChangeNothing) {
  const std::string model = CreateModel();
  const auto before = live_->StateChecksum(model);
  const int64_t next = NextSeqId(model);
  const std::string batch = TinkerBatch(model, next, Batch(1));
  struct Case {
    const char* what;
    Reply reply;
    int status;
    const char* detail;
  };
  const std::vector<Case> cases = {
      {"unknown endpoint", Post("no_such_thing", Json::object()), 404, "no endpoint"},
      {"no key", Post("get_info", {{"model_id", model}}, ""), 401, "X-API-Key: missing"},
      {"unknown key", Post("get_info", {{"model_id", model}}, "tml-nobody"), 401, "X-API-Key"},
      {"malformed JSON", Send("POST", "/api/v1/optim_step", "{\"model_id\": "), 400, "body"},
      {"wrong content type", Send("POST", "/api/v1/optim_step", "x", "text/plain"), 415,
       "Content-Type"},
      {"wrong method", Send("GET", "/api/v1/optim_step", ""), 405, "POST"},
      {"JSON forward_backward", Send("POST", "/api/v1/forward_backward", "{}"), 415,
       "application/x-protobuf"},
      {"malformed protobuf", SubmitBatch(std::string("\xff\xff\xff", 3)), 400, "body"},
      {"compressed",
       Send("POST", "/api/v1/forward_backward", batch, "application/x-protobuf", kAlice,
            {{"Content-Encoding", "zstd"}}),
       415, "Content-Encoding"},
      {"missing field", Post("optim_step", {{"model_id", model}}), 400, "seq_id: required"},
      {"unknown future", Post("retrieve_future", {{"request_id", model + ":999"}}), 404,
       "request_id"},
      {"another model",
       Post("create_model",
            {{"session_id", Session()}, {"model_seq_id", 1}, {"base_model", "gpt-9"}}),
       400, "base_model"},
      {"unknown session",
       Post("create_model",
            {{"session_id", "session-0"}, {"model_seq_id", 1}, {"base_model", "tiny-llama"}}),
       404, "session_id"},
      {"another optimizer",
       Post("create_model", {{"session_id", Session()},
                             {"model_seq_id", 1},
                             {"base_model", "tiny-llama"},
                             {"optimizer_config", {{"type", "dimuon"}}}}),
       400, "optimizer_config.type"},
      {"foreign model", Post("get_info", {{"model_id", model}}, kBob), 404, "model_id"},
      {"sample without a prompt", Post("asample", {{"sampling_session_id", "sampler-0"}}), 400,
       "prompt"},
      {"stop strings on a model without a tokenizer",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"sampling_params", {{"max_tokens", 2}, {"stop", "\n"}}}}),
       400, "sampling_params.stop: stop strings need the model's tokenizer"},
      // SDK 0.38's fields: those not served are refused by name, never ignored; bad values of the
      // served ones are refused before anything is queued.
      {"too many alternative prompt tokens",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"prompt_alt_tokens_k", 21},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "prompt_alt_tokens_k: must be in [0, 20], got 21"},
      {"too many top-k logprobs of sampled tokens",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"topk_sample_logprobs", 21},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "topk_sample_logprobs: must be in [0, 20], got 21"},
      {"target prompt logprobs of floats",
       Post("asample",
            {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
             {"target_prompt_logprobs", {{"data", {0.5}}, {"dtype", "float32"}, {"shape", {1, 1}}}},
             {"sampling_params", {{"max_tokens", 2}}}}),
       400, "target_prompt_logprobs.dtype"},
      {"stability records",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"record_stability_info", true},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "record_stability_info"},
      {"a negative last n of prompt logprobs",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"prompt_logprobs", true},
                        {"prompt_logprobs_last_n", -1},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "prompt_logprobs_last_n: must be in [1, len(prompt) - 1], got -1"},
      {"stop strings mixed with token ids",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"sampling_params", {{"max_tokens", 2}, {"stop", {"\n", 5}}}}}),
       400, "sampling_params.stop"},
      {"a chunk type that is no string (once thrown out of the handler)",
       Post("asample", {{"prompt", {{"chunks", {{{"type", 5}, {"tokens", {1}}}}}}},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "prompt.chunks[0]: type: must be a string"},
      // Issue 36, items 11 and 12: an empty string is a value (no identifier takes it), never
      // absence; an integer at or past 2^63 is refused, never read modulo 2^64.
      {"an empty sampling session id",
       Post("asample", {{"sampling_session_id", ""},
                        {"seq_id", 0},
                        {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "sampling_session_id: must be a non-empty string"},
      {"an empty export path",
       Post("create_sampling_session",
            {{"session_id", Session()}, {"sampling_session_seq_id", 0}, {"model_path", ""}}),
       400, "model_path: must be a non-empty string"},
      {"top_k of 2^64 - 1",
       Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"sampling_params",
                         {{"max_tokens", 2}, {"top_k", Json(uint64_t{18446744073709551615ull})}}}}),
       400, "sampling_params: top_k: must be an integer in [-2^63, 2^63)"},
      {"num_samples of 2^64 - 1",
       Post("asample", {{"num_samples", Json(uint64_t{18446744073709551615ull})},
                        {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "num_samples: must be an integer in [-2^63, 2^63)"},
      {"a prompt token of 2^63",
       Post("asample",
            {{"prompt",
              {{"chunks", {{{"type", "encoded_text"}, {"tokens", {Json(uint64_t{1} << 63)}}}}}}},
             {"sampling_params", {{"max_tokens", 2}}}}),
       400, "prompt.chunks[0].tokens: must be int64 integers"},
      // Issue 36, item 2: nesting is refused at the 17th level, as containers open.
      {"a body nested 17 levels deep",
       Send("POST", "/api/v1/asample",
            R"({"prompt": {"chunks": [{"tokens": )" + std::string(13, '[') + "1" +
                std::string(13, ']') + "}]}}",
            "application/json"),
       400, "body: nested deeper than 16 levels"},
      // Issue 36, item 2: a shape denser than any request is refused at its start, before its
      // DOM (here ~300 MB) is built.
      {"8 MiB of nested arrays",
       Send("POST", "/api/v1/asample",
            [] {
              std::string s = R"({"prompt": {"chunks": [{"tokens": [)";
              while (s.size() < (size_t{8} << 20)) s += "[1],";
              s.back() = ']';
              return s + "}]}}";
            }(),
            "application/json"),
       400, "body: its JSON would take more than 24 bytes of memory per byte of text"},
      {"too many samples",
       Post("asample", {{"num_samples", 1 << 30},
                        {"prompt", {{"chunks", Json::array()}}},
                        {"sampling_params", {{"max_tokens", 2}}}}),
       400, "num_samples"},
      {"unknown sampler", Send("GET", "/api/v1/samplers/sampler-0", "", "", kAlice), 404,
       "sampler_id"},
      {"unknown export",
       Post("create_sampling_session",
            {{"session_id", Session()},
             {"sampling_session_seq_id", 0},
             {"model_path", "tinker://" + model + "/sampler_weights/nope"}}),
       404, "model_path: "},
      {"a training checkpoint as an export",
       Post("create_sampling_session", {{"session_id", Session()},
                                        {"sampling_session_seq_id", 0},
                                        {"model_path", "tinker://" + model + "/weights/nope"}}),
       400, "model_path: "},
      {"another base model to sample",
       Post("create_sampling_session",
            {{"session_id", Session()}, {"sampling_session_seq_id", 0}, {"base_model", "gpt-9"}}),
       400, "base_model: "},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.reply.status, c.status) << c.what << ": " << c.reply.body;
    EXPECT_EQ(c.reply.content_type, "application/json") << c.what;
    const Json j = c.reply.json();
    ASSERT_TRUE(j.is_object() && j.contains("detail")) << c.what << ": " << c.reply.body;
    EXPECT_NE(j["detail"].get<std::string>().find(c.detail), std::string::npos)
        << c.what << ": " << c.reply.body;
  }
  // Another tenant's future is unknown to bob, though it exists for alice.
  Reply submitted = SubmitBatch(batch);
  ASSERT_EQ(submitted.status, 200) << submitted.body;
  const std::string rid = submitted.json()["request_id"];
  EXPECT_EQ(Post("retrieve_future", {{"request_id", rid}}, kBob).status, 404);
  EXPECT_EQ(Await(rid).content_type, "application/x-protobuf");
  // Only that last, valid batch changed the model (the control that the checksum sees a change).
  EXPECT_NE(live_->StateChecksum(model), before);
  EXPECT_EQ(NextSeqId(model), next + 1);
}

// A field refused once the request's model and seq_id are read takes that seq_id with its error,
// answered through the call's future: the SDK has used the seq_id and waits on it, and the model's
// later calls would otherwise wait --order_timeout_s for a seq_id that never comes. Nothing else
// changes, and a resend of the refused request is answered with the same refusal.
TEST_F(TinkerHttp, ARefusedFieldTakesItsSeqIdAndTheModelsNextCallRuns) {
  const std::string model = CreateModel();
  const auto before = live_->StateChecksum(model);
  struct Case {
    const char* what;
    const char* endpoint;
    Json fields;
    const char* detail;
  };
  const std::vector<Case> cases = {
      {"a mistyped Adam parameter",
       "optim_step",
       {{"adam_params", {{"eps", "x"}}}},
       "adam_params.eps: must be a number"},
      {"a sampler of an unknown kind",
       "save_weights_for_sampler",
       {{"kind", "sideways"}},
       "kind: must be 'snapshot' or 'inflight'"},
      {"an inflight sampler with a path",
       "save_weights_for_sampler",
       {{"kind", "inflight"}, {"path", "p"}},
       "kind: an inflight save"},
      {"a sampler checkpoint's lifetime under an hour",
       "save_weights_for_sampler",
       {{"path", "x"}, {"ttl_seconds", 60}},
       "ttl_seconds: must be an integer from 3600"},
      {"a lifetime on a save that stores nothing",
       "save_weights_for_sampler",
       {{"sampling_session_seq_id", 0}, {"ttl_seconds", 3600}},
       "ttl_seconds: a save without a path"},
      {"a checkpoint's lifetime as a string",
       "save_weights",
       {{"path", "y"}, {"ttl_seconds", "3600"}},
       "ttl_seconds: must be an integer from 3600"},
      {"Adam parameters that are not an object",
       "optim_step",
       {{"adam_params", Json::array({1})}},
       "adam_params: must be an object"},
      {"a checkpoint save without a path", "save_weights", Json::object(), "path: required"},
      {"a checkpoint save under an empty name",
       "save_weights",
       {{"path", ""}},
       "path: must be a non-empty string"},
      {"overwrite as a string",
       "save_weights",
       {{"path", "z"}, {"overwrite", "yes"}},
       "overwrite: must be a boolean"},
      {"a sampler's path as a number",
       "save_weights_for_sampler",
       {{"path", 5}},
       "path: must be a string"},
      {"an export without a path", "save_weights_external", Json::object(), "path: required"},
      {"a load without a path", "load_weights", Json::object(), "path: required"},
      {"a load's optimizer flag as a string",
       "load_weights",
       {{"path", "w"}, {"optimizer", "yes"}},
       "optimizer: must be a boolean"},
  };
  for (const Case& c : cases) {
    const int64_t seq = NextSeqId(model);
    Json body = c.fields;
    body["model_id"] = model;
    body["seq_id"] = seq;
    const Reply refused = Call(c.endpoint, body);
    EXPECT_EQ(refused.json().value("category", ""), "user") << c.what << ": " << refused.body;
    EXPECT_NE(refused.json().value("error", "").find(c.detail), std::string::npos)
        << c.what << ": " << refused.body;
    EXPECT_EQ(NextSeqId(model), seq + 1) << c.what << ": the refusal takes its seq_id";
    const Reply again = Call(c.endpoint, body);
    EXPECT_EQ(again.json().value("error", ""), refused.json().value("error", ""))
        << c.what << ": a resend is answered as the request was: " << again.body;
    EXPECT_EQ(NextSeqId(model), seq + 1) << c.what << ": a resend takes no other seq_id";
  }
  EXPECT_EQ(live_->StateChecksum(model), before);
  // The model's next call runs now, at the seq_id after the refusals'.
  const int64_t next = NextSeqId(model);
  Reply submitted = SubmitBatch(TinkerBatch(model, next, Batch(2)));
  ASSERT_EQ(submitted.status, 200) << submitted.body;
  EXPECT_EQ(Await(submitted.json()["request_id"]).content_type, "application/x-protobuf");
  EXPECT_EQ(NextSeqId(model), next + 1);
  EXPECT_NE(live_->StateChecksum(model), before) << "the control: the checksum sees a change";
}

TEST_F(TinkerHttp, TheSameStepsThroughHttpAndGrpcGiveBitwiseIdenticalResultsAndWeights) {
  ExpectTheSameStepsEverywhere();
}

// A mixture of experts (Mixtral's layout: four experts, two per token, each with its own LoRA
// pairs) trains through both front ends as in process, and samples through the HTTP API with the
// trained adapter, each sampled token's logprob the trainer's.
TEST_F(TinkerHttp, AMixtureOfExpertsTrainsAndSamplesThroughBothFrontEnds) {
  family_ = "mixtral";
  ExpectTheSameStepsEverywhere();
  if (HasFatalFailure()) return;
  const std::string session = Session();
  const std::string model = CreateModel(/*seed=*/11, session);
  Reply trained = SubmitBatch(TinkerBatch(model, 1, Batch(300)));
  ASSERT_EQ(trained.status, 200) << trained.body;
  ASSERT_EQ(Await(trained.json()["request_id"]).status, 200);
  Reply stepped =
      Call("optim_step",
           {{"model_id", model}, {"seq_id", 2}, {"adam_params", {{"learning_rate", 5e-2}}}});
  ASSERT_EQ(stepped.status, 200) << stepped.body;
  Reply saved =
      Call("save_weights_for_sampler", {{"model_id", model}, {"path", "moe"}, {"seq_id", 3}});
  ASSERT_EQ(saved.status, 200) << saved.body;
  Reply sampler = Post("create_sampling_session", {{"session_id", session},
                                                   {"sampling_session_seq_id", 0},
                                                   {"model_path", saved.json().value("path", "")}});
  ASSERT_EQ(sampler.status, 200) << sampler.body;
  const std::vector<int64_t> prompt = {5, 17, 42};
  Reply r =
      Post("asample", {{"sampling_session_id", sampler.json().value("sampling_session_id", "")},
                       {"seq_id", 1},
                       {"num_samples", 2},
                       {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", prompt}}}}}},
                       {"sampling_params", {{"max_tokens", 5}, {"seed", 3}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  Reply done = Await(r.json().value("request_id", ""));
  ASSERT_EQ(done.status, 200) << done.body;
  ASSERT_EQ(done.content_type, "application/x-protobuf") << done.body;
  tinker_public::SampleResponse response;
  ASSERT_TRUE(response.ParseFromString(done.body));
  ASSERT_EQ(response.sequences_size(), 2);
  ModelRunner& runner = *live_->server->runner();
  for (const tinker_public::SampledSequence& s : response.sequences()) {
    std::vector<int32_t> sampled(s.tokens().size() / sizeof(int32_t));
    std::memcpy(sampled.data(), s.tokens().data(), s.tokens().size());
    std::vector<float> logprobs(s.logprobs().size() / sizeof(float));
    std::memcpy(logprobs.data(), s.logprobs().data(), s.logprobs().size());
    const std::vector<int64_t> tokens(sampled.begin(), sampled.end());
    ASSERT_EQ(tokens.size(), 5u);
    ASSERT_EQ(logprobs.size(), tokens.size());
    Datum d;
    d.tokens = prompt;
    d.tokens.insert(d.tokens.end(), tokens.begin(), tokens.end() - 1);
    std::vector<int64_t> targets(prompt.begin() + 1, prompt.end());
    targets.insert(targets.end(), tokens.begin(), tokens.end());
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(targets);
    d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(targets.size(), 1.f));
    auto forward = runner.Forward(model, {d}, "cross_entropy", {});
    ASSERT_TRUE(forward.ok()) << forward.status().message();
    for (size_t t = 0; t < tokens.size(); ++t) {
      // In float64 the sampler and Forward agree to the float32 the logprobs are sent in.
      EXPECT_NEAR(logprobs[t], forward->outputs[0].logprobs[prompt.size() - 1 + t],
                  1e-6 * std::max(1.0, std::abs(static_cast<double>(logprobs[t]))))
          << "token " << t;
    }
  }
}

void TinkerHttp::ExpectTheSameStepsEverywhere() {
  Start(absl::Seconds(30), /*keys=*/false);
  const std::string via_http = CreateModel(/*seed=*/11);
  // The gRPC twin with what create_model asks for: rank 4, default alpha, all modules, sums.
  auto grpc_model = [&](uint64_t seed) {
    grpc::ClientContext ctx;
    v1::CreateModelRequest req;
    req.set_loss_reduction("sum");
    req.set_seed(seed);
    req.mutable_lora()->set_rank(4);
    req.mutable_lora()->set_train_attn(true);
    req.mutable_lora()->set_train_mlp(true);
    req.mutable_lora()->set_train_unembed(true);
    v1::ModelInfo info;
    EXPECT_TRUE(live_->stub->CreateModel(&ctx, req, &info).ok());
    return info.model_id();
  };
  const std::string via_grpc = grpc_model(11);
  const std::string control = grpc_model(11);
  ASSERT_EQ(live_->StateChecksum(via_http), live_->StateChecksum(via_grpc));
  // And in process, on a runner of the same model and precision, no server in between.
  auto local = MakeRunner(live_->model_dir, ComputeDType::kFloat64);
  CreateModelOptions options;
  options.lora = LoraConfig{};
  options.lora->rank = 4;
  options.loss_reduction = LossReduction::kSum;
  options.seed = 11;
  const std::string in_process = *local->CreateModel(options);
  auto local_params = [&] { return Flat(Snap(*local, in_process, StateKind::kParams)); };
  auto server_params = [&](const std::string& m) {
    return Flat(Snap(*live_->server->runner(), m, StateKind::kParams));
  };
  ASSERT_EQ(local_params(), server_params(via_http));

  for (int step = 0; step < 2; ++step) {
    const std::vector<Datum> data = Batch(100 + step);
    const int64_t seq = 1 + 2 * step;
    Reply r = SubmitBatch(TinkerBatch(via_http, seq, data));
    ASSERT_EQ(r.status, 200) << r.body;
    Reply result = Await(r.json()["request_id"]);
    ASSERT_EQ(result.content_type, "application/x-protobuf") << result.body;
    tinker_public::ForwardBackwardOutput http_out;
    ASSERT_TRUE(http_out.ParseFromString(result.body));

    v1::ForwardBackwardOutput grpc_out;
    ASSERT_TRUE(live_->FwdBwd(MakeRequest(via_grpc, seq, data), &grpc_out).ok());
    std::vector<Datum> perturbed = data;  // the broken control: one weight differs
    perturbed[0].loss_fn_inputs["weights"].float32_data.back() += 0.5f;
    v1::ForwardBackwardOutput control_out;
    ASSERT_TRUE(live_->FwdBwd(MakeRequest(control, seq, perturbed), &control_out).ok());

    auto local_out = local->ForwardBackward(in_process, data, "cross_entropy", {});
    ASSERT_TRUE(local_out.ok()) << local_out.status().message();
    EXPECT_EQ(http_out.metrics().at("loss:sum"), grpc_out.metrics().at("loss:sum"));
    EXPECT_EQ(http_out.metrics().at("loss:sum"), local_out->metrics.at("loss:sum"));
    EXPECT_NE(control_out.metrics().at("loss:sum"), grpc_out.metrics().at("loss:sum"));
    std::string grpc_logprobs;
    for (const auto& o : grpc_out.outputs()) grpc_logprobs += o.logprobs().data();
    std::string http_logprobs;
    int64_t datums = 0;
    for (const auto& rec : http_out.loss_fn_outputs()) {
      http_logprobs += rec.fields().at("logprobs").data();
      datums += rec.num_datums();
    }
    EXPECT_EQ(datums, static_cast<int64_t>(data.size()));
    EXPECT_EQ(http_logprobs, grpc_logprobs);
    std::string local_logprobs;
    for (const DatumOutput& o : local_out->outputs) {
      local_logprobs.append(reinterpret_cast<const char*>(o.logprobs.data()),
                            o.logprobs.size() * sizeof(float));
    }
    EXPECT_EQ(http_logprobs, local_logprobs);

    Reply step_reply = Call(
        "optim_step",
        {{"model_id", via_http}, {"seq_id", seq + 1}, {"adam_params", {{"learning_rate", 1e-2}}}});
    ASSERT_EQ(step_reply.status, 200) << step_reply.body;
    EXPECT_GT(step_reply.json()["metrics"].value("grad_norm:mean", -1.0), 0.0) << step_reply.body;
    v1::OptimStepResponse grpc_step;
    ASSERT_TRUE(live_->Optim(via_grpc, seq + 1, &grpc_step, 1e-2).ok());
    ASSERT_TRUE(live_->Optim(control, seq + 1, &grpc_step, 1e-2).ok());
    AdamParams adam;
    adam.learning_rate = 1e-2;
    ASSERT_TRUE(local->OptimStep(in_process, adam).ok());
  }
  EXPECT_EQ(live_->StateChecksum(via_http), live_->StateChecksum(via_grpc));
  EXPECT_EQ(server_params(via_http), local_params());
  EXPECT_NE(live_->StateChecksum(control), live_->StateChecksum(via_grpc));
}

TEST_F(TinkerHttp, RetriesGetTheFirstResultAndAnotherPayloadForTheSameSeqIdIsRefused) {
  const std::string model = CreateModel();
  const std::vector<Datum> data = Batch(7);
  const std::string bytes = TinkerBatch(model, 1, data);
  Reply first = SubmitBatch(bytes);
  ASSERT_EQ(first.status, 200) << first.body;
  const Reply result = Await(first.json()["request_id"]);
  Reply retry = SubmitBatch(bytes);
  ASSERT_EQ(retry.status, 200) << retry.body;
  EXPECT_EQ(retry.json()["request_id"], first.json()["request_id"]);
  EXPECT_EQ(Await(retry.json()["request_id"]).body, result.body);
  int64_t tokens = 0;
  for (const Datum& d : data) {
    for (float w : d.loss_fn_inputs.at("weights").float32_data) tokens += w != 0.0f;
  }
  EXPECT_EQ(AccumulatedTokens(model), tokens) << "a retry was applied twice";

  Reply other = SubmitBatch(TinkerBatch(model, 1, Batch(8)));
  EXPECT_EQ(other.status, 400) << other.body;
  EXPECT_NE(other.json().value("detail", "").find("already used"), std::string::npos) << other.body;
  EXPECT_EQ(Await(first.json()["request_id"]).body, result.body) << "the first future changed";
  // Creating is deduplicated by (session, model_seq_id) too.
  const std::string session = Session();
  const Json create = {{"session_id", session}, {"model_seq_id", 3}, {"base_model", "tiny-llama"}};
  Reply a = Post("create_model", create), b = Post("create_model", create);
  ASSERT_EQ(a.status, 200);
  EXPECT_EQ(a.json()["request_id"], b.json()["request_id"]);
  EXPECT_EQ(Await(a.json()["request_id"]).json()["model_id"],
            Await(b.json()["request_id"]).json()["model_id"]);
}

TEST_F(TinkerHttp, FailuresBecomeTheFutureErrorAndDoNotHoldUpLaterCalls) {
  const std::string model = CreateModel();
  std::vector<Datum> bad = Batch(3);
  bad[1].tokens[0] = 1 << 30;  // outside the vocabulary
  Reply r = SubmitBatch(TinkerBatch(model, 1, bad));
  ASSERT_EQ(r.status, 200) << r.body;
  Json error = Await(r.json()["request_id"]).json();
  EXPECT_EQ(error.value("category", ""), "user") << error;
  EXPECT_NE(error.value("error", "").find("data[1]"), std::string::npos) << error;

  tinker_public::ForwardBackwardRequest image;  // decodes in no front end: refused, slot taken
  image.set_model_id(model);
  image.set_seq_id(2);
  image.set_loss_fn("cross_entropy");
  image.add_data()->add_model_input()->mutable_image()->set_data("png");
  r = SubmitBatch(image.SerializeAsString());
  ASSERT_EQ(r.status, 200) << r.body;
  error = Await(r.json()["request_id"]).json();
  EXPECT_EQ(error.value("category", ""), "user") << error;
  EXPECT_NE(error.value("error", "").find("image"), std::string::npos) << error;

  r = SubmitBatch(TinkerBatch(model, 3, Batch(4)));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Await(r.json()["request_id"]).content_type, "application/x-protobuf");
}

TEST_F(TinkerHttp, ALongPollAnswersTryAgainThenTheResultOnceTheEarlierSeqIdArrives) {
  Start(absl::Milliseconds(200));
  const std::string model = CreateModel();
  Reply second = SubmitBatch(TinkerBatch(model, 2, Batch(2)));  // waits for seq_id 1
  ASSERT_EQ(second.status, 200) << second.body;
  const std::string rid = second.json()["request_id"];
  Reply poll = Post("retrieve_future", {{"request_id", rid}});
  ASSERT_EQ(poll.status, 200) << poll.body;
  EXPECT_EQ(poll.json().value("type", ""), "try_again") << poll.body;
  EXPECT_EQ(poll.json().value("request_id", ""), rid);
  Reply first = SubmitBatch(TinkerBatch(model, 1, Batch(1)));
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(Await(rid).content_type, "application/x-protobuf");
  EXPECT_EQ(Await(first.json()["request_id"]).content_type, "application/x-protobuf");
}

TEST_F(TinkerHttp, CheckpointsSaveLoadAndDescribeThemselves) {
  const std::string model = CreateModel();
  ASSERT_EQ(Await(SubmitBatch(TinkerBatch(model, 1, Batch(1))).json()["request_id"]).status, 200);
  Reply saved = Call("save_weights", {{"model_id", model}, {"seq_id", 2}, {"path", "ck"}});
  ASSERT_EQ(saved.status, 200) << saved.body;
  const std::string path = saved.json().value("path", "");
  EXPECT_EQ(path, "tinker://" + model + "/weights/ck");
  const auto at_save = live_->StateChecksum(model);
  Call("optim_step", {{"model_id", model}, {"seq_id", 3}, {"adam_params", Json::object()}});
  ASSERT_NE(live_->StateChecksum(model), at_save);
  Reply loaded = Call("load_weights",
                      {{"model_id", model}, {"seq_id", 4}, {"path", path}, {"optimizer", true}});
  ASSERT_EQ(loaded.status, 200) << loaded.body;
  EXPECT_EQ(loaded.json().value("path", ""), path);
  EXPECT_EQ(live_->StateChecksum(model), at_save);

  Reply info = Post("weights_info", {{"tinker_path", path}});
  ASSERT_EQ(info.status, 200) << info.body;
  EXPECT_EQ(info.json().value("base_model", ""), "tiny-llama");
  EXPECT_EQ(info.json().value("lora_rank", 0), 4);
  EXPECT_EQ(Post("weights_info", {{"tinker_path", path}}, kBob).status, 404);

  Reply sampler =
      Call("save_weights_for_sampler", {{"model_id", model}, {"seq_id", 5}, {"path", "s1"}});
  EXPECT_EQ(sampler.json().value("path", ""), "tinker://" + model + "/sampler_weights/s1");
  auto last_request = [&](const std::string& id) {
    return Send("GET", "/api/v1/training_runs/" + id, "").json().value("last_request_time", "");
  };
  const std::string after_save = last_request(model);

  Reply restored =
      Call("load_weights",
           {{"session_id", Session()}, {"model_seq_id", 0}, {"path", path}, {"optimizer", true}});
  ASSERT_EQ(restored.status, 200) << restored.body;
  const std::string copy = restored.json().value("model_id", "");
  ASSERT_FALSE(copy.empty()) << restored.body;
  EXPECT_EQ(live_->StateChecksum(copy), at_save);
  // A run's last_request_time is its model's last request: the restore (another model's, tens of
  // milliseconds) does not move it; the copy's is later (ISO times in one format sort as text).
  EXPECT_EQ(last_request(model), after_save);
  EXPECT_GT(last_request(copy), after_save);

  // The RestClient's views: the run, its checkpoints, deleting one; none of it for bob.
  Reply run = Send("GET", "/api/v1/training_runs/" + model, "");
  ASSERT_EQ(run.status, 200) << run.body;
  EXPECT_EQ(run.json()["last_checkpoint"].value("tinker_path", ""), path) << run.body;
  EXPECT_EQ(run.json().value("lora_rank", 0), 4);
  Reply list = Send("GET", "/api/v1/training_runs/" + model + "/checkpoints", "");
  ASSERT_EQ(list.status, 200) << list.body;
  ASSERT_EQ(list.json()["checkpoints"].size(), 2u) << list.body;
  EXPECT_EQ(list.json()["checkpoints"][0].value("checkpoint_id", ""), "weights/ck");
  EXPECT_EQ(list.json()["checkpoints"][1].value("checkpoint_type", ""), "sampler");
  EXPECT_GT(list.json()["checkpoints"][0].value("size_bytes", 0), 0);
  Reply runs = Send("GET", "/api/v1/training_runs", "");
  EXPECT_EQ(runs.json()["cursor"].value("total_count", 0), 2) << runs.body;  // model and copy
  EXPECT_EQ(Send("GET", "/api/v1/training_runs/" + model, "", "", kBob).status, 404);
  EXPECT_EQ(Send("GET", "/api/v1/training_runs", "", "", kBob).json()["training_runs"].size(), 0u);
  EXPECT_EQ(
      Send("DELETE", "/api/v1/training_runs/" + model + "/checkpoints/weights/ck", "", "", kBob)
          .status,
      404);
  Reply deleted = Send("DELETE", "/api/v1/training_runs/" + model + "/checkpoints/weights/ck", "");
  EXPECT_EQ(deleted.status, 200) << deleted.body;
  EXPECT_EQ(Post("weights_info", {{"tinker_path", path}}).status, 404);

  Reply unloaded = Call("unload_model", {{"model_id", copy}});
  EXPECT_EQ(unloaded.json().value("model_id", ""), copy) << unloaded.body;
  EXPECT_FALSE(live_->server->scheduler()->HasModel(copy));
}

TEST_F(TinkerHttp, AnArchiveUrlStartsWithThePublicUrlAndAnswers410OnceItExpires) {
  archive_.url_ttl = absl::Seconds(2);
  archive_.public_url = "https://tinkerd.example.org/team/";
  Start(absl::Seconds(30));
  const std::string model = CreateModel();
  ASSERT_EQ(Call("save_weights", {{"model_id", model}, {"seq_id", 1}, {"path", "ck"}}).status, 200);
  const std::string endpoint = "/api/v1/training_runs/" + model + "/checkpoints/weights/ck/archive";
  Reply grant = Send("GET", endpoint, "");
  ASSERT_EQ(grant.status, 200) << grant.body;
  // Behind a proxy the URL is the public one (its trailing slash dropped), whatever Host said.
  const std::string url = grant.json().value("url", "");
  const std::string prefix = "https://tinkerd.example.org/team/api/v1/archives/";
  ASSERT_TRUE(absl::StartsWith(url, prefix)) << url;
  const std::string path = "/api/v1/archives/" + url.substr(prefix.size());

  // Until it expires the URL downloads the archive; then 410 with a body saying so, never 404.
  // Polled against the clock: the server's check is what is under test, not a sleep's length.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  Reply r;
  int downloads = 0;
  while (absl::Now() < deadline) {
    r = Send("GET", path, "", "", /*key=*/"");
    if (r.status != 200) break;
    ++downloads;
    EXPECT_EQ(r.content_type, "application/x-tar");
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(r.status, 410) << r.body;
  EXPECT_TRUE(absl::StrContains(r.json().value("detail", r.body), "expired")) << r.body;
  EXPECT_GT(absl::Now() + absl::Seconds(28), deadline)
      << "expired early, after " << downloads << " downloads";
  // A new URL for the same checkpoint works again.
  Reply again = Send("GET", endpoint, "");
  ASSERT_EQ(again.status, 200) << again.body;
  const std::string fresh = again.json().value("url", "");
  ASSERT_TRUE(absl::StartsWith(fresh, prefix)) << fresh;
  EXPECT_EQ(Send("GET", "/api/v1/archives/" + fresh.substr(prefix.size()), "", "", "").status, 200);
}

TEST_F(TinkerHttp, ASessionWithoutHeartbeatsEndsAndItsModelsGoButItsCheckpointsStay) {
  Start(absl::Seconds(30), /*keys=*/true, /*session_idle=*/absl::Milliseconds(400));
  const std::string quiet = Session(), alive = Session();
  const std::string gone = CreateModel(5, quiet), kept = CreateModel(5, alive);
  auto sampler = [&](const std::string& session) {
    Reply r = SamplingSession(session, 0);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().value("sampling_session_id", "");
  };
  const std::string gone_sampler = sampler(quiet), kept_sampler = sampler(alive);
  ASSERT_EQ(Send("GET", "/api/v1/samplers/" + gone_sampler, "").status, 200);
  Reply saved = Call("save_weights", {{"model_id", gone}, {"seq_id", 1}, {"path", "ck"}});
  ASSERT_EQ(saved.status, 200) << saved.body;
  // Wait for the condition, heartbeating `alive` meanwhile (its model is the control).
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (live_->server->scheduler()->HasModel(gone) && absl::Now() < deadline) {
    ASSERT_EQ(Post("session_heartbeat", {{"session_id", alive}}).status, 200);
    absl::SleepFor(absl::Milliseconds(20));  // paces the heartbeats; the loop waits on HasModel
  }
  EXPECT_FALSE(live_->server->scheduler()->HasModel(gone)) << "the idle session's model stayed";
  EXPECT_TRUE(live_->server->scheduler()->HasModel(kept))
      << "a heartbeating session lost its model";
  const Reply late = Post("session_heartbeat", {{"session_id", quiet}});
  EXPECT_EQ(late.status, 410) << late.body;  // the SDK stops heartbeating
  EXPECT_TRUE(absl::StartsWith(late.json().value("detail", ""), "session_id:")) << late.body;
  EXPECT_EQ(Post("session_heartbeat", {{"session_id", quiet}}, kBob).status, 404);
  EXPECT_EQ(Post("session_heartbeat", {{"session_id", "session-made-up"}}).status, 404);
  EXPECT_EQ(Send("GET", "/api/v1/sessions/" + quiet, "").status, 410);
  // Its samplers went with it (their memory counts against the tenant); the live session's stay.
  EXPECT_EQ(Send("GET", "/api/v1/samplers/" + gone_sampler, "").status, 404);
  EXPECT_EQ(Send("GET", "/api/v1/samplers/" + kept_sampler, "").status, 200);
  // The checkpoint outlives the session: a live session makes a model from it.
  Reply restored = Call("load_weights", {{"session_id", alive},
                                         {"model_seq_id", 1},
                                         {"path", saved.json()["path"]},
                                         {"optimizer", false}});
  EXPECT_FALSE(restored.json().value("model_id", "").empty()) << restored.body;
}

TEST_F(TinkerHttp, TheRestClientsListingsArePagedNewestFirstAndPerTenant) {
  const std::string older = Session(), newer = Session();
  const std::string m1 = CreateModel(5, older), m2 = CreateModel(6, newer);
  for (const auto& [model, endpoint, name] : {std::tuple{m1, "save_weights", "a"},
                                              {m1, "save_weights_for_sampler", "b"},
                                              {m2, "save_weights", "c"}}) {
    ASSERT_EQ(
        Call(endpoint, {{"model_id", model}, {"seq_id", NextSeqId(model)}, {"path", name}}).status,
        200);
  }
  auto get = [&](const std::string& path, const std::string& key = kAlice) {
    return Send("GET", "/api/v1/" + path, "", "", key);
  };

  // Sessions: newest first, one a page.
  Reply first = get("sessions?limit=1&offset=0&access_scope=owned");
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(first.json()["sessions"], Json::array({newer})) << first.body;
  EXPECT_EQ(first.json()["cursor"].value("total_count", 0), 2);
  EXPECT_EQ(get("sessions?offset=1&limit=1").json()["sessions"], Json::array({older}));
  EXPECT_EQ(get("sessions?offset=7&limit=1").json()["sessions"], Json::array());
  EXPECT_EQ(get("sessions", kBob).json()["sessions"], Json::array());  // bob has none

  // A session's models and samplers: what was made in it and still exists.
  const std::string sampler = SamplingSession(older, 0).json().value("sampling_session_id", "");
  ASSERT_FALSE(sampler.empty());
  Reply session = get("sessions/" + older);
  ASSERT_EQ(session.status, 200) << session.body;
  EXPECT_EQ(session.json()["training_run_ids"], Json::array({m1})) << session.body;
  EXPECT_EQ(session.json()["sampler_ids"], Json::array({sampler})) << session.body;
  EXPECT_EQ(get("sessions/" + newer).json()["sampler_ids"], Json::array());
  EXPECT_EQ(get("sessions/" + older, kBob).status, 404);

  // Training runs, paged: the pages hold each run once.
  std::set<std::string> runs;
  for (int offset : {0, 1}) {
    Reply page = get(absl::StrCat("training_runs?limit=1&offset=", offset));
    ASSERT_EQ(page.json()["training_runs"].size(), 1u) << page.body;
    EXPECT_EQ(page.json()["cursor"].value("total_count", 0), 2) << page.body;
    runs.insert(page.json()["training_runs"][0].value("training_run_id", ""));
  }
  EXPECT_EQ(runs, (std::set<std::string>{m1, m2}));

  // The user's checkpoints, of every model, newest first; a model unloaded keeps them listed.
  ASSERT_EQ(Call("unload_model", {{"model_id", m2}}).status, 200);
  EXPECT_EQ(get("sessions/" + newer).json()["training_run_ids"], Json::array());
  Reply all = get("checkpoints");
  ASSERT_EQ(all.status, 200) << all.body;
  const Json list = all.json()["checkpoints"];
  ASSERT_EQ(list.size(), 3u) << all.body;
  std::vector<std::string> paths;
  for (size_t i = 0; i < list.size(); ++i) {
    paths.push_back(list[i].value("tinker_path", ""));
    if (i > 0) {
      EXPECT_GE(list[i - 1].value("time", ""), list[i].value("time", "")) << all.body;
    }
  }
  EXPECT_EQ(std::set<std::string>(paths.begin(), paths.end()),
            (std::set<std::string>{"tinker://" + m1 + "/weights/a",
                                   "tinker://" + m1 + "/sampler_weights/b",
                                   "tinker://" + m2 + "/weights/c"}));
  Json pages = get("checkpoints?limit=2").json()["checkpoints"];
  const Json rest = get("checkpoints?limit=2&offset=2").json()["checkpoints"];
  pages.insert(pages.end(), rest.begin(), rest.end());
  EXPECT_EQ(pages, list);
  EXPECT_EQ(get("checkpoints", kBob).json()["checkpoints"], Json::array());

  // Bad pages and scopes are named; a listing is GET only; a session's other paths are unknown.
  for (const auto& [query, field] : {std::pair{"limit=0", "limit:"},
                                     {"limit=1001", "limit:"},
                                     {"limit=x", "limit:"},
                                     {"offset=-1", "offset:"},
                                     {"limit=1&limit=2", "limit:"},
                                     {"access_scope=all", "access_scope:"}}) {
    for (const char* listing : {"sessions?", "checkpoints?", "training_runs?"}) {
      Reply bad = get(absl::StrCat(listing, query));
      EXPECT_EQ(bad.status, 400) << listing << query;
      EXPECT_TRUE(absl::StartsWith(bad.json().value("detail", ""), field)) << bad.body;
    }
  }
  EXPECT_EQ(Send("POST", "/api/v1/sessions", "{}").status, 405);
  EXPECT_EQ(get("sessions/" + older + "/project").status, 404);
  EXPECT_EQ(Send("POST", "/api/v1/sessions/" + older + "/trace_export", "{}").status, 404);
  // A single item checks its access_scope too.
  EXPECT_EQ(get("sessions/" + older + "?access_scope=all").status, 400);
  EXPECT_EQ(get("training_runs/" + m1 + "?access_scope=all").status, 400);
  EXPECT_EQ(get("training_runs/" + m1 + "?access_scope=accessible").status, 200);
}

TEST_F(TinkerHttp, ALargeResultIsFirstAnnouncedByItsSizeWhenTheClientAllowsIt) {
  peek_bytes_ = 16;
  Start(absl::Seconds(30));
  const std::string model = CreateModel();
  const std::string id = SubmitBatch(TinkerBatch(model, 1, Batch(1))).json()["request_id"];
  auto poll = [&](bool allow) {
    return Post("retrieve_future", {{"request_id", id}, {"allow_metadata_only", allow}});
  };
  ASSERT_EQ(Await(id).status, 200);  // finished
  Reply peek = poll(true);
  ASSERT_EQ(peek.status, 200) << peek.body;
  ASSERT_EQ(peek.json().value("status", ""), "complete_metadata") << peek.body;
  const size_t size = peek.json().value("response_payload_size", size_t{0});
  Reply whole = poll(false);
  ASSERT_EQ(whole.status, 200);
  EXPECT_EQ(whole.content_type, "application/x-protobuf") << whole.body;
  EXPECT_EQ(whole.body.size(), size);
  EXPECT_GT(size, 16u);
  tinker_public::ForwardBackwardOutput out;
  EXPECT_TRUE(out.ParseFromString(whole.body));
  // Control: the same result under a threshold above its size is sent whole at once.
  peek_bytes_ = static_cast<int64_t>(size) + 1;
  Start(absl::Seconds(30));
  const std::string other = CreateModel();
  const std::string other_id = SubmitBatch(TinkerBatch(other, 1, Batch(1))).json()["request_id"];
  ASSERT_EQ(Await(other_id).status, 200);  // finished
  Reply direct = Post("retrieve_future", {{"request_id", other_id}, {"allow_metadata_only", true}});
  EXPECT_EQ(direct.content_type, "application/x-protobuf") << direct.body;
  EXPECT_EQ(direct.body.size(), size);
  // A failure is sent whole, however long its message: the peek is for results.
  peek_bytes_ = 1;
  Start(absl::Seconds(30));
  Reply failed = SubmitBatch(TinkerBatch("model-none", 1, Batch(1)));
  ASSERT_EQ(failed.status, 200) << failed.body;
  Reply error = Await(failed.json()["request_id"]);
  EXPECT_TRUE(error.json().contains("error")) << error.body;
  EXPECT_EQ(error.json().value("category", ""), "user") << error.body;
}

TEST_F(TinkerHttp, ManyClientsLongPollingWithRetriesLoseNothingAndApplyNothingTwice) {
  Start(absl::Milliseconds(300));  // short polls: many try_agains and re-polls
  constexpr int kClients = 24, kCalls = 4;
  std::vector<std::string> models(kClients);
  std::vector<int64_t> want_tokens(kClients, 0);
  std::vector<std::vector<std::string>> answers(kClients, std::vector<std::string>(kCalls));
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      models[c] = CreateModel(/*seed=*/c);
      std::vector<std::string> ids(kCalls);
      // Sent last to first, as the SDK sends a split batch's chunks, and each sent twice (a retry).
      for (int k = kCalls - 1; k >= 0; --k) {
        const std::vector<Datum> data = Batch(1000 * c + k, {3 + k, 2});
        for (const Datum& d : data) {
          for (float w : d.loss_fn_inputs.at("weights").float32_data) want_tokens[c] += w != 0.0f;
        }
        const std::string bytes = TinkerBatch(models[c], k + 1, data);
        for (int attempt = 0; attempt < 2; ++attempt) {
          Reply r = SubmitBatch(bytes);
          ASSERT_EQ(r.status, 200) << r.body;
          ids[k] = r.json()["request_id"];
        }
      }
      std::vector<std::thread> polls;  // every future polled at once
      for (int k = 0; k < kCalls; ++k) {
        polls.emplace_back([&, c, k] { answers[c][k] = Await(ids[k]).content_type; });
      }
      for (auto& t : polls) t.join();
    });
  }
  for (auto& t : clients) t.join();
  for (int c = 0; c < kClients; ++c) {
    for (int k = 0; k < kCalls; ++k) {
      EXPECT_EQ(answers[c][k], "application/x-protobuf") << "client " << c << " call " << k;
    }
    EXPECT_EQ(AccumulatedTokens(models[c]), want_tokens[c]) << "client " << c;
    EXPECT_EQ(NextSeqId(models[c]), kCalls + 1) << "client " << c;
  }
}

TEST_F(TinkerHttp, AFinishedResultStaysForItsKeepTimeThenItsIdIsUnknown) {
  keep_ = absl::Milliseconds(300);
  Start(absl::Seconds(30));
  const std::string model = CreateModel();
  Reply first = SubmitBatch(TinkerBatch(model, 1, Batch(1)));
  const std::string rid = first.json()["request_id"];
  EXPECT_EQ(Await(rid).content_type, "application/x-protobuf");
  EXPECT_EQ(Await(rid).content_type, "application/x-protobuf") << "a second poll lost the result";
  absl::SleepFor(absl::Milliseconds(400));  // the keep time is what is under test
  // Results expire as later calls come in.
  Reply second = SubmitBatch(TinkerBatch(model, 2, Batch(2)));
  EXPECT_EQ(Await(second.json()["request_id"]).content_type, "application/x-protobuf");
  EXPECT_EQ(Post("retrieve_future", {{"request_id", rid}}).status, 404);
}

TEST_F(TinkerHttp, ACallRefusedForAFullFutureTableNeverRan) {
  max_futures_ = 1;
  Start(absl::Seconds(30));
  const std::string model = CreateModel();
  // seq_id 2 waits for 1: its future stays unfinished and fills the table.
  Reply waiting = SubmitBatch(TinkerBatch(model, 2, Batch(2)));
  ASSERT_EQ(waiting.status, 200) << waiting.body;
  Reply refused = SubmitBatch(TinkerBatch(model, 1, Batch(1)));
  EXPECT_EQ(refused.status, 429) << refused.body;
  // The SDK resends a 429 later: had the call run, the resend would find its result applied.
  EXPECT_EQ(NextSeqId(model), 1) << "the call answered 429 ran";
  EXPECT_EQ(AccumulatedTokens(model), 0);
  const Json sample = {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                       {"sampling_params", {{"max_tokens", 2}}}};
  EXPECT_EQ(Post("asample", sample).status, 429);
  EXPECT_NE(Metrics().find("tinkerd_sample_requests_total 0\n"), std::string::npos)
      << "the sample answered 429 ran";
}

TEST_F(TinkerHttp, RacingResendsOfASamplingSessionOrASampleStartItOnce) {
  const std::string session = Session();
  constexpr int kResends = 8;
  std::vector<Reply> created(kResends);
  {
    std::vector<std::thread> t;
    for (int i = 0; i < kResends; ++i) {
      t.emplace_back([&, i] { created[i] = SamplingSession(session, 0); });
    }
    for (auto& th : t) th.join();
  }
  const std::string sampler = created[0].json().value("sampling_session_id", "");
  ASSERT_FALSE(sampler.empty()) << created[0].body;
  for (const Reply& r : created) {
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json().value("sampling_session_id", ""), sampler) << "a resend made a sampler";
  }
  const Json sample = {{"sampling_session_id", sampler},
                       {"seq_id", 1},
                       {"num_samples", 2},
                       {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                       {"sampling_params", {{"max_tokens", 3}}}};
  std::vector<Reply> sent(kResends);
  {
    std::vector<std::thread> t;
    for (int i = 0; i < kResends; ++i) {
      t.emplace_back([&, i] { sent[i] = Post("asample", sample); });
    }
    for (auto& th : t) th.join();
  }
  for (const Reply& r : sent) {
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json()["request_id"], sent[0].json()["request_id"]);
  }
  EXPECT_EQ(Await(sent[0].json()["request_id"]).content_type, "application/x-protobuf");
  const std::string metrics = Metrics();
  EXPECT_NE(metrics.find("tinkerd_sample_requests_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("tinkerd_sampled_sequences_total 2\n"), std::string::npos) << metrics;
}

TEST_F(TinkerHttp, RetrieveFuturesReportsEachFinishedSampleOncePerSessionAndClone) {
  const std::string sampler = SamplingSession(Session(), 0).json().value("sampling_session_id", "");
  ASSERT_FALSE(sampler.empty());
  auto target = [&](int64_t clone) {
    return Json{{"type", "sampling_session"},
                {"sampling_session_id", sampler},
                {"cloned_sampler_id", clone}};
  };
  auto poll = [&](int64_t clone, int64_t cursor, Json timeout, const std::string& key = kAlice) {
    Reply r = Post("retrieve_futures",
                   {{"target", target(clone)}, {"prev_cursor", cursor}, {"timeout", timeout}}, key);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json();
  };
  auto sample = [&](int64_t seq, int64_t token) {
    Reply r = Post("asample",
                   {{"sampling_session_id", sampler},
                    {"seq_id", seq},
                    {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, token}}}}}}},
                    {"sampling_params", {{"max_tokens", 3}}}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().value("request_id", "");
  };
  const Json nothing = poll(0, 0, 0);
  EXPECT_EQ(nothing["completions"], Json::array());
  EXPECT_EQ(nothing["cursor"], 0);

  // A long poll parked before anything finished is answered by the first completion.
  Json parked;
  std::thread parked_poll([&] { parked = poll(0, 0, nullptr); });
  const std::string ok = sample(1, 2);
  const std::string bad = sample(2, 1 << 30);  // a token outside the vocabulary: a failed future
  const std::string other_clone = sample(1'000'000'001, 3);
  parked_poll.join();
  ASSERT_FALSE(parked["completions"].empty()) << parked;

  // Polled with each answer's cursor, clone 0 sees its two futures once each, and nothing else.
  std::map<std::string, Json> seen;
  int64_t cursor = 0;
  Json answer = parked;
  for (int polls = 0; seen.size() < 2 && polls < 10; ++polls) {
    if (polls > 0) answer = poll(0, cursor, nullptr);
    for (const Json& c : answer["completions"]) {
      EXPECT_TRUE(seen.emplace(c["request_id"].get<std::string>(), c).second) << "twice: " << c;
    }
    EXPECT_GT(answer["cursor"].get<int64_t>(), cursor) << answer;
    cursor = answer["cursor"];
  }
  ASSERT_EQ(seen.size(), 2u);
  ASSERT_TRUE(seen.count(ok) && seen.count(bad));
  EXPECT_EQ(seen[bad]["state"], "failed");
  EXPECT_EQ(seen[ok]["state"], "finished");
  const Reply result = Await(ok);
  EXPECT_EQ(result.content_type, "application/x-protobuf");
  EXPECT_EQ(seen[ok]["response_payload_uncompressed_size"], result.body.size());
  // Seen is forgotten: nothing after the cursor, and nothing again from the start.
  const Json after = poll(0, cursor, 0.2);  // waits 0.2 s, then answers with nothing
  EXPECT_EQ(after["completions"], Json::array());
  EXPECT_EQ(after["cursor"], cursor);
  EXPECT_EQ(poll(0, 0, 0)["completions"], Json::array());

  // The other clone has its own; another tenant sees none of them.
  const Json clone = poll(1, 0, nullptr);
  ASSERT_EQ(clone["completions"].size(), 1u) << clone;
  EXPECT_EQ(clone["completions"][0]["request_id"], other_clone);
  EXPECT_EQ(poll(1, 0, 0, kBob)["completions"], Json::array());

  // Bad input is named, with a 400.
  for (const auto& [body, field] : std::vector<std::pair<Json, std::string>>{
           {Json{{"prev_cursor", 0}}, "target"},
           {Json{{"target", {{"type", "training_run"}, {"sampling_session_id", sampler}}}},
            "target.type"},
           {Json{{"target", {{"type", "sampling_session"}}}}, "target.sampling_session_id"},
           {Json{{"target", target(0)}, {"timeout", -1}}, "timeout"},
           {Json{{"target", target(0)}, {"prev_cursor", "x"}}, "prev_cursor"},
           {Json{{"target", target(0)}, {"retrieved_request_ids", {1, 2}}},
            "retrieved_request_ids"}}) {
    const Reply r = Post("retrieve_futures", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_TRUE(absl::StartsWith(r.json().value("detail", ""), field + ":")) << r.body;
  }
}

// SDK 0.38 tells the server when it abandons a sample (dynamic_config's sample_cancel_enabled):
// the engine stops decoding it after the step under way, its future fails CANCELLED naming the
// cause, and its samples are released. A finished future answers cancelled: false; an id the
// tenant never had, another tenant's included, is 404.
TEST_F(TinkerHttp, CancelFutureStopsARunningSampleAndItsFutureFailsCancelled) {
  const Reply config = Post("client/dynamic_config", Json::object());
  EXPECT_TRUE(config.json().value("sample_cancel_enabled", false)) << config.body;
  const std::string sampler = SamplingSession(Session(), 0).json().value("sampling_session_id", "");
  ASSERT_FALSE(sampler.empty());
  auto sample = [&](int64_t seq, int64_t max_tokens, int64_t n) {
    Reply r =
        Post("asample", {{"sampling_session_id", sampler},
                         {"seq_id", seq},
                         {"num_samples", n},
                         {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                         {"sampling_params", {{"max_tokens", max_tokens}}}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().value("request_id", "");
  };
  // Many samples to the end of the context, cancelled as soon as accepted: hundreds of decode
  // steps against one request on loopback. Should the last step win all the same (the cancel
  // then finds a finished future, or lands in the last step), the test tries again.
  const int64_t context = live_->server->runner()->limits().max_context_length;
  ASSERT_GT(context, 100);
  bool stopped = false;
  for (int attempt = 1; attempt <= 5 && !stopped; ++attempt) {
    const std::string id = sample(attempt, context - 2, 16);
    const Reply cancel = Post("cancel_future", {{"request_id", id}});
    ASSERT_EQ(cancel.status, 200) << cancel.body;
    const Reply r = Await(id);
    if (r.content_type == "application/x-protobuf") continue;
    EXPECT_TRUE(cancel.json().value("cancelled", false)) << cancel.body;
    EXPECT_EQ(r.json().value("category", ""), "user") << r.body;
    EXPECT_NE(r.json().value("error", "").find("cancelled"), std::string::npos) << r.body;
    stopped = true;
  }
  ASSERT_TRUE(stopped) << "every sample finished before its cancel";
  EXPECT_NE(Metrics().find("tinkerd_sample_sequences_running 0\n"), std::string::npos);

  const std::string finished = sample(100, 2, 1);
  ASSERT_EQ(Await(finished).content_type, "application/x-protobuf");
  const Reply late = Post("cancel_future", {{"request_id", finished}});
  EXPECT_EQ(late.status, 200) << late.body;
  EXPECT_FALSE(late.json().value("cancelled", true)) << late.body;
  EXPECT_EQ(Post("cancel_future", {{"request_id", finished}}, kBob).status, 404);
  EXPECT_EQ(Post("cancel_future", {{"request_id", "sample:made-up:1"}}).status, 404);
  const Reply bad = Post("cancel_future", {{"request", finished}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_TRUE(absl::StartsWith(bad.json().value("detail", ""), "request_id:")) << bad.body;
}

TEST_F(TinkerHttp, AResentSamplingSessionWhoseSamplerWasEvictedGetsALiveOne) {
  max_samplers_ = 2;
  Start(absl::Seconds(30));
  const std::string session = Session();
  auto id = [](const Reply& r) { return r.json().value("sampling_session_id", ""); };
  const std::string first = id(SamplingSession(session, 0));
  const std::string second = id(SamplingSession(session, 1));
  const std::string third = id(SamplingSession(session, 2));  // evicts the first
  ASSERT_FALSE(first.empty() || second.empty() || third.empty());
  EXPECT_EQ(Send("GET", "/api/v1/samplers/" + first, "").status, 404);
  const std::string again = id(SamplingSession(session, 0));
  EXPECT_NE(again, first) << "a resend was answered with an evicted sampler";
  EXPECT_EQ(Send("GET", "/api/v1/samplers/" + again, "").status, 200);
  EXPECT_EQ(id(SamplingSession(session, 2)), third) << "a live sampler's resend made another";
}

TEST_F(TinkerHttp, RequestsAreCountedByRouteAndStatus) {
  const std::string model = CreateModel();
  Post("get_info", {{"model_id", model}});
  Post("no/such/route", Json::object());
  httplib::Client cli("127.0.0.1", live_->server->metrics_port());
  auto r = cli.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_NE(r->body.find("tinkerd_http_requests_total{endpoint=\"get_info\",status=\"200\"} 1"),
            std::string::npos)
      << r->body;
  EXPECT_NE(r->body.find("tinkerd_http_requests_total{endpoint=\"unknown\",status=\"404\"} 1"),
            std::string::npos);
  EXPECT_EQ(r->body.find("no/such/route"), std::string::npos) << "a client's path became a label";
}

// Issue 36, item 1: a request without a valid key is answered 401 from its headers; the body it
// announces (here 200 MiB, never sent) is not waited for, nor buffered. Health and an archive URL,
// which need no key, and a keyed request are read as before.
TEST_F(TinkerHttp, AKeylessRequestIsRefusedBeforeItsBodyIsRead) {
  for (const std::string key : {"", "tml-not-a-key-of-this-server"}) {
    RawClient c(port_);
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(c.Send(absl::StrCat("POST /api/v1/forward_backward HTTP/1.1\r\nHost: t\r\n",
                                    key.empty() ? "" : "X-API-Key: " + key + "\r\n",
                                    "Content-Type: application/x-protobuf\r\n"
                                    "Content-Length: 209715200\r\n\r\n")));
    std::optional<RawClient::Answer> a = c.Read();
    ASSERT_TRUE(a.has_value()) << "no answer before the body";
    EXPECT_EQ(a->status, 401);
    EXPECT_NE(a->body.find("X-API-Key"), std::string::npos) << a->body;
    EXPECT_TRUE(c.ClosedByServer());
  }
  RawClient health(port_);
  ASSERT_TRUE(health.Send("GET /api/v1/healthz HTTP/1.1\r\nHost: t\r\n\r\n"));
  std::optional<RawClient::Answer> h = health.Read();
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->status, 200);
  const Reply keyed = Post("client/config", Json{{"sdk_version", "0.38.0"}});
  EXPECT_EQ(keyed.status, 200) << keyed.body;
}

// join_sampling_session: a copy of a sampling client gets the next client number of the sampler
// (1, 2, ...: the original is 0); another tenant's sampler, or none, is 404 naming the field.
TEST_F(TinkerHttp, JoiningASamplingSessionNumbersItsClients) {
  const Reply made = Post(
      "create_sampling_session",
      {{"session_id", Session()}, {"sampling_session_seq_id", 0}, {"base_model", "tiny-llama"}});
  ASSERT_EQ(made.status, 200) << made.body;
  const std::string sampler = made.json()["sampling_session_id"].get<std::string>();
  for (int64_t want : {1, 2}) {
    const Reply joined = Post("join_sampling_session", {{"sampling_session_id", sampler}});
    ASSERT_EQ(joined.status, 200) << joined.body;
    EXPECT_EQ(joined.json()["client_counter"].get<int64_t>(), want);
    EXPECT_EQ(joined.json()["type"].get<std::string>(), "join_sampling_session");
  }
  const Reply foreign = Post("join_sampling_session", {{"sampling_session_id", sampler}}, kBob);
  EXPECT_EQ(foreign.status, 404) << foreign.body;
  EXPECT_NE(foreign.body.find("sampling_session_id"), std::string::npos) << foreign.body;
  const Reply config = Post("client/config", Json{{"sdk_version", "0.38.0"}});
  EXPECT_TRUE(config.json()["sample_join_sampling_session"].get<bool>()) << config.body;
}

// Issue 36, items 8-10: a request's key (a model's seq_id, a session's model_seq_id or
// sampling_session_seq_id, a sampling session's seq_id) names one request. A resend of the same
// request finds its first answer; a different request reusing the key is a 400 naming the field
// and changes nothing (before, it was silently answered with the first request's result: an
// optim_step with a forward_backward's output, a load_weights with a fresh model, a sample of
// another prompt).
TEST_F(TinkerHttp, AKeyReusedByADifferentRequestIsRefusedNamingItsField) {
  const std::string session = Session();
  const std::string model = CreateModel(5, session);
  auto refused = [](const Reply& r, const std::string& field) {
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_NE(r.body.find(field + ": "), std::string::npos) << r.body;
    EXPECT_NE(r.body.find("different request"), std::string::npos) << r.body;
  };
  // A model's seq_id: forward_backward, then a forward under the same seq_id.
  const std::string batch = TinkerBatch(model, 1, Batch(1));
  Reply fb = SubmitBatch(batch);
  ASSERT_EQ(fb.status, 200) << fb.body;
  ASSERT_EQ(Await(fb.json()["request_id"]).status, 200);
  const int64_t tokens = AccumulatedTokens(model);
  refused(SubmitBatch(TinkerBatch(model, 1, Batch(1), /*forward_only=*/true)), "seq_id");
  refused(SubmitBatch(TinkerBatch(model, 1, Batch(2))), "seq_id");
  Reply resent = SubmitBatch(batch);  // the same request again: its first answer
  ASSERT_EQ(resent.status, 200) << resent.body;
  EXPECT_EQ(resent.json()["request_id"], fb.json()["request_id"]);
  EXPECT_EQ(AccumulatedTokens(model), tokens) << "applied once";
  // An optim_step under seq_id 2, then one with other parameters under it.
  const Json step{{"model_id", model}, {"seq_id", 2}, {"adam_params", {{"learning_rate", 0.01}}}};
  ASSERT_EQ(Call("optim_step", step).status, 200);
  Json other_step = step;
  other_step["adam_params"]["learning_rate"] = 0.02;
  refused(Post("optim_step", other_step), "seq_id");
  refused(Post("save_weights", {{"model_id", model}, {"seq_id", 2}, {"path", "ck"}}), "seq_id");
  EXPECT_EQ(live_->server->runner()->GetInfo(model)->step, 1);
  // A session's model_seq_id: create_model's key taken by a load_weights.
  refused(Post("load_weights", {{"session_id", session},
                                {"model_seq_id", 0},
                                {"path", "tinker://" + model + "/weights/ck"}}),
          "model_seq_id");
  // A sampling session's seq_id, and a session's sampling_session_seq_id.
  const Reply made = SamplingSession(session, 0);
  ASSERT_EQ(made.status, 200) << made.body;
  const std::string sampler = made.json()["sampling_session_id"];
  auto sample = [&](std::vector<int64_t> prompt) {
    return Post("asample",
                {{"sampling_session_id", sampler},
                 {"seq_id", 4},
                 {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", prompt}}}}}},
                 {"sampling_params", {{"max_tokens", 2}, {"seed", 1}}}});
  };
  const Reply first = sample({1, 2});
  ASSERT_EQ(first.status, 200) << first.body;
  refused(sample({3, 4}), "seq_id");
  EXPECT_EQ(sample({1, 2}).json()["request_id"], first.json()["request_id"]);
  refused(Post("create_sampling_session",
               {{"session_id", session},
                {"sampling_session_seq_id", 0},
                {"model_path", "tinker://" + model + "/sampler_weights/none"}}),
          "sampling_session_seq_id");
}

// `tinker auth login` checks a key with GET auth/apikey/me: each key answers with its own number
// and tenant; an unknown key is 401; DELETE (logout's revocation) is 501 naming where keys live.
// A JSON body's DOM is held in the server's one memory account while its request is read: where
// the account has no room (other tenants' models, say) the request is 429 naming its body, and
// nothing of it runs; with room again, the same request is served.
TEST_F(TinkerHttp, AJsonBodyIsHeldInTheMemoryAccountWhileItIsRead) {
  if (TestDevice() != "cpu") GTEST_SKIP() << "JSON bodies take the CPU's account only";
  std::shared_ptr<MemoryAccount> account = live_->server->runner()->memory_account();
  const Json body = {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                     {"sampling_params", {{"max_tokens", 1}}}};
  const int64_t used = account->reserved();
  // All but 8 KiB of the account taken, as other tenants' models would; a body's first charge
  // is 16 KiB.
  absl::StatusOr<Reservation> others =
      account->Reserve(account->capacity() - account->reserved() - (8 << 10), "others", "");
  ASSERT_TRUE(others.ok()) << others.status();
  Reply refused = Post("asample", body);
  EXPECT_EQ(refused.status, 429) << refused.body;
  EXPECT_NE(refused.body.find("asample: the request's JSON body needs 16.0 KiB of memory"),
            std::string::npos)
      << refused.body;
  EXPECT_EQ(account->reserved(), used + others->bytes()) << "the refused body's charge was kept";
  *others = Reservation();
  Reply served = Post("asample", body);
  ASSERT_EQ(served.status, 200) << served.body;
  EXPECT_FALSE(served.json().value("request_id", "").empty()) << served.body;
  EXPECT_EQ(Await(served.json().value("request_id", "")).status, 200);
  EXPECT_EQ(account->reserved(), used) << "a served body's charge outlived its request";
}

// Issue 36: a body that can never fit what the memory budget holds for request bodies (a quarter)
// is 413, which a client does not retry, where it was 429 for ever: one larger than the quarter,
// refused from its headers, and a JSON body whose DOM would need more than the quarter, refused
// as it is read. Control: a body that fits is served.
TEST_F(TinkerHttp, BodiesThatCanNeverFitTheMemoryBudgetAre413) {
  if (TestDevice() != "cpu") GTEST_SKIP() << "JSON bodies take the CPU's account only";
  memory_budget_ = 16 << 20;  // the HTTP bodies' quarter: 4 MiB
  Start(absl::Seconds(30));
  // Announced and not sent: the answer comes from the headers.
  RawClient raw(port_);
  ASSERT_TRUE(raw.Send(
      absl::StrCat("POST /api/v1/asample HTTP/1.1\r\nHost: t\r\nX-API-Key: ", kAlice,
                   "\r\nContent-Type: application/json\r\nContent-Length: ", 5 << 20, "\r\n\r\n")));
  const std::optional<RawClient::Answer> larger = raw.Read();
  ASSERT_TRUE(larger.has_value());
  EXPECT_EQ(larger->status, 413) << larger->body;
  EXPECT_NE(larger->body.find("body: larger than the server's limit of 4194304 bytes (what its "
                              "memory budget holds for request bodies)"),
            std::string::npos)
      << larger->body;
  // 1 MiB of one-digit tokens: a DOM of ~24 MiB.
  std::string tokens;
  while (tokens.size() < (1 << 20)) tokens += "1,";
  tokens += "1";
  const std::string dense = R"({"prompt":{"chunks":[{"type":"encoded_text","tokens":[)" + tokens +
                            R"(]}]},"sampling_params":{"max_tokens":1},"num_samples":1})";
  const Reply dom = Send("POST", "/api/v1/asample", dense);
  EXPECT_EQ(dom.status, 413) << dom.body;
  EXPECT_NE(dom.body.find("body: its JSON needs more than the 4 MiB the server's memory budget "
                          "holds for request bodies"),
            std::string::npos)
      << dom.body;
  const Reply fits =
      Post("asample", {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2}}}}}}},
                       {"sampling_params", {{"max_tokens", 1}}}});
  ASSERT_EQ(fits.status, 200) << fits.body;
  EXPECT_EQ(Await(fits.json().value("request_id", "")).status, 200);
}

// Checkpoint lifetimes (the cookbook saves with ttl_seconds 7 days, rolling ones 2 hours):
// save_weights, save_weights_for_sampler and copy_weights set one, the ttl endpoint changes or
// removes it, listings show it as expires_at, and once it has passed the checkpoint is deleted
// (here the sweep is run at a time 3 hours on). Out of range is refused naming ttl_seconds. A copy
// does not take its source's lifetime, nor an archive the file that holds it.
TEST_F(TinkerHttp, CheckpointsExpireAfterTheirTtl) {
  const std::string model = CreateModel();
  const absl::Time before = absl::Now();
  auto save = [&](const char* endpoint, int64_t seq, const std::string& name, const Json& ttl) {
    Json body{{"model_id", model}, {"seq_id", seq}, {"path", name}};
    if (!ttl.is_discarded()) body["ttl_seconds"] = ttl;
    return Call(endpoint, body);
  };
  const Reply hour = save("save_weights", 1, "hour", 3600);
  ASSERT_EQ(hour.status, 200) << hour.body;
  const Reply forever = save("save_weights", 2, "forever", nullptr);
  ASSERT_EQ(forever.status, 200) << forever.body;
  const Reply sampler = save("save_weights_for_sampler", 3, "s", 7200);
  ASSERT_EQ(sampler.status, 200) << sampler.body;
  // Each refusal takes its seq_id (ARefusedFieldTakesItsSeqIdAndTheModelsNextCallRuns).
  int64_t seq = 4;
  for (const Json& bad : {Json(3599), Json(int64_t{10} * 365 * 86400 + 1), Json(-1),
                          Json(std::numeric_limits<uint64_t>::max()), Json("3600"), Json(3600.5)}) {
    const Reply refused =
        Call("save_weights",
             {{"model_id", model}, {"seq_id", seq++}, {"path", "bad"}, {"ttl_seconds", bad}});
    EXPECT_EQ(refused.json().value("category", ""), "user") << bad << ": " << refused.body;
    EXPECT_NE(refused.body.find("ttl_seconds: must be an integer from 3600"), std::string::npos)
        << refused.body;
  }

  auto expiries = [&] {
    std::map<std::string, Json> out;
    const Reply list = Send("GET", "/api/v1/training_runs/" + model + "/checkpoints", "");
    EXPECT_EQ(list.status, 200) << list.body;
    const Json listed = list.json();
    for (const Json& c : listed["checkpoints"]) {
      out[c.value("checkpoint_id", "")] = c["expires_at"];
    }
    return out;
  };
  auto parse = [](const Json& iso) {
    absl::Time t;
    std::string err;
    EXPECT_TRUE(iso.is_string() &&
                absl::ParseTime(absl::RFC3339_full, iso.get<std::string>(), &t, &err))
        << iso << " " << err;
    return t;
  };
  std::map<std::string, Json> at = expiries();
  ASSERT_EQ(at.size(), 3u);
  EXPECT_TRUE(at["weights/forever"].is_null());
  const absl::Time hour_at = parse(at["weights/hour"]);
  EXPECT_GE(hour_at, before + absl::Seconds(3599));
  EXPECT_LE(hour_at, absl::Now() + absl::Seconds(3601));
  EXPECT_GE(parse(at["sampler_weights/s"]), hour_at + absl::Seconds(3599));

  // The ttl endpoint: the sampler checkpoint never expires now; "forever" gets an hour.
  const std::string base = "/api/v1/training_runs/" + model + "/checkpoints/";
  EXPECT_EQ(Send("PUT", base + "sampler_weights/s/ttl", R"({"ttl_seconds": null})").status, 200);
  EXPECT_EQ(Send("PUT", base + "weights/forever/ttl", R"({"ttl_seconds": 3600})").status, 200);
  const Reply bad_put = Send("PUT", base + "weights/forever/ttl", R"({"ttl_seconds": 5})");
  EXPECT_EQ(bad_put.status, 400) << bad_put.body;
  EXPECT_EQ(Send("PUT", base + "weights/forever/ttl", R"({"ttl_seconds": 7200})",
                 "application/json", kBob)
                .status,
            404)
      << "another tenant's checkpoint";
  EXPECT_EQ(Send("PUT", base + "weights/none/ttl", R"({"ttl_seconds": 3600})").status, 404);
  at = expiries();
  EXPECT_TRUE(at["sampler_weights/s"].is_null());
  EXPECT_FALSE(at["weights/forever"].is_null());

  // A copy with a ttl of its own, and one without: neither takes the source's.
  const Reply copy = Send("POST", "/api/v1/copy_weights",
                          Json{{"source_path", hour.json().value("path", "")},
                               {"destination_project_id", "p"},
                               {"ttl_seconds", 86400}}
                              .dump(),
                          "application/json", kAlice, {{"X-Idempotency-Key", "copy-1"}});
  ASSERT_EQ(copy.status, 200) << copy.body;
  const Reply plain = Send(
      "POST", "/api/v1/copy_weights",
      Json{{"source_path", hour.json().value("path", "")}, {"destination_project_id", "p"}}.dump(),
      "application/json", kAlice, {{"X-Idempotency-Key", "copy-2"}});
  ASSERT_EQ(plain.status, 200) << plain.body;
  auto copy_run = [](const Reply& r) {
    const std::string path = r.json().value("tinker_path", "");
    return path.substr(9, path.find('/', 9) - 9);
  };
  auto expiry_of = [&](const std::string& run) {
    const Reply list = Send("GET", "/api/v1/training_runs/" + run + "/checkpoints", "");
    EXPECT_EQ(list.status, 200) << list.body;
    const Json listed = list.json();
    return listed["checkpoints"].at(0)["expires_at"];
  };
  EXPECT_GE(parse(expiry_of(copy_run(copy))), hour_at + absl::Hours(22));
  EXPECT_TRUE(expiry_of(copy_run(plain)).is_null());
  // The archive's files are the checkpoint's own: the lifetime is the store's.
  const absl::StatusOr<std::vector<CheckpointFile>> files =
      live_->server->ops()->CheckpointFiles("alice", hour.json().value("path", ""));
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_FALSE(files->empty());
  for (const CheckpointFile& f : *files) {
    EXPECT_EQ(f.name.find(kExpiryFile), std::string::npos) << f.name;
  }

  // An hour on, nothing has expired yet; three hours on, the two one-hour checkpoints have.
  Ops* ops = live_->server->ops();
  EXPECT_EQ(ops->ExpireCheckpoints(absl::Now() + absl::Minutes(50)), 0);
  EXPECT_EQ(ops->ExpireCheckpoints(absl::Now() + absl::Hours(3)), 2);
  at = expiries();
  EXPECT_EQ(at.size(), 1u);
  EXPECT_EQ(at.count("sampler_weights/s"), 1u) << "no longer expiring";
  const Reply gone = Call("load_weights", {{"model_id", model},
                                           {"seq_id", seq},
                                           {"path", hour.json().value("path", "")},
                                           {"optimizer", true}});
  EXPECT_EQ(gone.json().value("category", ""), "user") << gone.body;
  EXPECT_NE(gone.json().value("error", "").find("no checkpoint at"), std::string::npos)
      << gone.body;
  EXPECT_FALSE(expiry_of(copy_run(copy)).is_null()) << "the day-long copy is still there";
}

TEST_F(TinkerHttp, AKeyDescribesItselfAndIsNotDeletedOverHttp) {
  for (const auto& [key, number, tenant] :
       {std::tuple<std::string, int, std::string>{kAlice, 1, "alice"}, {kBob, 2, "bob"}}) {
    const Reply me = Send("GET", "/api/v1/auth/apikey/me", "", "", key);
    ASSERT_EQ(me.status, 200) << me.body;
    EXPECT_EQ(me.json()["key_id"].get<int>(), number);
    EXPECT_EQ(me.json()["name"].get<std::string>(), tenant);
    EXPECT_EQ(me.json()["details"]["org_details"]["name"].get<std::string>(), tenant);
    EXPECT_TRUE(me.json()["details"]["user_details"]["email"].is_string());
  }
  EXPECT_EQ(Send("GET", "/api/v1/auth/apikey/me", "", "", "tml-not-a-key-of-this-server").status,
            401);
  const Reply del = Send("DELETE", "/api/v1/auth/apikey/me", "", "", kAlice);
  EXPECT_EQ(del.status, 501) << del.body;
  EXPECT_NE(del.body.find("--api_keys_file"), std::string::npos) << del.body;
  EXPECT_EQ(Send("GET", "/api/v1/auth/apikey/me", "", "", kAlice).status, 200) << "still a key";
}

// Issue 36: sequences of HTTP calls, valid and refused, interleaved at random on one model while a
// twin made with the same seed gets only the valid ones, over the same edge. Checked after every
// call: the two models' whole training state (parameters, gradient sums, moments, counters, step)
// is equal to the bit, so a refused call changed nothing and a valid one exactly what the twin's
// did; every refusal is a 4xx with a detail or a future failed with category "user", never a 5xx;
// and another tenant's call at the model's next seq_id neither reaches the model nor takes that
// seq_id from its owner. Seeded; TINKERD_HTTP_SEQUENCES sets the number of calls (default 300).
TEST_F(TinkerHttp, RefusedCallsInAnySequenceChangeNothing) {
  const std::string model = CreateModel(5), twin = CreateModel(5);
  ASSERT_EQ(live_->StateChecksum(model), live_->StateChecksum(twin)) << "twins from the start";
  const char* env = std::getenv("TINKERD_HTTP_SEQUENCES");
  const int calls = env != nullptr ? std::atoi(env) : 300;
  SplitMix64 g(2026);
  int64_t seq = 1, twin_seq = 1;
  auto with_loss = [](std::string bytes, const std::string& loss) {
    tinker_public::ForwardBackwardRequest req;
    EXPECT_TRUE(req.ParseFromString(bytes));
    req.set_loss_fn(loss);
    return req.SerializeAsString();
  };
  auto optim = [&](const std::string& m, int64_t s, const Json& adam) {
    return Post("optim_step", {{"model_id", m}, {"seq_id", s}, {"adam_params", adam}});
  };
  // A call that must apply: its future's answer is a result, not an error.
  auto applied = [&](const Reply& r, const std::string& what) {
    ASSERT_EQ(r.status, 200) << what << ": " << r.body;
    const Reply done = Await(r.json().value("request_id", ""));
    EXPECT_EQ(done.status, 200) << what;
    if (done.content_type == "application/json") {
      EXPECT_FALSE(done.json().contains("error")) << what << ": " << done.body;
    }
  };
  // A refusal: a 4xx with a detail at once, or a future that fails for the user.
  auto refused = [&](const Reply& r, const std::string& what, const std::string& key = kAlice) {
    if (r.status != 200) {
      EXPECT_TRUE(r.status >= 400 && r.status < 500) << what << ": " << r.status << " " << r.body;
      EXPECT_TRUE(r.json().contains("detail")) << what << ": " << r.body;
      return;
    }
    const Json error = Await(r.json().value("request_id", ""), key).json();
    EXPECT_EQ(error.value("category", ""), "user") << what << ": " << error;
  };
  const char* names[] = {
      "step",          "forward",       "optim_step",   "token outside the vocabulary",
      "no such loss",  "beta1 1.5",     "garbage body", "learning_rate a string",
      "a used seq_id", "another tenant"};
  for (int i = 0; i < calls; ++i) {
    const uint64_t draw = g.Next() % 17;  // 0-9 the valid calls, then one of each refusal
    const int kind = draw < 6 ? 0 : draw < 8 ? 1 : draw < 10 ? 2 : static_cast<int>(draw - 7);
    const std::string what = absl::StrCat("call ", i, " (", names[kind], ")");
    const std::vector<Datum> data =
        Batch(g.Next(), {1 + static_cast<int>(g.Next() % 6), 1 + static_cast<int>(g.Next() % 6)});
    switch (kind) {
      case 0:  // the same batch on both
        applied(SubmitBatch(TinkerBatch(model, seq++, data)), what);
        applied(SubmitBatch(TinkerBatch(twin, twin_seq++, data)), what + " on the twin");
        break;
      case 1:  // changes nothing, on the model alone
        applied(SubmitBatch(TinkerBatch(model, seq++, data, /*forward_only=*/true)), what);
        break;
      case 2: {
        const Json adam = {{"learning_rate", g.Next() % 2 == 0 ? 1e-3 : 1e-2}};
        applied(optim(model, seq++, adam), what);
        applied(optim(twin, twin_seq++, adam), what + " on the twin");
        break;
      }
      case 3: {  // decodes, then fails in its place in the model's order: the seq_id is used
        std::vector<Datum> bad = data;
        bad[0].tokens[0] = int64_t{1} << 30;
        refused(SubmitBatch(TinkerBatch(model, seq++, bad)), what);
        break;
      }
      case 4:
        refused(SubmitBatch(with_loss(TinkerBatch(model, seq++, data), "no_such_loss")), what);
        break;
      case 5:
        refused(optim(model, seq++, {{"learning_rate", 1e-3}, {"beta1", 1.5}}), what);
        break;
      case 6:  // unreadable: no seq_id to take
        refused(SubmitBatch(std::string("\xff\xff\xff\x07", 4)), what);
        break;
      case 7:  // a mistyped field, refused in the model's order: the seq_id is used
        refused(optim(model, seq++, {{"learning_rate", "fast"}}), what);
        break;
      case 8:
        if (seq > 1) refused(SubmitBatch(TinkerBatch(model, seq - 1, data)), what);
        break;
      case 9:  // bob, at the seq_id alice sends next
        refused(SubmitBatch(TinkerBatch(model, seq, data), kBob), what, kBob);
        break;
    }
    ASSERT_EQ(live_->StateChecksum(model), live_->StateChecksum(twin)) << "after " << what;
  }
  // The broken control: one more step on the model alone must show.
  applied(SubmitBatch(TinkerBatch(model, seq++, Batch(99))), "control");
  EXPECT_NE(live_->StateChecksum(model), live_->StateChecksum(twin));
}

}  // namespace
}  // namespace tinkerd::testing
