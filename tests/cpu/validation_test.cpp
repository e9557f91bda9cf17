// Argument validation of dispatch and combine (semantics.md section 7). These checks run before anything touches a
// device, and never dereference pointers, so fake non-null pointer values are enough: each test starts from a
// valid baseline and introduces exactly one defect, which must be reported as kInvalidArgument by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "epx/epx.hpp"
#include "layout/limits.hpp"
#include "layout/scales.hpp"
#include "runtime/ops.hpp"
#include "runtime/validate.hpp"

using ::testing::HasSubstr;

namespace {

constexpr int kRanks = 4;
constexpr const char* kOp = "test_op";

template <typename T = void>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

std::string invalid_argument_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.status(), epx::Status::kInvalidArgument) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(kOp)) << "the message should name the operation";
    return e.what();
  }
  ADD_FAILURE() << "expected epx::Error(kInvalidArgument), nothing was thrown";
  return "";
}

// BF16 dispatch of 8 tokens, hidden 4096, top-8 of 32 experts over 4 ranks.
epx::DispatchArgs bf16_args() {
  epx::DispatchArgs a{};
  a.x = fake(0x1000);
  a.dtype = EPX_BF16;
  a.num_tokens = 8;
  a.hidden = 4096;
  a.topk_idx = fake<const int64_t>(0x2000);
  a.topk_weights = fake<const float>(0x3000);
  a.num_topk = 8;
  a.num_experts = 32;
  a.num_tokens_per_rank = fake<const int>(0x4000);
  a.num_tokens_per_expert = fake<const int>(0x5000);
  a.is_token_in_rank = fake<const uint8_t>(0x6000);
  a.expert_alignment = 1;
  return a;
}

// FP8 dispatch: hidden 7168 with per-128 scales.
epx::DispatchArgs fp8_args() {
  epx::DispatchArgs a = bf16_args();
  a.dtype = EPX_FP8_E4M3;
  a.hidden = 7168;
  a.x_scales = fake<const float>(0x7000);
  a.num_scales = 7168 / 128;
  return a;
}

std::string dispatch_error(const epx::DispatchArgs& a, bool cached = false) {
  return invalid_argument_message([&] { epx::validate_dispatch_args(a, kRanks, cached, kOp); });
}

}  // namespace

TEST(DispatchValidation, BaselinesPass) {
  EXPECT_NO_THROW(epx::validate_dispatch_args(bf16_args(), kRanks, false, kOp));
  EXPECT_NO_THROW(epx::validate_dispatch_args(fp8_args(), kRanks, false, kOp));
  epx::DispatchArgs a = bf16_args();
  a.num_topk = 0;  // routing without top-k metadata is allowed: num_topk 0 says so
  a.topk_idx = nullptr;
  a.topk_weights = nullptr;
  a.num_tokens_per_expert = nullptr;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a = bf16_args();
  a.topk_weights = nullptr;  // weights are optional with top-k (zeros are sent)
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a = bf16_args();
  a.expert_alignment = 0;  // taken as 1
  a.num_worst_tokens = 64;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
}

TEST(DispatchValidation, ZeroTokensNeedNoData) {
  epx::DispatchArgs a = fp8_args();
  a.num_tokens = 0;
  a.x = nullptr;
  a.x_scales = nullptr;
  a.is_token_in_rank = nullptr;
  a.topk_idx = nullptr;  // num_topk stays 8: it must agree across ranks, the pointers of an empty rank need not
  a.topk_weights = nullptr;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
}

TEST(DispatchValidation, DtypeAndSizes) {
  epx::DispatchArgs a = bf16_args();
  a.dtype = static_cast<epx_dtype>(7);
  EXPECT_THAT(dispatch_error(a), HasSubstr("dtype"));
  a = bf16_args();
  a.num_tokens = -1;
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_tokens"));
  for (int hidden : {0, -8, epx::kMaxHidden + 8}) {
    a = bf16_args();
    a.hidden = hidden;
    EXPECT_THAT(dispatch_error(a), HasSubstr("hidden")) << hidden;
  }
}

