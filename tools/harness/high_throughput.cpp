#include "high_throughput.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace epx::harness {

constexpr int kMaxReported = 4;

// Collects the first few mismatches of a check.
class Mismatches {
 public:
  explicit Mismatches(const char* what) : what_(what) {}
  template <typename A, typename B>
  void expect_eq(const A& got, const B& want, const std::string& where) {
    if (got == want) return;
    if (count_++ < kMaxReported) os_ << "  " << what_ << " " << where << ": got " << got << ", want " << want << "\n";
  }
  void fail(const std::string& msg) {
    if (count_++ < kMaxReported) os_ << "  " << what_ << " " << msg << "\n";
  }
  std::string str() const {
    if (count_ == 0) return "";
    std::ostringstream o;
    o << os_.str();
    if (count_ > kMaxReported) o << "  ... " << count_ << " mismatches in " << what_ << "\n";
    return o.str();
  }

 private:
  const char* what_;
  int count_ = 0;
  std::ostringstream os_;
};

namespace {

constexpr uint64_t kExpertOutSalt = 0xe0;
constexpr uint64_t kBiasSalt = 0xb0;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::string at(int row, int col = -1) {
  return col < 0 ? "[" + std::to_string(row) + "]" : "[" + std::to_string(row) + "][" + std::to_string(col) + "]";
}

}  // namespace

HtCase experts_for(HtCase c, int num_ranks) {
  c.routing.num_experts = (c.routing.num_experts + num_ranks - 1) / num_ranks * num_ranks;
  return c;
}

HtSession::HtSession(Buffer& buffer, const HtCase& c, const Config& dispatch_config, const Config& combine_config,
                     cudaStream_t stream)
    : buffer_(buffer),
      c_(experts_for(c, buffer.num_ranks())),
      dispatch_config_(dispatch_config),
      combine_config_(combine_config),
      stream_(stream) {
  rank_ = buffer.rank();
  num_ranks_ = buffer.num_ranks();
  internode_ = buffer.internode();
  num_nvl_ranks_ = buffer.num_nvl_ranks();
  num_domains_ = num_ranks_ / num_nvl_ranks_;
  num_tokens_ = c_.tokens_of(rank_);
  x_seed_ = mix(c_.seed, 0x0);
  const int R = num_ranks_, K = c_.routing.num_topk, E = c_.routing.num_experts;

  topk_.resize(R);
  weights_.resize(R);
  layouts_.resize(R);
  max_rows_ = 0;
  for (int s = 0; s < R; ++s) {
    make_topk(c_.routing, s, R, c_.tokens_of(s), topk_[s], weights_[s]);
    layouts_[s] = ref::dispatch_layout(topk_[s].data(), c_.tokens_of(s), K, E, R, internode_ ? num_nvl_ranks_ : 0);
    max_rows_ += c_.tokens_of(s);
  }
  for (int s = 0; s < R; ++s) {
    ref::Source src{c_.tokens_of(s), layouts_[s].is_token_in_rank.data(), topk_[s].data(), weights_[s].data()};
    routing_.push_back(src);
    if (!c_.with_topk) src.topk_idx = nullptr;
    if (!c_.with_topk || !c_.with_weights) src.topk_weights = nullptr;
    sources_.push_back(src);
  }
  expected_rows_ = ref::recv_rows(sources_, rank_);

  const int T = num_tokens_, C = num_channels(dispatch_config);
  topk_idx_.upload(topk_[rank_], stream);
  topk_weights_.upload(weights_[rank_], stream);
  num_tokens_per_rank_.resize(R);
  num_tokens_per_expert_.resize(E);
  is_token_in_rank_.resize(size_t(T) * R);
  rank_prefix_.resize(size_t(R) * R);
  channel_prefix_.resize(size_t(R) * C);
  recv_channel_prefix_.resize(size_t(R) * C);
  send_head_.resize(size_t(T) * R);
  recv_src_idx_.resize(max_rows_);
  recv_x_.resize(size_t(max_rows_) * row_bytes());
  recv_scales_.resize(size_t(max_rows_) * num_scales());
  recv_topk_idx_.resize(size_t(max_rows_) * K);
  recv_topk_weights_.resize(size_t(max_rows_) * K);
  expert_out_.resize(size_t(max_rows_) * c_.hidden);
  expert_weights_.resize(size_t(max_rows_) * K);
  bias0_.resize(size_t(T) * c_.hidden);
  bias1_.resize(size_t(T) * c_.hidden);
  combined_x_.resize(size_t(T) * c_.hidden);
  combined_weights_.resize(size_t(T) * K);
  num_tokens_per_rdma_rank_.resize(num_domains_);
  set_configs(dispatch_config, combine_config);
  // Poison outputs: a row the kernels forget to write cannot pass by accident.
  recv_x_.fill_bytes(0x7b, stream);
  recv_src_idx_.fill_bytes(0x7b, stream);
  combined_x_.fill_bytes(0x7b, stream);
  set_x(x_seed_);
}

