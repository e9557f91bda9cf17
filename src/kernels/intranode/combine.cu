// High-throughput combine inside one NVLink domain (semantics.md section 3): the dispatch run backwards.
//
// Block 2c sends channel c: for every source rank s, the rows that dispatch put at
// [recv_channel_prefix_matrix[s][c], ...) go back, in the same order, into ring (c, me) of rank s. So the
// k-th record of that ring is the token whose send_head[t][me] == k. At 2 ranks or fewer (kOwnInPlace) this
// rank's own rows take no ring: the reducers read them from x in place, at row recv_channel_prefix_matrix[me][c]
// + send_head[t][me] (at 4 ranks that measured no faster; docs/bench-notes.md). Block 2c+1 reduces channel c:
// reducer warps take tokens round robin, wait for each contributing rank's record, and sum the rows in
// ascending rank order in float32 (then bias0, then bias1), rounding once. A coordinator warp frees ring
// slots: every reducer publishes, per ring, the lowest position it may still read; the coordinator publishes
// the minimum as the ring head.
#include <cuda_runtime.h>

#include <climits>

#include "device/bf16.cuh"
#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "kernels/intranode/chunk_publisher.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "kernels/intranode/peer_groups.cuh"
#include "kernels/intranode/reduce_row.cuh"
#include "kernels/intranode/sender_coordinator.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// 16-byte loads in flight per lane in row copies (8 measured no faster for dispatch, slower for combine).
constexpr int kCopyUnroll = 4;

constexpr int kReducerWarps = kDataWarps - 1;  // the last warp of a receiver block coordinates

// Own rows read in place (no own ring, no sender group for this rank): the kernels for at most 2 ranks.
template <int kRanks>
constexpr bool kOwnInPlace = kRanks <= 2;

__device__ __forceinline__ int row_end_of(const CombineParams& p, int src, int channel) {
  return channel + 1 < p.num_channels ? p.recv_channel_prefix_matrix[src * p.num_channels + channel + 1]
                                      : p.rank_prefix_matrix[src * p.num_ranks + p.peers.rank];
}

// Chunked sender (3 or more ranks), the group for one destination (a source rank of the dispatch): pushes its
// rows in dispatch order, a chunk at a time (row i of the chunk by warp i % warps); the chunk's publisher then
// publishes the tail (kernels/chunk_publisher.cuh).
template <int kUnroll>
__device__ void combine_sender(const CombineParams& p, int channel, ChunkGrants& grants) {
  PeerGroup g;
  if (!PeerGroup::of(p.num_ranks, g)) return;
  const int lane = threadIdx.x % 32, dest = g.peer, me = p.peers.rank;
  const int row_begin = p.recv_channel_prefix_matrix[dest * p.num_channels + channel];
  const int row_end = row_end_of(p, dest, channel);
  NvlControl* dst = nvl_control(p.peers, dest);
  uint64_t* tail_ptr = &dst->combine_tail[channel][me];
  const uint64_t* head_ptr = &dst->combine_head[channel][me];
  const uint64_t base = read_idle(tail_ptr);  // idle ring: head == tail == base
  const uint64_t cap = p.ring.capacity;
  uint64_t tail = base;

  int c = 0;
  for (int row = row_begin; row < row_end; ++c) {
    const int n = min(p.num_send_chunk, row_end - row);
    // pairs with the grant, whose publisher acquired the coordinator's release of head
    wait_for_grant(grants, g, c, p.fail, WaitSite{kRoleCombineSender, channel, dest, row});
    for (int i = g.warp; i < n; i += g.warps) {
      uint8_t* slot = p.ring.slot(dst, channel, me, tail + i);
      // The weight is loaded before the row so that its latency hides behind the copy.
      const float w = lane < p.num_topk ? ld_nc(p.topk_weights + int64_t(row + i) * p.num_topk + lane) : 0.f;
      write_rows<kUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(row + i) * p.x_int4, p.x_int4, lane, LoadNc{});
      if (lane < p.num_topk) reinterpret_cast<float*>(slot + p.record.weight_offset)[lane] = w;
    }
    tail += n;
    row += n;
    publish_chunk(grants, g, c, base, tail, n, p.num_send_chunk, cap, tail_ptr, head_ptr, p.fail,
                  WaitSite{kRoleCombineSender, channel, dest, row});
  }
}

