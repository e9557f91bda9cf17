// Argument validation that needs no Buffer: shapes, pointers, alignment, ranges (semantics.md section 7).
#pragma once

#include <cstdint>

#include "epx/epx.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

bool aligned16(const void* p);
// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (null or empty ranges share none): an op that reads one
// while it writes the other refuses that.
bool overlaps(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes);
int64_t row_bytes(epx_dtype dtype, int hidden);
// Throws kInvalidArgument naming the first bad field. `cached`: num_tokens_per_rank is not needed.
void validate_dispatch_args(const DispatchArgs& a, int num_ranks, bool cached, const char* op);
void validate_combine_args(const CombineArgs& a, const CombineOutputs& o, int num_tokens, int num_recv_tokens,
                           const char* op);
DispatchRecord dispatch_record(const DispatchArgs& a);

// Rules that the operations and the size hints share (each lives here once; a hint takes the arguments the ops take
// and accepts exactly what they accept). All throw kInvalidArgument with a message that starts with `op`.
// Ranks of a Buffer: 1..kMaxRanks (creation, the default configs, the internode size hints).
void validate_num_ranks(int num_ranks, const char* op, const char* what = "num_ranks");
// The hidden size of BF16 rows: whole 16-byte vectors, at most kMaxHidden (combine, the low-latency calls, and the
// size hints, whose rows are BF16). `what` names the argument in the message.
void validate_bf16_hidden(int64_t hidden, const char* op, const char* what = "hidden");
// The shape of the low-latency calls of a buffer of num_ranks ranks: num_max_dispatch_tokens_per_rank, hidden and
// the experts (low_latency_size_hint sizes the buffer for the same shape).
void validate_low_latency_shape(int num_ranks, int max_tokens, int hidden, int num_experts, const char* op);

}  // namespace epx
