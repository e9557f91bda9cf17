// Deterministic test data: every value is a hash of (seed, rank, token, position), so any rank can regenerate
// any other rank's inputs and expected outputs without communication.
#pragma once

#include <cstdint>
#include <vector>

typedef struct CUstream_st* cudaStream_t;

namespace epx::harness {

uint64_t mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0);
// Uniform in [0, 1).
double unit(uint64_t h);

enum class Routing {
  kUniform,    // top-k distinct experts, uniform
  kSkewed,     // Zipf-like popularity: low expert ids (rank 0) are hot
  kLastIdle,   // the last rank's experts are never chosen: it receives nothing
  kOneExpert,  // every token's first slot is expert 0, the rest -1
  kZeroTwice,  // every token's first two slots are expert 0 (a duplicate), the rest -1
};

struct RoutingSpec {
  Routing kind = Routing::kUniform;
  int num_experts = 256;
  int num_topk = 8;
  double empty_slot_prob = 0.0;  // probability that a slot is -1
  uint64_t seed = 1;
};

// topk_idx [T, K] and topk_weights [T, K] of `rank`.
void make_topk(const RoutingSpec& spec, int rank, int num_ranks, int num_tokens, std::vector<int64_t>& idx,
               std::vector<float>& weights);

// Row payloads. bf16 values are finite, in [-8, 8); fp8 bytes avoid NaN; scales are positive.
void fill_bf16_row(uint64_t seed, int rank, int token, int hidden, uint16_t* row);
void fill_fp8_row(uint64_t seed, int rank, int token, int hidden, uint8_t* row);
void fill_scales(uint64_t seed, int rank, int token, int num_scales, float* scales);
float weight_value(uint64_t seed, int a, int b, int c);

// The same rows written by a kernel on `stream` (gen_device.cu), token t of `rank` at row t. Timed loops refresh
// their inputs this way: generating them on the host leaves the GPU idle for ~100 ms, after which the next
// dispatch was measured ~330 us slower on H200 (a cold start that back-to-back use never pays).
void fill_bf16_rows_device(uint64_t seed, int rank, int num_tokens, int hidden, uint16_t* rows, cudaStream_t stream);
void fill_fp8_rows_device(uint64_t seed, int rank, int num_tokens, int hidden, uint8_t* rows, cudaStream_t stream);
// Scale g of token t goes to scales[t * stride_token + g * stride_group]; the words in between are left as they are.
void fill_scales_device(uint64_t seed, int rank, int num_tokens, int num_scales, float* scales, int64_t stride_token,
                        int64_t stride_group, cudaStream_t stream);

}  // namespace epx::harness
