// The transport: the only way a kernel writes another rank's memory, publishes an index or signal to it, or reads
// one. Every mode uses these calls; which way a peer is reached is a fact of the peer map (layout/peer_map.hpp),
// decided when the Buffer was created, not a branch of the kernels.
//
// Two ways to reach a rank's copy of a region:
//  - peer pointer (RegionMap::peer[r] != nullptr): the copy mapped here through CUDA IPC or by nvshmem_ptr; the
//    kernel's own stores and loads move the data over NVLink.
//  - NVSHMEM (peer[r] == nullptr; kernels compiled with EPX_NVSHMEM_DEVICE only): puts and atomics on this rank's
//    symmetric address of the same offset; the NVSHMEM library moves the data (P2P stores inside a node, RDMA through
//    its proxy or IBGDA between nodes). Sources of puts must then be symmetric memory (callers stage them there).
// EPX_NVSHMEM_DEVICE is set for the kernels that are device-linked with NVSHMEM (CMakeLists.txt); elsewhere, and
// in builds without NVSHMEM, every rank has a peer pointer (has_peer_pointer is constant true) and the NVSHMEM
// branches compile away.
//
// Ordering contracts. Data written with ordinary stores becomes visible to a reader once the reader's acquire sees
// a release that came after the stores in the writer's order. "Observed" below is what the releasing thread wrote
// itself, what its warp wrote before a __syncwarp, and what its block wrote before a barrier (release is
// cumulative over all of that at system scope).
//   write_rows      data into a peer address: ordinary stores, published by a later publish / publish_add /
//                   signal_add / add_after_fence of a thread that observed them.
//   write_word      one data word, as write_rows.
//   read_idle       relaxed load of an index nobody writes at the moment (a ring's position when an operation
//                   starts: the barrier in front of every operation left it idle).
//   publish         st.release.sys of a ring index, flag or message word at a peer (or here): every write the
//                   thread observed is visible to a reader whose acquire load sees the value. One per batch of
//                   data, not one per row.
//   publish_add     red.release.sys.add: publish for a counter several writers add to.
//   acquire         ld.acquire.sys of an index: pairs with the publish, publish_add or signal_add that wrote it;
//                   data the writer published is visible after it. Bounded waits on an index go through
//                   device/wait.cuh, which polls with this load.
//   post            relaxed store of a word that carries no data (only its value matters to the reader).
// Per-peer calls over a RegionMap (the peer may be reached either way; `mine` is an address in this rank's copy
// of the region, meaning the same offset in the peer's copy):
//   put_warp        data. Peer pointer: write_rows' contract. NVSHMEM: complete at the peer on return.
//   put_int         one data word, as put_warp.
//   post / post64   as post above; through NVSHMEM an atomic set (post64 also completes it).
//   signal_add      a release add: the value lands after everything the thread observed to be complete, so a
//                   receiver whose acquire sees it also sees the data announced before it.
//   add_after_fence a relaxed add that fence_release_sys, earlier in the same thread, makes a release (one fence
//                   may precede several adds).
//   add_after_prior_grids  a relaxed add that announces only what the earlier grids of this kernel's stream did:
//                   called after wait_prior_grids, which returns once they completed and their memory operations were
//                   performed, so their loads have their values and their stores are in place before the add leaves.
// The network hop of the internode mode (NetworkMap: a peer is a PE; `mine` and sources are addresses in this
// rank's symmetric network region, which name the same offsets at the peer):
//   net_put_warp    data (a nonblocking put): complete at the peer only after a later net_quiet of the same threads.
//                   The source must stay untouched until the reader's credit says the data arrived.
//   net_put_signal_warp  data, then a signal word set at the peer (NVSHMEM put with signal): a reader whose acquire
//                   sees the signal sees the data.
//   net_quiet       every network operation this thread issued is complete at its peer.
//   net_signal      sets a word at the peer after a fence: announces data that the threads which put it made complete
//                   (net_quiet) before this thread observed their progress (a release / acquire in this block).
//   net_add         an atomic add at the peer that orders nothing (ring credits: the slots it frees were read
//                   before the add was issued).
// Nothing here waits: a caller that must wait for a peer polls its own memory (or a peer's index through a peer
// pointer) with the bounded waits of device/wait.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device/ptx.cuh"
#include "device/warp_copy.cuh"
#include "layout/peer_map.hpp"

