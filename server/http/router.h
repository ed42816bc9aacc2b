// The Tinker API's route table: which endpoint a request's path names under /api/v1/ (base_url
// may put a prefix before it), the label it is counted under in the metrics, and, for the
// endpoints that take a JSON object by POST, their handler. Built once, then only read: no lock.
#pragma once

#include <functional>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "server/http/http_server.h"

namespace tinkerd::http {

inline constexpr char kApiPrefix[] = "/api/v1/";

class Router {
 public:
  using JsonHandler =
      std::function<void(const std::string& tenant, const nlohmann::json& body, Respond respond)>;

  enum class Kind {
    kUnknown,
    kHealthz,
    kArchive,          // GET archives/{token}: the token is the credential, no API key
    kTrainingRuns,     // training_runs[/...]
    kSessions,         // sessions, sessions/{id}
    kCheckpoints,      // checkpoints
    kFinishSession,    // sessions/{id}/finish
    kCopyWeights,      // POST copy_weights: JSON, and its X-Idempotency-Key
    kCapabilities,     // GET get_server_capabilities
    kSampler,          // GET samplers/{id}
    kApiKey,           // GET (DELETE) auth/apikey/me: the caller's own key
    kForwardBackward,  // POST forward_backward, Tinker's protobuf
    kJson,             // a POST endpoint taking a JSON object: `handler`
  };
  struct Route {
    Kind kind = Kind::kUnknown;
    std::string endpoint;  // the path after /api/v1/; empty when it has none
    // For the metrics: the route, never a client's text (an unknown path, an id inside a path).
    std::string label;
    const JsonHandler* handler = nullptr;  // kJson's
  };

  explicit Router(std::map<std::string, JsonHandler> json_posts)
      : json_posts_(std::move(json_posts)) {}

  Route Find(const std::string& path) const;

 private:
  const std::map<std::string, JsonHandler> json_posts_;  // by endpoint
};

}  // namespace tinkerd::http
