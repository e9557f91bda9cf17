// The pieces every low-latency combine phase shares (kernels/low_latency/combine.cu): the block shape, the arrival
// slots, and the send's frame: the rows per (local expert, source) and the back-pressure wait at its start, every
// pair's target at the source, and the fence and arrival adds at its end. One translation unit includes it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "kernels/low_latency/epochs.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/limits.hpp"
#include "layout/ll_params.hpp"

namespace epx::dev::ll_combine {
namespace {  // internal linkage: a __noinline__ function here gets its kernel's register budget

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = kCopyItemInt4;  // int4 per send work item (device/transport.cuh)

// The slot of (expert rank, its local expert) in the arrival counters and targets (layout/ll_layout.hpp). Not the
// global expert: a call with another expert count on the same buffer maps global experts to other ranks, and
// the running totals (combine_sent at the sender, combine_arrived at the source) must keep pairing up.
__device__ __forceinline__ int arrival_slot(int rank, int local_expert, int num_ranks) {
  return rank * (kLowLatencyMaxExperts / num_ranks) + local_expert;
}

// Where a row this rank returns to itself leaves its index in x (its receive slot's first word) when the
// receive phase reads it in place.
__device__ __forceinline__ int32_t* local_row_of(int4* receive, int64_t slot, int row_int4) {
  return reinterpret_cast<int32_t*>(receive + slot * row_int4);
}

// The start of every send phase: the rows per (local expert, source) into shared memory (s_range: (begin, count) of
// each pair's rows among its expert's, by source ascending), s_items zeroed, and the back-pressure wait. -> the ranks
// this op leaves out (rank masking; 0 without).
template <bool kShrink>
__device__ __forceinline__ uint32_t begin_send(const LowLatencyCombineParams& p, int2* s_range, int* s_items) {
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  const int warp = threadIdx.x / 32;
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  const uint64_t* recv_seen = p.layout.recv_seen(p.peers.ll.local, p.set);
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // earlier ops on this set, of either kind
  // Rows per (local expert, source) and their begins, from the layout ranges: one load per pair, all threads at once.
  for (int pair = threadIdx.x; pair < L * R; pair += kThreads) {
    const int64_t range = p.recv_layout_range[pair];
    s_range[pair] = int2{int(range >> 32), int(range & 0xffffffff)};
    s_items[pair] = 0;
  }
  // Back-pressure (wait_back_pressure), once per block instead of once per warp and destination (4224 warps polling
  // the same R words); the barrier orders every thread's writes into a rank's set after the wait for it, and s_skip
  // holds the ranks this op leaves out (rank masking).
  __shared__ uint32_t s_skip;
  if (warp == 0)
    wait_back_pressure<kShrink>(recv_seen, k_ops, mask, me, R, p.fail, kRoleLowLatencyCombineSend, &s_skip);
  __syncthreads();
  return kShrink ? s_skip : 0u;
}

// s_first from s_range: row g of the concatenation of every local expert's packed rows belongs to expert i when
// s_first[i] <= g < s_first[i + 1] (warp 0's scan; s_first[L] is the total).
__device__ __forceinline__ void prefix_rows(const LowLatencyCombineParams& p, const int2* s_range, int* s_first) {
  const int R = p.num_ranks, L = p.num_experts / R;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < L; base += 32) {
      const int i = base + lane;
      int n = 0;
      if (i < L)
        for (int s = 0; s < R; ++s) n += s_range[i * R + s].y;
      const int incl = warp_inclusive_scan(n);
      if (i < L) s_first[i] = carry + incl - n;
      carry += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) s_first[L] = carry;
  }
  __syncthreads();
}

// Row g (< s_first[L]) of the concatenation -> its local expert i, its index n among i's rows, its source s.
__device__ __forceinline__ void row_of(const int* s_first, const int2* s_range, int L, int R, int g, int* i, int* n,
                                       int* s) {
  int lo = 0, hi = L;  // largest i with s_first[i] <= g
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s_first[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  *i = lo;
  *n = g - s_first[lo];
  int src = 0;
  while (src < R - 1 && *n >= s_range[lo * R + src].x + s_range[lo * R + src].y) ++src;  // by source, ascending
  *s = src;
}

// Every (local expert, source) pair's target at the source, one warp per pair, also for pairs without rows (the
// source may wait for them: it only knows which experts its tokens chose): this op's items of the pair, `parts` per
// row, on top of the pair's running total. Only this rank adds to the source's counter for this expert, and only
// the warp of the pair's index writes the total (the grid is the same in every call); the slot at the source is
// free to overwrite since the back-pressure wait (its receivers of the last combine on the set are done).
__device__ __forceinline__ void post_targets(const LowLatencyCombineParams& p, const int2* s_range, int parts,
                                             uint32_t skip) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  int32_t* sent = p.layout.combine_sent(p.peers.ll.local, p.set);  // running totals per (local expert, source)
  uint64_t* targets = p.layout.combine_target(p.peers.ll.local, p.set);
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);
  for (int pair = blockIdx.x * kWarps + warp; pair < L * R; pair += gridDim.x * kWarps) {
    if (lane != 0) continue;
    const int i = pair / R, s = pair % R;
    if (skip >> s & 1) continue;  // left out: its running total stays
    const int32_t target = int32_t(uint32_t(sent[pair]) + uint32_t(s_range[pair].y * parts));  // wraps
    sent[pair] = target;
    post64(p.peers.ll, s, targets + arrival_slot(me, i, R), uint64_t(k_ops + 1u) << 32 | uint32_t(target));
  }
}

// The end of every send phase: the block's items are issued; one fence (it waits for every store the block issued,
// the barrier putting them before it), then one add per pair the block wrote to, at the pair's source. Every lane of
// warp 0 runs the one fence, so that each of its adds is a write of the same thread after it (a release pattern; one
// fence however many pairs the block's items touched). Pairs with the receiver's acquire of arrived[e] (receive_phase).
// The waits of the receive phase start only after this (its threads k < K are warp 0's; the other warps block at its
// barrier): waits or row loads while the SM's stores still drain made the combine slower (docs/bench-notes.md).
__device__ __forceinline__ void end_send(const LowLatencyCombineParams& p, const int* s_items) {
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  int32_t* arrived = p.layout.combine_arrived(p.peers.ll.local, p.set);  // addresses here = offsets at every peer
  __syncthreads();
  if (threadIdx.x < 32) {
    bool any = false;
    for (int pair = threadIdx.x; pair < L * R; pair += 32) any |= s_items[pair] != 0;
    if (!__any_sync(kFullMask, any)) return;  // the block wrote nothing
    fence_release_sys();
    for (int pair = threadIdx.x; pair < L * R; pair += 32) {
      const int n = s_items[pair];
      if (n != 0) add_after_fence(p.peers.ll, pair % R, arrived + arrival_slot(me, pair / R, R), n);
    }
  }
}

}  // namespace
}  // namespace epx::dev::ll_combine
