// Low-latency combine (SPEC section 5).
//
// Send phase: one warp per row; a row goes back into its source rank's receive area at [global expert][source
// token] once the source has cleared its flag for the expert (it consumed the last call on this buffer set);
// the last row of an (expert, source) pair raises the flag. Writes into other ranks go through
// kernels/ll_transport.cuh (peer pointer or NVSHMEM); for NVSHMEM peers a row that is not already in the
// symmetric region (zero-copy) is first copied to its place in this set's combine-send area.
// Receive phase: warps wait for every expert's flag, a grid barrier, then block b reduces tokens b, b+G, ...:
// out[t] = bf16(sum over k ascending of w[t][k] * row(e_k, t)), float32 multiply then add, one rounding;
// a second grid barrier, then the flags are cleared.
#include <cuda_runtime.h>

#include "device/bf16.cuh"
#include "device/grid_barrier.cuh"
#include "device/ptx.cuh"
#include "device/wait.cuh"
#include "device/warp_copy.cuh"
#include "kernels/ll_params.hpp"
#include "kernels/ll_transport.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// Rows this rank sends back, spread one per warp over the whole grid. Row g of the concatenation of every local
// expert's packed rows belongs to expert i (s_first[i] <= g < s_first[i + 1]) and source rank s (from the
// layout range). The last warp to finish a (expert, source) pair raises that pair's flag at the source.
__device__ void send_phase(const LowLatencyCombineParams& p, int* s_first) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, me = p.env.rank;
  const int L = p.num_experts / R;
  const int row_int4 = p.hidden / 8;
  const int64_t rows_per_expert = int64_t(R) * M;
  // Completion counters per (local expert, source): the set's `sent` area, unused by combine otherwise and left
  // at zero by every call.
  int32_t* done = p.layout.sent(p.peers.local, p.set);
  int32_t* flags = p.layout.combine_flag(p.peers.local, p.set);  // addresses here = offsets at every peer
  int4* receive = reinterpret_cast<int4*>(p.layout.receive(p.peers.local, p.set));
  int4* stage = reinterpret_cast<int4*>(p.layout.combine_send(p.peers.local, p.set));
  if (warp == 0) {  // exclusive prefix of rows per local expert
    int carry = 0;
    for (int base = 0; base < L; base += 32) {
      const int i = base + lane;
      int n = 0;
      if (i < L)
        for (int s = 0; s < R; ++s) n += int(p.recv_layout_range[int64_t(i) * R + s] & 0xffffffff);
      int incl = n;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      if (i < L) s_first[i] = carry + incl - n;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_first[L] = carry;
  }
  __syncthreads();
  const int total = s_first[L];
  const int warps = gridDim.x * kWarps;
  const int parts = warps >= 4 * total ? 4 : (warps >= 2 * total ? 2 : 1);  // warps per row when rows are few
  for (int w = blockIdx.x * kWarps + warp; w < total * parts; w += warps) {
    const int g = w / parts, part = w % parts;
    int lo = 0, hi = L;  // largest i with s_first[i] <= g
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s_first[mid] <= g) lo = mid; else hi = mid;
    }
    const int i = lo, n = g - s_first[i];
    int s = 0, count = 0;
    for (; s < R; ++s) {
      const int64_t range = p.recv_layout_range[int64_t(i) * R + s];
      const int begin = int(range >> 32);
      count = int(range & 0xffffffff);
      if (n >= begin && n < begin + count) break;
    }
    const int e = me * L + i;
    // Back-pressure: s clears the flag only after it reduced the rows of the last call on this set.
    if (lane == 0) wait_peer_zero(p.peers, s, flags + e, p.env, WaitSite{kRoleLowLatencyCombineSend, -1, s, e});
    __syncwarp();
    const int t = p.recv_src_info[int64_t(i) * rows_per_expert + n];
    const int64_t row = int64_t(i) * rows_per_expert + n;
    const int first = row_int4 * part / parts, last = row_int4 * (part + 1) / parts;
    const int4* src = p.x + row * row_int4 + first;
    if (!has_peer_pointer(p.peers, s) && !p.x_in_region) {  // NVSHMEM puts read symmetric memory
      warp_copy<4>(stage + row * row_int4 + first, src, last - first, lane, LoadNc{}, StoreNa{});
      __threadfence();  // visible to whatever reads the put's source (this warp, or a NIC)
      __syncwarp();
      src = stage + row * row_int4 + first;
    }
    put_warp<4>(p.peers, s, receive + (int64_t(e) * M + t) * row_int4 + first, src, last - first, lane, LoadNc{});
    __syncwarp();  // every lane's part is written before lane 0's release below
    // acq_rel: releases this warp's part and, for the last one, acquires every other part of the pair, so the
    // flag's signal (a release) publishes all of them (release is cumulative).
    if (lane == 0 && atomic_add_acq_rel_gpu(&done[i * R + s], 1) + 1 == count * parts) {
      done[i * R + s] = 0;
      signal(p.peers, s, flags + e, 1);  // pairs with the receiver's wait_nonzero
    }
  }
  // Pairs with no rows still tell the source that nothing more comes from this expert.
  for (int pair = blockIdx.x * kWarps + warp; pair < L * R; pair += warps) {
    const int i = pair / R, s = pair % R;
    if ((p.recv_layout_range[int64_t(i) * R + s] & 0xffffffff) != 0 || lane != 0) continue;
    wait_peer_zero(p.peers, s, flags + me * L + i, p.env, WaitSite{kRoleLowLatencyCombineSend, -1, s, me * L + i});
    signal(p.peers, s, flags + me * L + i, 1);
  }
}

