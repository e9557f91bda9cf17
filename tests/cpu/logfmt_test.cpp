// LogFMT-10 (docs/logfmt.md, semantics.md section 9): the tables against their definitions, the bit layout against
// words worked out by hand, round-trip error bounds, special values, the reference model's LogFMT combine, and the
// accuracy contract on random normal data.
#include "layout/logfmt.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "epx/reference.hpp"
#include "test_helpers.hpp"

namespace ref = epx::ref;

namespace {

using epx_test::from_bits;

uint16_t bf16_of(float f) { return ref::float_to_bf16(f); }

// One group of 128 BF16 values, encoded by the reference model.
struct Encoded {
  std::vector<uint8_t> bytes;
  int top() const { return int16_t(uint16_t(bytes[0] | bytes[1] << 8)); }
  // The 10-bit word of element i of group 0.
  uint32_t word(int i) const {
    const uint8_t* low = bytes.data() + epx::logfmt_low_offset(0);
    const uint8_t* high = bytes.data() + epx::logfmt_high_offset(0);
    return low[i] | uint32_t((high[i / 4] >> (2 * (i % 4))) & 3) << 8;
  }
};

Encoded encode(const std::vector<uint16_t>& x) {
  Encoded e;
  e.bytes.resize(size_t(ref::logfmt_row_bytes(int(x.size()))));
  ref::logfmt_encode_row(x.data(), int(x.size()), e.bytes.data());
  return e;
}

std::vector<float> round_trip(const std::vector<uint16_t>& x) {
  const Encoded e = encode(x);
  std::vector<float> out(x.size());
  ref::logfmt_decode_row(e.bytes.data(), int(x.size()), out.data());
  return out;
}

// 1 - 2 * sum(x * y) / sum(x * x + y * y) (semantics.md section 9), in double.
double diff_measure(const std::vector<uint16_t>& x, const std::vector<uint16_t>& y) {
  double xy = 0, xx_yy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double a = ref::bf16_to_float(x[i]), b = ref::bf16_to_float(y[i]);
    xy += a * b;
    xx_yy += a * a + b * b;
  }
  return 1.0 - 2.0 * xy / xx_yy;
}

}  // namespace

// ---- tables ------------------------------------------------------------------------------------------------------

TEST(Logfmt, LevelTableIsTheNearestFloatToEachPowerOfTwo) {
  for (int f = 0; f < epx::kLogfmtLevelsPerOctave; ++f) {
    const float level = from_bits(epx::logfmt_level_bits(f));
    const long double exact = std::exp2l((long double)f / 64);
    const long double ulp = std::ldexp(1.0L, -23);  // every level is in [1, 2)
    EXPECT_LE(std::fabs((long double)level - exact), ulp / 2) << "f = " << f;
    EXPECT_EQ(epx::logfmt_level_bits(f) >> 23, 127u) << "f = " << f;
  }
  EXPECT_EQ(epx::logfmt_level_bits(0), 0x3f800000u);   // 1
  EXPECT_EQ(epx::logfmt_level_bits(32), 0x3fb504f3u);  // sqrt(2) in float32
}

TEST(Logfmt, MantissaTableIsTheNearestLevel) {
  for (int m = 0; m < 128; ++m) {
    const double v = 1.0 + m / 128.0;  // exact, as are the levels: their differences are exact in double
    int best = 0;
    for (int i = 1; i <= 64; ++i) {
      const double level = i == 64 ? 2.0 : from_bits(epx::logfmt_level_bits(i));
      const double best_level = best == 64 ? 2.0 : from_bits(epx::logfmt_level_bits(best));
      if (std::fabs(v - level) < std::fabs(v - best_level)) best = i;  // the lower one on a tie
    }
    EXPECT_EQ(epx::logfmt_mantissa_level(m), best) << "m = " << m;
  }
  EXPECT_EQ(epx::logfmt_mantissa_level(0), 0);     // 1.0 is level 0
  EXPECT_EQ(epx::logfmt_mantissa_level(127), 64);  // 1.9921875 is nearer 2 than 2^(63/64) = 1.9785
}

