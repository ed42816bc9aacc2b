// A bounded load test on loopback: C concurrent clients, each with its own model, send R
// forward_backward requests each, out of order (shuffled, several in flight) and with a share
// delivered twice (a retry with the same seq_id and payload). Afterwards every model must have
// accumulated exactly R requests' tokens: every result delivered, none lost, none applied twice.
// Exits 1 on any violation. Prints throughput and latency percentiles.
//   build/bench/load_test --clients=16 --requests=250 --duplicates=0.1
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "server/server.h"
#include "tinkerd/v1/tinkerd.grpc.pb.h"

ABSL_FLAG(int, clients, 16, "concurrent clients, one model each");
ABSL_FLAG(int, requests, 250, "forward_backward requests per client");
ABSL_FLAG(double, duplicates, 0.1, "share of requests delivered twice");
ABSL_FLAG(int, in_flight, 8, "requests each client keeps in flight");
ABSL_FLAG(int, tokens, 8, "tokens per request");

namespace {

using Clock = std::chrono::steady_clock;

tinkerd::v1::ForwardBackwardRequest Request(const std::string& model, int64_t seq, int tokens) {
  tinkerd::v1::ForwardBackwardRequest r;
  r.set_model_id(model);
  r.set_seq_id(seq);
  r.mutable_loss_fn()->set_name("cross_entropy");
  auto* d = r.add_data();
  auto* chunk = d->mutable_model_input()->add_chunks()->mutable_encoded_text();
  std::vector<int64_t> targets;
  std::vector<float> weights(tokens, 1.0f);
  for (int t = 0; t < tokens; ++t) {
    chunk->add_tokens((seq * 31 + t * 7) % 512);
    targets.push_back((seq * 17 + t * 3) % 512);
  }
  auto& tt = (*d->mutable_loss_fn_inputs())["target_tokens"];
  tt.set_dtype(tinkerd::v1::INT64);
  tt.set_data(std::string(reinterpret_cast<const char*>(targets.data()), targets.size() * 8));
  auto& w = (*d->mutable_loss_fn_inputs())["weights"];
  w.set_dtype(tinkerd::v1::FLOAT32);
  w.set_data(std::string(reinterpret_cast<const char*>(weights.data()), weights.size() * 4));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0, spdlog::level::warn);
  const int C = absl::GetFlag(FLAGS_clients), R = absl::GetFlag(FLAGS_requests);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  tinkerd::RunnerConfig rc;
  rc.base_model_path = tinkerd::kEmbeddedDefaultModel;
  tinkerd::ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.scheduler.max_pending_per_model = 2 * absl::GetFlag(FLAGS_in_flight);
  auto server = tinkerd::TinkerdServer::Start(sc, std::move(*tinkerd::ModelRunner::Create(rc)));
  if (!server.ok()) return 1;
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = tinkerd::v1::Tinkerd::NewStub(channel);

  std::vector<std::string> models;
  for (int c = 0; c < C; ++c) {
    grpc::ClientContext ctx;
    tinkerd::v1::ModelInfo info;
    if (!stub->CreateModel(&ctx, tinkerd::v1::CreateModelRequest(), &info).ok()) return 1;
    models.push_back(info.model_id());
  }
  std::mutex mu;
  std::vector<double> latencies_ms;
  std::atomic<int> failures{0}, mismatched_duplicates{0}, sent{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < C; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(c);
      std::vector<int64_t> order(R);
      for (int i = 0; i < R; ++i) order[i] = i + 1;
      // Shuffle within windows: requests arrive out of order but the gaps stay bounded, as with
      // a pipelining client.
      const int window = absl::GetFlag(FLAGS_in_flight);
      for (int i = 0; i < R; i += window) {
        std::shuffle(order.begin() + i, order.begin() + std::min(R, i + window), rng);
      }
      std::bernoulli_distribution dup(absl::GetFlag(FLAGS_duplicates));
      for (int i = 0; i < R; i += window) {
        std::vector<std::future<void>> batch;
        for (int j = i; j < std::min(R, i + window); ++j) {
          const int64_t seq = order[j];
          const int copies = dup(rng) ? 2 : 1;
          batch.push_back(std::async(std::launch::async, [&, seq, copies] {
            const auto req = Request(models[c], seq, tokens);
            std::string first;
            for (int k = 0; k < copies; ++k) {
              grpc::ClientContext ctx;
              ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
              tinkerd::v1::ForwardBackwardOutput out;
              const auto s = Clock::now();
              grpc::Status st = stub->ForwardBackward(&ctx, req, &out);
              const double ms = std::chrono::duration<double, std::milli>(Clock::now() - s).count();
              sent++;
              if (!st.ok()) {
                failures++;
                std::fprintf(stderr, "%s seq %lld: %s\n", models[c].c_str(),
                             static_cast<long long>(seq), st.error_message().c_str());
                continue;
              }
              const std::string loss = std::to_string(out.metrics().at("loss:sum"));
              if (k == 0) first = loss;
              if (k == 1 && loss != first) mismatched_duplicates++;
              std::lock_guard<std::mutex> lock(mu);
              latencies_ms.push_back(ms);
            }
          }));
        }
        for (auto& f : batch) f.get();
      }
    });
  }
  for (auto& t : clients) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  int wrong_counts = 0;
  for (const std::string& m : models) {
    grpc::ClientContext ctx;
    tinkerd::v1::ModelRef ref;
    ref.set_model_id(m);
    tinkerd::v1::ModelInfo info;
    stub->GetInfo(&ctx, ref, &info);
    if (info.accumulated_tokens() != static_cast<int64_t>(R) * tokens ||
        info.next_seq_id() != R + 1) {
      ++wrong_counts;
      std::fprintf(stderr, "%s: %lld tokens accumulated (want %lld), next seq %lld\n", m.c_str(),
                   static_cast<long long>(info.accumulated_tokens()),
                   static_cast<long long>(R) * tokens, static_cast<long long>(info.next_seq_id()));
    }
  }
  (*server)->Shutdown();
  std::sort(latencies_ms.begin(), latencies_ms.end());
  auto pct = [&](double p) {
    return latencies_ms.empty()
               ? 0.0
               : latencies_ms[std::min(latencies_ms.size() - 1,
                                       static_cast<size_t>(p * latencies_ms.size()))];
  };
  std::printf("%d clients x %d requests (+%d duplicate deliveries) in %.1f s: %.0f requests/s\n", C,
              R, sent.load() - C * R, secs, sent.load() / secs);
  std::printf("latency ms: p50 %.1f  p90 %.1f  p99 %.1f  max %.1f\n", pct(0.5), pct(0.9), pct(0.99),
              pct(1.0));
  std::printf("failed calls %d, duplicates answered differently %d, models with wrong totals %d\n",
              failures.load(), mismatched_duplicates.load(), wrong_counts);
  const bool ok = failures == 0 && mismatched_duplicates == 0 && wrong_counts == 0;
  std::printf("%s\n",
              ok ? "OK: every result delivered once, none lost, none applied twice" : "FAILED");
  return ok ? 0 : 1;
}
