// Argument validation that needs no Buffer (also exercised by the CPU tests).
#include "runtime/validate.hpp"

#include <cstring>

#include "layout/ll_layout.hpp"
#include "runtime/errors.hpp"

namespace epx {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool overlaps(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x >= y ? x - y < b_bytes : y - x < a_bytes;  // no end address is formed: nothing wraps
}

int64_t row_bytes(epx_dtype dtype, int hidden) { return int64_t(hidden) * (dtype == EPX_FP8_E4M3 ? 1 : 2); }

namespace {

// The strides of FP8 scales (epx.h): what can be checked without knowing the allocation. Every word the kernels read,
// up to (T - 1) * token stride + (S - 1) * group stride, must have a byte offset an int64 holds.
void validate_scale_strides(const DispatchArgs& a, const char* op) {
  const int64_t st = a.x_scales_stride_token, sg = a.x_scales_stride_group;
  EPX_REQUIRE(st >= 0 && sg >= 0, op, ": x_scales strides must be >= 0 (elements), got x_scales_stride_token ", st,
              ", x_scales_stride_group ", sg);
  if ((st == 0 && sg == 0) || a.num_tokens == 0) return;  // row-major, or nothing is read
  EPX_REQUIRE(a.num_tokens == 1 || st >= 1, op, ": x_scales_stride_token must be >= 1 with ", a.num_tokens,
              " tokens, got 0 (0 and 0 mean row-major)");
  EPX_REQUIRE(a.num_scales == 1 || sg >= 1, op, ": x_scales_stride_group must be >= 1 with ", a.num_scales,
              " scales per token, got 0 (0 and 0 mean row-major)");
  constexpr int64_t kMaxWord = INT64_MAX / 4;
  const int64_t groups = a.num_scales - 1, tokens = a.num_tokens - 1;
  const bool fits =
      (groups == 0 || sg <= kMaxWord / groups) && (tokens == 0 || st <= (kMaxWord - groups * sg) / tokens);
  EPX_REQUIRE(fits, op, ": x_scales strides (", st, ", ", sg, ") address words beyond any allocation for ",
              a.num_tokens, " tokens of ", a.num_scales, " scales");
}

}  // namespace

void validate_dispatch_args(const DispatchArgs& a, int num_ranks, bool cached, const char* op) {
  // A C or Python caller may store any int in the dtype field, but C++ must not load an epx_dtype outside its
  // enumerators (undefined behaviour, which UBSan reports): the check reads the int.
  int dtype = 0;
  static_assert(sizeof(a.dtype) == sizeof(dtype));
  std::memcpy(&dtype, &a.dtype, sizeof dtype);
  EPX_REQUIRE(dtype == EPX_BF16 || dtype == EPX_FP8_E4M3, op, ": dtype must be EPX_BF16 or EPX_FP8_E4M3, got ", dtype);
  EPX_REQUIRE(a.num_tokens >= 0, op, ": num_tokens must be >= 0, got ", a.num_tokens);
  EPX_REQUIRE(a.hidden > 0 && a.hidden <= kMaxHidden, op, ": hidden must be in [1, ", kMaxHidden, "], got ", a.hidden);
  EPX_REQUIRE(row_bytes(a.dtype, a.hidden) % 16 == 0, op, ": a row of x must be a multiple of 16 bytes (hidden ",
              a.hidden, a.dtype == EPX_BF16 ? " bf16: hidden % 8 == 0" : " fp8: hidden % 16 == 0", ")");
  const bool has_tokens = a.num_tokens > 0;
  EPX_REQUIRE(!has_tokens || a.x != nullptr, op, ": x is null");
  EPX_REQUIRE(aligned16(a.x), op, ": x must be 16-byte aligned");
  if (a.dtype == EPX_FP8_E4M3) {
    EPX_REQUIRE(a.num_scales >= 1, op,
                ": FP8 dispatch needs x_scales with num_scales >= 1 (hidden / 128 = ", a.hidden / kFp8GroupSize,
                " for per-128 scales)");
    EPX_REQUIRE(!has_tokens || a.x_scales != nullptr, op, ": FP8 dispatch needs x_scales");
    EPX_REQUIRE((reinterpret_cast<uintptr_t>(a.x_scales) & 3u) == 0, op,
                ": x_scales must be 4-byte aligned (32-bit words)");
    validate_scale_strides(a, op);
  } else {
    EPX_REQUIRE(a.x_scales == nullptr && a.num_scales == 0, op, ": x_scales are only for FP8 x");
    EPX_REQUIRE(a.x_scales_stride_token == 0 && a.x_scales_stride_group == 0, op,
                ": x_scales_stride_token / x_scales_stride_group are only for FP8 x (BF16 takes 0)");
  }
  // Top-k presence is num_topk > 0 on every rank (it shapes the ring records, which all ranks must agree on);
  // a rank without tokens may pass null pointers.
  if (a.num_topk != 0) {
    EPX_REQUIRE(a.num_topk >= 1 && a.num_topk <= kMaxTopk, op, ": num_topk must be 0 (no top-k) or in [1, ", kMaxTopk,
                "], got ", a.num_topk);
    EPX_REQUIRE(!has_tokens || a.topk_idx != nullptr, op, ": num_topk = ", a.num_topk, " but topk_idx is null");
  } else {
    EPX_REQUIRE(a.topk_idx == nullptr && a.topk_weights == nullptr, op,
                ": topk_idx / topk_weights given with num_topk = 0");
  }
  if (a.num_topk != 0 || a.num_tokens_per_expert != nullptr) {
    EPX_REQUIRE(a.num_experts > 0 && a.num_experts % num_ranks == 0, op, ": num_experts (", a.num_experts,
                ") must be a positive multiple of the number of ranks (", num_ranks, ")");
    EPX_REQUIRE(a.num_experts / num_ranks <= kMaxLocalExperts, op, ": at most ", kMaxLocalExperts,
                " experts per rank, got ", a.num_experts / num_ranks);
  }
  EPX_REQUIRE(!has_tokens || a.is_token_in_rank != nullptr, op, ": is_token_in_rank is null");
  if (!cached) EPX_REQUIRE(a.num_tokens_per_rank != nullptr, op, ": num_tokens_per_rank is null");
  EPX_REQUIRE(a.expert_alignment >= 0, op, ": expert_alignment must be >= 1, got ", a.expert_alignment);
  EPX_REQUIRE(a.num_worst_tokens >= 0, op, ": num_worst_tokens must be >= 0, got ", a.num_worst_tokens);
}

DispatchRecord dispatch_record(const DispatchArgs& a) {
  return DispatchRecord::make(row_bytes(a.dtype, a.hidden), a.dtype == EPX_FP8_E4M3 ? a.num_scales : 0, a.num_topk);
}

void validate_combine_args(const CombineArgs& a, const CombineOutputs& o, int num_tokens, int num_recv_tokens,
                           const char* op) {
  validate_bf16_hidden(a.hidden, op);
  EPX_REQUIRE(a.num_rows >= 0, op, ": num_rows must be >= 0");
  EPX_REQUIRE(num_recv_tokens < 0 || a.num_rows >= num_recv_tokens, op, ": x has ", a.num_rows,
              " rows but the dispatch delivered ", num_recv_tokens);
  EPX_REQUIRE(a.num_rows == 0 || (a.x != nullptr && aligned16(a.x)), op,
              ": x must be a 16-byte aligned device pointer");
  // As in dispatch, num_topk > 0 (on every rank) says that weights are combined.
  if (a.num_topk != 0) {
    EPX_REQUIRE(a.num_topk >= 1 && a.num_topk <= kMaxTopk, op, ": num_topk must be 0 (no weights) or in [1, ", kMaxTopk,
                "], got ", a.num_topk);
    EPX_REQUIRE(a.num_rows == 0 || a.topk_weights != nullptr, op, ": num_topk = ", a.num_topk,
                " but topk_weights is null");
    EPX_REQUIRE(num_tokens == 0 || o.combined_topk_weights != nullptr, op, ": num_topk = ", a.num_topk,
                " but combined_topk_weights is null");
  } else {
    EPX_REQUIRE(a.topk_weights == nullptr && o.combined_topk_weights == nullptr, op,
                ": topk weights given with num_topk = 0");
  }
  EPX_REQUIRE(num_tokens == 0 || (o.combined_x != nullptr && aligned16(o.combined_x)), op,
              ": combined_x must be a 16-byte aligned device pointer");
  EPX_REQUIRE(!overlaps(a.x, uint64_t(a.num_rows) * a.hidden * 2, o.combined_x, uint64_t(num_tokens) * a.hidden * 2),
              op, ": combined_x must not overlap x (the combine reads x while it writes combined_x)");
  EPX_REQUIRE(aligned16(a.bias0) && aligned16(a.bias1), op, ": biases must be 16-byte aligned");
}

void validate_num_ranks(int num_ranks, const char* op, const char* what) {
  EPX_REQUIRE(num_ranks >= 1 && num_ranks <= kMaxRanks, op, ": ", what, " must be in [1, ", kMaxRanks,
              "] (a Buffer spans at most ", kMaxDomains, " NVLink domains of ", kMaxNvlRanks, " ranks), got ",
              num_ranks);
}

void validate_bf16_hidden(int64_t hidden, const char* op, const char* what) {
  EPX_REQUIRE(hidden > 0 && hidden <= kMaxHidden && hidden % 8 == 0, op, ": ", what, " must be a multiple of 8 in [8, ",
              kMaxHidden, "] (bf16 rows of 16-byte vectors), got ", hidden);
}

void validate_low_latency_shape(int num_ranks, int max_tokens, int hidden, int num_experts, const char* op) {
  EPX_REQUIRE(num_ranks >= 1 && num_ranks <= kLowLatencyMaxRanks, op, ": the low-latency mode runs on 1..",
              kLowLatencyMaxRanks, " ranks of one NVLink domain, got num_ranks = ", num_ranks);
  EPX_REQUIRE(max_tokens >= 1 && max_tokens <= kLowLatencyMaxTokens, op,
              ": num_max_dispatch_tokens_per_rank must be in [1, ", kLowLatencyMaxTokens, "], got ", max_tokens);
  validate_bf16_hidden(hidden, op);
  EPX_REQUIRE(num_experts > 0 && num_experts % num_ranks == 0 && num_experts <= kLowLatencyMaxExperts, op,
              ": num_experts (", num_experts, ") must be a positive multiple of the number of ranks (", num_ranks,
              ") and <= ", kLowLatencyMaxExperts);
}

}  // namespace epx
