// The Tinker API's futures: an asynchronous call answers at once with a request_id, and its
// result (or error) lands here when the scheduler finishes it; retrieve_future polls read it.
// A poll of an unfinished future is parked (a callback and a timer, no thread) and answered when
// the result lands, or with try_again after the long-poll time, well inside the SDK's 45 s
// timeout. Futures are per tenant: another tenant's request_id is unknown (404), like a made-up
// one. A finished result stays `keep` after it finished, so a poll retried after a lost answer
// still finds it; then it is gone (404, like an id never issued).
//
// A future may belong to a topic (the SDK's sampling session and clone): newer SDKs learn which of
// a topic's futures finished from one long poll (retrieve_futures) instead of one poll per future,
// and then fetch each result with retrieve_future. Each finishing is numbered by a cursor that
// only grows, across topics and across restarts (it starts at the server's start time in
// microseconds), so a client's cursor from before a restart never hides a new completion.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/http/http_server.h"
#include "server/http/tinker_api_config.h"

namespace tinkerd::http {

class Futures {
 public:
  // `after` runs a function later on the HTTP server's threads (HttpServer::After).
  Futures(FuturesConfig config, std::function<void(absl::Duration, std::function<void()>)> after);

  enum class Opened { kNew, kExists, kConflict, kFull };
  // Registers a pending future, unless one exists already: kExists (left as it is) when it was
  // opened with the same `digest` (a retry of the same call), kConflict when with another (a
  // different call reusing the id, which must not get the first call's answer). kFull when there
  // is no room (every entry pending) or the table is closed. Opened before the call starts, so a
  // call answered 429 was never started.
  Opened Open(const std::string& tenant, const std::string& request_id, uint64_t digest,
              const std::string& topic = "");
  // Forgets a future opened for a call that was then refused at once, so that a resend starts
  // afresh; polls parked on it meanwhile are answered 503 (the client polls again, then 404).
  void Drop(const std::string& tenant, const std::string& request_id);
  // The future's answer: a result (status 200) or, `failed`, a {"error", "category"} body. Wakes
  // its polls, and its topic's. A future finished already keeps its first answer.
  void Finish(const std::string& tenant, const std::string& request_id, Response answer,
              bool failed = false);
  // Whether `tenant` has future `request_id`, pending or finished and not yet expired.
  bool Known(const std::string& tenant, const std::string& request_id) const;
  // Answers with the future's answer when it has one, else parks the poll. With peek_bytes > 0
  // (the client allows a metadata-only answer), a result of at least that many bytes is answered
  // {"status": "complete_metadata", "response_payload_size"} instead, and stays for the next poll;
  // failures and try_again are always sent whole.
  void Poll(const std::string& tenant, const std::string& request_id, Respond respond,
            int64_t peek_bytes = 0);
  // Answers {"completions": [...], "cursor": c} with the topic's futures that finished after
  // `after_cursor`, each {"state": "finished" | "failed", "request_id", and for a finished one
  // "response_payload_uncompressed_size"}; those at or before it are forgotten (the client has
  // seen them). With none, parks the poll until one finishes or `wait` (at most the long-poll
  // time) passes, then answers with none and the cursor unchanged.
  void PollFinished(const std::string& tenant, const std::string& topic, int64_t after_cursor,
                    absl::Duration wait, Respond respond);
  // Answers every parked poll with 503 (the client polls again) and forgets everything.
  void Close();

  size_t size() const;

 private:
  struct Parked {
    Respond respond;
    int64_t peek_bytes;
  };
  struct Entry {
    std::optional<Response> answer;
    bool failed = false;
    absl::Time finished;
    std::map<uint64_t, Parked> polls;  // by poll id
    std::string topic;
    uint64_t digest = 0;  // the call's kind and payload (Open)
  };
  // What a poll gets for a finished future (see Poll's peek_bytes).
  static Response Answer(const Entry& e, int64_t peek_bytes);
  struct Completion {
    int64_t cursor;
    absl::Time finished;
    std::string request_id;
    bool failed;
    size_t payload_bytes;
  };
  struct Topic {
    std::deque<Completion> completions;                     // in cursor order
    std::map<uint64_t, std::pair<int64_t, Respond>> polls;  // parked: after_cursor, by poll id
  };
  static std::string Key(const std::string& tenant, const std::string& request_id) {
    return tenant + '\n' + request_id;  // tenants and ids never contain a newline
  }
  // Under mu_: drops finished entries past `keep`, then the oldest finished until `adding` more
  // fit in max_entries, and topic completions past `keep`. Amortized O(1): finished_ and
  // topic_finished_ are in finishing order.
  void ExpireLocked(size_t adding) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(const std::string& key, uint64_t poll_id, std::string request_id);
  // Under mu_: forgets the topic's completions at or before `cursor`, older than `keep` or past
  // max_entries, and the topic itself once it holds nothing.
  void TrimLocked(const std::string& key, int64_t cursor) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireFinishedPoll(const std::string& key, uint64_t poll_id, int64_t after_cursor);
  static Response FinishedAnswer(const std::deque<Completion>& completions, int64_t after_cursor);

  const FuturesConfig config_;
  const std::function<void(absl::Duration, std::function<void()>)> after_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // (finished, key) of each answer, oldest first; a key answered again after it expired and was
  // reopened appears twice, and only the entry with the matching time is dropped.
  std::deque<std::pair<absl::Time, std::string>> finished_ ABSL_GUARDED_BY(mu_);
  uint64_t next_poll_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Topic> topics_ ABSL_GUARDED_BY(mu_);  // by Key(tenant, topic)
  // (finished, topic key) of each completion, oldest first: how expired ones are found.
  std::deque<std::pair<absl::Time, std::string>> topic_finished_ ABSL_GUARDED_BY(mu_);
  int64_t cursor_ ABSL_GUARDED_BY(mu_);  // the latest completion's
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tinkerd::http
