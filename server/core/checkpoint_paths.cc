#include "server/core/checkpoint_paths.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runner/util/echo.h"

namespace tinkerd {
namespace {

bool SafeComponent(const std::string& s) {
  if (s.empty() || s.size() > 200 || s[0] == '.') return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == ':';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

std::string CheckpointPath::Uri() const {
  return absl::StrCat("tinker://", model_id, "/", kind, "/", name);
}

std::string CheckpointPath::Fs(const std::string& root) const {
  return absl::StrCat(root, "/", model_id, "/", kind, "/", name);
}

absl::Status ValidateCheckpointName(const std::string& name, absl::string_view field) {
  if (!SafeComponent(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", Echo(name),
                     "' must be 1-200 characters of [A-Za-z0-9._:-], not starting with '.'"));
  }
  return absl::OkStatus();
}

std::string CheckpointKindName(const std::string& kind) {
  if (kind == "weights") return "training";
  if (kind == "sampler_weights") return "sampler";
  return "external";
}

absl::StatusOr<CheckpointPath> ParseCheckpointPath(const std::string& uri) {
  constexpr absl::string_view kScheme = "tinker://";
  if (uri.rfind(std::string(kScheme), 0) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: '", Echo(uri), "' must start with tinker://"));
  }
  std::vector<std::string> parts = absl::StrSplit(uri.substr(kScheme.size()), '/');
  if (parts.size() != 3 || !SafeComponent(parts[0]) || !SafeComponent(parts[2]) ||
      std::find(kCheckpointKinds.begin(), kCheckpointKinds.end(), parts[1]) ==
          kCheckpointKinds.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: '", Echo(uri),
                     "' must be tinker://<model_id>/<kind>/<name>, the kind weights, "
                     "sampler_weights or external_weights"));
  }
  return CheckpointPath{parts[0], parts[1], parts[2]};
}

}  // namespace tinkerd
