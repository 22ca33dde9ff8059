// The delta codec of delta.h. Hand-written (no Debian library diffs a buffer against a base the
// receiver holds, nor names the base); the format and the size rule are in the header.
#include "shardsync/delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/delta_internal.h"
#include "common/delta_walks.h"
#include "shardsync/checksum.h"
#include "shardsync/delta_rule.h"

namespace shardsync {
namespace {

using namespace delta_internal;  // NOLINT(build/namespaces): the codec's own helpers

// Byte offset -> piece (DeltaPiece), for offsets that never decrease: records come in increasing
// element order, so a decode walks the pieces once.
class PieceCursor {
 public:
  explicit PieceCursor(std::span<const DeltaPiece> p) : p_(p) {}
  const DeltaPiece& At(uint64_t at) {
    while (p_[k_].offset + p_[k_].len <= at) ++k_;
    return p_[k_];
  }
  // The base's checksum word at byte `at` (a multiple of 8) of an n-byte bucket: zero-padded
  // past n, gathered when it straddles pieces.
  uint64_t Word(uint64_t at, uint64_t n) {
    const DeltaPiece& p = At(at);
    if (at + 8 <= p.offset + p.len) return Get<uint64_t>(p.base + (at - p.offset));
    uint64_t w = 0;
    const uint64_t end = std::min(at + 8, n);
    for (size_t k = k_, o = at; o < end; ++k) {
      const DeltaPiece& q = p_[k];
      const uint64_t take = std::min(end, q.offset + q.len) - o;
      std::memcpy(reinterpret_cast<std::byte*>(&w) + (o - at), q.base + (o - q.offset), take);
      o += take;
    }
    return w;
  }

 private:
  std::span<const DeltaPiece> p_;
  size_t k_ = 0;
};

// The pieces tile [0, n) in order, on element (e) boundaries, with bytes to read (and, `writes`,
// somewhere to write).
Status CheckPieces(std::span<const DeltaPiece> pieces, uint64_t n, uint64_t e,
                   std::string_view name, bool writes) {
  uint64_t at = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const DeltaPiece& p = pieces[k];
    if (p.offset != at || p.offset % e != 0 || p.len % e != 0 ||
        (p.len != 0 && (p.base == nullptr || (writes && p.out == nullptr))))
      return InvalidArgumentError(fmt::format(
          "delta of bucket {}: piece {} (offset {}, {} bytes) does not continue the pieces at "
          "offset {} on {}-byte elements",
          name, k, p.offset, p.len, at, e));
    at += p.len;
  }
  if (at != n)
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: the pieces cover {} bytes, the bucket is {}", name, at, n));
  return OkStatus();
}

// The checksum sum (checksum.h, unfinished) of the pieces' base bytes of an n-byte bucket, read
// once, in bucket order up to where To() was asked; with `copy`, each piece whose `out` is
// elsewhere gets the base's bytes in the same pass. Words split between pieces are assembled
// byte by byte (at most 7 bytes per piece edge).
class PieceSum {
 public:
  PieceSum(std::span<const DeltaPiece> pieces, uint64_t n, bool copy)
      : p_(pieces), n_(n), copy_(copy) {}
  void To(uint64_t to) {
    while (at_ < to) {
      const DeltaPiece& p = p_[k_];
      const uint64_t end = std::min(p.offset + p.len, to);
      if (end > at_) Range(p, at_, end);
      at_ = std::max(at_, end);
      if (at_ == p.offset + p.len) ++k_;
    }
  }
  uint64_t Finish() {
    To(n_);
    if (n_ % 8 != 0) sum_ += ChecksumMixWord(word_, n_ / 8);  // the zero-padded last word
    return sum_;
  }

 private:
  void Range(const DeltaPiece& p, uint64_t o, uint64_t end) {
    const std::byte* src = p.base + (o - p.offset);
    std::byte* dst = p.out + (o - p.offset);
    const bool cp = copy_ && p.out != p.base;
    uint64_t len = end - o;
    auto bytes = [&](uint64_t count) {
      for (uint64_t k = 0; k < count; ++k, ++o) {
        word_ |= static_cast<uint64_t>(src[k]) << (8 * (o % 8));
        if (cp) dst[k] = src[k];
        if (o % 8 == 7) {
          sum_ += ChecksumMixWord(word_, o / 8);
          word_ = 0;
        }
      }
      src += count;
      dst += count;
      len -= count;
    };
    bytes(std::min<uint64_t>(len, (8 - o % 8) % 8));
    const uint64_t whole = len & ~uint64_t{7};
    if (whole != 0) {
      sum_ += cp ? CopyWithChecksumPartial(dst, src, whole, o) : ChecksumPartial(src, whole, o);
      src += whole;
      dst += whole;
      o += whole;
      len -= whole;
    }
    bytes(len);
  }

