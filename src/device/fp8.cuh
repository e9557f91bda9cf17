// Per-128-element FP8 (e4m3) quantization on send (semantics.md section 4), bit-identical to ref::quantize_group:
//   amax = max(max |x|, kAmaxFloor); scale = amax / 448 (rounded once); round_scale: scale rounded up to a
//   power of two; q = e4m3_satfinite_rne(x / scale); UE8M0 keeps the scale's exponent byte.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace epx::dev {

constexpr float kFp8Max = 448.f;
constexpr float kAmaxFloor = 1e-4f;

// Smallest power of two >= s (s > 0, finite): clear the mantissa and step the exponent if it was not zero.
__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t b = __float_as_uint(s);
  if (b & 0x7fffffu) b = (b & 0xff800000u) + 0x800000u;
  return __uint_as_float(b);
}

__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
  const float s = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
  return round_scale ? round_up_pow2(s) : s;
}

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint8_t ue8m0_of(float pow2_scale) { return uint8_t(__float_as_uint(pow2_scale) >> 23); }

}  // namespace epx::dev
