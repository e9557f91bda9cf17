// Warp roles of the high-throughput data blocks: the block's warps are split into one group per peer
// (kDataWarps / R warps each); a group synchronises on its own named barrier, so groups never wait for
// each other. Leftover warps (when R does not divide kDataWarps) stay idle.
#pragma once

#include "kernels/intranode/sender_groups.hpp"
#include "layout/limits.hpp"

namespace epx {

struct PeerGroup {
  int peer;        // the rank this group sends to or receives from
  int warp;        // warp index inside the group
  int warps;       // warps in the group
  int threads;     // warps * 32, for the named barrier
  int barrier_id;  // 1 + peer (0 is __syncthreads)
  bool leader;     // lane 0 of warp 0: polls and publishes ring indices

  __device__ __forceinline__ static bool of(int num_ranks, PeerGroup& g) {
    const int warp = threadIdx.x / 32;
    g.warps = kDataWarps / num_ranks;
    g.peer = warp / g.warps;
    g.warp = warp % g.warps;
    g.threads = g.warps * 32;
    g.barrier_id = 1 + g.peer;
    g.leader = g.warp == 0 && threadIdx.x % 32 == 0;
    return g.peer < num_ranks;
  }
  // The chunked dispatch senders' groups (chunked_peer_slot): one per peer, none for this rank (its own tokens go
  // from x to the outputs in the receiver block, kernels/intranode/dispatch.cu); leftover warps stay idle. R >= 2.
  __device__ __forceinline__ static bool of_peers(int num_ranks, int self, PeerGroup& g) {
    const PeerSlot s = chunked_peer_slot(int(threadIdx.x / 32), num_ranks, self);
    g.peer = s.peer;
    g.warp = s.index;
    g.warps = s.warps;
    g.threads = g.warps * 32;
    g.barrier_id = 1 + g.peer;
    g.leader = g.warp == 0 && threadIdx.x % 32 == 0;
    return s.active;
  }
};

static_assert(kDataWarps / kMaxNvlRanks >= 1, "every peer needs a warp");
static_assert(kMaxNvlRanks + 1 <= 16, "one named barrier per peer");

}  // namespace epx