TEST(DispatchValidation, RowsMustBeWholeSixteenByteVectors) {
  epx::DispatchArgs a = bf16_args();
  a.hidden = 4100;  // 8200 bytes
  EXPECT_THAT(dispatch_error(a), HasSubstr("multiple of 16 bytes"));
  // 7176 is a multiple of 8 but not of 16: a valid bf16 row (14352 bytes), an invalid fp8 row (7176 bytes).
  a = bf16_args();
  a.hidden = 7176;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a = fp8_args();
  a.hidden = 7176;
  EXPECT_THAT(dispatch_error(a), HasSubstr("multiple of 16 bytes"));
}

TEST(DispatchValidation, XPointer) {
  epx::DispatchArgs a = bf16_args();
  a.x = nullptr;
  EXPECT_THAT(dispatch_error(a), HasSubstr("x is null"));
  for (uintptr_t p : {0x1001, 0x1004, 0x1008}) {
    a = bf16_args();
    a.x = fake(p);
    EXPECT_THAT(dispatch_error(a), HasSubstr("16-byte aligned")) << std::hex << p;
  }
}

TEST(DispatchValidation, ScalesOnlyWithFp8) {
  epx::DispatchArgs a = fp8_args();
  a.num_scales = 0;
  EXPECT_THAT(dispatch_error(a), HasSubstr("x_scales"));
  a = fp8_args();
  a.x_scales = nullptr;
  EXPECT_THAT(dispatch_error(a), HasSubstr("x_scales"));
  a = bf16_args();
  a.x_scales = fake<const float>(0x7000);
  a.num_scales = 32;
  EXPECT_THAT(dispatch_error(a), HasSubstr("only for FP8"));
  a = bf16_args();
  a.num_scales = 32;  // a count without data is just as wrong
  EXPECT_THAT(dispatch_error(a), HasSubstr("only for FP8"));
}

// FP8 scales at any element strides (epx.h): 0 and 0 mean row-major; the kernels read them in place through ScaleView.
TEST(DispatchValidation, ScaleStrides) {
  epx::DispatchArgs a = fp8_args();  // 8 tokens of 56 scales
  const int T = a.num_tokens, S = a.num_scales;
  for (auto [st, sg] : {std::pair<int64_t, int64_t>{S, 1},  // row-major, given explicitly
                        {1, T},                             // column-major: s.T.contiguous().T
                        {2 * S + 3, 2},                     // padded
                        {1, 1}}) {                          // overlapping words: only read, so allowed
    a.x_scales_stride_token = st;
    a.x_scales_stride_group = sg;
    EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp)) << st << ", " << sg;
    EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, true, kOp)) << "cached " << st << ", " << sg;
  }
  for (auto [st, sg] : {std::pair<int64_t, int64_t>{-1, 1}, {S, -1}, {INT64_MIN, 0}}) {
    a = fp8_args();
    a.x_scales_stride_token = st;
    a.x_scales_stride_group = sg;
    EXPECT_THAT(dispatch_error(a), HasSubstr(">= 0")) << st << ", " << sg;
  }
  a = fp8_args();
  a.x_scales_stride_group = 1;  // token stride 0 with 8 tokens: every token would read the same scales
  EXPECT_THAT(dispatch_error(a), HasSubstr("x_scales_stride_token must be >= 1"));
  a = fp8_args();
  a.x_scales_stride_token = 1;  // group stride 0 with 56 scales
  EXPECT_THAT(dispatch_error(a), HasSubstr("x_scales_stride_group must be >= 1"));
  a = fp8_args();
  a.x_scales_stride_token = INT64_MAX / 8;  // (T - 1) * stride words overflow any byte offset
  a.x_scales_stride_group = 1;
  EXPECT_THAT(dispatch_error(a), HasSubstr("beyond any allocation"));
  a = fp8_args();
  a.x_scales_stride_token = 1;
  a.x_scales_stride_group = INT64_MAX / 64;
  EXPECT_THAT(dispatch_error(a), HasSubstr("beyond any allocation"));

  // Strides that address nothing more are not needed: one token, one scale, no tokens.
  a = fp8_args();
  a.num_tokens = 1;
  a.x_scales_stride_group = 1;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a = fp8_args();
  a.num_scales = 1;
  a.x_scales_stride_token = 1;
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a = fp8_args();
  a.num_tokens = 0;
  a.x_scales = nullptr;
  a.x_scales_stride_token = 1;  // column-major of an empty tensor: (1, 0)
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));

  // Scales are 32-bit words: 4-byte aligned at any strides.
  for (uintptr_t p : {0x7001, 0x7002, 0x7003}) {
    a = fp8_args();
    a.x_scales = fake<const float>(p);
    EXPECT_THAT(dispatch_error(a), HasSubstr("4-byte aligned")) << std::hex << p;
  }
  a = fp8_args();
  a.x_scales = fake<const float>(0x7004);  // a column of a [T, S] tensor starts at any word
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));

  // Strides without FP8 scales are a mistake, as scales are.
  a = bf16_args();
  a.x_scales_stride_token = 1;
  EXPECT_THAT(dispatch_error(a), HasSubstr("only for FP8"));
}

