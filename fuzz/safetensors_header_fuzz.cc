// Fuzzes the safetensors header parser: any bytes must give a clean Status (no crash, no UB,
// no unbounded allocation), and an accepted header must satisfy the invariants readers rely on.
#include <cstdint>
#include <cstdlib>

// The layer libraries are built without coverage or sanitizer flags; compiling the parser into
// this target instruments it, so libFuzzer is guided by (and ASan/UBSan check) the parser itself.
// The archive's copy is then never pulled in by the linker: every symbol it defines is here.
#include "io/safetensors.cc"  // NOLINT(bugprone-suspicious-include)

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = shardsync::ParseSafetensorsHeader({data, size});
  if (!r.ok()) return 0;
  const auto& h = *r;
  if (h.data_start + h.data_size != size) std::abort();
  uint64_t pos = 0;
  for (const auto& e : h.tensors) {
    // Tensors tile the data section in order, each exactly dtype x numel bytes.
    if (e.begin != pos || e.end < e.begin || e.end > h.data_size) std::abort();
    if (e.end - e.begin !=
        static_cast<uint64_t>(e.numel()) * static_cast<uint64_t>(shardsync::DTypeSize(e.dtype))) {
      std::abort();
    }
    pos = e.end;
  }
  if (pos != h.data_size) std::abort();
  return 0;
}
