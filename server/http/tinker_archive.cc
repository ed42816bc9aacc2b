// Checkpoint downloads for the Tinker RestClient's get_checkpoint_archive_url: the URL it answers
// points back at this server, GET archives/{token}, which streams the checkpoint's files as a
// tar archive. The token (128 random bits) is the credential, as a signed URL is: whoever holds
// it may download that one checkpoint until it expires, without an API key.
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "runner/util/echo.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {
namespace {

using Json = TinkerApi::Json;

// As long as the hosted service's URLs live (the SDK assumes 15 minutes when told nothing).
constexpr absl::Duration kArchiveUrlTtl = absl::Minutes(15);
constexpr size_t kMaxArchiveGrants = 4096;
constexpr char kApiPrefix[] = "/api/v1/";

std::string Token() {
  std::random_device entropy;  // the kernel's CSPRNG
  std::string t;
  for (int i = 0; i < 4; ++i) t += absl::StrFormat("%08x", entropy());
  return t;
}

// A Host header this server can put in a URL: a name or address and a port, nothing else.
bool UsableHost(const std::string& host) {
  if (host.empty() || host.size() > 255) return false;
  for (char c : host) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != ':' && c != '[' && c != ']') {
      return false;
    }
  }
  return true;
}

}  // namespace

void TinkerApi::ArchiveUrl(const std::string& tenant, const Request& req, const std::string& uri,
                           Respond respond) {
  // Checked now, so that a URL is given only for a checkpoint that exists and is this tenant's.
  auto files = ops_->CheckpointFiles(tenant, uri);
  if (!files.ok()) return respond(Error(files.status()));
  if (!UsableHost(req.host)) {
    return respond(Error(400, "Host: missing or not a host name; the archive URL is made of it"));
  }
  const std::string token = Token();
  const absl::Time expires = absl::Now() + kArchiveUrlTtl;
  {
    absl::MutexLock lock(&mu_);
    archives_[token] = ArchiveGrant{tenant, uri, expires};
    archive_order_.push_back(token);
    while (archive_order_.size() > kMaxArchiveGrants) {
      archives_.erase(archive_order_.front());
      archive_order_.pop_front();
    }
  }
  // The prefix of base_url's path, if any, before /api/v1/.
  const std::string prefix = req.path.substr(0, req.path.find(kApiPrefix));
  respond(JsonResponse(Json{{"url", absl::StrCat(req.tls ? "https://" : "http://", req.host, prefix,
                                                 kApiPrefix, "archives/", token)},
                            {"expires", IsoTime(expires)}}));
}

void TinkerApi::Archive(const std::string& method, const std::string& token, Respond respond) {
  if (method != "GET") return respond(Error(405, "archives: use GET"));
  ArchiveGrant grant;
  {
    absl::MutexLock lock(&mu_);
    auto it = archives_.find(token);
    if (it == archives_.end()) return respond(Error(404, "archive: no such URL"));
    grant = it->second;
  }
  if (absl::Now() > grant.expires) {
    return respond(Error(410, absl::StrCat("archive: the URL expired at ", IsoTime(grant.expires),
                                           "; ask for a new one")));
  }
  auto files = ops_->CheckpointFiles(grant.tenant, grant.uri);
  if (!files.ok()) return respond(Error(files.status()));
  Response r;
  r.content_type = "application/x-tar";
  for (const CheckpointFile& f : *files) {
    if (f.name.size() > 100) {
      return respond(Error(500, "archive: a file name is longer than tar's 100 bytes"));
    }
    r.tar.push_back(TarMember{f.name, f.path, f.size, absl::ToUnixSeconds(f.mtime)});
  }
  // tinker://model/kind/name → model-kind-name.tar (the parts are [A-Za-z0-9._:-] only).
  const std::string name =
      absl::StrReplaceAll(grant.uri.substr(sizeof("tinker://") - 1), {{"/", "-"}, {":", "-"}});
  r.headers.emplace_back("Content-Disposition",
                         absl::StrCat("attachment; filename=\"", name, ".tar\""));
  respond(std::move(r));
}

}  // namespace tinkerd::http