void HtSession::set_configs(const Config& dispatch_config, const Config& combine_config) {
  dispatch_config_ = dispatch_config;
  combine_config_ = combine_config;
  // The per-channel handle arrays are [R, C] with C the dispatch config's channels.
  const size_t rc = size_t(num_ranks_) * num_channels(dispatch_config);
  channel_prefix_.resize(rc);
  recv_channel_prefix_.resize(rc);
  handle_ = DispatchHandle{};  // its arrays may have moved, and its channel count no longer matches
  if (!internode_) return;
  const int C = num_channels(dispatch_config), D = num_domains_, G = num_nvl_ranks_;
  net_handle_ = ref::internode_handle(routing_, rank_, G, C);
  rdma_channel_prefix_.resize(size_t(D) * C);
  recv_rdma_channel_prefix_.resize(size_t(D) * C);
  recv_rdma_rank_prefix_.resize(D);
  recv_gbl_rank_prefix_.resize(num_ranks_);
  send_rdma_head_.resize(size_t(num_tokens_) * D);
  const size_t rdma_rows = std::max<size_t>(net_handle_.send_nvl_head.size() / G, size_t(worst_tokens()));
  send_nvl_head_.resize(rdma_rows * G);
  recv_src_meta_.resize(size_t(max_rows_) * 2);
  recv_src_meta_.fill_bytes(0x7b, stream_);
  send_nvl_head_.fill_bytes(0x7b, stream_);
}

void HtSession::set_ring_sizes(const Config& dispatch_config, const Config& combine_config) {
  if (dispatch_config.num_sms != dispatch_config_.num_sms || combine_config.num_sms != combine_config_.num_sms)
    throw std::invalid_argument("set_ring_sizes: num_sms must stay as it was (use set_configs)");
  dispatch_config_ = dispatch_config;
  combine_config_ = combine_config;
}

double HtSession::net_bytes_remote() const {
  if (!internode_) return 0;
  const int C = int(net_handle_.recv_rdma_channel_prefix_matrix.size()) / num_domains_;
  const int d = rank_ / num_nvl_ranks_;
  double records = 0;
  for (int m = 0; m < num_domains_; ++m)
    if (m != d) records += net_handle_.recv_rdma_channel_prefix_matrix[size_t(m) * C + C - 1];
  return records * double(row_bytes() + int64_t(num_scales()) * 4);
}

int HtSession::worst_tokens() const {
  if (!c_.worst_case) return 0;
  return c_.worst_tokens_override > 0 ? c_.worst_tokens_override : max_rows_;
}

void HtSession::set_x(uint64_t seed) {
  x_seed_ = seed;
  const int T = num_tokens_, H = c_.hidden;
  // Generated on the device (same bits as expected_x_row): no host round trip that would idle the GPU.
  x_.resize(size_t(T) * row_bytes());
  if (c_.dtype == EPX_FP8_E4M3)
    fill_fp8_rows_device(seed, rank_, T, H, reinterpret_cast<uint8_t*>(x_.get()), stream_);
  else
    fill_bf16_rows_device(seed, rank_, T, H, reinterpret_cast<uint16_t*>(x_.get()), stream_);
  if (num_scales() > 0) {
    x_scales_.resize(scale_words());
    x_scales_.fill_bytes(0x7f, stream_);  // the words between padded scales: a kernel that reads one fails the check
    fill_scales_device(seed, rank_, T, num_scales(), x_scales_.get(), scale_stride_token(), scale_stride_group(),
                       stream_);
  }
  cuda_check(cudaStreamSynchronize(stream_), "set_x");
}

