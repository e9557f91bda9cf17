// LogFMT-10: the compressed row format of the low-latency combine with use_logfmt (docs/logfmt.md is the
// specification; semantics.md section 9). Every rule of the encoding lives here, as integer arithmetic on BF16 bits,
// and is shared by the kernels (kernels/low_latency/combine.cu, through device/logfmt.cuh) and the reference model
// (src/reference/logfmt.cpp), so that both produce and read the same bits.
//
// Per group of 128 elements: a 16-bit top level tau (the group's largest level) and, per element, a 10-bit word:
// a sign bit and a 9-bit magnitude code c. Level n stands for 2^(n / 64); code c in [1, 510] is level tau - 510 + c,
// code 0 is zero (sign clear) or NaN (sign set), code 511 is +-infinity. A row is a sequence of blocks of up to 8
// groups: [16-byte header: tau of each group, int16][per group: 128 bytes of low code bits, 32 bytes of high bits].
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

constexpr int kLogfmtGroup = 128;                   // elements per group (one tau), as an FP8 scale group
constexpr int kLogfmtLevelsPerOctave = 64;          // level n is 2^(n / 64)
constexpr int kLogfmtTopCode = 510;                 // code of level tau; codes 1..510 are levels tau-509..tau
constexpr int kLogfmtInfCode = 511;                 // +-infinity (sign bit)
constexpr uint32_t kLogfmtNanWord = 0x200;          // sign set, code 0
constexpr int kLogfmtMinLevel = -126 * 64;          // 2^-126: no level below float32's normal range
constexpr int kLogfmtMaxLevel = 128 * 64 - 1;       // just below 2^128: every level is a finite float32
constexpr int kLogfmtGroupsPerBlock = 8;            // groups per block (one 16-byte header)
constexpr int kLogfmtLowBytes = kLogfmtGroup;       // bits 0-7 of element i's word: byte i
constexpr int kLogfmtHighBytes = kLogfmtGroup / 4;  // bits 8-9 of element i's word: bits 2i, 2i+1
constexpr int kLogfmtGroupBytes = kLogfmtLowBytes + kLogfmtHighBytes;  // 160
constexpr int kLogfmtHeaderBytes = 16;
constexpr int kLogfmtBlockBytes = kLogfmtHeaderBytes + kLogfmtGroupsPerBlock * kLogfmtGroupBytes;  // 1296
// A group's top level when it has no finite nonzero element (no code then refers to it).
constexpr int kLogfmtEmptyTop = 0;
// Below every level: marks the elements that do not take part in a group's top (zero, subnormal, inf, NaN).
constexpr int kLogfmtNoLevel = -32768;

// Bytes of one encoded row of `hidden` elements (hidden % 128 == 0): a 16-byte header per 8 groups and 160 bytes
// per group; a multiple of 16.
EPX_HD constexpr int64_t logfmt_row_bytes(int hidden) {
  const int groups = hidden / kLogfmtGroup;
  return int64_t(ceil_div(groups, kLogfmtGroupsPerBlock)) * kLogfmtHeaderBytes + int64_t(groups) * kLogfmtGroupBytes;
}
// Where group g's header slot and code planes are in a row (bytes from the row's start).
EPX_HD constexpr int64_t logfmt_block_offset(int group) {
  return int64_t(group / kLogfmtGroupsPerBlock) * kLogfmtBlockBytes;
}
EPX_HD constexpr int64_t logfmt_top_offset(int group) {
  return logfmt_block_offset(group) + 2 * (group % kLogfmtGroupsPerBlock);
}
EPX_HD constexpr int64_t logfmt_low_offset(int group) {
  return logfmt_block_offset(group) + kLogfmtHeaderBytes + int64_t(group % kLogfmtGroupsPerBlock) * kLogfmtGroupBytes;
}
EPX_HD constexpr int64_t logfmt_high_offset(int group) { return logfmt_low_offset(group) + kLogfmtLowBytes; }

// Bits of the float32 nearest to 2^(f / 64), f in [0, 64) (exponent field 127). The decoded value of level n is
// this for f = n mod 64, with the exponent field raised by floor(n / 64).
EPX_HD uint32_t logfmt_level_bits(int f) {
  static constexpr uint32_t kBits[kLogfmtLevelsPerOctave] = {
      0x3f800000u, 0x3f8164d2u, 0x3f82cd87u, 0x3f843a29u, 0x3f85aac3u, 0x3f871f62u, 0x3f88980fu, 0x3f8a14d5u,
      0x3f8b95c2u, 0x3f8d1adfu, 0x3f8ea43au, 0x3f9031dcu, 0x3f91c3d3u, 0x3f935a2bu, 0x3f94f4f0u, 0x3f96942du,
      0x3f9837f0u, 0x3f99e046u, 0x3f9b8d3au, 0x3f9d3edau, 0x3f9ef532u, 0x3fa0b051u, 0x3fa27043u, 0x3fa43516u,
      0x3fa5fed7u, 0x3fa7cd94u, 0x3fa9a15bu, 0x3fab7a3au, 0x3fad583fu, 0x3faf3b79u, 0x3fb123f6u, 0x3fb311c4u,
      0x3fb504f3u, 0x3fb6fd92u, 0x3fb8fbafu, 0x3fbaff5bu, 0x3fbd08a4u, 0x3fbf179au, 0x3fc12c4du, 0x3fc346cdu,
      0x3fc5672au, 0x3fc78d75u, 0x3fc9b9beu, 0x3fcbec15u, 0x3fce248cu, 0x3fd06334u, 0x3fd2a81eu, 0x3fd4f35bu,
      0x3fd744fdu, 0x3fd99d16u, 0x3fdbfbb8u, 0x3fde60f5u, 0x3fe0ccdfu, 0x3fe33f89u, 0x3fe5b907u, 0x3fe8396au,
      0x3feac0c7u, 0x3fed4f30u, 0x3fefe4bau, 0x3ff28177u, 0x3ff5257du, 0x3ff7d0dfu, 0x3ffa83b3u, 0x3ffd3e0cu};
  return kBits[f];
}

