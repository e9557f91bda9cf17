// Layout of the low-latency region of a rank: after the high-throughput ring region inside the CUDA IPC
// allocation (so every peer maps it), or, in builds with NVSHMEM, a separate allocation in NVSHMEM symmetric
// memory (runtime/symmetric_memory.hpp). Two buffer sets alternate between calls (double buffering):
//
//   set s: [ signals | receive area | combine send area ]
//     signals        dispatch_count[E]: at the receiver, index local_expert * R + src_rank; the source's
//                                       selections of the expert + 1 (sent before the rows), cleared by the
//                                       receiver after it copied the rows
//                    dispatch_arrived[E]: at the receiver, same index; rows of that (expert, source) whose
//                                       record and row map entry are written (relaxed adds by the senders,
//                                       behind one release fence per writer lane), cleared by the receiver
//                                       after it copied the rows
//                    combine_arrived[E]: at the token's source rank, index expert rank * (E_max / R) + its
//                                       local expert (E_max = kLowLatencyMaxExperts: the same slots whatever
//                                       a call's expert count, so the running totals keep pairing up); work items
//                                       (kernels/low_latency/combine.cu) of that expert's rows written here, summed
//                                       over every combine on the set (never cleared but by clean; added to
//                                       by the sending blocks, a release each; compared wrap-safe)
//                    combine_sent[E]:   at the sender, per (local expert, source): the running total of work
//                                       items sent to that pair on the set, this rank's own
//                    combine_target[E]: at the token's source rank, index as combine_arrived, uint64: (k + 1) << 32
//                                       | the value combine_arrived[e] reaches when the set's k-th op (a
//                                       combine) has written all of e's rows here; posted by the sender
//                                       before its rows (relaxed), never cleared but by clean
//                    epochs:            per set, monotonic counters (never cleared but by clean):
//                      recv_seen[R]     uint64: receive phases of rank r's blocks on the set, added to here
//                                       by each of r's blocks (G per op: every rank launches the same grid
//                                       G): with rank masking when the receive is done, without it at the
//                                       start of r's next low-latency kernel (block_told)
//                      block_ops[G]     uint32, this rank's own: ops block b has received on the set (block
//                                       b's k; only block b reads and writes it). As a rank receives every
//                                       call before sending the next on the set (the host checks that
//                                       order), it is also the number of earlier ops there
//                      block_told[G]    uint32, this rank's own: how many of those block b has added to
//                                       the ranks' recv_seen (without rank masking it adds each receive at
//                                       the start of its next kernel, kernels/low_latency/epochs.cuh)
// Back-pressure: before writing into rank r's set for its k-th op there, of either kind, a sender waits (a
// poll of its own memory) until recv_seen[r] >= k * G: every block of r has received every earlier op on that
// set. The count slots are cleared before that add. Dispatch and combine share the counters, so a combine can
// never overwrite dispatch records a slow peer has not received yet (dispatch A, dispatch B, combine A).
// The combine's arrival counters are not cleared: each combine's receivers await the totals its senders posted.
//     receive area   dispatch: [src rank][M] records (token row, then scales with FP8; a token goes
//                              once to each rank that holds one of its experts, at its own index), then the
//                              row map [local expert][src rank][M] int32: the source token of each slot
//                    combine:  [global expert][M] bf16 rows (expert outputs for this rank's tokens)
//     combine send   [local expert][R * M] bf16 rows: where zero-copy combine reads expert outputs from;
//                    with NVSHMEM peers also the staging of dispatch records and of combine rows (sources of
//                    NVSHMEM puts must be symmetric memory)
//
// Signals sit at fixed offsets so that calls with other sizes never misread them.
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

// Limits of the low-latency mode (exported through epx_get_limits).
// Largest expert count of the low-latency signals (fixed offsets).
constexpr int kLowLatencyMaxExperts = 1024;
constexpr int kLowLatencyMaxBlocks = 256;  // the grid of the low-latency kernels (one block per SM, at most)
// Largest num_max_dispatch_tokens_per_rank (M).
constexpr int kLowLatencyMaxTokens = 4096;
// Ranks: one NVLink domain (the peer map holds one region pointer per rank of the domain).
constexpr int kLowLatencyMaxRanks = kMaxNvlRanks;
// Top-k slots per token: one lane per slot in the dispatch's send phase.
constexpr int kLowLatencyMaxTopk = kMaxTopk;

// One dispatch record: [row][scales (FP8 only)][top-k (with weights only)], 16-byte aligned. The source token is
// its index in [src rank][M] (the row map names it per slot). A dispatch given topk_weights (for the rank-reduced
// combine) appends the token's top-k: float weights [K], then int16 global experts [K] (-1 for none), the same for
// every destination (one staged record serves them all); the receiver finds its own slots among them.
struct LowLatencyRecord {
  int64_t row_bytes;
  int64_t scale_offset;
  int64_t topk_offset;  // weights [K] float at topk_offset, experts [K] int16 at topk_offset + 4 * K
  int64_t bytes;
  EPX_HD static LowLatencyRecord make(int hidden, bool fp8, int topk_carried = 0) {
    LowLatencyRecord r{};
    r.row_bytes = int64_t(hidden) * (fp8 ? 1 : 2);
    r.scale_offset = align_up(r.row_bytes, 16);
    r.topk_offset = r.scale_offset + (fp8 ? align_up(int64_t(hidden / kFp8GroupSize) * 4, 16) : 0);
    r.bytes = r.topk_offset + align_up(int64_t(topk_carried) * 6, 16);
    return r;
  }
};