int64_t HtSession::scale_stride_token() const {
  switch (c_.scale_layout) {
    case ScaleLayout::kColumnMajor:
      return 1;
    case ScaleLayout::kPadded:
      return 2 * int64_t(num_scales()) + 3;
    default:
      return num_scales();
  }
}

int64_t HtSession::scale_stride_group() const {
  switch (c_.scale_layout) {
    case ScaleLayout::kColumnMajor:
      return std::max(num_tokens_, 1);
    case ScaleLayout::kPadded:
      return 2;
    default:
      return 1;
  }
}

size_t HtSession::scale_words() const {
  if (num_tokens_ == 0 || num_scales() == 0) return 0;
  return size_t((num_tokens_ - 1) * scale_stride_token() + (num_scales() - 1) * scale_stride_group() + 1);
}

void HtSession::expected_x_row(int src, int token, std::vector<uint8_t>& row) const {
  row.resize(row_bytes());
  if (c_.dtype == EPX_FP8_E4M3)
    fill_fp8_row(x_seed_, src, token, c_.hidden, row.data());
  else
    fill_bf16_row(x_seed_, src, token, c_.hidden, reinterpret_cast<uint16_t*>(row.data()));
}

void HtSession::layout() {
  LayoutArgs a{topk_idx_.get(), num_tokens_, c_.routing.num_topk, c_.routing.num_experts};
  LayoutOutputs o{num_tokens_per_rank_.get(), num_domains_ > 1 ? num_tokens_per_rdma_rank_.get() : nullptr,
                  num_tokens_per_expert_.get(), is_token_in_rank_.get()};
  buffer_.get_dispatch_layout(a, o, stream_);
}

DispatchArgs HtSession::dispatch_args() const {
  DispatchArgs a{};
  a.x = x_.get();
  a.dtype = c_.dtype;
  a.num_tokens = num_tokens_;
  a.hidden = c_.hidden;
  a.x_scales = num_scales() > 0 ? x_scales_.get() : nullptr;
  a.num_scales = num_scales();
  if (c_.scale_layout != ScaleLayout::kRowMajor) {  // row-major goes as 0 and 0, as callers that predate strides pass
    a.x_scales_stride_token = scale_stride_token();
    a.x_scales_stride_group = scale_stride_group();
  }
  a.topk_idx = c_.with_topk ? topk_idx_.get() : nullptr;
  a.topk_weights = c_.with_topk && c_.with_weights ? topk_weights_.get() : nullptr;
  a.num_topk = c_.with_topk ? c_.routing.num_topk : 0;
  a.num_experts = c_.routing.num_experts;
  a.num_tokens_per_rank = num_tokens_per_rank_.get();
  a.num_tokens_per_expert = num_tokens_per_expert_.get();
  a.is_token_in_rank = is_token_in_rank_.get();
  a.expert_alignment = c_.expert_alignment;
  a.num_worst_tokens = worst_tokens();
  return a;
}

DispatchOutputs HtSession::dispatch_outputs() const {
  DispatchOutputs o{};
  o.recv_x = recv_x_.get();
  o.recv_x_scales = num_scales() > 0 ? recv_scales_.get() : nullptr;
  o.recv_topk_idx = c_.with_topk ? recv_topk_idx_.get() : nullptr;
  o.recv_topk_weights = c_.with_topk && c_.with_weights ? recv_topk_weights_.get() : nullptr;
  o.num_rows = max_rows_;
  return o;
}

