// Resident-set readings of this process, for the benchmarks' memory columns (Linux /proc).
#pragma once

#include <sys/resource.h>

#include <cstdio>

namespace tinkerd::bench {

// Peak resident set of this process over its whole life (ru_maxrss is in KiB on Linux): the
// set-up (writing and loading the model) included.
inline double PeakRssMB() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

// A line "<key> <n> kB" of /proc/self/status in MiB, or -1 where /proc cannot say.
inline double StatusMB(const char* format) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  double kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, format, &kb) == 1) break;
  }
  std::fclose(f);
  return kb < 0 ? -1 : kb / 1024.0;
}

// Peak resident set since the last ResetPeakRss (VmHWM). Training memory is measured from a
// reset after the model loads, so that generating and loading its weights, which a server does
// once, do not hide what training adds.
inline double PeakRssSinceResetMB() {
  return StatusMB("VmHWM: %lf kB");
}
inline double RssMB() {
  return StatusMB("VmRSS: %lf kB");
}
// Bytes this process has read through read(2) and its kin so far (/proc/self/io's rchar: files
// and sockets, whether or not the page cache served them), or -1 where /proc cannot say.
inline double ReadMB() {
  std::FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return -1;
  double bytes = -1;
  char line[256];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "rchar: %lf", &bytes) == 1) break;
  }
  std::fclose(f);
  return bytes < 0 ? -1 : bytes / (1 << 20);
}
inline void ResetPeakRss() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);  // 5: reset the peak resident set size (proc(5))
    std::fclose(f);
  }
}

}  // namespace tinkerd::bench