// ---- bit layout ----------------------------------------------------------------------------------------------------

TEST(Logfmt, RowBytes) {
  EXPECT_EQ(ref::logfmt_row_bytes(128), 16 + 160);
  EXPECT_EQ(ref::logfmt_row_bytes(1024), 16 + 8 * 160);
  EXPECT_EQ(ref::logfmt_row_bytes(1152), 2 * 16 + 9 * 160);
  EXPECT_EQ(ref::logfmt_row_bytes(7168), 7 * 16 + 56 * 160);  // 9072 bytes: 63% of the 14336 of BF16
  EXPECT_EQ(epx::logfmt_block_offset(9), 1296);
  EXPECT_EQ(epx::logfmt_top_offset(9), 1296 + 2);
  EXPECT_EQ(epx::logfmt_low_offset(9), 1296 + 16 + 160);
  EXPECT_EQ(epx::logfmt_high_offset(9), 1296 + 16 + 160 + 128);
  EXPECT_THROW(ref::logfmt_row_bytes(64), std::invalid_argument);
}

TEST(Logfmt, WordsAndLayoutWorkedOutByHand) {
  std::vector<uint16_t> x(128, 0);
  x[0] = bf16_of(1.0f);                       // level 0, the top: code 510 = 0x1fe
  x[1] = bf16_of(-1.0f);                      // sign | 510 = 0x3fe
  x[2] = bf16_of(0.5f);                       // level -64: code 446 = 0x1be
  x[3] = 0x8000;                              // -0: word 0
  x[4] = 0x7f80;                              // +inf: 0x1ff
  x[5] = 0xff80;                              // -inf: 0x3ff
  x[6] = 0x7fc0;                              // NaN: 0x200
  x[7] = 0x0001;                              // subnormal: word 0
  x[8] = bf16_of(std::ldexp(1.0f, -8));       // level -512: d = 512 > 509, lowest level's half
  x[9] = bf16_of(std::ldexp(1.0f, -9));       // level -576: d = 576 > 573: zero
  x[10] = bf16_of(-std::exp2(-509.0f / 64));  // level -509 or a neighbour: below the range
  x[127] = bf16_of(1.5f);                     // 1.5: level 37 (2^(37/64) = 1.4924): the top
  const Encoded e = encode(x);
  ASSERT_EQ(e.bytes.size(), 176u);
  EXPECT_EQ(e.top(), 37);
  for (int j = 1; j < 8; ++j) EXPECT_EQ(e.bytes[2 * j] | e.bytes[2 * j + 1], 0) << "header slot " << j;
  EXPECT_EQ(e.word(0), uint32_t(510 - 37));
  EXPECT_EQ(e.word(1), 0x200u | (510 - 37));
  EXPECT_EQ(e.word(2), uint32_t(510 - 37 - 64));
  EXPECT_EQ(e.word(3), 0u);
  EXPECT_EQ(e.word(4), 0x1ffu);
  EXPECT_EQ(e.word(5), 0x3ffu);
  EXPECT_EQ(e.word(6), 0x200u);
  EXPECT_EQ(e.word(7), 0u);
  EXPECT_EQ(e.word(8), 1u);       // d = 37 + 512 = 549 <= 573
  EXPECT_EQ(e.word(9), 0u);       // d = 37 + 576 = 613
  EXPECT_EQ(e.word(10), 0x201u);  // d = 37 + 509 (or a level either side): code 1 with the sign
  EXPECT_EQ(e.word(127), 510u);
  // Low plane byte i, high plane bits 2i and 2i + 1: element 1 (0x3fe) and element 127 (0x1fe).
  const uint8_t* low = e.bytes.data() + 16;
  const uint8_t* high = low + 128;
  EXPECT_EQ(low[1], 0xfe - 37);
  EXPECT_EQ(high[0] >> 2 & 3, 3);
  EXPECT_EQ(low[127], 0xfe);
  EXPECT_EQ(high[31] >> 6, 1);
  // The top is a little-endian int16: a negative one.
  std::vector<uint16_t> small(128, bf16_of(0.25f));  // level -128
  const Encoded s = encode(small);
  EXPECT_EQ(s.bytes[0], 0x80);
  EXPECT_EQ(s.bytes[1], 0xff);
  EXPECT_EQ(s.word(5), 510u);
}

