// High-throughput dispatch inside one NVLink domain (semantics.md section 2).
//
// Block 2c sends channel c, block 2c+1 receives it. Channel c covers a contiguous token range of every rank.
// Ring (c, s) lives in receiver r's buffer; sender s writes records and advances its tail, r copies them to recv_x
// and advances its head. A rank's own tokens take no ring: an own-token group copies them from x to the outputs
// (dispatch_self_copy). At 3 or more ranks it is the receiver block's group for this rank, and every sender warp
// works for a peer; at 2 ranks it also takes the sender block's last warps (DispatchSplit, runtime/dispatch_split.hpp:
// a row pushed over NVLink costs a warp more than one copied locally, so the blocks balance). Record order is token
// order, so rows from source s, channel c land at consecutive rows starting at recv_channel_prefix_matrix[s][c]. Ring
// indices never reset (64-bit, monotonic): an operation starts where the last one ended, and the epoch barrier
// guarantees the ring is idle then (the notify kernel's in front of a dispatch with a layout, the kernel's own in a
// cached dispatch: start_operation). A sized dispatch at 2 ranks lets its senders write before the notify block's
// start word once they have seen the peer's ring idle themselves (early_senders.cuh).
#include <cuda_runtime.h>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "kernels/intranode/chunk_publisher.cuh"
#include "kernels/intranode/dispatch_rows.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "kernels/intranode/notify_body.cuh"
#include "kernels/intranode/peer_groups.cuh"
#include "kernels/intranode/sender_coordinator.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// Writes the small fields of output row `row`; scales past the preloaded ones come from src_scales (load).
template <typename Load>
__device__ __forceinline__ void store_row_fields(const DispatchParams& p, int row, const SmallFields& f,
                                                 ScaleRow src_scales, int lane, Load load) {
  store_scales(p, reinterpret_cast<int32_t*>(p.recv_x_scales) + int64_t(row) * p.num_scales, f, src_scales, lane, load);
  if (lane == 0) p.recv_src_idx[row] = f.src_idx;
  if (lane < p.num_topk) {
    if (p.recv_topk_idx != nullptr) p.recv_topk_idx[int64_t(row) * p.num_topk + lane] = f.topk;
    if (p.recv_topk_weights != nullptr)
      p.recv_topk_weights[int64_t(row) * p.num_topk + lane] = __int_as_float(f.weight);
  }
}

// Writes token t (row, scales, src index, top-k rebased to dest's local experts) into a ring slot.
template <int kUnroll>
__device__ __forceinline__ void write_record(const DispatchParams& p, int t, int dest, uint8_t* slot, int lane) {
  const SmallFields f = token_fields(p, t, dest, lane);
  const ScaleRow src_scales = p.x_scales.token(t);
  write_rows<kUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(t) * p.x_int4, p.x_int4, lane, LoadNc{});
  store_scales(p, reinterpret_cast<int32_t*>(slot + p.record.scale_offset), f, src_scales, lane, LoadNc{});
  int32_t* meta = reinterpret_cast<int32_t*>(slot + p.record.meta_offset);
  if (lane == 0) meta[0] = f.src_idx;
  if (lane < p.num_topk) {
    meta[1 + lane] = f.topk;
    meta[1 + p.num_topk + lane] = f.weight;
  }
}

// Copies one ring record to row `row` of the outputs (small fields loaded first, as above).
template <int kUnroll>
__device__ __forceinline__ void read_record(const DispatchParams& p, const uint8_t* slot, int row, int lane) {
  SmallFields f{};
  const ScaleRow src_scales{reinterpret_cast<const int32_t*>(slot + p.record.scale_offset), 1};  // record: contiguous
  const int32_t* meta = reinterpret_cast<const int32_t*>(slot + p.record.meta_offset);
#pragma unroll
  for (int j = 0; j < kScaleWordsPerLane; ++j)
    if (lane + 32 * j < p.num_scales) f.scale[j] = ld_cg(src_scales.at(lane + 32 * j));
  if (lane == 0) f.src_idx = ld_cg(meta);
  if (lane < p.num_topk) {
    f.topk = ld_cg(meta + 1 + lane);
    f.weight = ld_cg(meta + 1 + p.num_topk + lane);
  }
  warp_copy<kUnroll>(p.recv_x + int64_t(row) * p.x_int4, reinterpret_cast<const int4*>(slot), p.x_int4, lane, LoadCg{},
                     StoreNa{});
  store_row_fields(p, row, f, src_scales, lane, LoadCg{});
}

