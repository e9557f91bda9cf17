// The CPU reference model (semantics.md sections 1-3). Plain loops, written to be obviously right.
#include "epx/reference.hpp"

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <string>

namespace epx::ref {
namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

float bf16_to_float(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }

uint16_t float_to_bf16(float value) {
  uint32_t u = float_bits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float e4m3_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xf, mantissa = bits & 7;
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  if (exponent == 0xf && mantissa == 7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(float(mantissa), -9);
  return sign * std::ldexp(1.f + float(mantissa) / 8.f, exponent - 7);
}

uint8_t float_to_e4m3(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  const float a = std::fabs(value);
  constexpr uint8_t kMaxFinite = 0x7e;  // 448
  if (a >= 448.f) return sign | kMaxFinite;
  if (a < std::ldexp(1.f, -6)) {  // subnormal: multiples of 2^-9; 8 rounds up to the smallest normal (0x08)
    const float q = std::nearbyint(a * 512.f);
    return sign | uint8_t(q);
  }
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  e -= 1;                             // a = (2m) * 2^e, 2m in [1, 2)
  float q = std::nearbyint((2.f * m - 1.f) * 8.f);
  if (q == 8.f) {
    q = 0.f;
    ++e;
  }
  const int field = e + 7;
  if (field > 15 || (field == 15 && q == 7.f)) return sign | kMaxFinite;
  return sign | uint8_t(field << 3) | uint8_t(q);
}

Layout dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                       int num_nvl_ranks) {
  require(num_tokens >= 0 && num_topk >= 1 && num_ranks >= 1, "dispatch_layout: bad sizes");
  require(num_experts > 0 && num_experts % num_ranks == 0, "dispatch_layout: num_experts must be a multiple of R");
  const bool rdma = num_nvl_ranks > 0 && num_nvl_ranks < num_ranks;
  require(!rdma || num_ranks % num_nvl_ranks == 0, "dispatch_layout: num_nvl_ranks must divide R");
  const int experts_per_rank = num_experts / num_ranks;
  Layout out;
  out.num_tokens_per_rank.assign(num_ranks, 0);
  out.num_tokens_per_expert.assign(num_experts, 0);
  if (rdma) out.num_tokens_per_rdma_rank.assign(num_ranks / num_nvl_ranks, 0);
  out.is_token_in_rank.assign(size_t(num_tokens) * num_ranks, 0);
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<uint8_t> in_domain(out.num_tokens_per_rdma_rank.size(), 0);
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = topk_idx[size_t(t) * num_topk + k];
      if (e == -1) continue;
      require(e >= 0 && e < num_experts, "topk_idx[" + std::to_string(t) + "][" + std::to_string(k) +
                                             "] = " + std::to_string(e) + " is outside [-1, " +
                                             std::to_string(num_experts) + ")");
      ++out.num_tokens_per_expert[e];
      const int r = int(e / experts_per_rank);
      out.is_token_in_rank[size_t(t) * num_ranks + r] = 1;
    }
    for (int r = 0; r < num_ranks; ++r) {
      if (!out.is_token_in_rank[size_t(t) * num_ranks + r]) continue;
      ++out.num_tokens_per_rank[r];
      if (rdma) in_domain[r / num_nvl_ranks] = 1;
    }
    for (size_t d = 0; d < in_domain.size(); ++d) out.num_tokens_per_rdma_rank[d] += in_domain[d];
  }
  return out;
}

std::vector<int> rank_prefix_matrix(const std::vector<Source>& sources) {
  const int R = int(sources.size());
  std::vector<int> m(size_t(R) * R, 0);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < R; ++j) {
      int n = 0;
      for (int t = 0; t < sources[i].num_tokens; ++t) n += sources[i].is_token_in_rank[size_t(t) * R + j] ? 1 : 0;
      m[size_t(i) * R + j] = (i > 0 ? m[size_t(i - 1) * R + j] : 0) + n;
    }
  return m;
}

std::vector<RecvRow> recv_rows(const std::vector<Source>& sources, int rank) {
  const int R = int(sources.size());
  require(rank >= 0 && rank < R, "recv_rows: rank outside [0, R)");
  std::vector<RecvRow> rows;
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < sources[s].num_tokens; ++t)
      if (sources[s].is_token_in_rank[size_t(t) * R + rank]) rows.push_back({s, t});
  return rows;
}

