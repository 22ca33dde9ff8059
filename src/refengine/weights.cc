// Weight sources, cutting engine shards through a shard map, and engine dumps.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "refengine/kernels.h"
#include "shardsync/refengine.h"
#include "shardsync/synthetic.h"

namespace shardsync {
namespace {

namespace fs = std::filesystem;

// F8_E4M3: block-FP8 checkpoints' quantized weights (their fp32 scales are read beside them).
bool IsFloatWeight(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF64 ||
         t == DType::kF8E4M3;
}

// Index of the first NaN or infinity among `n` elements of a float dtype, -1 if none.
int64_t FirstNonFinite(DType t, const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    bool finite = true;
    switch (t) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        finite = std::isfinite(f);
        break;
      }
      case DType::kF64: {
        double f;
        std::memcpy(&f, p + 8 * i, 8);
        finite = std::isfinite(f);
        break;
      }
      case DType::kBF16:
      case DType::kF16: {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint16_t exp = t == DType::kBF16 ? 0x7f80 : 0x7c00;  // all-ones exponent
        finite = (h & exp) != exp;
        break;
      }
      case DType::kF8E4M3:  // e4m3fn has no infinity; S.1111.111 is its only NaN
        finite = (p[i] & 0x7f) != 0x7f;
        break;
      default:
        break;
    }
    if (!finite) return i;
  }
  return -1;
}

Status CheckRegion(std::string_view name, const Region& r, const Shape& shape) {
  if (!RegionInside(r, shape)) {
    return OutOfRangeError(fmt::format("region {} is outside tensor '{}' of shape {}", r.ToString(),
                                       name, ShapeToString(shape)));
  }
  return OkStatus();
}

}  // namespace

// ---- CheckpointWeightSource ----

Result<std::unique_ptr<CheckpointWeightSource>> CheckpointWeightSource::Open(
    const std::string& path) {
  std::unique_ptr<CheckpointWeightSource> s(new CheckpointWeightSource());
  SS_ASSIGN_OR_RETURN(s->ckpt_, SafetensorsCheckpoint::Open(path));
  return s;
}

Result<TensorInfo> CheckpointWeightSource::Describe(std::string_view hf_name) const {
  SS_ASSIGN_OR_RETURN(TensorView v, ckpt_->Get(hf_name));
  return TensorInfo{v.dtype, v.shape};
}

Status CheckpointWeightSource::Read(std::string_view hf_name, const Region& r, DType dtype,
                                    void* out) const {
  SS_ASSIGN_OR_RETURN(TensorView v, ckpt_->Get(hf_name));
  if (v.shape.size() > static_cast<size_t>(kMaxDims)) {
    return UnimplementedError(
        fmt::format("tensor '{}' has {} dimensions (max {})", hf_name, v.shape.size(), kMaxDims));
  }
  if (!IsFloatWeight(v.dtype)) {
    return InvalidArgumentError(fmt::format(
        "tensor '{}' is {}: the reference engine reads F32, BF16, F16, F64 or F8_E4M3 weights",
        hf_name, DTypeName(v.dtype)));
  }
  SS_RETURN_IF_ERROR(CheckRegion(hf_name, r, v.shape));
  const int src_size = DTypeSize(v.dtype), dst_size = DTypeSize(dtype);
  auto* dst = static_cast<uint8_t*>(out);
  Status st;
  ForEachRun(r, v.shape, [&](int64_t off, int64_t len) {
    if (!st.ok()) return;
    // A NaN or an infinity would decode to garbage tokens that look like an answer.
    const uint8_t* src = v.data.data() + off * src_size;
    if (const int64_t bad = FirstNonFinite(v.dtype, src, len); bad >= 0) {
      st =
          InvalidArgumentError(fmt::format("tensor '{}' holds a non-finite value (NaN or "
                                           "infinity) at element {}",
                                           hf_name, off + bad));
      return;
    }
    st = ConvertElements(v.dtype, src, dtype, dst, len);
    dst += len * dst_size;
  });
  if (!st.ok()) st.Annotate(fmt::format("tensor '{}'", hf_name));
  return st;
}

// ---- SyntheticWeightSource ----

SyntheticWeightSource::SyntheticWeightSource(const ModelSpec& spec, uint64_t seed)
    : seed_(seed), dtype_(spec.dtype) {
  for (const auto& t : HfTensorInventory(spec)) shapes_.emplace(t.name, t.shape);
}

Result<TensorInfo> SyntheticWeightSource::Describe(std::string_view hf_name) const {
  auto it = shapes_.find(hf_name);
  if (it == shapes_.end()) {
    return NotFoundError(fmt::format("tensor '{}' is not in the model's inventory", hf_name));
  }
  return TensorInfo{dtype_, it->second};
}

