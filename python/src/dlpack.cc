// Borrowing tensors through DLPack (Debian's libdlpack-dev header) without copying. Only the
// legacy "dltensor" capsule is requested (no max_version), which every producer still returns.
#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <string>

#include "common.h"

namespace shardsync::py_bind {
namespace {

// Type codes newer than this header's DLPack 0.6 (DLPack 1.1 numbering).
constexpr uint8_t kDLBoolCode = 6;
constexpr uint8_t kDLFloat8E4M3FnCode = 10;
constexpr uint8_t kDLFloat8E5M2Code = 12;

Result<DType> DTypeFromDL(DLDataType t, const std::string& what) {
  if (t.lanes != 1) {
    return InvalidArgumentError(what + ": vector dtypes (lanes " + std::to_string(t.lanes) +
                                ") are not supported");
  }
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::kF32;
      if (t.bits == 16) return DType::kF16;
      if (t.bits == 64) return DType::kF64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBF16;
      break;
    case kDLInt:
      if (t.bits == 64) return DType::kI64;
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 16) return DType::kI16;
      if (t.bits == 8) return DType::kI8;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::kU8;
      break;
    case kDLBoolCode:
      if (t.bits == 8) return DType::kBool;
      break;
    case kDLFloat8E4M3FnCode:
      if (t.bits == 8) return DType::kF8E4M3;
      break;
    case kDLFloat8E5M2Code:
      if (t.bits == 8) return DType::kF8E5M2;
      break;
    default:
      break;
  }
  return InvalidArgumentError(what + ": unsupported DLPack dtype (code " + std::to_string(t.code) +
                              ", bits " + std::to_string(t.bits) + ")");
}

Status CheckContiguous(const DLTensor& t, const std::string& what) {
  if (t.strides == nullptr) return OkStatus();  // DLPack: null strides mean compact row-major
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    // A dimension of extent 1 may carry any stride (torch reports such strides freely).
    if (t.shape[i] != 1 && t.strides[i] != expected) {
      std::string s = "(";
      for (int j = 0; j < t.ndim; ++j) s += (j ? ", " : "") + std::to_string(t.strides[j]);
      return InvalidArgumentError(what + ": tensor is not C-contiguous (strides " + s +
                                  ")); pass .contiguous() / np.ascontiguousarray");
    }
    expected *= t.shape[i];
  }
  return OkStatus();
}

void ReleaseManaged(DLManagedTensor* mt) {
  if (mt == nullptr || mt->deleter == nullptr) return;
  // Producers' deleters may drop Python references (numpy); run them under the GIL, unless the
  // interpreter is already gone (then leaking is the only safe choice).
  if (!Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  mt->deleter(mt);
}

Result<DType> DTypeFromBufferFormat(const std::string& fmt, ssize_t itemsize,
                                    const std::string& what) {
  char c = fmt.empty() ? '?' : fmt.back();
  switch (c) {
    case 'f':
      return DType::kF32;
    case 'd':
      return DType::kF64;
    case 'e':
      return DType::kF16;
    case 'b':
      return DType::kI8;
    case 'B':
      return DType::kU8;
    case '?':
      if (fmt == "?") return DType::kBool;
      break;
    case 'h':
      return DType::kI16;
    case 'i':
    case 'l':
    case 'q':
      if (itemsize == 4) return DType::kI32;
      if (itemsize == 8) return DType::kI64;
      break;
    default:
      break;
  }
  return InvalidArgumentError(what + ": unsupported buffer format '" + fmt + "'");
}

TensorRef BorrowBuffer(py::handle obj, const std::string& what, bool writable) {
  py::buffer buf = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info;
  try {
    info = buf.request(writable);  // read-only is fine for sources: they are only read
  } catch (py::error_already_set& e) {
    if (!writable || !e.matches(PyExc_BufferError)) throw;
    ThrowIfError(InvalidArgumentError(what + ": the buffer is read-only; the sync writes into " +
                                      "its destinations"));
  }
  TensorRef ref;
  ref.dtype = Unwrap(DTypeFromBufferFormat(info.format, info.itemsize, what));
  if (info.itemsize != DTypeSize(ref.dtype)) {
    ThrowIfError(InvalidArgumentError(what + ": buffer item size " + std::to_string(info.itemsize) +
                                      " does not match its format"));
  }
  int64_t expected = info.itemsize;
  for (ssize_t i = info.ndim - 1; i >= 0; --i) {
    if (info.shape[i] != 1 && info.strides[i] != expected) {
      ThrowIfError(InvalidArgumentError(what + ": buffer is not C-contiguous"));
    }
    expected *= info.shape[i];
  }
  ref.data = info.ptr;
  ref.shape.assign(info.shape.begin(), info.shape.end());
  ref.nbytes = NumElements(ref.shape) * info.itemsize;
  // The buffer_info's view keeps the exporter's memory pinned until released.
  auto* held = new py::buffer_info(std::move(info));
  auto* owner = new py::object(py::reinterpret_borrow<py::object>(obj));
  ref.keepalive = std::shared_ptr<void>(held, [owner](void* p) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    delete static_cast<py::buffer_info*>(p);
    delete owner;
  });
  return ref;
}

