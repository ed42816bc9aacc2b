#include "runner/util/omp_wait_policy.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tinkerd {

void PreferPassiveOpenMpWaits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0) != 0) return;
  execv("/proc/self/exe", argv);
  std::fprintf(stderr,
               "could not re-execute with OMP_WAIT_POLICY=PASSIVE (%s); OpenMP workers will spin\n",
               std::strerror(errno));
}

}  // namespace tinkerd
