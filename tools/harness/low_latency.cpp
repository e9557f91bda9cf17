#include "low_latency.hpp"

#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace epx::harness {
namespace {

constexpr uint64_t kExpertSalt = 0xe11;
constexpr int kMaxReported = 4;

class Report {
 public:
  void fail(const std::string& msg) {
    if (count_++ < kMaxReported) os_ << "  " << msg << "\n";
  }
  std::string str() const {
    std::ostringstream o;
    o << os_.str();
    if (count_ > kMaxReported) o << "  ... " << count_ << " mismatches\n";
    return count_ ? o.str() : "";
  }

 private:
  int count_ = 0;
  std::ostringstream os_;
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

LowLatencySession::LowLatencySession(Buffer& buffer, const LowLatencyCase& c, cudaStream_t stream)
    : buffer_(buffer), c_(c), stream_(stream), combine_rank_(c.rank_reduced) {
  rank_ = buffer.rank();
  num_ranks_ = buffer.num_ranks();
  num_experts_ = c.num_experts;
  num_tokens_ = c.tokens_of(rank_);
  const int L = num_experts_ / num_ranks_, M = c.max_tokens, H = c.hidden, K = c.num_topk;
  const size_t rows = size_t(L) * num_ranks_ * M;
  x_.resize(size_t(std::max(num_tokens_, 1)) * H);
  topk_idx_.resize(size_t(std::max(num_tokens_, 1)) * K);
  topk_weights_.resize(size_t(std::max(num_tokens_, 1)) * K);
  stats_.resize(L);
  stats_.fill_bytes(0, stream);
  expected_stats_.assign(L, 0);
  packed_x_.resize(rows * H * (c.fp8 ? 1 : 2));
  packed_scales_.resize(c.fp8 ? rows * (H / epx::limits().fp8_group_size) : 1);
  packed_count_.resize(L);
  src_info_.resize(rows);
  layout_range_.resize(size_t(L) * num_ranks_);
  topk_slots_.resize(c.rank_reduced ? size_t(num_ranks_) * M * K * 2 : 1);
  expert_out_.resize(rows * H);
  combined_.resize(size_t(std::max(num_tokens_, 1)) * H);
  packed_x_.fill_bytes(0x7b, stream);
  combined_.fill_bytes(0x7b, stream);
  set_step(c.seed);
}

void LowLatencySession::expected_row(int src, int token, std::vector<uint16_t>& row) const {
  row.resize(c_.hidden);
  fill_bf16_row(step_seed_, src, token, c_.hidden, row.data());
}

void LowLatencySession::set_step(uint64_t seed) {
  step_seed_ = seed;
  const int R = num_ranks_, H = c_.hidden, K = c_.num_topk;
  RoutingSpec spec;
  spec.kind = c_.routing;
  spec.num_experts = num_experts_;
  spec.num_topk = K;
  spec.empty_slot_prob = c_.empty_slot_prob;
  spec.seed = seed;
  topk_.assign(R, {});
  weights_.assign(R, {});
  for (int s = 0; s < R; ++s) make_topk(spec, s, R, c_.tokens_of(s), topk_[s], weights_[s]);
  route();

  std::vector<uint16_t> x(size_t(num_tokens_) * H);
  for (int t = 0; t < num_tokens_; ++t) fill_bf16_row(seed, rank_, t, H, x.data() + size_t(t) * H);
  // Same device arrays every step (graph replays read them): copy, never reallocate.
  cuda_check(cudaMemcpyAsync(x_.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice, stream_), "x");
  cuda_check(
      cudaMemcpyAsync(topk_idx_.get(), topk_[rank_].data(), topk_[rank_].size() * 8, cudaMemcpyHostToDevice, stream_),
      "topk");
  cuda_check(cudaMemcpyAsync(topk_weights_.get(), weights_[rank_].data(), weights_[rank_].size() * 4,
                             cudaMemcpyHostToDevice, stream_),
             "weights");
  cuda_check(cudaStreamSynchronize(stream_), "set_step");
}

void LowLatencySession::route() {
  std::vector<ref::Source> sources(num_ranks_);
  for (int s = 0; s < num_ranks_; ++s) {
    sources[s].num_tokens = c_.tokens_of(s);
    sources[s].topk_idx = topk_[s].data();
  }
  rows_ = mask_.empty() ? ref::low_latency_rows(sources, c_.num_topk, num_experts_, rank_)
                        : ref::low_latency_rows_masked(sources, c_.num_topk, num_experts_, rank_, mask_);
}

void LowLatencySession::set_mask(const std::vector<int32_t>& mask) {
  mask_ = mask;
  route();
}

LowLatencyDispatchArgs LowLatencySession::dispatch_args() const {
  LowLatencyDispatchArgs a{};
  a.x = x_.get();
  a.num_tokens = num_tokens_;
  a.hidden = c_.hidden;
  a.topk_idx = topk_idx_.get();
  a.num_topk = c_.num_topk;
  a.num_experts = num_experts_;
  a.num_max_dispatch_tokens_per_rank = c_.max_tokens;
  a.use_fp8 = c_.fp8;
  a.round_scale = c_.round_scale;
  a.use_ue8m0 = c_.ue8m0;
  a.cumulative_local_expert_recv_stats = stats_.get();
  a.topk_weights = c_.rank_reduced ? topk_weights_.get() : nullptr;
  return a;
}

void LowLatencySession::note_replayed_dispatch() {
  for (size_t i = 0; i < rows_.size(); ++i) expected_stats_[i] += int(rows_[i].size());
}

void LowLatencySession::dispatch(int phases, bool counted) {
  LowLatencyDispatchOutputs o{packed_x_.get(),     c_.fp8 ? packed_scales_.get() : nullptr,
                              packed_count_.get(), src_info_.get(),
                              layout_range_.get(), c_.rank_reduced ? topk_slots_.get() : nullptr};
  buffer_.low_latency_dispatch(dispatch_args(), o, phases, handle_, stream_);
  if (counted && (phases & kLowLatencyRecvPhase)) note_replayed_dispatch();
}

void LowLatencySession::receive_with_fp8(bool fp8) {
  LowLatencyDispatchArgs a = dispatch_args();
  a.use_fp8 = fp8;
  LowLatencyDispatchOutputs o{packed_x_.get(), packed_scales_.get(), packed_count_.get(),
                              src_info_.get(), layout_range_.get(),  c_.rank_reduced ? topk_slots_.get() : nullptr};
  buffer_.low_latency_dispatch(a, o, kLowLatencyRecvPhase, handle_, stream_);
}

void LowLatencySession::set_combine_inputs(uint64_t seed) {
  combine_seed_ = seed;
  if (c_.expert_identity) return;  // combine reads packed_recv_x itself
  const int R = num_ranks_, M = c_.max_tokens, H = c_.hidden, L = num_local_experts();
  std::vector<uint16_t> y(size_t(L) * R * M * H, 0);
  for (int i = 0; i < L; ++i)
    for (size_t n = 0; n < rows_[i].size(); ++n)
      fill_bf16_row(mix(seed, kExpertSalt, rank_ * L + i), rows_[i][n].src_rank, rows_[i][n].src_token, H,
                    y.data() + (size_t(i) * R * M + n) * H);
  void* dst = c_.zero_copy ? buffer_.next_low_latency_combine_buffer(handle_) : expert_out_.get();
  cuda_check(cudaMemcpyAsync(dst, y.data(), y.size() * 2, cudaMemcpyHostToDevice, stream_), "expert outputs");
  cuda_check(cudaStreamSynchronize(stream_), "set_combine_inputs");
}

LowLatencyCombineArgs LowLatencySession::combine_args() const {
  LowLatencyCombineArgs a{};
  a.x = c_.expert_identity ? static_cast<const void*>(packed_x_.get()) : expert_out_.get();
  a.zero_copy = c_.zero_copy && !c_.expert_identity;
  a.topk_idx = topk_idx_.get();
  a.topk_weights = topk_weights_.get();
  a.use_logfmt = c_.logfmt;
  a.reduction = combine_rank_ ? EPX_REDUCE_RANK : EPX_REDUCE_DEFAULT;
  return a;
}

void LowLatencySession::combine(int phases) {
  combine_set_ = buffer_.low_latency_combine(combine_args(), handle_, combined_.get(), phases, combine_set_, stream_);
}

void LowLatencySession::combine_with_logfmt(int phases, bool logfmt) {
  LowLatencyCombineArgs a = combine_args();
  a.use_logfmt = logfmt;
  combine_set_ = buffer_.low_latency_combine(a, handle_, combined_.get(), phases, combine_set_, stream_);
}

void LowLatencySession::set_combine_rank_reduced(bool rank_reduced) {
  if (rank_reduced && !c_.rank_reduced)
    throw std::invalid_argument("set_combine_rank_reduced: the case's dispatches carry no weights (rank_reduced)");
  combine_rank_ = rank_reduced;
}

void LowLatencySession::combine_with_reduction(int phases, int reduction) {
  LowLatencyCombineArgs a = combine_args();
  a.reduction = reduction;
  combine_set_ = buffer_.low_latency_combine(a, handle_, combined_.get(), phases, combine_set_, stream_);
}

void LowLatencySession::combine_over_input(int phases) {
  const LowLatencyCombineArgs a = combine_args();
  combine_set_ = buffer_.low_latency_combine(a, handle_, const_cast<void*>(a.x), phases, combine_set_, stream_);
}

std::string LowLatencySession::check_dispatch() const {
  const int R = num_ranks_, M = c_.max_tokens, H = c_.hidden, L = num_local_experts(),
            G = H / epx::limits().fp8_group_size;
  const size_t rows_per_expert = size_t(R) * M;
  Report r;
  const auto count = packed_count_.download(L, stream_);
  const auto range = layout_range_.download(size_t(L) * R, stream_);
  const auto info = src_info_.download(L * rows_per_expert, stream_);
  const auto px = packed_x_.download(L * rows_per_expert * H * (c_.fp8 ? 1 : 2), stream_);
  const auto scales = c_.fp8 ? packed_scales_.download(L * rows_per_expert * G, stream_) : std::vector<int32_t>();
  const auto stats = stats_.download(L, stream_);
  std::vector<uint16_t> row;
  std::vector<uint8_t> q(H);
  std::vector<float> sc(G);
  for (int i = 0; i < L; ++i) {
    const auto& want = rows_[i];
    const std::string at = "expert " + std::to_string(i);
    if (count[i] != int(want.size()))
      r.fail(at + ": count " + std::to_string(count[i]) + ", want " + std::to_string(want.size()));
    if (stats[i] != expected_stats_[i])
      r.fail(at + ": cumulative stats " + std::to_string(stats[i]) + ", want " + std::to_string(expected_stats_[i]));
    int begin = 0;
    for (int s = 0; s < R; ++s) {
      int n = 0;
      for (const auto& w : want) n += w.src_rank == s ? 1 : 0;
      const int64_t v = range[size_t(i) * R + s];
      if (v != ((int64_t(begin) << 32) | n))
        r.fail(at + " source " + std::to_string(s) + ": layout range (" + std::to_string(v >> 32) + ", " +
               std::to_string(v & 0xffffffff) + "), want (" + std::to_string(begin) + ", " + std::to_string(n) + ")");
      begin += n;
    }
    for (size_t n = 0; n < want.size() && n < rows_per_expert; ++n) {
      const size_t prow = size_t(i) * rows_per_expert + n;
      const std::string where = at + " row " + std::to_string(n);
      if (info[prow] != want[n].src_token)
        r.fail(where + ": src_info " + std::to_string(info[prow]) + ", want " + std::to_string(want[n].src_token));
      expected_row(want[n].src_rank, want[n].src_token, row);
      if (!c_.fp8) {
        if (std::memcmp(px.data() + prow * H * 2, row.data(), size_t(H) * 2) != 0) r.fail(where + ": bf16 row differs");
        continue;
      }
      ref::quantize_fp8_row(row.data(), H, c_.round_scale, q.data(), sc.data());
      if (std::memcmp(px.data() + prow * H, q.data(), H) != 0) {
        int b = 0;
        while (px[prow * H + b] == q[b]) ++b;
        r.fail(where + ": e4m3 byte " + std::to_string(b) + " is " + std::to_string(px[prow * H + b]) + ", want " +
               std::to_string(q[b]));
      }
      for (int g = 0; g < G; ++g) {  // token-minor scales
        if (c_.ue8m0) {
          if (g % 4) continue;
          uint32_t want_word = 0;
          for (int j = 0; j < 4; ++j) want_word |= uint32_t(ref::ue8m0(sc[g + j])) << (8 * j);
          const uint32_t got = uint32_t(scales[(size_t(i) * (G / 4) + g / 4) * rows_per_expert + n]);
          if (got != want_word) r.fail(where + ": ue8m0 word " + std::to_string(g / 4) + " differs");
        } else {
          const uint32_t got = uint32_t(scales[(size_t(i) * G + g) * rows_per_expert + n]);
          if (got != bits(sc[g])) r.fail(where + ": scale " + std::to_string(g) + " differs");
        }
      }
    }
  }
  return r.str();
}

std::string LowLatencySession::check_combine() const {
  const int H = c_.hidden, K = c_.num_topk, L = num_local_experts();
  const auto got = combined_.download(size_t(num_tokens_) * H, stream_);
  std::vector<std::vector<uint16_t>> scratch(K, std::vector<uint16_t>(H));
  std::vector<uint16_t> want(H);
  Report r;
  for (int t = 0; t < num_tokens_; ++t) {
    int slot = 0;
    auto row = [&](int64_t e) -> const uint16_t* {
      std::vector<uint16_t>& buf = scratch[slot++ % K];
      if (c_.expert_identity)
        fill_bf16_row(step_seed_, rank_, t, H, buf.data());
      else
        fill_bf16_row(mix(combine_seed_, kExpertSalt, int(e)), rank_, t, H, buf.data());
      return buf.data();
    };
    std::vector<int64_t> masked(topk_[rank_].begin() + ptrdiff_t(t) * K, topk_[rank_].begin() + ptrdiff_t(t + 1) * K);
    if (!mask_.empty()) ref::mask_topk_slots(masked.data(), K, num_experts_, mask_, rank_, masked.data());
    const int64_t* idx = masked.data();
    const float* w = weights_[rank_].data() + size_t(t) * K;
    if (c_.logfmt)
      ref::low_latency_combine_row_logfmt(H, idx, w, K, num_experts_, row, want.data());
    else if (combine_rank_)
      ref::low_latency_combine_row_rank_reduced(H, idx, w, K, num_experts_, num_ranks_, row, want.data());
    else
      ref::low_latency_combine_row(H, idx, w, K, num_experts_, row, want.data());
    if (std::memcmp(got.data() + size_t(t) * H, want.data(), size_t(H) * 2) != 0) {
      int h = 0;
      while (got[size_t(t) * H + h] == want[h]) ++h;
      r.fail("combined_x[" + std::to_string(t) + "][" + std::to_string(h) +
             "] = " + std::to_string(got[size_t(t) * H + h]) + ", want " + std::to_string(want[h]));
    }
  }
  (void)L;
  return r.str();
}

double LowLatencySession::dispatch_bytes() const {
  size_t rows = 0;
  for (const auto& e : rows_) rows += e.size();
  const double row = c_.fp8 ? c_.hidden + c_.hidden / epx::limits().fp8_group_size * 4.0 : c_.hidden * 2.0;
  return double(rows) * row;
}

std::vector<size_t> LowLatencySession::combine_rows_to() const {
  std::vector<size_t> n(num_ranks_, 0);
  std::set<std::pair<int, int>> tokens;  // rank-reduced: one row per (source, token) with any expert here
  for (const auto& expert_rows : rows_)
    for (const auto& row : expert_rows)
      if (!combine_rank_ || tokens.insert({row.src_rank, int(row.src_token)}).second) ++n[row.src_rank];
  return n;
}

std::vector<size_t> LowLatencySession::combine_rows_from() const {
  std::vector<size_t> n(num_ranks_, 0);
  const int per_rank = num_experts_ / num_ranks_, K = c_.num_topk;
  for (size_t t = 0; t * K < topk_[rank_].size(); ++t) {
    std::vector<bool> seen(num_ranks_, false);  // rank-reduced: one row per rank holding any of t's experts
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk_[rank_][t * K + k];
      if (e < 0 || e >= num_experts_ || (combine_rank_ && seen[e / per_rank])) continue;
      seen[e / per_rank] = true;
      ++n[e / per_rank];
    }
  }
  return n;
}

double LowLatencySession::combine_bytes() const {
  size_t n = 0;
  if (combine_rank_) {
    for (size_t rows : combine_rows_from()) n += rows;
    return double(n) * c_.hidden * 2.0;
  }
  for (int t = 0; t < num_tokens_; ++t)
    for (int k = 0; k < c_.num_topk; ++k) n += topk_[rank_][size_t(t) * c_.num_topk + k] >= 0 ? 1 : 0;
  return double(n) * (c_.logfmt ? double(ref::logfmt_row_bytes(c_.hidden)) : c_.hidden * 2.0);
}

}  // namespace epx::harness