__device__ void receive_phase(const LowLatencyCombineParams& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int M = p.max_tokens, K = p.num_topk;
  int32_t* flags = p.layout.combine_flag(p.peers.local, p.set);
  for (int e = blockIdx.x * kWarps + warp; e < p.num_experts; e += gridDim.x * kWarps) {
    if (lane == 0)
      wait_nonzero(flags + e, p.env, WaitSite{kRoleLowLatencyCombineRecv, -1, e / (p.num_experts / p.num_ranks), e});
  }
  grid_barrier(&p.env.self->grid_barrier, p.env, WaitSite{kRoleLowLatencyCombineRecv, -1, -1, -1});

  const int row_int4 = p.hidden / 8;
  const uint8_t* recv = p.layout.receive(p.peers.local, p.set);
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    for (int h = threadIdx.x; h < row_int4; h += kThreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        const int64_t e = p.topk_idx[int64_t(t) * K + k];
        if (e < 0 || e >= p.num_experts) continue;
        const float w = p.topk_weights[int64_t(t) * K + k];
        const int4 v = ld_cg(reinterpret_cast<const int4*>(recv) + (e * M + t) * row_int4 + h);
        const uint32_t words[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // no fused multiply-add: the reference multiplies, then adds
          acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, __uint_as_float(words[q] << 16)));
          acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, __uint_as_float(words[q] & 0xffff0000u)));
        }
      }
      st_na(p.out + int64_t(t) * row_int4 + h, pack_bf16x8(acc));
    }
  }
  // Every block has read its rows: clear the flags (release), which lets the next call on this set write.
  grid_barrier(&p.env.self->grid_barrier, p.env, WaitSite{kRoleLowLatencyCombineRecv, -1, -1, -2});
  for (int e = blockIdx.x * kWarps + warp; e < p.num_experts; e += gridDim.x * kWarps)
    if (lane == 0) st_release_sys(flags + e, 0);
}

__global__ void __launch_bounds__(kThreads, 1) low_latency_combine_kernel(LowLatencyCombineParams p) {
  __shared__ int s_first[kLowLatencyMaxExperts + 1];
  if (p.phases & kLowLatencySend) send_phase(p, s_first);
  if (p.phases & kLowLatencyRecv) receive_phase(p);
}

}  // namespace

void launch_low_latency_combine(const LowLatencyCombineParams& p, int grid, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // the receive phase has a grid barrier
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, low_latency_combine_kernel, p);
}

}  // namespace epx
