// The shm transport's segments in /dev/shm: creating this rank's, mapping a peer's from its
// published record, and cleaning up after ranks that died before unlinking theirs.
//
// A segment is unlinked by its creator once every peer mapped it, so nothing is left when a job
// runs to the end or fails after connect. A rank killed during connect cannot: a survivor that
// sees its creator gone unlinks it (UnlinkOrphan), and the next connect on the host sweeps what
// is left (SweepOrphanSegments). Names carry the creator's uid, pid namespace and pid
// ("/shardsync-<uid>-<pidns>-<pid>-<rank>-<nonce>"), so only this user's segments of this pid
// namespace whose creator has exited are touched (a reused pid only delays the cleanup).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/status.h"

namespace shardsync::shm {

// This rank's segment: rings for every rank in `senders` (mapped read / write).
struct OwnSegment {
  std::string name;
  char* map = nullptr;
  size_t bytes = 0;
};
// Creates, sizes (the pages reserved: a full /dev/shm fails here, not with SIGBUS later) and
// initialises the segment. On failure nothing is left behind.
Result<OwnSegment> CreateSegment(int rank, const std::vector<int>& senders);

// A peer's connection record, "name pid rings rank...": every field checked (it comes from
// another process). `index` is this rank's ring in the peer's segment.
struct PeerRecord {
  std::string name;
  pid_t pid = 0;
  uint64_t rings = 0;
  uint64_t index = 0;
};
Result<PeerRecord> ParsePeerRecord(const std::string& record, int peer, int self);
std::string FormatRecord(const std::string& name, pid_t pid, const std::vector<int>& senders);
// Maps a peer's segment and checks its header against the record; returns the mapping.
Result<char*> MapPeerSegment(const PeerRecord& rec, int peer, size_t* bytes);

// "/shardsync-<uid>-<pidns>-<pid>-": the start of every segment name this process creates. Other
// layers' segments (cuda_ipc mailboxes) use it too, so SweepOrphanSegments reclaims theirs.
std::string OwnSegmentPrefix();
// The creator's pid when `name` is a segment of this user's shardsync in this pid namespace.
std::optional<pid_t> SegmentCreator(std::string_view name);
// Unlinks `name` when it is such a segment and its creator has exited; true if it did.
bool UnlinkOrphan(const std::string& name);
// UnlinkOrphan for every such segment in /dev/shm; returns how many went.
int SweepOrphanSegments();

}  // namespace shardsync::shm