void HtSession::dispatch() {
  handle_ = DispatchHandle{};
  handle_.rank_prefix_matrix = rank_prefix_.get();
  handle_.channel_prefix_matrix = channel_prefix_.get();
  handle_.recv_channel_prefix_matrix = recv_channel_prefix_.get();
  handle_.send_head = send_head_.get();
  handle_.recv_src_idx = recv_src_idx_.get();
  if (internode_) {
    handle_.rdma_channel_prefix_matrix = rdma_channel_prefix_.get();
    handle_.recv_rdma_channel_prefix_matrix = recv_rdma_channel_prefix_.get();
    handle_.recv_rdma_rank_prefix_sum = recv_rdma_rank_prefix_.get();
    handle_.recv_gbl_rank_prefix_sum = recv_gbl_rank_prefix_.get();
    handle_.recv_src_meta = recv_src_meta_.get();
    handle_.send_rdma_head = send_rdma_head_.get();
    handle_.send_nvl_head = send_nvl_head_.get();
  }
  const DispatchArgs a = dispatch_args();
  if (c_.in_buffer) {
    counts_ = buffer_.dispatch_in_buffer(a, dispatch_config_, handle_, false, region_, stream_);
    return;
  }
  resized_ = false;
  const int offset = c_.sized_offset_of(rank_);
  if (c_.sized && !internode_ && offset != HtCase::kTwoStep) {
    DispatchOutputs o = dispatch_outputs();
    const int64_t guess = int64_t(expected_rows_.size()) + offset;
    if (!c_.worst_case) o.num_rows = int(std::min<int64_t>(std::max<int64_t>(guess, 0), max_rows_));
    counts_ = buffer_.dispatch_sized(a, dispatch_config_, handle_, o, stream_);
    if (counts_.num_recv_tokens >= 0 || c_.worst_case) return;  // worst-case mode: no host wait
    resized_ = true;  // every rank repeats: sized ranks here, the others inside notify_dispatch
  }
  counts_ = buffer_.notify_dispatch(a, dispatch_config_, handle_, stream_);
  buffer_.dispatch(a, dispatch_config_, handle_, dispatch_outputs(), stream_);
}

void HtSession::dispatch_cached() {
  if (c_.in_buffer) {
    buffer_.dispatch_in_buffer(dispatch_args(), dispatch_config_, handle_, true, region_, stream_);
    return;
  }
  buffer_.dispatch_cached(dispatch_args(), dispatch_config_, handle_, dispatch_outputs(), stream_);
}

void HtSession::set_combine_inputs(uint64_t seed) {
  combine_seed_ = seed;
  const int H = c_.hidden, K = c_.routing.num_topk, T = num_tokens_;
  const size_t rows = expected_rows_.size();
  std::vector<uint16_t> y(rows * H);
  std::vector<float> w(rows * K);
  for (size_t n = 0; n < rows; ++n) {
    const ref::RecvRow& r = expected_rows_[n];
    fill_bf16_row(mix(seed, kExpertOutSalt, rank_), r.src_rank, r.src_token, H, y.data() + n * H);
    for (int k = 0; k < K; ++k) w[n * K + k] = weight_value(mix(seed, rank_), r.src_rank, r.src_token, k);
  }
  expert_out_.upload(y, stream_);
  expert_weights_.upload(w, stream_);
  for (int b = 0; b < c_.num_biases; ++b) {
    std::vector<uint16_t> bias(size_t(T) * H);
    for (int t = 0; t < T; ++t) fill_bf16_row(mix(seed, kBiasSalt + b), rank_, t, H, bias.data() + size_t(t) * H);
    (b == 0 ? bias0_ : bias1_).upload(bias, stream_);
  }
  expert_out_.resize(std::max<size_t>(rows, size_t(worst_tokens())) * H);
  if (c_.in_buffer) {  // the combine reads them from every rank's output region
    const RecvRegionViews v = buffer_.combine_region(H, combine_topk());
    cuda_check(cudaMemcpyAsync(v.recv_x, expert_out_.get(), rows * H * 2, cudaMemcpyDeviceToDevice, stream_),
               "combine rows to the region");
    if (combine_topk() > 0)
      cuda_check(
          cudaMemcpyAsync(v.recv_topk_weights, expert_weights_.get(), rows * K * 4, cudaMemcpyDeviceToDevice, stream_),
          "combine weights to the region");
  }
  cuda_check(cudaStreamSynchronize(stream_), "set_combine_inputs");
}

