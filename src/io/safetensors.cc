#include "shardsync/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace shardsync {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Error messages never echo a file's bytes beyond what identifies the fault (a path a
// checkpoint index names may be a symlink to a file the user cannot otherwise read): tensor
// names only when they look like names, and never values.
std::string SafeName(std::string_view name) {
  const bool printable = name.size() <= 256 && std::all_of(name.begin(), name.end(), [](char c) {
                           return c >= 0x20 && c < 0x7f;
                         });
  return printable ? std::string(name) : fmt::format("<a {}-byte name>", name.size());
}

// The dtypes a safetensors file may hold, by their exact safetensors spelling.
constexpr DType kSafetensorsDTypes[] = {DType::kF32,    DType::kBF16,   DType::kF16, DType::kF64,
                                        DType::kF8E4M3, DType::kF8E5M2, DType::kI64, DType::kI32,
                                        DType::kI16,    DType::kI8,     DType::kU8,  DType::kBool};

Result<DType> SafetensorsDType(std::string_view s, std::string_view tensor) {
  std::string known;
  for (DType t : kSafetensorsDTypes) {
    if (DTypeName(t) == s) return t;
    known += (known.empty() ? "" : ", ") + std::string(DTypeName(t));
  }
  return InvalidArgumentError(fmt::format("safetensors tensor '{}': unknown dtype (not one of {})",
                                          SafeName(tensor), known));
}

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Status ParseEntry(const std::string& name, const json& j, SafetensorsEntry* e) {
  auto bad = [&](std::string_view what) {
    return InvalidArgumentError(fmt::format("safetensors tensor '{}': {}", SafeName(name), what));
  };
  if (!j.is_object()) return bad("entry is not a JSON object");
  auto dt = j.find("dtype");
  auto sh = j.find("shape");
  auto off = j.find("data_offsets");
  if (dt == j.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
  if (sh == j.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
  if (off == j.end() || !off->is_array() || off->size() != 2) {
    return bad("'data_offsets' must be an array [begin, end]");
  }
  e->name = name;
  SS_ASSIGN_OR_RETURN(e->dtype, SafetensorsDType(dt->get<std::string>(), name));
  // numel overflow check: every product stays below 2^62 so byte sizes fit in int64 too.
  constexpr uint64_t kLimit = uint64_t{1} << 62;
  uint64_t numel = 1;
  if (sh->size() > 16) return bad(fmt::format("shape has {} dimensions (max 16)", sh->size()));
  for (const json& d : *sh) {
    if (!d.is_number_unsigned()) return bad("shape entries must be non-negative integers");
    const uint64_t v = d.get<uint64_t>();
    if (v >= kLimit || (v != 0 && numel > kLimit / v)) return bad("shape element count overflows");
    numel *= v;
    e->shape.push_back(static_cast<int64_t>(v));
  }
  for (const json& o : *off) {
    if (!o.is_number_unsigned()) return bad("data_offsets must be non-negative integers");
  }
  e->begin = (*off)[0].get<uint64_t>();
  e->end = (*off)[1].get<uint64_t>();
  if (e->end < e->begin) {
    return bad(fmt::format("data_offsets [{}, {}] end before begin", e->begin, e->end));
  }
  const uint64_t elem = static_cast<uint64_t>(DTypeSize(e->dtype));
  if (numel > kLimit / elem) return bad("byte size overflows");
  if (e->end - e->begin != numel * elem) {
    return bad(fmt::format("data_offsets [{}, {}] hold {} bytes but {} {} x {} needs {}", e->begin,
                           e->end, e->end - e->begin, ShapeToString(e->shape), DTypeName(e->dtype),
                           elem, numel * elem));
  }
  return OkStatus();
}

bool IsRegularFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::Find(std::string_view name) const {
  for (const auto& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

// A safetensors header is an object of tensor objects (dtype, a shape of a few dims, two data
// offsets) and string metadata: three levels, short arrays. nlohmann builds the whole tree first,
// and a hostile 80 MB header of nested or long arrays cost 33 s and 5.95 GB of it: a linear scan
// refuses those shapes before parsing, naming the byte (never echoing the header).
Status CheckHeaderShape(const char* p, uint64_t n) {
  constexpr int kMaxDepth = 8;
  constexpr uint64_t kMaxArrayItems = 64;
  bool arr[kMaxDepth + 1] = {};
  uint64_t items[kMaxDepth + 1] = {};
  int depth = 0;
  bool in_string = false;
  for (uint64_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) {
        return InvalidArgumentError(fmt::format(
            "safetensors: the header nests deeper than {} levels at byte {} (not a safetensors "
            "header)",
            kMaxDepth, 8 + i));
      }
      arr[depth] = c == '[';
      items[depth] = 0;
    } else if (c == '}' || c == ']') {
      if (depth > 0) --depth;
    } else if (c == ',' && depth > 0 && arr[depth] && ++items[depth] >= kMaxArrayItems) {
      return InvalidArgumentError(fmt::format(
          "safetensors: the header has an array of more than {} items at byte {} (shapes and "
          "offsets are a few numbers)",
          kMaxArrayItems, 8 + i));
    }
  }
  return OkStatus();
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> file) {
  if (file.size() < 8) {
    return DataLossError(fmt::format(
        "safetensors: file is {} bytes, shorter than the 8-byte header length", file.size()));
  }
  // The length field is the file's own bytes: say where it is, not what it holds.
  const uint64_t n = ReadLe64(file.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return InvalidArgumentError(
        fmt::format("safetensors: the header length at bytes 0-7 exceeds the limit of {} bytes "
                    "(not a safetensors file?)",
                    kMaxSafetensorsHeaderBytes));
  }
  if (n > file.size() - 8) {
    return DataLossError(
        fmt::format("safetensors: the header length at bytes 0-7 runs past the end of the file "
                    "({} bytes): truncated, or not a safetensors file",
                    file.size()));
  }
  const char* hb = reinterpret_cast<const char*>(file.data() + 8);
  SS_RETURN_IF_ERROR(CheckHeaderShape(hb, n));
  json j;
  try {
    j = json::parse(hb, hb + n);
  } catch (const json::parse_error& e) {
    // nlohmann's message quotes the bytes it last read: report the offset instead.
    return InvalidArgumentError(
        fmt::format("safetensors: the header (bytes 8-{}) is not valid JSON (error near byte {})",
                    8 + n, 8 + (e.byte > 0 ? e.byte - 1 : 0)));
  } catch (const std::exception&) {
    return InvalidArgumentError("safetensors: the header (bytes 8-) is not valid JSON");
  }
  if (!j.is_object()) return InvalidArgumentError("safetensors: header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  h.data_size = file.size() - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object())
        return InvalidArgumentError("safetensors: __metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return InvalidArgumentError(fmt::format(
              "safetensors: __metadata__ value of '{}' is not a string", SafeName(m.key())));
        }
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    SS_RETURN_IF_ERROR(ParseEntry(it.key(), *it, &e));
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : h.tensors) {
    if (e.end > h.data_size) {
      return DataLossError(fmt::format(
          "safetensors tensor '{}': data [{}, {}) runs past the end of the data section ({} "
          "bytes): truncated file",
          SafeName(e.name), e.begin, e.end, h.data_size));
    }
    if (e.begin < pos) {
      return DataLossError(fmt::format("safetensors tensor '{}': data [{}, {}) overlaps '{}'",
                                       SafeName(e.name), e.begin, e.end, SafeName(prev->name)));
    }
    if (e.begin > pos) {
      return DataLossError(
          fmt::format("safetensors tensor '{}': gap of {} bytes before its data at offset {}",
                      SafeName(e.name), e.begin - pos, e.begin));
    }
    pos = e.end;
    prev = &e;
  }
  if (pos != h.data_size) {
    return DataLossError(fmt::format(
        "safetensors: data section is {} bytes but the tensors cover {} (trailing bytes)",
        h.data_size, pos));
  }
  return h;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise block until a writer appears; the
  // regular-file check below then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    std::string msg = fmt::format("safetensors file '{}': {}", path, std::strerror(err));
    return err == ENOENT ? NotFoundError(msg) : UnavailableError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgumentError(fmt::format("safetensors file '{}': not a regular file", path));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return InternalError(
          fmt::format("safetensors file '{}': mmap: {}", path, std::strerror(err)));
    }
    f->base_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  auto h = ParseSafetensorsHeader({f->base_, f->size_});
  if (!h.ok()) {
    Status s = h.status();
    s.Annotate(path);
    return s;
  }
  f->header_ = std::move(h).value();
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) {
    f->index_.emplace(f->header_.tensors[i].name, i);
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

Result<TensorView> SafetensorsFile::Get(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return NotFoundError(fmt::format("tensor '{}' not found in '{}'", name, path_));
  }
  const SafetensorsEntry* e = &header_.tensors[it->second];
  TensorView v;
  v.name = e->name;
  v.dtype = e->dtype;
  v.shape = e->shape;
  v.data = {base_ + header_.data_start + e->begin, e->bytes()};
  return v;
}

