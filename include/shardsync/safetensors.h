// Safetensors: the file format of Hugging Face checkpoints, read (mmap'd, header validated) and
// written.
//
// File layout: 8-byte little-endian header length N, then N bytes of JSON
//   {"<tensor>": {"dtype": "BF16", "shape": [d0, ...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// (optionally padded with spaces), then the data section. Offsets are relative to the data section.
// Like the reference implementation (huggingface/safetensors), the tensors must tile the data
// section exactly: sorted by offset they start at 0, leave no gap, do not overlap and end at the
// end of the file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync {

// Header length limit (the reference implementation uses the same 100 MB bound).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets inside the data section, [begin, end)
  uint64_t end = 0;
  int64_t numel() const { return NumElements(shape); }
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + header length
  uint64_t data_size = 0;   // bytes of the data section
  // The entry named `name`, or nullptr (linear scan; SafetensorsFile::Get is indexed).
  const SafetensorsEntry* Find(std::string_view name) const;
};

// Parses and validates the header of a safetensors file whose complete contents are `file`
// (only the first 8 + N bytes are read; the size of `file` is the file size the offsets are
// checked against). Pure function of the bytes, fuzzed by fuzz/safetensors_header_fuzz.cc.
// Errors (the message names the tensor where there is one):
//   DataLoss: file shorter than 8 bytes, header length past the end of the file, a tensor's
//     data past the end of the file, a gap or overlap between tensors, data section longer than
//     the tensors (trailing bytes).
//   InvalidArgument: header length above kMaxSafetensorsHeaderBytes, invalid JSON, not an object,
//     unknown dtype, malformed shape or data_offsets, shape numel overflow, byte size that does
//     not match dtype x numel, malformed __metadata__.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> file);

// A read-only view of one tensor's bytes (valid while its file is open).
struct TensorView {
  std::string_view name;
  DType dtype = DType::kF32;
  Shape shape;
  std::span<const uint8_t> data;
  int64_t numel() const { return NumElements(shape); }
};

// One safetensors file, mmap'd read-only. Not copyable; thread-safe for concurrent reads.
class SafetensorsFile {
 public:
  // NotFound if the file does not exist; errors of ParseSafetensorsHeader prefixed with the path.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t file_size() const { return size_; }
  // NotFound naming the tensor and the file.
  Result<TensorView> Get(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string_view, size_t> index_;  // name -> header_.tensors index
};

// A checkpoint: a single .safetensors file, or a directory holding model.safetensors, or a
// directory holding model.safetensors.index.json ({"weight_map": {tensor: file}}) and its shards.
class SafetensorsCheckpoint {
 public:
  // Index errors name the field or tensor: a shard file outside the directory or missing
  // (NotFound), a tensor the index maps to a file that lacks it (DataLoss), a tensor present in
  // two files (DataLoss).
  static Result<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& path);

  // The directory config.json is expected in (the file's directory, or the directory itself).
  const std::string& directory() const { return dir_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // NotFound naming the tensor.
  Result<TensorView> Get(std::string_view name) const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor -> index into files_
};

// A tensor to write: bytes are row-major, size dtype x numel.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::span<const uint8_t> data;
};

// Serializes tensors (data in the given order) into safetensors bytes; the header is padded with
// spaces to a multiple of 8 bytes so the data section is aligned. InvalidArgument naming the
// tensor: empty or duplicate name, "__metadata__", a negative dimension, data size not dtype x
// numel.
Result<std::vector<uint8_t>> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});
// SerializeSafetensors, written to `path` through a temporary file and a rename (readers never
// see a partial file).
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// Element conversion between f32, bf16, f16 and f64 (the float dtypes checkpoints hold);
// Unimplemented for other pairs unless src == dst (plain copy).
Status ConvertElements(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t n);

}  // namespace shardsync
