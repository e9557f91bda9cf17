// Rank masking (enable_shrink, semantics.md section 9) on the CPU: the shrink budget's parsing, the reference model
// under a mask, and the C ABI's mask calls without a buffer.
#include "runtime/shrink.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "epx/reference.hpp"

namespace {

TEST(ShrinkTimeout, OptionThenEnvironmentThenDefault) {
  EXPECT_EQ(epx::shrink_timeout_seconds(0.25, nullptr), 0.25);
  EXPECT_EQ(epx::shrink_timeout_seconds(0.25, "3"), 0.25);  // the option wins over the variable
  EXPECT_EQ(epx::shrink_timeout_seconds(0, "3"), 3.0);
  EXPECT_EQ(epx::shrink_timeout_seconds(-1, "0.5"), 0.5);
  EXPECT_EQ(epx::shrink_timeout_seconds(0, nullptr), 1.0);  // the documented default
  EXPECT_EQ(epx::shrink_timeout_seconds(0, ""), 1.0);
}

TEST(ShrinkTimeout, RejectsBadValues) {
  for (const char* bad : {"0", "-1", "nan", "inf", "1e7", "0.5s", "x", "1 "})
    EXPECT_THROW(epx::shrink_timeout_seconds(0, bad), epx::Error) << bad;
  EXPECT_THROW(epx::shrink_timeout_seconds(2, "x"), epx::Error);  // checked although the option wins
  for (double bad : {std::nan(""), HUGE_VAL, 1e7, 1e300})
    EXPECT_THROW(epx::shrink_timeout_seconds(bad, nullptr), epx::Error) << bad;
  try {
    epx::shrink_timeout_seconds(0, "abc");
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.status(), epx::Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("EPX_LL_SHRINK_TIMEOUT_S"), std::string::npos);
  }
}

// 3 ranks, 6 experts (2 per rank), top-2; rank s's tokens choose experts as below.
struct Routing {
  std::vector<std::vector<int64_t>> topk{{0, 2, 4, 5, -1, 1}, {1, 3}, {5, 0, 2, 2}};
  std::vector<epx::ref::Source> sources() const {
    std::vector<epx::ref::Source> s(3);
    for (int r = 0; r < 3; ++r) {
      s[r].num_tokens = int(topk[r].size() / 2);
      s[r].topk_idx = topk[r].data();
    }
    return s;
  }
};

std::vector<std::vector<std::pair<int, int>>> as_pairs(const std::vector<std::vector<epx::ref::RecvRow>>& rows) {
  std::vector<std::vector<std::pair<int, int>>> out;
  for (const auto& e : rows) {
    out.emplace_back();
    for (const auto& r : e) out.back().emplace_back(r.src_rank, r.src_token);
  }
  return out;
}

TEST(ShrinkReference, NoMaskIsTheUnmaskedModel) {
  const Routing g;
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_EQ(as_pairs(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, rank, {0, 0, 0})),
              as_pairs(epx::ref::low_latency_rows(g.sources(), 2, 6, rank)));
}

TEST(ShrinkReference, MaskedSourcesSendNothing) {
  const Routing g;
  // Rank 0's experts 0 and 1: unmasked, expert 0 gets (0,0) (2,0); expert 1 gets (0,2) (1,0). Masking rank 2 drops
  // (2,0); masking rank 1 drops (1,0).
  using P = std::vector<std::vector<std::pair<int, int>>>;
  EXPECT_EQ(as_pairs(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, 0, {0, 0, 1})),
            (P{{{0, 0}}, {{0, 2}, {1, 0}}}));
  EXPECT_EQ(as_pairs(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, 0, {0, 1, 0})),
            (P{{{0, 0}, {2, 0}}, {{0, 2}}}));
  // Rank 1's experts 2 and 3 with rank 0 masked: (2,1) twice for expert 2 (listed twice), (1,0) for expert 3.
  EXPECT_EQ(as_pairs(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, 1, {1, 0, 0})),
            (P{{{2, 1}, {2, 1}}, {{1, 0}}}));
  // A rank that masked itself receives nothing.
  EXPECT_EQ(as_pairs(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, 1, {0, 1, 0})), (P{{}, {}}));
}

