#include "server/http/futures.h"

#include <optional>

#include <nlohmann/json.hpp>

namespace tinkerd::http {

Futures::Futures(FuturesConfig config,
                 std::function<void(absl::Duration, std::function<void()>)> after)
    : config_(config), after_(std::move(after)) {}

namespace {

Response Unavailable(const char* why = "the call was refused; poll again") {
  return Response{503, "application/json", nlohmann::json{{"detail", why}}.dump(), {}};
}

}  // namespace

size_t Futures::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

void Futures::ExpireLocked(size_t adding) {
  const absl::Time cutoff = absl::Now() - config_.keep;
  while (!finished_.empty() &&
         (finished_.front().first < cutoff || entries_.size() + adding > config_.max_entries)) {
    auto it = entries_.find(finished_.front().second);
    if (it != entries_.end() && it->second.answer &&
        it->second.finished == finished_.front().first) {
      entries_.erase(it);
    }
    finished_.pop_front();
  }
}

Futures::Opened Futures::Open(const std::string& tenant, const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(tenant, request_id);
  if (entries_.count(key)) return Opened::kExists;
  if (closed_) return Opened::kFull;
  ExpireLocked(/*adding=*/1);
  if (entries_.size() >= config_.max_entries) return Opened::kFull;
  entries_.emplace(key, Entry());
  return Opened::kNew;
}

void Futures::Drop(const std::string& tenant, const std::string& request_id) {
  std::map<uint64_t, Respond> polls;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(Key(tenant, request_id));
    if (it == entries_.end() || it->second.answer) return;
    polls.swap(it->second.polls);
    entries_.erase(it);
  }
  for (auto& [id, respond] : polls) respond(Unavailable());
}

void Futures::Finish(const std::string& tenant, const std::string& request_id, Response answer) {
  std::map<uint64_t, Respond> polls;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(Key(tenant, request_id));
    if (it == entries_.end() || it->second.answer) return;
    it->second.answer = answer;
    it->second.finished = absl::Now();
    finished_.emplace_back(it->second.finished, it->first);
    polls.swap(it->second.polls);
    ExpireLocked(/*adding=*/0);  // the answer just given stays, even at max_entries
  }
  for (auto& [id, respond] : polls) respond(answer);
}

void Futures::Poll(const std::string& tenant, const std::string& request_id, Respond respond) {
  const std::string key = Key(tenant, request_id);
  std::optional<Response> now;  // answered outside the lock
  uint64_t poll_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.answer) {
      now = *it->second.answer;
    } else if (it == entries_.end() || closed_) {
      now = Response{404,
                     "application/json",
                     nlohmann::json{{"detail", "request_id: unknown or expired future"}}.dump(),
                     {}};
    } else {
      poll_id = next_poll_++;
      it->second.polls.emplace(poll_id, std::move(respond));
    }
  }
  if (now) return respond(*std::move(now));
  after_(config_.long_poll, [this, key, poll_id, request_id] { Expire(key, poll_id, request_id); });
}

void Futures::Expire(const std::string& key, uint64_t poll_id, std::string request_id) {
  Respond respond;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return;
    auto p = it->second.polls.find(poll_id);
    if (p == it->second.polls.end()) return;  // answered meanwhile
    respond = std::move(p->second);
    it->second.polls.erase(p);
  }
  Response r;
  r.body =
      nlohmann::json{{"type", "try_again"}, {"request_id", request_id}, {"queue_state", "active"}}
          .dump();
  respond(std::move(r));
}

void Futures::Close() {
  std::vector<Respond> polls;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    for (auto& [key, e] : entries_) {
      for (auto& [id, respond] : e.polls) polls.push_back(std::move(respond));
    }
    entries_.clear();
    finished_.clear();
  }
  for (auto& respond : polls) respond(Unavailable("server is shutting down"));
}

}  // namespace tinkerd::http
