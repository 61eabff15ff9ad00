// SaveLock: flock(2) on DIR/.epx-lock, the owner written into the file.
#include "epx/train/checkpoint_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "train/checkpoint.h"

namespace epx {
namespace {

namespace fs = std::filesystem;

// Who holds (or held) a folder's lock, as its file says.
struct Owner {
  std::string host, pid, started, run;
  [[nodiscard]] bool known() const { return !pid.empty(); }
  [[nodiscard]] std::string describe() const {
    return fmt::format("pid {} on host {}, started {}{}", pid, host.empty() ? "?" : host,
                       started.empty() ? "?" : started, run.empty() ? "" : fmt::format(" (run {})", run));
  }
};

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char text[32] = {};
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string format_owner(const std::string& run_id) {
  return fmt::format("host {}\npid {}\nstarted {}\nrun {}\n", host_name(), ::getpid(), utc_now(), run_id);
}

// The "key value" lines of a lock file (at most its first 4 KiB).
Owner read_owner(int fd) {
  char bytes[4096];
  const ssize_t n = ::pread(fd, bytes, sizeof(bytes), 0);
  Owner owner;
  std::string_view text(bytes, n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!text.empty()) {
    const std::size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    const std::size_t space = line.find(' ');
    if (space == std::string_view::npos) continue;
    const std::string_view key = line.substr(0, space);
    std::string value(line.substr(space + 1, 256));
    if (key == "host") owner.host = std::move(value);
    if (key == "pid") owner.pid = std::move(value);
    if (key == "started") owner.started = std::move(value);
    if (key == "run") owner.run = std::move(value);
  }
  return owner;
}

// The file open as `fd` is still the one at `path` (not removed or replaced
// by an owner that left while this process waited to lock it).
bool still_at_path(int fd, const fs::path& path) {
  struct stat open_st {}, path_st {};
  return ::fstat(fd, &open_st) == 0 && ::stat(path.c_str(), &path_st) == 0 && open_st.st_dev == path_st.st_dev &&
         open_st.st_ino == path_st.st_ino;
}

// The locks this process holds, by folder: a second acquire shares the first.
std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

struct SaveLock::Held {
  Held(int f, fs::path p) : fd(f), path(std::move(p)) {}
  ~Held() {
    // Removed while still locked, so no other process can lock this file
    // after it is gone from the folder (it checks still_at_path).
    if (still_at_path(fd, path)) ::unlink(path.c_str());
    ::close(fd);
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  int fd;
  fs::path path;
};

namespace {

// Folder -> its SaveLock::Held, while this process holds it.
std::map<std::string, std::weak_ptr<void>>& registry() {
  static std::map<std::string, std::weak_ptr<void>> held;
  return held;
}

// A lock that could not be taken because another process holds it, or
// because the filesystem has no locks (then `unlocked` says so).
Status refuse(const std::string& dir, const fs::path& path, int fd, int err, std::string* unlocked) {
  const Owner owner = read_owner(fd);
  if (err == EWOULDBLOCK)
    return failed_precondition(
        "--save {} is in use by another run: {} holds its lock {}; two runs saving into one folder would replace "
        "and prune each other's checkpoints. Wait for that run to end, or choose another --save folder",
        dir, owner.known() ? owner.describe() : "a process", path.string());
  if (err == ENOLCK || err == EOPNOTSUPP || err == EINVAL) {
    *unlocked = fmt::format("--save {}: the filesystem does not lock files ({}), so a second run saving into this "
                            "folder is not refused; start one run per folder",
                            dir, std::strerror(err));
    return Status::ok();
  }
  return internal_error("--save {}: cannot lock {}: {}", dir, path.string(), std::strerror(err));
}

std::string stale_note(const std::string& dir, const Owner& previous) {
  if (!previous.known()) return "";
  return fmt::format("--save {}: the lock of a previous run was left behind: {} is gone (its lock was free: the "
                     "process ended without releasing it, e.g. killed); this run takes the folder over",
                     dir, previous.describe());
}

}  // namespace

Result<SaveLock> SaveLock::acquire(const std::string& dir, const std::string& run_id) {
  EPX_RETURN_IF_ERROR(detail::make_checkpoint_folder(dir));
  std::error_code ec;
  const std::string key = fs::weakly_canonical(fs::absolute(dir), ec).string();
  std::lock_guard guard(registry_mutex());
  if (std::shared_ptr<void> held = registry()[key].lock())
    return SaveLock(std::static_pointer_cast<Held>(std::move(held)), "");
  const fs::path path = fs::path(dir) / kSaveLockFile;
  constexpr int kAttempts = 8;  // each retry follows an owner that removed the file as this process opened it
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return internal_error("--save {}: cannot create the lock file {}: {}", dir, path.string(), std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      std::string unlocked;
      const Status s = refuse(dir, path, fd, errno, &unlocked);
      ::close(fd);
      if (!s.is_ok()) return s;
      return SaveLock(nullptr, std::move(unlocked));
    }
    if (!still_at_path(fd, path)) {
      ::close(fd);
      continue;
    }
    auto held = std::make_shared<Held>(fd, path);
    const std::string note = stale_note(dir, read_owner(fd));
    const std::string mine = format_owner(run_id);
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, mine.data(), mine.size(), 0) != static_cast<ssize_t>(mine.size()))
      return internal_error("--save {}: cannot write the lock file {}: {}", dir, path.string(), std::strerror(errno));
    registry()[key] = held;
    return SaveLock(std::move(held), note);
  }
  return internal_error("--save {}: the lock file {} was replaced {} times while it was being locked", dir,
                        path.string(), kAttempts);
}

const std::string& SaveLock::note() const { return note_; }

}  // namespace epx
