#include "server/http/futures.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

namespace tinkerd::http {

Futures::Futures(FuturesConfig config,
                 std::function<void(absl::Duration, std::function<void()>)> after)
    : config_(config), after_(std::move(after)), cursor_(absl::ToUnixMicros(absl::Now())) {}

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
  // Completions expire with the results, even in topics nobody polls any more.
  while (!topic_finished_.empty() && topic_finished_.front().first < cutoff) {
    TrimLocked(topic_finished_.front().second, /*cursor=*/0);
    topic_finished_.pop_front();
  }
}

Futures::Opened Futures::Open(const std::string& tenant, const std::string& request_id,
                              uint64_t digest, const std::string& topic) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(tenant, request_id);
  if (auto it = entries_.find(key); it != entries_.end()) {
    return it->second.digest == digest ? Opened::kExists : Opened::kConflict;
  }
  if (closed_) return Opened::kFull;
  ExpireLocked(/*adding=*/1);
  if (entries_.size() >= config_.max_entries) return Opened::kFull;
  Entry& e = entries_.emplace(key, Entry()).first->second;
  e.topic = topic;
  e.digest = digest;
  return Opened::kNew;
}

bool Futures::Known(const std::string& tenant, const std::string& request_id) const {
  absl::MutexLock lock(&mu_);
  return entries_.count(Key(tenant, request_id)) > 0;
}

void Futures::Drop(const std::string& tenant, const std::string& request_id) {
  std::map<uint64_t, Parked> polls;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(Key(tenant, request_id));
    if (it == entries_.end() || it->second.answer) return;
    polls.swap(it->second.polls);
    entries_.erase(it);
  }
  for (auto& [id, poll] : polls) poll.respond(Unavailable());
}

void Futures::Finish(const std::string& tenant, const std::string& request_id, Response answer,
                     bool failed) {
  std::vector<std::pair<Respond, Response>> polls;
  std::vector<std::pair<Respond, Response>> topic_polls;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(Key(tenant, request_id));
    if (it == entries_.end() || it->second.answer) return;
    it->second.answer = answer;
    it->second.failed = failed;
    it->second.finished = absl::Now();
    finished_.emplace_back(it->second.finished, it->first);
    for (auto& [id, poll] : it->second.polls) {
      polls.emplace_back(std::move(poll.respond), Answer(it->second, poll.peek_bytes));
    }
    it->second.polls.clear();
    if (!it->second.topic.empty()) {
      const std::string key = Key(tenant, it->second.topic);
      Topic& topic = topics_[key];
      topic.completions.push_back(
          {++cursor_, it->second.finished, request_id, failed, answer.body.size()});
      topic_finished_.emplace_back(it->second.finished, key);
      for (auto p = topic.polls.begin(); p != topic.polls.end();) {
        auto& [after_cursor, respond] = p->second;
        if (after_cursor >= cursor_) {  // a cursor from the future: nothing is new to it yet
          ++p;
          continue;
        }
        topic_polls.emplace_back(std::move(respond),
                                 FinishedAnswer(topic.completions, after_cursor));
        p = topic.polls.erase(p);
      }
      TrimLocked(key, /*cursor=*/0);
    }
    ExpireLocked(/*adding=*/0);  // the answer just given stays, even at max_entries
  }
  for (auto& [respond, r] : polls) respond(std::move(r));
  for (auto& [respond, r] : topic_polls) respond(std::move(r));
}

Response Futures::FinishedAnswer(const std::deque<Completion>& completions, int64_t after_cursor) {
  nlohmann::json list = nlohmann::json::array();
  int64_t cursor = after_cursor;
  for (const Completion& c : completions) {
    if (c.cursor <= after_cursor) continue;
    nlohmann::json j{{"state", c.failed ? "failed" : "finished"}, {"request_id", c.request_id}};
    if (!c.failed) j["response_payload_uncompressed_size"] = c.payload_bytes;
    list.push_back(std::move(j));
    cursor = c.cursor;
  }
  return Response{200,
                  "application/json",
                  nlohmann::json{{"completions", list}, {"cursor", cursor}}.dump(),
                  {}};
}