  std::span<const DeltaPiece> p_;
  uint64_t n_;
  bool copy_;
  size_t k_ = 0;
  uint64_t at_ = 0;
  uint64_t sum_ = 0, word_ = 0;
};

// What the changes do to the checksum sum: the checksum is a sum of per-word terms, so each
// changed word's term is replaced. Fed alongside PieceSum (To: the records whose words lie below
// `limit`, read while that stretch is still in cache); records come in increasing element order
// (checked before), so each changed word is finished before the next starts.
template <int E>
class Predict {
 public:
  // `news`: for the packed form, each change's new value goes there (the apply then only writes,
  // as it does for the other forms, instead of reading each old value a second time).
  Predict(const DeltaInfo& info, const std::byte* payload, std::span<const DeltaPiece> pieces,
          uint64_t n, const uint16_t* xoffs, std::vector<std::byte>* news)
      : news_(news),
        rec_(info, payload),
        iw_(info.kind == DeltaKind::kPacked
                ? IndexWalk<E>(payload, reinterpret_cast<const std::byte*>(xoffs), nullptr,
                               info.changed)
                : IndexWalk<E>(info, payload)),
        pw_(info, payload),
        index_(info.kind == DeltaKind::kIndex),
        packed_(info.kind == DeltaKind::kPacked),
        cur_(pieces),
        n_(n) {}
  void To(uint64_t limit) {
    // The walk on locals (and the word patched by shifts, not byte stores): members written
    // through a std::byte pointer would be reloaded after every change.
    uint64_t word_at = word_at_, old_word = old_word_, new_word = new_word_, delta = delta_;
    constexpr uint64_t kMask = E == 4 ? 0xFFFFFFFFull : (uint64_t{1} << (8 * E)) - 1;
    // Change i into its word, its new value value_of(old value); false, leaving it for the next
    // To, past `limit`.
    auto fold = [&](uint64_t i, auto&& value_of) {
      const uint64_t at = i * E / 8 * 8;
      if (at + 8 > limit && limit < n_) return false;
      if (at != word_at) {
        delta += Change(word_at, old_word, new_word);
        word_at = at;
        old_word = new_word = cur_.Word(at, n_);
      }
      const unsigned shift = static_cast<unsigned>(8 * (i * E - at));
      new_word = (new_word & ~(kMask << shift)) | (value_of(old_word >> shift & kMask) << shift);
      return true;
    };
    auto stored = [](const std::byte* v) {
      return [v](uint64_t) { return static_cast<uint64_t>(Get<Elem<E>>(v)); };
    };
    if (packed_) {  // tile by tile over the expanded offsets, the values from the value bytes
      IndexWalk<E> w = iw_;
      PackedWalk<E> pw = pw_;
      std::byte* news = news_->data();
      for (bool more = true; more && w.k < w.count;) {
        w.Seek();
        for (const uint64_t end = w.tile_end; w.k < end; ++w.k) {
          const uint64_t j = w.k;
          auto value = [&](uint64_t old) {
            const uint64_t v = pw.Value(j, old);
            Put<Elem<E>>(news + j * E, static_cast<Elem<E>>(v));
            return v;
          };
          if (!fold(w.Index(j), value)) {
            more = false;
            break;
          }
        }
      }
      iw_ = w;
      pw_ = pw;
    } else if (index_) {  // tile by tile
      IndexWalk<E> w = iw_;
      for (bool more = true; more && w.k < w.count;) {
        w.Seek();
        for (const uint64_t end = w.tile_end; w.k < end; ++w.k) {
          if (!fold(w.Index(w.k), stored(w.vals + w.k * E))) {
            more = false;
            break;
          }
        }
      }
      iw_ = w;
    } else {
      Records<E> rec = rec_;
      for (; !rec.done() && fold(rec.index(), stored(rec.value())); rec.Next()) {
      }
      rec_ = rec;
    }
    word_at_ = word_at;
    old_word_ = old_word;
    new_word_ = new_word;
    delta_ = delta;
  }
  // The sum's change (mod 2^64).
  uint64_t Finish() {
    To(n_);
    Flush();
    word_at_ = UINT64_MAX;
    return delta_;
  }

