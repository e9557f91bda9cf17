// One rank's side of a high-throughput scenario (intranode, or internode when the Buffer spans several NVLink
// domains): generates its inputs, runs layout / dispatch / combine on a Buffer, and checks every output against
// the reference model. Shared by the GPU tests and epx-bench.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "device_array.hpp"
#include "epx/epx.hpp"
#include "epx/reference.hpp"
#include "gen.hpp"

namespace epx::harness {

// Where an FP8 input's scales sit: row-major (the C ABI's strides 0 and 0), column-major [T, S] (strides 1 and T, as
// grouped GEMMs keep them), or padded (strides 2S + 3 and 2: unused words between tokens and between scales, which
// set_x poisons).
enum class ScaleLayout { kRowMajor, kColumnMajor, kPadded };

struct HtCase {
  std::string name;
  std::vector<int> tokens{4096};  // per rank; one value means the same on every rank
  int hidden = 7168;
  epx_dtype dtype = EPX_BF16;
  int num_scales = 0;  // FP8: scales per token; 0 means hidden / 128
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  bool with_topk = true;     // pass topk_idx to dispatch
  bool with_weights = true;  // pass topk_weights to dispatch
  RoutingSpec routing;
  int expert_alignment = 1;
  bool worst_case = false;        // num_worst_tokens = the sum of all ranks' tokens (no host wait)
  int worst_tokens_override = 0;  // > 0: use this num_worst_tokens instead (to provoke the overflow error)
  int num_biases = 0;             // 0, 1 or 2 bias tensors in combine
  bool combine_weights = true;
  int reduction = EPX_REDUCE_DEFAULT;  // the combine's order (internode: two-level by default, or flat)
  bool in_buffer = false;              // dispatch into the Buffer's output region, combine from it
  // Ring dispatch with a layout into outputs sized by a guess (Buffer::dispatch_sized), then notify_dispatch and
  // dispatch if a rank's rows did not fit. The guess is this rank's rows + sized_offset_of(rank), within [0, the sum of
  // all ranks' tokens]; kTwoStep: this rank calls notify_dispatch and dispatch (ranks may mix the two). With
  // worst_case, dispatch_sized runs worst-case mode in one launch (the offset only tells kTwoStep).
  bool sized = false;
  std::vector<int> sized_offset{0};  // per rank; one value means the same on every rank
  static constexpr int kTwoStep = -(1 << 30);
  static constexpr int kLargest = 1 << 30;  // the guess is the sum of all ranks' tokens
  uint64_t seed = 1;
  int tokens_of(int rank) const { return tokens.size() == 1 ? tokens[0] : tokens.at(rank); }
  int sized_offset_of(int rank) const { return sized_offset.size() == 1 ? sized_offset[0] : sized_offset.at(rank); }
};

// The case with its expert count rounded up to a multiple of the rank count (3 ranks: 64 experts become 66), so every
// case runs at every rank count; HtSession runs this.
HtCase experts_for(HtCase c, int num_ranks);

class Mismatches;  // high_throughput.cpp: the first few differences a check found

class HtSession {
 public:
  HtSession(Buffer& buffer, const HtCase& c, const Config& dispatch_config, const Config& combine_config,
            cudaStream_t stream);

  void layout();
  void dispatch();         // notify (+ bounded host wait unless worst-case) + data
  void dispatch_cached();  // same routing, current x, no count exchange
  void combine();
  void set_x(uint64_t seed);               // regenerates and uploads this rank's x (and scales)
  void set_combine_inputs(uint64_t seed);  // expert outputs, weights and biases for the next combine
  // Switches to other configs without regenerating data (benchmark sweeps). Drops the handle: call dispatch()
  // before dispatch_cached() or combine().
  void set_configs(const Config& dispatch_config, const Config& combine_config);
  void set_reduction(int reduction) { c_.reduction = reduction; }
  // Other ring sizes (num_max_send_tokens, num_max_recv_tokens) for the next calls, keeping the handle: num_sms must
  // be the current configs' (the handle's channels follow it).
  void set_ring_sizes(const Config& dispatch_config, const Config& combine_config);

  // "" when equal to the reference model, else the first mismatches.
  std::string check_layout() const;
  std::string check_dispatch() const;
  std::string check_combine() const;

