// The real tinkerd's start-up environment (runner/util/cpu_environment.h): with OMP_WAIT_POLICY,
// GOMP_SPINCOUNT and OPENBLAS_CORETYPE unset it re-executes itself with short OpenMP spins before
// sleeping and, on a CPU with AVX, never runs OpenBLAS's generic Prescott kernels; it caps oneDNN
// at AVX-512 BF16 (row-invariant bf16 products on AMX CPUs); values the operator set are kept. The
// runner's start-up line says what is in effect.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

// Starts tinkerd with `env` applied (nullptr: unset), returns its runner start-up line and stops
// it.
std::string RunnerLine(const std::vector<std::pair<const char*, const char*>>& env) {
  int out[2];
  if (pipe(out) != 0) return "";
  const std::string tinkerd = BuiltBinary(TINKERD_BINARY);
  const pid_t pid = fork();
  if (pid == 0) {
    for (const auto& [name, value] : env) {
      if (value != nullptr) {
        setenv(name, value, 1);
      } else {
        unsetenv(name);
      }
    }
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    execl(tinkerd.c_str(), "tinkerd", "--listen=127.0.0.1:0", "--threads=1",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  FILE* f = fdopen(out[0], "r");
  std::string runner;
  char line[4096];
  while (fgets(line, sizeof(line), f) != nullptr) {
    const std::string text(line);
    if (text.find("] runner: ") != std::string::npos) runner = text;
    if (text.find("tinkerd listening on port") != std::string::npos) break;
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  fclose(f);
  return runner;
}

// What follows `key` up to the next ',' or end of line.
std::string Value(const std::string& line, const std::string& key) {
  const size_t at = line.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return std::string(
      absl::StripAsciiWhitespace(line.substr(from, line.find_first_of(",\n", from) - from)));
}

TEST(CpuEnvironment, TinkerdSetsWhatTheCpuLibrariesReadAsTheyLoad) {
  const std::string chosen = RunnerLine({{"OMP_WAIT_POLICY", nullptr},
                                         {"GOMP_SPINCOUNT", nullptr},
                                         {"OPENBLAS_CORETYPE", nullptr},
                                         {"ONEDNN_MAX_CPU_ISA", nullptr}});
  ASSERT_NE(chosen, "") << "no runner start-up line";
  EXPECT_EQ(Value(chosen, "OMP_WAIT_POLICY="), "PASSIVE") << chosen;
  EXPECT_EQ(Value(chosen, "ONEDNN_MAX_CPU_ISA="), "AVX512_CORE_BF16") << chosen;
  EXPECT_EQ(Value(chosen, "GOMP_SPINCOUNT="), "3000") << chosen;
  const std::string kernels = Value(chosen, "OpenBLAS kernels ");
  ASSERT_NE(kernels, "") << chosen;
  __builtin_cpu_init();
  if (kernels != "(not OpenBLAS)" && __builtin_cpu_supports("avx")) {
    EXPECT_NE(absl::AsciiStrToLower(kernels), "prescott") << chosen;
  }
  // The operator's values are kept, and the line names what runs (the control: Prescott shows).
  const std::string kept = RunnerLine({{"OMP_WAIT_POLICY", "ACTIVE"},
                                       {"GOMP_SPINCOUNT", nullptr},
                                       {"OPENBLAS_CORETYPE", "Prescott"},
                                       {"ONEDNN_MAX_CPU_ISA", "ALL"}});
  EXPECT_EQ(Value(kept, "OMP_WAIT_POLICY="), "ACTIVE") << kept;
  EXPECT_EQ(Value(kept, "ONEDNN_MAX_CPU_ISA="), "ALL") << kept;
  EXPECT_EQ(Value(kept, "GOMP_SPINCOUNT="), "(unset)") << kept;
  // A spin count alone is the operator's choice of waiting too: neither variable is added.
  const std::string spins = RunnerLine(
      {{"OMP_WAIT_POLICY", nullptr}, {"GOMP_SPINCOUNT", "50000"}, {"OPENBLAS_CORETYPE", nullptr}});
  EXPECT_EQ(Value(spins, "GOMP_SPINCOUNT="), "50000") << spins;
  EXPECT_EQ(Value(spins, "OMP_WAIT_POLICY="), "(unset)") << spins;
  if (kernels != "(not OpenBLAS)") {
    EXPECT_EQ(absl::AsciiStrToLower(Value(kept, "OpenBLAS kernels ")), "prescott") << kept;
  }
}

}  // namespace
}  // namespace tinkerd::testing
