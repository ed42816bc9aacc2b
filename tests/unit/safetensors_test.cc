#include "runner/model/safetensors.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "runner/util/hash.h"

namespace tinkerd {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(Safetensors, SerializeThenParseRoundTrips) {
  const std::string a = Bytes({1, 2, 3, 4, 5, 6}), b = Bytes({-1});
  auto file = SerializeSafetensors({{"w", "F32", {2, 3}, a}, {"b", "F32", {1}, b}}, {{"k", "v"}});
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ((file->size() - b.size() - a.size()) % 8, 0u);  // data section 8-byte aligned
  auto h = ParseSafetensors(*file);
  ASSERT_TRUE(h.ok()) << h.status().message();
  ASSERT_EQ(h->entries.size(), 2u);
  EXPECT_EQ(h->metadata.at("k"), "v");
  for (const auto& e : h->entries) {
    const std::string& want = e.name == "w" ? a : b;
    EXPECT_EQ(file->substr(h->data_start + e.begin, e.end - e.begin), want) << e.name;
    EXPECT_EQ(e.shape, e.name == "w" ? std::vector<int64_t>({2, 3}) : std::vector<int64_t>({1}));
  }
}

TEST(Safetensors, RejectsSizeMismatchOnWrite) {
  auto r = SerializeSafetensors({{"w", "F32", {2, 3}, Bytes({1, 2})}}, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

std::string WithHeader(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\0');
}

TEST(Safetensors, HostileOrTruncatedFilesAreRejected) {
  struct Case {
    std::string file;
    const char* expect;
  };
  std::string huge(8, '\xff');
  const Case cases[] = {
      {"abc", "shorter"},
      {huge, "implausibly large"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 0).substr(0, 20),
       "past the end"},
      {WithHeader("[1]", 0), "not a JSON object"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "outside"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "do not match"},
      {WithHeader(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative"},
      {WithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                      "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  12),
       "overlap"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "data_offsets"},
  };
  for (const Case& c : cases) {
    auto r = ParseSafetensors(c.file);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(r.status().message().find(c.expect), absl::string_view::npos)
        << c.expect << " vs " << r.status().message();
  }
}

// A scratch directory of this test process, removed with it.
struct Scratch {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("safetensors_test_" + std::to_string(::getpid()));
  Scratch() { std::filesystem::create_directories(dir); }
  ~Scratch() { std::filesystem::remove_all(dir); }
  std::string File(const std::string& name) const { return (dir / name).string(); }
};

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Written a piece at a time, the file is byte for byte what SerializeSafetensors makes whole, and
// the digest returned is the file's; read back a tensor at a time, the same tensors and digest.
TEST(SafetensorsWriter, PiecesMakeTheSerializedFileAndItsDigest) {
  Scratch scratch;
  const std::string a = Bytes({1, 2, 3, 4, 5, 6}), b = Bytes({-1}), c = Bytes({7, 8});
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  const auto whole = SerializeSafetensors(
      {{"w", "F32", {2, 3}, a}, {"b", "F32", {1}, b}, {"m", "F32", {2}, c}}, meta);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::string path = scratch.File("w.safetensors");
  auto writer = SafetensorsWriter::Open(
      path, {{"w", "F32", {2, 3}}, {"b", "F32", {1}}, {"m", "F32", {2}}}, meta);
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::string data;
  for (const SafetensorsSpec& spec : (*writer)->order()) {
    data += spec.name == "w" ? a : spec.name == "b" ? b : c;
  }
  for (size_t at = 0; at < data.size(); at += 5) {  // pieces that straddle tensors
    ASSERT_TRUE((*writer)->Append(absl::string_view(data).substr(at, 5)).ok());
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "visible before Commit";
  const absl::StatusOr<FileDigest> written = (*writer)->Commit();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(Contents(path), *whole);
  EXPECT_EQ(*written, (FileDigest{whole->size(), Fnv64(*whole)}));

  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (const SafetensorsEntry& e : (*reader)->header().entries) {
    std::string got(e.end - e.begin, '\0');
    ASSERT_TRUE((*reader)->Read(e, got.data()).ok());
    EXPECT_EQ(got, e.name == "w" ? a : e.name == "b" ? b : c) << e.name;
  }
  const absl::StatusOr<FileDigest> read = (*reader)->Finish();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, *written);
}

// A write that is not committed, or not the size the header promises, leaves no file behind.
TEST(SafetensorsWriter, AnUnfinishedWriteLeavesNoFile) {
  Scratch scratch;
  const std::string path = scratch.File("short.safetensors");
  {
    auto writer = SafetensorsWriter::Open(path, {{"w", "F32", {2}}}, {});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(Bytes({1})).ok());
    EXPECT_EQ((*writer)->Append(Bytes({2, 3})).code(), absl::StatusCode::kInvalidArgument)
        << "past the header's 8 bytes";
    EXPECT_EQ((*writer)->Commit().status().code(), absl::StatusCode::kInvalidArgument)
        << "4 of the 8 bytes";
  }
  {
    auto writer = SafetensorsWriter::Open(path, {{"w", "F32", {1}}}, {});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(Bytes({1})).ok());
  }  // destroyed uncommitted
  EXPECT_TRUE(std::filesystem::is_empty(scratch.dir));
}

// The reader's digest covers every byte of the file, those between tensors included: changing
// one of those changes it (a digest of the tensors alone would not see it).
TEST(SafetensorsReader, TheDigestCoversBytesBetweenTensors) {
  Scratch scratch;
  std::string file = WithHeader(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                                    "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                16);
  for (const bool changed : {false, true}) {
    if (changed) file[file.size() - 10] = 'x';  // in the gap between a and b
    const std::string path = scratch.File("gap.safetensors");
    std::ofstream(path, std::ios::binary) << file;
    auto reader = SafetensorsReader::Open(path);
    ASSERT_TRUE(reader.ok()) << reader.status();
    for (const SafetensorsEntry& e : (*reader)->header().entries) {
      char out[4];
      ASSERT_TRUE((*reader)->Read(e, out).ok());
    }
    const absl::StatusOr<FileDigest> read = (*reader)->Finish();
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, (FileDigest{file.size(), Fnv64(file)})) << "changed: " << changed;
  }
}

}  // namespace
}  // namespace tinkerd
