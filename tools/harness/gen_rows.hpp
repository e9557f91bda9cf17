// The per-element payload functions behind fill_*_row, shared by the host generators (gen.cpp, used by the
// checks) and the device generators (gen_device.cu, used to refresh inputs between timed iterations), so both
// produce the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EPX_GEN_HD __host__ __device__ inline
#else
#define EPX_GEN_HD inline
#endif

namespace epx::harness::rows {

EPX_GEN_HD uint64_t mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t x = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull;
  x ^= (c + 0x94d049bb133111ebull) * 0xd6e8feb86659fd93ull;
  x ^= (d + 0x2545f4914f6cdd1dull) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 33;
  return x;
}

// Uniform in [0, 1).
EPX_GEN_HD double unit(uint64_t h) { return double(h >> 11) * (1.0 / 9007199254740992.0); }

EPX_GEN_HD uint64_t bf16_row_base(uint64_t seed, int rank, int token) {
  return mix(seed, uint64_t(rank), uint64_t(token));
}
EPX_GEN_HD uint64_t fp8_row_base(uint64_t seed, int rank, int token) {
  return mix(seed, uint64_t(rank), uint64_t(token), 0xf8);
}
EPX_GEN_HD uint64_t scale_row_base(uint64_t seed, int rank, int token) {
  return mix(seed, uint64_t(rank), uint64_t(token), 0x5c);
}

// A finite value in [-8, 8) with 16 fractional bits, exact in float, rounded to bf16 (nearest even); the
// rounding is the reference model's float_to_bf16 for finite values.
EPX_GEN_HD uint16_t bf16_element(uint64_t base, int h) {
  const uint64_t v = mix(base, uint64_t(h));
  const float f = float(int64_t(v % 4096) - 2048) / 256.f + float((v >> 20) % 256) / 65536.f;
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Any e4m3 byte except NaN.
EPX_GEN_HD uint8_t fp8_element(uint64_t base, int h) {
  uint8_t b = uint8_t(mix(base, uint64_t(h)));
  if ((b & 0x7f) == 0x7f) b &= 0xfe;
  return b;
}

// Positive, in [0.001, 1.001).
EPX_GEN_HD float scale_element(uint64_t base, int i) { return 0.001f + float(unit(mix(base, uint64_t(i)))); }

}  // namespace epx::harness::rows
