// The rotating tail publisher of a chunked sender group (dispatch and combine at 3 ranks or more): the group's
// warps write chunk c of a ring's records, then arrive at the group's barrier without waiting and go on to chunk
// c + 1 once it is granted; chunk c's publisher (warp c % warps) waits at the barrier for the chunk's records,
// grants the next chunk and publishes the tail with a system-scope release. That release's fence (microseconds
// on a busy SM) so holds back one warp, not the group (docs/bench-notes.md). The grant also keeps every warp
// within one chunk of the barrier's phase: a warp arrives for chunk c + 1 only after the publisher of chunk c
// has passed the barrier.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "kernels/intranode/peer_groups.cuh"
#include "kernels/intranode/sender_groups.hpp"

namespace epx {

// Shared memory of a sender block's groups, one entry per destination.
struct ChunkGrants {
  int32_t granted[kMaxNvlRanks];     // chunks the group may write; chunk 0 always fits the idle ring
  uint64_t head_seen[kMaxNvlRanks];  // the receiver's head as last read (publishers' lane 0 only)

  __device__ __forceinline__ void init() {
    if (threadIdx.x < kMaxNvlRanks) granted[threadIdx.x] = 0;
  }
};

// Before chunk c (c > 0): every warp waits until it is granted. Pairs with the grant's release in
// publish_chunk by chunk c - 1's publisher (whose head acquire comes before it).
__device__ __forceinline__ void wait_for_grant(ChunkGrants& s, const PeerGroup& g, int c, const FailState& env,
                                               const dev::WaitSite& site) {
  if (c > 0 && threadIdx.x % 32 == 0) {
    dev::SpinBudget budget;
    for (int32_t seen; (seen = dev::ld_acquire_cta(&s.granted[g.peer])) < c;) budget.tick(env, site, seen, c);
  }
  __syncwarp();
}

// After chunk c's records (this warp's share written, tail already advanced by the chunk's `taken` records):
// every warp but the publisher arrives at the group barrier and returns; the publisher waits there, grants chunk
// c + 1 (room for up to `chunk` positions past tail once the ring's head reaches tail + chunk - cap) and releases
// the tail; granted before the tail when the last head seen, or one fresh read, allows it, else after (the
// receiver may need chunk c to free the room).
__device__ __forceinline__ void publish_chunk(ChunkGrants& s, const PeerGroup& g, int c, uint64_t base, uint64_t tail,
                                              int taken, int chunk, uint64_t cap, uint64_t* tail_ptr,
                                              const uint64_t* head_ptr, const FailState& env,
                                              const dev::WaitSite& site) {
  if (c % g.warps != g.warp) {
    dev::named_barrier_arrive(g.barrier_id, g.threads);  // this warp's records of chunk c are written
    return;
  }
  dev::named_barrier(g.barrier_id, g.threads);  // every record of chunk c is written
  if (threadIdx.x % 32 == 0) {
    uint64_t head = c == 0 ? base : s.head_seen[g.peer];
    if (tail + chunk > cap + head) head = dev::acquire(head_ptr);  // pairs with the receiver's head release
    const bool room = tail + chunk <= cap + head;
    if (room) {
      s.head_seen[g.peer] = head;
      dev::st_release_cta(&s.granted[g.peer], c + 1);
    }
    if (taken > 0) dev::publish(tail_ptr, tail);  // pairs with the receiver's acquire of tail
    if (!room) {
      s.head_seen[g.peer] = dev::wait_at_least(head_ptr, tail + chunk - cap, env, site);
      dev::st_release_cta(&s.granted[g.peer], c + 1);
    }
  }
  __syncwarp();
}

// A sender block (dispatch and combine) of kWarps warps: at 2 ranks or fewer (kCoordinated) the first kWarps - 1
// warps run coordinated(progress words) and the last warp coordinator(progress words)
// (kernels/sender_coordinator.cuh); otherwise every warp runs chunked(grants), the chunked senders of this header.
template <bool kCoordinated, int kWarps = kDataWarps, typename Coordinated, typename Coordinator, typename Chunked>
__device__ __forceinline__ void run_sender_block(Coordinated coordinated, Coordinator coordinator, Chunked chunked) {
  if constexpr (kCoordinated) {
    __shared__ int32_t s_progress[kWarps - 1];  // per sender warp
    if (threadIdx.x < kWarps - 1) s_progress[threadIdx.x] = 0;
    __syncthreads();
    if (threadIdx.x / 32 < kWarps - 1)
      coordinated(s_progress);
    else
      coordinator(s_progress);
  } else {
    __shared__ ChunkGrants grants;
    grants.init();
    __syncthreads();
    chunked(grants);
  }
}

}  // namespace epx
