// Test helper (issue 26): the store served by a forked child under descriptor / memory limits.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shardsync/store.h"

namespace shardsync::testing {

inline constexpr char kForkedStoreToken[] = "abuse-test-token-0123456789";

struct StoreLimits {
  rlim_t nofile = 0;    // RLIMIT_NOFILE of the store's process (0: inherited)
  rlim_t as_bytes = 0;  // RLIMIT_AS (0: inherited)
  // After the server started, hold descriptors until only this many are free (-1: none held).
  int free_fds = -1;
  size_t max_bytes = 0;  // StoreServerOptions::max_bytes (0: the default quota)
};

// A store served by a child process (so a test can cap its descriptors or memory and measure its
// CPU time and log apart from the test's own), stopped when this object goes.
class ForkedStore {
 public:
  explicit ForkedStore(const StoreLimits& lim, const std::string& token = kForkedStoreToken) {
    char tmpl[] = "/tmp/shardsync-store-log-XXXXXX";
    const int log_fd = mkstemp(tmpl);
    log_path_ = tmpl;
    int port_pipe[2], ctl_pipe[2];
    if (log_fd < 0 || pipe(port_pipe) != 0 || pipe(ctl_pipe) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(port_pipe[0]);
      close(ctl_pipe[1]);
      dup2(log_fd, 2);
      if (lim.nofile > 0) {
        rlimit r{lim.nofile, lim.nofile};
        setrlimit(RLIMIT_NOFILE, &r);
      }
      if (lim.as_bytes > 0) {
        rlimit r{lim.as_bytes, lim.as_bytes};
        setrlimit(RLIMIT_AS, &r);
      }
      StoreServerOptions opt;
      if (lim.max_bytes > 0) opt.max_bytes = lim.max_bytes;
      auto s = StoreServer::Start("127.0.0.1", 0, token, opt);
      if (!s.ok()) _exit(3);
      if (lim.free_fds >= 0) {
        std::vector<int> held;
        for (int fd; (fd = open("/dev/null", O_RDONLY)) >= 0;) held.push_back(fd);
        for (int i = 0; i < lim.free_fds && !held.empty(); ++i) {
          close(held.back());
          held.pop_back();
        }
      }
      const int port = (*s)->port();
      if (write(port_pipe[1], &port, sizeof(port)) != sizeof(port)) _exit(4);
      char b;
      while (read(ctl_pipe[0], &b, 1) < 0 && errno == EINTR) {
      }
      _exit(0);  // the parent closed the control pipe
    }
    close(log_fd);
    close(port_pipe[1]);
    close(ctl_pipe[0]);
    ctl_ = ctl_pipe[1];
    int port = 0;
    const bool got = read(port_pipe[0], &port, sizeof(port)) == sizeof(port);
    close(port_pipe[0]);
    if (pid_ > 0 && got) address_ = "127.0.0.1:" + std::to_string(port), port_ = port;
  }
  ~ForkedStore() {
    if (ctl_ >= 0) close(ctl_);
    if (pid_ > 0) {
      for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (i == 99) {
          kill(pid_, SIGKILL);
          waitpid(pid_, nullptr, 0);
        }
      }
    }
    unlink(log_path_.c_str());
  }
  bool ok() const { return !address_.empty(); }
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  // User + system CPU seconds the store's process used so far.
  double CpuSeconds() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/stat");
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = all.rfind(')');
    if (close == std::string::npos) return -1;
    std::istringstream in(all.substr(close + 2));
    std::string field;
    unsigned long long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && in >> field; ++i) {
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
    }
    return double(utime + stime) / sysconf(_SC_CLK_TCK);
  }
  // The store process's peak resident memory (VmHWM), bytes.
  size_t PeakRssBytes() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
    for (std::string line; std::getline(f, line);) {
      if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
  }
  size_t LogBytes() const {
    struct stat st {};
    return stat(log_path_.c_str(), &st) == 0 ? static_cast<size_t>(st.st_size) : 0;
  }

 private:
  pid_t pid_ = -1;
  int ctl_ = -1;
  int port_ = 0;
  std::string address_;
  std::string log_path_;
};

// A TCP connection to the store that never says hello; -1 when refused.
inline int RawConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace shardsync::testing
