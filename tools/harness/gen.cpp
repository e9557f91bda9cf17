#include "gen.hpp"

#include <cmath>

#include "epx/reference.hpp"

namespace epx::harness {

uint64_t mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull;
  x ^= (c + 0x94d049bb133111ebull) * 0xd6e8feb86659fd93ull;
  x ^= (d + 0x2545f4914f6cdd1dull) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 33;
  return x;
}

double unit(uint64_t h) { return double(h >> 11) * (1.0 / 9007199254740992.0); }

void make_topk(const RoutingSpec& s, int rank, int num_ranks, int num_tokens, std::vector<int64_t>& idx,
               std::vector<float>& weights) {
  const int K = s.num_topk, E = s.num_experts, L = E / num_ranks;
  const int choosable = s.kind == Routing::kLastIdle ? E - L : E;
  idx.assign(size_t(num_tokens) * K, -1);
  weights.assign(size_t(num_tokens) * K, 0.f);
  for (int t = 0; t < num_tokens; ++t) {
    int64_t* row = idx.data() + size_t(t) * K;
    if (s.kind == Routing::kOneExpert) {
      row[0] = 0;
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
  const uint64_t base = mix(seed, rank, token);
  for (int h = 0; h < hidden; ++h) {
    const uint64_t v = mix(base, h);
    row[h] = ref::float_to_bf16(float(int64_t(v % 4096) - 2048) / 256.f + float((v >> 20) % 256) / 65536.f);
  }
}

void fill_fp8_row(uint64_t seed, int rank, int token, int hidden, uint8_t* row) {
  const uint64_t base = mix(seed, rank, token, 0xf8);
  for (int h = 0; h < hidden; ++h) {
    uint8_t b = uint8_t(mix(base, h));
    if ((b & 0x7f) == 0x7f) b &= 0xfe;  // no NaN
    row[h] = b;
  }
}

void fill_scales(uint64_t seed, int rank, int token, int num_scales, float* scales) {
  const uint64_t base = mix(seed, rank, token, 0x5c);
  for (int i = 0; i < num_scales; ++i) scales[i] = 0.001f + float(unit(mix(base, i)));
}

float weight_value(uint64_t seed, int a, int b, int c) { return float(unit(mix(seed, a, b, c))) + 0.01f; }

}  // namespace epx::harness
