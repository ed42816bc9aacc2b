#include "runner/util/memory_account.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tinkerd {
namespace {

std::string MiB(int64_t bytes) {
  if (bytes < (1 << 20)) return absl::StrFormat("%.1f KiB", static_cast<double>(bytes) / 1024);
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (account_ != nullptr) account_->Release(bytes_);
    account_ = std::move(other.account_);
    bytes_ = other.bytes_;
    other.account_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

Reservation::~Reservation() {
  if (account_ != nullptr) account_->Release(bytes_);
}

std::shared_ptr<MemoryAccount> MemoryAccount::Create(int64_t capacity, std::string flags) {
  return std::shared_ptr<MemoryAccount>(new MemoryAccount(capacity, std::move(flags), nullptr));
}

std::shared_ptr<MemoryAccount> MemoryAccount::CreateShare(std::shared_ptr<MemoryAccount> parent,
                                                          int64_t capacity, std::string name) {
  return std::shared_ptr<MemoryAccount>(
      new MemoryAccount(capacity, std::move(name), std::move(parent)));
}

absl::StatusOr<Reservation> MemoryAccount::Reserve(int64_t bytes, const std::string& what,
                                                   const std::string& advice) {
  if (absl::Status st = Take(bytes, what, advice); !st.ok()) return st;
  return Reservation(shared_from_this(), bytes);
}

absl::Status MemoryAccount::Take(int64_t bytes, const std::string& what,
                                 const std::string& advice) {
  // A share's lock is held while the parent takes its part: shares lock before their parent,
  // never after, so there is no cycle.
  absl::MutexLock lock(&mu_);
  if (parent_ != nullptr) {
    if (bytes > capacity_ - reserved_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " needs ", MiB(bytes), " of memory; ", flags_, " (", MiB(capacity_), ") has ",
          MiB(std::max<int64_t>(0, capacity_ - reserved_)), " left", advice));
    }
    if (absl::Status st = parent_->Take(bytes, what, advice); !st.ok()) return st;
    reserved_ += bytes;
    return absl::OkStatus();
  }
  if (bytes > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", MiB(bytes), " of memory, more than the server's whole ", "memory budget (",
        MiB(capacity_), ", ", flags_, "): it cannot run here as it is", advice));
  }
  if (bytes > capacity_ - reserved_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", MiB(bytes), " of memory; the server's memory budget (",
                     MiB(capacity_), ", shared by models, training calls and samples; ", flags_,
                     ") has ", MiB(capacity_ - reserved_), " left", advice));
  }
  reserved_ += bytes;
  return absl::OkStatus();
}

int64_t MemoryAccount::reserved() const {
  absl::MutexLock lock(&mu_);
  return reserved_;
}

void MemoryAccount::Release(int64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    reserved_ -= bytes;
  }
  if (parent_ != nullptr) parent_->Release(bytes);
}

}  // namespace tinkerd
