#include "runner/checkpoint/store.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

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

std::string Unique() {
  static std::atomic<uint64_t> counter{0};
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  return absl::StrCat(::getpid(), "-", now, "-", counter++);
}

// Leftovers of interrupted commits: hidden temporaries, and versions no link points to.
void RemoveGarbage(const fs::path& folder, const std::string& name) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return;
  std::string live;
  if (fs::is_symlink(folder / name, ec)) live = fs::read_symlink(folder / name, ec).string();
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string n = e.path().filename().string();
    const bool temp =
        n.rfind(".tmp-" + name + "-", 0) == 0 || n.rfind(".link-" + name + "-", 0) == 0;
    const bool stale_version = n.rfind(name + ".v", 0) == 0 && n != live;
    if (temp || stale_version) fs::remove_all(e.path(), ec);
  }
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
  RemoveGarbage(folder, name);
  const bool exists = fs::is_symlink(target, ec);
  if (exists && !overwrite) {
    return absl::AlreadyExistsError(absl::StrCat("checkpoint ", path, " exists (pass overwrite)"));
  }
  if (fs::exists(target, ec) && !fs::is_symlink(target, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a checkpoint"));
  }
  const std::string id = Unique();
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

}  // namespace tinkerd
