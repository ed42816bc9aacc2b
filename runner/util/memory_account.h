// One account of the memory the server's large allocations may take: each model's training state
// (for its lifetime), each training call's activations and staged gradient (for the call), and
// each admitted sample's KV cache (until it finishes). Every one reserves its bytes before it
// allocates; past the capacity the request that asked is RESOURCE_EXHAUSTED, for its client to
// retry, and nothing is allocated, so sampling cannot push training (or the reverse) past what
// the process may use, where each used to take memory unseen by the other.
//
// Torch-free: the runner, the sampling engine and the server share it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tinkerd {

class MemoryAccount;

// Bytes held in an account until destroyed (or moved from). Empty when default-constructed.
class Reservation {
 public:
  Reservation() = default;
  Reservation(Reservation&& other) noexcept { *this = std::move(other); }
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  ~Reservation();

  int64_t bytes() const { return bytes_; }

 private:
  friend class MemoryAccount;
  Reservation(std::shared_ptr<MemoryAccount> account, int64_t bytes)
      : account_(std::move(account)), bytes_(bytes) {}
  std::shared_ptr<MemoryAccount> account_;
  int64_t bytes_ = 0;
};

class MemoryAccount : public std::enable_shared_from_this<MemoryAccount> {
 public:
  // `capacity` bytes; `flags` name how an operator changes it (for the refusal's message).
  static std::shared_ptr<MemoryAccount> Create(int64_t capacity, std::string flags);
  // A share of `parent` holding at most `capacity` of it: what is reserved here is reserved there
  // too, so one kind of use (HTTP bodies, say) cannot take the whole parent. `name` describes the
  // share in its refusals ("the quarter of the memory budget for HTTP bodies").
  static std::shared_ptr<MemoryAccount> CreateShare(std::shared_ptr<MemoryAccount> parent,
                                                    int64_t capacity, std::string name);

  // `bytes` for `what` ("create_model: the model's trainable state"), or RESOURCE_EXHAUSTED
  // saying what is left (or that it exceeds the whole capacity), then `advice` (what the client
  // can do about it, appended as given), with nothing reserved.
  absl::StatusOr<Reservation> Reserve(int64_t bytes, const std::string& what,
                                      const std::string& advice);

  int64_t capacity() const { return capacity_; }
  int64_t reserved() const;

 private:
  MemoryAccount(int64_t capacity, std::string flags, std::shared_ptr<MemoryAccount> parent)
      : capacity_(capacity), flags_(std::move(flags)), parent_(std::move(parent)) {}
  friend class Reservation;
  // Reserve without the Reservation: here, and in the parent first when a share.
  absl::Status Take(int64_t bytes, const std::string& what, const std::string& advice);
  void Release(int64_t bytes);

  const int64_t capacity_;
  const std::string flags_;  // a share's: its name
  const std::shared_ptr<MemoryAccount> parent_;
  mutable absl::Mutex mu_;
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tinkerd