Result<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& path) {
  std::unique_ptr<SafetensorsCheckpoint> c(new SafetensorsCheckpoint());
  const fs::path p(path);
  std::error_code ec;
  if (!fs::exists(p, ec))
    return NotFoundError(fmt::format("'{}': no such file or directory", path));
  std::vector<std::pair<std::string, std::vector<std::string>>> shards;  // file -> expected names
  if (fs::is_directory(p, ec)) {
    c->dir_ = p.string();
    const fs::path index = p / "model.safetensors.index.json";
    if (IsRegularFile(index)) {
      std::ifstream in(index);
      std::stringstream ss;
      ss << in.rdbuf();
      const std::string text = ss.str();
      json j = json::parse(text, nullptr, false);
      if (j.is_discarded() || !j.is_object()) {
        return InvalidArgumentError(fmt::format("'{}': not a JSON object", index.string()));
      }
      auto wm = j.find("weight_map");
      if (wm == j.end() || !wm->is_object()) {
        return InvalidArgumentError(
            fmt::format("'{}': missing or non-object 'weight_map'", index.string()));
      }
      std::map<std::string, std::vector<std::string>> by_file;
      for (auto it = wm->begin(); it != wm->end(); ++it) {
        if (!it->is_string()) {
          return InvalidArgumentError(fmt::format("'{}': weight_map['{}'] is not a string",
                                                  index.string(), SafeName(it.key())));
        }
        const std::string file = it->get<std::string>();
        const fs::path fp(file);
        if (file.empty() || fp.is_absolute() || file.find('/') != std::string::npos ||
            file == "." || file == "..") {
          return InvalidArgumentError(
              fmt::format("'{}': weight_map['{}'] = '{}' is not a file name in the directory",
                          index.string(), SafeName(it.key()), SafeName(file)));
        }
        by_file[file].push_back(it.key());
      }
      for (auto& [file, names] : by_file) shards.emplace_back((p / file).string(), names);
    } else if (IsRegularFile(p / "model.safetensors")) {
      shards.emplace_back((p / "model.safetensors").string(), std::vector<std::string>{});
    } else {
      return NotFoundError(fmt::format(
          "'{}': no model.safetensors or model.safetensors.index.json in the directory", path));
    }
  } else {
    c->dir_ = p.has_parent_path() ? p.parent_path().string() : std::string(".");
    shards.emplace_back(p.string(), std::vector<std::string>{});
  }
  for (auto& [file, expected] : shards) {
    SS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(file));
    const size_t idx = c->files_.size();
    const std::set<std::string_view> wanted(expected.begin(), expected.end());
    for (const auto& e : f->header().tensors) {
      if (!wanted.empty() && wanted.count(e.name) == 0) {
        continue;  // present in the shard but mapped elsewhere by the index: the index decides
      }
      auto [it, inserted] = c->where_.emplace(e.name, idx);
      if (!inserted) {
        return DataLossError(fmt::format("tensor '{}' is present in both '{}' and '{}'",
                                         SafeName(e.name), c->files_[it->second]->path(), file));
      }
    }
    for (const auto& name : expected) {
      if (!f->Get(name).ok()) {
        return DataLossError(fmt::format(
            "model.safetensors.index.json maps tensor '{}' to '{}', which does not hold it", name,
            file));
      }
    }
    c->files_.push_back(std::move(f));
  }
  return c;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, idx] : where_) out.push_back(name);
  return out;
}

