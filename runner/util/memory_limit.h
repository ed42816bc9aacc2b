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

// Under RLIMIT_AS every mapping counts, used or only reserved, and glibc's malloc reserves 64 MiB
// of address space for each arena it adds as threads contend (up to 8 per core): under a cap of
// its idle size + 1 GiB, tinkerd's arenas took ~600 MiB of it after the memory budget was sized,
// and a request's allocation then failed outside any account. So where RLIMIT_AS is finite and the
// operator left MALLOC_ARENA_MAX unset, this caps the arenas at `arenas` (a few threads then share
// one, at some cost in lock contention). Call first in main, before threads start. Returns the cap
// set, or 0 when it set none.
int CapMallocArenasUnderAddressSpaceLimit(int arenas = 2);

}  // namespace tinkerd
