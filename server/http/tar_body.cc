#include "server/http/tar_body.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tinkerd::http {
namespace {

constexpr uint64_t kBlock = 512;
constexpr size_t kChunk = 256 << 10;

uint64_t Padded(uint64_t n) {
  return (n + kBlock - 1) / kBlock * kBlock;
}

// `value` in octal, zero-filled to width − 1 digits and NUL-terminated, at `field`.
void Octal(char* field, size_t width, uint64_t value) {
  const std::string digits = absl::StrFormat("%0*o", static_cast<int>(width - 1), value);
  std::memcpy(field, digits.data(), width - 1);
  field[width - 1] = '\0';
}

}  // namespace

std::string TarHeader(const TarArchive::Member& m) {
  std::string h(kBlock, '\0');
  char* b = h.data();
  std::memcpy(b, m.name.data(), std::min<size_t>(m.name.size(), 100));
  Octal(b + 100, 8, 0644);  // mode
  Octal(b + 108, 8, 0);     // uid
  Octal(b + 116, 8, 0);     // gid
  if (m.size < (uint64_t{1} << 33)) {
    Octal(b + 124, 12, m.size);
  } else {
    // Base-256: a leading 0x80, then the size big-endian in the field's remaining bytes.
    b[124] = static_cast<char>(0x80);
    for (int i = 0; i < 8; ++i) b[135 - i] = static_cast<char>((m.size >> (8 * i)) & 0xff);
  }
  Octal(b + 136, 12, static_cast<uint64_t>(std::max<int64_t>(m.mtime, 0)));
  b[156] = '0';  // a regular file
  std::memcpy(b + 257, "ustar", 6);
  std::memcpy(b + 263, "00", 2);
  // The checksum: every header byte summed as unsigned, its own field counted as spaces.
  std::memset(b + 148, ' ', 8);
  unsigned sum = 0;
  for (char c : h) sum += static_cast<unsigned char>(c);
  Octal(b + 148, 7, sum);
  b[155] = ' ';
  return h;
}

uint64_t TarSize(const TarArchive& archive) {
  if (archive.raw) return archive.members.empty() ? 0 : archive.members.front().size;
  uint64_t n = 2 * kBlock;
  for (const TarArchive::Member& m : archive.members) n += kBlock + Padded(m.size);
  return n;
}

TarArchive::~TarArchive() {
  for (const Member& m : members) ::close(m.fd);
  if (on_close) on_close();
}

absl::StatusOr<std::shared_ptr<TarArchive>> OpenTarArchive(
    const std::vector<std::pair<std::string, std::string>>& files) {
  auto archive = std::make_shared<TarArchive>();
  for (const auto& [name, path] : files) {
    if (name.empty() || name.size() > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("archive: '", name, "' does not fit a tar header's 100 bytes"));
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("archive: ", name, " is gone"));
    archive->members.push_back({name, fd, 0, 0});
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::NotFoundError(absl::StrCat("archive: ", name, " is not a regular file"));
    }
    archive->members.back().size = static_cast<uint64_t>(st.st_size);
    archive->members.back().mtime = static_cast<int64_t>(st.st_mtime);
  }
  return archive;
}

boost::optional<std::pair<TarBody::writer::const_buffers_type, bool>> TarBody::writer::get(
    boost::beast::error_code& ec) {
  ec = {};
  auto out = [this](bool more) {
    return boost::make_optional(
        std::make_pair(const_buffers_type(chunk_.data(), chunk_.size()), more));
  };
  while (true) {
    switch (part_) {
      case Part::kHeader:
        if (member_ == archive_.members.size()) {
          part_ = Part::kTrailer;
          continue;
        }
        chunk_ = TarHeader(archive_.members[member_]);
        done_ = 0;
        part_ = Part::kData;
        return out(true);
      case Part::kData: {
        if (member_ == archive_.members.size()) {  // a raw body of nothing
          part_ = Part::kEnd;
          continue;
        }
        const TarArchive::Member& m = archive_.members[member_];
        const uint64_t left = m.size - done_;
        if (left == 0) {
          part_ = archive_.raw ? Part::kEnd : Part::kPadding;
          continue;
        }
        chunk_.resize(static_cast<size_t>(std::min<uint64_t>(left, kChunk)));
        ssize_t n;
        do {
          n = ::pread(m.fd, chunk_.data(), chunk_.size(), static_cast<off_t>(done_));
        } while (n < 0 && errno == EINTR);
        if (n <= 0) {
          // Shorter than it was when opened: the length sent is a promise that cannot be kept.
          ec.assign(n < 0 ? errno : EIO, boost::system::generic_category());
          return boost::none;
        }
        chunk_.resize(static_cast<size_t>(n));
        done_ += static_cast<uint64_t>(n);
        return out(true);
      }
      case Part::kPadding: {
        const uint64_t size = archive_.members[member_].size;
        const uint64_t pad = Padded(size) - size;
        ++member_;
        part_ = Part::kHeader;
        if (pad == 0) continue;
        chunk_.assign(static_cast<size_t>(pad), '\0');
        return out(true);
      }
      case Part::kTrailer:
        chunk_.assign(2 * kBlock, '\0');
        part_ = Part::kEnd;
        return out(false);
      case Part::kEnd:
        return boost::none;
    }
  }
}

}  // namespace tinkerd::http
