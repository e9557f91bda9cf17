// How the low-latency kernels are launched (both kernel files use this).
//
// Default: cooperative. Blocks wait for one another (the dispatch's receivers for counts that other blocks send,
// the combine's reducers for other blocks' rows), so every block must be resident; the cooperative launch
// checks that the grid fits and starts it as one.
// LowLatencyLaunch::early (EPX_LL_EARLY_LAUNCH=1, read when the Buffer is created): programmatic dependent launch
// instead. The kernel may be
// launched while the kernel before it in the stream is still running, and its blocks take each SM as the
// earlier kernel's block there exits, instead of after the whole grid has ended and the next launch has gone
// through (faster for calls in a row, no change for single calls and graphs; docs/bench-notes.md). It needs the
// cooperative attribute dropped: with it
// the launch waited for the whole device as before and nothing changed. The grid stays one block per SM, so
// its blocks are resident together as soon as the SMs are free; what the attribute no longer guarantees is
// that they start together: a kernel of another stream that holds SMs delays our last blocks until it ends
// (our first ones wait for them inside their bounded waits), and a kernel that could only end after ours
// (one that waits for our output on the device) would deadlock until those waits time out. Hence opt-in.
// Either way every thread first waits for the earlier grids (wait_prior_grids: complete, their memory
// visible) and then lets the next one launch (allow_next_grid): reads and writes are ordered exactly as
// without the attribute, and a later kernel gets nothing of this one's results before its own wait. A driver
// that refuses the early launch gets the cooperative one (once refused, for the rest of the process).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "layout/ll_params.hpp"

// The namespace of this build's launch functions (layout/ll_params.hpp).
#if EPX_NVSHMEM_DEVICE
#define EPX_LL_BUILD ll_nvshmem
#else
#define EPX_LL_BUILD ll_peer_pointers
#endif

namespace epx {

// Set once a driver refused the early launch: both kernels launch cooperatively from then on.
inline std::atomic<bool>& low_latency_early_launch_refused() {
  static std::atomic<bool> refused{false};
  return refused;
}

// Launches kernel(p) as above; the caller checks cudaGetLastError as for any launch.
template <typename Params>
void launch_low_latency_kernel(void (*kernel)(Params), const Params& p, const LowLatencyLaunch& launch, int threads,
                               size_t smem, cudaStream_t stream) {
  std::atomic<bool>& refused = low_latency_early_launch_refused();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(launch.grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  config.attrs = attr;
  config.numAttrs = 1;
  if (launch.early && !refused.load(std::memory_order_relaxed)) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    if (cudaLaunchKernelEx(&config, kernel, p) == cudaSuccess) return;
    (void)cudaGetLastError();  // a launch that never started: not a sticky error
    refused.store(true, std::memory_order_relaxed);
  }
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace epx
