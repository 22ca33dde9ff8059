// A rank's bindings: the source shards a trainer rank hands over, the parameters an engine rank
// receives into, their checks against the plan, and the pack regions of a bucket over them.
// PeerShapes: the parameter shapes of the engine ranks a trainer sends to.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardsync/shard_map.h"
#include "sync/context.h"

namespace shardsync::sync_internal {

class Bindings {
 public:
  explicit Bindings(const SessionContext& ctx);
  // Engine ranks: this rank's parameters from the shard map.
  Status Init();

  Status BindSource(const SourceBinding& b);
  Status BindDest(const DestBinding& b);
  // Every binding the plan needs is there and holds what the plan reads / writes.
  Status Check() const;

  // The engine parameters this rank binds (empty for trainer ranks).
  const std::vector<EngineParam>& expected() const { return shards_.params; }
  // The trainer map of this rank (empty for engine ranks).
  const std::vector<TrainerParam>& expected_sources() const { return trainer_.params; }
  // The binding of HF tensor `tensor` (trainer) / of parameter `param` (engine).
  const SourceBinding& source(int tensor) const { return sources_.at(tensor); }
  bool has_source(int tensor) const { return sources_.count(tensor) > 0; }
  // Where a sender reads op `i` of message `m`: the bound memory, its dtype and row-major shape,
  // the op's region inside it, and `id` naming that memory for direct transfers (WireRun::tensor:
  // the HF tensor, or for Megatron senders the local parameter).
  struct OpSource {
    const void* data = nullptr;
    DType dtype = DType::kF32;
    Shape shape;
    Region region;
    int32_t id = 0;
    MemKind mem = MemKind::kHost;
  };
  OpSource SourceOf(const Message& m, int i) const;
  // Megatron senders: local source `ls` of an op reading HF region `src` for sync rank `dst` is a
  // bound local parameter holding that region (Check's test, shared with FP8 plans).
  Status CheckLocalSource(const LocalSource& ls, const Region& src, int dst) const;
  bool megatron_sender() const { return ctx_.who.is_trainer && trainer_.megatron; }
  // The bound memory of a direct transfer's source `id` (WireRun::tensor).
  const void* SourceData(int32_t id) const;
  // Shape of local parameter `param` of the sender of message `m` (Megatron messages: the
  // regions of Message::local sit in it), for BucketTransfers on both ends; null when unknown.
  const Shape* LocalShape(const Message& m, int param) const;
  const DestBinding& dest(int param) const { return dests_[param]; }
  // Staged commit (staging.h): parameter `param` lands at `data` (its staging, same memory kind)
  // instead of where it was bound; before Connect registers receive memory.
  void RedirectDest(int param, void* data) { dests_[param].data = data; }
  const std::vector<DestBinding>& dests() const { return dests_; }
  // The memory every binding of this rank lives in (-1: none bound, or a mix).
  int BoundMem() const;

  // PackRegions of bucket `b` of message `m` over the sender's sources / the receiver's
  // parameters, wire offsets from the bucket start.
  std::vector<PackRegion> SourceRegions(const Message& m, const Bucket& b) const;
  std::vector<PackRegion> LandedRegions(const Message& m, const Bucket& b) const;

  // DataLoss naming the message, the bucket and (up to 8 of) the parameters it lands in.
  Status MismatchError(const Message& m, int bucket, uint64_t version, uint64_t sent,
                       uint64_t got) const;

 private:
  Status BindLocal(const SourceBinding& b);
  // ls: the op's local source (Megatron senders), else null.
  OpSource SourceFor(int32_t tensor, const Region& src, const LocalSource* ls) const;

  const SessionContext& ctx_;
  std::map<std::string, size_t> tensor_index_;
  // Trainer side: by HF tensor index.
  std::map<int, SourceBinding> sources_;
  // Trainer side: this rank's trainer map; Megatron senders bind its parameters (locals_, by
  // parameter index), FSDP-like ones may name them too (stored in sources_).
  TrainerRankParams trainer_;
  std::map<std::pair<int, std::string>, size_t> local_index_;  // (chunk, name) -> parameter
  std::vector<SourceBinding> locals_;
  std::vector<char> local_bound_;
  // Engine side: local parameter shapes of the Megatron trainer ranks this rank receives from.
  std::map<int, std::vector<Shape>> sender_shapes_;
  // Engine side.
  EngineRankShards shards_;
  std::map<std::string, size_t> param_index_;
  std::vector<DestBinding> dests_;
};

class PeerShapes {
 public:
  explicit PeerShapes(const SessionContext& ctx) : ctx_(ctx) {}
  // Shape of parameter `param` of engine sync rank `dst` (cached per destination; empty when
  // there is no such parameter).
  const Shape& Get(int dst, int param);
  // How many parameters engine sync rank `dst` registers (its region ids run from its regbase;
  // a block-FP8 receiver's staging comes right after them).
  int Count(int dst);

 private:
  const SessionContext& ctx_;
  std::map<int, std::vector<Shape>> shapes_;
  std::unique_ptr<ShardMap> replica_map_;
};

}  // namespace shardsync::sync_internal