// Copies this rank's token t straight to output row `row`: what write_record and read_record do together.
template <int kUnroll>
__device__ __forceinline__ void copy_own_token(const DispatchParams& p, int t, int row, int lane) {
  const SmallFields f = token_fields(p, t, p.peers.rank, lane);
  warp_copy<kUnroll>(p.recv_x + int64_t(row) * p.x_int4, p.x + int64_t(t) * p.x_int4, p.x_int4, lane, LoadNc{},
                     StoreNa{});
  store_row_fields(p, row, f, p.x_scales.token(t), lane, LoadNc{});
}

// A warp (gwarp of gwarps) of the own-token group: scans the channel's tokens 32 at a time as the senders do
// (every warp scans them all and so knows every stream position), copies the routed tokens whose position is
// its own (position % group warps == its index) from x to their output rows, and records send_head[t][me]
// (windows dealt round-robin over the group). No ring, no wait: the inputs are this rank's. Rows past the
// channel's count from the layout (an inconsistent handle) are not written.
template <int kUnroll>
__device__ void dispatch_self_copy(const DispatchParams& p, int channel, int gwarp, int gwarps) {
  const int lane = threadIdx.x % 32, R = p.num_ranks, C = p.num_channels, me = p.peers.rank;
  const ChannelRange range = ChannelRange::of(p.num_tokens, C, channel);
  const int row_begin = p.recv_channel_prefix_matrix[me * C + channel];
  const int row_end =
      channel + 1 < C ? p.recv_channel_prefix_matrix[me * C + channel + 1] : p.rank_prefix_matrix[me * R + me];
  int routed = 0;  // stream position of the window's first routed token
  for (int cursor = range.begin, window = 0; cursor < range.end; cursor += 32, ++window) {
    const uint32_t mask = scan_window(p, cursor, range.end, window, me, routed, gwarp, gwarps);
    for (uint32_t m = owned_lanes(mask, routed, gwarp, gwarps); m != 0; m &= m - 1) {
      const int l = __ffs(m) - 1, i = window_position(mask, routed, l);
      if (row_begin + i < row_end) copy_own_token<kUnroll>(p, cursor + l, row_begin + i, lane);
    }
    routed += __popc(mask);
  }
}

// Chunked sender (3 or more ranks, see launch_dispatch), the group for one peer (PeerGroup::of_peers): scans the
// channel's tokens in order, takes up to a chunk of those routed to the destination, copies them (token i of the chunk
// by warp i % warps); the chunk's publisher then publishes the tail (kernels/chunk_publisher.cuh). Every warp scans the
// same tokens, so all agree on the chunks and the ring positions.
// Also records send_head[t][dest]: the token's stream position, or -(next position) - 1 if not sent, which
// the combine receiver uses as "positions below this are no longer needed".
template <int kUnroll>
__device__ void dispatch_sender(const DispatchParams& p, int channel, ChunkGrants& grants) {
  PeerGroup g;
  if (!PeerGroup::of_peers(p.num_ranks, p.peers.rank, g)) return;
  const int lane = threadIdx.x % 32, R = p.num_ranks, dest = g.peer, me = p.peers.rank;
  const ChannelRange range = ChannelRange::of(p.num_tokens, p.num_channels, channel);
  NvlControl* dst = nvl_control(p.peers, dest);
  uint64_t* tail_ptr = &dst->dispatch_tail[channel][me];
  const uint64_t* head_ptr = &dst->dispatch_head[channel][me];
  const uint64_t base = read_idle(tail_ptr);  // idle ring: head == tail == base
  const uint64_t cap = p.ring.capacity;
  const int chunk = p.num_send_chunk;
  uint64_t tail = base;

  int cursor = range.begin;
  for (int c = 0; cursor < range.end; ++c) {
    wait_for_grant(grants, g, c, p.fail, WaitSite{kRoleDispatchSender, channel, dest, cursor});
    int taken = 0;
    while (taken < chunk && cursor < range.end) {
      const int t = cursor + lane;
      const bool in = t < range.end && p.is_token_in_rank[int64_t(t) * R + dest];
      uint32_t mask = __ballot_sync(kFullMask, in);
      int scanned = min(32, range.end - cursor);
      const int need = chunk - taken;
      if (__popc(mask) > need) {  // stop right after the need-th routed token
        scanned = int(__fns(mask, 0, need)) + 1;
        mask &= scanned == 32 ? kFullMask : ((1u << scanned) - 1);
      }
      if (g.warp == 0 && lane < scanned) {
        const int pos = int(tail - base) + taken + __popc(mask & lanemask_lt());
        p.send_head[int64_t(t) * R + dest] = in ? pos : -pos - 1;
      }
      for (uint32_t m = owned_lanes(mask, taken, g.warp, g.warps); m != 0; m &= m - 1) {
        const int l = __ffs(m) - 1;
        write_record<kUnroll>(p, cursor + l, dest,
                              p.ring.slot(dst, channel, me, tail + window_position(mask, taken, l)), lane);
      }
      taken += __popc(mask);
      cursor += scanned;
    }
    tail += taken;
    publish_chunk(grants, g, c, base, tail, taken, chunk, cap, tail_ptr, head_ptr, p.fail,
                  WaitSite{kRoleDispatchSender, channel, dest, cursor});
  }
}