// The level of 1 + m / 128 (m: a BF16 mantissa field, 7 bits) within its octave: the i in [0, 64] whose
// 2^(i / 64) (the float32 of logfmt_level_bits, 2 for i = 64) is nearest to it, the lower one on a tie.
EPX_HD int logfmt_mantissa_level(int m) {
  static constexpr uint8_t kLevel[128] = {
      0,  1,  1,  2,  3,  4,  4,  5,  6,  6,  7,  8,  8,  9,  10, 10, 11, 12, 12, 13, 13, 14, 15, 15, 16, 16,
      17, 18, 18, 19, 19, 20, 21, 21, 22, 22, 23, 23, 24, 25, 25, 26, 26, 27, 27, 28, 28, 29, 29, 30, 30, 31,
      31, 32, 32, 33, 34, 34, 35, 35, 35, 36, 36, 37, 37, 38, 38, 39, 39, 40, 40, 41, 41, 42, 42, 43, 43, 43,
      44, 44, 45, 45, 46, 46, 47, 47, 47, 48, 48, 49, 49, 50, 50, 50, 51, 51, 52, 52, 52, 53, 53, 54, 54, 55,
      55, 55, 56, 56, 56, 57, 57, 58, 58, 58, 59, 59, 60, 60, 60, 61, 61, 61, 62, 62, 63, 63, 63, 64};
  return kLevel[m];
}

// The level of a BF16 value (its bits): 64 * (exponent - 127) + logfmt_mantissa_level(mantissa), at most
// kLogfmtMaxLevel, for normal finite values; kLogfmtNoLevel for zero, subnormals, infinities and NaN.
EPX_HD int logfmt_level(uint32_t bf16) {
  const int exponent = int(bf16 >> 7) & 0xff;
  if (exponent == 0 || exponent == 0xff) return kLogfmtNoLevel;
  const int level = (exponent - 127) * kLogfmtLevelsPerOctave + logfmt_mantissa_level(int(bf16 & 0x7f));
  return level < kLogfmtMaxLevel ? level : kLogfmtMaxLevel;
}

// A group's top from the largest logfmt_level of its elements.
EPX_HD int logfmt_top(int max_level) { return max_level == kLogfmtNoLevel ? kLogfmtEmptyTop : max_level; }

// The 10-bit word of a BF16 value (bits) of level `level` (logfmt_level) in a group whose top is `top` (logfmt_top:
// >= every level of the group).
//  - normal finite: d = top - level; d <= 509: code 510 - d (the level itself); else the nearer of zero and the
//    lowest level, top - 509, by level: code 1 if d <= 509 + 64 (|x| at least about half the lowest level) and that
//    level is >= kLogfmtMinLevel, else zero. The sign bit is x's, except that zero is always word 0.
//  - zero and subnormals: word 0. Infinity: sign | 511. NaN: kLogfmtNanWord.
EPX_HD uint32_t logfmt_encode(uint32_t bf16, int level, int top) {
  const uint32_t sign = (bf16 >> 15) & 1u;
  if (level == kLogfmtNoLevel) {
    if ((bf16 & 0x7f80u) != 0x7f80u) return 0;  // zero or subnormal
    return (bf16 & 0x7fu) ? kLogfmtNanWord : (sign << 9 | uint32_t(kLogfmtInfCode));
  }
  const int d = top - level;
  if (d <= kLogfmtTopCode - 1) return sign << 9 | uint32_t(kLogfmtTopCode - d);
  const bool lowest = d <= kLogfmtTopCode - 1 + kLogfmtLevelsPerOctave && top - (kLogfmtTopCode - 1) >= kLogfmtMinLevel;
  return lowest ? (sign << 9 | 1u) : 0u;
}

// The float32 bits a 10-bit word decodes to in a group whose top is `top`: code c in [1, 510] is level
// n = top - 510 + c, 2^(n / 64) = logfmt_level_bits(n mod 64) with floor(n / 64) added to the exponent field,
// with the word's sign; word 0 is +0, kLogfmtNanWord the quiet NaN 0x7fc00000, code 511 +-infinity.
EPX_HD uint32_t logfmt_decode(uint32_t word, int top) {
  const uint32_t sign = (word & 0x200u) << 22;
  const int code = int(word & 0x1ffu);
  if (code == 0) return sign ? 0x7fc00000u : 0u;
  if (code == kLogfmtInfCode) return sign | 0x7f800000u;
  const int n = top - kLogfmtTopCode + code;
  return sign | (logfmt_level_bits(n & (kLogfmtLevelsPerOctave - 1)) + (uint32_t(n >> 6) << 23));
}

}  // namespace epx