void HtSession::combine() {
  CombineArgs a{};
  a.x = expert_out_.get();
  a.num_rows = worst_tokens() > 0 ? worst_tokens() : int(expected_rows_.size());
  a.hidden = c_.hidden;
  a.topk_weights = c_.combine_weights ? expert_weights_.get() : nullptr;
  a.num_topk = combine_topk();
  a.bias0 = c_.num_biases >= 1 ? bias0_.get() : nullptr;
  a.bias1 = c_.num_biases >= 2 ? bias1_.get() : nullptr;
  a.reduction = c_.reduction;
  CombineOutputs o{combined_x_.get(), c_.combine_weights ? combined_weights_.get() : nullptr};
  if (c_.in_buffer) {
    const RecvRegionViews v = buffer_.combine_region(c_.hidden, a.num_topk);
    a.x = v.recv_x;
    a.topk_weights = v.recv_topk_weights;
    buffer_.combine_in_buffer(a, combine_config_, handle_, o, stream_);
    return;
  }
  buffer_.combine(a, combine_config_, handle_, o, stream_);
}

std::string HtSession::check_layout() const {
  const ref::Layout& want = layouts_[rank_];
  Mismatches m("layout");
  const auto per_rank = num_tokens_per_rank_.download(num_ranks_, stream_);
  const auto per_expert = num_tokens_per_expert_.download(c_.routing.num_experts, stream_);
  const auto in_rank = is_token_in_rank_.download(size_t(num_tokens_) * num_ranks_, stream_);
  for (int r = 0; r < num_ranks_; ++r)
    m.expect_eq(per_rank[r], want.num_tokens_per_rank[r], "num_tokens_per_rank" + at(r));
  for (int e = 0; e < c_.routing.num_experts; ++e)
    m.expect_eq(per_expert[e], want.num_tokens_per_expert[e], "num_tokens_per_expert" + at(e));
  for (size_t i = 0; i < in_rank.size(); ++i)
    m.expect_eq(int(in_rank[i] != 0), int(want.is_token_in_rank[i]),
                "is_token_in_rank" + at(int(i / num_ranks_), int(i % num_ranks_)));
  if (num_domains_ > 1) {
    const auto per_domain = num_tokens_per_rdma_rank_.download(num_domains_, stream_);
    for (int d = 0; d < num_domains_; ++d)
      m.expect_eq(per_domain[d], want.num_tokens_per_rdma_rank[d], "num_tokens_per_rdma_rank" + at(d));
  }
  return m.str();
}