TEST(ScaleView, AddressesEveryLayout) {
  const float* base = fake<const float>(0x10000);
  const int32_t* words = reinterpret_cast<const int32_t*>(base);
  const int T = 5, S = 3;
  // Row-major by default (0, 0), as callers that predate the strides pass.
  epx::ScaleView v = epx::ScaleView::of(base, S, 0, 0);
  EXPECT_EQ(v.token(2).at(1), words + 2 * S + 1);
  v = epx::ScaleView::of(base, S, 1, T);  // column-major
  EXPECT_EQ(v.token(2).at(1), words + 2 + 1 * T);
  v = epx::ScaleView::of(base, S, 2 * S + 3, 2);  // padded
  EXPECT_EQ(v.token(4).at(2), words + 4 * (2 * S + 3) + 2 * 2);
  EXPECT_EQ(v.token(0).at(0), words);
}

TEST(DispatchValidation, TopkMetadata) {
  epx::DispatchArgs a = bf16_args();
  a.topk_idx = nullptr;  // num_topk 8 with tokens: the ids are needed
  EXPECT_THAT(dispatch_error(a), HasSubstr("topk_idx is null"));
  a.topk_weights = nullptr;
  EXPECT_THAT(dispatch_error(a), HasSubstr("topk_idx is null"));
  a = bf16_args();
  a.num_topk = 0;  // ids or weights with "no top-k" are contradictory
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_topk = 0"));
  a.topk_idx = nullptr;  // weights without ids
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_topk = 0"));
  for (int experts : {30, 0, -4}) {
    a = bf16_args();
    a.num_experts = experts;
    EXPECT_THAT(dispatch_error(a), HasSubstr("num_experts")) << experts;
  }
  a = bf16_args();
  a.num_experts = kRanks * epx::kMaxLocalExperts;  // the largest accepted
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp));
  a.num_experts = kRanks * (epx::kMaxLocalExperts + 1);
  EXPECT_THAT(dispatch_error(a), HasSubstr("experts per rank"));
  // Per-expert counts alone also need a valid expert count.
  a = bf16_args();
  a.num_topk = 0;
  a.topk_idx = nullptr;
  a.topk_weights = nullptr;
  a.num_experts = 6;
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_experts"));
  for (int k : {-1, epx::kMaxTopk + 1}) {
    a = bf16_args();
    a.num_topk = k;
    EXPECT_THAT(dispatch_error(a), HasSubstr("num_topk")) << k;
  }
  for (int k : {1, epx::kMaxTopk}) {
    a = bf16_args();
    a.num_topk = k;
    EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, false, kOp)) << k;
  }
}

TEST(DispatchValidation, LayoutInputs) {
  epx::DispatchArgs a = bf16_args();
  a.is_token_in_rank = nullptr;
  EXPECT_THAT(dispatch_error(a), HasSubstr("is_token_in_rank"));
  a = bf16_args();
  a.num_tokens_per_rank = nullptr;
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_tokens_per_rank"));
  // Cached dispatch reuses the handle's counts, so it does not need them.
  EXPECT_NO_THROW(epx::validate_dispatch_args(a, kRanks, /*cached=*/true, kOp));
  a.is_token_in_rank = nullptr;  // but it still needs the routing
  EXPECT_THAT(dispatch_error(a, /*cached=*/true), HasSubstr("is_token_in_rank"));
}

TEST(DispatchValidation, NegativeAlignmentAndWorstTokens) {
  epx::DispatchArgs a = bf16_args();
  a.expert_alignment = -1;
  EXPECT_THAT(dispatch_error(a), HasSubstr("expert_alignment"));
  a = bf16_args();
  a.num_worst_tokens = -1;
  EXPECT_THAT(dispatch_error(a), HasSubstr("num_worst_tokens"));
}

