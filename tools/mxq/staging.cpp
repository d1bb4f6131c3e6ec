#include "fail.hpp"
#include "staging.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace fs = std::filesystem;

namespace mxq::cli {

namespace {

constexpr std::string_view kStagingPrefix = ".mxq-staging-";

// The pid of a staging directory's name, or 0 when the name is not exactly ".mxq-staging-<digits>".
long staging_pid(const std::string& name) {
  if (!name.starts_with(kStagingPrefix) || name.size() == kStagingPrefix.size() || name.size() > kStagingPrefix.size() + 10)
    return 0;
  const std::string digits = name.substr(kStagingPrefix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) || digits[0] == '0') return 0;
  const long long pid = std::stoll(digits);
  return pid > INT_MAX ? 0 : long(pid);
}

}  // namespace

int remove_stale_staging(const fs::path& out) {
  std::error_code ec;
  if (!fs::is_directory(out, ec)) return 0;
  std::vector<std::pair<fs::path, long>> stale;
  for (auto it = fs::directory_iterator(out, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const long pid = staging_pid(it->path().filename().string());
    std::error_code e2;
    if (pid == 0 || pid == long(::getpid()) || it->is_symlink(e2) || !it->is_directory(e2)) continue;
    if (::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;  // alive (EPERM: alive, another user's)
    // A run in another PID namespace (a container sharing this directory) has a pid this one does
    // not see; it holds the directory's lock for as long as it lives.
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    ::close(fd);
    if (!held) stale.emplace_back(it->path(), pid);
  }
  int removed = 0;
  for (const auto& [p, pid] : stale) {
    fs::remove_all(p, ec);
    if (ec) {
      fmt::print(stderr, "mxq: could not remove {} (the staging directory of process {}, which is gone): {}\n", p.string(),
                 pid, ec.message());
    } else {
      fmt::print(stderr, "mxq: removed {}: the staging directory of an interrupted run (process {}, which is gone)\n",
                 p.string(), pid);
      ++removed;
    }
  }
  return removed;
}

void check_output(const fs::path& in, const fs::path& out, bool overwrite) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(out, ec))) return;  // Staging creates it
  if (!fs::is_directory(out, ec)) fail(out.string() + ": exists and is not a directory");
  const fs::path in_dir = fs::is_directory(in, ec) ? in : (in.has_parent_path() ? in.parent_path() : fs::path("."));
  if (fs::equivalent(in_dir, out, ec))
    fail(out.string() + ": is the input's directory (" + in.string() + "); write the converted checkpoint elsewhere");
  const fs::path cin = fs::weakly_canonical(in_dir, ec), cout = fs::weakly_canonical(out, ec);
  for (fs::path p = cin; !p.empty(); p = p.parent_path()) {
    if (p == cout) fail(out.string() + ": holds the input " + in.string() + "; write the converted checkpoint elsewhere");
    if (p == p.parent_path()) break;
  }
  remove_stale_staging(out);
  if (!overwrite && !fs::is_empty(out, ec))
    fail(out.string() + ": exists and is not empty; pass --overwrite to replace its contents with the converted checkpoint");
}

Staging::Staging(const fs::path& out, bool overwrite) : out_(out), overwrite_(overwrite) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out, ec)) && !fs::is_directory(out, ec))
    fail(out.string() + ": exists and is not a directory");
  created_ = !fs::exists(out, ec);
  fs::create_directories(out);
  dir_ = out / (std::string(kStagingPrefix) + std::to_string(::getpid()));
  fs::remove_all(dir_);
  fs::create_directory(dir_);
  // Held until this process ends, however it ends: remove_stale_staging's proof of life.
  lock_fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (lock_fd_ >= 0) ::flock(lock_fd_, LOCK_EX | LOCK_NB);
}

Staging::~Staging() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
  if (published_) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
  if (created_ && fs::is_empty(out_, ec)) fs::remove(out_, ec);
}

