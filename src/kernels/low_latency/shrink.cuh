// Rank masking ("shrink", semantics.md section 9) in the low-latency kernels. A buffer created with enable_shrink
// passes its mask (NvlControl::ll_mask, this rank's own view) in RankMask; without it the phases run their versions
// instantiated without masking (shrink_mask<false>), where RankMask::words is null at compile time and every helper
// here is the plain wait.
//
// A rank left out (its word set, or every rank when this rank's own word is set: a rank that masked itself takes
// no part) is skipped by both kernels: nothing is written into its region (records, counts, arrivals, targets,
// rows, epoch adds), nothing of it is waited for, its rows are not received (dispatch counts 0 from it) and its
// experts' slots count as -1 in the combine. A wait for one rank that outlasts RankMask::budget_ns masks that rank
// (device/wait.cuh, wait_until_or_mask) and the call completes without it. What a rank left out still writes into
// this rank's region, and what this rank wrote into it before masking it, stays there: the signals are only
// consistent again after clean_low_latency_buffer on every rank (docs/semantics.md section 9).
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "layout/fail_state.hpp"

namespace epx::dev {

// The mask a phase instantiated with (kShrink) or without rank masking works with: without, its words are null at
// compile time and every helper below folds into the plain wait (a buffer without enable_shrink runs no masking code).
template <bool kShrink>
__device__ __forceinline__ RankMask shrink_mask(const RankMask& m) {
  return kShrink ? m : RankMask{nullptr, 0};
}

// Whether this call leaves rank r out, as the mask says now (false without enable_shrink).
__device__ __forceinline__ bool rank_left_out(const RankMask& m, int me, int r) {
  return m.words != nullptr && (ld_relaxed_sys(m.words + r) != 0 || ld_relaxed_sys(m.words + me) != 0);
}

// The ranks left out as bits (rank r at bit r; num_ranks <= 32), as the mask says now. Only with enable_shrink.
__device__ __forceinline__ uint32_t left_out_ranks(const RankMask& m, int me, int num_ranks) {
  const uint32_t all = num_ranks >= 32 ? ~0u : (1u << num_ranks) - 1;
  if (ld_relaxed_sys(m.words + me) != 0) return all;
  uint32_t bits = 0;
  for (int r = 0; r < num_ranks; ++r) bits |= ld_relaxed_sys(m.words + r) != 0 ? 1u << r : 0u;
  return bits;
}

// wait_until for a value that rank `rank` writes: true once reached (*seen set); false when the rank is left out,
// before the wait or during it (enable_shrink only; without it the plain wait, which fails the call on timeout). Polls
// relaxed and acquires once the value is reached (Poll::kRelaxed, device/wait.cuh).
template <typename T, typename Reached>
__device__ __forceinline__ bool wait_for_rank(const T* p, Reached reached, int64_t awaited, const RankMask& m, int me,
                                              int rank, const FailState& env, const WaitSite& site, T* seen) {
  if (m.words == nullptr) {
    *seen = wait_until<Poll::kRelaxed>(p, reached, awaited, env, site);
    return true;
  }
  if (rank_left_out(m, me, rank)) return false;
  return wait_until_or_mask<Poll::kRelaxed>(p, reached, awaited, m, me, rank, env, site, seen);
}

}  // namespace epx::dev
