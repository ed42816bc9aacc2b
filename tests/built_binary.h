// The binaries the tests start, found beside the running test binary.
//
// The build names each by its path relative to the test binary's folder (tinkerd_test_binary in
// tests/CMakeLists.txt): an absolute path in a compile definition would make every translation
// unit of the suite, and its precompiled header, differ from one clone to another, and a clean
// clone in another folder (CI's) would find none of them in ccache.
#pragma once

#include <filesystem>
#include <string>

namespace tinkerd::testing {

// Call it before fork(): it allocates.
inline std::string BuiltBinary(const char* relative) {
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  return (self.parent_path() / relative).lexically_normal().string();
}

}  // namespace tinkerd::testing
