// Layout of the NVLink buffer of one rank (mapped into every peer through CUDA IPC), shared by the host
// (sizes, validation) and the kernels (addresses). Nothing else computes these offsets.
//
//   [ NvlControl | pad to kAlign | ring data: [channel][peer][slot] records | output region | low-latency sets ]
//
// The output region (num_recv_bytes, layout/recv_region.hpp) holds the outputs of a dispatch into the buffer; the
// low-latency sets (runtime/buffer_impl.hpp) are there only with CUDA IPC transport.
// The ring data is reused by dispatch and combine (never active at once: every operation starts with the epoch
// barrier, which no rank passes before all ranks finished their previous operation; the early senders of a 2-rank
// sized dispatch write before it only once the peer has read every record they published,
// kernels/intranode/early_senders.cuh).
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

// Count message that rank s writes into rank r's buffer in the epoch barrier (the header) and notify (ints).
struct NotifyMsg {
  static constexpr int kErrorCode = 0;  // first input error the sender saw (ErrorCode), 0 if none
  static constexpr int kErrorRank = 1;  // rank that saw it
  static constexpr int kNumTokens = 2;  // sender's token count (diagnostics)
  static constexpr int kSignature = 3;  // hash of the operation's shape: every rank must send the same
  // Rows the sender can receive: > 0 a hard bound (num_worst_tokens: more is an input error), < 0 -(guess + 1) for the
  // rows of outputs it sized before the counts (more makes every rank repeat the count exchange: kVerdictResize), 0
  // none.
  static constexpr int kRowBound = 4;
  static constexpr int kHeader = 5;
  EPX_HD static constexpr int tokens_per_rank(int j) { return kHeader + j; }        // sender's row
  EPX_HD static constexpr int expert(int i) { return kHeader + kMaxNvlRanks + i; }  // receiver's expert i
  EPX_HD static constexpr int channel(int c) { return kHeader + kMaxNvlRanks + kMaxLocalExperts + c; }
  static constexpr int kInts = kHeader + kMaxNvlRanks + kMaxLocalExperts + kMaxChannels;
};

// Control region at offset 0 of every NVLink buffer. Zeroed at creation; counters only grow afterwards.
struct NvlControl {
  // Written by this rank only.
  uint32_t epoch;         // operations (epoch barriers) this rank has started
  int32_t local_error;    // input error found by this rank's layout kernel, reported at the next notify
  int32_t op_error;       // collective error of the current operation (0: none), set by its epoch barrier
  int32_t op_error_rank;  // rank that reported op_error
  // Start words of a high-throughput data kernel that runs the epoch barrier itself (cached dispatch, combine;
  // kernels/intranode/epoch_barrier.cuh): block 0 releases word b once the barrier is through, block b acquires it
  // and resets it to 0. A dispatch into the buffer with a layout: its grid's last block (the notify) releases them.
  uint32_t block_start[2 * kMaxChannels];
  // Written by any rank: 1 + the rank that failed a wait; every wait of every rank checks it.
  int32_t abort;
  int32_t fatal_claimed;  // first failing thread of this rank claims the host diagnostic slot (atomicCAS)
  int32_t pad0;
  // notify_flag[s] = epoch of the last notify message rank s wrote here (release; read with acquire).
  uint32_t notify_flag[kMaxNvlRanks];
  // Messages double-buffered by epoch parity: no rank can run two operations ahead of another.
  int32_t notify_msg[2][kMaxNvlRanks][NotifyMsg::kInts];
  // Ring indices, monotonic over the buffer's life (64-bit: they never wrap). For the ring of
  // (channel c, peer p) held in this buffer: tail advanced by the sender p (release), head by this rank.
  uint64_t dispatch_tail[kMaxChannels][kMaxNvlRanks];
  uint64_t dispatch_head[kMaxChannels][kMaxNvlRanks];
  uint64_t combine_tail[kMaxChannels][kMaxNvlRanks];
  uint64_t combine_head[kMaxChannels][kMaxNvlRanks];
  // Dispatch into the buffer (kernels/intranode/dispatch_in_buffer.cu): dispatch_done[b][s] = the epoch of the last
  // such dispatch whose block b of rank s had written all its rows to this rank (release; read with acquire).
  uint32_t dispatch_done[2 * kMaxChannels][kMaxNvlRanks];
  // Rank mask of the low-latency mode (buffers created with enable_shrink; semantics.md section 9): nonzero where
  // this rank leaves rank r out. Set by the host's mask calls (stream-ordered) and by a low-latency kernel whose wait
  // for r outlasted the shrink budget (atomicExch); read by the low-latency kernels at run time. This rank's own
  // view: no other rank reads or writes it.
  int32_t ll_mask[kMaxNvlRanks];
};

