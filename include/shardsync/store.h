// Rendezvous store: a token-authenticated TCP key-value store for addresses, memory keys and ids.
// Served by rank 0 (StoreServer in-process) or by `shardsync store --bind ADDR:PORT`.
// Launch contract (torchrun / SLURM / Ray compatible): SHARDSYNC_STORE=host:port, RANK,
// WORLD_SIZE, SHARDSYNC_TOKEN.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsync/status.h"

namespace shardsync {

using Millis = std::chrono::milliseconds;

class StoreServer {
 public:
  virtual ~StoreServer() = default;
  // Binds host:port (port 0 picks a free one) and serves until Stop or destruction.
  static Result<std::unique_ptr<StoreServer>> Start(const std::string& host, int port,
                                                    const std::string& token);
  virtual int port() const = 0;
  virtual std::string address() const = 0;  // "host:port"
  virtual void Stop() = 0;
};

// Thread-compatible (one thread at a time per client); use one client per thread.
class StoreClient {
 public:
  virtual ~StoreClient() = default;
  // Connects to "host:port" and presents the token; PermissionDenied if the server refuses it.
  static Result<std::unique_ptr<StoreClient>> Connect(const std::string& address,
                                                      const std::string& token, Millis timeout);
  virtual Status Set(const std::string& key, std::string_view value) = 0;
  // Blocks until the key exists (DeadlineExceeded after timeout).
  virtual Result<std::string> Get(const std::string& key, Millis timeout) = 0;
  // Atomically adds delta to an integer key (created at 0); returns the new value.
  virtual Result<int64_t> Add(const std::string& key, int64_t delta) = 0;
  virtual Status Wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  // Blocks until every key exists and returns their values in order: one round trip where a
  // Get per key would take one each (DeadlineExceeded naming a missing key after timeout).
  virtual Result<std::vector<std::string>> GetMany(const std::vector<std::string>& keys,
                                                   Millis timeout) = 0;
  // Pipelined forms, one round trip each: several Sets; a Set, then GetMany of `keys`.
  virtual Status SetMany(const std::vector<std::pair<std::string, std::string>>& kvs) = 0;
  virtual Result<std::vector<std::string>> SetThenGetMany(const std::string& key,
                                                          std::string_view value,
                                                          const std::vector<std::string>& keys,
                                                          Millis timeout) = 0;
  // Every one of `world` participants calls Barrier(name, world); returns when all arrived.
  virtual Status Barrier(const std::string& name, int world, Millis timeout) = 0;
};

// Splits "host:port" ("[v6addr]:port" also accepted); InvalidArgument naming `what` otherwise.
Result<std::pair<std::string, int>> ParseHostPort(std::string_view address,
                                                  std::string_view what = "address");

// What a launched process reads from its environment (torchrun / SLURM / Ray compatible).
struct LaunchEnv {
  std::string store_address;  // SHARDSYNC_STORE, "host:port"
  int rank = 0;               // RANK, else SLURM_PROCID
  int world_size = 1;         // WORLD_SIZE, else SLURM_NTASKS
  std::string token;          // SHARDSYNC_TOKEN
};

// Reads the launch contract; errors name the missing or malformed variable.
Result<LaunchEnv> LaunchEnvFromEnvironment();
// Same, with an injectable lookup (tests).
Result<LaunchEnv> LaunchEnvFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);

}  // namespace shardsync
