// The sanitizer stage's broken control: a build that claims ASan + UBSan must catch these. Run as
// `sanitizer_canary heap` (reads one element past a heap array) or `sanitizer_canary int` (signed
// overflow); ctest passes only when the sanitizer's report appears in the output.
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  volatile int n = 8;  // volatile: the compiler must not see the bug and fold it away
  if (std::strcmp(argv[1], "heap") == 0) {
    std::vector<int>* v = new std::vector<int>(n, 1);
    const int* p = v->data();
    std::printf("%d\n", p[n]);
    delete v;
  } else if (std::strcmp(argv[1], "int") == 0) {
    volatile int big = std::numeric_limits<int>::max();
    std::printf("%d\n", big + n);
  }
  return 0;
}