// Coordinated sender (at most 2 ranks, see launch_dispatch): a warp of the group for one peer (SenderGroups::dispatch:
// at 2 ranks the first 23 - self_sender_warps sender warps; the others join the own-token group) scans the channel's
// tokens 32 at a time (every warp of the group scans them all, so all agree on the stream positions without talking),
// writes the routed tokens whose position is its own (position % group warps == its index) into ring slots, and after
// each window publishes its progress word in shared memory: every position below it that this warp owns is written. No
// barrier and no system fence here: the coordinator turns progress into ring tails. Also records send_head[t][dest] as
// the chunked sender does (windows dealt round-robin over the group).
template <int kUnroll, int kWarps>
__device__ void dispatch_sender_coordinated(const DispatchParams& p, int channel, int32_t* s_progress,
                                            const EarlyStart* early) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, R = p.num_ranks, me = p.peers.rank;
  const SenderGroups groups = SenderGroups::dispatch(R, p.self_sender_warps, kWarps - 1);
  if (R == 2 && warp >= groups.each) {  // a warp of the own-token group (its receiver-block part comes first)
    if (early != nullptr && !await_go(*early, p.fail, kRoleDispatchSender, channel)) return;  // the rows' places
    const int own = kWarps - p.ring_receiver_warps;
    dispatch_self_copy<kUnroll>(p, channel, own + warp - groups.each, own + p.self_sender_warps);
    return;
  }
  const SenderGroups::Place place = groups.place(warp, R, me);
  if (place.index >= place.warps) return;  // idle: no group (the coordinator reads group warps' words only)
  if (early != nullptr && !await_slots(*early, p.fail, kRoleDispatchSender, channel)) return;
  const int dest = place.dest, gwarp = place.index, gwarps = place.warps;
  const ChannelRange range = ChannelRange::of(p.num_tokens, p.num_channels, channel);
  NvlControl* dst = nvl_control(p.peers, dest);
  const uint64_t* head_ptr = &dst->dispatch_head[channel][me];
  const uint64_t base = read_idle(&dst->dispatch_tail[channel][me]);  // idle ring: head == tail == base
  const uint64_t cap = p.ring.capacity;
  uint64_t head_seen = base;
  int32_t* progress = s_progress + warp;

  int routed = 0;  // stream position of the window's first routed token
  for (int cursor = range.begin, window = 0; cursor < range.end; cursor += 32, ++window) {
    const uint32_t mask = scan_window(p, cursor, range.end, window, dest, routed, gwarp, gwarps);
    for (uint32_t m = owned_lanes(mask, routed, gwarp, gwarps); m != 0; m &= m - 1) {
      const int l = __ffs(m) - 1, i = window_position(mask, routed, l);
      head_seen = wait_for_slot(i, base, cap, head_seen, head_ptr, progress, early, p.fail,  // the receiver's head
                                kRoleDispatchSender, channel, dest, cursor + l);
      if (head_seen == kSlotSkipped) return;
      write_record<kUnroll>(p, cursor + l, dest, p.ring.slot(dst, channel, me, base + i), lane);
    }
    routed += __popc(mask);
    __syncwarp();                                     // every lane's stores of this window come before lane 0's release
    if (lane == 0) st_release_cta(progress, routed);  // pairs with the coordinator's acquire
    if (early != nullptr && skipped(*early)) return;  // nothing of this operation will be published
  }
  __syncwarp();
  if (lane == 0) st_release_cta(progress, -routed - 1);  // done: the final count, negated
}

