// The CPU reference model: SPEC.md as code. Every GPU test compares against it.
//
// The model works on routing (who receives which token, in which order, with which metadata) and on
// arithmetic (how rows are reduced). Row payloads are reached through accessors, so a test can generate
// each source's data on the fly instead of materialising every rank's tensors on every rank.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

namespace epx::ref {

// ---- numerics -------------------------------------------------------------------------------------------------
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);  // round to nearest even (NaN -> canonical quiet NaN)
float e4m3_to_float(uint8_t bits);
uint8_t float_to_e4m3(float value);   // round to nearest even, saturating to +-448 (NaN -> 0x7f)

// ---- SPEC section 1: layout -----------------------------------------------------------------------------------
struct Layout {
  std::vector<int> num_tokens_per_rank;       // [R]
  std::vector<int> num_tokens_per_rdma_rank;  // [R / G], empty when num_nvl_ranks is 0 or R
  std::vector<int> num_tokens_per_expert;     // [E] (a slot counts once; duplicates count per slot)
  std::vector<uint8_t> is_token_in_rank;      // [T, R]
};
// Throws std::invalid_argument naming the first slot outside [-1, E).
Layout dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                       int num_nvl_ranks = 0);

// ---- SPEC section 2: normal dispatch ---------------------------------------------------------------------------
// What the model needs from one source rank.
struct Source {
  int num_tokens = 0;
  const uint8_t* is_token_in_rank = nullptr;  // [T, R]
  const int64_t* topk_idx = nullptr;          // [T, K] or null
  const float* topk_weights = nullptr;        // [T, K] or null
};

struct RecvRow {
  int src_rank;
  int src_token;
};

// rank_prefix_matrix [R, R]: [i][j] = tokens ranks 0..i send to rank j.
std::vector<int> rank_prefix_matrix(const std::vector<Source>& sources);
// Rows rank `rank` receives, in recv order: source ascending, then token ascending.
std::vector<RecvRow> recv_rows(const std::vector<Source>& sources, int rank);

struct RecvMeta {
  std::vector<int> recv_src_idx;                // [N]
  std::vector<int64_t> recv_topk_idx;           // [N, K] local expert ids or -1 (empty without top-k)
  std::vector<float> recv_topk_weights;         // [N, K] (empty without weights)
  std::vector<int> num_recv_tokens_per_expert;  // [L], rounded up to expert_alignment (empty without top-k)
};
// Everything except the row payloads (which are copies of the source rows, bit for bit). with_topk /
// with_weights say whether dispatch was given topk_idx / topk_weights (a source with no tokens may have null
// pointers, so they are not inferred).
RecvMeta dispatch_meta(const std::vector<Source>& sources, int rank, int num_topk, int num_experts,
                       int expert_alignment, bool with_topk, bool with_weights);

// ---- SPEC section 3: normal combine -----------------------------------------------------------------------------
// Row of token `token` of rank `rank` as it comes back from rank j: bf16 [hidden], and top-k weights [K] (or null).
using ContributionRow = std::function<const uint16_t*(int j, int token)>;
using ContributionWeights = std::function<const float*(int j, int token)>;

struct Combined {
  std::vector<uint16_t> x;     // [T, hidden] bf16
  std::vector<float> weights;  // [T, K] (empty without weights)
};
// combined[t] = bf16(sum over receiving ranks j ascending of float(row_j) + bias0 + bias1), float32, one rounding.
Combined combine(const Source& own, int num_ranks, int hidden, int num_topk, const ContributionRow& row,
                 const ContributionWeights& weights, const uint16_t* bias0, const uint16_t* bias1);

// The reduction of one row (exposed for the low-latency model and tests).
void reduce_bf16_rows(int hidden, const std::vector<const uint16_t*>& rows, const uint16_t* bias0,
                      const uint16_t* bias1, uint16_t* out);

// ---- SPEC section 4: low-latency dispatch ---------------------------------------------------------------------
// FP8 quantization of one BF16 row, per 128-element group g:
//   amax = max(max |x|, 1e-4); scale = amax / 448 (one float32 division); round_scale: the scale rounded up to
//   a power of two (exponent bits); q = e4m3(x / scale), round to nearest even, saturating.
void quantize_fp8_row(const uint16_t* x, int hidden, bool round_scale, uint8_t* q, float* scales);
// The UE8M0 byte of a power-of-two scale (its biased exponent).
uint8_t ue8m0(float pow2_scale);

// Rows local expert i of `rank` receives: source rank ascending, then each source's (token, slot) order
// (a token that lists the expert twice arrives twice). sources[s] needs num_tokens and topk_idx.
std::vector<std::vector<RecvRow>> low_latency_rows(const std::vector<Source>& sources, int num_topk, int num_experts,
                                                   int rank);

// ---- SPEC section 5: low-latency combine ----------------------------------------------------------------------
// out = bf16(sum over k ascending with 0 <= idx[k] < E of w[k] * float(row(idx[k]))), each product rounded to
// float32, then added in float32 (no fused multiply-add); one rounding to bf16.
using ExpertRow = std::function<const uint16_t*(int64_t expert)>;
void low_latency_combine_row(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                             const ExpertRow& row, uint16_t* out);

}  // namespace epx::ref