Status SyntheticWeightSource::Read(std::string_view hf_name, const Region& r, DType dtype,
                                   void* out) const {
  auto it = shapes_.find(hf_name);
  if (it == shapes_.end()) {
    return NotFoundError(fmt::format("tensor '{}' is not in the model's inventory", hf_name));
  }
  SS_RETURN_IF_ERROR(CheckRegion(hf_name, r, it->second));
  const int64_t n = r.numel();
  std::vector<float> f(n);
  FillSyntheticRegion(seed_, hf_name, it->second, r, f.data());
  // Round to the model dtype first: every reader sees the values a bf16 trainer would hold.
  std::vector<uint8_t> typed(n * DTypeSize(dtype_));
  SS_RETURN_IF_ERROR(ConvertElements(DType::kF32, f.data(), dtype_, typed.data(), n));
  return ConvertElements(dtype_, typed.data(), dtype, out, n);
}

// ---- CutEngineShards ----

Result<std::vector<EngineBuffers>> CutEngineShards(const ShardMap& map,
                                                   const WeightSource& weights) {
  int64_t bytes = 0;
  for (const EngineRankShards& rank : map.ranks) {
    for (const EngineParam& p : rank.params) {
      bytes = refengine::SatAdd(bytes, refengine::SatMul(p.numel(), DTypeSize(p.dtype)));
    }
  }
  SS_RETURN_IF_ERROR(
      CheckHostMemory(bytes, "model '" + map.model.name + "'", "the engine-layout shards"));
  std::vector<EngineBuffers> out(map.ranks.size());
  std::vector<uint8_t> tmp;
  for (size_t i = 0; i < map.ranks.size(); ++i) {
    const EngineRankShards& rank = map.ranks[i];
    for (const EngineParam& p : rank.params) {
      HostTensor t;
      t.dtype = p.dtype;
      t.shape = p.shape;
      const int es = DTypeSize(p.dtype);
      t.data.assign(static_cast<size_t>(p.numel()) * es, 0);
      for (const Piece& piece : p.pieces) {
        if (piece.src.numel() != piece.dst.numel() || !RegionInside(piece.dst, p.shape)) {
          return InvalidArgumentError(fmt::format(
              "rank (tp {}, pp {}) parameter '{}': piece from '{}' {} -> {} does not fit {}",
              rank.tp_rank, rank.pp_rank, p.name, piece.source, piece.src.ToString(),
              piece.dst.ToString(), ShapeToString(p.shape)));
        }
        tmp.resize(static_cast<size_t>(piece.src.numel()) * es);
        Status st = weights.Read(piece.source, piece.src, p.dtype, tmp.data());
        if (!st.ok()) {
          st.Annotate(fmt::format("rank (tp {}, pp {}) parameter '{}'", rank.tp_rank, rank.pp_rank,
                                  p.name));
          return st;
        }
        const uint8_t* src = tmp.data();
        ForEachRun(piece.dst, p.shape, [&](int64_t off, int64_t len) {
          std::memcpy(t.data.data() + off * es, src, len * es);
          src += len * es;
        });
      }
      for (const ZeroFill& z : p.zero_fills) {
        ForEachRun(z.dst, p.shape, [&](int64_t off, int64_t len) {
          std::memset(t.data.data() + off * es, 0, len * es);
        });
      }
      out[i].emplace(p.name, std::move(t));
    }
  }
  return out;
}

// ---- Engine dumps ----

