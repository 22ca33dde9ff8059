#include "sync/bindings.h"

#include <algorithm>

#include "sync/codec.h"

namespace shardsync::sync_internal {
namespace {

// InvalidArgument for a binding in memory the session's packer does not handle.
Status UnsupportedMemory(const std::string& what, MemKind mem, const Packer& packer) {
  return InvalidArgumentError(what + ": " + (mem == MemKind::kCuda ? "device" : "host") +
                              " memory needs a packer that handles it (SessionOptions::packer;"
                              " the " +
                              std::string(packer.name()) + " packer does not)");
}

}  // namespace

Bindings::Bindings(const SessionContext& ctx) : ctx_(ctx) {
  for (size_t i = 0; i < ctx_.inventory.size(); ++i) tensor_index_[ctx_.inventory[i].name] = i;
}

Status Bindings::Init() {
  const PlanInputs& in = ctx_.in;
  if (ctx_.who.is_trainer) {
    SS_ASSIGN_OR_RETURN(trainer_, BuildTrainerParams(in.model, in.trainer, ctx_.who.trainer_rank,
                                                     in.trainer_dtype));
    for (size_t i = 0; i < trainer_.params.size(); ++i) {
      local_index_[{trainer_.params[i].chunk, trainer_.params[i].name}] = i;
    }
    if (trainer_.megatron) {
      locals_.resize(trainer_.params.size());
      local_bound_.assign(trainer_.params.size(), 0);
    }
    return OkStatus();
  }
  SS_ASSIGN_OR_RETURN(ShardMap map, BuildShardMap(in.model, in.rollout.shard));
  shards_ = map.rank(ctx_.who.tp_rank, ctx_.who.pp_rank);
  // ExpectedParams says what BindDest accepts: the wire dtype (block FP8: e4m3 weights and fp32
  // scales), not the config's dtype the shard map carries (issue 36: with wire_dtype fp32 it said
  // BF16, and binding what it described was refused).
  for (EngineParam& p : shards_.params) p.dtype = BoundDType(in, p);
  for (size_t i = 0; i < shards_.params.size(); ++i) param_index_[shards_.params[i].name] = i;
  dests_.resize(shards_.params.size());
  // Megatron senders: both ends cut transfers where the sender's local regions stop being
  // contiguous (BucketTransfers), so the receiver needs its senders' local parameter shapes.
  for (const Message& m : ctx_.plan.recvs) {
    if (m.local.empty() || sender_shapes_.count(m.src)) continue;
    SS_ASSIGN_OR_RETURN(SyncRank src, DescribeSyncRank(in, m.src));
    SS_ASSIGN_OR_RETURN(
        TrainerRankParams tp,
        BuildTrainerParams(in.model, in.trainer, src.trainer_rank, in.trainer_dtype));
    std::vector<Shape>& shapes = sender_shapes_[m.src];
    for (const TrainerParam& p : tp.params) shapes.push_back(p.shape);
  }
  return OkStatus();
}

Status Bindings::BindSource(const SourceBinding& b) {
  const PlanInputs& in = ctx_.in;
  if (!ctx_.who.is_trainer) {
    return FailedPreconditionError("BindSource(" + b.hf_name + "): sync rank " +
                                   std::to_string(ctx_.rank) + " is an engine rank");
  }
  if (!b.local.empty()) return BindLocal(b);
  if (trainer_.megatron) {
    return InvalidArgumentError(
        "source binding '" + b.hf_name + "': trainer rank " +
        std::to_string(ctx_.who.trainer_rank) + " of " + in.trainer.ToString() +
        " holds Megatron local parameters, not HF shards: bind each local parameter "
        "(SourceBinding::local and chunk, as ExpectedSources lists them)");
  }
  auto it = tensor_index_.find(b.hf_name);
  if (it == tensor_index_.end()) {
    return InvalidArgumentError("source binding '" + b.hf_name + "': not a tensor of model " +
                                in.model.name);
  }
  const HfTensor& t = ctx_.inventory[it->second];
  const Region held = TrainerHeldRegion(in.trainer, ctx_.who.trainer_rank, t.shape);
  if (!(b.region == held)) {
    return InvalidArgumentError("source binding '" + b.hf_name + "': trainer rank " +
                                std::to_string(ctx_.who.trainer_rank) + " of " +
                                in.trainer.ToString() + " holds " + held.ToString() +
                                ", binding covers " + b.region.ToString());
  }
  if (b.dtype != in.trainer_dtype) {
    return InvalidArgumentError("source binding '" + b.hf_name + "': dtype " +
                                std::string(DTypeName(b.dtype)) + ", plan's trainer dtype is " +
                                std::string(DTypeName(in.trainer_dtype)));
  }
  if (b.data == nullptr && !held.empty()) {
    return InvalidArgumentError("source binding '" + b.hf_name + "': null data");
  }
  if (!ctx_.packer->Supports(b.mem)) {
    return UnsupportedMemory("source binding '" + b.hf_name + "'", b.mem, *ctx_.packer);
  }
  if (!sources_.emplace(it->second, b).second) {
    return InvalidArgumentError("source binding '" + b.hf_name + "': bound twice");
  }
  return OkStatus();
}

Status Bindings::BindLocal(const SourceBinding& b) {
  const PlanInputs& in = ctx_.in;
  const std::string who =
      "trainer rank " + std::to_string(ctx_.who.trainer_rank) + " of " + in.trainer.ToString();
  const std::string what = "source binding '" + b.local + "'" +
                           (trainer_.megatron ? " (chunk " + std::to_string(b.chunk) + ")" : "");
  auto it = local_index_.find({b.chunk, b.local});
  if (it == local_index_.end()) {
    // Name the chunks that do hold it: a parameter bound to the wrong model chunk is the likely
    // mistake under virtual pipelining.
    std::string chunks;
    for (const TrainerParam& p : trainer_.params) {
      if (p.name == b.local) chunks += (chunks.empty() ? "" : ", ") + std::to_string(p.chunk);
    }
    return InvalidArgumentError(what + ": not a local parameter of " + who +
                                (chunks.empty()
                                     ? std::string(" (ExpectedSources lists them)")
                                     : "; model chunk(s) " + chunks + " hold one of that name"));
  }
  const TrainerParam& p = trainer_.params[it->second];
  if (!(b.region == Region::Full(p.shape))) {
    return InvalidArgumentError(what + ": shape " + ShapeToString(b.region.extents()) +
                                (b.region.offsets() == Shape(b.region.ndim, 0)
                                     ? std::string()
                                     : " at offset " + b.region.ToString()) +
                                ", the trainer map of " + who + " says " + ShapeToString(p.shape));
  }
  if (b.dtype != in.trainer_dtype) {
    return InvalidArgumentError(what + ": dtype " + std::string(DTypeName(b.dtype)) +
                                ", plan's trainer dtype is " +
                                std::string(DTypeName(in.trainer_dtype)));
  }
  if (b.data == nullptr && p.numel() > 0) return InvalidArgumentError(what + ": null data");
  if (!ctx_.packer->Supports(b.mem)) return UnsupportedMemory(what, b.mem, *ctx_.packer);
  if (!trainer_.megatron) {
    // FSDP-like: one parameter per HF tensor, named like it, holding the rank's dim-0 chunk.
    SourceBinding h = b;
    h.hf_name = b.local;
    h.local.clear();
    h.region = TrainerHeldRegion(in.trainer, ctx_.who.trainer_rank,
                                 ctx_.inventory.at(tensor_index_.at(b.local)).shape);
    return BindSource(h);
  }
  if (local_bound_[it->second]) return InvalidArgumentError(what + ": bound twice");
  locals_[it->second] = b;
  local_bound_[it->second] = 1;
  return OkStatus();
}

Status Bindings::BindDest(const DestBinding& b) {
  if (ctx_.who.is_trainer) {
    return FailedPreconditionError("BindDest(" + b.name + "): sync rank " +
                                   std::to_string(ctx_.rank) + " is a trainer rank");
  }
  auto it = param_index_.find(b.name);
  if (it == param_index_.end()) {
    return InvalidArgumentError(
        "destination binding '" + b.name + "': not a parameter of engine rank tp=" +
        std::to_string(ctx_.who.tp_rank) + " pp=" + std::to_string(ctx_.who.pp_rank));
  }
  const EngineParam& p = shards_.params[it->second];
  if (b.shape != p.shape) {
    return InvalidArgumentError("destination binding '" + b.name + "': shape " +
                                ShapeToString(b.shape) + ", the shard map says " +
                                ShapeToString(p.shape));
  }
  const DType wire = ctx_.in.options.wire_dtype;
  if (ctx_.quantized() && b.dtype != BoundDType(ctx_.in, p)) {
    return InvalidArgumentError("destination binding '" + b.name + "': dtype " +
                                std::string(DTypeName(b.dtype)) + ", the block-FP8 engine holds " +
                                std::string(DTypeName(BoundDType(ctx_.in, p))));
  }
  if (!ctx_.quantized() && b.dtype != wire) {
    return InvalidArgumentError("destination binding '" + b.name + "': dtype " +
                                std::string(DTypeName(b.dtype)) + " differs from the wire dtype " +
                                std::string(DTypeName(wire)) +
                                " (bytes land in place, so parameters must use the wire dtype)");
  }
  if (b.data == nullptr) {
    return InvalidArgumentError("destination binding '" + b.name + "': null data");
  }
  if (!ctx_.packer->Supports(b.mem)) {
    return UnsupportedMemory("destination binding '" + b.name + "'", b.mem, *ctx_.packer);
  }
  if (dests_[it->second].data != nullptr) {
    return InvalidArgumentError("destination binding '" + b.name + "': bound twice");
  }
  // Two parameters sharing bytes would each be written by the sync (one's checksum breaking the
  // other's): refused here, naming both, not at the first sync.
  const auto bytes_of = [](const DestBinding& d) {
    return static_cast<uintptr_t>(NumElements(d.shape)) * DTypeSize(d.dtype);
  };
  const auto start = reinterpret_cast<uintptr_t>(b.data);
  const uintptr_t end = start + bytes_of(b);
  for (const DestBinding& d : dests_) {
    const auto s = reinterpret_cast<uintptr_t>(d.data);
    if (d.data == nullptr || d.mem != b.mem || d.device != b.device || start == end) continue;
    if (s < end && start < s + bytes_of(d)) {
      return InvalidArgumentError("destination binding '" + b.name + "' overlaps destination '" +
                                  d.name +
                                  "' (bytes of one buffer bound twice); every parameter "
                                  "needs its own memory");
    }
  }
  dests_[it->second] = b;
  return OkStatus();
}

Status Bindings::Check() const {
  if (ctx_.quantized()) return CheckEncodedBindings(ctx_, *this);
  const RankPlan& plan = ctx_.plan;
  const std::string me = "sync rank " + std::to_string(ctx_.rank);
  if (ctx_.who.is_trainer && trainer_.megatron) {
    for (const Message& m : plan.sends) {
      if (m.local.size() != m.ops.size()) {
        return InternalError("plan message to sync rank " + std::to_string(m.dst) + ": " +
                             std::to_string(m.ops.size()) + " ops but " +
                             std::to_string(m.local.size()) + " local sources");
      }
      for (size_t i = 0; i < m.ops.size(); ++i) {
        SS_RETURN_IF_ERROR(CheckLocalSource(m.local[i], m.ops[i].src, m.dst));
      }
    }
    return OkStatus();
  }
  if (ctx_.who.is_trainer) {
    for (const Message& m : plan.sends) {
      for (const TransferOp& op : m.ops) {
        auto it = sources_.find(op.tensor);
        const std::string& name = ctx_.inventory.at(op.tensor).name;
        if (it == sources_.end()) {
          return NotFoundError(me + ": source tensor '" + name +
                               "' is sent by the plan but was not bound");
        }
        if (!RegionContains(it->second.region, op.src)) {
          return InvalidArgumentError("source binding '" + name + "': plan reads " +
                                      op.src.ToString() + " outside the bound region " +
                                      it->second.region.ToString());
        }
      }
    }
    return OkStatus();
  }
  for (size_t i = 0; i < dests_.size(); ++i) {
    if (dests_[i].data == nullptr) {
      return NotFoundError(me + ": engine parameter '" + shards_.params[i].name +
                           "' (tp=" + std::to_string(ctx_.who.tp_rank) +
                           " pp=" + std::to_string(ctx_.who.pp_rank) + ") was not bound");
    }
  }
  for (const Message& m : plan.recvs) {
    for (const TransferOp& op : m.ops) {
      if (op.param < 0 || static_cast<size_t>(op.param) >= dests_.size() ||
          !RegionInside(op.dst, dests_[op.param].shape)) {
        return InternalError("plan op from sync rank " + std::to_string(m.src) +
                             " lands outside parameter index " + std::to_string(op.param));
      }
    }
  }
  return OkStatus();
}

Status Bindings::CheckLocalSource(const LocalSource& ls, const Region& src, int dst) const {
  if (ls.param < 0 || static_cast<size_t>(ls.param) >= trainer_.params.size()) {
    return InternalError("plan op to sync rank " + std::to_string(dst) +
                         " reads local parameter index " + std::to_string(ls.param) + " of " +
                         std::to_string(trainer_.params.size()));
  }
  const TrainerParam& p = trainer_.params[ls.param];
  const std::string name = "'" + p.name + "' (chunk " + std::to_string(p.chunk) + ")";
  if (!local_bound_[ls.param]) {
    return NotFoundError("sync rank " + std::to_string(ctx_.rank) + ": local parameter " + name +
                         " is read by the plan but was not bound");
  }
  if (!RegionInside(ls.region, p.shape) || ls.region.extents() != src.extents()) {
    return InternalError("plan op to sync rank " + std::to_string(dst) + " reads " +
                         ls.region.ToString() + " of local parameter " + name + ", shape " +
                         ShapeToString(p.shape) + ", for HF region " + src.ToString());
  }
  return OkStatus();
}

int Bindings::BoundMem() const {
  int kind = -1;
  auto see = [&](MemKind k) {
    const int v = static_cast<int>(k);
    kind = kind == -1 || kind == v ? v : -2;
  };
  for (const auto& [t, b] : sources_) see(b.mem);
  for (size_t i = 0; i < locals_.size(); ++i) {
    if (local_bound_[i]) see(locals_[i].mem);
  }
  for (const DestBinding& d : dests_) see(d.mem);
  return kind < 0 ? -1 : kind;
}

Bindings::OpSource Bindings::SourceOf(const Message& m, int i) const {
  return SourceFor(m.ops[i].tensor, m.ops[i].src, trainer_.megatron ? &m.local[i] : nullptr);
}

Bindings::OpSource Bindings::SourceFor(int32_t tensor, const Region& src,
                                       const LocalSource* ls) const {
  OpSource s;
  if (ls != nullptr) {
    // Megatron: the op's bytes sit at the plan's local region of a local parameter.
    const SourceBinding& b = locals_[ls->param];
    s.data = b.data;
    s.dtype = b.dtype;
    s.shape = trainer_.params[ls->param].shape;
    s.region = ls->region;
    s.id = ls->param;
    s.mem = b.mem;
    return s;
  }
  const SourceBinding& sb = sources_.at(tensor);
  s.data = sb.data;
  s.dtype = sb.dtype;
  s.shape = sb.region.extents();
  s.region = src;
  for (int d = 0; d < src.ndim; ++d) s.region.offset[d] -= sb.region.offset[d];
  s.id = tensor;
  s.mem = sb.mem;
  return s;
}

const void* Bindings::SourceData(int32_t id) const {
  return trainer_.megatron ? locals_.at(id).data : sources_.at(id).data;
}

const Shape* Bindings::LocalShape(const Message& m, int param) const {
  if (ctx_.who.is_trainer) {
    if (!trainer_.megatron || param < 0 || static_cast<size_t>(param) >= trainer_.params.size()) {
      return nullptr;
    }
    return &trainer_.params[param].shape;
  }
  auto it = sender_shapes_.find(m.src);
  if (it == sender_shapes_.end() || param < 0 || static_cast<size_t>(param) >= it->second.size()) {
    return nullptr;
  }
  return &it->second[param];
}

std::vector<PackRegion> Bindings::SourceRegions(const Message& m, const Bucket& b) const {
  std::vector<PackRegion> out;
  for (int i = b.op_begin; i < b.op_end; ++i) {
    OpSource s = SourceOf(m, i);
    PackRegion r;
    r.base = s.data;
    r.dtype = s.dtype;
    r.shape = std::move(s.shape);
    r.region = s.region;
    r.wire_offset = m.ops[i].wire_offset - b.wire_offset;
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<PackRegion> Bindings::LandedRegions(const Message& m, const Bucket& b) const {
  std::vector<PackRegion> out;
  for (int i = b.op_begin; i < b.op_end; ++i) {
    const TransferOp& op = m.ops[i];
    const DestBinding& d = dests_[op.param];
    out.push_back({d.data, d.dtype, d.shape, op.dst, op.wire_offset - b.wire_offset});
  }
  return out;
}

Status Bindings::MismatchError(const Message& m, int bucket, uint64_t version, uint64_t sent,
                               uint64_t got) const {
  const Bucket& b = m.buckets[bucket];
  const std::string where = "message from sync rank " + std::to_string(m.src) + " to sync rank " +
                            std::to_string(ctx_.rank) + ", bucket " + std::to_string(bucket);
  std::vector<std::string> names;
  for (int i = b.op_begin; i < b.op_end; ++i) {
    const std::string& n = dests_[m.ops[i].param].name;
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  }
  std::string list;
  for (size_t i = 0; i < names.size() && i < 8; ++i) list += (i ? ", " : "") + names[i];
  if (names.size() > 8) list += ", ... (" + std::to_string(names.size()) + " parameters)";
  return DataLossError("checksum mismatch, version " + std::to_string(version) + ", " + where +
                       ": sent " + Hex(sent) + ", landed " + Hex(got) + "; parameters: " + list);
}

int PeerShapes::Count(int dst) {
  Get(dst, 0);
  return static_cast<int>(shapes_.at(dst).size());
}

const Shape& PeerShapes::Get(int dst, int param) {
  auto it = shapes_.find(dst);
  if (it == shapes_.end()) {
    std::vector<Shape> shapes;
    auto who = DescribeSyncRank(ctx_.in, dst);
    if (who.ok()) {
      if (!replica_map_) {
        auto map = BuildShardMap(ctx_.in.model, ctx_.in.rollout.shard);
        if (map.ok()) replica_map_ = std::make_unique<ShardMap>(std::move(map).value());
      }
      if (replica_map_) {
        for (const EngineParam& p : replica_map_->rank(who->tp_rank, who->pp_rank).params) {
          shapes.push_back(p.shape);
        }
      }
    }
    it = shapes_.emplace(dst, std::move(shapes)).first;
  }
  static const Shape kEmpty;
  if (param < 0 || static_cast<size_t>(param) >= it->second.size()) return kEmpty;
  return it->second[param];
}

}  // namespace shardsync::sync_internal
