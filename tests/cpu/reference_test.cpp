// The CPU reference model is the oracle of every GPU test, so it is checked here against values worked out
// by hand (never against itself): numeric conversions, layout, dispatch routing and the combine reduction.
#include "epx/reference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "test_helpers.hpp"

namespace ref = epx::ref;

namespace {

using epx_test::from_bits;

uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

// ---- bf16 -------------------------------------------------------------------------------------------------------

TEST(Bf16, FromFloatHandTable) {
  // float bits -> bf16 bits, worked out by hand. bf16 keeps the top 16 bits of the float; the low 16 bits
  // decide the rounding: > 0x8000 up, < 0x8000 down, == 0x8000 to the even neighbour.
  const std::pair<uint32_t, uint16_t> table[] = {
      {0x3f800000u, 0x3f80},  // 1.0 exact
      {0xc0000000u, 0xc000},  // -2.0 exact
      {0x40490000u, 0x4049},  // 3.140625 exact
      {0x3f807fffu, 0x3f80},  // just below the midpoint: down
      {0x3f808000u, 0x3f80},  // tie, 0x3f80 is even: down
      {0x3f808001u, 0x3f81},  // just above the midpoint: up
      {0x3f818000u, 0x3f82},  // tie, 0x3f81 is odd: up to 0x3f82
      {0xbf818000u, 0xbf82},  // the same tie on a negative value (rounding is on the magnitude)
      {0x3fffffffu, 0x4000},  // rounds up across the exponent boundary (1.99999988 -> 2.0)
      {0x7f7f0000u, 0x7f7f},  // largest finite bf16, exact
      {0x7f7fffffu, 0x7f80},  // FLT_MAX rounds to +inf
      {0x7f800000u, 0x7f80},  // +inf
      {0xff800000u, 0xff80},  // -inf
      {0x80000000u, 0x8000},  // -0.0 keeps its sign
      {0x00000001u, 0x0000},  // smallest float subnormal: down to 0
      {0x00008000u, 0x0000},  // subnormal tie, even: down
      {0x00018000u, 0x0002},  // subnormal tie, odd: up
  };
  for (const auto& [in, want] : table)
    EXPECT_EQ(ref::float_to_bf16(from_bits(in)), want) << std::hex << "float bits 0x" << in;
}

TEST(Bf16, NaNStaysNaN) {
  // A NaN whose payload sits only in the low 16 bits would become +inf under plain truncation-with-rounding.
  EXPECT_EQ(ref::float_to_bf16(from_bits(0x7fc00000u)), 0x7fc0);
  EXPECT_EQ(ref::float_to_bf16(from_bits(0x7f800001u)), 0x7fc0);
  EXPECT_EQ(ref::float_to_bf16(from_bits(0x7fffffffu)), 0x7fc0);
  EXPECT_EQ(ref::float_to_bf16(from_bits(0xff800001u)), 0xffc0);  // sign kept
}

TEST(Bf16, ToFloat) {
  EXPECT_EQ(ref::bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(ref::bf16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(ref::bf16_to_float(0xc2f7), -123.5f);
  EXPECT_EQ(ref::bf16_to_float(0x0001), std::ldexp(1.0f, -133));  // bf16 subnormal
  EXPECT_EQ(ref::bf16_to_float(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(ref::bf16_to_float(0xff80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(0x7fc0)));
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(0xffc1)));
  const float negative_zero = ref::bf16_to_float(0x8000);
  EXPECT_EQ(negative_zero, 0.0f);
  EXPECT_TRUE(std::signbit(negative_zero));
}

TEST(Bf16, EveryFiniteCodeRoundTrips) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = uint16_t(b);
    if ((bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0) continue;  // NaN
    ASSERT_EQ(ref::float_to_bf16(ref::bf16_to_float(bits)), bits) << std::hex << b;
    ASSERT_EQ(to_bits(ref::bf16_to_float(bits)), b << 16);  // widening is a 16-bit shift
  }
}

// ---- e4m3 (float8_e4m3fn: bias 7, 3 mantissa bits, no infinities, S.1111.111 is NaN) ---------------------------

TEST(E4m3, ToFloatHandTable) {
  const std::pair<uint8_t, float> table[] = {
      {0x00, 0.0f},      {0x01, 1.0f / 512}, {0x07, 7.0f / 512},  // subnormals: m * 2^-9
      {0x08, 1.0f / 64}, {0x38, 1.0f},       {0x3c, 1.5f},        {0x40, 2.0f},
      {0x77, 240.0f},    {0x78, 256.0f},     {0x7e, 448.0f},  // 1.75 * 2^8 is the largest finite
      {0xb8, -1.0f},     {0xfe, -448.0f},    {0x81, -1.0f / 512},
  };
  for (const auto& [bits, want] : table) EXPECT_EQ(ref::e4m3_to_float(bits), want) << int(bits);
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0xff)));
  EXPECT_TRUE(std::signbit(ref::e4m3_to_float(0x80)));
}