  int num_recv_tokens() const { return int(expected_rows_.size()); }
  // The last dispatch went through dispatch_sized and a rank's rows did not fit (this rank then repeated it).
  bool last_dispatch_resized() const { return resized_; }
  bool internode() const { return internode_; }
  // Internode: records this rank's network rings receive, and rows of them that came from another domain.
  int num_rdma_recv_tokens() const { return int(net_handle_.send_nvl_head.size()) / num_nvl_ranks_; }
  double net_bytes_remote() const;
  // Tokens rank src sends to rank dst under this routing (the reference layout), e.g. for an all-to-all baseline.
  int num_tokens_routed(int src, int dst) const { return layouts_.at(src).num_tokens_per_rank.at(dst); }
  // The outputs as they are on the device: recv_x rows (and scales) of the dispatch, combined_x of the last combine.
  std::vector<uint8_t> received_bytes() const;
  std::vector<uint16_t> combined_bytes() const;
  double recv_bytes() const;     // dispatch: rows received here (own included) x (row + scale bytes)
  double combine_bytes() const;  // combine: the same rows as bf16
  const DispatchHandle& handle() const { return handle_; }

 private:
  DispatchArgs dispatch_args() const;
  DispatchOutputs dispatch_outputs() const;
  int64_t row_bytes() const { return int64_t(c_.hidden) * (c_.dtype == EPX_FP8_E4M3 ? 1 : 2); }
  int combine_topk() const { return c_.combine_weights ? c_.routing.num_topk : 0; }
  int num_scales() const {
    if (c_.dtype != EPX_FP8_E4M3) return 0;
    return c_.num_scales > 0 ? c_.num_scales : c_.hidden / epx::limits().fp8_group_size;
  }
  // Element strides of x_scales_ (token, scale) as laid out, and the words they span.
  int64_t scale_stride_token() const;
  int64_t scale_stride_group() const;
  size_t scale_words() const;
  int worst_tokens() const;
  void expected_x_row(int src_rank, int token, std::vector<uint8_t>& row) const;
  void check_internode_handle(Mismatches& m) const;

  Buffer& buffer_;
  HtCase c_;
  Config dispatch_config_, combine_config_;
  cudaStream_t stream_;
  int rank_, num_ranks_, num_tokens_, max_rows_;
  uint64_t x_seed_, combine_seed_ = 0;

  // Reference view of every rank's routing.
  std::vector<std::vector<int64_t>> topk_;
  std::vector<std::vector<float>> weights_;
  std::vector<ref::Layout> layouts_;
  std::vector<ref::Source> sources_;  // as dispatch sees them (top-k only if passed)
  std::vector<ref::Source> routing_;  // always with top-k (per-expert counts)
  std::vector<ref::RecvRow> expected_rows_;

  // Device data of this rank.
  DeviceArray<int64_t> topk_idx_;
  DeviceArray<float> topk_weights_;
  DeviceArray<uint8_t> x_;
  DeviceArray<float> x_scales_;
  DeviceArray<int> num_tokens_per_rank_, num_tokens_per_expert_;
  DeviceArray<uint8_t> is_token_in_rank_;
  DeviceArray<int> rank_prefix_, channel_prefix_, recv_channel_prefix_, send_head_, recv_src_idx_;
  DeviceArray<uint8_t> recv_x_;
  DeviceArray<float> recv_scales_;
  DeviceArray<int64_t> recv_topk_idx_;
  DeviceArray<float> recv_topk_weights_;
  DeviceArray<uint16_t> expert_out_, bias0_, bias1_, combined_x_;
  DeviceArray<float> expert_weights_, combined_weights_;
  // Internode buffers: the handle arrays only that mode has, and what the reference model says of this rank.
  bool internode_ = false;
  int num_nvl_ranks_ = 1, num_domains_ = 1;
  ref::InternodeHandle net_handle_;
  DeviceArray<int> num_tokens_per_rdma_rank_, rdma_channel_prefix_, recv_rdma_channel_prefix_, recv_rdma_rank_prefix_,
      recv_gbl_rank_prefix_, send_rdma_head_, send_nvl_head_;
  DeviceArray<int32_t> recv_src_meta_;

  DispatchHandle handle_{};
  DispatchCounts counts_;
  bool resized_ = false;
  RecvRegionViews region_{};  // in_buffer: where the last dispatch wrote its outputs

  // The last dispatch's outputs: region_'s views in in_buffer mode, else this session's arrays.
  const uint8_t* out_x() const { return c_.in_buffer ? static_cast<const uint8_t*>(region_.recv_x) : recv_x_.get(); }
  const float* out_scales() const { return c_.in_buffer ? region_.recv_x_scales : recv_scales_.get(); }
  const int64_t* out_topk_idx() const { return c_.in_buffer ? region_.recv_topk_idx : recv_topk_idx_.get(); }
  const float* out_topk_weights() const { return c_.in_buffer ? region_.recv_topk_weights : recv_topk_weights_.get(); }
  const int* out_src_idx() const { return c_.in_buffer ? region_.recv_src_idx : recv_src_idx_.get(); }
};

}  // namespace epx::harness