// Coordinated sender (at most 2 ranks, as in dispatch): a warp of the peer's group (SenderGroups::combine) pushes the
// rows of the peer's stream whose position is its own (position % group warps == its index) and after each row
// publishes its progress word in shared memory: every position below it that this warp owns is written. The
// sender coordinator turns progress into ring tails.
template <int kUnroll>
__device__ void combine_sender_coordinated(const CombineParams& p, int channel, int32_t* s_progress) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, R = p.num_ranks, me = p.peers.rank;
  const SenderGroups::Place place = SenderGroups::combine(R).place(warp, R, me);
  if (place.index >= place.warps) return;  // idle (the coordinator reads group warps' words only)
  const int dest = place.dest, gwarp = place.index, gwarps = place.warps;
  const int row_begin = p.recv_channel_prefix_matrix[dest * p.num_channels + channel];
  const int n = row_end_of(p, dest, channel) - row_begin;
  NvlControl* dst = nvl_control(p.peers, dest);
  const uint64_t* head_ptr = &dst->combine_head[channel][me];
  const uint64_t base = read_idle(&dst->combine_tail[channel][me]);  // idle ring: head == tail == base
  const uint64_t cap = p.ring.capacity;
  uint64_t head_seen = base;
  int32_t* progress = s_progress + warp;

  for (int i = gwarp; i < n; i += gwarps) {
    head_seen = wait_for_slot(i, base, cap, head_seen, head_ptr, progress, nullptr, p.fail,  // the reducers' head
                              kRoleCombineSender, channel, dest, row_begin + i);
    uint8_t* slot = p.ring.slot(dst, channel, me, base + i);
    const int row = row_begin + i;
    // The weight is loaded before the row so that its latency hides behind the copy.
    const float w = lane < p.num_topk ? ld_nc(p.topk_weights + int64_t(row) * p.num_topk + lane) : 0.f;
    write_rows<kUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(row) * p.x_int4, p.x_int4, lane, LoadNc{});
    if (lane < p.num_topk) reinterpret_cast<float*>(slot + p.record.weight_offset)[lane] = w;
    __syncwarp();  // every lane's stores of this row come before lane 0's release
    if (lane == 0) st_release_cta(progress, min(i + gwarps, n));  // pairs with the coordinator's acquire
  }
  __syncwarp();
  if (lane == 0) st_release_cta(progress, -n - 1);  // done: the final count, negated
}

// Sender coordinator (the sender block's last warp): see coordinate_sender_tails.
__device__ void combine_sender_coordinator(const CombineParams& p, int channel, const int32_t* s_progress) {
  const int lane = threadIdx.x % 32, me = p.peers.rank;
  uint64_t* tail_j = lane < p.num_ranks ? &nvl_control(p.peers, lane)->combine_tail[channel][me] : nullptr;
  coordinate_sender_tails(tail_j, s_progress, SenderGroups::combine(p.num_ranks), p.num_ranks, me, p.fail,
                          kRoleCombineSenderCoordinator, channel);
}

// Lane j < R of a reducer or of the coordinator serves ring (c, j); with kOwnInPlace none serves this rank.
template <bool kInPlace>
__device__ __forceinline__ bool ring_lane(const CombineParams& p, int lane) {
  return lane < p.num_ranks && !(kInPlace && lane == p.peers.rank);
}

template <int kRanks>
__device__ void combine_reducer(const CombineParams& p, int channel, int (*s_need)[kMaxNvlRanks]) {
  constexpr bool kInPlace = kOwnInPlace<kRanks>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, R = p.num_ranks, me = p.peers.rank;
  NvlControl* self = nvl_self(p.peers);
  const ChannelRange range = ChannelRange::of(p.num_tokens, p.num_channels, channel);
  const bool ring = ring_lane<kInPlace>(p, lane);
  const uint64_t base = ring ? read_idle(&self->combine_head[channel][lane]) : 0;
  const int own_begin = kInPlace ? p.recv_channel_prefix_matrix[me * p.num_channels + channel] : 0;  // own pos 0's row
  volatile int* need_slot = s_need[warp];

  for (int t = range.begin + warp; t < range.end; t += kReducerWarps) {
    int pos = -1;
    if (lane < R) {
      pos = p.send_head[int64_t(t) * R + lane];
      if (!kInPlace || lane != me) {                  // ring_lane
        need_slot[lane] = pos >= 0 ? pos : -pos - 1;  // positions below this are no longer needed by this warp
        if (pos >= 0)                                 // pairs with the sender's release of tail
          wait_at_least(&self->combine_tail[channel][lane], base + pos + 1, p.fail,
                        WaitSite{kRoleCombineReceiver, channel, lane, t});
      }
    }
    __syncwarp();
    const uint32_t valid = __ballot_sync(kFullMask, pos >= 0);
    const int own_row = kInPlace ? own_begin + __shfl_sync(kFullMask, pos, me) : 0;  // x row of the own row, if valid
    const int4* rows[kRanks];
#pragma unroll
    for (int j = 0; j < kRanks; ++j) {
      const int pj = __shfl_sync(kFullMask, pos, j);
      const uint64_t bj = __shfl_sync(kFullMask, base, j);
      rows[j] = !((valid >> j) & 1u)  ? nullptr
                : kInPlace && j == me ? p.x + int64_t(own_row) * p.x_int4
                                      : reinterpret_cast<const int4*>(p.ring.slot(self, channel, j, bj + pj));
    }
    reduce_row<kRanks, 8 / kRanks>(p, t, rows, valid, lane, 0, p.x_int4);
    if (p.combined_topk_weights != nullptr && lane < p.num_topk) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kRanks; ++j)
        if ((valid >> j) & 1u) {
          const float* w =
              kInPlace && j == me
                  ? p.topk_weights + int64_t(own_row) * p.num_topk
                  : reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(rows[j]) + p.record.weight_offset);
          acc += __int_as_float(ld_cg(reinterpret_cast<const int32_t*>(w) + lane));
        }
      p.combined_topk_weights[int64_t(t) * p.num_topk + lane] = acc;
    }
    __syncwarp();  // this token's records are consumed before the next need is published
  }
  if (ring) need_slot[lane] = INT_MAX;
}

