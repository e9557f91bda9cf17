// How the low-latency kernels are launched (both kernel files use this).
//
// Cooperative: blocks wait for one another (the dispatch's receivers for counts that other blocks send, the
// combine's reducers for other blocks' rows), so every block must be resident.
// Early launch (programmatic dependent launch, sm_90): the launch may overlap the end of the kernel before it
// in the stream, so that the blocks of this one take each SM as soon as the earlier kernel's block there
// exits, instead of after the whole grid has ended and the next launch has gone through. Every thread of these
// kernels first waits for the earlier grids (wait_prior_grids: they have completed and their memory is
// visible), so what it reads and writes is ordered exactly as without the attribute; each kernel lets the next
// one launch as soon as it starts (allow_next_grid), which lets a later kernel's blocks queue for the SMs but
// gives them nothing of this kernel's results before their own wait. EPX_LL_EARLY_LAUNCH=0 turns it off (read
// once per process); a driver that refuses the attribute with a cooperative launch turns it off on first use.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace epx {

inline bool low_latency_early_launch_enabled() {
  static const bool from_env = [] {
    const char* v = std::getenv("EPX_LL_EARLY_LAUNCH");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return from_env;
}

// Launches kernel(p) with the attributes above; the caller checks cudaGetLastError as for any launch.
template <typename Params>
void launch_low_latency_kernel(void (*kernel)(Params), const Params& p, int grid, int threads, size_t smem,
                               cudaStream_t stream) {
  static std::atomic<bool> refused{false};  // the driver refused the early launch once: never ask again
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  const bool early = low_latency_early_launch_enabled() && !refused.load(std::memory_order_relaxed);
  config.numAttrs = early ? 2 : 1;
  if (cudaLaunchKernelEx(&config, kernel, p) == cudaSuccess || !early) return;
  // Refused (not a sticky error: a launch that never started). Once more as a plain cooperative launch; its
  // error, if any, is the caller's to see.
  (void)cudaGetLastError();
  refused.store(true, std::memory_order_relaxed);
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace epx
