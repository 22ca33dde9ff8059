// Verdicts of one host's ranks through POSIX shared memory. Every rank posts one verdict per sync
// and waits for every other rank's; through the store that is a round trip per rank plus the
// server's fan-out to every waiter (~75-100 us at the end of each sync on an H200 host, measured
// in docs/benchmarks.md), through shared memory it is a few cache-line transfers. A session uses
// the board only when every rank of the job opened the same segment (same host, same IPC
// namespace: checked with a nonce at Connect); otherwise verdicts go through the store.
//
// Layout: a header, then for every rank a ring of kRing entries holding its last kRing verdicts
// (in posting order, whatever the versions: callers may skip versions). Each entry is a seqlock:
// the writer marks it busy, writes the text, then publishes the version; a reader looks for the
// entry of its version and keeps the text only when the version read before and after the copy
// is the one it waits for.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync::sync_internal {

class VerdictBoard {
 public:
  static constexpr int kRing = 4;
  static constexpr size_t kTextBytes = 1000;  // longer texts (error messages) are cut
  static constexpr int kMaxWorld = 4096;

  // Rank 0: creates the segment `name` (replacing a stale one) for `world` ranks, stamped with
  // `nonce` and the job's identity `job` (SessionContext::job_tag). The others: open it, and fail
  // unless it carries the same nonce, job and world.
  static Result<std::unique_ptr<VerdictBoard>> Create(const std::string& name, int world,
                                                      uint64_t nonce, uint64_t job);
  static Result<std::unique_ptr<VerdictBoard>> Open(const std::string& name, int world,
                                                    uint64_t nonce, uint64_t job);
  ~VerdictBoard();
  VerdictBoard(const VerdictBoard&) = delete;
  VerdictBoard& operator=(const VerdictBoard&) = delete;

  // Removes the name (the creator, once every rank has mapped it); mappings stay valid.
  void Unlink();

  // Publishes `rank`'s verdict for `version` (version >= 1).
  void Post(int rank, uint64_t version, std::string_view text);

  struct Entry;  // one rank's verdict of one version (verdict_board.cc)
  enum class Lookup { kMissing, kFound, kOverwritten };
  // `rank`'s verdict for `version` into *text when posted; kOverwritten when that rank has since
  // posted kRing verdicts of later versions.
  Lookup Get(int rank, uint64_t version, std::string* text) const;

 private:
  VerdictBoard(std::string name, void* map, size_t len, bool owner, int world);
  Entry& At(int rank, int slot) const;

  std::string name_;
  void* map_;
  size_t len_;
  bool owner_;
  bool unlinked_ = false;
  int world_;
  std::vector<uint64_t> posts_;  // verdicts this process posted, per rank (the ring's cursor)
};

// The segment name of the board stamped `nonce` on this host (POSIX names: one leading slash, no
// other). It carries a hash of the host identity (transport.h HostIdentity), so ranks of another
// emulated node (SHARDSYNC_HOST_ID) find no board and every rank takes the store, as across
// machines: the board is a same-host path like cuda_ipc and shm.
std::string VerdictBoardName(uint64_t nonce);

}  // namespace shardsync::sync_internal