struct LowLatencyLayout {
  static constexpr int64_t kSignalBytes = int64_t(kLowLatencyMaxExperts) * 4;
  // recv_seen, block_ops, block_told
  static constexpr int64_t kEpochBytes = kMaxNvlRanks * 8 + 2 * kLowLatencyMaxBlocks * 4;
  static constexpr int64_t kSignalsBytes = align_up(6 * kSignalBytes + kEpochBytes, kAlign);

  int64_t set_bytes;           // fixed for the buffer: half of num_rdma_bytes, so set 1 never moves
  int64_t receive_bytes;       // of this call's shape
  int64_t combine_send_bytes;  // of this call's shape

  // The dispatch's part of the receive area, [R][M] records and the [L][R][M] row map, for any rank count
  // (R <= E): E * M records and E * M map entries. Records that carry the top-k are larger than this bound's
  // (BF16 rows without it); a dispatch with them checks dispatch_fits with its rank count instead.
  EPX_HD static int64_t dispatch_receive_bound(int max_tokens, int num_experts, int64_t record_bytes) {
    return int64_t(num_experts) * max_tokens * (record_bytes + 4);
  }
  // The areas of a set for a shape (BF16 records: larger than FP8 ones) in a set of set_bytes.
  EPX_HD static LowLatencyLayout make(int64_t set_bytes, int max_tokens, int hidden, int num_experts) {
    LowLatencyLayout l{};
    l.set_bytes = set_bytes;
    const int64_t record = LowLatencyRecord::make(hidden, false).bytes;
    const int64_t dispatch_recv = dispatch_receive_bound(max_tokens, num_experts, record);
    const int64_t combine_recv = int64_t(num_experts) * max_tokens * hidden * 2;  // [E][M]
    l.receive_bytes = align_up(dispatch_recv > combine_recv ? dispatch_recv : combine_recv, kAlign);
    l.combine_send_bytes = align_up(int64_t(num_experts) * max_tokens * hidden * 2, kAlign);  // [L][R*M]
    return l;
  }
  // Bytes one set needs for a shape.
  EPX_HD static int64_t required_set_bytes(int max_tokens, int hidden, int num_experts) {
    const LowLatencyLayout l = make(0, max_tokens, hidden, num_experts);
    return kSignalsBytes + l.receive_bytes + l.combine_send_bytes;
  }
  EPX_HD bool fits() const { return kSignalsBytes + receive_bytes + combine_send_bytes <= set_bytes; }
  // Whether this shape's receive area holds R * M records of record_bytes and the [L][R][M] row map.
  EPX_HD bool dispatch_fits(int num_ranks, int max_tokens, int num_experts, int64_t record_bytes) const {
    return int64_t(num_ranks) * max_tokens * record_bytes + int64_t(num_experts) * max_tokens * 4 <= receive_bytes;
  }

  EPX_HD uint8_t* set_base(void* region, int set) const { return static_cast<uint8_t*>(region) + set * set_bytes; }
  EPX_HD int32_t* dispatch_count(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set));
  }
  EPX_HD int32_t* combine_arrived(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + kSignalBytes);
  }
  EPX_HD int32_t* combine_sent(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + 2 * kSignalBytes);
  }
  EPX_HD int32_t* dispatch_arrived(void* region, int set) const {
    return reinterpret_cast<int32_t*>(set_base(region, set) + 3 * kSignalBytes);
  }
  EPX_HD uint64_t* combine_target(void* region, int set) const {
    return reinterpret_cast<uint64_t*>(set_base(region, set) + 4 * kSignalBytes);
  }
  EPX_HD uint64_t* recv_seen(void* region, int set) const {
    return reinterpret_cast<uint64_t*>(set_base(region, set) + 6 * kSignalBytes);
  }
  EPX_HD uint32_t* block_ops(void* region, int set) const {
    return reinterpret_cast<uint32_t*>(set_base(region, set) + 6 * kSignalBytes + kMaxNvlRanks * 8);
  }
  EPX_HD uint32_t* block_told(void* region, int set) const { return block_ops(region, set) + kLowLatencyMaxBlocks; }
  EPX_HD uint8_t* receive(void* region, int set) const { return set_base(region, set) + kSignalsBytes; }
  // The dispatch's records: rank s's token t at (s * M + t) * record_bytes.
  EPX_HD uint8_t* dispatch_records(void* region, int set) const { return receive(region, set); }
  // The dispatch's row map after the records: [(local expert * R + s) * M + slot] = rank s's token in that slot.
  EPX_HD int32_t* dispatch_row_map(void* region, int set, int num_ranks, int max_tokens, int64_t record_bytes) const {
    return reinterpret_cast<int32_t*>(receive(region, set) + int64_t(num_ranks) * max_tokens * record_bytes);
  }
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