// numpy (and cupy) arrays say whether they may be written; a view of a read-only array says
// so too.
void CheckWriteableFlag(const py::object& obj, const std::string& what) {
  if (!py::hasattr(obj, "flags")) return;
  py::object flags = obj.attr("flags");
  if (!py::hasattr(flags, "writeable")) return;
  if (!flags.attr("writeable").cast<bool>()) {
    ThrowIfError(InvalidArgumentError(what + ": the array is read-only (flags.writeable is " +
                                      "False); the sync writes into its destinations"));
  }
}

}  // namespace

Status CheckHostWritable(const void* data, int64_t bytes, const std::string& what) {
  if (bytes <= 0) return OkStatus();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  std::ifstream maps("/proc/self/maps");
  if (!maps) return OkStatus();  // not Linux / no procfs: nothing to check against
  // Mappings are listed in address order: walk them until [begin, end) is covered.
  uintptr_t covered = begin;
  for (std::string line; covered < end && std::getline(maps, line);) {
    char* rest = nullptr;
    const uintptr_t lo = std::strtoull(line.c_str(), &rest, 16);
    if (rest == nullptr || *rest != '-') continue;
    const uintptr_t hi = std::strtoull(rest + 1, &rest, 16);
    if (hi <= covered) continue;
    if (lo > covered) break;  // a gap: part of the range is not mapped at all
    const char* perms = rest;
    while (*perms == ' ') ++perms;
    if (perms[0] == '\0' || perms[1] != 'w') {
      return InvalidArgumentError(what +
                                  ": its memory is mapped read-only (a read-only "
                                  "np.memmap or file mapping?); the sync writes into " +
                                  "its destinations");
    }
    covered = hi;
  }
  if (covered < end) {
    return InvalidArgumentError(what + ": its memory is not (wholly) mapped in this process");
  }
  return OkStatus();
}

Status CheckNotInBytesObject(const void* data, int64_t bytes, const std::string& what) {
  if (bytes <= 0) return OkStatus();
  // torch.frombuffer(b) and torch.from_numpy(np.frombuffer(b)) give tensors over an immutable
  // bytes object's characters, and nothing says so at bind time: torch has no read-only tensor
  // flag (Debian's 1.13, nor 2.x; it only warns when the tensor is made), DLPack 0.x carries
  // none, and the pages are writable heap. CPython lays a bytes object out as its header, then
  // its characters (PyBytesObject::ob_sval): so memory inside one has, at most 4 KiB before it
  // (frombuffer's offset=), an object header whose type is PyBytes_Type and whose characters
  // cover the whole range. Reads stay inside the readable mapping that holds `data`.
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  uintptr_t floor = p, ceil = p;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    char* rest = nullptr;
    const uintptr_t lo = std::strtoull(line.c_str(), &rest, 16);
    if (rest == nullptr || *rest != '-') continue;
    const uintptr_t hi = std::strtoull(rest + 1, &rest, 16);
    while (*rest == ' ') ++rest;
    if (lo <= p && p < hi && rest[0] == 'r') {
      floor = lo;
      ceil = hi;
      break;
    }
  }
  constexpr uintptr_t kHeader = offsetof(PyBytesObject, ob_sval);
  constexpr uintptr_t kReach = 4096;
  if (p < floor + kHeader) return OkStatus();
  uintptr_t obj = (p - kHeader) & ~uintptr_t{7};
  for (; obj >= floor && obj + kHeader + kReach >= p; obj -= 8) {
    const auto* o = reinterpret_cast<const PyVarObject*>(obj);
    if (o->ob_base.ob_type != &PyBytes_Type || o->ob_size < 0) continue;
    // A live object only: a freed one keeps its type word (pymalloc and glibc's fastbins write
    // the free-list link over ob_refcnt alone), so stale headers in freed memory before an
    // unrelated array matched here. Live: a plausible reference count, and the NUL CPython keeps
    // after the characters (ob_sval[ob_size] == 0).
    const Py_ssize_t refs = o->ob_base.ob_refcnt;
    if (refs < 1 || refs > (Py_ssize_t{1} << 32)) continue;
    const uintptr_t chars = obj + kHeader;
    const uintptr_t end = chars + static_cast<uintptr_t>(o->ob_size);
    if (end < chars || end >= ceil || *reinterpret_cast<const char*>(end) != '\0') continue;
    if (chars <= p && p + static_cast<uintptr_t>(bytes) <= chars + o->ob_size) {
      return InvalidArgumentError(what +
                                  ": its memory is an immutable Python bytes object's "
                                  "(torch.frombuffer / np.frombuffer of bytes?); the sync writes "
                                  "into its destinations: pass a bytearray or a copy");
    }
    if (obj < 8) break;
  }
  return OkStatus();
}

