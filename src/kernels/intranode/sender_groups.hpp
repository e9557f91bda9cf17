// Warp groups of a coordinated sender block (dispatch and combine at 2 ranks or fewer; kernels/intranode/):
// its first kSenderWarps warps form one group per peer, in rank order; the last warp is the sender coordinator.
// Neither op has a group for this rank itself: the dispatch's receiver block copies this rank's tokens (at 2 ranks
// with the sender block's last warps), and the combine's reducers read this rank's rows in place. Host and device
// (unit-tested on the CPU).
#pragma once

#include "layout/limits.hpp"

namespace epx {

constexpr int kSenderWarps = kDataWarps - 1;

struct SenderGroups {
  int own;   // warps of the group for this rank
  int each;  // warps of every other group

  // The combine's groups (at most 2 ranks): the peer's kCombinePeerWarps, the other sender warps idle (the best
  // of 8 / 10 / 12 on 2 x H200 at 16 and 24 SMs; more pushing warps are slower, docs/bench-notes.md).
  static constexpr int kCombinePeerWarps = 10;
  EPX_HD static SenderGroups combine(int num_ranks) { return {0, num_ranks == 2 ? kCombinePeerWarps : 0}; }
  // The dispatch's groups: no group for this rank itself (the receiver block copies its own tokens straight from
  // x to the outputs, kernels/intranode/dispatch.cu), every peer kSenderWarps / (R - 1) warps, the rest idle.
  EPX_HD static SenderGroups peers_only(int num_ranks) {
    return {0, num_ranks > 1 ? kSenderWarps / (num_ranks - 1) : 0};
  }
  // The dispatch's groups at 2 ranks when self_warps of the block's sender_warps copy this rank's own tokens
  // instead: the peer's group is the first sender_warps - self_warps warps. Other rank counts: peers_only.
  EPX_HD static SenderGroups dispatch(int num_ranks, int self_warps, int sender_warps = kSenderWarps) {
    return num_ranks == 2 ? SenderGroups{0, sender_warps - self_warps} : peers_only(num_ranks);
  }
  // Warps in groups (the rest are idle).
  EPX_HD int used(int num_ranks) const { return own + (num_ranks - 1) * each; }
  EPX_HD int warps(int peer, int self) const { return peer == self ? own : each; }
  EPX_HD int first_warp(int peer, int self) const { return peer * each + (peer > self ? own - each : 0); }

  // The group of sender warp `warp` (< kSenderWarps): its destination and the warp's index in it.
  struct Place {
    int dest;
    int index;
    int warps;
  };
  EPX_HD Place place(int warp, int num_ranks, int self) const {
    int dest = 0;
    while (dest + 1 < num_ranks && warp >= first_warp(dest + 1, self)) ++dest;
    return {dest, warp - first_warp(dest, self), warps(dest, self)};
  }
};

// The chunked dispatch senders' groups (3 or more ranks; PeerGroup::of_peers): one per peer, in rank order
// skipping this rank, kDataWarps / (R - 1) warps each; the leftover warps (when R - 1 does not divide kDataWarps)
// are idle (active false). Host and device (unit-tested on the CPU). R >= 2.
struct PeerSlot {
  int peer;   // the rank this warp's group sends to
  int index;  // the warp's index in the group
  int warps;  // warps per group
  bool active;
};
EPX_HD PeerSlot chunked_peer_slot(int warp, int num_ranks, int self) {
  const int warps = kDataWarps / (num_ranks - 1);
  const int k = warp / warps;  // the k-th rank other than self
  return {k < self ? k : k + 1, warp % warps, warps, k < num_ranks - 1};
}

static_assert(kSenderWarps >= kMaxNvlRanks, "every sender group needs a warp");
static_assert(SenderGroups::kCombinePeerWarps <= kSenderWarps, "the combine's peer group is made of sender warps");

}  // namespace epx
