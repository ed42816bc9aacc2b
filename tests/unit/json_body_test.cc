// server/http/json_body.h: the streaming parse of a request's JSON body builds exactly
// nlohmann::json::parse's DOM, pays for it before building it (the charges cover what the heap
// really holds), and refuses a body denser than any request of the API near its start (issue 36,
// item 2: 8 MiB of nested arrays once took 308 MB).
#include "server/http/json_body.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace tinkerd::http {
namespace {

using Json = nlohmann::json;

// Parses with a charge that accepts everything and counts what it was offered.
struct Counted {
  absl::StatusOr<JsonDom> json;
  int64_t charged = 0;
  int calls = 0;
};
Counted Parse(const std::string& text) {
  Counted c;
  c.json = ParseJsonBody(text, [&](int64_t bytes) {
    c.charged += bytes;
    ++c.calls;
    return absl::OkStatus();
  });
  return c;
}

// The heap in use, small and mmapped chunks alike.
int64_t HeapBytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}
// Whether the allocator reports through mallinfo2 (a sanitizer's does not).
bool HeapIsMeasurable() {
  const int64_t before = HeapBytes();
  std::vector<char> probe(1 << 20, 1);
  return HeapBytes() - before >= (1 << 20);
}

std::string Tokens(int64_t n, const std::string& token) {
  std::string s = "[";
  for (int64_t i = 0; i < n; ++i) absl::StrAppend(&s, i ? "," : "", token);
  return s + "]";
}
std::string Asample(const std::string& tokens) {
  return R"({"sampling_session_id": "s", "seq_id": 3, "num_samples": 2, "prompt": {"chunks": [)"
         R"({"type": "encoded_text", "tokens": )" +
         tokens + R"(}]}, "sampling_params": {"max_tokens": 8, "stop": ["\n\nUser:"]}})";
}
// {"a": [[1],[1],...]}: arrays of one, the shape that took 38 times its text.
std::string NestedArrays(int64_t bytes) {
  std::string s = R"({"a": [)";
  while (static_cast<int64_t>(s.size()) < bytes) s += "[1],";
  s.back() = ']';
  return s + "}";
}

TEST(JsonBody, BuildsTheDomJsonParseBuilds) {
  const std::string bodies[] = {
      Asample(Tokens(5, "151643")),
      R"({})",
      R"({"a": 1, "a": 2, "b": [true, false, null], "c": -0.5e-3})",  // a repeated key
      R"({"big": 18446744073709551615, "neg": -9223372036854775808, "f": 1e308})",
      R"({"s": "\u00e9\ud83d\ude00 and a string longer than the small buffer", "": ""})",
      R"({"a key longer than fifteen characters": {"x": [[], {}, [[1.5]]]}})",
      R"({"d": [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]})",  // 16 levels
  };
  for (const std::string& text : bodies) {
    Counted c = Parse(text);
    ASSERT_TRUE(c.json.ok()) << text << ": " << c.json.status();
    EXPECT_EQ(**c.json, Json::parse(text)) << text;
    EXPECT_EQ((*c.json)->dump(), Json::parse(text).dump()) << text;
  }
}

TEST(JsonBody, RefusesWhatIsNotAnObjectNamingTheBody) {
  for (const std::string text :
       {"", "[1]", "5", "\"x\"", "{", R"({"a": })", "{} x", "{\"a\" 1}", "nul", "{\"a\": [1,]}"}) {
    Counted c = Parse(text);
    ASSERT_FALSE(c.json.ok()) << text;
    EXPECT_EQ(c.json.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StartsWith(c.json.status().message(), "body: not a JSON object"))
        << text << ": " << c.json.status();
  }
}

