// Checkpoint downloads for the Tinker RestClient's get_checkpoint_archive_url: the URL it answers
// points back at this server, GET archives/{token}, which streams the checkpoint's files as a
// tar archive. The token (128 random bits from the kernel) is the credential, as a signed URL
// is: whoever holds it may download that one checkpoint until it expires, without an API key.
#include <sys/random.h>

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "server/core/checkpoint_paths.h"
#include "server/http/router.h"
#include "server/http/tar_body.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {
namespace {

using Json = TinkerApi::Json;

absl::StatusOr<std::string> Token() {
  uint64_t bits[2];
  if (getrandom(bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    return absl::UnavailableError("archive: no randomness for a token; retry");
  }
  return absl::StrFormat("%016x%016x", bits[0], bits[1]);
}

// A Host header this server can put in a URL: a name or address and a port, nothing else.
bool UsableHost(const std::string& host) {
  if (host.empty() || host.size() > 255) return false;
  for (char c : host) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != '_' && c != ':' && c != '[' &&
        c != ']') {
      return false;
    }
  }
  return true;
}

// Bearer-token answers are no one's to keep.
Response NoStore(Response r) {
  r.headers.emplace_back("Cache-Control", "no-store");
  return r;
}

}  // namespace

absl::StatusOr<std::string> TinkerApi::GrantUrl(const Request& req, ArchiveGrant grant) {
  const ArchiveConfig& conf = config_.archive;
  if (conf.public_url.empty() && !UsableHost(req.host)) {
    return absl::InvalidArgumentError(
        "Host: missing or not a host name; the download URL is made of it");
  }
  auto token = Token();
  if (!token.ok()) return token.status();
  archives_.Add(*token, std::move(grant));
  // Without a public URL: the scheme and host this request came by, and the prefix of
  // base_url's path, if any, before /api/v1/.
  const std::string base = conf.public_url.empty()
                               ? absl::StrCat(req.tls ? "https://" : "http://", req.host,
                                              req.path.substr(0, req.path.find(kApiPrefix)))
                               : std::string(absl::StripSuffix(conf.public_url, "/"));
  return absl::StrCat(base, kApiPrefix, "archives/", *token);
}

void TinkerApi::ArchiveUrl(const std::string& tenant, const Request& req, const std::string& uri,
                           Respond respond) {
  // Checked now, so that a URL is given only for a checkpoint that exists and is this tenant's.
  auto files = ops_->CheckpointFiles(tenant, uri);
  if (!files.ok()) return respond(Error(files.status()));
  const absl::Time expires = absl::Now() + config_.archive.url_ttl;
  auto url = GrantUrl(req, ArchiveGrant{tenant, uri, expires, ""});
  if (!url.ok()) return respond(Error(url.status()));
  respond(NoStore(JsonResponse(Json{{"url", *url}, {"expires", IsoTime(expires)}})));
}

void TinkerApi::FileUrls(const std::string& tenant, const Request& req, const std::string& uri,
                         Respond respond) {
  auto path = ParseCheckpointPath(uri);
  if (path.ok() && path->kind != "external_weights") {
    path = absl::InvalidArgumentError(
        "external_weights_urls: only an external_weights checkpoint (save_weights_external) has "
        "them; download others whole (archive)");
  }
  if (!path.ok()) return respond(Error(path.status()));
  auto files = ops_->CheckpointFiles(tenant, uri);
  if (!files.ok()) return respond(Error(files.status()));
  const absl::Time expires = absl::Now() + config_.archive.url_ttl;
  Json urls = Json::object();
  for (const CheckpointFile& f : *files) {
    auto url = GrantUrl(req, ArchiveGrant{tenant, uri, expires, f.name});
    if (!url.ok()) return respond(Error(url.status()));
    urls[f.name] = *url;
  }
  respond(NoStore(JsonResponse(Json{{"urls", std::move(urls)}, {"expires", IsoTime(expires)}})));
}

void TinkerApi::Archive(const std::string& method, const std::string& token, Respond respond) {
  if (method != "GET") return respond(Error(405, "archives: use GET"));
  const std::optional<ArchiveGrant> found = archives_.Find(token);
  if (!found) return respond(Error(404, "archive: no such URL"));
  const ArchiveGrant& grant = *found;
  if (absl::Now() > grant.expires) {
    return respond(Error(410, absl::StrCat("archive: the URL expired at ", IsoTime(grant.expires),
                                           "; ask for a new one")));
  }
  auto files = ops_->CheckpointFiles(grant.tenant, grant.uri);
  if (!files.ok()) return respond(Error(files.status()));
  if (archive_downloads_->fetch_add(1) >= config_.archive.max_downloads) {
    archive_downloads_->fetch_sub(1);
    Response busy = Error(503, absl::StrCat("archive: ", config_.archive.max_downloads,
                                            " downloads are running; retry shortly"));
    busy.headers.emplace_back("Retry-After", "5");
    return respond(std::move(busy));
  }
  std::vector<std::pair<std::string, std::string>> named;
  for (const CheckpointFile& f : *files) {
    if (grant.file.empty() || f.name == grant.file) named.emplace_back(f.name, f.path);
  }
  if (!grant.file.empty() && named.empty()) {
    archive_downloads_->fetch_sub(1);
    return respond(Error(404, "archive: the file is gone from its checkpoint"));
  }
  auto archive = OpenTarArchive(named);
  if (!archive.ok()) {
    archive_downloads_->fetch_sub(1);
    return respond(Error(archive.status()));
  }
  (*archive)->on_close = [downloads = archive_downloads_] { downloads->fetch_sub(1); };
  (*archive)->raw = !grant.file.empty();
  Response r;
  r.content_type = grant.file.empty() ? "application/x-tar" : "application/octet-stream";
  r.tar = std::move(*archive);
  // tinker://model/kind/name → model-kind-name.tar (the parts are [A-Za-z0-9._:-] only); a
  // file, its own name (the part after its last '/': a checkpoint's files are ASCII).
  const std::string name =
      grant.file.empty()
          ? absl::StrCat(absl::StrReplaceAll(grant.uri.substr(sizeof("tinker://") - 1),
                                             {{"/", "-"}, {":", "-"}}),
                         ".tar")
          : grant.file.substr(grant.file.rfind('/') + 1);
  r.headers.emplace_back("Content-Disposition",
                         absl::StrCat("attachment; filename=\"", name, "\""));
  respond(NoStore(std::move(r)));
}

}  // namespace tinkerd::http
