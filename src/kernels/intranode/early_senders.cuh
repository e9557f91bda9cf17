// Early senders (a sized ring dispatch at exactly 2 ranks, DispatchParams::early_senders): the sender block starts
// writing ring records before the notify block (notify_body.cuh) releases its start word, as soon as it has seen for
// itself that the peer holds no record of this rank that it has not read. Its coordinator publishes tails only once
// the start word says go. (A cached dispatch or a combine waits only for the epoch barrier, a few microseconds: there
// early senders measured no faster, docs/bench-notes.md, and those kernels do not use them.)
//
// Why the records may be written then. At 2 ranks only this rank writes the ring data region of the peer's buffer
// (one ring per channel: neither op rings a rank's own rows), and the peer reads there only records this rank
// published. When every index pair of this rank at the peer has head == tail (dispatch and combine rings, every
// channel up to kMaxChannels, whatever config an earlier operation used), the peer has read everything this rank
// published and released each head after those reads, so every slot may be rewritten. No tail moves before go, so
// the peer reads none of the new records before its own start; on skip (a collective error, or a resize) nothing is
// published and the rings stay as they were. Before go no head moves either, so a sender that needs a slot past the
// ring's capacity waits for the verdict first (await_go); on a skip every sender stops after its window (skipped).
//
// Roles: the coordinator warp (take_start) opens the slots and takes the start word; the sender warps wait for the
// slots (await_slots) and, where they need the verdict, for it (await_go). Both words live in shared memory.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "layout/fail_state.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/peer_map.hpp"

namespace epx {

// The sender block's shared words (0 until set, then set once, by the coordinator's lane 0, with a CTA release).
struct EarlyStart {
  static constexpr int32_t kOpen = 1;  // slots: the sender warps may write records
  static constexpr int32_t kGo = 1;    // verdict: the operation runs (the coordinator publishes tails)
  static constexpr int32_t kSkip = 2;  // slots or verdict: the operation has a collective error, return
  int32_t slots;
  int32_t verdict;
  __device__ __forceinline__ void init() {
    if (threadIdx.x == 0) slots = verdict = 0;
  }
};

// One whole warp: true on every lane when every ring index pair of this rank at the peer is idle. The head loads are
// acquires: they pair with the peer's release of each head after its reads of the slots below it.
__device__ __forceinline__ bool peer_rings_idle(const PeerMap& peers) {
  const int lane = threadIdx.x % 32, me = peers.rank;
  const NvlControl* dst = nvl_control(peers, 1 - me);
  bool idle = true;
  for (int c = lane; c < kMaxChannels; c += 32) {
    idle &= dev::acquire(&dst->dispatch_head[c][me]) == dev::read_idle(&dst->dispatch_tail[c][me]);
    idle &= dev::acquire(&dst->combine_head[c][me]) == dev::read_idle(&dst->combine_tail[c][me]);
  }
  return __all_sync(dev::kFullMask, idle);
}

// Lane 0 sets one of the words; every lane's earlier acquires are ordered before it through __syncwarp.
__device__ __forceinline__ void set_word(int32_t* word, int32_t v) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) dev::st_release_cta(word, v);  // pairs with await_word's acquire
}

// The coordinator warp, first thing: opens the slots once the peer's rings are idle, then takes the block's start
// word (lane 0 resets it, as wait_for_start does) and sets the verdict. The abort word comes first: a peer that
// failed may have lost its memory, which the ring check reads. Bounded as wait_for_start is. Returns true on go, on
// every lane. Not inlined: the data roles' registers stay as they were.
static __device__ __noinline__ bool take_start(EarlyStart& s, const PeerMap& peers, const FailState& fail) {
  const int lane = threadIdx.x % 32;
  NvlControl* self = nvl_self(peers);
  uint32_t* word = &self->block_start[blockIdx.x];
  const dev::WaitSite site{kRoleDataStart, int(blockIdx.x / 2), -1, blockIdx.x};
  if (lane == 0) dev::check_abort(fail, site);
  __syncwarp();
  bool open = peer_rings_idle(peers);
  if (open) set_word(&s.slots, EarlyStart::kOpen);
  dev::SpinBudget budget;
  uint32_t seen = 0;
  while (true) {
    if (lane == 0) seen = dev::acquire(word);  // pairs with the notify block's release of the start word
    seen = __shfl_sync(dev::kFullMask, seen, 0);
    if (seen != 0) break;
    if (lane == 0) budget.tick(fail, site, seen, 1, 2);
    if (!open && (open = peer_rings_idle(peers))) set_word(&s.slots, EarlyStart::kOpen);
  }
  if (lane == 0) dev::write_word(word, 0u);
  const bool go = seen == kStartGo;
  if (!open) set_word(&s.slots, go ? EarlyStart::kOpen : EarlyStart::kSkip);
  set_word(&s.verdict, go ? EarlyStart::kGo : EarlyStart::kSkip);
  return go;
}

// A sender warp: waits until *word (a field of EarlyStart) is set, and returns it on every lane. The coordinator sets
// it within its own bounded wait, so this one has the same budget (twice the waits', as wait_for_start) and reports
// only when the coordinator did not get to run.
__device__ __forceinline__ int32_t await_word(const int32_t* word, const FailState& fail, int role, int channel) {
  int32_t v = 0;
  if (threadIdx.x % 32 == 0) {
    const dev::WaitSite site{role, channel, -1, 0};
    dev::SpinBudget budget;
    while ((v = dev::ld_acquire_cta(word)) == 0)  // pairs with set_word's release
      budget.tick(fail, site, 0, 1, 2);
  }
  return __shfl_sync(dev::kFullMask, v, 0);
}

// True once the sender warps may write records; false when the operation skips.
__device__ __forceinline__ bool await_slots(const EarlyStart& s, const FailState& fail, int role, int channel) {
  return await_word(&s.slots, fail, role, channel) == EarlyStart::kOpen;
}

// True once the operation goes; false when it skips.
__device__ __forceinline__ bool await_go(const EarlyStart& s, const FailState& fail, int role, int channel) {
  return await_word(&s.verdict, fail, role, channel) == EarlyStart::kGo;
}

// Without waiting: true on every lane once the verdict says skip. A sender warp asks after every window, so that on a
// skip it stops within one window instead of filling the ring's capacity with records nobody reads.
__device__ __forceinline__ bool skipped(const EarlyStart& s) {
  int32_t v = 0;
  if (threadIdx.x % 32 == 0) v = dev::ld_acquire_cta(&s.verdict);  // pairs with set_word's release
  return __shfl_sync(dev::kFullMask, v, 0) == EarlyStart::kSkip;
}

}  // namespace epx