TEST(E4m3, FromFloatRoundsToNearestEvenAndSaturates) {
  const std::pair<float, uint8_t> table[] = {
      {1.0f, 0x38},
      {448.0f, 0x7e},
      {449.0f, 0x7e},  // saturation, never NaN
      {464.0f, 0x7e},  // the midpoint to the (non-existent) 480
      {1e9f, 0x7e},
      {std::numeric_limits<float>::infinity(), 0x7e},
      {-std::numeric_limits<float>::infinity(), 0xfe},
      {-1000.0f, 0xfe},
      {1.0625f, 0x38},                // tie between 1.0 (0x38, even) and 1.125 (0x39)
      {1.0625f + 1.0f / 1024, 0x39},  // just above the tie
      {1.1875f, 0x3a},                // tie between 1.125 (0x39, odd) and 1.25 (0x3a)
      {248.0f, 0x78},                 // tie between 240 (0x77) and 256 (0x78, even) crosses a binade
      {1.0f / 64, 0x08},              // smallest normal
      {1.0f / 1024, 0x00},            // subnormal tie between 0 and 2^-9: to 0
      {3.0f / 1024, 0x02},            // subnormal tie between 0x01 and 0x02: to 0x02
      {15.0f / 1024, 0x08},           // tie between 0x07 and 0x08 (2^-6): to the even 0x08
      {1.0f / 4096, 0x00},            // underflow
      {-1.0f / 1024, 0x80},           // underflow keeps the sign
      {-1.5f, 0xbc},
  };
  for (const auto& [value, want] : table) EXPECT_EQ(ref::float_to_e4m3(value), want) << value;
  EXPECT_EQ(ref::float_to_e4m3(std::nanf("")), 0x7f);
}

TEST(E4m3, AllNonNaNCodesRoundTrip) {
  // Independent derivation of the value of every positive code: codes 0..15 are c * 2^-9 (the subnormals and
  // the first normal binade share that spacing), and each further 8 codes double the value.
  std::vector<float> value(127);
  for (int c = 0; c < 16; ++c) value[c] = float(c) / 512;
  for (int c = 16; c < 127; ++c) value[c] = 2 * value[c - 8];
  ASSERT_EQ(value[0x7e], 448.0f);
  int round_trips = 0;
  for (int code = 0; code < 256; ++code) {
    const uint8_t bits = uint8_t(code);
    if ((bits & 0x7f) == 0x7f) continue;  // the two NaN codes
    const float want = (bits & 0x80) ? -value[bits & 0x7f] : value[bits & 0x7f];
    EXPECT_EQ(ref::e4m3_to_float(bits), want) << code;
    EXPECT_EQ(ref::float_to_e4m3(ref::e4m3_to_float(bits)), bits) << code;
    ++round_trips;
  }
  EXPECT_EQ(round_trips, 254);
}

// ---- layout (semantics.md section 1)
// --------------------------------------------------------------------------------------

namespace {

// R = 4 ranks, E = 8 experts (2 per rank), K = 3, T = 4 tokens.
const std::vector<int64_t> kLayoutTopk = {
    0,  5,  -1,  // t0: ranks 0 and 2
    -1, -1, -1,  // t1: routed nowhere
    1,  0,  7,   // t2: experts 1 and 0 are both on rank 0 (counts once), 7 on rank 3
    3,  2,  -1,  // t3: both experts on rank 1
};

}  // namespace

