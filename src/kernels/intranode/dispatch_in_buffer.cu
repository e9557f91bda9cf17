// High-throughput dispatch into the buffer (semantics.md section 2, "Outputs in the buffer"): the outputs are the
// receiving rank's output region (layout/recv_region.hpp), and the sending warps write every token straight to its
// output row there, through the peer's NVLink mapping or, for this rank's own tokens, locally. No ring, no
// receiving warps, no waits while rows move.
//
// Channel c (a contiguous token range of every rank, as in dispatch.cu) has blocks 2c and 2c+1. In each block the
// first warps are the peers' writers (an equal share per peer, in rank order), the last in_buffer_self_warps this
// rank's own; a group is the matching warps of both blocks. Every warp of a group scans the channel's tokens 32 at a
// time (scan_window), so all agree on each token's position in the (channel, destination) stream, and writes the
// routed tokens whose position is its own (position % group warps == its index) to output row first + position,
// where first is where this rank's channel-c rows start at the destination (from rank_prefix_matrix and
// channel_prefix_matrix, which the receiver's recv_channel_prefix_matrix agrees with). The scan also records
// send_head[t][dest], as the ring dispatch does, so the combine does not know which dispatch ran.
//
// With a layout the grid has one more block, its last, which runs the notify (notify_body.cuh): it counts, exchanges
// the counts and writes channel_prefix_matrix and rank_prefix_matrix, then releases every data block's start word and
// finishes the handle and the host's counts while the rows move. A cached dispatch runs the epoch barrier first
// (start_operation). Where the device has no SM for the extra block, a notify kernel runs before the grid instead.
//
// At the end block b releases dispatch_done[b][me] = the operation's epoch in every peer's buffer and waits for the
// same word from every peer's block b: once every block has, every row written to this rank is visible, and the grid
// ends. The next operation's epoch barrier (notify or start_operation) keeps every rank from writing a region again
// before all ranks have finished this one.
#include <cuda_runtime.h>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "kernels/intranode/dispatch_rows.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "kernels/intranode/notify_body.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// 16-byte loads in flight per lane in the row copies: 7 against the ring dispatch's 4, measured 13-18 us faster at 16
// SMs on 2 x H200 at hidden 7168 and no different at 24 (docs/bench-notes.md); 78 registers, no spills.
constexpr int kInBufferUnroll = 7;

// The output arrays of one rank's region, as this GPU addresses them.
struct RegionRows {
  int4* x;
  int32_t* scales;
  int32_t* src_idx;
  int64_t* topk_idx;
  float* weights;
  __device__ __forceinline__ static RegionRows of(const DispatchParams& p, int rank) {
    uint8_t* base = reinterpret_cast<uint8_t*>(nvl_control(p.peers, rank)) + p.region_offset;
    return RegionRows{reinterpret_cast<int4*>(base), reinterpret_cast<int32_t*>(base + p.region.scale_offset),
                      reinterpret_cast<int32_t*>(base + p.region.src_offset),
                      reinterpret_cast<int64_t*>(base + p.region.topk_offset),
                      reinterpret_cast<float*>(base + p.region.weight_offset)};
  }
};

// The group a warp belongs to: the writers for one destination rank.
struct WriterPlace {
  int dest;
  int index;  // in the group (both blocks of the channel)
  int warps;  // of the group
  bool active;
  __device__ __forceinline__ static WriterPlace of(int warp, int half, int warps_per_block, int num_ranks, int me,
                                                   int self_warps) {
    const int peer_warps = warps_per_block - self_warps;
    if (warp >= peer_warps) return {me, half * self_warps + warp - peer_warps, 2 * self_warps, true};
    const int each = peer_warps / (num_ranks - 1);  // num_ranks >= 2 here: at 1 rank every warp is a self warp
    const int k = warp / each;                      // the k-th rank other than this one
    return {k < me ? k : k + 1, half * each + warp % each, 2 * each, k < num_ranks - 1};
  }
};

// Token t to row `row` of out (dest's region).
template <int kUnroll>
__device__ __forceinline__ void write_row(const DispatchParams& p, const RegionRows& out, int t, int dest, int row,
                                          int lane) {
  const SmallFields f = token_fields(p, t, dest, lane);
  write_rows<kUnroll>(out.x + int64_t(row) * p.x_int4, p.x + int64_t(t) * p.x_int4, p.x_int4, lane, LoadNc{});
  store_scales(p, out.scales + int64_t(row) * p.num_scales, f, p.x_scales.token(t), lane, LoadNc{});
  if (lane == 0) out.src_idx[row] = f.src_idx;
  if (lane < p.num_topk) {
    out.topk_idx[int64_t(row) * p.num_topk + lane] = f.topk;
    out.weights[int64_t(row) * p.num_topk + lane] = __int_as_float(f.weight);
  }
}

