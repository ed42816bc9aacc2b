#include "runner/util/memory_account.h"

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
  return std::shared_ptr<MemoryAccount>(new MemoryAccount(capacity, std::move(flags)));
}

absl::StatusOr<Reservation> MemoryAccount::Reserve(int64_t bytes, const std::string& what,
                                                   const std::string& advice) {
  {
    absl::MutexLock lock(&mu_);
    if (bytes > capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " needs ", MiB(bytes), " of memory, more than the server's whole ",
                       "memory budget (", MiB(capacity_), ", ", flags_,
                       "): it cannot run here as it is", advice));
    }
    if (bytes > capacity_ - reserved_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " needs ", MiB(bytes), " of memory; the server's memory budget (",
                       MiB(capacity_), ", shared by models, training calls and samples; ", flags_,
                       ") has ", MiB(capacity_ - reserved_), " left", advice));
    }
    reserved_ += bytes;
  }
  return Reservation(shared_from_this(), bytes);
}

int64_t MemoryAccount::reserved() const {
  absl::MutexLock lock(&mu_);
  return reserved_;
}

void MemoryAccount::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ -= bytes;
}

}  // namespace tinkerd
