// The host data path of a session: every message that is not a prepared pair (pairs.h), sent and
// received through the transport's two-sided or one-sided calls. The plan's encodings pick the
// implementation once, at the session's creation: HostSender / HostReceiver (host_send.h,
// host_recv.h) for copy plans, the block-FP8 codec's Fp8HostSender / Fp8HostReceiver (fp8_send.h,
// fp8_recv.h) for quantized ones, DeltaHostSender / DeltaHostReceiver (delta_send.h,
// delta_recv.h) for copy plans under the delta encoding.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "shardsync/session.h"
#include "shardsync/status.h"

namespace shardsync::sync_internal {

class Bindings;
class PeerShapes;
class PreparedPairs;

class HostSendPath {
 public:
  virtual ~HostSendPath() = default;
  // Connect, after the pairs are prepared: staging, and every host bucket's transfers (replayed
  // each sync). `regbase`: each receiver's first region id (one-sided puts).
  virtual Status Prepare(const Bindings& bindings, PeerShapes& shapes, PreparedPairs& pairs,
                         std::map<int, uint32_t> regbase) = 0;
  // Whether this rank sends any bucket on the host path.
  virtual bool has_buckets() const = 0;
  // Block FP8: whether this rank holds rows of blocks shared with other trainer ranks, whose
  // scales the holders agree on (ExchangeAmax) before any of them is quantized.
  virtual bool exchanges() const { return false; }
  virtual Status ExchangeAmax() { return OkStatus(); }
  // Sync, once receiver `dst` is ready: its ready value (HostRecvPath::ReadyValue), which under
  // the delta encoding advertises the base it holds per bucket (delta_path.h).
  virtual Status SetReceiverBases(int /*dst*/, std::string_view /*value*/) { return OkStatus(); }
  // Sync: sends every host bucket and waits until each one and its control message completed.
  virtual Status Send(RankSyncStats& st) = 0;
};

class HostRecvPath {
 public:
  virtual ~HostRecvPath() = default;
  // Connect: every bucket's transfers, as the sender cuts them (replayed each sync).
  virtual Status Prepare(const Bindings& bindings, const PreparedPairs& pairs) = 0;
  // Sync, before this rank says it is ready: the value of its ready key ("1"; under the delta
  // encoding the base it holds per bucket, recomputed over its live bytes: delta_path.h).
  virtual Result<std::string> ReadyValue() { return std::string("1"); }
  // Sync: posts every host receive, then completes, verifies and lands each bucket.
  virtual Status Receive(RankSyncStats& st) = 0;
};

}  // namespace shardsync::sync_internal