TEST(Logfmt, DecodeFormula) {
  // Code c in [1, 510] is level n = top - 510 + c: 2^(n / 64) as logfmt_level_bits(n mod 64) * 2^floor(n / 64).
  for (int top : {-7000, -64, 0, 37, 5000, epx::kLogfmtMaxLevel})
    for (int code = 1; code <= 510; ++code) {
      const int n = top - 510 + code;
      const int f = ((n % 64) + 64) % 64, e = (n - f) / 64;
      const float want = std::ldexp(from_bits(epx::logfmt_level_bits(f)), e);
      EXPECT_EQ(from_bits(epx::logfmt_decode(uint32_t(code), top)), want) << top << " " << code;
      EXPECT_EQ(from_bits(epx::logfmt_decode(0x200u | uint32_t(code), top)), -want) << top << " " << code;
    }
  EXPECT_EQ(epx::logfmt_decode(0, 5), 0u);
  EXPECT_TRUE(std::isnan(from_bits(epx::logfmt_decode(0x200, 5))));
  EXPECT_EQ(from_bits(epx::logfmt_decode(0x1ff, 5)), INFINITY);
  EXPECT_EQ(from_bits(epx::logfmt_decode(0x3ff, 5)), -INFINITY);
}

// ---- round trips ---------------------------------------------------------------------------------------------------

// Every positive normal BF16 value within the 509 levels below a group's top comes back within half a level step
// (linear): |y / x - 1| <= (2^(1/64) - 1) / 2 < 0.0055, with its sign.
TEST(Logfmt, RoundTripErrorWithinHalfAStepForEveryBf16InRange) {
  for (float top_value : {1.0f, 3.0f, 1e-30f, 1e30f}) {
    const uint16_t top_bits = bf16_of(top_value);
    const int top = epx::logfmt_level(top_bits);
    double worst = 0;
    int checked = 0;
    for (uint32_t b = 0x0080; b < 0x7f80; ++b) {  // every positive normal BF16
      const int level = epx::logfmt_level(b);
      if (level > top || top - level > 509) continue;
      for (uint32_t sign : {0u, 0x8000u}) {
        std::vector<uint16_t> x(128, 0);
        x[0] = top_bits;
        x[77] = uint16_t(b | sign);
        const std::vector<float> y = round_trip(x);
        const double v = ref::bf16_to_float(x[77]);
        const double rel = std::fabs(y[77] / v - 1);
        worst = std::max(worst, rel);
        ASSERT_LE(rel, 0.0055) << "top " << top_value << " bits 0x" << std::hex << x[77];
        ASSERT_EQ(std::signbit(y[77]), sign != 0);
        ++checked;
      }
    }
    EXPECT_GT(checked, 2 * 7 * 128);
    EXPECT_GT(worst, 0.004);  // the bound is nearly reached (a check that the test sees the rounding)
  }
}

TEST(Logfmt, BelowTheRangeRoundsToZeroOrTheLowestLevel) {
  const uint16_t top_bits = bf16_of(1.0f);  // levels down to 2^(-509/64) ~ 0.00404
  const float lowest = from_bits(epx::logfmt_decode(1, 0));
  EXPECT_FLOAT_EQ(lowest, std::exp2(-509.0f / 64));
  for (uint32_t b = 0x0080; b < bf16_of(lowest); ++b) {
    std::vector<uint16_t> x(128, top_bits);
    x[3] = uint16_t(b);
    const float y = round_trip(x)[3], v = ref::bf16_to_float(uint16_t(b));
    ASSERT_TRUE(y == 0.f || y == lowest) << std::hex << b;
    ASSERT_LE(std::fabs(y - v), 0.5f * lowest * 1.03f) << std::hex << b;  // nearest, to within a level step
  }
}

