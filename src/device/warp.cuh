// Warp-wide helpers: the full-warp mask and the reductions and scans every kernel shares.
#pragma once

#include <cstdint>

namespace epx::dev {

constexpr uint32_t kFullMask = 0xffffffffu;

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Inclusive prefix sum over the lanes (lane i gets v of lanes 0..i).
__device__ __forceinline__ int warp_inclusive_scan(int v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kFullMask, v, o);
    if (int(threadIdx.x % 32) >= o) v += u;
  }
  return v;
}

}  // namespace epx::dev
