#include "runner/model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

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

}  // namespace
}  // namespace tinkerd
