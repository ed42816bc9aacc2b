// A Beast body that streams files from disk as one POSIX ustar archive, a chunk at a time: a
// checkpoint of any size is served with bounded memory and without a copy on disk. Each member
// is a 512-byte header, the file's bytes and zeros to the next 512-byte boundary; two zero blocks
// end the archive. The length is known before the first byte, so the response carries it and a
// cut download is detectable.
#pragma once

#include <boost/asio/buffer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/optional.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "server/http/http_server.h"

namespace tinkerd::http {

// The 512-byte ustar header of `m` (sizes of 8 GiB and more in GNU's base-256 form).
std::string TarHeader(const TarMember& m);
// The archive's length in bytes.
uint64_t TarSize(const std::vector<TarMember>& members);

struct TarBody {
  using value_type = std::vector<TarMember>;

  static uint64_t size(const value_type& members) { return TarSize(members); }

  class writer {
   public:
    using const_buffers_type = boost::asio::const_buffer;

    template <bool isRequest, class Fields>
    writer(const boost::beast::http::header<isRequest, Fields>&, const value_type& members)
        : members_(members) {}
    ~writer();
    writer(const writer&) = delete;
    writer& operator=(const writer&) = delete;

    // Opens every file first: a checkpoint deleted while it downloads still reads whole.
    void init(boost::beast::error_code& ec);
    boost::optional<std::pair<const_buffers_type, bool>> get(boost::beast::error_code& ec);

   private:
    const value_type& members_;
    std::vector<int> fds_;
    size_t member_ = 0;
    uint64_t done_ = 0;  // bytes of the current member's data sent
    enum class Part { kHeader, kData, kPadding, kTrailer, kEnd } part_ = Part::kHeader;
    std::string chunk_;
  };
};

}  // namespace tinkerd::http