TEST(Logfmt, SpecialValues) {
  std::vector<uint16_t> x(128, 0);
  // A group without finite nonzero values: top 0, zeros come back as +0, infinities and NaN as they were.
  x[1] = 0x8000;
  x[2] = 0x7f80;
  x[3] = 0xff80;
  x[4] = 0xffc1;  // a negative NaN with payload: NaN
  x[5] = 0x807f;  // the largest negative subnormal: zero
  Encoded e = encode(x);
  EXPECT_EQ(e.top(), epx::kLogfmtEmptyTop);
  std::vector<float> y = round_trip(x);
  EXPECT_EQ(y[0], 0.f);
  EXPECT_FALSE(std::signbit(y[1]));
  EXPECT_EQ(y[2], INFINITY);
  EXPECT_EQ(y[3], -INFINITY);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_EQ(y[5], 0.f);
  // The largest finite BF16 (0x7f7f, level 8192 before the clamp) stays finite: level 8191, 2^(8191/64).
  x.assign(128, 0x7f7f);
  x[9] = 0xff7f;
  y = round_trip(x);
  EXPECT_EQ(encode(x).top(), epx::kLogfmtMaxLevel);
  EXPECT_TRUE(std::isfinite(y[0]));
  EXPECT_EQ(y[0], std::ldexp(from_bits(epx::logfmt_level_bits(63)), 127));
  EXPECT_EQ(y[9], -y[0]);
  // The smallest normal BF16 (2^-126) is level -8064, exactly; nothing below it is ever a level: with a top of
  // 2^-120 (level -7680) the levels would reach down to -8189, so values under 2^-126 become zero.
  x.assign(128, 0);
  x[0] = bf16_of(std::ldexp(1.0f, -120));
  x[1] = 0x0080;  // 2^-126
  x[2] = bf16_of(std::ldexp(1.0f, -126) * 1.5f);
  y = round_trip(x);
  EXPECT_EQ(y[0], std::ldexp(1.0f, -120));
  EXPECT_EQ(y[1], std::ldexp(1.0f, -126));
  EXPECT_NEAR(y[2] / std::ldexp(1.0f, -126), 1.5f, 0.01f);
  // A group at the bottom of the range: its lowest code would be a level below 2^-126, so the encoder gives zero
  // where code 1 would be.
  x.assign(128, 0);
  x[0] = 0x0100;                           // 2^-125: level -8000, top; the lowest level -8509 is below -8064
  x[1] = bf16_of(std::ldexp(1.0f, -132));  // subnormal in BF16: zero anyway
  y = round_trip(x);
  EXPECT_EQ(y[0], std::ldexp(1.0f, -125));
  EXPECT_EQ(y[1], 0.f);
  for (int code = 1; code <= 510; ++code) {  // every code an encoder can give decodes to a normal float or zero
    const float v = from_bits(epx::logfmt_decode(uint32_t(code), -8000));
    if (code >= 510 - 64) {
      EXPECT_TRUE(std::isnormal(v)) << code;
    }
  }
}

TEST(Logfmt, GroupsAreIndependent) {
  // Each group has its own top: a large value in group 0 does not coarsen group 1.
  std::vector<uint16_t> x(256);
  for (int i = 0; i < 256; ++i) x[i] = bf16_of(i < 128 ? 1000.f : 0.001f * (1 + i % 7));
  const std::vector<float> y = round_trip(x);
  for (int i = 128; i < 256; ++i) EXPECT_NEAR(y[i] / ref::bf16_to_float(x[i]), 1.0, 0.0055) << i;
  std::vector<uint8_t> bytes(size_t(ref::logfmt_row_bytes(256)));
  ref::logfmt_encode_row(x.data(), 256, bytes.data());
  EXPECT_EQ(int16_t(bytes[0] | bytes[1] << 8), epx::logfmt_level(bf16_of(1000.f)));
  EXPECT_EQ(int16_t(bytes[2] | bytes[3] << 8), epx::logfmt_level(bf16_of(0.007f)));  // group 1's largest
}

// ---- the reference model's LogFMT combine --------------------------------------------------------------------------

