// LogFMT-10 on the device (docs/logfmt.md): a warp encodes a work item of BF16 row data into one block of the
// encoded row, and a thread decodes 8 elements. The per-element rules are layout/logfmt.hpp's, which the reference
// model applies too; this file only moves the bits between registers, lanes and memory.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/warp.cuh"
#include "layout/logfmt.hpp"

namespace epx::dev {

// BF16 elements per int4, and int4 of BF16 per group.
constexpr int kLogfmtGroupInt4 = kLogfmtGroup / 8;
static_assert(kLogfmtGroupInt4 == 16, "a group is one half-warp's int4 (its top is a half-warp reduction)");

// Warp-collective (all 32 lanes): encodes n int4 of a BF16 row (n a multiple of 16: whole groups, at most
// 32 * kUnroll int4 and 8 groups) from src into one LogFMT block at dst: its 16-byte header and the groups'
// planes, 16 + 160 * n / 16 bytes, every store 16 bytes wide. dst may be a peer's memory, and may overlap src (the
// NVSHMEM staging of a zero-copy input): every lane's loads are done before any lane stores.
// Lane l holds int4 l + 32u of the item (round u), so in round u lanes 0-15 hold group 2u and lanes 16-31 group
// 2u + 1, 8 elements each: the group's top is a max over its half-warp.
template <int kUnroll, typename Load, typename Store>
__device__ __forceinline__ void logfmt_encode_block(int4* dst, const int4* src, int n, int lane, Load load,
                                                    Store store) {
  static_assert(kUnroll * 32 == kLogfmtGroupsPerBlock * kLogfmtGroupInt4, "an item is a block: its header is one int4");
  int4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (lane + u * 32 < n) v[u] = load(src + lane + u * 32);
  __syncwarp();
  uint8_t* block = reinterpret_cast<uint8_t*>(dst);
  uint32_t header[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool valid = lane + u * 32 < n;  // the same for a whole half-warp (n % 16 == 0)
    const uint32_t w[4] = {uint32_t(v[u].x), uint32_t(v[u].y), uint32_t(v[u].z), uint32_t(v[u].w)};
    uint32_t bits[8];
    int level[8];
    int max_level = kLogfmtNoLevel;
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // element 2q in the low half of word q
      bits[e] = (w[e / 2] >> (16 * (e % 2))) & 0xffffu;
      level[e] = valid ? logfmt_level(bits[e]) : kLogfmtNoLevel;
      max_level = max(max_level, level[e]);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) max_level = max(max_level, __shfl_xor_sync(kFullMask, max_level, o));
    const int top = logfmt_top(max_level);
    uint32_t low[2] = {0u, 0u}, high = 0u;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t word = logfmt_encode(bits[e], level[e], top);
      low[e / 4] |= (word & 0xffu) << (8 * (e % 4));
      high |= (word >> 8) << (2 * e);
    }
    // Low plane: an even lane stores its 8 bytes and its neighbour's. High plane: 16 bits per lane, lanes 8i..8i+7
    // gathered by lane 8i into 16 bytes. Header: the tops of groups 2u and 2u + 1 (0 for groups past n).
    const uint32_t next_low0 = __shfl_down_sync(kFullMask, low[0], 1);
    const uint32_t next_low1 = __shfl_down_sync(kFullMask, low[1], 1);
    const uint32_t high2 = high | __shfl_down_sync(kFullMask, high, 1) << 16;
    const uint32_t high_a = __shfl_down_sync(kFullMask, high2, 2);
    const uint32_t high_b = __shfl_down_sync(kFullMask, high2, 4);
    const uint32_t high_c = __shfl_down_sync(kFullMask, high2, 6);
    const int top_odd = __shfl_sync(kFullMask, top, 16);
    header[u] = (uint32_t(top) & 0xffffu) | uint32_t(top_odd) << 16;
    if (valid) {
      const int group = 2 * u + lane / 16, j = lane % 16;  // j: 8-element piece of the group
      uint8_t* planes = block + kLogfmtHeaderBytes + group * kLogfmtGroupBytes;
      if (j % 2 == 0)
        store(reinterpret_cast<int4*>(planes + 8 * j),
              make_int4(int(low[0]), int(low[1]), int(next_low0), int(next_low1)));
      if (j % 8 == 0)
        store(reinterpret_cast<int4*>(planes + kLogfmtLowBytes + 2 * j),
              make_int4(int(high2), int(high_a), int(high_b), int(high_c)));
    }
  }
  if (lane == 0) store(dst, make_int4(int(header[0]), int(header[1]), int(header[2]), int(header[3])));
}

// Elements 8j..8j+7 of a group (j in [0, 16)) as float32, from the group's encoded row at `row` (bytes; peers wrote
// it during this kernel, after the caller's acquire): its top, 8 low bytes and 16 high bits.
struct LogfmtPiece {
  uint2 low;
  uint16_t high;
  int16_t top;
};

__device__ __forceinline__ LogfmtPiece logfmt_load_piece(const uint8_t* row, int group, int j) {
  LogfmtPiece piece;
  piece.low = ld_cg(reinterpret_cast<const uint2*>(row + logfmt_low_offset(group) + 8 * j));
  piece.high = ld_cg(reinterpret_cast<const uint16_t*>(row + logfmt_high_offset(group) + 2 * j));
  piece.top = int16_t(ld_cg(reinterpret_cast<const uint16_t*>(row + logfmt_top_offset(group))));
  return piece;
}

__device__ __forceinline__ float logfmt_element(const LogfmtPiece& piece, int e) {
  const uint32_t low = e < 4 ? piece.low.x : piece.low.y;
  const uint32_t word = ((low >> (8 * (e % 4))) & 0xffu) | ((uint32_t(piece.high) >> (2 * e)) & 3u) << 8;
  return __uint_as_float(logfmt_decode(word, piece.top));
}

}  // namespace epx::dev
