// Warp-cooperative copies of 16-byte vectors with several loads in flight per lane before the stores.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"

namespace epx::dev {

struct LoadNc {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_nc(p); }
  __device__ __forceinline__ int32_t operator()(const int32_t* p) const { return ld_nc(p); }
};
struct LoadCg {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_cg(p); }
  __device__ __forceinline__ int32_t operator()(const int32_t* p) const { return ld_cg(p); }
};
struct StoreNa {
  __device__ __forceinline__ void operator()(int4* p, const int4& v) const { st_na(p, v); }
};

// Copies n int4 from src to dst with the 32 lanes of a warp; kUnroll loads per lane are issued before
// their stores.
template <int kUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane, Load load, Store store) {
  int i = lane;
  for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load(src + i + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store(dst + i + u * 32, v[u]);
  }
  for (; i < n; i += 32) store(dst + i, load(src + i));
}

// Copies n <= 32 * kUnroll int4 in one round: every lane issues all of its (predicated) loads, then its stores,
// so the copy costs one load latency where warp_copy's serial tail would cost one per leftover vector.
template <int kUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy_once(int4* dst, const int4* src, int n, int lane, Load load, Store store) {
  int4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (lane + u * 32 < n) v[u] = load(src + lane + u * 32);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (lane + u * 32 < n) store(dst + lane + u * 32, v[u]);
}

}  // namespace epx::dev
