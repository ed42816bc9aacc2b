// The fuzz stage's broken control: a planted crash that only coverage guidance reaches quickly (a
// 6-byte magic prefix, compared byte by byte so each byte is its own branch). ctest expects this
// fuzzer to fail; if it passes, instrumentation or the libFuzzer wiring is broken and the other
// fuzzers' clean runs mean nothing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char kMagic[] = "tinker";
  for (size_t i = 0; i < 6; ++i) {
    if (i >= size || data[i] != static_cast<uint8_t>(kMagic[i])) return 0;
  }
  std::abort();
}