 private:
  void Flush() { delta_ += Change(word_at_, old_word_, new_word_); }
  // What replacing the word at byte `at` (none: UINT64_MAX) does to the sum.
  static uint64_t Change(uint64_t at, uint64_t old_word, uint64_t new_word) {
    return at == UINT64_MAX ? 0
                            : ChecksumMixWord(new_word, at / 8) - ChecksumMixWord(old_word, at / 8);
  }
  std::vector<std::byte>* news_;
  Records<E> rec_;
  IndexWalk<E> iw_;
  PackedWalk<E> pw_;
  bool index_, packed_;
  PieceCursor cur_;
  uint64_t n_;
  uint64_t word_at_ = UINT64_MAX, old_word_ = 0, new_word_ = 0, delta_ = 0;
};

// Writes the changed elements into the pieces' `out` (elements never straddle pieces). The index
// form's changes are spread over the bucket, last touched a whole pass ago: their lines are
// prefetched a few records ahead. The bitmap form's are dense: a plain walk of its bytes.
template <int E>
void Apply(const DeltaInfo& info, const std::byte* payload, std::span<const DeltaPiece> pieces,
           const uint16_t* xoffs, const std::byte* news) {
  PieceCursor cur(pieces);
  auto put = [&](uint64_t i, const std::byte* value) {
    const DeltaPiece& p = cur.At(i * E);
    Put<Elem<E>>(p.out + (i * E - p.offset), Get<Elem<E>>(value));
  };
  if (info.kind != DeltaKind::kBitmap) {
    // The packed form as expanded: its offsets (PackedPositions), its new values (Predict).
    const IndexWalk<E> walk =
        info.kind == DeltaKind::kPacked
            ? IndexWalk<E>(payload, reinterpret_cast<const std::byte*>(xoffs), news, info.changed)
            : IndexWalk<E>(info, payload);
    constexpr uint64_t kAhead = 16;
    IndexWalk<E> w = walk, ahead = walk;
    PieceCursor pre(pieces);
    ahead.k = std::min<uint64_t>(kAhead, ahead.count);
    while (w.k < w.count) {
      w.Seek();
      for (const uint64_t end = w.tile_end; w.k < end; ++w.k) {
        if (ahead.k < ahead.count) {
          ahead.Seek();
          const uint64_t a = ahead.Index(ahead.k++) * E;
          const DeltaPiece& q = pre.At(a);
          __builtin_prefetch(q.out + (a - q.offset), 1);
        }
        put(w.Index(w.k), w.vals + w.k * E);
      }
    }
    return;
  }
  const uint64_t nbits = BitmapBytes(info.elements);
  const std::byte* vals = payload + nbits;
  for (uint64_t j = 0; j < nbits; ++j) {
    if (j % 8 == 0 && j + 8 <= nbits && Get<uint64_t>(payload + j) == 0) {
      j += 7;
      continue;
    }
    for (unsigned m = static_cast<unsigned>(payload[j]); m != 0; m &= m - 1, vals += E)
      put(j * 8 + std::countr_zero(m), vals);
  }
}

}  // namespace

std::string_view DeltaReasonText(DeltaReason r) {
  switch (r) {
    case DeltaReason::kDelta:
      return "delta";
    case DeltaReason::kNoImage:
      return "no kept image";
    case DeltaReason::kVersion:
      return "base version differs";
    case DeltaReason::kChecksum:
      return "base checksum differs";
    case DeltaReason::kSize:
      return "delta not smaller";
    case DeltaReason::kCost:
      return "does not pay at the link speed";
  }
  return "?";
}

std::string_view DeltaKindName(DeltaKind kind) {
  switch (kind) {
    case DeltaKind::kFull:
      return "full";
    case DeltaKind::kIndex:
      return "index";
    case DeltaKind::kBitmap:
      return "bitmap";
    case DeltaKind::kPacked:
      return "packed";
  }
  return "unknown";
}

DeltaSize DeltaEncodedBytes(uint64_t elements, int element_size, uint64_t changed,
                            uint64_t escapes) {
  return DeltaSizeRule(elements, static_cast<uint64_t>(element_size), changed, escapes);
}