// A writer warp (gwarp of gwarps) for destination dest: the channel's tokens routed there whose stream position is its
// own. Rows past this rank's range at dest (an inconsistent handle) or past the region are not written.
template <int kUnroll>
__device__ void write_channel(const DispatchParams& p, int channel, int dest, int gwarp, int gwarps) {
  const int lane = threadIdx.x % 32, R = p.num_ranks, C = p.num_channels, me = p.peers.rank;
  const ChannelRange range = ChannelRange::of(p.num_tokens, C, channel);
  const int first = (me > 0 ? p.rank_prefix_matrix[(me - 1) * R + dest] : 0) +
                    (channel > 0 ? p.channel_prefix_matrix[dest * C + channel - 1] : 0);
  const int end = min(p.rank_prefix_matrix[me * R + dest], p.region.capacity);
  const RegionRows out = RegionRows::of(p, dest);
  int routed = 0;  // stream position of the window's first routed token
  for (int cursor = range.begin, window = 0; cursor < range.end; cursor += 32, ++window) {
    const uint32_t mask = scan_window(p, cursor, range.end, window, dest, routed, gwarp, gwarps);
    for (uint32_t m = owned_lanes(mask, routed, gwarp, gwarps); m != 0; m &= m - 1) {
      const int l = __ffs(m) - 1, i = window_position(mask, routed, l);
      if (first + i < end) write_row<kUnroll>(p, out, cursor + l, dest, first + i, lane);
    }
    routed += __popc(mask);
  }
}

// Worst-case mode: this rank's rows past the received ones get src index -1 and no experts.
template <int kWarps>
__device__ void pad_region_rows(const DispatchParams& p) {
  const int R = p.num_ranks, me = p.peers.rank, lane = threadIdx.x % 32;
  const int first = p.rank_prefix_matrix[(R - 1) * R + me];
  const int end = min(p.num_worst_tokens, p.region.capacity);
  const RegionRows out = RegionRows::of(p, me);
  const int data_blocks = 2 * p.num_channels;  // the grid's, without a notify block
  for (int row = first + blockIdx.x * kWarps + threadIdx.x / 32; row < end; row += data_blocks * kWarps) {
    if (lane == 0) out.src_idx[row] = -1;
    if (lane < p.num_topk) {
      out.topk_idx[int64_t(row) * p.num_topk + lane] = -1;
      out.weights[int64_t(row) * p.num_topk + lane] = 0.f;
    }
  }
}

template <int kUnroll, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    dispatch_in_buffer_kernel(const __grid_constant__ DispatchParams p, const __grid_constant__ NotifyParams notify) {
  NvlControl* self = nvl_self(p.peers);
  if (p.notify_block) {
    if (blockIdx.x == gridDim.x - 1) return run_notify(notify, gridDim.x - 1);
    if (!start_after_notify_block(p.fail, self)) return;  // every rank skips
  } else if (!start_operation(p.fail, p.peers, p.num_ranks, p.barrier != 0, p.signature)) {
    return;  // every rank skips
  }
  const int R = p.num_ranks, me = p.peers.rank, tid = threadIdx.x;
  // This rank's epoch of the operation, the same on every rank: set by the notify (a kernel before this grid or this
  // grid's last block, before the start word this block acquired), or by block 0 of this grid before
  // start_operation's block barrier (and the start word each other block acquired).
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&self->epoch);
  const int self_warps = R == 1 ? kWarps : p.in_buffer_self_warps;
  const WriterPlace place = WriterPlace::of(tid / 32, blockIdx.x % 2, kWarps, R, me, self_warps);
  if (place.active) write_channel<kUnroll>(p, blockIdx.x / 2, place.dest, place.index, place.warps);
  if (p.num_worst_tokens > 0) pad_region_rows<kWarps>(p);
  __syncthreads();  // every warp's row stores come before the releases below
  if (tid < R && tid != me) {
    publish(&nvl_control(p.peers, tid)->dispatch_done[blockIdx.x][me], epoch);  // pairs with rank tid's wait below
    // Pairs with rank tid's release above: the rows its block blockIdx.x wrote here are visible to this thread, and,
    // as the grid ends after it, to the work that follows on the stream.
    wait_equal(&self->dispatch_done[blockIdx.x][tid], epoch, p.fail,
               WaitSite{kRoleDispatchReceiver, int(blockIdx.x / 2), tid, int64_t(epoch)});
  }
}

}  // namespace

void launch_dispatch_in_buffer(const DispatchParams& p, const NotifyParams& notify, cudaStream_t stream) {
  const int blocks = p.num_channels * 2 + (p.notify_block ? 1 : 0);
  dispatch_in_buffer_kernel<kInBufferUnroll, kDataWarps><<<blocks, kDataThreads, 0, stream>>>(p, notify);
}

}  // namespace epx
