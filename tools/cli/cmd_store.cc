// `shardsync store --bind ADDR:PORT`: serves the rendezvous store until SIGINT / SIGTERM.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shardsync/settings.h"
#include "shardsync/store.h"

namespace shardsync::cli {
namespace {

// Writes the token to a new file only this user can read; an existing path (or a symlink
// planted there) is refused rather than overwritten.
Status WriteTokenFile(const std::string& path, const std::string& token) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    return err == EEXIST ? InvalidArgumentError("--token-file '" + path + "': already exists")
                         : InvalidArgumentError("--token-file '" + path +
                                                "': cannot create: " + std::strerror(err));
  }
  const std::string line = token + "\n";
  const bool ok = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  const bool closed = close(fd) == 0;
  if (!ok || !closed) {
    unlink(path.c_str());
    return UnavailableError("--token-file '" + path + "': write failed");
  }
  return OkStatus();
}

int RunStore(const std::string& bind, const std::string& token_flag, const std::string& token_file,
             bool json) {
  auto hp = ParseHostPort(bind, "--bind");
  if (!hp.ok()) return ReportError(hp.status());
  std::string token = token_flag;
  const char* source = "--token";
  if (token.empty()) {
    auto env = TextKnob("SHARDSYNC_TOKEN");  // text: no value is malformed
    if (!env.ok()) return ReportError(env.status());
    token = *env;
    source = "SHARDSYNC_TOKEN";
  }
  const bool generated = token.empty();
  if (generated) {
    auto t = GenerateStoreToken();
    if (!t.ok()) return ReportError(t.status());
    token = *t;
  } else if (Status s = CheckStoreToken(token, source); !s.ok()) {
    return ReportError(s);
  }
  if (!token_file.empty()) {
    if (Status s = WriteTokenFile(token_file, token); !s.ok()) return ReportError(s);
  }
  // Block the signals before the server thread starts so only sigwait below receives them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  auto server = StoreServer::Start(hp->first, hp->second, token);
  if (!server.ok()) {
    if (!token_file.empty()) unlink(token_file.c_str());
    return ReportError(Status(server.status()).Annotate("--bind"));
  }
  // Stdout: the bound address (launchers read it; useful with port 0), then a generated token
  // unless it went to --token-file; with --json one object holding both.
  const bool print_token = generated && token_file.empty();
  if (json) {
    nlohmann::json j = {{"address", (*server)->address()}, {"port", (*server)->port()}};
    if (print_token) j["token"] = token;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s\n", (*server)->address().c_str());
    if (print_token) std::printf("SHARDSYNC_TOKEN=%s\n", token.c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  std::fprintf(stderr, "shardsync store: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->Stop();
  return kExitOk;
}

Registration reg({"store", [](CLI::App& app) {
                    auto* sub = app.add_subcommand(
                        "store",
                        "Serve the rendezvous store (token-authenticated TCP key-value store) "
                        "until SIGINT/SIGTERM; prints the bound host:port");
                    auto bind = std::make_shared<std::string>("127.0.0.1:0");
                    auto token = std::make_shared<std::string>();
                    auto token_file = std::make_shared<std::string>();
                    sub->add_option("--bind", *bind,
                                    "ADDR:PORT to listen on (port 0 picks a free one)")
                        ->capture_default_str();
                    sub->add_option("--token", *token,
                                    "job token clients must present, at least 16 characters "
                                    "(default: $SHARDSYNC_TOKEN, else a generated one; prefer "
                                    "the variable, flags show in ps)");
                    sub->add_option("--token-file", *token_file,
                                    "write the token to this new file (mode 0600) instead of "
                                    "printing a generated one");
                    auto json = std::make_shared<bool>(false);
                    sub->add_flag("--json", *json,
                                  "Print {\"address\", \"port\"[, \"token\"]} as one JSON line");
                    return [=] { return RunStore(*bind, *token, *token_file, *json); };
                  }});

}  // namespace
}  // namespace shardsync::cli
