// The cost of the Tinker HTTP API: the same training steps (forward_backward + optim_step on the
// same batch) run in process on a ModelRunner and through a real tinkerd's HTTP API on loopback,
// spoken as the Tinker SDK does (protobuf batch, JSON optim_step, both submitted before the first
// result is polled; each result read by a long-polled retrieve_future). Steps of the two sides
// alternate so that machine drift affects both alike. Then the long-poll wake-up: a 1-token
// forward through HTTP against the same forward in process; the difference bounds the time from
// a finished call to the polling client seeing it.
//   build/bench/http_overhead_bench --steps=12 --seqs=16 --len=128
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/overhead_util.h"
#include "runner/model_runner.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "server/server.h"
#include "tinker_public/tinker_public.pb.h"

ABSL_FLAG(int, steps, 12, "timed steps (after one warm-up step)");
ABSL_FLAG(int, seqs, 16, "sequences per forward_backward");
ABSL_FLAG(int, len, 128, "tokens per sequence");
ABSL_FLAG(int, polls, 50, "timed 1-token forwards for the long-poll wake-up");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads (0: LibTorch default)");

namespace {

using Clock = std::chrono::steady_clock;
using tinkerd::bench::EmbeddedRunner;
using tinkerd::bench::MakeBatch;
using tinkerd::bench::Median;
using Json = nlohmann::json;

// The batch as the Tinker SDK encodes it.
std::string TinkerBatch(const std::string& model, int seq, const std::vector<tinkerd::Datum>& data,
                        bool forward_only) {
  tinker_public::ForwardBackwardRequest req;
  req.set_model_id(model);
  req.set_seq_id(seq);
  req.set_loss_fn("cross_entropy");
  req.set_forward_only(forward_only);
  for (const auto& d : data) {
    auto* out = req.add_data();
    std::vector<int32_t> tokens(d.tokens.begin(), d.tokens.end());
    out->add_model_input()->mutable_encoded_text()->set_tokens(
        std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4));
    const auto& targets = d.loss_fn_inputs.at("target_tokens").int64_data;
    const auto& weights = d.loss_fn_inputs.at("weights").float32_data;
    auto& t = (*out->mutable_loss_fn_inputs())["target_tokens"];
    t.set_dtype(tinker_public::DTYPE_INT64);
    t.set_dense(std::string(reinterpret_cast<const char*>(targets.data()), targets.size() * 8));
    auto& w = (*out->mutable_loss_fn_inputs())["weights"];
    w.set_dtype(tinker_public::DTYPE_FLOAT32);
    w.set_dense(std::string(reinterpret_cast<const char*>(weights.data()), weights.size() * 4));
  }
  return req.SerializeAsString();
}

class Http {
 public:
  explicit Http(int port) : cli_("127.0.0.1", port) {
    cli_.set_read_timeout(120, 0);
    cli_.set_keep_alive(true);
    cli_.set_tcp_nodelay(true);  // as the SDK's connections do (asyncio sets TCP_NODELAY)
  }
  std::string Post(const std::string& endpoint, const std::string& body,
                   const std::string& type = "application/json") {
    auto r = cli_.Post("/api/v1/" + endpoint, body, type);
    if (!r || r->status != 200) {
      std::fprintf(stderr, "%s failed: %s\n", endpoint.c_str(), r ? r->body.c_str() : "no answer");
      std::exit(1);
    }
    return r->body;
  }
  std::string Submit(const std::string& endpoint, const std::string& body,
                     const std::string& type = "application/json") {
    return Json::parse(Post(endpoint, body, type))["request_id"];
  }
  // Polls as the SDK does until the result (the server parks the poll meanwhile).
  std::string Await(const std::string& request_id) {
    const std::string body = Json{{"request_id", request_id}, {"allow_metadata_only", true}}.dump();
    for (;;) {
      auto r = cli_.Post("/api/v1/retrieve_future", body, "application/json");
      if (!r || r->status != 200) std::exit(1);
      if (r->get_header_value("Content-Type") == "application/x-protobuf") return r->body;
      const Json j = Json::parse(r->body);
      if (j.value("type", "") != "try_again") {
        if (j.contains("error")) {
          std::fprintf(stderr, "future failed: %s\n", r->body.c_str());
          std::exit(1);
        }
        return r->body;
      }
    }
  }