Result<DeltaInfo> InspectDelta(std::span<const std::byte> encoded, std::string_view bucket) {
  auto bad = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", bucket, what));
  };
  if (encoded.size() < kDeltaHeaderBytes)
    return bad(fmt::format("{} bytes, shorter than the {}-byte header", encoded.size(),
                           kDeltaHeaderBytes));
  const std::byte* h = encoded.data();
  if (Get<uint32_t>(h) != kMagic) return bad(fmt::format("magic {:#x}", Get<uint32_t>(h)));
  if (Get<uint8_t>(h + 4) != kFormat) return bad(fmt::format("format {}", Get<uint8_t>(h + 4)));
  DeltaInfo info;
  const uint8_t kind = Get<uint8_t>(h + 5);
  if (kind != static_cast<uint8_t>(DeltaKind::kIndex) &&
      kind != static_cast<uint8_t>(DeltaKind::kBitmap) &&
      kind != static_cast<uint8_t>(DeltaKind::kPacked))
    return bad(fmt::format("kind {}", kind));
  info.kind = static_cast<DeltaKind>(kind);
  info.element_size = Get<uint8_t>(h + 6);
  if (!ValidElementSize(info.element_size))
    return bad(fmt::format("element_size {}", info.element_size));
  if (Get<uint8_t>(h + 7) != 0) return bad("reserved byte 7 not zero");
  info.elements = Get<uint64_t>(h + 8);
  info.base_version = Get<uint64_t>(h + 16);
  info.base_checksum = Get<uint64_t>(h + 24);
  info.new_checksum = Get<uint64_t>(h + 32);
  info.changed = Get<uint64_t>(h + 40);
  if (info.elements > kDeltaMaxElements)
    return bad(fmt::format("elements {} over the limit {}", info.elements, kDeltaMaxElements));
  if (info.changed > info.elements)
    return bad(fmt::format("count {} over elements {}", info.changed, info.elements));
  // elements < 2^32 and changed <= elements: no product below overflows 64 bits.
  const uint64_t e = info.element_size;
  const uint64_t have = encoded.size() - kDeltaHeaderBytes;
  if (info.kind == DeltaKind::kPacked) {
    if (!DeltaPackedAllowed(info.elements, e, info.changed))
      return bad(fmt::format("packed form of {} changes of {}-byte elements: over the form's limit",
                             info.changed, e));
    // The escapes (element size 2) are what the length leaves after the rest.
    const uint64_t l0 = DeltaPackedPayload(info.elements, e, info.changed, 0).bytes;
    if (e == 1 && have != l0)
      return bad(fmt::format("{} payload bytes, the header's packed form of {} changes needs {}",
                             have, info.changed, l0));
    if (e == 2 && (have < l0 || (have - l0) % 2 != 0 || (have - l0) / 2 > info.changed))
      return bad(fmt::format(
          "{} payload bytes, the header's packed form of {} changes needs {} plus 2 per escape "
          "(at most {})",
          have, info.changed, l0, info.changed));
    info.escapes = e == 2 ? (have - l0) / 2 : 0;
    return info;
  }
  const uint64_t payload = info.kind == DeltaKind::kIndex
                               ? DeltaIndexPayload(info.elements, e, info.changed).bytes
                               : BitmapBytes(info.elements) + info.changed * e;
  if (encoded.size() - kDeltaHeaderBytes != payload)
    return bad(fmt::format("{} payload bytes, the header's {} form of {} changes needs {}",
                           encoded.size() - kDeltaHeaderBytes, DeltaKindName(info.kind),
                           info.changed, payload));
  return info;
}

