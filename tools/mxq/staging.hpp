#pragma once
// Where a conversion writes: OUT/.mxq-staging-<pid>/, published into OUT only when the whole
// checkpoint is there, and removed on any failure or interruption (SIGINT, SIGTERM, SIGHUP). A run
// that could not clean up (SIGKILL, a crash, a power cut) leaves its staging directory; the next run
// writing into the same OUT removes it once its process is gone, and says so.
#include <csignal>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace mxq::cli {

// What OUT may be: a new or an empty directory (stale staging directories of dead runs do not count),
// or with --overwrite a directory whose contents the converted checkpoint replaces; never the input's
// own directory (by path or inode, symlinks resolved) nor a directory that holds the input.
void check_output(const std::filesystem::path& in, const std::filesystem::path& out, bool overwrite);

// Removes OUT/.mxq-staging-<pid> directories (that exact name, pid all digits) whose process is gone:
// kill(pid, 0) fails with ESRCH and no process holds the directory's lock (a run in another PID
// namespace keeps it). Says so on stderr, one line per directory. Returns how many it removed.
int remove_stale_staging(const std::filesystem::path& out);

class Staging {
 public:
  Staging(const std::filesystem::path& out, bool overwrite);
  ~Staging();  // not published: the staging directory is removed (and OUT, if this run created it)
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  const std::filesystem::path& dir() const { return dir_; }
  // Moves everything staged into OUT (with overwrite: after moving OUT's old contents aside). A
  // rename that fails rolls back every move made, leaving OUT as it was, and throws naming the file.
  void publish();

 private:
  std::filesystem::path out_, dir_;
  int lock_fd_ = -1;
  bool overwrite_ = false, created_ = false, published_ = false;
};

// ---- interruption: SIGINT, SIGTERM and SIGHUP become an exception at the next tensor ------------------
// The handler only records the signal (async-signal-safe); the conversion loops call
// check_interrupted(), the stack unwinds through ~Staging, and main() re-raises the signal with its
// default action so that the exit status says what happened. A second signal kills at once.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int sig);
  int signal() const { return sig_; }

 private:
  int sig_;
};
void install_interrupt_handlers();
int interrupt_signal();   // the signal received, 0 when none
void check_interrupted();  // throws Interrupted once a signal was received

}  // namespace mxq::cli