RecvMeta dispatch_meta(const std::vector<Source>& sources, int rank, int num_topk, int num_experts,
                       int expert_alignment, bool with_topk, bool with_weights) {
  const int R = int(sources.size());
  const std::vector<RecvRow> rows = recv_rows(sources, rank);
  RecvMeta meta;
  meta.recv_src_idx.reserve(rows.size());
  for (const RecvRow& row : rows) meta.recv_src_idx.push_back(row.src_token);
  if (!with_topk) return meta;
  require(num_topk >= 0 && num_experts > 0 && num_experts % R == 0 && expert_alignment >= 1,
          "dispatch_meta: bad sizes");
  const int L = num_experts / R;
  const bool weights = with_weights;
  meta.recv_topk_idx.assign(rows.size() * num_topk, -1);
  if (weights) meta.recv_topk_weights.assign(rows.size() * num_topk, 0.f);
  meta.num_recv_tokens_per_expert.assign(L, 0);
  for (size_t n = 0; n < rows.size(); ++n) {
    const Source& src = sources[rows[n].src_rank];
    for (int k = 0; k < num_topk; ++k) {
      const size_t slot = size_t(rows[n].src_token) * num_topk + k;
      const int64_t e = src.topk_idx[slot];
      if (e < int64_t(rank) * L || e >= int64_t(rank + 1) * L) continue;
      meta.recv_topk_idx[n * num_topk + k] = e - int64_t(rank) * L;
      if (weights) meta.recv_topk_weights[n * num_topk + k] = src.topk_weights[slot];
      ++meta.num_recv_tokens_per_expert[e - int64_t(rank) * L];
    }
  }
  for (int& c : meta.num_recv_tokens_per_expert) {
    const int64_t aligned = (int64_t(c) + expert_alignment - 1) / expert_alignment * expert_alignment;
    require(aligned <= INT32_MAX, "dispatch_meta: an aligned count past INT32_MAX");
    c = int(aligned);
  }
  return meta;
}

void reduce_bf16_rows(int hidden, const std::vector<const uint16_t*>& rows, const uint16_t* bias0,
                      const uint16_t* bias1, uint16_t* out) {
  for (int h = 0; h < hidden; ++h) {
    float acc = 0.f;
    for (const uint16_t* row : rows) acc += bf16_to_float(row[h]);
    if (bias0 != nullptr) acc += bf16_to_float(bias0[h]);
    if (bias1 != nullptr) acc += bf16_to_float(bias1[h]);
    out[h] = float_to_bf16(acc);
  }
}

Combined combine(const Source& own, int num_ranks, int hidden, int num_topk, const ContributionRow& row,
                 const ContributionWeights& weights, const uint16_t* bias0, const uint16_t* bias1) {
  require(num_ranks >= 1 && hidden >= 0 && num_topk >= 0 && own.num_tokens >= 0, "combine: bad sizes");
  Combined out;
  out.x.assign(size_t(own.num_tokens) * hidden, 0);
  if (weights) out.weights.assign(size_t(own.num_tokens) * num_topk, 0.f);
  std::vector<const uint16_t*> rows;
  for (int t = 0; t < own.num_tokens; ++t) {
    rows.clear();
    for (int j = 0; j < num_ranks; ++j)
      if (own.is_token_in_rank[size_t(t) * num_ranks + j]) rows.push_back(row(j, t));
    const size_t off = size_t(t) * hidden;
    reduce_bf16_rows(hidden, rows, bias0 ? bias0 + off : nullptr, bias1 ? bias1 + off : nullptr, out.x.data() + off);
    if (!weights) continue;
    for (int k = 0; k < num_topk; ++k) {
      float acc = 0.f;
      for (int j = 0; j < num_ranks; ++j)
        if (own.is_token_in_rank[size_t(t) * num_ranks + j]) acc += weights(j, t)[k];
      out.weights[size_t(t) * num_topk + k] = acc;
    }
  }
  return out;
}

namespace {

// Smallest power of two >= s (s > 0, finite), by exponent bits (as the kernels do).
float round_up_pow2(float s) {
  uint32_t b = float_bits(s);
  if (b & 0x7fffffu) b = (b & 0xff800000u) + 0x800000u;
  return bits_float(b);
}

}  // namespace

void quantize_fp8_row(const uint16_t* x, int hidden, bool round_scale, uint8_t* q, float* scales) {
  constexpr int kGroup = 128;
  require(hidden % kGroup == 0, "quantize_fp8_row: hidden must be a multiple of 128");
  for (int g = 0; g < hidden / kGroup; ++g) {
    float amax = 0.f;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(bf16_to_float(x[g * kGroup + i])));
    volatile float floored = std::max(amax, 1e-4f);  // volatile: no contraction or reassociation
    float scale = floored / 448.f;
    if (round_scale) scale = round_up_pow2(scale);
    scales[g] = scale;
    for (int i = 0; i < kGroup; ++i) {
      volatile float v = bf16_to_float(x[g * kGroup + i]) / scale;
      q[g * kGroup + i] = float_to_e4m3(v);
    }
  }
}

uint8_t ue8m0(float pow2_scale) { return uint8_t(float_bits(pow2_scale) >> 23); }