Status DecodeDeltaPieces(std::span<const std::byte> encoded, std::span<const DeltaPiece> pieces,
                         uint64_t bucket_bytes, const DeltaExpect& expect) {
  SS_ASSIGN_OR_RETURN(const DeltaInfo info, InspectDelta(encoded, expect.bucket));
  const std::string_view name = expect.bucket;
  if (info.element_size != expect.element_size)
    return InvalidArgumentError(
        fmt::format("delta of bucket {}: element_size {} in the encoding, the receiver's is {}",
                    name, info.element_size, expect.element_size));
  const uint64_t e = info.element_size;
  const uint64_t n = bucket_bytes;
  if (n % e != 0 || n / e != info.elements)
    return InvalidArgumentError(fmt::format(
        "delta of bucket {}: the encoding covers {} elements of {} bytes, the receiver's bucket "
        "is {} bytes",
        name, info.elements, e, n));
  SS_RETURN_IF_ERROR(CheckPieces(pieces, n, e, name, /*writes=*/true));
  if (info.base_version != expect.base_version)
    return FailedPreconditionError(fmt::format(
        "delta of bucket {}: computed against base version {}, the receiver holds version {}: "
        "not applied",
        name, info.base_version, expect.base_version));
  // Positions first (the payload alone): a pass over the bucket may only look up valid ones.
  const std::byte* payload = encoded.data() + kDeltaHeaderBytes;
  auto bad = [&](std::string what) {
    return DataLossError(fmt::format("delta of bucket {}: malformed encoding: {}", name, what));
  };
  Status positions = OkStatus();
  std::vector<uint16_t> xoffs;  // the packed form's changes named as the index form names them
  if (info.kind == DeltaKind::kPacked) {
    xoffs.resize(info.changed);
    positions = PackedPositions(info, payload, name, xoffs.data());
  } else if (info.kind == DeltaKind::kIndex) {
    // The running counts, then each tile's offsets, then the padding (delta.h "Encoded form").
    const DeltaIndexLayout l = DeltaIndexPayload(info.elements, e, info.changed);
    uint64_t prev = 0;
    for (uint64_t t = 0; t < l.tiles && positions.ok(); ++t) {
      const uint32_t end = Get<uint32_t>(payload + 4 * t);
      if (end < prev)
        positions = bad(
            fmt::format("tile {}: running count {} below the previous tile's {}", t, end, prev));
      prev = end;
    }
    if (positions.ok() && l.tiles > 0 && prev != info.changed)
      positions = bad(fmt::format("tile {}: running count {}, the count says {}", l.tiles - 1, prev,
                                  info.changed));
    // Every running count is now at most the count: the offsets read below lie in the payload.
    for (uint64_t t = 0, k = 0; t < l.tiles && positions.ok(); ++t) {
      const uint64_t end = Get<uint32_t>(payload + 4 * t);
      const uint64_t n_t = std::min(l.tile_elems, info.elements - t * l.tile_elems);
      uint16_t last = 0;
      for (const uint64_t first = k; k < end; ++k) {
        const uint16_t off = Get<uint16_t>(payload + l.offsets + 2 * k);
        if (off >= n_t) {
          positions = bad(
              fmt::format("record {}: element {} of tile {} out of range [0, {})", k, off, t, n_t));
          break;
        }
        if (k > first && off <= last) {
          positions = bad(fmt::format("record {}: element {} of tile {} not above the previous {}",
                                      k, off, t, last));
          break;
        }
        last = off;
      }
    }
    for (uint64_t i = l.offsets + 2 * info.changed; i < l.values && positions.ok(); ++i)
      if (payload[i] != std::byte{0})
        positions = bad(fmt::format("index padding byte {} not zero", i));
  } else {
    const uint64_t nbits = BitmapBytes(info.elements);
    const unsigned tail = info.elements % 8;
    uint64_t count = 0;
    uint64_t j = 0;
    for (; j + 8 <= nbits; j += 8) count += Popcount64(Get<uint64_t>(payload + j));
    for (; j < nbits; ++j) count += Popcount64(static_cast<unsigned>(payload[j]));
    if (tail != 0 && (static_cast<unsigned>(payload[nbits - 1]) >> tail) != 0)
      positions = bad(fmt::format("bitmap bits set past element {}", info.elements));
    else if (count != info.changed)
      positions =
          bad(fmt::format("bitmap has {} bits set, the count says {}", count, info.changed));
  }

  // One pass over the bucket, chunk by chunk: its base checksum (with `out` elsewhere, the copy)
  // and, while each chunk is in cache, the changed words' old and new terms. Refusals in order:
  // another base, then a malformed encoding, then a result that is not the sender's; nothing is
  // written before all three passed.
  PieceSum base(pieces, n, /*copy=*/true);
  uint64_t change = 0;
  // Malformed positions: the records are never walked (their walk trusts the checks above).
  DeltaInfo walk = info;
  if (!positions.ok()) walk.changed = 0;
  // The packed form's new values, from the prediction, for the apply.
  std::vector<std::byte> news(walk.kind == DeltaKind::kPacked ? walk.changed * e : 0);
  auto pass = [&]<int E>(Predict<E> pred) {
    for (uint64_t c = 0; c < n; c += kChunk) {
      const uint64_t end = std::min<uint64_t>(c + kChunk, n);
      base.To(end);
      if (positions.ok()) pred.To(end);
    }
    if (positions.ok()) change = pred.Finish();
  };
  if (e == 1)
    pass(Predict<1>(walk, payload, pieces, n, xoffs.data(), &news));
  else if (e == 2)
    pass(Predict<2>(walk, payload, pieces, n, xoffs.data(), &news));
  else
    pass(Predict<4>(walk, payload, pieces, n, xoffs.data(), &news));
  const uint64_t base_sum = base.Finish();
  const uint64_t have = ChecksumFinish(base_sum, n);
  if (have != info.base_checksum)
    return FailedPreconditionError(fmt::format(
        "delta of bucket {}: base_checksum {:#018x} (version {}), the receiver's bytes have "
        "{:#018x}: not applied",
        name, info.base_checksum, info.base_version, have));
  SS_RETURN_IF_ERROR(positions);
  const uint64_t sum = base_sum + change;
  if (ChecksumFinish(sum, n) != info.new_checksum)
    return DataLossError(fmt::format(
        "delta of bucket {}: the result's checksum {:#018x} is not the sender's new_checksum "
        "{:#018x} (corrupt values): not applied",
        name, ChecksumFinish(sum, n), info.new_checksum));
  if (e == 1)
    Apply<1>(info, payload, pieces, xoffs.data(), news.data());
  else if (e == 2)
    Apply<2>(info, payload, pieces, xoffs.data(), news.data());
  else
    Apply<4>(info, payload, pieces, xoffs.data(), news.data());
  return OkStatus();
}

