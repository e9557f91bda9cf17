// bf16 vectors as raw bits: 8 values in one int4, element 2q in the low half of word q.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace epx::dev {

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] += __uint_as_float(w[q] << 16);
    acc[2 * q + 1] += __uint_as_float(w[q] & 0xffff0000u);
  }
}

// acc[e] += w * element e of v, the product rounded to float32 before the add (no fused multiply-add: the reference
// model multiplies, then adds).
__device__ __forceinline__ void add_weighted_bf16x8(float (&acc)[8], const int4& v, float w) {
  const uint32_t words[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, __uint_as_float(words[q] << 16)));
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, __uint_as_float(words[q] & 0xffff0000u)));
  }
}

// Round to nearest even, once.
__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    w[q] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

}  // namespace epx::dev
