// server/http/tar_body: ustar headers as a reader decodes them (octal and, from 8 GiB, GNU
// base-256 sizes; the checksum), and the archive's length. The downloads themselves are read by
// Python's tarfile in the SDK flow (tests/sdk/tinker_flow.py, check r).
#include "server/http/tar_body.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace tinkerd::http {
namespace {

// A reader's view of a size field: octal digits, or base-256 when the first byte has 0x80.
uint64_t DecodeSize(const std::string& h) {
  const auto* f = reinterpret_cast<const unsigned char*>(h.data() + 124);
  uint64_t v = 0;
  if (f[0] & 0x80) {
    for (int i = 1; i < 12; ++i) v = (v << 8) | f[i];
    return v;
  }
  for (int i = 0; i < 11 && f[i] >= '0' && f[i] <= '7'; ++i) v = v * 8 + (f[i] - '0');
  return v;
}

// True when the stored checksum equals the sum of the header with its field as spaces.
bool ChecksumHolds(std::string h) {
  const uint64_t stored = std::stoull(h.substr(148, 6), nullptr, 8);
  for (int i = 148; i < 156; ++i) h[i] = ' ';
  uint64_t sum = 0;
  for (char c : h) sum += static_cast<unsigned char>(c);
  return sum == stored;
}

TEST(TarBody, HeadersDecodeAsAReaderReadsThem) {
  for (uint64_t size : {uint64_t{0}, uint64_t{1}, uint64_t{566}, (uint64_t{1} << 33) - 1,
                        uint64_t{1} << 33, uint64_t{5} << 40}) {
    const std::string h = TarHeader({"adapter_model.safetensors", "/unused", size, 1700000000});
    ASSERT_EQ(h.size(), 512u);
    EXPECT_EQ(h.substr(0, 26), std::string("adapter_model.safetensors") + '\0');
    EXPECT_EQ(DecodeSize(h), size) << size;
    EXPECT_EQ(h.substr(257, 6), std::string("ustar") + '\0');
    EXPECT_EQ(h[156], '0') << "a regular file";
    EXPECT_TRUE(ChecksumHolds(h)) << size;
    std::string broken = h;  // the control: one changed byte breaks the checksum
    broken[0] = 'b';
    EXPECT_FALSE(ChecksumHolds(broken));
  }
}

TEST(TarBody, SizeCountsHeadersPaddingAndTheTrailer) {
  EXPECT_EQ(TarSize({}), 1024u);
  // 512 + 1024 (566 padded), 512 + 0, 512 + 512: and the two trailing zero blocks.
  EXPECT_EQ(TarSize({{"a", "", 566, 0}, {"b", "", 0, 0}, {"c", "", 512, 0}}),
            512u + 1024 + 512 + 512 + 512 + 1024);
}

}  // namespace
}  // namespace tinkerd::http