Status DecodeDeltaInPlace(std::span<const std::byte> encoded, std::span<std::byte> bucket,
                          const DeltaExpect& expect) {
  const DeltaPiece whole{0, bucket.size(), bucket.data(), bucket.data()};
  return DecodeDeltaPieces(encoded, {&whole, 1}, bucket.size(), expect);
}

Result<uint64_t> DeltaPiecesChecksum(std::span<const DeltaPiece> pieces, uint64_t bucket_bytes,
                                     bool copy) {
  SS_RETURN_IF_ERROR(CheckPieces(pieces, bucket_bytes, 1, "(checksum)", /*writes=*/copy));
  return ChecksumFinish(PieceSum(pieces, bucket_bytes, copy).Finish(), bucket_bytes);
}

Result<DeltaCost> EstimateDeltaCost(const DeltaCostInput& in) {
  if (!ValidElementSize(in.element_size))
    return InvalidArgumentError(
        fmt::format("delta cost: element_size must be 1, 2 or 4, got {}", in.element_size));
  if (in.bucket_bytes % in.element_size != 0)
    return InvalidArgumentError(
        fmt::format("delta cost: bucket_bytes {} is not a multiple of element_size {}",
                    in.bucket_bytes, in.element_size));
  if (!std::isfinite(in.density) || in.density < 0 || in.density > 1)
    return InvalidArgumentError(
        fmt::format("delta cost: density must be in [0, 1], got {}", in.density));
  for (auto [name, v] :
       {std::pair{"link_gbps", in.link_gbps}, std::pair{"encode_gbps", in.encode_gbps},
        std::pair{"decode_gbps", in.decode_gbps}})
    if (!std::isfinite(v) || v <= 0)
      return InvalidArgumentError(
          fmt::format("delta cost: {} must be positive and finite, got {}", name, v));
  const uint64_t elements = in.bucket_bytes / in.element_size;
  const uint64_t changed =
      static_cast<uint64_t>(std::llround(in.density * static_cast<double>(elements)));
  const DeltaSize size = DeltaEncodedBytes(elements, in.element_size, changed);
  DeltaCost c;
  c.kind = size.kind;
  c.full_bytes = in.bucket_bytes;
  c.wire_bytes = size.bytes;
  const double f = static_cast<double>(in.bucket_bytes);
  c.full_seconds = f / (in.link_gbps * 1e9);
  if (size.kind == DeltaKind::kFull) {
    c.delta_seconds = c.full_seconds;  // the encoder sends the bucket whole
    return c;
  }
  const double enc = f / (in.encode_gbps * 1e9), dec = f / (in.decode_gbps * 1e9);
  const double wire = static_cast<double>(size.bytes) / (in.link_gbps * 1e9);
  c.delta_seconds = in.overlap ? std::max({enc, wire, dec}) : enc + wire + dec;
  c.pays = c.delta_seconds < c.full_seconds;
  // Serial: pays while enc + dec < (f - w) / L. Overlapped: while L < min(encode, decode).
  const double saved = 1.0 - static_cast<double>(size.bytes) / f;
  c.break_even_link_gbps = in.overlap ? std::min(in.encode_gbps, in.decode_gbps)
                                      : saved / (1.0 / in.encode_gbps + 1.0 / in.decode_gbps);
  return c;
}

}  // namespace shardsync