TEST(LogfmtCombine, DecodesEveryRowThenSumsInSlotOrder) {
  const int H = 256, K = 4, E = 8;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  std::vector<std::vector<uint16_t>> rows(E, std::vector<uint16_t>(H));
  for (auto& r : rows)
    for (auto& v : r) v = bf16_of(normal(gen));
  const int64_t idx[K] = {5, -1, 2, 7};
  const float w[K] = {0.25f, 9.f, 0.5f, 0.125f};
  std::vector<uint16_t> out(H);
  ref::low_latency_combine_row_logfmt(
      H, idx, w, K, E, [&](int64_t e) { return rows[e].data(); }, out.data());
  // By hand: the decoded rows, w * value rounded to float32, added in slot order from +0.
  std::vector<std::vector<float>> dec(E);
  for (int e : {5, 2, 7}) dec[e] = round_trip(rows[e]);
  for (int h = 0; h < H; ++h) {
    float acc = 0.f;
    for (int k : {0, 2, 3}) {
      volatile float product = w[k] * dec[idx[k]][h];
      acc = acc + product;
    }
    ASSERT_EQ(out[h], ref::float_to_bf16(acc)) << h;
  }
  // No expert: zero.
  const int64_t none[K] = {-1, -1, 8, -1};  // 8 is outside [0, E): skipped like -1
  ref::low_latency_combine_row_logfmt(
      H, none, w, K, E, [&](int64_t e) { return rows[e].data(); }, out.data());
  for (int h = 0; h < H; ++h) ASSERT_EQ(out[h], 0);
  EXPECT_THROW(ref::low_latency_combine_row_logfmt(
                   100, idx, w, K, E, [&](int64_t e) { return rows[e].data(); }, out.data()),
               std::invalid_argument);
}

// semantics.md section 9: on random normal data the LogFMT combine is within 1e-5 of the flat BF16 combine by
// 1 - 2 * sum(x * y) / sum(x * x + y * y). 256 tokens of hidden 7168, top-8 of 256 experts (5% empty slots),
// positive weights; the measure is printed (docs/logfmt.md quotes it).
TEST(LogfmtCombine, AccuracyOnRandomNormalData) {
  const int T = 256, H = 7168, K = 8, E = 256;
  std::mt19937 gen(2024);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::uniform_int_distribution<int> expert(0, E - 1);
  std::vector<uint16_t> flat(size_t(T) * H), logfmt(size_t(T) * H), row_data(size_t(K) * H);
  double row_xy = 0, row_xx_yy = 0;  // the rows' own round trip, for the record
  for (int t = 0; t < T; ++t) {
    int64_t idx[K];
    float w[K];
    for (int k = 0; k < K; ++k) {
      idx[k] = unit(gen) < 0.05f ? -1 : expert(gen);
      w[k] = unit(gen);
      for (int h = 0; h < H; ++h) row_data[size_t(k) * H + h] = bf16_of(normal(gen));
    }
    // A slot's row is row_data's k-th (the accessor is asked in slot order, once per valid slot).
    int k_asked = 0;
    const auto rows = [&](int64_t) {
      while (idx[k_asked] < 0) ++k_asked;
      return row_data.data() + size_t(k_asked++) * H;
    };
    ref::low_latency_combine_row(H, idx, w, K, E, rows, flat.data() + size_t(t) * H);
    k_asked = 0;
    ref::low_latency_combine_row_logfmt(H, idx, w, K, E, rows, logfmt.data() + size_t(t) * H);
    if (t < 16) {
      std::vector<uint16_t> r(row_data.begin(), row_data.begin() + H);
      const std::vector<float> y = round_trip(r);
      for (int h = 0; h < H; ++h) {
        const double a = ref::bf16_to_float(r[h]);
        row_xy += a * y[h];
        row_xx_yy += a * a + double(y[h]) * y[h];
      }
    }
  }
  const double measure = diff_measure(flat, logfmt);
  std::printf("LogFMT accuracy: combined %.3g (bound 1e-5), one row's round trip %.3g\n", measure,
              1 - 2 * row_xy / row_xx_yy);
  EXPECT_LT(measure, 1e-5);
  EXPECT_GT(measure, 0.0);  // it is lossy: a measure of 0 would mean the encoding was never applied
}
