// Config checks that the operations share (the public helpers are in epx.hpp).
#pragma once

#include <cstdint>

#include "epx/epx.hpp"

namespace epx {

// Throws kInvalidArgument naming the first bad field of an internode config for D domains of G ranks.
void validate_internode_config(const Config& config, int num_nvl_ranks, int num_domains);

// Tokens an intranode dispatch sender of 3 or more ranks publishes per tail update, for records of record_bytes:
// config.num_max_send_tokens, fewer where a chunk's records pass 180 KiB, never fewer than two tokens per warp of a
// peer group. At 4 ranks and hidden 7168 that is 24 for FP8 rows and 12 for BF16 rows, the best of each in the sweeps
// (docs/tuning.md); the defaults at other rank counts stay as they are.
int dispatch_send_chunk(const Config& config, int64_t record_bytes, int num_ranks);

}  // namespace epx