 private:
  httplib::Client cli_;
};

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0, spdlog::level::warn);
  const int steps = absl::GetFlag(FLAGS_steps);
  const auto batch = MakeBatch(absl::GetFlag(FLAGS_seqs), absl::GetFlag(FLAGS_len), 512);
  const auto one = MakeBatch(1, 1, 512);

  // The same model on both sides: LoRA rank 32 on every module, sums (what create_model makes).
  tinkerd::CreateModelOptions options;
  options.loss_reduction = tinkerd::LossReduction::kSum;
  auto local_runner = EmbeddedRunner(absl::GetFlag(FLAGS_threads));
  const std::string local_id = *local_runner->CreateModel(options);
  tinkerd::ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.tinker_http.listen = "127.0.0.1:0";
  sc.tinker_http.served_model_name = "bench";
  auto server = tinkerd::TinkerdServer::Start(sc, EmbeddedRunner(absl::GetFlag(FLAGS_threads)));
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  Http http((*server)->tinker_http_port());
  const std::string session = Json::parse(http.Post("create_session", "{}"))["session_id"];
  const std::string model =
      Json::parse(http.Await(http.Submit("create_model", Json{{"session_id", session},
                                                              {"model_seq_id", 0},
                                                              {"base_model", "bench"},
                                                              {"lora_config", {{"rank", 32}}}}
                                                             .dump())))["model_id"];
  const std::string adam = Json{{"learning_rate", 1e-4}}.dump();
  tinkerd::AdamParams params;
  int seq = 1;
  std::vector<double> local, remote;
  for (int s = 0; s <= steps; ++s) {
    auto t0 = Clock::now();
    if (!local_runner->ForwardBackward(local_id, batch, "cross_entropy", {}).ok()) return 1;
    if (!local_runner->OptimStep(local_id, params).ok()) return 1;
    const double l = Seconds(t0);
    t0 = Clock::now();
    const std::string fb = http.Submit("forward_backward", TinkerBatch(model, seq++, batch, false),
                                       "application/x-protobuf");
    const std::string os = http.Submit(
        "optim_step",
        Json{{"model_id", model}, {"seq_id", seq++}, {"adam_params", Json::parse(adam)}}.dump());
    http.Await(fb);
    http.Await(os);
    const double r = Seconds(t0);
    if (s > 0) {
      local.push_back(l);
      remote.push_back(r);
    }
  }
  std::vector<double> local_fwd, remote_fwd;
  for (int p = 0; p <= absl::GetFlag(FLAGS_polls); ++p) {
    auto t0 = Clock::now();
    if (!local_runner->Forward(local_id, one, "cross_entropy", {}).ok()) return 1;
    const double l = Seconds(t0);
    t0 = Clock::now();
    http.Await(http.Submit("forward_backward", TinkerBatch(model, seq++, one, true),
                           "application/x-protobuf"));
    const double r = Seconds(t0);
    if (p > 0) {
      local_fwd.push_back(l);
      remote_fwd.push_back(r);
    }
  }
  (*server)->Shutdown();

  const double l = Median(local), r = Median(remote);
  const int tokens = absl::GetFlag(FLAGS_seqs) * absl::GetFlag(FLAGS_len);
  std::printf("batch: %d sequences x %d tokens; %d timed steps; median step\n",
              absl::GetFlag(FLAGS_seqs), absl::GetFlag(FLAGS_len), steps);
  std::printf("in-process: %.4f s (%.0f tokens/s)\n", l, tokens / l);
  std::printf("HTTP:       %.4f s (%.0f tokens/s)\n", r, tokens / r);
  std::printf("HTTP / in-process step time: %.3fx (overhead %.1f ms per step, %.2f%%)\n", r / l,
              (r - l) * 1e3, 100 * (r - l) / l);
  const double lf = Median(local_fwd), rf = Median(remote_fwd);
  std::printf(
      "1-token forward: in-process %.2f ms, HTTP submit + long poll %.2f ms: "
      "the wake-up and round trips take at most %.2f ms\n",
      lf * 1e3, rf * 1e3, (rf - lf) * 1e3);
  std::printf(
      "{\"bench\":\"http_overhead\",\"local_step_s\":%.6f,\"http_step_s\":%.6f,\"ratio\":%.4f,"
      "\"local_forward_s\":%.6f,\"http_forward_s\":%.6f}\n",
      l, r, r / l, lf, rf);
  return 0;
}
