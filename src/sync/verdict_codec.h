// A rank's verdict of one sync as its store value (verdict.cc): one short line, written and read
// on every sync's critical path (JSON cost 10-20 us a side on the H200 machine).
#pragma once

#include <string>
#include <string_view>

#include "shardsync/session.h"

namespace shardsync::sync_internal {

// Decode fails with DataLoss naming `rank` on anything malformed or naming another rank.
std::string EncodeVerdict(const RankSyncStats& s);
Result<RankSyncStats> DecodeVerdict(std::string_view text, int rank);

}  // namespace shardsync::sync_internal
