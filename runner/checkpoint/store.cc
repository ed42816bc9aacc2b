#include "runner/checkpoint/store.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace tinkerd {
namespace {

namespace fs = std::filesystem;

absl::Status FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("fsync ", path, ": ", std::strerror(errno)));
  return absl::OkStatus();
}

// A save's id: <pid>-<steady clock ns>-<counter>. The pid tells whether the save that made an
// entry may still be running (see Stale).
std::string Unique() {
  static std::atomic<uint64_t> counter{0};
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  return absl::StrCat(::getpid(), "-", now, "-", counter++);
}

// The ids of this process's saves in progress: their entries are not leftovers.
absl::Mutex in_progress_mu;
std::set<std::string>& InProgress() {
  static auto* ids = new std::set<std::string>();
  return *ids;
}

struct Entry {
  enum Kind { kTemp, kLink, kVersion } kind;
  std::string name;  // the checkpoint's name
  std::string id;    // the save's id
  pid_t pid;
};

// `s` is a save id exactly (digits-digits-digits); sets its pid.
bool ParseId(absl::string_view s, pid_t* pid) {
  std::vector<absl::string_view> parts = absl::StrSplit(s, '-');
  if (parts.size() != 3) return false;
  for (absl::string_view p : parts) {
    if (p.empty() || p.size() > 20 || !std::all_of(p.begin(), p.end(), ::isdigit)) return false;
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(parts[0], &v) || v <= 0 || v > std::numeric_limits<pid_t>::max())
    return false;
  *pid = static_cast<pid_t>(v);
  return true;
}

// What CommitCheckpoint makes, parsed exactly: .tmp-<name>-<id>, .link-<name>-<id> and
// <name>.v<id>, with <id> as Unique() writes it. So the clean-up of "run" never matches
// "run.valid" or "run-1"'s temporaries.
std::optional<Entry> ParseEntry(const std::string& n) {
  Entry e;
  auto split_tail = [&](absl::string_view rest) {
    // The id is the last three '-'-separated fields; the name is what precedes them.
    size_t cut = rest.size();
    for (int i = 0; i < 3; ++i) {
      cut = rest.rfind('-', cut - 1);
      if (cut == absl::string_view::npos || cut == 0) return false;
    }
    e.name = std::string(rest.substr(0, cut));
    e.id = std::string(rest.substr(cut + 1));
    return ParseId(e.id, &e.pid);
  };
  if (absl::StartsWith(n, ".tmp-")) {
    e.kind = Entry::kTemp;
    if (split_tail(absl::string_view(n).substr(5))) return e;
  } else if (absl::StartsWith(n, ".link-")) {
    e.kind = Entry::kLink;
    if (split_tail(absl::string_view(n).substr(6))) return e;
  } else if (size_t v = n.rfind(".v"); v != std::string::npos && v > 0) {
    e.kind = Entry::kVersion;
    e.name = n.substr(0, v);
    e.id = n.substr(v + 2);
    if (ParseId(e.id, &e.pid)) return e;
  }
  return std::nullopt;
}

// Whether the save that made `e` is over: a save of this process that is not in progress (this
// also covers a previous process that had the same pid, as pid 1 in a container), or one of
// another process that no longer exists. A live other process is left alone.
bool Stale(const Entry& e) {
  if (e.pid == ::getpid()) {
    absl::MutexLock lock(&in_progress_mu);
    return InProgress().count(e.id) == 0;
  }
  return ::kill(e.pid, 0) != 0 && errno == ESRCH;
}

// Leftovers of interrupted commits in `folder`, of any checkpoint name: temporaries, links and
// versions no link points to, whose save is over.
void RemoveGarbage(const fs::path& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return;
  std::vector<fs::path> garbage;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string n = e.path().filename().string();
    auto parsed = ParseEntry(n);
    if (!parsed || !Stale(*parsed)) continue;
    if (parsed->kind == Entry::kVersion) {
      // A version is live while its checkpoint's link points to it.
      if (fs::is_symlink(e.path(), ec)) continue;  // a checkpoint whose name looks like one
      const fs::path link = folder / parsed->name;
      if (fs::is_symlink(link, ec) && fs::read_symlink(link, ec).string() == n) continue;
    }
    garbage.push_back(e.path());
  }
  for (const fs::path& p : garbage) fs::remove_all(p, ec);
}

}  // namespace

