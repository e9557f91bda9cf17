// How a low-latency kernel writes into another rank's low-latency region. Per peer, one of two ways:
//
//  - peer pointer (LowLatencyPeers::direct[peer] != nullptr): the region mapped here through CUDA IPC or
//    returned by nvshmem_ptr; the kernel's own stores move the data over NVLink.
//  - NVSHMEM (direct[peer] == nullptr; builds with EPX_HAVE_NVSHMEM only): puts and atomics on the symmetric
//    address; the NVSHMEM library moves the data (P2P stores inside a node, RDMA through its proxy or IBGDA
//    between nodes). Sources of puts must then be in the symmetric heap (callers stage them there): remote
//    transports read them with the NIC.
//
// Every address below is an address in *this* rank's region; the same offset is meant in the peer's region.
// Every rank only ever polls its own memory with acquire loads (device/wait.cuh): back-pressure too, since a
// receiver's blocks add their completions into every sender's memory (signal_add, kernels/ll_epochs.cuh).
// Nothing here reads a peer's memory.
//
// Ordering contract, the same on both paths:
//   put_warp  : peer pointer: on return this lane's stores are issued; they become visible at the peer with
//               the release that follows (the dispatch: __syncwarp, then a lane's signal_add; the combine: a
//               block barrier, then a fence and add_after_fence), so no lane needs a fence of its own.
//               NVSHMEM: complete at the peer on return.
//   signal_add, add_after_fence (after fence_acq_rel_sys): the value lands after everything this thread has
//               observed to be complete (cumulative), so a receiver whose acquire load sees it also sees the
//               data that was announced before it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "device/warp_copy.cuh"
#include "layout/ll_params.hpp"

#if EPX_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace epx::dev {

// Constant true without NVSHMEM (the host gives every rank a pointer), so that build compiles to stores only and
// the NVSHMEM branches below are never reached there.
__device__ __forceinline__ bool has_peer_pointer(const LowLatencyPeers& peers, int peer) {
#if EPX_HAVE_NVSHMEM
  return peers.direct[peer] != nullptr;
#else
  return true;
#endif
}

// Whether any rank is reached through NVSHMEM (then put sources are staged in symmetric memory).
__device__ __forceinline__ bool uses_nvshmem(const LowLatencyPeers& peers) {
#if EPX_HAVE_NVSHMEM
  return peers.num_nvshmem > 0;
#else
  return false;
#endif
}

// The address in peer's region of `mine` (an address in this rank's region).
template <typename T>
__device__ __forceinline__ T* at_peer(const LowLatencyPeers& peers, int peer, T* mine) {
  const auto offset = reinterpret_cast<const uint8_t*>(mine) - peers.local;
  return reinterpret_cast<T*>(peers.direct[peer] + offset);
}

// Warp-collective (all 32 lanes, same arguments): n int4 from src to `dst` in peer's region.
template <int kUnroll, typename Load>
__device__ __forceinline__ void put_warp(const LowLatencyPeers& peers, int peer, int4* dst, const int4* src, int n,
                                         int lane, Load load) {
  if (has_peer_pointer(peers, peer)) {
    warp_copy<kUnroll>(at_peer(peers, peer, dst), src, n, lane, load, StoreNa{});
    return;
  }
#if EPX_HAVE_NVSHMEM
  if (n > 0) nvshmemx_putmem_nbi_warp(dst, src, size_t(n) * sizeof(int4), peer);
  // Every lane: between P2P GPUs quiet is this lane's fence.sys after its share of the stores; through a
  // proxy or IBGDA it waits until the puts are complete at the peer. Either way the data is there before this
  // lane announces it.
  nvshmem_quiet();
#endif
}

// int4 per copy work item of the low-latency kernels (dispatch receive, combine send): one round of 4 loads per
// lane in flight, the registers a 1024-thread block allows; warp_copy_once / put_warp_once move one item.
constexpr int kCopyItemInt4 = 4 * 32;

// put_warp for n <= 32 * kUnroll int4: through a peer pointer every lane issues all of its loads before its
// stores (one load latency; warp_copy_once). Same contract as put_warp.
template <int kUnroll, typename Load>
__device__ __forceinline__ void put_warp_once(const LowLatencyPeers& peers, int peer, int4* dst, const int4* src,
                                              int n, int lane, Load load) {
  if (has_peer_pointer(peers, peer)) {
    warp_copy_once<kUnroll>(at_peer(peers, peer, dst), src, n, lane, load, StoreNa{});
    return;
  }
  put_warp<kUnroll>(peers, peer, dst, src, n, lane, load);
}

