// `shardsync store --bind ADDR:PORT`: serves the rendezvous store until SIGINT / SIGTERM.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "command.h"
#include "shardsync/store.h"

namespace shardsync::cli {
namespace {

int RunStore(const std::string& bind, const std::string& token_flag, bool json) {
  auto hp = ParseHostPort(bind, "--bind");
  if (!hp.ok()) return ReportError(hp.status());
  std::string token = token_flag;
  if (token.empty()) {
    const char* env = std::getenv("SHARDSYNC_TOKEN");
    if (env != nullptr) token = env;
  }
  if (token.empty()) {
    return ReportError(InvalidArgumentError(
        "store token missing: pass --token or set SHARDSYNC_TOKEN (the job's shared secret)"));
  }
  // Block the signals before the server thread starts so only sigwait below receives them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  auto server = StoreServer::Start(hp->first, hp->second, token);
  if (!server.ok()) return ReportError(Status(server.status()).Annotate("--bind"));
  // The one stdout line: launchers read the bound address (useful with port 0).
  if (json) {
    nlohmann::json j = {{"address", (*server)->address()}, {"port", (*server)->port()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s\n", (*server)->address().c_str());
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
                    sub->add_option("--bind", *bind,
                                    "ADDR:PORT to listen on (port 0 picks a free one)")
                        ->capture_default_str();
                    sub->add_option("--token", *token,
                                    "job token clients must present (default: $SHARDSYNC_TOKEN; "
                                    "prefer the variable, flags show in ps)");
                    auto json = std::make_shared<bool>(false);
                    sub->add_flag("--json", *json,
                                  "Print the bound address as {\"address\", \"port\"}");
                    return [=] { return RunStore(*bind, *token, *json); };
                  }});

}  // namespace
}  // namespace shardsync::cli