absl::Status CommitCheckpoint(const std::string& path, bool overwrite,
                              const CheckpointWriter& write) {
  const fs::path target(path);
  const fs::path folder = target.parent_path();
  const std::string name = target.filename().string();
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", folder.string(), ": ", ec.message()));
  RemoveGarbage(folder);
  const bool exists = fs::is_symlink(target, ec);
  if (exists && !overwrite) {
    return absl::AlreadyExistsError(absl::StrCat("checkpoint ", path, " exists (pass overwrite)"));
  }
  if (fs::exists(target, ec) && !fs::is_symlink(target, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a checkpoint"));
  }
  const std::string id = Unique();
  {
    absl::MutexLock lock(&in_progress_mu);
    InProgress().insert(id);
  }
  struct Done {
    std::string id;
    ~Done() {
      absl::MutexLock lock(&in_progress_mu);
      InProgress().erase(id);
    }
  } done{id};
  const fs::path tmp = folder / (".tmp-" + name + "-" + id);
  fs::create_directory(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", tmp.string(), ": ", ec.message()));
  absl::Status st = write(tmp.string());
  if (st.ok() && !fs::exists(tmp / "manifest.json", ec)) {
    st = absl::InternalError("checkpoint writer produced no manifest.json");
  }
  if (st.ok()) st = FsyncPath(tmp.string());
  const std::string version = name + ".v" + id;
  if (st.ok()) {
    fs::rename(tmp, folder / version, ec);
    if (ec) st = absl::InternalError(absl::StrCat("rename to ", version, ": ", ec.message()));
  }
  if (st.ok()) st = FsyncPath(folder.string());
  if (!st.ok()) {
    fs::remove_all(tmp, ec);
    return st;
  }
  const std::string old = exists ? fs::read_symlink(target, ec).string() : "";
  const fs::path link = folder / (".link-" + name + "-" + id);
  fs::create_directory_symlink(version, link, ec);
  if (!ec) fs::rename(link, target, ec);  // atomic replacement of the old link
  if (ec) {
    fs::remove_all(folder / version, ec);
    return absl::InternalError(absl::StrCat("publish ", path, ": ", ec.message()));
  }
  if (auto s = FsyncPath(folder.string()); !s.ok()) return s;
  if (!old.empty() && old != version) fs::remove_all(folder / old, ec);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ResolveCheckpoint(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::is_symlink(p, ec)) {
    // A plain complete directory (e.g. exported elsewhere) is accepted as well.
    if (fs::exists(p / "manifest.json", ec)) return p.string();
    return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
  }
  const fs::path dir = p.parent_path() / fs::read_symlink(p, ec);
  if (ec || !fs::exists(dir / "manifest.json", ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, " is incomplete"));
  }
  return dir.string();
}

std::vector<std::string> ListCheckpoints(const std::string& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string n = e.path().filename().string();
    if (n.empty() || n[0] == '.' || !fs::is_symlink(e.path(), ec)) continue;
    if (ResolveCheckpoint(e.path().string()).ok()) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status DeleteCheckpoint(const std::string& path) {
  auto dir = ResolveCheckpoint(path);
  if (!dir.ok()) return dir.status();
  std::error_code ec;
  fs::remove(path, ec);  // the link first: from here on the checkpoint is gone for readers
  if (ec) return absl::InternalError(absl::StrCat("delete ", path, ": ", ec.message()));
  fs::remove_all(*dir, ec);
  return absl::OkStatus();
}

void SweepCheckpointLeftovers(const std::string& root) {
  std::error_code ec;
  // Checkpoint folders sit at most four levels down (<tenant>/<model>/<kind>/); what a
  // checkpoint holds is never descended into.
  std::vector<std::pair<fs::path, int>> todo{{fs::path(root), 0}};
  while (!todo.empty()) {
    auto [dir, depth] = todo.back();
    todo.pop_back();
    RemoveGarbage(dir);
    if (depth == 4) continue;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.empty() || n[0] == '.' || ParseEntry(n) || e.is_symlink(ec) || !e.is_directory(ec))
        continue;
      todo.emplace_back(e.path(), depth + 1);
    }
  }
}

}  // namespace tinkerd
