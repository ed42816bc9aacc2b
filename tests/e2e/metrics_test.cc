// The Prometheus endpoint, /healthz and /readyz over real HTTP, with values checked against the
// traffic the test sent.
#include <httplib.h>

#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

std::string Get(int port, const std::string& path, int* status) {
  httplib::Client c("127.0.0.1", port);
  auto res = c.Get(path.c_str());
  *status = res ? res->status : -1;
  return res ? res->body : "";
}

bool HasLine(const std::string& body, const std::string& line) {
  return body.find(line + "\n") != std::string::npos;
}

TEST(Metrics, CountsRequestsTokensStepsAndServesProbes) {
  ServerConfig sc;
  sc.metrics_port = 0;
  LiveServer live(sc);
  const int port = live.server->metrics_port();
  ASSERT_GT(port, 0);
  const std::string model = live.CreateModel();
  SplitMix64 g(1);
  auto data = RandomData(g, {10, 6}, "cross_entropy", 128);
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(live.FwdBwd(MakeRequest(model, 1, data), &out).ok());
  auto bad = MakeRequest(model, 2, data);
  bad.mutable_loss_fn()->set_name("mse");
  EXPECT_FALSE(live.FwdBwd(bad, &out).ok());
  v1::OptimStepResponse os;
  ASSERT_TRUE(live.Optim(model, 3, &os).ok());

  int status = 0;
  const std::string body = Get(port, "/metrics", &status);
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(HasLine(body, "tinkerd_requests_total{method=\"ForwardBackward\",code=\"OK\"} 1"))
      << body;
  EXPECT_TRUE(HasLine(
      body, "tinkerd_requests_total{method=\"ForwardBackward\",code=\"INVALID_ARGUMENT\"} 1"));
  EXPECT_TRUE(HasLine(body, "tinkerd_requests_total{method=\"CreateModel\",code=\"OK\"} 1"));
  EXPECT_TRUE(HasLine(body, "tinkerd_request_duration_seconds_count{method=\"OptimStep\"} 1"));
  EXPECT_TRUE(HasLine(body, "tinkerd_tokens_processed_total " +
                                std::to_string(static_cast<int64_t>(os.num_tokens()))));
  EXPECT_TRUE(HasLine(body, "tinkerd_optimizer_steps_total 1"));
  // Per tenant (auth off: every call is the tenant "default"): the tokens trained, and the
  // scheduler's three jobs (the refused loss is answered by its job).
  EXPECT_TRUE(HasLine(body, "tinkerd_tenant_tokens_trained_total{tenant=\"default\"} " +
                                std::to_string(static_cast<int64_t>(os.num_tokens()))))
      << body;
  EXPECT_TRUE(HasLine(body, "tinkerd_tenant_jobs_total{tenant=\"default\"} 3")) << body;
  EXPECT_TRUE(HasLine(body, "tinkerd_tenant_rejected_total{tenant=\"default\"} 0")) << body;
  EXPECT_TRUE(HasLine(body, "tinkerd_skipped_steps_total 0"));
  EXPECT_TRUE(HasLine(body, "tinkerd_queue_depth 0"));
  EXPECT_TRUE(HasLine(body, "tinkerd_serving 1"));
  EXPECT_EQ(Get(port, "/healthz", &status), "ok\n");
  EXPECT_EQ(status, 200);
  Get(port, "/readyz", &status);
  EXPECT_EQ(status, 200);
  // Draining: not ready any more (the HTTP endpoint stops at the end of shutdown).
  std::thread stop([&] { live.server->Shutdown(); });
  stop.join();
  Get(port, "/readyz", &status);
  EXPECT_NE(status, 200);
}

// A job that does not return (as when a kernel spins or an allocator retries forever) on the
// scheduler's one thread: past --stall_timeout_s gRPC health, /readyz and /healthz say so, naming
// the job; once it returns they serve again. Its control: with the watch off, the same job running
// for twice as long leaves health SERVING.
struct StalledJob {
  absl::Notification release, running;
  std::atomic<bool> answered{false};

  void Submit(Scheduler& scheduler) {
    absl::Notification created;
    scheduler.CreateModel(
        "tenant-a", [] { return absl::StatusOr<std::string>("probe"); },
        [&](const absl::StatusOr<std::string>& id) {
          EXPECT_TRUE(id.ok());
          created.Notify();
        });
    created.WaitForNotification();
    JobSpec spec;
    spec.kind = "forward_backward";
    spec.run = [this] {
      running.Notify();
      release.WaitForNotification();
      return JobStep{true, v1::RetrieveResultResponse()};
    };
    scheduler.Submit("probe", 1, std::move(spec), [this](const JobResult&) { answered = true; });
    running.WaitForNotification();
  }
};

bool GrpcServing(const LiveServer& live) {
  client::ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(live.server->port());
  auto serving = client::Connection::Create(o)->Health();
  EXPECT_TRUE(serving.ok()) << serving.status().message();
  return serving.ok() && *serving;
}

TEST(Health, AStalledCallTurnsHealthNotServingUntilItReturns) {
  const absl::Duration timeout = absl::Milliseconds(300);
  ServerConfig sc;
  sc.metrics_port = 0;
  sc.stall_timeout = timeout;
  LiveServer live(sc);
  const int port = live.server->metrics_port();
  ASSERT_TRUE(GrpcServing(live));
  StalledJob job;
  job.Submit(*live.server->scheduler());
  WaitFor([&] { return !GrpcServing(live); }, "NOT_SERVING while the job runs past the timeout");
  EXPECT_GT(absl::Now() - live.server->scheduler()->Current().since, timeout);
  int status = 0;
  const std::string body = Get(port, "/healthz", &status);
  EXPECT_EQ(status, 503);
  EXPECT_NE(body.find("stalled: forward_backward seq_id 1 of model probe (tenant tenant-a)"),
            std::string::npos)
      << body;
  Get(port, "/readyz", &status);
  EXPECT_EQ(status, 503);
  EXPECT_FALSE(job.answered);

  job.release.Notify();
  WaitFor([&] { return job.answered.load(); }, "the job's answer");
  WaitFor([&] { return GrpcServing(live); }, "SERVING once the job returned");
  EXPECT_EQ(Get(port, "/healthz", &status), "ok\n");
  EXPECT_EQ(status, 200);
  Get(port, "/readyz", &status);
  EXPECT_EQ(status, 200);
}

TEST(Health, WithoutAStallTimeoutALongCallLeavesHealthServing) {
  ServerConfig sc;
  sc.metrics_port = 0;
  sc.stall_timeout = absl::ZeroDuration();
  LiveServer live(sc);
  StalledJob job;
  job.Submit(*live.server->scheduler());
  WaitFor(
      [&] {
        return absl::Now() - live.server->scheduler()->Current().since > absl::Milliseconds(600);
      },
      "the job running twice the other test's timeout");
  EXPECT_TRUE(GrpcServing(live));
  int status = 0;
  EXPECT_EQ(Get(live.server->metrics_port(), "/healthz", &status), "ok\n");
  job.release.Notify();
  WaitFor([&] { return job.answered.load(); }, "the job's answer");
}

}  // namespace
}  // namespace tinkerd::testing
