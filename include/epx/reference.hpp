// The CPU reference model: docs/semantics.md as code. Every GPU test compares against it.
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
uint8_t float_to_e4m3(float value);  // round to nearest even, saturating to +-448 (NaN -> 0x7f)

// ---- semantics.md section 1: layout
// -----------------------------------------------------------------------------------
struct Layout {
  std::vector<int> num_tokens_per_rank;       // [R]
  std::vector<int> num_tokens_per_rdma_rank;  // [R / G], empty when num_nvl_ranks is 0 or R
  std::vector<int> num_tokens_per_expert;     // [E] (a slot counts once; duplicates count per slot)
  std::vector<uint8_t> is_token_in_rank;      // [T, R]
};
// Throws std::invalid_argument naming the first slot outside [-1, E).
Layout dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                       int num_nvl_ranks = 0);

// ---- semantics.md section 2: normal dispatch
// --------------------------------------------------------------------------- What the model needs from one source
// rank.
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

// ---- semantics.md section 3: normal combine
// ----------------------------------------------------------------------------- Row of token `token` of rank `rank` as
// it comes back from rank j: bf16 [hidden], and top-k weights [K] (or null).
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

// ---- semantics.md section 6: internode (hierarchical) mode
// ---------------------------------------------------------------- R = D x G ranks: rank r = d * G + g (domain d, local
// index g). The dispatch splits every rank's tokens into C channels: token t of a rank with T tokens is in channel t /
// ceil(T / C) (channel_of). A token "needs" domain m when it goes to at least one rank of m. Sources are indexed by
// global rank; sources[s].is_token_in_rank is [T_s, R]. Positions below are per (source rank, channel, stream) and
// start at 0 in every operation; a token that is not in a stream gets -(k) - 1, where k is the position the stream's
// next token would take (the number of the channel's tokens before it that are in the stream).

int channel_of(int num_tokens, int num_channels, int token);

// Mask of the GPUs of domain m (bit j: rank m * G + j) that token t of `src` goes to.
uint32_t domain_mask(const Source& src, int num_ranks, int num_nvl_ranks, int token, int domain);

// The internode handle of rank `rank` after a dispatch (deep_ep's element numbers in brackets).
struct InternodeHandle {
  std::vector<int> rdma_channel_prefix_matrix;       // [D, C] [1] this rank's tokens in channels <= c that need
                                                     //     domain m (inclusive over channels)
  std::vector<int> gbl_channel_prefix_matrix;        // [R, C] [2] this rank's tokens in channels <= c that go to
                                                     //     rank j (inclusive)
  std::vector<int> recv_rdma_channel_prefix_matrix;  // [D, C] [3] tokens of rank (m, g) in channels <= c that need
                                                     //     this rank's domain d (inclusive): records arriving in
                                                     //     this rank's network ring from domain m
  std::vector<int> recv_rdma_rank_prefix_sum;        // [D] [4] inclusive prefix over m of [3][m][C - 1]
  std::vector<int> recv_gbl_channel_prefix_matrix;   // [R, C] [5] first recv_x row of source s, channel c
                                                     //     (exclusive start, as the intranode handle's)
  std::vector<int> recv_gbl_rank_prefix_sum;         // [R] [6] inclusive prefix of the rows from sources <= s
  std::vector<int32_t> recv_src_meta;                // [N, 2] [7] per recv_x row: source domain, and the mask of
                                                     //     this domain's GPUs that receive the token (bit j:
                                                     //     rank d * G + j)
  std::vector<int> send_rdma_head;                   // [T, D] [8] token t's position in its channel's stream to
                                                     //     domain m (tokens of that channel that need m), or -k-1
  std::vector<int> send_nvl_head;                    // [N_rdma, G] [9] for every record this rank's network ring
                                                     //     receives, in the "network-received" order (source
                                                     //     domain m ascending, channel ascending, token
                                                     //     ascending; index [4][m - 1] + [3][m][c - 1] + ordinal):
                                                     //     the token's position among the tokens of source
                                                     //     (m, g), channel c, that go to rank d * G + j, or -k-1
};
// Everything rank `rank` holds after an internode dispatch of `sources` (all R of them) with num_channels channels.
InternodeHandle internode_handle(const std::vector<Source>& sources, int rank, int num_nvl_ranks, int num_channels);

