// What every part of a sync session shares (session.cc composes the parts): the rank's identity,
// its plan, the store, the transport and the packer; the control message and tags of the host
// path; tracing. Fixed once the session is created, but for the job it joins at Connect.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/trace.h"
#include "shardsync/session.h"
#include "sync/tags.h"
#include "sync/watched_store.h"

namespace shardsync::sync_internal {

using Clock = std::chrono::steady_clock;

struct SessionContext {
  SessionContext(PlanInputs inputs, int r, SyncRank w, RankPlan p, StoreClient& s, Transport& t,
                 SessionOptions o, LaunchId l)
      : in(std::move(inputs)),
        rank(r),
        who(w),
        plan(std::move(p)),
        watched(s),
        store(watched),
        tx(t),
        opt(std::move(o)),
        launch(std::move(l)),
        inventory(HfTensorInventory(in.model)),
        world(SyncWorldSize(in)) {
    if (opt.packer == nullptr) {
      own_packer = MakeCpuPacker();
      packer = own_packer.get();
    } else {
      packer = opt.packer;
    }
  }
  SessionContext(const SessionContext&) = delete;
  SessionContext& operator=(const SessionContext&) = delete;

  // Store key `k` in this job's namespace, "<prefix><job nonce>/k" (identity.h); valid once
  // Connect joined the job.
  std::string Key(const std::string& k) const { return root + k; }
  // Block-FP8 models (ModelSpec::quant): `plan`'s ops carry the codec's encodings and its
  // quantization tables, which the fp8_* parts replay.
  bool quantized() const { return in.model.quant.has_value(); }
  // The built-in CPU packer (host memory), not one passed in SessionOptions.
  bool builtin_packer() const { return packer == own_packer.get(); }

  const PlanInputs in;
  const int rank;
  const SyncRank who;
  const RankPlan plan;
  // The caller's store; `store` reaches it through `watched`, which watches the peers at Connect.
  WatchedStore watched;
  StoreClient& store;
  Transport& tx;
  const SessionOptions opt;
  const LaunchId launch;  // this rank's launch (SessionOptions::job_id or the environment)
  const std::vector<HfTensor> inventory;
  const int world;
  std::unique_ptr<Packer> own_packer;
  Packer* packer = nullptr;
  // The job this rank joined (JobIdentity::Join): its key namespace and its nonce, which control
  // messages and the verdict board carry.
  std::string root;
  uint64_t job_tag = 0;
};

inline constexpr uint32_t kControlMagic = 0x53534331;  // "SSC1"

// Sent after a bucket's puts were flushed: the receiver checksums what landed and compares.
struct Control {
  uint32_t magic = kControlMagic;
  uint32_t bucket = 0;
  uint64_t version = 0;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  uint64_t job = 0;  // SessionContext::job_tag: a message of another job is refused on receipt
  // The delta encoding (delta_path.h): the form the bucket travelled in (DeltaKind: 0 whole), why
  // (DeltaReason), and its bytes on the wire (the bucket's when whole).
  uint32_t form = 0;
  uint32_t reason = 0;
  uint64_t payload = 0;
};
static_assert(sizeof(Control) == 56);

// A bucket's control message as every receiver checks it before its checksum (host_recv.cc):
// magic and bucket, the job it comes from, the version, the byte count; `where` names it.
Status CheckControl(const Control& c, const std::string& where, int bucket, uint64_t job_tag,
                    uint64_t version, int64_t bytes);

// Tags (MakeTag): the version keeps messages of an aborted sync from being taken for a later
// sync's.
inline uint64_t ControlTag(uint64_t version, uint32_t bucket) {
  return MakeTag(true, version, bucket);
}
inline uint64_t DataTag(uint64_t version, uint64_t seq) { return MakeTag(false, version, seq); }

// SHARDSYNC_TRACE=1 (common/trace.h): the session's steps on stderr. The text is built only when
// tracing is on: these calls sit on every sync's path.
template <typename Text>
void Trace(int rank, uint64_t version, const Text& text) {
  if (!trace::On()) return;
  trace::Line("sync rank %d v%llu: %s", rank, static_cast<unsigned long long>(version),
              std::string(text()).c_str());
}

inline std::string Hex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace shardsync::sync_internal