// ---- combine -------------------------------------------------------------------------------------------------------

namespace {

constexpr int kTokens = 6, kRecv = 10;

struct CombineCase {
  epx::CombineArgs a{};
  epx::CombineOutputs o{};
  int num_tokens = kTokens;
  int num_recv_tokens = kRecv;
  static constexpr uintptr_t kX = 0x100000, kOut = 0x500000;  // 1 MiB apart: no two arrays share a byte
  CombineCase() {
    a.x = fake(kX);
    a.num_rows = kRecv;
    a.hidden = 4096;
    a.topk_weights = fake<const float>(0x200000);
    a.num_topk = 8;
    a.bias0 = fake(0x300000);
    a.bias1 = fake(0x400000);
    o.combined_x = fake(kOut);
    o.combined_topk_weights = fake<float>(0x600000);
  }
  void validate() const { epx::validate_combine_args(a, o, num_tokens, num_recv_tokens, kOp); }
  std::string error() const {
    return invalid_argument_message([&] { validate(); });
  }
};

}  // namespace

TEST(CombineValidation, BaselinesPass) {
  EXPECT_NO_THROW(CombineCase().validate());
  CombineCase c;
  c.a.num_topk = 0;  // no weights, no biases
  c.a.topk_weights = nullptr;
  c.o.combined_topk_weights = nullptr;
  c.a.bias0 = c.a.bias1 = nullptr;
  EXPECT_NO_THROW(c.validate());
  c = CombineCase();
  c.a.num_rows = kRecv + 5;  // more rows than delivered (worst-case outputs) is fine
  EXPECT_NO_THROW(c.validate());
  c = CombineCase();
  c.num_recv_tokens = -1;  // not known on the host (worst-case mode): any row count
  c.a.num_rows = 1;
  EXPECT_NO_THROW(c.validate());
  c = CombineCase();
  c.num_tokens = 0;  // nothing comes back to this rank: no outputs needed (num_topk still agrees across ranks)
  c.o.combined_x = nullptr;
  c.o.combined_topk_weights = nullptr;
  EXPECT_NO_THROW(c.validate());
  c = CombineCase();
  c.num_recv_tokens = 0;  // nothing was delivered to this rank: no x needed
  c.a.num_rows = 0;
  c.a.x = nullptr;
  c.a.topk_weights = nullptr;
  EXPECT_NO_THROW(c.validate());
}

TEST(CombineValidation, Hidden) {
  for (int hidden : {0, 4, 4100, epx::kMaxHidden + 8}) {
    CombineCase c;
    c.a.hidden = hidden;
    EXPECT_THAT(c.error(), HasSubstr("hidden")) << hidden;
  }
}

TEST(CombineValidation, Rows) {
  CombineCase c;
  c.a.num_rows = kRecv - 1;
  EXPECT_THAT(c.error(), HasSubstr("rows"));
  c.a.num_rows = -1;
  EXPECT_THAT(c.error(), HasSubstr("num_rows"));
}

TEST(CombineValidation, MisalignedOrMissingPointers) {
  CombineCase c;
  c.a.x = fake(0x1001);
  EXPECT_THAT(c.error(), HasSubstr("x must be a 16-byte aligned"));
  c.a.x = nullptr;
  EXPECT_THAT(c.error(), HasSubstr("x must be a 16-byte aligned"));
  c = CombineCase();
  c.o.combined_x = fake(0x5008);
  EXPECT_THAT(c.error(), HasSubstr("combined_x"));
  c.o.combined_x = nullptr;
  EXPECT_THAT(c.error(), HasSubstr("combined_x"));
  c = CombineCase();
  c.a.bias0 = fake(0x3002);
  EXPECT_THAT(c.error(), HasSubstr("biases"));
  c = CombineCase();
  c.a.bias1 = fake(0x400c);
  EXPECT_THAT(c.error(), HasSubstr("biases"));
}

