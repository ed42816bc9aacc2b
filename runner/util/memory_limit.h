// The memory this process may really use: the smallest of the machine's physical memory, its
// cgroup's limit (v2 memory.max of its cgroup and every ancestor's, or v1
// memory.limit_in_bytes) and its address-space rlimit (RLIMIT_AS). A budget sized from
// physical memory alone is one the kernel's OOM killer or a failed allocation enforces first
// under a container's limit.
#pragma once

#include <cstdint>
#include <string>

namespace tinkerd {

struct MemoryLimit {
  int64_t bytes = 0;
  std::string source;  // which bound won: "physical memory", "cgroup memory.max", ...
};

// Where the limits are read from: the real files by default; tests point them at their own.
struct MemorySources {
  std::string proc_self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";
  bool rlimit = true;  // read RLIMIT_AS
};

MemoryLimit ProcessMemoryLimit(const MemorySources& sources = {});

// What the process uses now of what `limit` bounds (/proc/self/statm): its address space when
// RLIMIT_AS is the bound (the kernel counts mappings there, resident or not), else its resident
// memory; 0 where it cannot be read.
int64_t UsedBytes(const MemoryLimit& limit);

}  // namespace tinkerd
