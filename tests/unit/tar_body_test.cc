// server/http/tar_body: ustar headers as a reader decodes them (octal and, from 8 GiB, GNU
// base-256 sizes; the checksum), the archive's length, and the whole stream the body writes over
// real files, read back member by member. Python's tarfile reads real downloads in the SDK flow
// (tests/sdk/tinker_flow.py, check r).
#include "server/http/tar_body.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/beast/http/fields.hpp>
#include <cstdint>
#include <fstream>
#include <string>

#include "tests/test_util.h"

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
    const std::string h = TarHeader({"adapter_model.safetensors", -1, size, 1700000000});
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

// Everything the body writes for `archive`; false if the writer reported an error.
bool Stream(const std::shared_ptr<const TarArchive>& archive, std::string* out) {
  boost::beast::http::response_header<> header;
  TarBody::writer w(header, archive);
  boost::beast::error_code ec;
  w.init(ec);
  if (ec) return false;
  while (true) {
    auto part = w.get(ec);
    if (ec) return false;
    if (!part) return true;
    out->append(static_cast<const char*>(part->first.data()), part->first.size());
    if (!part->second) return true;
  }
}

std::string Contents(size_t n, char seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + 31 * i);
  return s;
}

TEST(TarBody, StreamsEachFileWhole) {
  testing::TempDir dir;
  const std::vector<size_t> sizes = {0, 511, 512, (256 << 10) * 2 + 1};
  std::vector<std::pair<std::string, std::string>> files;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string path = dir.path() + "/f" + std::to_string(i);
    std::ofstream(path, std::ios::binary) << Contents(sizes[i], static_cast<char>('a' + i));
    files.emplace_back("member" + std::to_string(i), path);
  }
  auto archive = OpenTarArchive(files);
  ASSERT_TRUE(archive.ok()) << archive.status();
  std::string tar;
  ASSERT_TRUE(Stream(*archive, &tar));
  ASSERT_EQ(tar.size(), TarSize(**archive));
  size_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string h = tar.substr(at, 512);
    EXPECT_EQ(h.substr(0, 8), "member" + std::to_string(i) + '\0');
    ASSERT_EQ(DecodeSize(h), sizes[i]);
    EXPECT_TRUE(ChecksumHolds(h));
    EXPECT_EQ(tar.substr(at + 512, sizes[i]), Contents(sizes[i], static_cast<char>('a' + i)));
    const size_t padded = (sizes[i] + 511) / 512 * 512;
    EXPECT_EQ(tar.substr(at + 512 + sizes[i], padded - sizes[i]),
              std::string(padded - sizes[i], '\0'));
    at += 512 + padded;
  }
  EXPECT_EQ(tar.substr(at), std::string(1024, '\0')) << "the trailer: two zero blocks";

  // A file cut after it was opened cannot fill the length already promised: the writer fails.
  ASSERT_EQ(truncate(files[3].second.c_str(), 1000), 0);
  std::string cut;
  EXPECT_FALSE(Stream(*archive, &cut));
}

// A raw body (one file's download URL): the file's bytes alone, no header, padding or trailer,
// and its length is the file's.
TEST(TarBody, ARawBodyIsTheFileAlone) {
  testing::TempDir dir;
  for (const size_t size : {size_t{0}, size_t{511}, (size_t{256} << 10) * 2 + 1}) {
    const std::string path = dir.path() + "/f" + std::to_string(size);
    std::ofstream(path, std::ios::binary) << Contents(size, 'r');
    auto archive = OpenTarArchive({{"adapter_config.json", path}});
    ASSERT_TRUE(archive.ok()) << archive.status();
    (*archive)->raw = true;
    std::string body;
    ASSERT_TRUE(Stream(*archive, &body));
    EXPECT_EQ(TarSize(**archive), size);
    EXPECT_EQ(body, Contents(size, 'r')) << size << " bytes";
  }
}

TEST(TarBody, OpensRegularFilesOnlyNeverThroughALink) {
  testing::TempDir dir;
  const std::string file = dir.path() + "/real", link = dir.path() + "/link";
  std::ofstream(file) << "x";
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  EXPECT_TRUE(OpenTarArchive({{"real", file}}).ok());
  EXPECT_EQ(OpenTarArchive({{"link", link}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenTarArchive({{"dir", dir.path()}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenTarArchive({{std::string(101, 'n'), file}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TarBody, SizeCountsHeadersPaddingAndTheTrailer) {
  TarArchive empty;
  EXPECT_EQ(TarSize(empty), 1024u);
  TarArchive three;
  three.members = {{"a", -1, 566, 0}, {"b", -1, 0, 0}, {"c", -1, 512, 0}};
  // 512 + 1024 (566 padded), 512 + 0, 512 + 512: and the two trailing zero blocks.
  EXPECT_EQ(TarSize(three), 512u + 1024 + 512 + 512 + 512 + 1024);
}

}  // namespace
}  // namespace tinkerd::http
