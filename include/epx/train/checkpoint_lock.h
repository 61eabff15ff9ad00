// One writer per checkpoint folder. A run that saves into DIR holds an
// exclusive flock(2) on DIR/.epx-lock from before its first step to its end;
// the file names the owner (host, pid, start time, run id), so a second run
// started with the same DIR is refused at once, naming the first.
//
//   EPX_ASSIGN_OR_RETURN(epx::SaveLock lock, epx::SaveLock::acquire("ck", run_id));
//   if (!lock.note().empty()) fmt::print(stderr, "{}\n", lock.note());
//
// acquire creates DIR and its marker when needed (check_save_dir's rules:
// a new or empty folder, or epx's), then the lock file.
// - Held by another process (of this host, or of another host sharing the
//   filesystem, where the filesystem passes flock on): FailedPrecondition
//   naming the owner from the file.
// - A lock file whose lock is free was left by an owner that died (kill -9, a
//   crash, a lost node): taken over; note() says who the previous owner was.
// - Released when the last SaveLock of this process for DIR goes (the file
//   is removed first, while still locked) or when the process dies (the
//   kernel drops the lock; the file stays for the next owner to explain).
// - Within one process, acquiring a folder it already holds returns the same
//   lock (`epx train` takes it before train() takes it again); two runs of one
//   process in one folder are therefore not told apart.
// - A filesystem without flock (ENOLCK, EOPNOTSUPP): no lock; note() says so.
#pragma once

#include <memory>
#include <string>

#include "epx/core/status.h"

namespace epx {

inline constexpr const char* kSaveLockFile = ".epx-lock";

class SaveLock {
 public:
  [[nodiscard]] static Result<SaveLock> acquire(const std::string& dir, const std::string& run_id);
  // One line about the previous owner's stale lock, or a filesystem without
  // locks; empty otherwise.
  [[nodiscard]] const std::string& note() const;

 private:
  struct Held;
  explicit SaveLock(std::shared_ptr<Held> held, std::string note) : held_(std::move(held)), note_(std::move(note)) {}
  std::shared_ptr<Held> held_;
  std::string note_;
};

}  // namespace epx
