// The per-set epochs of the low-latency ops (layout/ll_layout.hpp): every block of every rank counts the
// receive phases it completed on a buffer set (block_ops, its own) and adds each completion to every rank's
// recv_seen[me]; a sender writes into a peer's set only once every block of the peer has received every
// earlier op there. No block waits for the others at the end of a phase. Both kernels use these.
// When the add happens: with rank masking at the end of the receive phase, behind a system-scope release
// (finish_receive); without it at the start of the block's next low-latency kernel (announce_receives), where the
// end of the receive's grid orders it, so the receive ends without a fence. The host runs every low-latency kernel
// of a Buffer in one stream order (semantics.md, ordering rules), which is what "next" relies on.
#pragma once

#include <cstdint>

#include "device/transport.cuh"
#include "device/wait.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/limits.hpp"
#include "layout/ll_params.hpp"

namespace epx::dev {

// The number k of ops on the set before this one, as this block counted them: every earlier op there was
// received by this rank before this one was sent (the host keeps that order: runtime/low_latency_ops.cpp,
// choose_set). Written by this same block index at the end of an earlier kernel's receive phase.
__device__ __forceinline__ uint32_t ops_before(const LowLatencyLayout& layout, const RegionMap& region, int set) {
  return layout.block_ops(region.local, set)[blockIdx.x];
}

// Whether a block counter read as v has reached target, compared in its low 32 bits, wrap-safe (the counter is a sum
// of ones, so that is exact modulo 2^32 while it is less than 2^31 ahead: it can be at most one op's G ahead here).
__device__ __forceinline__ bool epoch_reached(uint64_t v, uint32_t target) {
  return int32_t(uint32_t(v) - target) >= 0;
}

// Waits until the block counter *p has reached target (epoch_reached). Acquire.
__device__ __forceinline__ void wait_blocks(const uint64_t* p, uint32_t target, const FailState& env,
                                            const WaitSite& site) {
  wait_until<Poll::kRelaxed>(
      p, [target](uint64_t v) { return epoch_reached(v, target); }, target, env, site);
}

// wait_blocks for rank `rank`'s epoch word under rank masking (kernels/low_latency/shrink.cuh): false when the rank
// is left out (nothing may then be written into its set). Without enable_shrink, wait_blocks.
__device__ __forceinline__ bool wait_blocks_of_rank(const uint64_t* p, uint32_t target, const RankMask& mask, int me,
                                                    int rank, const FailState& env, const WaitSite& site) {
  uint64_t seen = 0;
  return wait_for_rank(
      p, [target](uint64_t v) { return epoch_reached(v, target); }, target, mask, me, rank, env, site, &seen);
}

// The back-pressure wait at the start of a send phase, run by one whole warp of the block: lane r < num_ranks polls
// rank r's epoch word on this set until every block of r has received the k_ops earlier ops there, so nothing unread
// is overwritten (a local acquire that pairs with r's epoch adds: announce_receives, or finish_receive with rank
// masking). With kShrink a rank left out is not waited for, one silent past the shrink budget is masked, and lane 0
// writes the ranks this op leaves out (the mask as it is after the waits) to *skip, which the block reads after a
// barrier.
template <bool kShrink>
__device__ __forceinline__ void wait_back_pressure(const uint64_t* recv_seen, uint32_t k_ops, const RankMask& mask,
                                                   int me, int num_ranks, const FailState& env, int role,
                                                   uint32_t* skip) {
  const int lane = threadIdx.x % 32;
  if (lane < num_ranks)
    wait_blocks_of_rank(recv_seen + lane, k_ops * gridDim.x, mask, me, lane, env, WaitSite{role, -1, lane, -1});
  if (kShrink) {
    __syncwarp();  // the lanes' masking stores (atomicExch) come before lane 0's reads
    if (lane == 0) *skip = left_out_ranks(mask, me, num_ranks);
  }
}

// Start of every low-latency kernel without rank masking, right after wait_prior_grids, lanes 0..2R-1 of the block's
// last warp (lane = set * R + rank): block b adds the receive phases it completed on each set and has not added yet
// (block_ops - block_told: at most the last earlier kernel's) to every rank's recv_seen[me] there, then records them
// as told. Those phases belong to grids that wait_prior_grids saw complete: their loads of the receive area have
// their values and their clears of count slots are in place, so the add needs no fence (add_after_prior_grids);
// it pairs with the back-pressure polls (wait_blocks) of the peers' next senders on the set. Every rank makes the
// same calls, so a peer that waits for this add gets it once this rank starts a later low-latency kernel, at the
// latest the first kernel of the very call the peer is sending, and nothing here waits.
__device__ __forceinline__ void announce_receives(const LowLatencyLayout& layout, const RegionMap& region, int me,
                                                  int num_ranks) {
  const int lane = threadIdx.x % 32;
  if (threadIdx.x / 32 != blockDim.x / 32 - 1 || lane >= 2 * num_ranks) return;  // 2R <= 2 * kMaxNvlRanks <= 32
  const int set = lane / num_ranks, rank = lane % num_ranks;
  uint32_t* told = layout.block_told(region.local, set) + blockIdx.x;
  // Both written only by this block index: the receive phase of an earlier grid, and this function in one.
  const uint32_t received = layout.block_ops(region.local, set)[blockIdx.x];
  const uint32_t new_ops = received - *told;  // wraps, as block_ops does
  if (new_ops != 0) add_after_prior_grids(region, rank, layout.recv_seen(region.local, set) + me, uint64_t(new_ops));
  __syncwarp((1u << (2 * num_ranks)) - 1u);  // every lane of the set read *told before lane `set * R` writes it
  if (rank == 0 && new_ops != 0) *told = received;
}

// End of a receive phase, every thread of every block, after the block's last read of the receive area and its
// clears of count slots: the block counts the op as received (its own block_ops, read by this block index in a later
// grid). Without rank masking that is all: announce_receives adds it to the ranks' recv_seen at the start of the
// block's next low-latency kernel. With rank masking (kShrink) the block adds it here, to every rank's recv_seen[me]
// but those left out (nothing is written into their regions), and marks it told. Release (the barrier first, so it
// covers every thread's reads and clears): pairs with the back-pressure polls (wait_blocks) at the senders of the
// next op on this set. The mask may change between calls (semantics.md section 9), so its adds are not deferred.
template <bool kShrink>
__device__ __forceinline__ void finish_receive(const LowLatencyLayout& layout, const RegionMap& region, int set,
                                               uint32_t k_ops, int me, int num_ranks, const RankMask& mask) {
  if constexpr (!kShrink) {
    if (threadIdx.x == 0) layout.block_ops(region.local, set)[blockIdx.x] = k_ops + 1u;  // wraps; only this block
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    layout.block_ops(region.local, set)[blockIdx.x] = k_ops + 1u;
    layout.block_told(region.local, set)[blockIdx.x] = k_ops + 1u;
  }
  if (threadIdx.x < num_ranks && !rank_left_out(mask, me, threadIdx.x))
    signal_add(region, threadIdx.x, layout.recv_seen(region.local, set) + me, 1);
}

}  // namespace epx::dev