TEST(JsonBody, NestingBeyondSixteenLevelsIsRefused) {
  auto nested = [](int levels) {
    std::string s;
    for (int i = 0; i < levels; ++i) s += i == 0 ? "{\"a\": " : (i % 2 ? "[" : "{\"b\": ");
    s += "1";
    for (int i = levels - 1; i >= 0; --i) s += i == 0 ? "}" : (i % 2 ? "]" : "}");
    return s;
  };
  ASSERT_TRUE(Json::accept(nested(17)));
  EXPECT_TRUE(Parse(nested(16)).json.ok()) << Parse(nested(16)).json.status();
  const Counted deep = Parse(nested(17));
  ASSERT_FALSE(deep.json.ok());
  EXPECT_EQ(deep.json.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(deep.json.status().message(), "body: nested deeper than 16"))
      << deep.json.status();
  // Brackets inside strings are characters, escaped quotes included.
  EXPECT_TRUE(Parse(R"({"a": "[[[[[[[[[[[[[[[[[[[[\"[[[[[[[[[[[[[[[[[[[["})").json.ok());
  // 100,000 open brackets: refused at the 17th, not after building 100,000 levels.
  const Counted brackets = Parse("{\"a\": " + std::string(100000, '['));
  EXPECT_TRUE(absl::StartsWith(brackets.json.status().message(), "body: nested deeper"));
  EXPECT_LE(brackets.charged, int64_t{1} << 20);
}

// The charges are the safety claim: every byte the DOM holds was offered to the account first.
// Checked against the heap, each shape at a size where rounding cannot hide a shortfall.
TEST(JsonBody, ChargesCoverWhatTheHeapHolds) {
  if (!HeapIsMeasurable()) GTEST_SKIP() << "this allocator does not report through mallinfo2";
  const std::string shapes[] = {
      Asample(Tokens(400000, "1")),       // the densest request: one-digit tokens
      Asample(Tokens(400000, "151643")),  // real token ids
      NestedArrays(int64_t{4} << 10),     // dense (36 per byte), within the 64 KiB it may have
      "{" +
          [] {
            std::string members;
            for (int i = 0; i < 20000; ++i) {
              absl::StrAppend(&members, i ? "," : "", "\"k", i,
                              "\": \"a value past fifteen chars\"");
            }
            return members;
          }() +
          "}",
  };
  for (const std::string& text : shapes) {
    const int64_t before = HeapBytes();
    Counted c = Parse(text);
    const int64_t held = HeapBytes() - before;  // the DOM, still alive
    ASSERT_TRUE(c.json.ok()) << c.json.status();
    EXPECT_GE(c.charged, held) << text.substr(0, 60);
    // And not wildly above it: a charge of three slots per element bounds the moment an array's
    // buffer moves, so up to 3x what a settled DOM holds, then steps of up to half again.
    EXPECT_LE(c.charged, 5 * held + (int64_t{64} << 10)) << text.substr(0, 60);
  }
  // The broken control: charging a JSON value's own 16 bytes per element, as a count of values
  // would, is short of the heap.
  const std::string flat = Asample(Tokens(400000, "1"));
  const int64_t before = HeapBytes();
  const Json dom = Json::parse(flat);
  EXPECT_GT(HeapBytes() - before, 400000 * static_cast<int64_t>(sizeof(Json)));
}

// Issue 36, item 2: 8 MiB of nested arrays would be a ~300 MB DOM; it is refused after its first
// few KiB, having been charged (and so having allocated) at most a MiB.
TEST(JsonBody, ABodyDenserThanAnyRequestIsRefusedAtItsStart) {
  const std::string text = NestedArrays(int64_t{8} << 20);
  const Counted c = Parse(text);
  ASSERT_FALSE(c.json.ok());
  EXPECT_EQ(c.json.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(c.json.status().message(),
                               absl::StrCat("body: its JSON would take more than ",
                                            kJsonBytesPerTextByte, " bytes of memory per byte")))
      << c.json.status();
  EXPECT_LE(c.charged, int64_t{1} << 20);
  // The broken control: built whole, a MiB of this shape holds over 16 MiB (so the 8 MiB body,
  // over 128 MiB where its refusal was charged at most one).
  if (HeapIsMeasurable()) {
    const std::string mib = NestedArrays(int64_t{1} << 20);
    const int64_t before = HeapBytes();
    const Json dom = Json::parse(mib);
    EXPECT_GT(HeapBytes() - before, 16 * static_cast<int64_t>(mib.size()));
  }
  // Empty containers and strings by the thousand are as dense.
  for (const char* unit : {"[],", "{},", "\"\","}) {
    std::string many = "{\"a\": [";
    for (int i = 0; i < 200000; ++i) many += unit;
    many.back() = ']';
    many += "}";
    EXPECT_TRUE(absl::StartsWith(Parse(many).json.status().message(), "body: its JSON would"))
        << unit;
  }
}

// The densest request of the API, a long prompt of one-digit tokens, is accepted, its charge
// taken in a few steps.
TEST(JsonBody, TheDensestRequestFitsAndIsChargedInFewSteps) {
  const std::string text = Asample(Tokens(1000000, "1"));
  const Counted c = Parse(text);
  ASSERT_TRUE(c.json.ok()) << c.json.status();
  EXPECT_EQ((*c.json)->at("prompt").at("chunks").at(0).at("tokens").size(), 1000000u);
  EXPECT_GE(c.charged, 1000000 * static_cast<int64_t>(sizeof(Json)));
  EXPECT_LE(c.calls, 32);
}

// A refused charge ends the parse with the charge's own status; nothing more is asked.
TEST(JsonBody, ARefusedChargeEndsTheParseWithItsStatus) {
  const std::string text = Asample(Tokens(200000, "151643"));
  int64_t granted = 0;
  int refusals = 0, asked_after_refusal = 0;
  const absl::StatusOr<JsonDom> r = ParseJsonBody(text, [&](int64_t bytes) {
    if (refusals > 0) ++asked_after_refusal;
    if (granted + bytes > (int64_t{1} << 20)) {
      ++refusals;
      return absl::ResourceExhaustedError("asample: the request's JSON body needs more");
    }
    granted += bytes;
    return absl::OkStatus();
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(), "asample: the request's JSON body needs more");
  EXPECT_EQ(refusals, 1);
  EXPECT_EQ(asked_after_refusal, 0);
  EXPECT_GT(granted, 0);
  EXPECT_LE(granted, int64_t{1} << 20);
}

// Freeing a DOM takes no memory: where none is left (here an address-space limit at what the
// process holds), FreeJson frees a 2M-element array, where nlohmann's own teardown first asks for
// a copy of the array's elements, and that failing in a destructor ends the process.
void FreeUnderALimit(bool ours) {
  Json dom = Json::object();
  Json& tokens = dom["tokens"] = Json::array();
  for (int i = 0; i < 2000000; ++i) tokens.push_back(i);
  if (!testing::LimitAddressSpace(1 << 20)) _exit(2);
  if (ours) FreeJson(dom);
  dom = nullptr;  // nlohmann's teardown, of whatever is left
  _exit(0);
}

TEST(JsonBodyDeathTest, FreeingADomTakesNoMemory) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer's allocator maps memory of its own, which the limit refuses";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(FreeUnderALimit(/*ours=*/true), ::testing::ExitedWithCode(0), "");
  // The broken control: nlohmann's teardown of the same DOM.
  EXPECT_DEATH(FreeUnderALimit(/*ours=*/false), "");
}

}  // namespace
}  // namespace tinkerd::http
