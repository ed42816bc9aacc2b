#include "server/http/router.h"

#include "absl/strings/match.h"

namespace tinkerd::http {

Router::Route Router::Find(const std::string& path) const {
  Route r;
  const size_t at = path.find(kApiPrefix);
  r.endpoint = at == std::string::npos ? "" : path.substr(at + sizeof(kApiPrefix) - 1);
  const std::string& e = r.endpoint;
  if (auto it = json_posts_.find(e); it != json_posts_.end()) {  // sessions/search among them
    r.kind = Kind::kJson;
    r.label = e;
    r.handler = &it->second;
  } else if (absl::StartsWith(e, "archives/")) {
    r.kind = Kind::kArchive;
    r.label = "archives";
  } else if (e == "training_runs" || absl::StartsWith(e, "training_runs/")) {
    r.kind = Kind::kTrainingRuns;
    r.label = absl::StrContains(e, "/checkpoints") ? "training_runs/checkpoints"
              : e == "training_runs"               ? "training_runs"
                                                   : "training_runs/run";
  } else if (absl::StartsWith(e, "sessions/") && absl::EndsWith(e, "/finish")) {
    r.kind = Kind::kFinishSession;
    r.label = "sessions/finish";
  } else if (e == "sessions" || absl::StartsWith(e, "sessions/")) {
    r.kind = Kind::kSessions;
    r.label = e == "sessions" ? "sessions" : "sessions/session";
  } else if (e == "copy_weights") {
    r.kind = Kind::kCopyWeights;
    r.label = e;
  } else if (e == "checkpoints") {
    r.kind = Kind::kCheckpoints;
    r.label = e;
  } else if (e == "healthz") {
    r.kind = Kind::kHealthz;
    r.label = e;
  } else if (e == "get_server_capabilities") {
    r.kind = Kind::kCapabilities;
    r.label = e;
  } else if (e == "auth/apikey/me") {
    r.kind = Kind::kApiKey;
    r.label = e;
  } else if (absl::StartsWith(e, "samplers/")) {
    r.kind = Kind::kSampler;
    r.label = "samplers";
  } else if (e == "forward_backward") {
    r.kind = Kind::kForwardBackward;
    r.label = e;
  } else {
    r.label = "unknown";
  }
  return r;
}

}  // namespace tinkerd::http
