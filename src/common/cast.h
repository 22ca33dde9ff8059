// The CPU element casts (F32 / BF16 / F16) of the host data path: the sync layer's packer and host
// sender and the job harness's baselines cast through these, bit for bit as the device kernels.
#pragma once

#include <cstdint>

#include "shardsync/dtype.h"

namespace shardsync {

// Element cast between F32 / BF16 / F16 (plain copy for equal dtypes), as the packer does it.
void CastInto(const void* in, DType a, void* out, DType b, int64_t n);
// fp32 -> bf16 cast (as CastInto) of the first k elements of in[0, n), with k a multiple of 16
// chosen by the kernel (0 where no vector unit does it), adding the checksum.h partial sum of
// the k * 2 bytes written to *sum, out[0] being the start of message word `word`. Returns k.
int64_t CastF32ToBF16WithSum(const void* in, void* out, int64_t n, uint64_t word, uint64_t* sum);

}  // namespace shardsync
