// Internal: the block-FP8 form of a shard map (BuildShardMap calls it when the model is
// quantized).
#pragma once

#include "shardsync/shard_map.h"

namespace shardsync::internal {

// Turns every engine parameter filled from quantized HF weights into the two parameters the
// engine registers: the weight as float8_e4m3fn (same shape, same pieces) and its fp32
// `weight_scale_inv` right after it, whose pieces carry the source blocks' scales. Refuses,
// naming the rank, parameter and HF tensor, any piece whose quantized dims do not sit on the
// 128 grid, with the engines' own wording (validate_block_quant_shapes / create_fp8_moe_weight_).
Status QuantizeShardMap(ShardMap* map);

}  // namespace shardsync::internal