// Sender coordinator (the sender block's last warp): see coordinate_sender_tails. With early senders it first takes
// the block's start (take_start) and publishes nothing when the operation skips.
template <int kWarps>
__device__ void dispatch_sender_coordinator(const DispatchParams& p, int channel, const int32_t* s_progress,
                                            EarlyStart* early) {
  if (early != nullptr && !take_start(*early, p.peers, p.fail)) return;
  const int lane = threadIdx.x % 32, me = p.peers.rank;
  uint64_t* tail_j = lane < p.num_ranks ? &nvl_control(p.peers, lane)->dispatch_tail[channel][me] : nullptr;
  coordinate_sender_tails(tail_j, s_progress, SenderGroups::dispatch(p.num_ranks, p.self_sender_warps, kWarps - 1),
                          p.num_ranks, me, p.fail, kRoleDispatchCoordinator, channel);
}

// Receiver group for one source: waits for the source's tail, copies what arrived, publishes the head. The
// group for this rank itself copies from x instead (dispatch_self_copy); at 2 ranks the groups are the first
// ring_receiver_warps warps (the peer) and the rest (own tokens, numbered before the sender block's own-token
// warps).
template <int kUnroll, int kWarps>
__device__ void dispatch_receiver(const DispatchParams& p, int channel, uint64_t* s_tail) {
  PeerGroup g;
  if (p.num_ranks == 2) {  // the peer's ring: the first ring_receiver_warps warps; own tokens: the rest (DispatchSplit)
    const int warp = threadIdx.x / 32, ring = p.ring_receiver_warps;
    if (warp >= ring) {
      dispatch_self_copy<kUnroll>(p, channel, warp - ring, kWarps - ring + p.self_sender_warps);
      return;
    }
    g.peer = 1 - p.peers.rank;
    g.warp = warp;
    g.warps = ring;
    g.threads = ring * 32;
    g.barrier_id = 1 + g.peer;
    g.leader = warp == 0 && threadIdx.x % 32 == 0;
  } else {
    if (!PeerGroup::of(p.num_ranks, g)) return;
    if (g.peer == p.peers.rank) {
      dispatch_self_copy<kUnroll>(p, channel, g.warp, g.warps);
      return;
    }
  }
  const int lane = threadIdx.x % 32, R = p.num_ranks, C = p.num_channels, src = g.peer, me = p.peers.rank;
  NvlControl* self = nvl_self(p.peers);
  const uint64_t* tail_ptr = &self->dispatch_tail[channel][src];
  uint64_t* head_ptr = &self->dispatch_head[channel][src];
  uint64_t head = read_idle(head_ptr);
  const int row_begin = p.recv_channel_prefix_matrix[src * C + channel];
  const int row_end =
      channel + 1 < C ? p.recv_channel_prefix_matrix[src * C + channel + 1] : p.rank_prefix_matrix[src * R + me];

  for (int row = row_begin; row < row_end;) {
    if (g.leader)  // pairs with the sender's release of tail
      s_tail[src] = wait_at_least(tail_ptr, head + 1, p.fail, WaitSite{kRoleDispatchReceiver, channel, src, row});
    named_barrier(g.barrier_id, g.threads);
    const uint64_t tail = *reinterpret_cast<volatile uint64_t*>(&s_tail[src]);
    const int avail = int(min(tail - head, uint64_t(row_end - row)));
    for (int i = g.warp; i < avail; i += g.warps)
      read_record<kUnroll>(p, p.ring.slot(self, channel, src, head + i), row + i, lane);
    named_barrier(g.barrier_id, g.threads);  // every record read: the slots may be reused
    head += avail;
    row += avail;
    if (g.leader) publish(head_ptr, head);  // pairs with the sender's acquire of head
  }
}

