#include "runner/util/memory_limit.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tinkerd {
namespace {

// A limit file's value; "max" (v2) or a value of 2^62 or more (v1's "unlimited", a page-rounded
// LONG_MAX) is no limit.
bool ReadLimit(const std::string& path, int64_t* bytes) {
  std::ifstream in(path);
  std::string text;
  if (!in || !std::getline(in, text)) return false;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v)) return false;  // "max"
  if (v >= (uint64_t{1} << 62)) return false;
  *bytes = static_cast<int64_t>(v);
  return true;
}

void Take(MemoryLimit* best, int64_t bytes, const std::string& source) {
  if (bytes > 0 && (best->bytes == 0 || bytes < best->bytes)) *best = {bytes, source};
}

// The cgroup v2 path ("0::/a/b") or v1 memory controller's path ("4:memory:/a/b") of this
// process, and whether it is v2.
bool CgroupPath(const std::string& proc_self_cgroup, std::string* path, bool* v2) {
  std::ifstream in(proc_self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) {
      *path = parts[2];
      *v2 = true;
      return true;
    }
    for (absl::string_view c : absl::StrSplit(parts[1], ',')) {
      if (c == "memory") {
        *path = parts[2];
        *v2 = false;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

MemoryLimit ProcessMemoryLimit(const MemorySources& sources) {
  MemoryLimit best;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) Take(&best, static_cast<int64_t>(pages) * page, "physical memory");
  std::string path;
  bool v2 = false;
  if (CgroupPath(sources.proc_self_cgroup, &path, &v2)) {
    // The cgroup and each ancestor: a parent's limit binds its children. Inside a container the
    // process's own cgroup is usually mounted as the root, so the root's file counts too.
    const std::string base = v2 ? sources.cgroup_root : sources.cgroup_root + "/memory";
    const std::string file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const std::string source = v2 ? "cgroup memory.max" : "cgroup memory.limit_in_bytes";
    std::string dir = path;
    while (true) {
      int64_t bytes = 0;
      if (ReadLimit(base + (dir == "/" ? "" : dir) + file, &bytes)) Take(&best, bytes, source);
      if (dir.empty() || dir == "/") break;
      const size_t slash = dir.rfind('/');
      dir = slash == 0 || slash == std::string::npos ? "/" : dir.substr(0, slash);
    }
  }
  rlimit as{};
  if (sources.rlimit && ::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    Take(&best, static_cast<int64_t>(as.rlim_cur), "RLIMIT_AS");
  }
  if (best.bytes == 0) best = {int64_t{8} << 30, "unknown (8 GiB assumed)"};
  return best;
}

int64_t UsedBytes(const MemoryLimit& limit) {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return (limit.source == "RLIMIT_AS" ? size : resident) *
         static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int CapMallocArenasUnderAddressSpaceLimit(int arenas) {
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return 0;
  if (std::getenv("MALLOC_ARENA_MAX") != nullptr) return 0;
  return ::mallopt(M_ARENA_MAX, arenas) == 1 ? arenas : 0;
}

}  // namespace tinkerd
