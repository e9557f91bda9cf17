// The per-set epochs of the low-latency ops (runtime/ll_layout.hpp): every rank counts the receive phases it
// completed on a buffer set and stores the count into every peer, and a sender writes into a peer's set only
// once the peer has received every earlier op there. Both kernels end their receive phases with these.
#pragma once

#include <cstdint>

#include "device/grid_barrier.cuh"
#include "device/wait.cuh"
#include "kernels/ll_params.hpp"
#include "kernels/ll_transport.cuh"
#include "runtime/limits.hpp"

namespace epx::dev {

// The number of ops on the set before this one: every earlier op there was received by this rank before this
// one was sent (the host keeps that order: runtime/low_latency_ops.cpp, choose_set), so it is this rank's
// receive count, written by the last receiving block of an earlier kernel on the stream.
__device__ __forceinline__ int32_t ops_before(const LowLatencyLayout& layout, const LowLatencyPeers& peers, int set) {
  return *layout.recv_count(peers.local, set);
}

// The ranks a thread has already seen ready for this op (bit r: recv_seen[r] reached k_ops). A sender polls a
// rank's epoch once per op instead of once per row: the many warps that write to the same rank would otherwise
// all poll the same word with system-scope acquires.
struct ReadyRanks {
  uint32_t bits = 0;
  static_assert(kMaxNvlRanks <= 32, "one bit per low-latency rank");
};

// The thread's writes into rank r's set after this come after r received every earlier op there. Acquire (the
// first time per rank; later calls rely on that acquire, earlier in this thread's program order); pairs with
// the release in r's publish_receive.
__device__ __forceinline__ void wait_rank_ready(ReadyRanks& ready, const int32_t* recv_seen, int r, int32_t k_ops,
                                                const FailEnv& env, const WaitSite& site) {
  const uint32_t bit = 1u << r;
  if (ready.bits & bit) return;
  wait_epoch(recv_seen + r, k_ops, env, site);
  ready.bits |= bit;
}

// Every thread of a block: whether this block is the last of the grid to finish the receive phase (its
// arrival acquires every other block's work).
__device__ __forceinline__ bool arrive_last_receiver(const LowLatencyLayout& layout, const LowLatencyPeers& peers,
                                                     int set) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) s_last = grid_arrive_is_last(layout.recv_arrivals(peers.local, set)) ? 1 : 0;
  __syncthreads();
  return s_last != 0;
}

// Every thread of the last receiving block, after its clears: counts the receive and stores the new count into
// every rank's recv_seen[me].
__device__ __forceinline__ void publish_receive(const LowLatencyLayout& layout, const LowLatencyPeers& peers, int set,
                                               int me, int num_ranks) {
  __shared__ int32_t s_count;
  __syncthreads();  // the block's clears before the releases below (cumulative)
  if (threadIdx.x == 0) {
    int32_t* count = layout.recv_count(peers.local, set);
    s_count = int32_t(uint32_t(*count) + 1u);  // wraps; wait_epoch compares wrap-safe
    *count = s_count;
  }
  __syncthreads();
  if (threadIdx.x < num_ranks) signal(peers, threadIdx.x, layout.recv_seen(peers.local, set) + me, s_count);
}

// End of a receive phase, every thread of every block, after the block's last read of the receive area and its
// clears of count slots or flags: the last block to arrive (its arrival acquires every other block's) counts the
// receive and stores the new count into every rank's recv_seen[me]. Release: pairs with wait_epoch at the
// senders of the next op on this set.
__device__ __forceinline__ void finish_receive(const LowLatencyLayout& layout, const LowLatencyPeers& peers, int set,
                                               int me, int num_ranks) {
  if (arrive_last_receiver(layout, peers, set)) publish_receive(layout, peers, set, me, num_ranks);
}

}  // namespace epx::dev