TensorRef BorrowTensor(py::handle obj_in, const std::string& what, bool writable) {
  py::object obj = py::reinterpret_borrow<py::object>(obj_in);
  if (writable) CheckWriteableFlag(obj, what);
  // Destinations in host memory: the pages themselves must be writable, whatever the producer
  // claims (torch has no read-only flag: a tensor over a read-only mapping would crash the sync).
  auto Checked = [&](TensorRef ref) {
    if (writable && !ref.cuda) {
      ThrowIfError(CheckHostWritable(ref.data, ref.nbytes, what));
      ThrowIfError(CheckNotInBytesObject(ref.data, ref.nbytes, what));
    }
    return ref;
  };
  // torch refuses to export tensors that require grad; detach() shares the storage.
  if (py::hasattr(obj, "requires_grad") && py::hasattr(obj, "detach") &&
      obj.attr("requires_grad").cast<bool>()) {
    obj = obj.attr("detach")();
  }
  if (!py::hasattr(obj, "__dlpack__")) {
    if (PyObject_CheckBuffer(obj.ptr())) return Checked(BorrowBuffer(obj, what, writable));
    ThrowIfError(InvalidArgumentError(what + ": " + std::string(py::str(py::type::of(obj))) +
                                      " has neither __dlpack__ nor the buffer protocol"));
  }
  py::object capsule;
  try {
    capsule = obj.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    // numpy refuses read-only arrays through DLPack but exports them as buffers.
    if (e.matches(PyExc_BufferError) && PyObject_CheckBuffer(obj.ptr())) {
      return Checked(BorrowBuffer(obj, what, writable));
    }
    ThrowIfError(InvalidArgumentError(what + ": __dlpack__ failed: " + std::string(e.what())));
  }
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    ThrowIfError(InvalidArgumentError(what + ": __dlpack__ did not return a 'dltensor' capsule"));
  }
  auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  // Consume the capsule (protocol: rename it so its destructor does not free the tensor); from
  // here on we own `mt` and must call its deleter.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  std::shared_ptr<void> keep(mt, [](void* p) { ReleaseManaged(static_cast<DLManagedTensor*>(p)); });
  const DLTensor& t = mt->dl_tensor;
  TensorRef ref;
  ref.keepalive = keep;
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory
      ref.cuda = false;
      ref.device = -1;
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      ref.cuda = true;
      ref.device = t.device.device_id;
      break;
    default:
      ThrowIfError(InvalidArgumentError(what + ": unsupported DLPack device type " +
                                        std::to_string(static_cast<int>(t.device.device_type))));
  }
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    ThrowIfError(InvalidArgumentError(what + ": " + std::to_string(t.ndim) +
                                      " dimensions; at most " + std::to_string(kMaxDims) +
                                      " are supported"));
  }
  ref.dtype = Unwrap(DTypeFromDL(t.dtype, what));
  ThrowIfError(CheckContiguous(t, what));
  ref.shape.assign(t.shape, t.shape + t.ndim);
  ref.data = static_cast<char*>(t.data) + t.byte_offset;
  ref.nbytes = NumElements(ref.shape) * DTypeSize(ref.dtype);
  return Checked(std::move(ref));
}

}  // namespace shardsync::py_bind
