#include "runner/dist/dist_config.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tinkerd {
namespace {

absl::Status ReadInt(const char* name, int* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return absl::OkStatus();
  if (!absl::SimpleAtoi(v, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment: ", name, "='", v, "' is not an integer"));
  }
  return absl::OkStatus();
}

}  // namespace

int FreeLoopbackPort() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(s);
  return port;
}

void SetLocalRankEnvironment(int rank, int world_size, int master_port) {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
}

absl::StatusOr<DistConfig> DistConfigFromEnv() {
  DistConfig c;
  if (auto st = ReadInt("WORLD_SIZE", &c.world_size); !st.ok()) return st;
  if (auto st = ReadInt("RANK", &c.rank); !st.ok()) return st;
  if (auto st = ReadInt("LOCAL_RANK", &c.local_rank); !st.ok()) return st;
  if (auto st = ReadInt("MASTER_PORT", &c.master_port); !st.ok()) return st;
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') c.master_addr = a;
  if (c.world_size < 1) return absl::InvalidArgumentError("environment: WORLD_SIZE must be >= 1");
  if (c.rank < 0 || c.rank >= c.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment: RANK=", c.rank, " outside [0, WORLD_SIZE=", c.world_size, ")"));
  }
  if (c.master_port < 1 || c.master_port > 65535) {
    return absl::InvalidArgumentError("environment: MASTER_PORT outside [1, 65535]");
  }
  return c;
}

std::string DistConfig::DebugString() const {
  return absl::StrFormat(
      "rank=%d world_size=%d local_rank=%d master=%s:%d timeout=%ds bucket=%dMiB", rank, world_size,
      local_rank, master_addr, master_port, static_cast<int>(timeout.count() / 1000),
      bucket_bytes >> 20);
}

}  // namespace tinkerd