TEST(ShrinkReference, SlotsOnMaskedRanksBecomeMinusOne) {
  const int64_t idx[4] = {0, 3, 5, -1};
  int64_t out[4];
  epx::ref::mask_topk_slots(idx, 4, 6, {0, 1, 0}, 0, out);
  EXPECT_EQ(std::vector<int64_t>(out, out + 4), (std::vector<int64_t>{0, -1, 5, -1}));
  epx::ref::mask_topk_slots(idx, 4, 6, {0, 0, 1}, 1, out);
  EXPECT_EQ(std::vector<int64_t>(out, out + 4), (std::vector<int64_t>{0, 3, -1, -1}));
  epx::ref::mask_topk_slots(idx, 4, 6, {1, 0, 0}, 0, out);  // this rank masked itself: every slot
  EXPECT_EQ(std::vector<int64_t>(out, out + 4), (std::vector<int64_t>{-1, -1, -1, -1}));
  int64_t in_place[2] = {2, 7};  // 7 is out of range: stays as it is (the combine skips it anyway)
  epx::ref::mask_topk_slots(in_place, 2, 6, {0, 1, 0}, 2, in_place);
  EXPECT_EQ(std::vector<int64_t>(in_place, in_place + 2), (std::vector<int64_t>{-1, 7}));
}

TEST(ShrinkReference, CombineOfAMaskedTokenSkipsItsSlots) {
  // The combine model on masked slots equals the model with those slots set to -1 by hand.
  const int H = 8;
  std::vector<uint16_t> rows(6 * H);
  for (int i = 0; i < 6 * H; ++i) rows[i] = uint16_t(0x3f80 + 17 * i);  // bf16 values near 1
  auto row = [&](int64_t e) { return rows.data() + e * H; };
  const int64_t idx[3] = {1, 4, 2};
  const float w[3] = {0.5f, 0.25f, 2.0f};
  int64_t masked[3];
  epx::ref::mask_topk_slots(idx, 3, 6, {0, 0, 1}, 0, masked);  // expert 4 is on rank 2
  const int64_t by_hand[3] = {1, -1, 2};
  std::vector<uint16_t> a(H), b(H);
  epx::ref::low_latency_combine_row(H, masked, w, 3, 6, row, a.data());
  epx::ref::low_latency_combine_row(H, by_hand, w, 3, 6, row, b.data());
  EXPECT_EQ(a, b);
}

TEST(ShrinkReference, RejectsBadInput) {
  const Routing g;
  EXPECT_THROW(epx::ref::low_latency_left_out({0, 0}, 2), std::invalid_argument);
  EXPECT_THROW(epx::ref::low_latency_left_out({}, 0), std::invalid_argument);
  EXPECT_THROW(epx::ref::low_latency_rows_masked(g.sources(), 2, 6, 0, {0, 0}), std::invalid_argument);
  int64_t idx[1] = {0};
  EXPECT_THROW(epx::ref::mask_topk_slots(idx, 1, 5, {0, 0, 0}, 0, idx), std::invalid_argument);
  EXPECT_THROW(epx::ref::mask_topk_slots(idx, 1, 6, {0, 0, 0}, 3, idx), std::invalid_argument);
}

TEST(ShrinkCApi, MaskCallsWithoutABuffer) {
  int32_t out[8];
  EXPECT_EQ(epx_ll_update_mask(nullptr, 0, 1, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(epx_last_error()).find("buffer"), std::string::npos);
  EXPECT_EQ(epx_ll_query_mask(nullptr, out, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(epx_ll_clean_mask(nullptr, nullptr), EPX_ERR_INVALID_ARGUMENT);
}

TEST(ShrinkCApi, ZeroedOptionsLeaveShrinkOff) {
  const epx_buffer_options o{};
  EXPECT_EQ(o.enable_shrink, 0);
  EXPECT_EQ(o.shrink_timeout_s, 0.0);
  EXPECT_GE(epx_version(), 6);  // 0.6: enable_shrink, shrink_timeout_s and the three mask calls
  const epx::BufferOptions d = epx::default_buffer_options();
  EXPECT_EQ(d.enable_shrink, 0);
}

}  // namespace