// The coordinator's budget ran out (it starts first, so it expires before the reducers' waits): the report names
// the source rank whose data the reducers wait for, the lowest lane j whose oldest needed record (position
// `published`, the head) has not arrived (tail - base <= published < total). A stream that is behind only
// because its ring is full (tail - head == capacity) is not that: its records are there. With no such rank the
// first unfinished one is named. Peer lanes read one ring tail each, once, at the timeout only. Does not return.
template <bool kInPlace>
__device__ __noinline__ void coordinator_timeout(const CombineParams& p, int channel, uint64_t base, int published,
                                                 int total) {
  const int lane = threadIdx.x % 32;
  const bool active = ring_lane<kInPlace>(p, lane);
  const int arrived = active ? int(ld_acquire_sys(&nvl_self(p.peers)->combine_tail[channel][lane]) - base) : 0;
  const uint32_t unfinished = __ballot_sync(kFullMask, active && published < total);
  const uint32_t starved = __ballot_sync(kFullMask, active && published < total && arrived <= published);
  const int culprit = __ffs(starved != 0 ? starved : unfinished) - 1;
  // a = records arrived from the peer, b = the head (the record the reducers need next), c = records in total
  if (lane == culprit)
    fail_fatal(p.fail, kErrTimeout, WaitSite{kRoleCombineCoordinator, channel, lane, total}, arrived, published);
  __syncwarp();
  __trap();  // not reached: the culprit's lane traps
}

// Publishes, for every ring (c, j), head = base + min over reducers of the position they may still need.
template <bool kInPlace>
__device__ void combine_coordinator(const CombineParams& p, int channel, int (*s_need)[kMaxNvlRanks]) {
  const int lane = threadIdx.x % 32, C = p.num_channels;
  NvlControl* self = nvl_self(p.peers);
  const bool active = ring_lane<kInPlace>(p, lane);
  const uint64_t base = active ? read_idle(&self->combine_head[channel][lane]) : 0;
  const int total = active ? p.channel_prefix_matrix[lane * C + channel] -
                                 (channel > 0 ? p.channel_prefix_matrix[lane * C + channel - 1] : 0)
                           : 0;
  int published = 0;
  SpinBudget budget;
  while (true) {
    if (active) {
      int m = INT_MAX;
      for (int w = 0; w < kReducerWarps; ++w) m = min(m, reinterpret_cast<volatile int*>(s_need[w])[lane]);
      if (m == INT_MAX) m = total;
      if (m > published) {
        publish(&self->combine_head[channel][lane], base + m);  // pairs with the sender's acquire of head
        published = m;
      }
    }
    if (__all_sync(kFullMask, !active || published == total)) break;
    if (budget.expired(p.fail, WaitSite{kRoleCombineCoordinator, channel, lane, total}))
      coordinator_timeout<kInPlace>(p, channel, base, published, total);
  }
}

template <int kUnroll, int kRanks>
__global__ void __launch_bounds__(kDataThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
  __shared__ int s_need[kReducerWarps][kMaxNvlRanks];
  if (!start_operation(p.fail, p.peers, p.num_ranks, true, p.signature)) return;  // every rank skips
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    // At most 2 ranks the coordinated sender, at more the chunked one: each is the faster there
    // (docs/bench-notes.md).
    run_sender_block<kRanks <= 2>([&](int32_t* progress) { combine_sender_coordinated<kUnroll>(p, channel, progress); },
                                  [&](const int32_t* progress) { combine_sender_coordinator(p, channel, progress); },
                                  [&](ChunkGrants& grants) { combine_sender<kUnroll>(p, channel, grants); });
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < kReducerWarps && lane < kMaxNvlRanks) s_need[warp][lane] = 0;
  __syncthreads();
  if (warp < kReducerWarps)
    combine_reducer<kRanks>(p, channel, s_need);
  else
    combine_coordinator<kOwnInPlace<kRanks>>(p, channel, s_need);
}

}  // namespace

void launch_combine(const CombineParams& p, cudaStream_t stream) {
  const int blocks = p.num_channels * 2;
  if (p.num_ranks <= 2)
    combine_kernel<kCopyUnroll, 2><<<blocks, kDataThreads, 0, stream>>>(p);
  else if (p.num_ranks <= 4)
    combine_kernel<kCopyUnroll, 4><<<blocks, kDataThreads, 0, stream>>>(p);
  else
    combine_kernel<kCopyUnroll, 8><<<blocks, kDataThreads, 0, stream>>>(p);
}

}  // namespace epx