Result<TensorView> SafetensorsCheckpoint::Get(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    return NotFoundError(fmt::format("tensor '{}' not found in checkpoint '{}'", name, dir_));
  }
  return files_[it->second]->Get(name);
}

Result<std::vector<uint8_t>> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return InvalidArgumentError(
          fmt::format("safetensors writer: invalid tensor name '{}'", t.name));
    }
    if (!seen.insert(t.name).second) {
      return InvalidArgumentError(fmt::format("safetensors writer: duplicate tensor '{}'", t.name));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return InvalidArgumentError(fmt::format("safetensors writer: tensor '{}' has shape {}",
                                                t.name, ShapeToString(t.shape)));
      }
    }
    const uint64_t need = static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
    if (t.data.size() != need) {
      return InvalidArgumentError(
          fmt::format("safetensors writer: tensor '{}' has {} bytes, {} {} needs {}", t.name,
                      t.data.size(), ShapeToString(t.shape), DTypeName(t.dtype), need));
    }
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {off, off + need}}};
    off += need;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - (text.size() % 8)) % 8, ' ');
  std::vector<uint8_t> out(8 + text.size() + off);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* dst = out.data() + 8 + text.size();
  for (const auto& t : tensors) {
    if (!t.data.empty()) std::memcpy(dst, t.data.data(), t.data.size());
    dst += t.data.size();
  }
  return out;
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  SS_ASSIGN_OR_RETURN(auto bytes, SerializeSafetensors(tensors, metadata));
  // A fresh file of a random name beside the target (mkstemp: O_CREAT | O_EXCL, mode 0600), so a
  // file or symlink planted under a predictable temporary name is never opened or followed, and
  // the weights are readable by this user only; the rename then replaces `path` itself (a
  // symlink there included, never its target).
  std::string tmp = path + ".XXXXXX";
  const int fd = mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) {
    return UnavailableError(
        fmt::format("cannot create a temporary file beside '{}': {}", path, std::strerror(errno)));
  }
  size_t off = 0;
  int err = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    off += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    return UnavailableError(fmt::format("writing '{}': {}", path, std::strerror(err)));
  }
  return OkStatus();
}

