#include "sync/codec.h"

#include <cstring>

#include "shardsync/region.h"
#include "sync/bindings.h"
#include "sync/connect.h"

namespace shardsync::sync_internal {
namespace {

// kCopy ops: the wire bytes are the parameters' own (cast to the wire dtype at most), so the loops
// cut, post and verify them in place. Pack is the whole-bucket pack of a packer passed in (device
// memory), into the packer's staging.
class CopyCodec final : public Codec {
 public:
  explicit CopyCodec(const SessionContext& ctx) : ctx_(ctx) {}

  bool in_place() const override { return true; }
  Status PrepareSend(const Bindings& bindings, const std::vector<int>& /*msgs*/) override {
    bindings_ = &bindings;
    return OkStatus();
  }
  Result<std::shared_ptr<unsigned char>> AllocSlot(size_t bytes) override {
    return ctx_.packer->AllocStaging(bytes);
  }
  Result<uint64_t> Pack(const Message& m, const Bucket& b, unsigned char* out) override {
    return ctx_.packer->Pack(bindings_->SourceRegions(m, b), ctx_.in.options.wire_dtype, out,
                             b.bytes);
  }
  // In place: the wire bytes are the destination's, each op's region in wire order.
  Status RebuildImage(const Bindings& bindings, const Message& m, const Bucket& b,
                      const std::function<void*(int param)>& live,
                      unsigned char* out) const override {
    const int ws = DTypeSize(ctx_.in.options.wire_dtype);
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const TransferOp& op = m.ops[i];
      GatherRegion(live(op.param), bindings.dest(op.param).shape, op.dst, ws,
                   out + (op.wire_offset - b.wire_offset));
    }
    return OkStatus();
  }
  // Pairs land in place: the receiver's landed regions, the sender's sources and where each op
  // lands at the peer.
  PairBucket RecvBucket(const Bindings& bindings, const Message& m, const Bucket& b) override {
    return {b.bytes, bindings.LandedRegions(m, b), {}};
  }
  PairBucket SendBucket(const Bindings& bindings, PeerShapes& shapes, const Message& m,
                        const Bucket& b, uint32_t base) override {
    PairBucket pb{b.bytes, bindings.SourceRegions(m, b), {}};
    for (int i = b.op_begin; i < b.op_end; ++i) {
      const TransferOp& op = m.ops[i];
      pb.remote.push_back(
          {base + static_cast<uint32_t>(op.param), 0, shapes.Get(m.dst, op.param), op.dst});
    }
    return pb;
  }

 private:
  const SessionContext& ctx_;
  const Bindings* bindings_ = nullptr;
};

}  // namespace

int64_t GatherRegion(const void* base, const Shape& shape, const Region& r, int es,
                     unsigned char* out) {
  int64_t n = 0;
  ForEachRun(r, shape, [&](int64_t off, int64_t len) {
    std::memcpy(out + n, static_cast<const unsigned char*>(base) + off * es,
                static_cast<size_t>(len * es));
    n += len * es;
  });
  return n;
}

std::unique_ptr<Codec> MakeCopyCodec(const SessionContext& ctx) {
  return std::make_unique<CopyCodec>(ctx);
}

DType BoundDType(const PlanInputs& in, const EngineParam& p) {
  const DType wire = in.options.wire_dtype;
  return in.model.quant.has_value() ? BlockQuantizeBoundDType(p, wire) : wire;
}

Status CheckEncodedBindings(const SessionContext& ctx, const Bindings& bindings) {
  if (ctx.quantized()) return CheckBlockQuantizeBindings(ctx, bindings);
  return InternalError("sync rank " + std::to_string(ctx.rank) +
                       ": no codec checks these bindings");
}

std::unique_ptr<Codec> MakeCodec(const SessionContext& ctx) {
  // A quantized model's plan carries the block-quantize encodings (plan.h Encoding) and tables.
  if (ctx.quantized()) return MakeBlockQuantizeCodec(ctx);
  return MakeCopyCodec(ctx);
}

}  // namespace shardsync::sync_internal