// One int32 into `mine`'s place in peer's region, with put_warp's ordering (peer pointer: issued here and
// published by the release chain that follows; NVSHMEM: complete at the peer on return). One thread.
__device__ __forceinline__ void put_int(const LowLatencyPeers& peers, int peer, int32_t* mine, int32_t value) {
  if (has_peer_pointer(peers, peer)) {
    *at_peer(peers, peer, mine) = value;
    return;
  }
#if EPX_HAVE_NVSHMEM
  nvshmem_int_p(mine, value, peer);
  nvshmem_quiet();
#endif
}

// Sets the 32-bit slot `mine` in peer's region to value without ordering anything before it: for a message
// that carries no data (the dispatch's counts), whose receiver only needs the value. A relaxed system-scope
// store; a fence here (a release) waits for the stores this SM has in flight to land, which put the
// counts behind the rows they were meant to precede (~15 us at the bench defaults, v0.8 probe). The slot's
// reuse is still ordered: the sender's earlier acquire (back-pressure) comes before it in program order.
__device__ __forceinline__ void post(const LowLatencyPeers& peers, int peer, int32_t* mine, int32_t value) {
  if (has_peer_pointer(peers, peer)) {
    st_relaxed_sys(at_peer(peers, peer, mine), value);
    return;
  }
#if EPX_HAVE_NVSHMEM
  nvshmem_int_atomic_set(mine, value, peer);  // one 32-bit write; nothing to order before it
#endif
}

// post for a 64-bit slot (the combine's tagged targets): one relaxed 64-bit write, single-copy atomic. The
// peer may never read a given op's value (it waits only for the experts its tokens chose), so a later op's
// write into the slot must not be overtaken by this one: a peer-pointer store is complete when the kernel ends;
// an NVSHMEM one is made complete here (through a proxy or IBGDA it might not be).
__device__ __forceinline__ void post64(const LowLatencyPeers& peers, int peer, uint64_t* mine, uint64_t value) {
  if (has_peer_pointer(peers, peer)) {
    st_relaxed_sys(at_peer(peers, peer, mine), value);
    return;
  }
#if EPX_HAVE_NVSHMEM
  nvshmem_uint64_atomic_set(mine, value, peer);
  nvshmem_quiet();
#endif
}

// Adds value to the 32-bit counter `mine` in peer's region after the caller's fence_acq_rel_sys in this same
// thread (peer pointer: a relaxed add, which that fence makes a release; NVSHMEM: an atomic add, ordered after
// the puts this thread completed and saw completed by that fence, as in signal_add). One fence can precede
// several adds. Pairs with the peer's acquire loads of the counter.
__device__ __forceinline__ void add_after_fence(const LowLatencyPeers& peers, int peer, int32_t* mine, int32_t value) {
  if (has_peer_pointer(peers, peer)) {
    red_add_relaxed_sys(at_peer(peers, peer, mine), value);
    return;
  }
#if EPX_HAVE_NVSHMEM
  nvshmem_int_atomic_add(mine, value, peer);
#endif
}

// Adds value to the counter `mine` (an address in this rank's region; 64-bit: the epochs, 32-bit: the dispatch's
// arrival counters) in peer's region, as a release. Pairs with the peer's acquire loads of that
// counter (wait_at_least / wait_at_least_i32 on its own memory).
template <typename T>
__device__ __forceinline__ void signal_add(const LowLatencyPeers& peers, int peer, T* mine,
                                           typename std::remove_cv<T>::type value) {  // T from `mine` alone
  static_assert(sizeof(T) == 8 || sizeof(T) == 4, "64- or 32-bit counters");
  if (has_peer_pointer(peers, peer)) {
    red_add_release_sys(at_peer(peers, peer, mine), value);
    return;
  }
#if EPX_HAVE_NVSHMEM
  // fence.sc.sys is cumulative: the data this thread saw announced (put_warp completed it before the
  // announcement) is ordered before the atomic.
  __threadfence_system();
  if constexpr (sizeof(T) == 8)
    nvshmem_uint64_atomic_add(reinterpret_cast<uint64_t*>(mine), uint64_t(value), peer);
  else
    nvshmem_int_atomic_add(reinterpret_cast<int*>(mine), int(value), peer);
#endif
}

}  // namespace epx::dev
