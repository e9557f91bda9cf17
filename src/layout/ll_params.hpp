// Parameters of the low-latency kernels (semantics.md sections 4 and 5).
#pragma once

#include <vector_types.h>

#include <cstddef>
#include <cstdint>

#include "layout/fail_state.hpp"
#include "layout/ll_layout.hpp"
#include "layout/peer_map.hpp"

namespace epx {

constexpr int kLowLatencySend = 1;
constexpr int kLowLatencyRecv = 2;

struct LowLatencyDispatchParams {
  FailState fail;
  RankMask mask;  // enable_shrink: the ranks this call leaves out (kernels/low_latency/shrink.cuh)
  PeerMap peers;  // the kernels reach the other ranks' low-latency regions through peers.ll
  LowLatencyLayout layout;
  int set;     // buffer set of this call
  int phases;  // kLowLatencySend | kLowLatencyRecv
  int num_ranks, num_tokens, max_tokens, hidden, num_topk, num_experts;
  int fp8, round_scale, ue8m0;
  const int4* x;               // bf16 [T, H]
  const int64_t* topk_idx;     // [T, K]
  int* cumulative_stats;       // [L] or null
  void* packed_recv_x;         // [L, R*M, H] bf16 or e4m3
  void* packed_recv_scales;    // fp8: float [L, H/128, R*M] or (ue8m0) int32 [L, H/512, R*M]
  int* packed_recv_count;      // [L]
  int* recv_src_info;          // [L, R*M]
  int64_t* recv_layout_range;  // [L, R]
  const float* topk_weights;   // [T, K] or null: carried in the records (LowLatencyRecord) for the rank-reduced combine
  int32_t* recv_topk_slots;    // [R, M, K] (packed row, weight bits) when topk_weights is given (epx.h)
};

struct LowLatencyCombineParams {
  FailState fail;
  RankMask mask;  // enable_shrink: the ranks this call leaves out (kernels/low_latency/shrink.cuh)
  PeerMap peers;  // the kernels reach the other ranks' low-latency regions through peers.ll
  LowLatencyLayout layout;
  int set;
  int phases;
  int num_ranks, num_tokens, max_tokens, hidden, num_topk, num_experts;
  const int4* x;                     // bf16 [L, R*M, H] expert outputs (a user tensor, or the zero-copy area)
  int x_in_region;                   // x is this set's combine-send area (zero-copy): NVSHMEM can put from it
  int logfmt;                        // rows travel as LogFMT (layout/logfmt.hpp), decoded before the sum
  const int64_t* topk_idx;           // [T, K]
  const float* topk_weights;         // [T, K]
  const int* recv_src_info;          // [L, R*M]
  const int64_t* recv_layout_range;  // [L, R]
  int4* out;                         // bf16 [T, H]
  int rank_reduced;                  // EPX_REDUCE_RANK: one partial row per (token, rank) (semantics.md section 5)
  const int2* recv_topk_slots;       // [R, M, K] (packed row, weight bits) of the dispatch (rank_reduced only)
};

// Grid of every low-latency launch on a GPU with that many SMs; a Buffer takes the smallest over its ranks, since
// the epochs count G blocks per op (kernels/low_latency/epochs.cuh) and so need the same G on every rank and launch.
inline int low_latency_grid(int num_device_sms) { return num_device_sms; }

// How a Buffer launches its low-latency kernels (runtime/low_latency_launch.cpp).
struct LowLatencyLaunch {
  int grid;    // blocks, the same on every rank
  bool early;  // programmatic dependent launch instead of a cooperative one (EPX_LL_EARLY_LAUNCH=1)
};

// A low-latency kernel as its launcher takes it: the __global__ function (one parameter struct), its block size and
// the dynamic shared memory of this call.
struct LowLatencyKernel {
  const void* func;
  int threads;
  size_t smem;
};

// The low-latency kernels come in two builds of the same sources (CMakeLists.txt). ll_peer_pointers: ordinary CUDA
// code, for buffers that reach every rank through a peer pointer (every build). ll_nvshmem: relocatable code
// device-linked with NVSHMEM, for buffers with ranks that only NVSHMEM puts reach (builds with NVSHMEM only). The
// same kernels run markedly slower as relocatable code (docs/bench-notes.md, "NVSHMEM builds and the low-latency
// kernels"), so a Buffer launches the NVSHMEM build only where a peer needs it. dispatch_kernel also raises the
// kernel's shared-memory limit where p needs more than the default.
namespace ll_peer_pointers {
LowLatencyKernel dispatch_kernel(const LowLatencyDispatchParams& p);
LowLatencyKernel combine_kernel();
}  // namespace ll_peer_pointers
namespace ll_nvshmem {
LowLatencyKernel dispatch_kernel(const LowLatencyDispatchParams& p);
LowLatencyKernel combine_kernel();
}  // namespace ll_nvshmem

}  // namespace epx
