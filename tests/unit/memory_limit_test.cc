// runner/util/memory_limit.h: the smallest of physical memory, the cgroup's limit (v2, with its
// ancestors; v1) and RLIMIT_AS, each read from files laid out as the kernel lays them out (in a
// temporary tree) or, for the rlimit, set in a child process.
#include "runner/util/memory_limit.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

void Write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

TEST(MemoryLimit, CgroupV2TakesTheSmallestLimitOfTheCgroupAndItsAncestors) {
  TempDir dir;
  MemorySources s{dir.Sub("cgroup"), dir.Sub("fs"), /*rlimit=*/false};
  Write(s.proc_self_cgroup, "0::/user.slice/job\n");
  Write(s.cgroup_root + "/memory.max", "max\n");
  Write(s.cgroup_root + "/user.slice/memory.max", "1073741824\n");  // the parent binds
  Write(s.cgroup_root + "/user.slice/job/memory.max", "max\n");
  MemoryLimit m = ProcessMemoryLimit(s);
  EXPECT_EQ(m.bytes, int64_t{1} << 30);
  EXPECT_EQ(m.source, "cgroup memory.max");
  // A container: the process's cgroup is the mount's root.
  Write(s.proc_self_cgroup, "0::/\n");
  Write(s.cgroup_root + "/memory.max", "805306368\n");
  m = ProcessMemoryLimit(s);
  EXPECT_EQ(m.bytes, int64_t{768} << 20);
  // Without a limit anywhere: physical memory (the control: "max" is no limit).
  Write(s.cgroup_root + "/memory.max", "max\n");
  m = ProcessMemoryLimit(s);
  EXPECT_EQ(m.source, "physical memory");
  EXPECT_GT(m.bytes, int64_t{768} << 20);
}

TEST(MemoryLimit, CgroupV1ReadsTheMemoryControllersLimit) {
  TempDir dir;
  MemorySources s{dir.Sub("cgroup"), dir.Sub("fs"), /*rlimit=*/false};
  Write(s.proc_self_cgroup, "7:cpu,cpuacct:/other\n4:memory:/docker/abc\n");
  Write(s.cgroup_root + "/memory/memory.limit_in_bytes", "9223372036854771712\n");  // unlimited
  Write(s.cgroup_root + "/memory/docker/abc/memory.limit_in_bytes", "536870912\n");
  const MemoryLimit m = ProcessMemoryLimit(s);
  EXPECT_EQ(m.bytes, int64_t{512} << 20);
  EXPECT_EQ(m.source, "cgroup memory.limit_in_bytes");
}

// In a child, so that the test process keeps its own limit; the child only makes system calls
// between fork and _exit.
TEST(MemoryLimit, AnAddressSpaceRlimitBelowTheRestWins) {
  const MemorySources s{"/nonexistent/cgroup", "/nonexistent", /*rlimit=*/true};
  const rlim_t kLimit = rlim_t{256} << 20;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit as{};
    ::getrlimit(RLIMIT_AS, &as);
    as.rlim_cur = kLimit;
    if (::setrlimit(RLIMIT_AS, &as) != 0) ::_exit(2);
    const MemoryLimit m = ProcessMemoryLimit(s);
    ::_exit(m.bytes == static_cast<int64_t>(kLimit) && m.source == "RLIMIT_AS" ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child did not see its RLIMIT_AS as the limit";
  // The control: this process, without one, is bound by something else.
  EXPECT_NE(ProcessMemoryLimit(s).source, "RLIMIT_AS");
}

// What the budget's default subtracts: resident memory grows by what is touched, and under
// RLIMIT_AS the address space, which holds at least the resident pages, is what counts.
TEST(MemoryLimit, UsedBytesIsResidentMemoryOrTheAddressSpaceUnderRlimitAs) {
  const MemoryLimit physical{int64_t{1} << 40, "physical memory"};
  const MemoryLimit rlimit{int64_t{1} << 40, "RLIMIT_AS"};
  const int64_t before = UsedBytes(physical);
  ASSERT_GT(before, 0);
  std::vector<char> touched(size_t{64} << 20, 1);
  const int64_t after = UsedBytes(physical);
  EXPECT_GE(after - before, int64_t{60} << 20) << "64 MiB touched";
  EXPECT_GE(UsedBytes(rlimit), after);
  EXPECT_EQ(touched[touched.size() / 2], 1);
}

}  // namespace
}  // namespace tinkerd::testing
