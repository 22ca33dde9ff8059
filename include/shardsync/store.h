// Rendezvous store: a token-authenticated TCP key-value store for addresses, memory keys and ids.
// Served by rank 0 (StoreServer in-process) or by `shardsync store --bind ADDR:PORT`.
// Launch contract (torchrun / SLURM / Ray compatible): SHARDSYNC_STORE=host:port, RANK,
// WORLD_SIZE, SHARDSYNC_TOKEN. What the token protects and what it does not: docs/security.md.
//
// Limits the server holds every client to: frames of 64 MiB (4 KiB before authentication), a
// reply above 64 MiB is refused (OutOfRange) before it is built, 1 GiB held for requests in all
// (keys, values, dead keys' reasons, parked and buffered requests, unread replies: OutOfRange;
// StoreServerOptions::max_bytes), keys of at most 4 KiB, connections capped from the process's
// descriptor limit (half of them may be unauthenticated; the oldest is dropped past that), a wrong
// token answered after 0.5 s.
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

// Shortest token a store accepts (servers refuse to start with less, clients refuse to send it).
inline constexpr size_t kMinStoreTokenChars = 16;
// InvalidArgument naming `what` (the flag or variable) when `token` is too short.
Status CheckStoreToken(std::string_view token, std::string_view what);
// A fresh random token (32 hex characters from the kernel's CSPRNG).
Result<std::string> GenerateStoreToken();

struct StoreServerOptions {
  // Every byte the server holds for requests counts against this (keys, values, dead keys'
  // reasons, parked requests, buffered requests, unread replies); a request over it gets an
  // OutOfRange reply. At least 1 MiB.
  size_t max_bytes = size_t{1} << 30;
};

class StoreServer {
 public:
  virtual ~StoreServer() = default;
  // Binds host:port (port 0 picks a free one) and serves until Stop or destruction.
  // InvalidArgument when `token` is shorter than kMinStoreTokenChars.
  static Result<std::unique_ptr<StoreServer>> Start(const std::string& host, int port,
                                                    const std::string& token);
  static Result<std::unique_ptr<StoreServer>> Start(const std::string& host, int port,
                                                    const std::string& token,
                                                    const StoreServerOptions& options);
  virtual int port() const = 0;
  virtual std::string address() const = 0;  // "host:port"
  virtual void Stop() = 0;
};

// Thread-compatible (one thread at a time per client); use one client per thread.
class StoreClient {
 public:
  virtual ~StoreClient() = default;
  // Connects to "host:port" and presents the token; PermissionDenied if the server refuses it
  // (after the server's delay), InvalidArgument for a token shorter than kMinStoreTokenChars.
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

  // Deletes every key starting with `prefix` (non-empty), dead keys included; returns how many
  // live keys went. For a job's per-version keys once every rank passed that version.
  virtual Result<int64_t> DeletePrefix(const std::string& prefix) = 0;
  // DeletePrefix of every prefix in one round trip (a session drops many finished versions at
  // once); the first error if one failed.
  virtual Status DeletePrefixes(const std::vector<std::string>& prefixes) = 0;

  // Ephemeral keys (etcd leases, ZooKeeper ephemeral nodes): the key is bound to this client's
  // connection. When that connection closes (the process exited or was killed, its host stopped
  // answering TCP keepalive within ~5 s, or the client was destroyed) the key is removed and
  // recorded dead with the reason; setting it again (any connection) revives it. A key another
  // live connection holds is refused (FailedPrecondition), whoever writes it.
  //
  // Dead keys: Get, GetMany, Wait and SetThenGetMany naming a dead key fail at once with
  // Unavailable naming the key and why it died, and requests already waiting on it fail the
  // moment it dies. So a rank that waits for peers' keys and names, among them, each peer's
  // ephemeral liveness key learns of a dead peer immediately instead of at its timeout.
  virtual Status SetEphemeral(const std::string& key, std::string_view value) = 0;
  // Sets `key` only if it is absent (or dead) and returns the value it holds afterwards: `value`
  // when this call set it, the existing value otherwise (a claim: compare with what you sent).
  // `ephemeral` binds a key this call sets to the connection.
  virtual Result<std::string> SetIfAbsent(const std::string& key, std::string_view value,
                                          bool ephemeral = false) = 0;
  // Removes `key` (present or not) and records it dead with `reason`, as if its owner's
  // connection had closed: for a launcher that saw the process exit.
  virtual Status MarkDead(const std::string& key, std::string_view reason) = 0;
};

// Splits "host:port" ("[v6addr]:port" also accepted); InvalidArgument naming `what` otherwise.
Result<std::pair<std::string, int>> ParseHostPort(std::string_view address,
                                                  std::string_view what = "address");

// The launch a rank belongs to: ranks started by one launch share it, so a rank never joins a
// job of another launch that uses the same store and key prefix (job identity, SessionOptions
// ::job_id, docs/security.md). From the environment, the first that is set: SHARDSYNC_JOB_ID
// (`shardsync run` / `demo` / `bench` give their ranks a fresh one), TORCHELASTIC_RUN_ID
// (torchrun's --rdzv-id; its default "none" counts as unset), SLURM_JOB_ID with SLURM_STEP_ID,
// RAY_JOB_ID (Ray's raylet gives it to every worker process it starts).
//
// An id names a launch but proves nothing (anyone can pass it). The launch's secret
// (SHARDSYNC_JOB_SECRET, SessionOptions::job_secret; the local launcher draws one per job) is
// what a rank proves to claim a slot of the job: a process without it is refused.
struct LaunchId {
  std::string id;      // "" when none is set
  std::string source;  // the variable(s) it came from, for messages ("" when none)
  std::string secret;  // the launch's secret, "" when none (never printed)
  // True when the rank can say which launch it belongs to.
  bool any() const { return !id.empty() || !secret.empty(); }
};
// Shortest and longest launch secret accepted (GenerateJobSecret gives 32 hex characters).
inline constexpr size_t kMinJobSecretChars = 16;
inline constexpr size_t kMaxJobSecretChars = 256;
// InvalidArgument naming `what` when `secret` is too short or too long (never echoing it).
Status CheckJobSecret(std::string_view secret, std::string_view what);
// A fresh launch secret: 32 hex characters (128 bits) from the kernel's CSPRNG.
Result<std::string> GenerateJobSecret();
// Longest job id accepted; ids are printable ASCII without spaces (they travel in store values).
inline constexpr size_t kMaxJobIdChars = 128;
// InvalidArgument naming `what` when `id` is too long or holds a space or a control character.
Status CheckJobId(std::string_view id, std::string_view what);

// What a launched process reads from its environment (torchrun / SLURM / Ray compatible).
struct LaunchEnv {
  std::string store_address;  // SHARDSYNC_STORE, "host:port"
  int rank = 0;               // RANK, else SLURM_PROCID
  int world_size = 1;         // WORLD_SIZE, else SLURM_NTASKS
  std::string token;          // SHARDSYNC_TOKEN
  LaunchId job_id;            // LaunchIdFromLookup
};

// Reads the launch contract; errors name the missing or malformed variable.
Result<LaunchEnv> LaunchEnvFromEnvironment();
// Same, with an injectable lookup (tests).
Result<LaunchEnv> LaunchEnvFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);
// The launch id alone (it needs none of the other variables); InvalidArgument naming the variable
// when its value fails CheckJobId.
Result<LaunchId> LaunchIdFromLookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);
Result<LaunchId> LaunchIdFromEnvironment();

}  // namespace shardsync
