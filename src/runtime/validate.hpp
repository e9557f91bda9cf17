// Argument validation that needs no Buffer: shapes, pointers, alignment, ranges (SPEC section 7).
#pragma once

#include <cstdint>

#include "epx/epx.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

bool aligned16(const void* p);
int64_t row_bytes(epx_dtype dtype, int hidden);
// Throws kInvalidArgument naming the first bad field. `cached`: num_tokens_per_rank is not needed.
void validate_dispatch_args(const DispatchArgs& a, int num_ranks, bool cached, const char* op);
void validate_combine_args(const CombineArgs& a, const CombineOutputs& o, int num_tokens, int num_recv_tokens,
                           const char* op);
DispatchRecord dispatch_record(const DispatchArgs& a);

}  // namespace epx
