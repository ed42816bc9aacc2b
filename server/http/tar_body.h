// A Beast body that streams files from disk as one POSIX ustar archive, a chunk at a time: a
// checkpoint of any size is served with bounded memory and without a copy on disk. Each member
// is a 512-byte header, the file's bytes and zeros to the next 512-byte boundary; two zero blocks
// end the archive. The files are opened (and their sizes taken) before the answer starts, so the
// length is known first: the response carries it, and a cut download is detectable.
#pragma once

#include <boost/asio/buffer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/optional.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/http/http_server.h"

namespace tinkerd::http {

struct TarArchive {
  struct Member {
    std::string name;  // inside the archive, at most 100 bytes
    int fd = -1;       // open for reading; closed with the archive
    uint64_t size = 0;
    int64_t mtime = 0;  // seconds since the epoch
  };
  std::vector<Member> members;
  std::function<void()> on_close;  // run once the archive is no longer needed
  // One member's bytes alone, without its header, padding or the trailer: a single file's
  // download, streamed the same way.
  bool raw = false;

  TarArchive() = default;
  TarArchive(const TarArchive&) = delete;
  TarArchive& operator=(const TarArchive&) = delete;
  ~TarArchive();
};

// Opens each (name in the archive, path on disk), in order: regular files only, never through a
// symbolic link. NOT_FOUND names a file that is gone, INVALID_ARGUMENT a name tar cannot hold.
absl::StatusOr<std::shared_ptr<TarArchive>> OpenTarArchive(
    const std::vector<std::pair<std::string, std::string>>& files);

// The 512-byte ustar header of a member (sizes of 8 GiB and more in GNU's base-256 form).
std::string TarHeader(const TarArchive::Member& m);
// The archive's length in bytes.
uint64_t TarSize(const TarArchive& archive);

struct TarBody {
  using value_type = std::shared_ptr<const TarArchive>;

  static uint64_t size(const value_type& archive) { return TarSize(*archive); }

  class writer {
   public:
    using const_buffers_type = boost::asio::const_buffer;

    template <bool isRequest, class Fields>
    writer(const boost::beast::http::header<isRequest, Fields>&, const value_type& archive)
        : archive_(*archive), part_(archive->raw ? Part::kData : Part::kHeader) {}

    void init(boost::beast::error_code& ec) { ec = {}; }
    boost::optional<std::pair<const_buffers_type, bool>> get(boost::beast::error_code& ec);

   private:
    const TarArchive& archive_;
    size_t member_ = 0;
    uint64_t done_ = 0;  // bytes of the current member's data sent
    enum class Part { kHeader, kData, kPadding, kTrailer, kEnd } part_;
    std::string chunk_;
  };
};

}  // namespace tinkerd::http