TEST(Layout, HandWorkedExample) {
  const ref::Layout l = ref::dispatch_layout(kLayoutTopk.data(), 4, 3, 8, 4);
  EXPECT_EQ(l.num_tokens_per_rank, (std::vector<int>{2, 1, 1, 1}));
  EXPECT_EQ(l.num_tokens_per_expert, (std::vector<int>{2, 1, 1, 1, 0, 1, 0, 1}));
  EXPECT_EQ(l.is_token_in_rank, (std::vector<uint8_t>{1, 0, 1, 0,  //
                                                      0, 0, 0, 0,  //
                                                      1, 0, 0, 1,  //
                                                      0, 1, 0, 0}));
  EXPECT_TRUE(l.num_tokens_per_rdma_rank.empty());  // one NVLink domain
  EXPECT_TRUE(ref::dispatch_layout(kLayoutTopk.data(), 4, 3, 8, 4, 4).num_tokens_per_rdma_rank.empty());
}

TEST(Layout, TokensPerRdmaRankCountOncePerDomain) {
  // Two domains of two ranks: {0, 1} and {2, 3}. t0 reaches both, t2 both, t3 only domain 0.
  const ref::Layout l = ref::dispatch_layout(kLayoutTopk.data(), 4, 3, 8, 4, 2);
  EXPECT_EQ(l.num_tokens_per_rdma_rank, (std::vector<int>{3, 2}));
  EXPECT_EQ(l.num_tokens_per_rank, (std::vector<int>{2, 1, 1, 1}));  // unchanged by the grouping
}

TEST(Layout, OutOfRangeIndexThrowsNamingTheSlot) {
  std::vector<int64_t> topk = kLayoutTopk;
  topk[2 * 3 + 1] = 8;  // t2, slot 1: one past the last expert
  try {
    ref::dispatch_layout(topk.data(), 4, 3, 8, 4);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx[2][1]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("8"), std::string::npos) << e.what();
  }
  topk = kLayoutTopk;
  topk[3 * 3 + 2] = -2;  // below -1 is not "no expert"
  EXPECT_THROW(ref::dispatch_layout(topk.data(), 4, 3, 8, 4), std::invalid_argument);
}

TEST(Layout, ZeroTokens) {
  const ref::Layout l = ref::dispatch_layout(nullptr, 0, 3, 8, 4, 2);
  EXPECT_EQ(l.num_tokens_per_rank, (std::vector<int>(4, 0)));
  EXPECT_EQ(l.num_tokens_per_expert, (std::vector<int>(8, 0)));
  EXPECT_EQ(l.num_tokens_per_rdma_rank, (std::vector<int>(2, 0)));
  EXPECT_TRUE(l.is_token_in_rank.empty());
}

// ---- dispatch routing (semantics.md section 2)
// ---------------------------------------------------------------------------

namespace {

// Three ranks, E = 6 (2 local experts each), K = 2. Rank 1 has no tokens.
// Source 0: t0 -> experts {0, 3} (ranks 0, 1); t1 -> {5} (rank 2); t2 -> {1, 4} (ranks 0, 2).
// Source 2: t0 -> {2, 4} (ranks 1, 2); t1 -> {3, 0} (ranks 1, 0).
struct ThreeRanks {
  std::vector<uint8_t> in0 = {1, 1, 0, 0, 0, 1, 1, 0, 1};
  std::vector<uint8_t> in2 = {0, 1, 1, 1, 1, 0};
  std::vector<int64_t> idx0 = {0, 3, 5, -1, 1, 4};
  std::vector<int64_t> idx2 = {2, 4, 3, 0};
  std::vector<float> w0 = {0.5f, 0.25f, 0.75f, 9.0f, 0.125f, 0.875f};  // 9.0: weight of a -1 slot
  std::vector<float> w2 = {1.5f, 2.5f, 3.5f, 4.5f};
  std::vector<ref::Source> sources(bool topk, bool weights) const {
    std::vector<ref::Source> s(3);
    s[0] = {3, in0.data(), topk ? idx0.data() : nullptr, weights ? w0.data() : nullptr};
    s[1] = {0, nullptr, nullptr, nullptr};  // no tokens: null pointers are allowed and never read
    s[2] = {2, in2.data(), topk ? idx2.data() : nullptr, weights ? w2.data() : nullptr};
    return s;
  }
};

std::vector<std::pair<int, int>> as_pairs(const std::vector<ref::RecvRow>& rows) {
  std::vector<std::pair<int, int>> out;
  for (const ref::RecvRow& r : rows) out.emplace_back(r.src_rank, r.src_token);
  return out;
}

}  // namespace