// The combine reads x while it writes combined_x: the two may not share a byte (adjacent is fine).
TEST(CombineValidation, OutputMustNotOverlapInput) {
  constexpr uintptr_t x_bytes = uintptr_t(kRecv) * 4096 * 2, out_bytes = uintptr_t(kTokens) * 4096 * 2;
  CombineCase c;
  c.o.combined_x = fake(CombineCase::kX);
  EXPECT_THAT(c.error(), HasSubstr("combined_x must not overlap x"));
  c.o.combined_x = fake(CombineCase::kX + x_bytes - 16);  // its first row over x's last 16 bytes
  EXPECT_THAT(c.error(), HasSubstr("must not overlap"));
  c.o.combined_x = fake(CombineCase::kX - out_bytes + 16);  // its last 16 bytes over x's first
  EXPECT_THAT(c.error(), HasSubstr("must not overlap"));
  c.o.combined_x = fake(CombineCase::kX + x_bytes);  // right after x
  EXPECT_NO_THROW(c.validate());
  c.o.combined_x = fake(CombineCase::kX - out_bytes);  // right before x
  EXPECT_NO_THROW(c.validate());
}

TEST(Overlap, Ranges) {
  EXPECT_TRUE(epx::overlaps(fake(0x1000), 16, fake(0x1000), 16));
  EXPECT_TRUE(epx::overlaps(fake(0x1000), 32, fake(0x1010), 16));
  EXPECT_TRUE(epx::overlaps(fake(0x1010), 16, fake(0x1000), 32));
  EXPECT_TRUE(epx::overlaps(fake(0x1000), 64, fake(0x1010), 16));   // one inside the other
  EXPECT_FALSE(epx::overlaps(fake(0x1000), 16, fake(0x1010), 16));  // adjacent
  EXPECT_FALSE(epx::overlaps(fake(0x1010), 16, fake(0x1000), 16));
  EXPECT_FALSE(epx::overlaps(nullptr, 64, fake(0x10), 16));  // null and empty ranges hold no byte
  EXPECT_FALSE(epx::overlaps(fake(0x1000), 0, fake(0x1000), 16));
  // At the top of the address space: no end address is formed, so nothing wraps.
  EXPECT_TRUE(epx::overlaps(fake(UINTPTR_MAX - 15), 16, fake(UINTPTR_MAX - 31), 32));
  EXPECT_FALSE(epx::overlaps(fake(UINTPTR_MAX - 15), UINT64_MAX, fake(0x10), 16));
  EXPECT_TRUE(epx::overlaps(fake(0x10), UINT64_MAX, fake(UINTPTR_MAX - 15), 16));
}

// The dispatch reads x while it writes recv_x.
TEST(DispatchValidation, RecvXMustNotOverlapX) {
  const epx::DispatchArgs a = bf16_args();  // 8 tokens x 4096 bf16 at 0x1000: 64 KiB
  epx::DispatchOutputs o{};
  o.num_rows = 12;
  o.recv_x = fake(0x1000 + 8 * 4096 * 2 - 16);
  const int src[1] = {0};
  const auto check = [&] { epx::check_dispatch_outputs(a, o, 12, src, ": no source rows", kOp); };
  EXPECT_THAT(invalid_argument_message(check), HasSubstr("recv_x must not overlap x"));
  o.recv_x = fake(0x1000 + 8 * 4096 * 2);  // right after x
  EXPECT_NO_THROW(check());
}

// num_topk > 0 (the same on every rank) says weights are combined: then both the input weights and the
// combined output are needed; with num_topk 0 neither may be given.
TEST(CombineValidation, CombinedWeightsExactlyWithWeights) {
  CombineCase c;
  c.o.combined_topk_weights = nullptr;
  EXPECT_THAT(c.error(), HasSubstr("combined_topk_weights is null"));
  c = CombineCase();
  c.a.topk_weights = nullptr;
  EXPECT_THAT(c.error(), HasSubstr("topk_weights is null"));
  c = CombineCase();
  c.a.num_topk = 0;
  EXPECT_THAT(c.error(), HasSubstr("num_topk = 0"));
  c.a.topk_weights = nullptr;  // the output alone is just as contradictory
  EXPECT_THAT(c.error(), HasSubstr("num_topk = 0"));
  for (int k : {-1, epx::kMaxTopk + 1}) {
    c = CombineCase();
    c.a.num_topk = k;
    EXPECT_THAT(c.error(), HasSubstr("num_topk")) << k;
  }
}
