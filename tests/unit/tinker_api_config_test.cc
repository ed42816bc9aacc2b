// TinkerApiConfig::Validate: the HTTP API's settings refused at start-up with the setting named,
// the defaults accepted, and nothing checked while the API is off.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/http/tinker_api_config.h"

namespace tinkerd::http {
namespace {

TinkerApiConfig On() {
  TinkerApiConfig c;
  c.listen = "127.0.0.1:0";
  c.served_model_name = "tiny-llama";
  return c;
}

TEST(TinkerApiConfig, RefusesEachBadSettingNamingIt) {
  EXPECT_TRUE(On().Validate().ok()) << On().Validate();
  TinkerApiConfig proxy = On();
  proxy.archive.public_url = "https://tinkerd.example.org/team";
  EXPECT_TRUE(proxy.Validate().ok()) << proxy.Validate();

  const std::vector<std::pair<std::function<void(TinkerApiConfig&)>, std::string>> bad = {
      {[](TinkerApiConfig& c) { c.threads = 0; }, "threads"},
      {[](TinkerApiConfig& c) { c.served_model_name.clear(); }, "served model name"},
      {[](TinkerApiConfig& c) { c.futures.long_poll = absl::Seconds(45); }, "long poll"},
      {[](TinkerApiConfig& c) { c.max_body_bytes = 1023; }, "max body"},
      {[](TinkerApiConfig& c) { c.archive.url_ttl = absl::ZeroDuration(); }, "archive URL"},
      {[](TinkerApiConfig& c) { c.archive.max_downloads = 0; }, "archive downloads"},
      {[](TinkerApiConfig& c) { c.archive.public_url = "tinkerd.example.org"; }, "public URL"},
  };
  for (const auto& [spoil, name] : bad) {
    TinkerApiConfig c = On();
    spoil(c);
    const absl::Status st = c.Validate();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(absl::StrContains(st.message(), name)) << name << ": " << st;
    // Off, the same setting is not looked at.
    c.listen.clear();
    EXPECT_TRUE(c.Validate().ok()) << name;
  }
}

}  // namespace
}  // namespace tinkerd::http