std::string HtSession::check_dispatch() const {
  const int R = num_ranks_, K = c_.routing.num_topk, S = num_scales();
  const int N = int(expected_rows_.size());
  Mismatches m("dispatch");
  if (!c_.worst_case) {
    m.expect_eq(counts_.num_recv_tokens, N, "num_recv_tokens");
    const ref::RecvMeta full =
        ref::dispatch_meta(routing_, rank_, K, c_.routing.num_experts, c_.expert_alignment, true, true);
    m.expect_eq(counts_.num_recv_tokens_per_expert.size(), full.num_recv_tokens_per_expert.size(), "experts");
    for (size_t i = 0; i < counts_.num_recv_tokens_per_expert.size() && i < full.num_recv_tokens_per_expert.size(); ++i)
      m.expect_eq(counts_.num_recv_tokens_per_expert[i], full.num_recv_tokens_per_expert[i],
                  "num_recv_tokens_per_expert" + at(int(i)));
  }
  if (internode_) {
    check_internode_handle(m);
  } else {
    const auto prefix = rank_prefix_.download(size_t(R) * R, stream_);
    const auto want_prefix = ref::rank_prefix_matrix(sources_);
    for (int i = 0; i < R * R; ++i) m.expect_eq(prefix[i], want_prefix[i], "rank_prefix_matrix" + at(i / R, i % R));
  }

  const int rows = c_.worst_case ? worst_tokens() : N;
  const auto recv_x = download_from(out_x(), size_t(rows) * row_bytes(), stream_);
  const auto src_idx = internode_ ? std::vector<int>(rows, -1) : download_from(out_src_idx(), rows, stream_);
  const ref::RecvMeta meta = ref::dispatch_meta(sources_, rank_, K, c_.routing.num_experts, c_.expert_alignment,
                                                c_.with_topk, c_.with_topk && c_.with_weights);
  std::vector<uint8_t> want_row;
  for (int n = 0; n < N; ++n) {
    const ref::RecvRow& r = expected_rows_[n];
    expected_x_row(r.src_rank, r.src_token, want_row);
    const uint8_t* got = recv_x.data() + size_t(n) * row_bytes();
    if (std::memcmp(got, want_row.data(), want_row.size()) != 0) {
      size_t b = 0;
      while (got[b] == want_row[b]) ++b;
      m.fail("recv_x" + at(n) + " (from rank " + std::to_string(r.src_rank) + " token " + std::to_string(r.src_token) +
             ") differs at byte " + std::to_string(b));
    }
    if (!internode_) m.expect_eq(src_idx[n], meta.recv_src_idx[n], "recv_src_idx" + at(n));
  }
  if (S > 0) {
    const auto scales = download_from(out_scales(), size_t(rows) * S, stream_);
    std::vector<float> want(S);
    for (int n = 0; n < N; ++n) {
      fill_scales(x_seed_, expected_rows_[n].src_rank, expected_rows_[n].src_token, S, want.data());
      for (int i = 0; i < S; ++i)
        m.expect_eq(bits(scales[size_t(n) * S + i]), bits(want[i]), "recv_x_scales" + at(n, i));
    }
  }
  if (c_.with_topk) {
    const auto idx = download_from(out_topk_idx(), size_t(rows) * K, stream_);
    for (int i = 0; i < N * K; ++i) m.expect_eq(idx[i], meta.recv_topk_idx[i], "recv_topk_idx" + at(i / K, i % K));
    for (int i = N * K; i < rows * K; ++i) m.expect_eq(idx[i], int64_t(-1), "padding recv_topk_idx" + at(i / K, i % K));
    if (c_.with_weights) {
      const auto w = download_from(out_topk_weights(), size_t(rows) * K, stream_);
      for (int i = 0; i < N * K; ++i)
        m.expect_eq(bits(w[i]), bits(meta.recv_topk_weights[i]), "recv_topk_weights" + at(i / K, i % K));
      for (int i = N * K; i < rows * K; ++i)
        m.expect_eq(bits(w[i]), bits(0.f), "padding recv_topk_weights" + at(i / K, i % K));
    }
  }
  for (int n = N; n < rows; ++n) m.expect_eq(src_idx[n], -1, "padding recv_src_idx" + at(n));
  return m.str();
}

std::string HtSession::check_combine() const {
  const int H = c_.hidden, K = c_.routing.num_topk, T = num_tokens_;
  std::vector<std::vector<uint16_t>> rows(num_ranks_, std::vector<uint16_t>(H));
  std::vector<std::vector<float>> ws(num_ranks_, std::vector<float>(K));
  const uint64_t seed = combine_seed_;
  const int me = rank_;
  auto row = [&](int j, int t) -> const uint16_t* {
    fill_bf16_row(mix(seed, kExpertOutSalt, j), me, t, H, rows[j].data());
    return rows[j].data();
  };
  auto weights = [&](int j, int t) -> const float* {
    for (int k = 0; k < K; ++k) ws[j][k] = weight_value(mix(seed, j), me, t, k);
    return ws[j].data();
  };
  std::vector<uint16_t> b0, b1;
  if (c_.num_biases >= 1) b0 = bias0_.download(size_t(T) * H, stream_);
  if (c_.num_biases >= 2) b1 = bias1_.download(size_t(T) * H, stream_);
  const ref::ContributionWeights wfn = c_.combine_weights ? ref::ContributionWeights(weights) : nullptr;
  const uint16_t* bias0 = b0.empty() ? nullptr : b0.data();
  const uint16_t* bias1 = b1.empty() ? nullptr : b1.data();
  const ref::Combined want =
      internode_ && c_.reduction != EPX_REDUCE_FLAT
          ? ref::combine_two_level(sources_[me], num_ranks_, num_nvl_ranks_, H, K, row, wfn, bias0, bias1)
          : ref::combine(sources_[me], num_ranks_, H, K, row, wfn, bias0, bias1);
  Mismatches m("combine");
  const auto got = combined_x_.download(size_t(T) * H, stream_);
  for (size_t i = 0; i < got.size(); ++i) m.expect_eq(got[i], want.x[i], "combined_x" + at(int(i / H), int(i % H)));
  if (c_.combine_weights) {
    const auto w = combined_weights_.download(size_t(T) * K, stream_);
    for (size_t i = 0; i < w.size(); ++i)
      m.expect_eq(bits(w[i]), bits(want.weights[i]), "combined_topk_weights" + at(int(i / K), int(i % K)));
  }
  return m.str();
}