// Combine in the two-level order of semantics.md section 6 (the internode default), for the tokens of `own`:
// for every domain m (ascending) with at least one rank that received token t, the partial P_m is the row of
// that rank when only one rank of m has the token, else bf16(sum over those ranks j ascending of float(row_j)),
// float32 from 0, one rounding; combined_x[t] = bf16(sum over m ascending of float(P_m) + bias0 + bias1), float32
// from 0, one rounding. combined_topk_weights are the flat combine's (summed over ranks in ascending global order).
// The flat order is combine() above.
Combined combine_two_level(const Source& own, int num_ranks, int num_nvl_ranks, int hidden, int num_topk,
                           const ContributionRow& row, const ContributionWeights& weights, const uint16_t* bias0,
                           const uint16_t* bias1);

// ---- semantics.md section 4: low-latency dispatch
// --------------------------------------------------------------------- FP8 quantization of one BF16 row, per
// 128-element group g:
//   amax = max(max |x|, 1e-4); scale = amax / 448 (one float32 division); round_scale: the scale rounded up to
//   a power of two (exponent bits); q = e4m3(x / scale), round to nearest even, saturating.
void quantize_fp8_row(const uint16_t* x, int hidden, bool round_scale, uint8_t* q, float* scales);
// The UE8M0 byte of a power-of-two scale (its biased exponent).
uint8_t ue8m0(float pow2_scale);

// Rows local expert i of `rank` receives: source rank ascending, then each source's (token, slot) order
// (a token that lists the expert twice arrives twice). sources[s] needs num_tokens and topk_idx.
std::vector<std::vector<RecvRow>> low_latency_rows(const std::vector<Source>& sources, int num_topk, int num_experts,
                                                   int rank);

// ---- semantics.md section 5: low-latency combine
// ---------------------------------------------------------------------- out = bf16(sum over k ascending with 0 <=
// idx[k] < E of w[k] * float(row(idx[k]))), each product rounded to float32, then added in float32 (no fused
// multiply-add); one rounding to bf16.
using ExpertRow = std::function<const uint16_t*(int64_t expert)>;
void low_latency_combine_row(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                             const ExpertRow& row, uint16_t* out);
// The rank-reduced order (EPX_REDUCE_RANK): for every rank r (experts r*E/R .. (r+1)*E/R - 1) holding one of the
// token's experts, partial_r = bf16(sum over k ascending with idx[k] on r of w[k] * float(row(idx[k]))), each
// product rounded to float32, added in float32 from 0, one rounding; out = bf16(sum over r ascending of
// float(partial_r)), float32 from 0, one rounding. num_experts % num_ranks == 0.
void low_latency_combine_row_rank_reduced(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                                          int num_ranks, const ExpertRow& row, uint16_t* out);

// ---- semantics.md section 9: rank masking (enable_shrink)
// ---------------------------------------------------------------- mask[r] nonzero: rank r is masked in the view of
// `rank` (each rank has its own mask). A rank whose own entry is set leaves every rank out (it takes no part).
// Which ranks the low-latency calls of `rank` leave out (mask has one entry per rank).
std::vector<bool> low_latency_left_out(const std::vector<int32_t>& mask, int rank);
// low_latency_rows under a mask: no rows from ranks left out (none at all when `rank` itself is masked).
std::vector<std::vector<RecvRow>> low_latency_rows_masked(const std::vector<Source>& sources, int num_topk,
                                                          int num_experts, int rank, const std::vector<int32_t>& mask);
// A token's topk_idx as the combine of `rank` sees it under a mask: slots whose expert is on a rank left out become
// -1 (the combine then computes low_latency_combine_row on them); out may be idx.
void mask_topk_slots(const int64_t* idx, int num_topk, int num_experts, const std::vector<int32_t>& mask, int rank,
                     int64_t* out);

// ---- semantics.md section 9: the LogFMT combine (use_logfmt; docs/logfmt.md)
// ------------------------------------------- The encoding rules are src/layout/logfmt.hpp's, which the kernels use
// too. hidden % 128 == 0. Bytes of one encoded row.
int64_t logfmt_row_bytes(int hidden);
// Encodes a BF16 row into logfmt_row_bytes(hidden) bytes (header slots past the last group are zero).
void logfmt_encode_row(const uint16_t* x, int hidden, uint8_t* out);
// Decodes an encoded row into float32 values.
void logfmt_decode_row(const uint8_t* in, int hidden, float* out);
// low_latency_combine_row with every expert row encoded and decoded first (also the rows of experts on the
// token's own rank): out = bf16(sum over k ascending with 0 <= idx[k] < E of w[k] * decoded(row(idx[k]))), each
// product rounded to float32, then added in float32; one rounding to bf16.
void low_latency_combine_row_logfmt(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                                    const ExpertRow& row, uint16_t* out);

}  // namespace epx::ref