void Futures::TrimLocked(const std::string& key, int64_t cursor) {
  auto it = topics_.find(key);
  if (it == topics_.end()) return;
  std::deque<Completion>& c = it->second.completions;
  const absl::Time cutoff = absl::Now() - config_.keep;
  while (!c.empty() && (c.front().cursor <= cursor || c.front().finished < cutoff ||
                        c.size() > config_.max_entries)) {
    c.pop_front();
  }
  if (c.empty() && it->second.polls.empty()) topics_.erase(it);
}

void Futures::PollFinished(const std::string& tenant, const std::string& topic,
                           int64_t after_cursor, absl::Duration wait, Respond respond) {
  const std::string key = Key(tenant, topic);
  std::optional<Response> now;
  uint64_t poll_id = 0;
  {
    absl::MutexLock lock(&mu_);
    TrimLocked(key, after_cursor);  // the client has seen everything up to its cursor
    auto it = topics_.find(key);
    const bool any = it != topics_.end() && !it->second.completions.empty() &&
                     it->second.completions.back().cursor > after_cursor;
    if (closed_) {
      now = Unavailable("server is shutting down");
    } else if (any || wait <= absl::ZeroDuration()) {
      static const std::deque<Completion> kNone;
      now = FinishedAnswer(it != topics_.end() ? it->second.completions : kNone, after_cursor);
    } else {
      poll_id = next_poll_++;
      topics_[key].polls.emplace(poll_id, std::make_pair(after_cursor, std::move(respond)));
    }
  }
  if (now) return respond(*std::move(now));
  after_(std::min(wait, config_.long_poll),
         [this, key, poll_id, after_cursor] { ExpireFinishedPoll(key, poll_id, after_cursor); });
}

void Futures::ExpireFinishedPoll(const std::string& key, uint64_t poll_id, int64_t after_cursor) {
  Respond respond;
  {
    absl::MutexLock lock(&mu_);
    auto it = topics_.find(key);
    if (it == topics_.end()) return;
    auto p = it->second.polls.find(poll_id);
    if (p == it->second.polls.end()) return;  // answered meanwhile
    respond = std::move(p->second.second);
    it->second.polls.erase(p);
    TrimLocked(key, after_cursor);
  }
  respond(FinishedAnswer({}, after_cursor));
}

Response Futures::Answer(const Entry& e, int64_t peek_bytes) {
  const size_t size = e.answer->body.size();
  if (e.failed || peek_bytes <= 0 || size < static_cast<uint64_t>(peek_bytes)) return *e.answer;
  return Response{
      200,
      "application/json",
      nlohmann::json{{"status", "complete_metadata"}, {"response_payload_size", size}}.dump(),
      {}};
}

void Futures::Poll(const std::string& tenant, const std::string& request_id, Respond respond,
                   int64_t peek_bytes) {
  const std::string key = Key(tenant, request_id);
  std::optional<Response> now;  // answered outside the lock
  uint64_t poll_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.answer) {
      now = Answer(it->second, peek_bytes);
    } else if (it == entries_.end() || closed_) {
      now = Response{404,
                     "application/json",
                     nlohmann::json{{"detail", "request_id: unknown or expired future"}}.dump(),
                     {}};
    } else {
      poll_id = next_poll_++;
      it->second.polls.emplace(poll_id, Parked{std::move(respond), peek_bytes});
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
    respond = std::move(p->second.respond);
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
      for (auto& [id, poll] : e.polls) polls.push_back(std::move(poll.respond));
    }
    for (auto& [key, topic] : topics_) {
      for (auto& [id, poll] : topic.polls) polls.push_back(std::move(poll.second));
    }
    entries_.clear();
    finished_.clear();
    topics_.clear();
    topic_finished_.clear();
  }
  for (auto& respond : polls) respond(Unavailable("server is shutting down"));
}

}  // namespace tinkerd::http