TEST(Dispatch, RankPrefixMatrix) {
  const ThreeRanks d;
  // Sent counts [source][dest]: source 0 -> {2, 1, 2}, source 1 -> {0, 0, 0}, source 2 -> {1, 2, 1}.
  EXPECT_EQ(ref::rank_prefix_matrix(d.sources(false, false)), (std::vector<int>{2, 1, 2,  //
                                                                                2, 1, 2,  //
                                                                                3, 3, 3}));
}

TEST(Dispatch, RecvRowsSourceThenTokenAscending) {
  const ThreeRanks d;
  const auto s = d.sources(false, false);
  using P = std::vector<std::pair<int, int>>;
  EXPECT_EQ(as_pairs(ref::recv_rows(s, 0)), (P{{0, 0}, {0, 2}, {2, 1}}));
  EXPECT_EQ(as_pairs(ref::recv_rows(s, 1)), (P{{0, 0}, {2, 0}, {2, 1}}));
  EXPECT_EQ(as_pairs(ref::recv_rows(s, 2)), (P{{0, 1}, {0, 2}, {2, 0}}));
}

TEST(Dispatch, MetaRebasesIdsAndZeroesForeignWeights) {
  const ThreeRanks d;
  const auto s = d.sources(true, true);
  // Rank 1 holds experts 2 and 3; its rows are (0,0) {0,3}, (2,0) {2,4}, (2,1) {3,0}.
  ref::RecvMeta m = ref::dispatch_meta(s, 1, 2, 6, 1, true, true);
  EXPECT_EQ(m.recv_src_idx, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(m.recv_topk_idx, (std::vector<int64_t>{-1, 1, 0, -1, 1, -1}));
  EXPECT_EQ(m.recv_topk_weights, (std::vector<float>{0.f, 0.25f, 1.5f, 0.f, 3.5f, 0.f}));
  EXPECT_EQ(m.num_recv_tokens_per_expert, (std::vector<int>{1, 2}));
  // Rank 2 holds experts 4 and 5; rows (0,1) {5,-1}, (0,2) {1,4}, (2,0) {2,4}. The -1 slot's weight is dropped.
  m = ref::dispatch_meta(s, 2, 2, 6, 1, true, true);
  EXPECT_EQ(m.recv_src_idx, (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(m.recv_topk_idx, (std::vector<int64_t>{1, -1, -1, 0, -1, 0}));
  EXPECT_EQ(m.recv_topk_weights, (std::vector<float>{0.75f, 0.f, 0.f, 0.875f, 0.f, 2.5f}));
  EXPECT_EQ(m.num_recv_tokens_per_expert, (std::vector<int>{2, 1}));
  // Rank 0 holds experts 0 and 1; rows (0,0) {0,3}, (0,2) {1,4}, (2,1) {3,0}.
  m = ref::dispatch_meta(s, 0, 2, 6, 1, true, true);
  EXPECT_EQ(m.recv_topk_idx, (std::vector<int64_t>{0, -1, 1, -1, -1, 0}));
  EXPECT_EQ(m.recv_topk_weights, (std::vector<float>{0.5f, 0.f, 0.125f, 0.f, 0.f, 4.5f}));
  EXPECT_EQ(m.num_recv_tokens_per_expert, (std::vector<int>{2, 1}));
}

TEST(Dispatch, MetaCountsRoundUpToAlignment) {
  const ThreeRanks d;
  const auto s = d.sources(true, true);
  EXPECT_EQ(ref::dispatch_meta(s, 1, 2, 6, 2, true, true).num_recv_tokens_per_expert,
            (std::vector<int>{2, 2}));  // 1, 2
  EXPECT_EQ(ref::dispatch_meta(s, 2, 2, 6, 3, true, true).num_recv_tokens_per_expert,
            (std::vector<int>{3, 3}));  // 2, 1
  EXPECT_EQ(ref::dispatch_meta(s, 0, 2, 6, 128, true, true).num_recv_tokens_per_expert, (std::vector<int>{128, 128}));
}

TEST(Dispatch, MetaWithoutTopkOrWeights) {
  const ThreeRanks d;
  ref::RecvMeta m = ref::dispatch_meta(d.sources(false, false), 2, 2, 6, 1, false, false);
  EXPECT_EQ(m.recv_src_idx, (std::vector<int>{1, 2, 0}));
  EXPECT_TRUE(m.recv_topk_idx.empty());
  EXPECT_TRUE(m.recv_topk_weights.empty());
  EXPECT_TRUE(m.num_recv_tokens_per_expert.empty());
  m = ref::dispatch_meta(d.sources(true, false), 2, 2, 6, 1, true, false);
  EXPECT_EQ(m.recv_topk_idx, (std::vector<int64_t>{1, -1, -1, 0, -1, 0}));
  EXPECT_TRUE(m.recv_topk_weights.empty());
}

// ---- combine (semantics.md section 3)
// ------------------------------------------------------------------------------------

namespace {

// Three ranks, hidden 2, K 2, T 3 tokens on the combining rank.
//   t0 is received by ranks 0, 1, 2; t1 by none; t2 by rank 1 only.
// Column 0 of t0: 2^24, 1, -2^24 from ranks 0, 1, 2, then bias0 1 and bias1 0.5. In the contract's order
//   ((2^24 + 1) = 2^24 in float) - 2^24 + 1 + 0.5 = 1.5. Reversed rank order gives 2.5, biases first give 4,
//   a double accumulator gives 2.5: only the fixed order gives 1.5.
// Column 1 of t0: 1, 2^-8, 2^-8: in float 1 + 2^-7 exactly (bf16 0x3f81); rounding to bf16 after every add
//   would give 1 (each 1 + 2^-8 is a tie to the even 1.0): only one rounding gives 0x3f81.
struct CombineData {
  static constexpr uint16_t kTwo24 = 0x4b80, kMinusTwo24 = 0xcb80, kOne = 0x3f80, kTwoM8 = 0x3b80;
  std::map<std::pair<int, int>, std::vector<uint16_t>> rows = {
      {{0, 0}, {kTwo24, kOne}},
      {{1, 0}, {kOne, kTwoM8}},
      {{2, 0}, {kMinusTwo24, kTwoM8}},
      {{1, 2}, {0x4000, 0xbf80}},  // 2.0, -1.0
  };
  // Weight rows; k = 1 of t0 is order-sensitive the same way: 2^24 + 1 - 2^24 = 0 in the contract's order.
  std::map<std::pair<int, int>, std::vector<float>> weights = {
      {{0, 0}, {0.5f, 16777216.f}},
      {{1, 0}, {0.25f, 1.f}},
      {{2, 0}, {0.125f, -16777216.f}},
      {{1, 2}, {0.3f, 0.7f}},
  };
  std::vector<uint8_t> in_rank = {1, 1, 1, 0, 0, 0, 0, 1, 0};
  std::vector<uint16_t> bias0 = {kOne, 0x0000, 0x4040, 0xbf00, 0x3f00, 0x0000};    // t1: 3.0, -0.5; t2: 0.5, 0
  std::vector<uint16_t> bias1 = {0x3f00, 0x0000, 0x3e80, 0x0000, 0x0000, 0x0000};  // t0: 0.5; t1: 0.25
  ref::Source own() const { return {3, in_rank.data(), nullptr, nullptr}; }
  ref::ContributionRow row_fn() const {
    return [this](int j, int t) -> const uint16_t* {
      auto it = rows.find({j, t});
      if (it == rows.end()) {
        ADD_FAILURE() << "combine read a row rank " << j << " never received (token " << t << ")";
        return rows.begin()->second.data();
      }
      return it->second.data();
    };
  }
  ref::ContributionWeights weight_fn() const {
    return [this](int j, int t) -> const float* {
      auto it = weights.find({j, t});
      if (it == weights.end()) {
        ADD_FAILURE() << "combine read weights rank " << j << " never received (token " << t << ")";
        return weights.begin()->second.data();
      }
      return it->second.data();
    };
  }
};

}  // namespace

TEST(Combine, HandConstantsAreWhatTheCommentsSay) {
  EXPECT_EQ(ref::bf16_to_float(CombineData::kTwo24), 16777216.f);
  EXPECT_EQ(ref::bf16_to_float(CombineData::kMinusTwo24), -16777216.f);
  EXPECT_EQ(ref::bf16_to_float(CombineData::kTwoM8), 1.f / 256);
  EXPECT_EQ(ref::bf16_to_float(0x4040), 3.f);
  EXPECT_EQ(ref::bf16_to_float(0x3e80), 0.25f);
  EXPECT_EQ(ref::bf16_to_float(0x3f00), 0.5f);
  EXPECT_EQ(ref::bf16_to_float(0xbf00), -0.5f);
}

TEST(Combine, FixedOrderRankThenBiasesOneRounding) {
  const CombineData d;
  const ref::Combined c = ref::combine(d.own(), 3, 2, 2, d.row_fn(), d.weight_fn(), d.bias0.data(), d.bias1.data());
  EXPECT_EQ(c.x, (std::vector<uint16_t>{
                     0x3fc0, 0x3f81,  // t0: 1.5 (the contract's order), 1 + 2^-7 (one rounding)
                     0x4050, 0xbf00,  // t1, routed nowhere: bias only, 3.0 + 0.25 = 3.25, -0.5
                     0x4020, 0xbf80,  // t2: 2.0 + 0.5, -1.0
                 }));
  // Weights are summed over the receiving ranks in ascending order; nowhere-routed tokens get 0.
  EXPECT_EQ(c.weights, (std::vector<float>{0.875f, 0.f, 0.f, 0.f, 0.3f, 0.7f}));
}

TEST(Combine, WithoutBiasesAndWithOne) {
  const CombineData d;
  ref::Combined c = ref::combine(d.own(), 3, 2, 2, d.row_fn(), nullptr, nullptr, nullptr);
  // t0 column 0: (2^24 + 1) - 2^24 = 0 in float; t1: zeros; t2: the single row.
  EXPECT_EQ(c.x, (std::vector<uint16_t>{0x0000, 0x3f81, 0x0000, 0x0000, 0x4000, 0xbf80}));
  EXPECT_TRUE(c.weights.empty());
  // bias1 alone is still added (after the rows).
  c = ref::combine(d.own(), 3, 2, 2, d.row_fn(), nullptr, nullptr, d.bias1.data());
  EXPECT_EQ(c.x, (std::vector<uint16_t>{0x3f00, 0x3f81, 0x3e80, 0x0000, 0x4000, 0xbf80}));
}

TEST(Combine, ReduceRowsDirectly) {
  // Same column-0 construction without the combine wrapper: the order is rows in the given order, then biases.
  const std::vector<uint16_t> a = {CombineData::kTwo24}, b = {CombineData::kOne}, c = {CombineData::kMinusTwo24};
  const uint16_t bias0 = CombineData::kOne;
  uint16_t out = 0xffff;
  ref::reduce_bf16_rows(1, {a.data(), b.data(), c.data()}, &bias0, nullptr, &out);
  EXPECT_EQ(out, 0x3f80);  // 0 + 1
  ref::reduce_bf16_rows(1, {c.data(), b.data(), a.data()}, &bias0, nullptr, &out);
  EXPECT_EQ(out, 0x4000);  // (-2^24 + 1) is exact, + 2^24 = 1, + 1 = 2
  ref::reduce_bf16_rows(1, {}, nullptr, nullptr, &out);
  EXPECT_EQ(out, 0x0000);
}

// ---- semantics.md section 5: the rank-reduced low-latency combine (EPX_REDUCE_RANK) ----------------------------

namespace {

// One-element rows of four experts, two per rank (R = 2: experts 0, 1 on rank 0; 2, 3 on rank 1).
struct RankReducedData {
  std::vector<uint16_t> rows;
  ref::ExpertRow row_fn() const {
    return [this](int64_t e) { return rows.data() + e; };
  }
};

}  // namespace

TEST(LowLatencyCombine, RankReducedRoundsEachRanksPartialOnce) {
  // Rank 0's partial 1 + 2^-8 is a tie in bf16 and rounds to 1; rank 1's 2^-8 is exact; 1 + 2^-8 rounds to 1
  // again. The flat order adds both 2^-8 to 1 before its one rounding: 1 + 2^-7.
  const RankReducedData d{{0x3f80, 0x3b80, 0x3b80, 0x0000}};
  const int64_t idx[3] = {0, 1, 2};
  const float w[3] = {1.f, 1.f, 1.f};
  uint16_t out = 0xffff;
  ref::low_latency_combine_row(1, idx, w, 3, 4, d.row_fn(), &out);
  EXPECT_EQ(out, 0x3f81);
  ref::low_latency_combine_row_rank_reduced(1, idx, w, 3, 4, 2, d.row_fn(), &out);
  EXPECT_EQ(out, 0x3f80);
}

TEST(LowLatencyCombine, RankReducedSumsRanksAscendingWhateverTheSlotOrder) {
  // 2^24 + 1 rounds to 2^24 inside rank 0 (float32), -2^24 + 1 = -16777215 rounds to -2^24 as rank 1's bf16
  // partial: 0 whatever the order of the slots. The flat order in slot order k gives 1.
  const RankReducedData d{{0x4b80, 0x3f80, 0xcb80, 0x3f80}};
  const float w[4] = {1.f, 1.f, 1.f, 1.f};
  uint16_t out = 0xffff;
  for (const auto& idx : {std::vector<int64_t>{0, 1, 2, 3}, std::vector<int64_t>{2, 0, 3, 1}}) {
    ref::low_latency_combine_row_rank_reduced(1, idx.data(), w, 4, 4, 2, d.row_fn(), &out);
    EXPECT_EQ(out, 0x0000);
  }
  const int64_t flat_idx[4] = {0, 1, 2, 3};
  ref::low_latency_combine_row(1, flat_idx, w, 4, 4, d.row_fn(), &out);
  EXPECT_EQ(out, 0x3f80);
}

TEST(LowLatencyCombine, RankReducedWeighsInsideTheRankAndSkipsEmptySlots) {
  // Rank 1 holds slots 1 and 3 (experts 3 and 2): 0.5 * 3 + 0.25 * 2 = 2; rank 0 holds slot 4: 1 * 0.25.
  // Slots 0 (-1) and 2 (outside [0, E)) are skipped; 2.25 is exact.
  const RankReducedData d{{0x3e80, 0x0000, 0x4000, 0x4040}};
  const int64_t idx[5] = {-1, 3, 9, 2, 0};
  const float w[5] = {100.f, 0.5f, 100.f, 0.25f, 1.f};
  uint16_t out = 0xffff;
  ref::low_latency_combine_row_rank_reduced(1, idx, w, 5, 4, 2, d.row_fn(), &out);
  EXPECT_EQ(out, 0x4010);
  const int64_t none[2] = {-1, -1};
  ref::low_latency_combine_row_rank_reduced(1, none, w, 2, 4, 2, d.row_fn(), &out);
  EXPECT_EQ(out, 0x0000);
}

TEST(LowLatencyCombine, RankReducedOnOneRankIsTheFlatOrder) {
  // One rank: its partial is the flat sum rounded once, and bf16(float(bf16(x))) == bf16(x).
  std::vector<uint16_t> rows(8 * 16);
  uint32_t state = 12345;
  for (auto& v : rows) {
    state = state * 1664525u + 1013904223u;
    v = uint16_t(0x3c00 + (state >> 20) % 0x600) | uint16_t(state & 0x8000);
  }
  const ref::ExpertRow row = [&](int64_t e) { return rows.data() + e * 16; };
  for (int trial = 0; trial < 50; ++trial) {
    int64_t idx[6];
    float w[6];
    for (int k = 0; k < 6; ++k) {
      state = state * 1664525u + 1013904223u;
      idx[k] = int64_t(state >> 24) % 9 - 1;  // -1 .. 7
      w[k] = float((state >> 8) & 0xff) / 64.f;
    }
    std::vector<uint16_t> flat(16), reduced(16);
    ref::low_latency_combine_row(16, idx, w, 6, 8, row, flat.data());
    ref::low_latency_combine_row_rank_reduced(16, idx, w, 6, 8, 1, row, reduced.data());
    EXPECT_EQ(flat, reduced) << trial;
  }
}

TEST(LowLatencyCombine, RankReducedRejectsBadSizes) {
  const RankReducedData d{{0, 0, 0, 0}};
  const int64_t idx[1] = {0};
  const float w[1] = {1.f};
  uint16_t out = 0;
  EXPECT_THROW(ref::low_latency_combine_row_rank_reduced(1, idx, w, 1, 4, 3, d.row_fn(), &out), std::invalid_argument);
  EXPECT_THROW(ref::low_latency_combine_row_rank_reduced(1, idx, w, 1, 4, 0, d.row_fn(), &out), std::invalid_argument);
  EXPECT_THROW(ref::low_latency_combine_row_rank_reduced(-1, idx, w, 1, 4, 2, d.row_fn(), &out), std::invalid_argument);
  EXPECT_THROW(ref::low_latency_combine_row_rank_reduced(1, idx, w, -1, 4, 2, d.row_fn(), &out), std::invalid_argument);
}
