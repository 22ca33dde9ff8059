// Shared helpers of the native module `shardsync._C`: Status -> Python exception, and DLPack
// tensor views.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsync/dtype.h"
#include "shardsync/region.h"
#include "shardsync/status.h"

namespace shardsync::py_bind {

namespace py = pybind11;

// How CLI flag names in a C++ message become Python argument names (wording.cc): kArguments
// ("--tp 3" -> "tp=3") for functions taking tp / pp / ... as keywords, kRollout ("--tp 3" ->
// "rollout tp=3") where they arrive inside Plan's rollout spec.
enum class Wording { kArguments, kRollout };
std::string PythonWording(std::string_view msg, Wording wording);

// Thrown by bindings for a non-OK Status; translated to the shardsync.errors subclass of its code,
// its message in Python wording.
struct StatusException {
  Status status;
  Wording wording = Wording::kArguments;
};

inline void ThrowIfError(Status s) {
  if (!s.ok()) throw StatusException{std::move(s)};
}
template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) throw StatusException{r.status()};
  return std::move(r).value();
}

void RegisterErrors(py::module_& m);

// A tensor borrowed through DLPack (or, for host objects that cannot export DLPack, the buffer
// protocol). Holds the producer's DLManagedTensor (or the object) until destroyed, so the memory
// stays valid while a session binds it. No byte is copied.
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  bool cuda = false;  // device memory (kDLCUDA / kDLCUDAManaged)
  int device = -1;    // CUDA device index, -1 on host
  int64_t nbytes = 0;
  std::shared_ptr<void> keepalive;  // releases the producer (under the GIL) when last owner goes
};

// Borrows `obj` (torch / numpy / cupy / anything with __dlpack__). `what` names the tensor in
// errors ("source 'model.embed_tokens.weight'"). Requires a C-contiguous tensor; a torch tensor
// that requires grad is detached first (same storage). `writable` (destinations, which the sync
// writes): a read-only array (numpy flags.writeable False, a read-only buffer, a read-only
// np.memmap) or host memory not mapped writable (a torch tensor over a read-only mapping) is
// InvalidArgument here, instead of being written or crashing the process at sync time.
TensorRef BorrowTensor(py::handle obj, const std::string& what, bool writable = false);

// InvalidArgument naming `what` unless every page of [data, data + bytes) is mapped writable in
// this process (/proc/self/maps). Host memory only.
Status CheckHostWritable(const void* data, int64_t bytes, const std::string& what);
// InvalidArgument naming `what` when [data, data + bytes) lies in an immutable Python bytes
// object (dlpack.cc says how it is found).
Status CheckNotInBytesObject(const void* data, int64_t bytes, const std::string& what);

void RegisterCore(py::module_& m);
void RegisterLayout(py::module_& m);
void RegisterModel(py::module_& m);
void RegisterPlan(py::module_& m);
void RegisterStore(py::module_& m);
void RegisterSession(py::module_& m);

// Region <-> Python: (offsets, extents) lists.
py::tuple RegionToPy(const Region& r);
Region RegionFromPy(py::handle obj, const std::string& what);

}  // namespace shardsync::py_bind