void Staging::publish() {
  const fs::path old = out_ / (".mxq-replaced-" + std::to_string(::getpid()));
  std::vector<fs::path> moved_old, moved_new;  // names moved so far, for the roll-back
  std::string error;
  const auto move = [&](const fs::path& from, const fs::path& to) {
    std::error_code ec;
    fs::rename(from, to, ec);
    if (ec) error = to.string() + ": cannot move into place: " + ec.message();
    return !ec;
  };
  bool ok = true;
  if (overwrite_) {
    std::vector<fs::path> names;
    for (const auto& e : fs::directory_iterator(out_))
      if (e.path() != dir_) names.push_back(e.path().filename());
    if (!names.empty()) {
      std::error_code ec;
      fs::create_directory(old, ec);
      if (ec) ok = false, error = old.string() + ": cannot create: " + ec.message();
      for (const fs::path& n : names) {
        if (!ok || !(ok = move(out_ / n, old / n))) break;
        moved_old.push_back(n);
      }
    }
  }
  std::vector<fs::path> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  for (const fs::path& n : names) {
    if (!ok) break;
    std::error_code ec;
    // OUT was empty (or moved aside) a moment ago; what appeared since is not this run's to replace
    // (rename would silently replace a file of that name).
    if (fs::exists(fs::symlink_status(out_ / n, ec))) {
      ok = false;
      error = (out_ / n).string() + ": appeared in the output directory during the conversion; not replaced";
      break;
    }
    if (!(ok = move(dir_ / n, out_ / n))) break;
    moved_new.push_back(n);
  }
  if (!ok) {
    std::string stuck;
    std::error_code ec;
    for (auto n = moved_new.rbegin(); n != moved_new.rend(); ++n) {
      fs::rename(out_ / *n, dir_ / *n, ec);
      if (ec) stuck.append(" ").append((out_ / *n).string());
    }
    for (auto n = moved_old.rbegin(); n != moved_old.rend(); ++n) {
      fs::rename(old / *n, out_ / *n, ec);
      if (ec) stuck.append(" ").append((old / *n).string()).append(" (a previous file)");
    }
    if (stuck.empty()) fs::remove(old, ec);
    fail(error + (stuck.empty() ? "; nothing was published (the output directory is as it was before this run)"
                                : "; rolling back failed too, left behind:" + stuck));
  }
  // The renames themselves on disk before success is reported.
  if (const int fd = ::open(out_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  published_ = true;
  std::error_code ec;
  fs::remove(dir_, ec);
  if (!moved_old.empty()) {
    fs::remove_all(old, ec);
    if (ec) fmt::print(stderr, "mxq: warning: the previous contents of {} could not all be removed from {}: {}\n",
                       out_.string(), old.string(), ec.message());
  }
}

// ---- interruption ---------------------------------------------------------------------------------------
namespace {
volatile std::sig_atomic_t g_signal = 0;
void record_signal(int sig) { g_signal = sig; }  // async-signal-safe: one store
}  // namespace

Interrupted::Interrupted(int sig) : std::runtime_error(std::string("interrupted by ") + ::strsignal(sig)), sig_(sig) {}

void install_interrupt_handlers() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;  // nohup, `cmd &`: stay ignored
    struct sigaction sa {};
    sa.sa_handler = record_signal;
    ::sigemptyset(&sa.sa_mask);
    // A second signal: the default action, at once. NOTE: no SA_RESTART: a system call blocked when
    // the signal comes (an open or read that waits) returns EINTR and fails, so the signal is seen;
    // with SA_RESTART a blocking open restarted and the first SIGTERM did nothing. (Reads and writes
    // of regular files are not interrupted; merge's copy loop checks interrupt_signal() per chunk.)
    sa.sa_flags = SA_RESETHAND;
    ::sigaction(sig, &sa, nullptr);
  }
}

int interrupt_signal() { return g_signal; }

void check_interrupted() {
  if (const int sig = g_signal) throw Interrupted(sig);
}

}  // namespace mxq::cli
