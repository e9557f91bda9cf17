#include "gen.hpp"

#include <cmath>

#include "epx/reference.hpp"
#include "gen_rows.hpp"

namespace epx::harness {

uint64_t mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) { return rows::mix(a, b, c, d); }

double unit(uint64_t h) { return rows::unit(h); }

void make_topk(const RoutingSpec& s, int rank, int num_ranks, int num_tokens, std::vector<int64_t>& idx,
               std::vector<float>& weights) {
  const int K = s.num_topk, E = s.num_experts, L = E / num_ranks;
  const int choosable = s.kind == Routing::kLastIdle ? E - L : E;
  idx.assign(size_t(num_tokens) * K, -1);
  weights.assign(size_t(num_tokens) * K, 0.f);
  for (int t = 0; t < num_tokens; ++t) {
    int64_t* row = idx.data() + size_t(t) * K;
    if (s.kind == Routing::kOneExpert || s.kind == Routing::kZeroTwice) {
      row[0] = 0;
      if (s.kind == Routing::kZeroTwice && K > 1) row[1] = 0;
    } else {
      for (int k = 0; k < K && k < choosable; ++k) {
        for (uint64_t attempt = 0;; ++attempt) {
          const uint64_t h = mix(s.seed, rank, t, uint64_t(k) << 32 | attempt);
          int64_t e;
          if (s.kind == Routing::kSkewed) {
            // Inverse CDF of a power law over [0, choosable): small ids are chosen far more often.
            e = int64_t(std::pow(unit(h), 3.0) * choosable);
          } else {
            e = int64_t(h % uint64_t(choosable));
          }
          bool dup = false;
          for (int q = 0; q < k; ++q) dup |= row[q] == e;
          if (!dup) {
            row[k] = e;
            break;
          }
        }
      }
      for (int k = 0; k < K; ++k)
        if (s.empty_slot_prob > 0 && unit(mix(s.seed ^ 0x5151, rank, t, k)) < s.empty_slot_prob) row[k] = -1;
    }
    for (int k = 0; k < K; ++k)
      weights[size_t(t) * K + k] = row[k] >= 0 ? weight_value(s.seed ^ 0x77, rank, t, k) : 0.f;
  }
}

void fill_bf16_row(uint64_t seed, int rank, int token, int hidden, uint16_t* row) {
  const uint64_t base = rows::bf16_row_base(seed, rank, token);
  for (int h = 0; h < hidden; ++h) row[h] = rows::bf16_element(base, h);
}

void fill_fp8_row(uint64_t seed, int rank, int token, int hidden, uint8_t* row) {
  const uint64_t base = rows::fp8_row_base(seed, rank, token);
  for (int h = 0; h < hidden; ++h) row[h] = rows::fp8_element(base, h);
}

void fill_scales(uint64_t seed, int rank, int token, int num_scales, float* scales) {
  const uint64_t base = rows::scale_row_base(seed, rank, token);
  for (int i = 0; i < num_scales; ++i) scales[i] = rows::scale_element(base, i);
}

float weight_value(uint64_t seed, int a, int b, int c) { return float(unit(mix(seed, a, b, c))) + 0.01f; }

}  // namespace epx::harness
