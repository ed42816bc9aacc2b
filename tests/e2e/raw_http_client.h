// A client speaking HTTP/1.1 over a raw socket, for the e2e tests: it sends what a library would
// not (a body announced and never sent, an unknown transfer coding, pipelined requests) and reads
// answers byte for byte.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace tinkerd::testing {

// Reads wait on the socket (poll) up to a deadline; a deadline passing fails the caller's check.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawClient() { ::close(fd_); }
  bool connected() const { return connected_; }

  bool Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  struct Answer {
    int status = 0;
    std::map<std::string, std::string> headers;  // names in lower case
    std::string body;
  };
  // One response: status line and headers, then Content-Length bytes of body (none for a HEAD).
  std::optional<Answer> Read(bool head = false) {
    size_t end;
    while ((end = buffer_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return std::nullopt;
    }
    Answer a;
    const std::string top = buffer_.substr(0, end);
    buffer_.erase(0, end + 4);
    std::vector<std::string> lines = absl::StrSplit(top, "\r\n");
    if (lines.empty() || !absl::StartsWith(lines[0], "HTTP/1.1 ") ||
        !absl::SimpleAtoi(lines[0].substr(9, 3), &a.status)) {
      ADD_FAILURE() << "not a status line: " << lines[0];
      return std::nullopt;
    }
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      a.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
          std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
    }
    size_t length = 0;
    if (!head && a.headers.count("content-length")) {
      EXPECT_TRUE(absl::SimpleAtoi(a.headers["content-length"], &length));
    }
    while (buffer_.size() < length) {
      if (!Fill()) return std::nullopt;
    }
    a.body = buffer_.substr(0, length);
    buffer_.erase(0, length);
    return a;
  }
  // Whether the server closes the connection (EOF or reset) before the deadline.
  bool ClosedByServer() {
    while (Fill()) {
    }
    return closed_;
  }

 private:
  // Appends what arrives within the deadline; false on EOF, error or deadline.
  bool Fill() {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, kDeadlineMs) <= 0) return false;
    char chunk[4096];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) {
      closed_ = true;
      return false;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  static constexpr int kDeadlineMs = 20'000;
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  std::string buffer_;
};

}  // namespace tinkerd::testing
