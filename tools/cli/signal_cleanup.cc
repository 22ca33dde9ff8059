// Temporary directories removed on SIGINT / SIGTERM (command.h, TempDir). The handler only
// writes the signal number to a pipe (async-signal-safe); a watcher thread removes the
// directories, then restores the default action and re-raises, so the command still dies of
// the signal (exit status 128 + N in a shell) and its child ranks follow (PR_SET_PDEATHSIG).
// sigaction rather than a blocked mask and sigwait: the ranks this process execs inherit a
// blocked mask, but not a handler.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "command.h"

namespace shardsync::cli {
namespace {

int g_pipe_w = -1;  // written by the handler

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  if (write(g_pipe_w, &b, 1) < 0) {
  }
  errno = saved;
}

struct Cleanup {
  std::mutex mu;
  std::set<std::string> paths;
  bool installed = false;

  void Install() {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return;
    g_pipe_w = p[1];
    std::thread([r = p[0], this] {
      unsigned char sig = 0;
      while (read(r, &sig, 1) < 0 && errno == EINTR) {
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        for (const std::string& path : paths) {
          // A rank may still be writing into it: retry until the directory is gone.
          for (int i = 0; i < 20; ++i) {
            std::error_code ec;
            std::filesystem::remove_all(path, ec);
            if (!std::filesystem::exists(path, ec)) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        paths.clear();
      }
      signal(sig, SIG_DFL);
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, sig);
      pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
      raise(sig);
      _exit(128 + sig);
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    installed = true;
  }
};

Cleanup& Get() {
  static Cleanup* r = new Cleanup();  // never destroyed: the watcher may run at exit
  return *r;
}

}  // namespace

void RemoveOnSignal(const std::string& path) {
  Cleanup& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.installed) r.Install();
  r.paths.insert(path);
}

void ForgetOnSignal(const std::string& path) {
  Cleanup& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  r.paths.erase(path);
}

}  // namespace shardsync::cli
