// Layout of the low-latency region of a rank: after the high-throughput ring region inside the CUDA IPC
// allocation (so every peer maps it), or, in builds with NVSHMEM, a separate allocation in NVSHMEM symmetric
// memory (runtime/symmetric_memory.hpp). Two buffer sets alternate between calls (double buffering):
//
//   set s: [ signals | receive area | combine send area ]
//     signals        dispatch_count[E]: at the receiver, index local_expert * R + src_rank; count + 1, cleared by
//                                       the receiver after it copied the rows
//                    combine_flag[E]:   at the token's source rank, index global expert; 1 when that expert's
//                                       rows have all been written here, cleared after the reduction
//                    sent[E]:           at the sender, tokens already written for expert e (local counter)
//                    dispatch_busy[E]:  at the sender, index global expert; set to 1 by the sender before it
//                                       signals e's count, cleared (0, a remote store) by e's rank after it
//                                       copied the rows: a sender writes rows for e only once it reads 0 there
//                    combine_busy[E]:   at the expert's rank, index local_expert * R + src_rank; set to 1 before
//                                       the combine flag is raised at src, cleared by src after its reduction
// The busy slots turn back-pressure into polls of local memory: the consumer pushes "free" to the producer
// (one remote store per slot and call) instead of every producer warp reading the consumer's slot over the
// link, where the reply queues behind the bulk data coming the other way (~4 us mean, ~10 us worst per poll).
//     receive area   dispatch: [local expert][src rank][M] records (token row, scales, source token index)
//                    combine:  [global expert][M] bf16 rows (expert outputs for this rank's tokens)
//     combine send   [local expert][R * M] bf16 rows: where zero-copy combine reads expert outputs from;
//                    with NVSHMEM peers also the staging of dispatch records and of combine rows (sources of
//                    NVSHMEM puts must be symmetric memory)
//
// Signals sit at fixed offsets so that calls with other sizes never misread them.
#pragma once

#include <cstdint>

#include "runtime/limits.hpp"

namespace epx {

// Largest expert count of the low-latency signals (fixed offsets).
constexpr int kLowLatencyMaxExperts = 1024;
// Largest num_max_dispatch_tokens_per_rank (M).
constexpr int kLowLatencyMaxTokens = 4096;

struct LowLatencyShape {
  int num_ranks;
  int max_tokens;  // M
  int hidden;
  int num_experts;
  int fp8;         // records carry e4m3 rows and float scales instead of bf16 rows
};

// One dispatch record: [row][scales][src token int32 + padding]
struct LowLatencyRecord {
  int64_t row_bytes;
  int64_t scale_offset;
  int64_t meta_offset;
  int64_t bytes;
  EPX_HD static LowLatencyRecord make(int hidden, bool fp8) {
    LowLatencyRecord r{};
    r.row_bytes = int64_t(hidden) * (fp8 ? 1 : 2);
    r.scale_offset = align_up(r.row_bytes, 16);
    r.meta_offset = r.scale_offset + (fp8 ? align_up(int64_t(hidden / kFp8GroupSize) * 4, 16) : 0);
    r.bytes = r.meta_offset + 16;
    return r;
  }
};

struct LowLatencyLayout {
  static constexpr int64_t kSignalBytes = int64_t(kLowLatencyMaxExperts) * 4;
  static constexpr int64_t kSignalsBytes = align_up(5 * kSignalBytes, kAlign);

  int64_t set_bytes;           // fixed for the buffer: half of num_rdma_bytes, so set 1 never moves
  int64_t receive_bytes;       // of this call's shape
  int64_t combine_send_bytes;  // of this call's shape

  // Bytes one set needs for a shape (BF16 records: larger than FP8 ones).
  EPX_HD static int64_t required_set_bytes(int max_tokens, int hidden, int num_experts) {
    const int64_t record = LowLatencyRecord::make(hidden, false).bytes;
    const int64_t dispatch_recv = int64_t(num_experts) * max_tokens * record;  // [L][R][M] = E * M records
    const int64_t combine_recv = int64_t(num_experts) * max_tokens * hidden * 2;
    const int64_t receive = align_up(dispatch_recv > combine_recv ? dispatch_recv : combine_recv, kAlign);
    const int64_t combine_send = align_up(int64_t(num_experts) * max_tokens * hidden * 2, kAlign);  // [L][R*M]
    return kSignalsBytes + receive + combine_send;
  }
  EPX_HD static LowLatencyLayout make(int64_t set_bytes, int max_tokens, int hidden, int num_experts) {
    LowLatencyLayout l{};
    l.set_bytes = set_bytes;
    const int64_t record = LowLatencyRecord::make(hidden, false).bytes;
    const int64_t dispatch_recv = int64_t(num_experts) * max_tokens * record;
    const int64_t combine_recv = int64_t(num_experts) * max_tokens * hidden * 2;
    l.receive_bytes = align_up(dispatch_recv > combine_recv ? dispatch_recv : combine_recv, kAlign);
    l.combine_send_bytes = align_up(int64_t(num_experts) * max_tokens * hidden * 2, kAlign);
    return l;
  }
  EPX_HD bool fits() const { return kSignalsBytes + receive_bytes + combine_send_bytes <= set_bytes; }

  EPX_HD uint8_t* set_base(void* region, int set) const { return static_cast<uint8_t*>(region) + set * set_bytes; }
  EPX_HD int32_t* dispatch_count(void* region, int set) const { return reinterpret_cast<int32_t*>(set_base(region, set)); }
  EPX_HD int32_t* combine_flag(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + kSignalBytes);
  }
  EPX_HD int32_t* sent(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + 2 * kSignalBytes);
  }
  EPX_HD int32_t* dispatch_busy(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + 3 * kSignalBytes);
  }
  EPX_HD int32_t* combine_busy(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + 4 * kSignalBytes);
  }
  EPX_HD uint8_t* receive(void* region, int set) const { return set_base(region, set) + kSignalsBytes; }
  EPX_HD uint8_t* combine_send(void* region, int set) const {
    return set_base(region, set) + kSignalsBytes + receive_bytes;
  }
  // Where a dispatch stages token t's record (at t * record bytes) for NVSHMEM puts, whose sources must be
  // symmetric memory. It is the combine-send area of the same set, which only a combine's send phase on that
  // set reads: a zero-copy input written there is for the very next call, and a dispatch on this set is not
  // that call; the puts are complete before the dispatch kernel ends.
  EPX_HD uint8_t* dispatch_stage(void* region, int set) const { return combine_send(region, set); }
  EPX_HD bool dispatch_stage_fits(int max_tokens, int64_t record_bytes) const {
    return int64_t(max_tokens) * record_bytes <= combine_send_bytes;
  }
};

}  // namespace epx
