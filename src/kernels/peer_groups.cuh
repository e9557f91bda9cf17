// Warp roles of the high-throughput data blocks: the block's warps are split into one group per peer
// (kDataWarps / R warps each); a group synchronises on its own named barrier, so groups never wait for
// each other. Leftover warps (when R does not divide kDataWarps) stay idle.
#pragma once

#include "runtime/limits.hpp"

namespace epx {

struct PeerGroup {
  int peer;           // the rank this group sends to or receives from
  int warp;           // warp index inside the group
  int warps;          // warps in the group
  int threads;        // warps * 32, for the named barrier
  int barrier_id;     // 1 + peer (0 is __syncthreads)
  bool leader;        // lane 0 of warp 0: polls and publishes ring indices

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
};

// Groups of a coordinated sender block (dispatch and combine at most 2 ranks): its first kSenderWarps warps, one
// group per destination in rank order; the last warp is the sender coordinator (kernels/dispatch.cu). The group for this rank itself writes
// local memory, ~1.5x faster per warp than a peer over NVLink (group timers, docs/bench-notes.md v0.13), so it
// is the smaller one: the peers get ceil(W / R) warps each (at most (W - 1) / (R - 1)), it gets the rest.
constexpr int kSenderWarps = kDataWarps - 1;

struct SenderGroups {
  int own;   // warps of the group for this rank
  int each;  // warps of every other group

  __host__ __device__ static SenderGroups of(int num_ranks) {
    if (num_ranks <= 1) return {kSenderWarps, 0};
    int each = (kSenderWarps + num_ranks - 1) / num_ranks;
    if (each > (kSenderWarps - 1) / (num_ranks - 1)) each = (kSenderWarps - 1) / (num_ranks - 1);
    return {kSenderWarps - (num_ranks - 1) * each, each};
  }
  __host__ __device__ int warps(int peer, int self) const { return peer == self ? own : each; }
  __host__ __device__ int first_warp(int peer, int self) const {
    return peer * each + (peer > self ? own - each : 0);
  }
};

static_assert(kSenderWarps >= kMaxNvlRanks, "every sender group needs a warp");

static_assert(kDataWarps / kMaxNvlRanks >= 1, "every peer needs a warp");
static_assert(kMaxNvlRanks + 1 <= 16, "one named barrier per peer");

}  // namespace epx