Status ConvertElements(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(src_dtype));
    return OkStatus();
  }
  auto load = [&](int64_t i) -> float {
    switch (src_dtype) {
      case DType::kF32:
        return static_cast<const float*>(src)[i];
      case DType::kBF16:
        return BF16ToF32(static_cast<const uint16_t*>(src)[i]);
      case DType::kF16:
        return F16ToF32(static_cast<const uint16_t*>(src)[i]);
      case DType::kF64:
        return static_cast<float>(static_cast<const double*>(src)[i]);
      default:
        return 0.f;
    }
  };
  auto is_float = [](DType t) {
    return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF64;
  };
  if (!is_float(src_dtype) || !is_float(dst_dtype)) {
    return UnimplementedError(fmt::format("conversion from {} to {} is not supported",
                                          DTypeName(src_dtype), DTypeName(dst_dtype)));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(i);
    switch (dst_dtype) {
      case DType::kF32:
        static_cast<float*>(dst)[i] = v;
        break;
      case DType::kBF16:
        static_cast<uint16_t*>(dst)[i] = F32ToBF16(v);
        break;
      case DType::kF16:
        static_cast<uint16_t*>(dst)[i] = F32ToF16(v);
        break;
      case DType::kF64:
        static_cast<double*>(dst)[i] = v;
        break;
      default:
        break;
    }
  }
  return OkStatus();
}

}  // namespace shardsync