std::vector<std::vector<RecvRow>> low_latency_rows(const std::vector<Source>& sources, int num_topk, int num_experts,
                                                   int rank) {
  const int R = int(sources.size());
  require(R >= 1 && num_topk >= 0, "low_latency_rows: needs a source and num_topk >= 0");
  require(num_experts > 0 && num_experts % R == 0, "low_latency_rows: num_experts must be a multiple of R");
  const int L = num_experts / R;
  std::vector<std::vector<RecvRow>> rows(L);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < sources[s].num_tokens; ++t)
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = sources[s].topk_idx[size_t(t) * num_topk + k];
        if (e >= int64_t(rank) * L && e < (int64_t(rank) + 1) * L) rows[e - int64_t(rank) * L].push_back({s, t});
      }
  return rows;
}

std::vector<bool> low_latency_left_out(const std::vector<int32_t>& mask, int rank) {
  const int R = int(mask.size());
  require(R >= 1 && rank >= 0 && rank < R, "low_latency_left_out: needs a mask entry per rank and a rank in [0, R)");
  std::vector<bool> out(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) out[size_t(r)] = mask[size_t(rank)] != 0 || mask[size_t(r)] != 0;
  return out;
}

std::vector<std::vector<RecvRow>> low_latency_rows_masked(const std::vector<Source>& sources, int num_topk,
                                                          int num_experts, int rank, const std::vector<int32_t>& mask) {
  require(mask.size() == sources.size(), "low_latency_rows_masked: the mask needs one entry per source");
  const std::vector<bool> out = low_latency_left_out(mask, rank);
  std::vector<std::vector<RecvRow>> rows = low_latency_rows(sources, num_topk, num_experts, rank);
  for (auto& expert : rows) {
    std::vector<RecvRow> kept;
    for (const RecvRow& row : expert)
      if (!out[size_t(row.src_rank)]) kept.push_back(row);
    expert = std::move(kept);
  }
  return rows;
}

void mask_topk_slots(const int64_t* idx, int num_topk, int num_experts, const std::vector<int32_t>& mask, int rank,
                     int64_t* out) {
  const int R = int(mask.size());
  require(num_topk >= 0 && num_experts > 0 && R >= 1 && num_experts % R == 0,
          "mask_topk_slots: num_experts must be a positive multiple of the mask's ranks");
  const std::vector<bool> left_out = low_latency_left_out(mask, rank);
  const int64_t L = num_experts / R;
  for (int k = 0; k < num_topk; ++k) {
    const int64_t e = idx[k];
    out[k] = e >= 0 && e < num_experts && left_out[size_t(e / L)] ? -1 : e;
  }
}

void low_latency_combine_row(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                             const ExpertRow& row, uint16_t* out) {
  std::vector<float> acc(hidden, 0.f);
  for (int k = 0; k < num_topk; ++k) {
    if (idx[k] < 0 || idx[k] >= num_experts) continue;
    const uint16_t* r = row(idx[k]);
    for (int h = 0; h < hidden; ++h) {
      volatile float product = w[k] * bf16_to_float(r[h]);  // rounded to float32 before the add
      acc[h] = acc[h] + product;
    }
  }
  for (int h = 0; h < hidden; ++h) out[h] = float_to_bf16(acc[h]);
}

void low_latency_combine_row_rank_reduced(int hidden, const int64_t* idx, const float* w, int num_topk, int num_experts,
                                          int num_ranks, const ExpertRow& row, uint16_t* out) {
  if (hidden < 0 || num_topk < 0 || num_ranks < 1 || num_experts < num_ranks || num_experts % num_ranks != 0)
    throw std::invalid_argument(
        "low_latency_combine_row_rank_reduced: hidden, num_topk >= 0 and num_experts a "
        "positive multiple of num_ranks");
  const int64_t per_rank = num_experts / num_ranks;
  std::vector<float> acc(hidden, 0.f), partial(hidden);
  for (int r = 0; r < num_ranks; ++r) {
    bool any = false;
    std::fill(partial.begin(), partial.end(), 0.f);
    for (int k = 0; k < num_topk; ++k) {
      if (idx[k] < 0 || idx[k] >= num_experts || idx[k] / per_rank != r) continue;
      any = true;
      const uint16_t* x = row(idx[k]);
      for (int h = 0; h < hidden; ++h) {
        volatile float product = w[k] * bf16_to_float(x[h]);  // rounded to float32 before the add
        partial[h] = partial[h] + product;
      }
    }
    if (!any) continue;
    for (int h = 0; h < hidden; ++h) acc[h] = acc[h] + bf16_to_float(float_to_bf16(partial[h]));
  }
  for (int h = 0; h < hidden; ++h) out[h] = float_to_bf16(acc[h]);
}

}  // namespace epx::ref
