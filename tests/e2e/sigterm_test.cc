// The real tinkerd binary as a child process: SIGTERM with work in flight finishes that work,
// then the process exits 0.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <future>

#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

struct Child {
  pid_t pid = -1;
  int port = 0;
};

// Starts tinkerd on a free loopback port and reads the port from its first stdout line.
Child SpawnTinkerd() {
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  Child c;
  const std::string tinkerd = BuiltBinary(TINKERD_BINARY);
  c.pid = fork();
  if (c.pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    // The grace outlasts the in-flight call on a loaded 2-core machine under ASan, where its
    // float32 products are instrumented loops (kernels/gemv.h) and took over 60 s.
    execl(tinkerd.c_str(), "tinkerd", "--listen=127.0.0.1:0", "--shutdown_grace_s=600",
          "--threads=1", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  FILE* f = fdopen(out[0], "r");
  char line[256] = {0};
  while (fgets(line, sizeof(line), f) != nullptr) {
    if (sscanf(line, "tinkerd listening on port %d", &c.port) == 1) break;
  }
  return c;
}

TEST(Sigterm, InFlightWorkFinishesThenExitZero) {
  Child child = SpawnTinkerd();
  ASSERT_GT(child.port, 0) << "tinkerd did not report its port";
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(child.port),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Tinkerd::NewStub(channel);
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    v1::CreateModelRequest req;
    ASSERT_TRUE(stub->CreateModel(&ctx, req, &info).ok());
  }
  // A call long enough (several seconds on one thread) that SIGTERM lands while it runs.
  SplitMix64 g(1);
  auto data = RandomData(g, std::vector<int>(12, 700), "cross_entropy", info.vocab_size());
  auto req = MakeRequest(info.model_id(), 1, data);
  auto inflight = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::ForwardBackwardOutput out;
    grpc::Status st = stub->ForwardBackward(&ctx, req, &out);
    return std::make_pair(st, out);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  ASSERT_EQ(kill(child.pid, SIGTERM), 0);
  auto [st, out] = inflight.get();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(out.outputs_size(), 12);
  EXPECT_GT(out.metrics().at("num_tokens:sum"), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child.pid, &status, 0), child.pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // Gone: a new request cannot reach it.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::ModelRef ref;
  ref.set_model_id(info.model_id());
  EXPECT_EQ(stub->GetInfo(&ctx, ref, &info).error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace tinkerd::testing
