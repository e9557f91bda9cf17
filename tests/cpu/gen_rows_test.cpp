// The payload functions shared by the harness's host and device generators (tools/harness/gen_rows.hpp): the
// checks regenerate expected rows on the host with them while the timed loops write inputs on the GPU with the
// same code, so their values are pinned here.
#include "gen_rows.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "epx/reference.hpp"
#include "gen.hpp"

namespace {

using namespace epx::harness;

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(GenRows, Bf16ElementsAreTheReferenceRoundingOfAnExactValue) {
  for (int t = 0; t < 50; ++t) {
    const uint64_t base = rows::bf16_row_base(7, 3, t);
    for (int h = 0; h < 512; ++h) {
      const uint64_t v = rows::mix(base, uint64_t(h));
      const float exact = float(int64_t(v % 4096) - 2048) / 256.f + float((v >> 20) % 256) / 65536.f;
      const uint16_t got = rows::bf16_element(base, h);
      ASSERT_EQ(got, epx::ref::float_to_bf16(exact)) << "token " << t << " h " << h;
      ASSERT_TRUE(std::isfinite(bf16_to_float(got)));
      ASSERT_LT(std::fabs(bf16_to_float(got)), 8.5f);
    }
  }
}

TEST(GenRows, HostRowsAreMadeOfTheSharedElements) {
  const int H = 256;
  std::vector<uint16_t> bf16(H);
  std::vector<uint8_t> fp8(H);
  std::vector<float> scales(H / 128);
  fill_bf16_row(11, 1, 5, H, bf16.data());
  fill_fp8_row(11, 1, 5, H, fp8.data());
  fill_scales(11, 1, 5, H / 128, scales.data());
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(bf16[h], rows::bf16_element(rows::bf16_row_base(11, 1, 5), h));
    EXPECT_EQ(fp8[h], rows::fp8_element(rows::fp8_row_base(11, 1, 5), h));
  }
  for (int i = 0; i < H / 128; ++i) EXPECT_EQ(scales[i], rows::scale_element(rows::scale_row_base(11, 1, 5), i));
}

TEST(GenRows, Fp8BytesAreNeverNanAndScalesArePositive) {
  int distinct = 0;
  bool seen[256] = {};
  for (int t = 0; t < 64; ++t)
    for (int h = 0; h < 1024; ++h) {
      const uint8_t b = rows::fp8_element(rows::fp8_row_base(3, 0, t), h);
      ASSERT_NE(b & 0x7f, 0x7f) << "e4m3 NaN at token " << t << " h " << h;
      if (!seen[b]) seen[b] = true, ++distinct;
    }
  EXPECT_GT(distinct, 200);  // not a pattern
  for (int i = 0; i < 1000; ++i) {
    const float s = rows::scale_element(rows::scale_row_base(3, 0, i), i % 56);
    ASSERT_GE(s, 0.001f);
    ASSERT_LT(s, 1.002f);
  }
}

TEST(GenRows, RowsDifferAcrossSeedsRanksAndTokens) {
  EXPECT_NE(rows::bf16_row_base(1, 0, 0), rows::bf16_row_base(2, 0, 0));
  EXPECT_NE(rows::bf16_row_base(1, 0, 0), rows::bf16_row_base(1, 1, 0));
  EXPECT_NE(rows::bf16_row_base(1, 0, 0), rows::bf16_row_base(1, 0, 1));
  EXPECT_NE(rows::bf16_row_base(1, 0, 0), rows::fp8_row_base(1, 0, 0));
}

}  // namespace
