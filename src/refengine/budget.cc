// Host memory budget: every allocation the reference engine sizes from its input (config dims,
// checkpoint shapes, token counts) is checked against it before it is made, so an absurd but
// valid config fails with a message naming the model instead of aborting on std::bad_alloc or
// waking the OOM killer.
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "refengine/kernels.h"
#include "shardsync/refengine.h"

namespace shardsync {
namespace {

// Pages of this process's address space and data segment (/proc/self/statm), 0 when unknown.
void CurrentUsage(int64_t* vm_bytes, int64_t* data_bytes) {
  *vm_bytes = *data_bytes = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return;
  long long size = 0, resident = 0, shared = 0, text = 0, lib = 0, data = 0;
  if (std::fscanf(f, "%lld %lld %lld %lld %lld %lld", &size, &resident, &shared, &text, &lib,
                  &data) == 6) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    *vm_bytes = size * page;
    *data_bytes = data * page;
  }
  std::fclose(f);
}

}  // namespace

int64_t HostMemoryBudget(bool this_process) {
  int64_t budget = INT64_MAX;
  struct sysinfo si {};
  if (sysinfo(&si) == 0 && si.totalram > 0) {
    // 80% of physical memory: the reference engine converts every weight to fp32 up front, and
    // the rest of the machine keeps running.
    const double ram = static_cast<double>(si.totalram) * si.mem_unit;
    budget = static_cast<int64_t>(0.8 * ram);
  }
  if (!this_process) return budget == INT64_MAX ? -1 : budget;
  int64_t vm = 0, data = 0;
  CurrentUsage(&vm, &data);
  rlimit r{};
  if (getrlimit(RLIMIT_AS, &r) == 0 && r.rlim_cur != RLIM_INFINITY) {
    budget = std::min<int64_t>(budget, std::max<int64_t>(0, int64_t(r.rlim_cur) - vm));
  }
  if (getrlimit(RLIMIT_DATA, &r) == 0 && r.rlim_cur != RLIM_INFINITY) {
    budget = std::min<int64_t>(budget, std::max<int64_t>(0, int64_t(r.rlim_cur) - data));
  }
  return budget == INT64_MAX ? -1 : budget;
}

Status CheckHostMemory(int64_t bytes, std::string_view what, std::string_view purpose,
                       bool this_process) {
  const int64_t budget = HostMemoryBudget(this_process);
  if (budget < 0 || bytes <= budget) return OkStatus();
  const std::string need = bytes == INT64_MAX ? std::string("over 8 EiB")
                                              : fmt::format("{:.1f} GiB", bytes / 1073741824.0);
  return InvalidArgumentError(fmt::format(
      "{}: {}: {} needed, more than the {:.1f} GiB {}", what, purpose, need, budget / 1073741824.0,
      this_process ? "this process may allocate (80% of physical memory, capped by RLIMIT_AS / "
                     "RLIMIT_DATA)"
                   : "this host has for it (80% of physical memory)"));
}

namespace refengine {

int64_t ForwardBytes(const ModelSpec& s, int64_t T, int64_t tp) {
  const int64_t H = s.hidden_size, d = s.head_dim;
  const int64_t q = SatMul(s.num_attention_heads, d), kv = SatMul(s.num_key_value_heads, d);
  const int64_t mlp = std::max(s.intermediate_size, s.moe_intermediate_size);
  // Per token: x, xn, delta, partial sums (4 H), q / attention (2 q), k / v (2 kv, plus the
  // cache's copy of both per layer), the MLP's gate and up (2 mlp) and the router (experts).
  int64_t per_token = SatAdd(SatMul(4, H), SatMul(2, q));
  per_token = SatAdd(per_token, SatMul(2, kv));
  per_token = SatAdd(per_token, SatMul(2, mlp));
  per_token = SatAdd(per_token, s.num_experts);
  // Under TP a rank holds at least one kv head (vLLM / SGLang replicate kv heads past tp = n_kv).
  const int64_t kv_all = std::max(kv, SatMul(std::max<int64_t>(1, tp), d));
  const int64_t cache = SatMul(SatMul(2, kv_all), s.num_hidden_layers);
  const int64_t floats = SatAdd(SatMul(T, SatAdd(per_token, cache)), s.vocab_size);
  return SatMul(floats, 4);
}

}  // namespace refengine
}  // namespace shardsync