void HtSession::check_internode_handle(Mismatches& m) const {
  const ref::InternodeHandle& w = net_handle_;
  if (!c_.worst_case)
    m.expect_eq(counts_.num_rdma_recv_tokens, int(w.send_nvl_head.size()) / num_nvl_ranks_, "num_rdma_recv_tokens");
  auto same = [&](const DeviceArray<int>& got, const std::vector<int>& want, const char* name) {
    const auto g = got.download(want.size(), stream_);
    for (size_t i = 0; i < want.size(); ++i) m.expect_eq(g[i], want[i], std::string(name) + at(int(i)));
  };
  same(rdma_channel_prefix_, w.rdma_channel_prefix_matrix, "rdma_channel_prefix_matrix");
  same(channel_prefix_, w.gbl_channel_prefix_matrix, "gbl_channel_prefix_matrix");
  same(recv_rdma_channel_prefix_, w.recv_rdma_channel_prefix_matrix, "recv_rdma_channel_prefix_matrix");
  same(recv_rdma_rank_prefix_, w.recv_rdma_rank_prefix_sum, "recv_rdma_rank_prefix_sum");
  same(recv_channel_prefix_, w.recv_gbl_channel_prefix_matrix, "recv_gbl_channel_prefix_matrix");
  same(recv_gbl_rank_prefix_, w.recv_gbl_rank_prefix_sum, "recv_gbl_rank_prefix_sum");
  same(send_rdma_head_, w.send_rdma_head, "send_rdma_head");
  same(send_nvl_head_, w.send_nvl_head, "send_nvl_head");
  const auto meta = recv_src_meta_.download(w.recv_src_meta.size(), stream_);
  for (size_t i = 0; i < w.recv_src_meta.size(); ++i)
    m.expect_eq(meta[i], w.recv_src_meta[i], "recv_src_meta" + at(int(i / 2), int(i % 2)));
  if (c_.worst_case) {
    const size_t rows = size_t(worst_tokens());
    const auto all = recv_src_meta_.download(rows * 2, stream_);
    for (size_t i = w.recv_src_meta.size(); i < rows * 2; i += 2)
      m.expect_eq(all[i], -1, "padding recv_src_meta" + at(int(i / 2)));
  }
}

std::vector<uint8_t> HtSession::received_bytes() const {
  const size_t rows = expected_rows_.size();
  std::vector<uint8_t> out = download_from(out_x(), rows * row_bytes(), stream_);
  if (num_scales() > 0) {
    const auto scales = download_from(out_scales(), rows * num_scales(), stream_);
    const auto* p = reinterpret_cast<const uint8_t*>(scales.data());
    out.insert(out.end(), p, p + scales.size() * sizeof(float));
  }
  return out;
}

std::vector<uint16_t> HtSession::combined_bytes() const {
  return combined_x_.download(size_t(num_tokens_) * c_.hidden, stream_);
}

double HtSession::recv_bytes() const {
  return double(expected_rows_.size()) * double(row_bytes() + int64_t(num_scales()) * 4);
}

double HtSession::combine_bytes() const { return double(expected_rows_.size()) * c_.hidden * 2.0; }

}  // namespace epx::harness