// Worst-case mode: rows past the received ones get src index -1 and no experts (blocks of kWarps warps).
template <int kWarps>
__device__ void pad_rows(const DispatchParams& p, int channel) {
  const int first = p.rank_prefix_matrix[(p.num_ranks - 1) * p.num_ranks + p.peers.rank];  // rows received
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int row = first + channel * kWarps + warp; row < p.num_worst_tokens; row += p.num_channels * kWarps) {
    if (lane == 0) p.recv_src_idx[row] = -1;
    if (lane < p.num_topk) {
      if (p.recv_topk_idx != nullptr) p.recv_topk_idx[int64_t(row) * p.num_topk + lane] = -1;
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[int64_t(row) * p.num_topk + lane] = 0.f;
    }
  }
}

// kWarps warps per block: kDataWarps, or kWideDispatchWarps for the wide 2-rank blocks (wide_dispatch). With
// p.notify_block (a sized dispatch) the grid's last block runs the notify and starts the others. With
// p.early_senders the sender blocks take their start in their coordinator warp (kernels/intranode/early_senders.cuh).
template <int kUnroll, bool kCoordinated, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    dispatch_kernel(const __grid_constant__ DispatchParams p, const __grid_constant__ NotifyParams notify) {
  __shared__ uint64_t s_tail[kMaxNvlRanks];
  __shared__ EarlyStart s_early;
  const bool early = kCoordinated && p.notify_block && p.early_senders && blockIdx.x % 2 == 0;
  if (p.notify_block) {
    if (blockIdx.x == gridDim.x - 1) return run_notify(notify, gridDim.x - 1);
    if (early)
      s_early.init();  // run_sender_block's block barrier orders it before every read
    else if (!start_after_notify_block(p.fail, nvl_self(p.peers)))
      return;  // every rank skips
  } else if (!start_operation(p.fail, p.peers, p.num_ranks, p.barrier != 0, p.signature)) {
    return;  // every rank skips
  }
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    EarlyStart* e = early ? &s_early : nullptr;
    run_sender_block<kCoordinated, kWarps>(
        [&](int32_t* progress) { dispatch_sender_coordinated<kUnroll, kWarps>(p, channel, progress, e); },
        [&](const int32_t* progress) { dispatch_sender_coordinator<kWarps>(p, channel, progress, e); },
        [&](ChunkGrants& grants) { dispatch_sender<kUnroll>(p, channel, grants); });
  } else {
    if (p.num_worst_tokens > 0) pad_rows<kWarps>(p, channel);
    dispatch_receiver<kUnroll, kWarps>(p, channel, s_tail);
  }
}

}  // namespace

// Senders: at most 2 ranks the coordinated sender (no per-chunk barrier and fence in its data warps); at more
// ranks the chunked one, which is faster there: the coordinator's fences each wait for every store in flight
// from its SM (docs/bench-notes.md). At 2 ranks, rows that are a whole number of wide copy rounds go in the wide
// blocks (fewer warps, more in flight each; layout/limits.hpp).
void launch_dispatch(const DispatchParams& p, const NotifyParams& notify, cudaStream_t stream) {
  const int blocks = p.num_channels * 2 + (p.notify_block ? 1 : 0);
  if (wide_dispatch(p.num_ranks, p.x_int4))
    dispatch_kernel<kWideDispatchUnroll, true, kWideDispatchWarps>
        <<<blocks, kWideDispatchWarps * 32, 0, stream>>>(p, notify);
  else if (p.num_ranks <= 2)
    dispatch_kernel<kCopyUnroll, true, kDataWarps><<<blocks, kDataThreads, 0, stream>>>(p, notify);
  else
    dispatch_kernel<kCopyUnroll, false, kDataWarps><<<blocks, kDataThreads, 0, stream>>>(p, notify);
}

}  // namespace epx