namespace {
constexpr const char* kMetaReplica = "shardsync.replica";
constexpr const char* kMetaTp = "shardsync.tp_rank";
constexpr const char* kMetaPp = "shardsync.pp_rank";

Result<int> MetaInt(const SafetensorsHeader& h, const char* key, const std::string& path) {
  auto it = h.metadata.find(key);
  if (it == h.metadata.end()) {
    return InvalidArgumentError(fmt::format(
        "engine dump '{}': __metadata__ lacks '{}' (not written by WriteEngineDump)", path, key));
  }
  int v = 0;
  size_t used = 0;
  try {
    v = std::stoi(it->second, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0 || used != it->second.size() || v < 0) {
    return InvalidArgumentError(fmt::format(
        "engine dump '{}': __metadata__ '{}' is not a non-negative integer", path, key));
  }
  return v;
}
}  // namespace

Status WriteEngineDump(const std::string& path, const std::vector<TensorToWrite>& params,
                       const EngineDumpInfo& info) {
  return WriteSafetensors(path, params,
                          {{kMetaReplica, std::to_string(info.replica)},
                           {kMetaTp, std::to_string(info.tp_rank)},
                           {kMetaPp, std::to_string(info.pp_rank)}});
}

Status WriteEngineDump(const std::string& path, const EngineBuffers& params,
                       const EngineDumpInfo& info) {
  std::vector<TensorToWrite> ts;
  ts.reserve(params.size());
  for (const auto& [name, t] : params) ts.push_back({name, t.dtype, t.shape, t.data});
  return WriteEngineDump(path, ts, info);
}

Result<std::vector<EngineBuffers>> LoadEngineDump(const std::string& dir, const ShardMap& map,
                                                  int replica) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError(fmt::format("engine dump directory '{}' does not exist", dir));
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".safetensors") {
      files.push_back(e.path().string());
    }
  }
  if (ec) return UnavailableError(fmt::format("listing '{}': {}", dir, ec.message()));
  std::sort(files.begin(), files.end());
  // Every tensor is copied into memory: the dumps' sizes, checked before anything is read.
  int64_t total = 0;
  for (const auto& path : files) {
    const auto size = fs::file_size(path, ec);
    total = refengine::SatAdd(total, ec ? 0 : static_cast<int64_t>(size));
  }
  SS_RETURN_IF_ERROR(
      CheckHostMemory(total, fmt::format("engine dump directory '{}'", dir), "loading the dumps"));
  std::vector<EngineBuffers> out(map.ranks.size());
  std::vector<std::string> from(map.ranks.size());
  for (const auto& path : files) {
    SS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
    SS_ASSIGN_OR_RETURN(int rep, MetaInt(f->header(), kMetaReplica, path));
    if (rep != replica) continue;
    SS_ASSIGN_OR_RETURN(int tp, MetaInt(f->header(), kMetaTp, path));
    SS_ASSIGN_OR_RETURN(int pp, MetaInt(f->header(), kMetaPp, path));
    if (tp >= map.spec.tp || pp >= map.spec.pp) {
      return InvalidArgumentError(
          fmt::format("engine dump '{}': rank (tp {}, pp {}) is outside the layout tp {} x pp {}",
                      path, tp, pp, map.spec.tp, map.spec.pp));
    }
    const size_t idx = static_cast<size_t>(pp) * map.spec.tp + tp;
    if (!from[idx].empty()) {
      return InvalidArgumentError(
          fmt::format("engine dumps '{}' and '{}' both claim replica {} rank (tp {}, pp {})",
                      from[idx], path, replica, tp, pp));
    }
    from[idx] = path;
    for (const auto& e : f->header().tensors) {
      SS_ASSIGN_OR_RETURN(TensorView v, f->Get(e.name));
      HostTensor t;
      t.dtype = v.dtype;
      t.shape = v.shape;
      t.data.assign(v.data.begin(), v.data.end());
      out[idx].emplace(e.name, std::move(t));
    }
  }
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i].empty()) {
      return NotFoundError(
          fmt::format("engine dump directory '{}' has no dump of replica {} rank "
                      "(tp {}, pp {})",
                      dir, replica, map.ranks[i].tp_rank, map.ranks[i].pp_rank));
    }
  }
  return out;
}

namespace {
// Quantized syncs (block FP8) quantize the trainer's values (trainer dtype) and copy the rest
// through the wire dtype: the reference values follow the same two paths.
class QuantizedSyncValues : public WeightSource {
 public:
  QuantizedSyncValues(const ModelSpec& spec, uint64_t seed, DType wire, DType trainer)
      : spec_(spec), wire_(WithDType(spec, wire), seed), trainer_(WithDType(spec, trainer), seed) {}
  Result<TensorInfo> Describe(std::string_view n) const override { return Pick(n).Describe(n); }
  Status Read(std::string_view n, const Region& r, DType t, void* out) const override {
    return Pick(n).Read(n, r, t, out);
  }

 private:
  static ModelSpec WithDType(ModelSpec s, DType t) {
    s.dtype = t;
    return s;
  }
  const WeightSource& Pick(std::string_view n) const {
    return IsQuantizedWeight(spec_, n) ? static_cast<const WeightSource&>(trainer_) : wire_;
  }
  ModelSpec spec_;
  SyntheticWeightSource wire_, trainer_;
};
}  // namespace

Result<GenerationCheck> CheckGenerationOfDump(const ShardMap& map, const std::string& dir,
                                              int replica, uint64_t seed, DType wire_dtype,
                                              int n_tokens, DType trainer_dtype) {
  SS_ASSIGN_OR_RETURN(std::vector<EngineBuffers> received, LoadEngineDump(dir, map, replica));
  if (map.model.quant) {
    QuantizedSyncValues reference(map.model, seed, wire_dtype, trainer_dtype);
    return CheckGeneration(map, received, reference, DefaultPrompt(), n_tokens);
  }
  ModelSpec ref_spec = map.model;
  ref_spec.dtype = wire_dtype;
  SyntheticWeightSource reference(ref_spec, seed);
  return CheckGeneration(map, received, reference, DefaultPrompt(), n_tokens);
}

}  // namespace shardsync
