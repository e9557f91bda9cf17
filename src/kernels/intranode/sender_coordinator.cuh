// The sender coordinator of a coordinated sender block (dispatch and combine at 2 ranks or fewer): the block's
// last warp turns its sender warps' progress words into ring tails.
#pragma once

#include <climits>
#include <cstdint>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "kernels/intranode/early_senders.cuh"
#include "kernels/intranode/sender_groups.hpp"
#include "layout/fail_state.hpp"

namespace epx {

// A coordinated sender warp about to write ring position i (this op's numbering; base = the ring's index at
// entry) when the ring may be full there: if the receiver has not yet freed that slot, lane 0 first releases the
// warp's progress as i (every position below it that the warp owns is written, so the tail can reach whatever
// the receiver needs to free the slot, at any ring capacity), then waits for the head. Returns the head seen,
// on every lane. The wait's diagnostic site is built only when it waits: a WaitSite built by the caller and
// passed in would be stored to local memory on every call, ahead of the branch (a large cost at 2 ranks).
// With early senders (`early` not null) no head moves before the operation's verdict, so the warp waits for that
// first, and returns kSlotSkipped when the operation skips.
constexpr uint64_t kSlotSkipped = ~uint64_t(0);
__device__ __forceinline__ uint64_t wait_for_slot(uint64_t i, uint64_t base, uint64_t cap, uint64_t head_seen,
                                                  const uint64_t* head_ptr, int32_t* progress, const EarlyStart* early,
                                                  const FailState& env, int role, int channel, int peer,
                                                  int64_t extra) {
  if (base + i + 1 <= cap + head_seen) return head_seen;
  __syncwarp();  // every lane's stores so far come before lane 0's release
  if (threadIdx.x % 32 == 0) dev::st_release_cta(progress, int32_t(i));  // pairs with the coordinator's acquire
  if (early != nullptr && !await_go(*early, env, role, channel)) return kSlotSkipped;
  if (threadIdx.x % 32 == 0)
    head_seen = dev::wait_at_least(head_ptr, base + i + 1 - cap, env, dev::WaitSite{role, channel, peer, extra});
  return __shfl_sync(dev::kFullMask, head_seen, 0);
}

// Lane j (< num_ranks) publishes *tail_j (the tail of this block's ring at rank j) = its value at entry + the minimum
// progress over group j's warps (`groups`), whenever that grows, until every warp of the group has marked itself done
// (progress negated: -count - 1); a group without warps publishes nothing. A warp's progress word says that every
// ring position below it that the warp owns is written. The acquire of the words and the system-scope release of the
// tail carry every record those warps wrote (release is cumulative), so the sender warps never wait for their stores
// to land; this warp does, once per publication (a system fence waits for every store in flight from the SM), while
// they keep writing. tail_j is null on lanes >= num_ranks.
__device__ __forceinline__ void coordinate_sender_tails(uint64_t* tail_j, const int32_t* s_progress,
                                                        const SenderGroups& groups, int num_ranks, int me,
                                                        const FailState& env, int role, int channel) {
  const int lane = threadIdx.x % 32;
  const bool active = lane < num_ranks && groups.warps(lane, me) > 0;
  const int first = active ? groups.first_warp(lane, me) : 0, warps = active ? groups.warps(lane, me) : 0;
  const uint64_t base = active ? dev::read_idle(tail_j) : 0;  // idle ring: nothing published this op yet
  int published = 0;
  bool done = !active;
  dev::SpinBudget budget;
  while (true) {
    if (!done) {
      int low = INT_MAX;
      bool finished = true;
      for (int w = first; w < first + warps; ++w) {
        const int32_t v = dev::ld_acquire_cta(s_progress + w);  // pairs with the sender warp's release
        finished &= v < 0;
        low = min(low, v < 0 ? -v - 1 : v);
      }
      if (low > published) {
        dev::publish(tail_j, base + low);  // pairs with the receiver's acquire of tail
        published = low;
      }
      done = finished;
    }
    if (__all_sync(dev::kFullMask, done)) break;
    budget.tick(env, dev::WaitSite{role, channel, lane, published}, published, -1);
  }
}

}  // namespace epx