#if EPX_NVSHMEM_DEVICE
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace epx::dev {

// ---- through a peer pointer -----------------------------------------------------------------------------------

// Warp-collective: n int4 from src to dst (a peer address, or local), kUnroll loads per lane in flight.
template <int kUnroll, typename Load>
__device__ __forceinline__ void write_rows(int4* dst, const int4* src, int n, int lane, Load load) {
  warp_copy<kUnroll>(dst, src, n, lane, load, StoreNa{});
}

template <typename T>
__device__ __forceinline__ void write_word(T* p, T v) {
  *p = v;
}

template <typename T>
__device__ __forceinline__ T read_idle(const T* p) {
  return ld_relaxed_sys(p);
}

template <typename T>
__device__ __forceinline__ void publish(T* p, T v) {
  st_release_sys(p, v);
}

template <typename T>
__device__ __forceinline__ T acquire(const T* p) {
  return ld_acquire_sys(p);
}

template <typename T>
__device__ __forceinline__ void publish_add(T* p, T v) {
  red_add_release_sys(p, v);
}

template <typename T>
__device__ __forceinline__ void post(T* p, T v) {
  st_relaxed_sys(p, v);
}

// ---- per peer: peer pointer or NVSHMEM ------------------------------------------------------------------------

__device__ __forceinline__ bool has_peer_pointer(const RegionMap& region, int peer) {
#if EPX_NVSHMEM_DEVICE
  return region.peer[peer] != nullptr;
#else
  return true;
#endif
}

// Whether any rank is reached through NVSHMEM (then put sources are staged in symmetric memory).
__device__ __forceinline__ bool uses_nvshmem(const RegionMap& region) {
#if EPX_NVSHMEM_DEVICE
  return region.num_nvshmem > 0;
#else
  return false;
#endif
}

// The address in peer's copy of `mine` (an address in this rank's copy); peer pointers only.
template <typename T>
__device__ __forceinline__ T* at_peer(const RegionMap& region, int peer, T* mine) {
  const auto offset = reinterpret_cast<const uint8_t*>(mine) - region.local;
  return reinterpret_cast<T*>(region.peer[peer] + offset);
}

// Warp-collective (all 32 lanes, same arguments): n int4 from src to `dst` in peer's copy.
template <int kUnroll, typename Load>
__device__ __forceinline__ void put_warp(const RegionMap& region, int peer, int4* dst, const int4* src, int n, int lane,
                                         Load load) {
  if (has_peer_pointer(region, peer)) {
    write_rows<kUnroll>(at_peer(region, peer, dst), src, n, lane, load);
    return;
  }
#if EPX_NVSHMEM_DEVICE
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
__device__ __forceinline__ void put_warp_once(const RegionMap& region, int peer, int4* dst, const int4* src, int n,
                                              int lane, Load load) {
  if (has_peer_pointer(region, peer)) {
    warp_copy_once<kUnroll>(at_peer(region, peer, dst), src, n, lane, load, StoreNa{});
    return;
  }
  put_warp<kUnroll>(region, peer, dst, src, n, lane, load);
}

// Warp-collective: int4 values held in registers (lane's j-th for dst[j * 32 + lane], those below n <= 32 *
// kUnroll) into peer's copy, with put_warp's contract. Through a peer pointer they are stored straight from the
// registers; for NVSHMEM they are first stored at `staging` (this rank's symmetric memory, n int4 the caller
// owns until the put is complete), the source of the put.
template <int kUnroll>
__device__ __forceinline__ void put_warp_values(const RegionMap& region, int peer, int4* dst, const int4 (&v)[kUnroll],
                                                int n, int lane, int4* staging) {
  int4* out = has_peer_pointer(region, peer) ? at_peer(region, peer, dst) : staging;
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (j * 32 + lane < n) st_na(out + j * 32 + lane, v[j]);
  if (has_peer_pointer(region, peer)) return;
  __threadfence();  // visible to whatever reads the put's source (this warp, or a NIC)
  __syncwarp();
  put_warp<kUnroll>(region, peer, dst, staging, n, lane, LoadNc{});
}

// One int32 into `mine`'s place in peer's copy, with put_warp's contract. One thread.
__device__ __forceinline__ void put_int(const RegionMap& region, int peer, int32_t* mine, int32_t value) {
  if (has_peer_pointer(region, peer)) {
    *at_peer(region, peer, mine) = value;
    return;
  }
#if EPX_NVSHMEM_DEVICE
  nvshmem_int_p(mine, value, peer);
  nvshmem_quiet();
#endif
}

// Sets the 32-bit slot `mine` in peer's copy to value without ordering anything before it: for a message that
// carries no data (the low-latency dispatch's counts), whose receiver only needs the value. A fence here (a
// release) would wait for the stores this SM has in flight to land. The slot's reuse is still ordered: the
// sender's earlier acquire (back-pressure) comes before it in program order.
__device__ __forceinline__ void post(const RegionMap& region, int peer, int32_t* mine, int32_t value) {
  if (has_peer_pointer(region, peer)) {
    post(at_peer(region, peer, mine), value);
    return;
  }
#if EPX_NVSHMEM_DEVICE
  nvshmem_int_atomic_set(mine, value, peer);  // one 32-bit write; nothing to order before it
#endif
}

// post for a 64-bit slot: one relaxed 64-bit write, single-copy atomic. The peer may never read a given op's value
// (the low-latency combine's targets: it waits only for the experts its tokens chose), so a later op's write into
// the slot must not be overtaken by this one: a peer-pointer store is complete when the kernel ends; an NVSHMEM one
// is made complete here (through a proxy or IBGDA it might not be).
__device__ __forceinline__ void post64(const RegionMap& region, int peer, uint64_t* mine, uint64_t value) {
  if (has_peer_pointer(region, peer)) {
    post(at_peer(region, peer, mine), value);
    return;
  }
#if EPX_NVSHMEM_DEVICE
  nvshmem_uint64_atomic_set(mine, value, peer);
  nvshmem_quiet();
#endif
}

// Adds value to the counter `mine` (32-bit: arrival counters, 64-bit: epochs) in peer's copy after the caller's
// fence_release_sys in this same thread (peer pointer: a relaxed add, which that fence makes a release; NVSHMEM: an
// atomic add, ordered after the puts this thread completed and saw completed by that fence, as in signal_add). Pairs
// with the peer's acquire loads.
template <typename T>
__device__ __forceinline__ void add_after_fence(const RegionMap& region, int peer, T* mine,
                                                typename std::remove_cv<T>::type value) {  // T from `mine` alone
  static_assert(std::is_same<T, int32_t>::value || std::is_same<T, uint64_t>::value, "the counters' two types");
  if (has_peer_pointer(region, peer)) {
    red_add_relaxed_sys(at_peer(region, peer, mine), value);
    return;
  }
#if EPX_NVSHMEM_DEVICE
  if constexpr (sizeof(T) == 8)
    nvshmem_uint64_atomic_add(mine, value, peer);
  else
    nvshmem_int_atomic_add(mine, value, peer);
#endif
}

// add_after_fence for an add that announces only the work of the earlier grids of this kernel's stream: after
// wait_prior_grids, which saw them complete, it needs no fence of its own.
__device__ __forceinline__ void add_after_prior_grids(const RegionMap& region, int peer, uint64_t* mine,
                                                      uint64_t value) {
  add_after_fence(region, peer, mine, value);
}

// Adds value to the counter `mine` (64-bit: epochs, 32-bit: arrival counters) in peer's copy, as a release. Pairs
// with the peer's acquire loads of that counter (device/wait.cuh on its own memory).
template <typename T>
__device__ __forceinline__ void signal_add(const RegionMap& region, int peer, T* mine,
                                           typename std::remove_cv<T>::type value) {  // T from `mine` alone
  static_assert(sizeof(T) == 8 || sizeof(T) == 4, "64- or 32-bit counters");
  if (has_peer_pointer(region, peer)) {
    publish_add(at_peer(region, peer, mine), value);
    return;
  }
#if EPX_NVSHMEM_DEVICE
  // fence.sc.sys is cumulative: the data this thread saw announced (put_warp completed it before the
  // announcement) is ordered before the atomic.
  __threadfence_system();
  if constexpr (sizeof(T) == 8)
    nvshmem_uint64_atomic_add(reinterpret_cast<uint64_t*>(mine), uint64_t(value), peer);
  else
    nvshmem_int_atomic_add(reinterpret_cast<int*>(mine), int(value), peer);
#endif
}

// ---- the network hop: NVSHMEM's generic device API only ------------------------------------------------------
// Kernels without EPX_NVSHMEM_DEVICE never reach these (the runtime refuses the internode mode there).

__device__ __forceinline__ void net_put_warp(void* dst, const void* src, size_t bytes, int pe) {
#if EPX_NVSHMEM_DEVICE
  nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
#else
  __trap();
#endif
}

__device__ __forceinline__ void net_signal(uint64_t* signal, uint64_t value, int pe) {
#if EPX_NVSHMEM_DEVICE
  __threadfence_system();  // cumulative: what this thread observed complete lands first
  nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
#else
  __trap();
#endif
}

__device__ __forceinline__ void net_put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* signal,
                                                    uint64_t value, int pe) {
#if EPX_NVSHMEM_DEVICE
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value, NVSHMEM_SIGNAL_SET, pe);
#else
  __trap();
#endif
}

__device__ __forceinline__ void net_add(uint64_t* counter, uint64_t value, int pe) {
#if EPX_NVSHMEM_DEVICE
  nvshmem_uint64_atomic_add(counter, value, pe);
#else
  __trap();
#endif
}

__device__ __forceinline__ void net_quiet() {
#if EPX_NVSHMEM_DEVICE
  nvshmem_quiet();
#endif
}

}  // namespace epx::dev