// Dispatch ring record: one token.
//   [x: x_bytes][scales: num_scales * 4][src_idx int32][topk idx int32 * K][topk weight f32 * K]
struct DispatchRecord {
  int64_t x_bytes;
  int64_t scale_offset;
  int64_t meta_offset;
  int64_t bytes;
  EPX_HD static DispatchRecord make(int64_t x_bytes, int num_scales, int num_topk) {
    DispatchRecord r{};
    r.x_bytes = x_bytes;
    r.scale_offset = align_up(x_bytes, 16);
    r.meta_offset = r.scale_offset + align_up(int64_t(num_scales) * 4, 16);
    r.bytes = r.meta_offset + align_up(4 + int64_t(num_topk) * 8, 16);
    return r;
  }
  EPX_HD static int64_t src_idx_offset() { return 0; }
  EPX_HD static int64_t topk_idx_offset() { return 4; }
  EPX_HD static int64_t topk_weight_offset(int num_topk) { return 4 + int64_t(num_topk) * 4; }
};

// Combine ring record: one expert-output row.  [x: hidden * 2][topk weight f32 * K]
struct CombineRecord {
  int64_t x_bytes;
  int64_t weight_offset;
  int64_t bytes;
  EPX_HD static CombineRecord make(int hidden, int num_topk) {
    CombineRecord r{};
    r.x_bytes = int64_t(hidden) * 2;
    r.weight_offset = align_up(r.x_bytes, 16);
    r.bytes = r.weight_offset + align_up(int64_t(num_topk) * 4, 16);
    return r;
  }
};

// Ring data region: [channel][ring][slot] records of `record_bytes`, each slot starting on a kAlign (128-byte)
// line: a 14416-byte BF16 record (14336 row + 80 meta) at a 16-byte stride put every warp's 512-byte store
// across five lines instead of four. A receiver has one ring per source rank, except at 2 ranks or fewer: there no
// ring carries a rank's own rows (the dispatch copies them from x, the combine reads them from x in place), so a
// channel has one ring, the peer's, at 2 ranks and none at 1.
struct RingLayout {
  int num_ranks;
  int capacity;  // slots per ring
  int64_t record_bytes;

  EPX_HD static constexpr int64_t data_offset() { return align_up(int64_t(sizeof(NvlControl)), kAlign); }
  EPX_HD int rings() const { return num_ranks <= 2 ? num_ranks - 1 : num_ranks; }  // per channel
  EPX_HD int64_t stride() const { return align_up(record_bytes, kAlign); }
  EPX_HD int64_t bytes(int num_channels) const { return int64_t(num_channels) * rings() * capacity * stride(); }
  // Slot `position` of the ring of (channel, source rank `src`) in the buffer at buffer_base.
  EPX_HD uint8_t* slot(void* buffer_base, int channel, int src, uint64_t position) const {
    const int ring = num_ranks <= 2 ? 0 : src;
    const int64_t index = (int64_t(channel) * rings() + ring) * capacity + int64_t(position % uint64_t(capacity));
    return static_cast<uint8_t*>(buffer_base) + data_offset() + index * stride();
  }
};

}  // namespace epx
