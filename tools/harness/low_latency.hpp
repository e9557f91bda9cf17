// One rank's side of a low-latency scenario: inputs generated per step from a seed, dispatch and combine
// (with or without the receive hook, zero-copy or not), checked against the reference model. Device pointers
// never move after construction, so the calls can be captured in a CUDA graph and replayed with new data.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "device_array.hpp"
#include "epx/epx.hpp"
#include "epx/reference.hpp"
#include "gen.hpp"

namespace epx::harness {

struct LowLatencyCase {
  std::string name;
  std::vector<int> tokens{128};  // per rank (one value: every rank), each <= max_tokens
  int max_tokens = 128;          // M
  int hidden = 7168;
  int num_experts = 288;
  int num_topk = 8;
  bool fp8 = true;
  bool round_scale = false;
  bool ue8m0 = false;
  bool zero_copy = false;
  bool logfmt = false;           // combine with use_logfmt (docs/logfmt.md), checked against the LogFMT reference
  bool rank_reduced = false;     // dispatch with topk_weights, combine in the rank-reduced order (EPX_REDUCE_RANK)
  bool expert_identity = false;  // combine input = the dispatch's packed_recv_x (BF16 only): graph friendly
  Routing routing = Routing::kUniform;
  double empty_slot_prob = 0.0;
  uint64_t seed = 1;
  int tokens_of(int rank) const { return tokens.size() == 1 ? tokens[0] : tokens.at(rank); }
};

class LowLatencySession {
 public:
  LowLatencySession(Buffer& buffer, const LowLatencyCase& c, cudaStream_t stream);

  // New routing and x (and combine weights) for the next step, uploaded into the same device arrays.
  void set_step(uint64_t seed);
  // Rank masking (enable_shrink): the mask this rank's calls run under (one entry per rank, nonzero = masked; empty:
  // none). The expected outputs follow the reference model under it (ref::low_latency_rows_masked, mask_topk_slots).
  void set_mask(const std::vector<int32_t>& mask);
  // A dispatch of this step ran outside dispatch() (a graph replay): count it in the expected statistics.
  void note_replayed_dispatch();
  // kLowLatencySendPhase, kLowLatencyRecvPhase or both. `counted`: false while capturing a graph (the
  // dispatch does not run then; each replay is counted with note_replayed_dispatch).
  void dispatch(int phases, bool counted = true);
  // The receive of this session's sent dispatch with use_fp8 replaced (for tests of the Buffer's checks).
  void receive_with_fp8(bool fp8);
  // Expert outputs for the next combine, at the packed positions of the reference model (zero-copy: written
  // into the buffer's next combine area).
  void set_combine_inputs(uint64_t seed);
  void combine(int phases);
  // combine(phases) with use_logfmt replaced (for tests of the Buffer's checks).
  void combine_with_logfmt(int phases, bool logfmt);
  // combine(phases) with the reduction order replaced (EPX_REDUCE_*; for tests of the Buffer's checks).
  void combine_with_reduction(int phases, int reduction);
  // combine(phases) with combined_x at x, the expert outputs (for tests of the Buffer's checks).
  void combine_over_input(int phases);
  // The order of the next combines and checks: rank-reduced (needs a case with rank_reduced, whose dispatches
  // carry the weights) or flat. The case's rank_reduced at first.
  void set_combine_rank_reduced(bool rank_reduced);

  std::string check_dispatch() const;
  std::string check_combine() const;

  double dispatch_bytes() const;  // bytes this rank receives in dispatch (rows incl. scales)
  double combine_bytes() const;   // rows this rank receives back in combine (bf16, or LogFMT with logfmt)
  // Rows the combine moves, per peer rank: those this rank returns to each source (its local experts' rows
  // from that source) and those each rank returns to this one (this rank's slots at that rank's experts).
  std::vector<size_t> combine_rows_to() const;
  std::vector<size_t> combine_rows_from() const;
  int num_local_experts() const { return num_experts_ / num_ranks_; }

 private:
  LowLatencyDispatchArgs dispatch_args() const;
  LowLatencyCombineArgs combine_args() const;
  void expected_row(int src, int token, std::vector<uint16_t>& row) const;

  Buffer& buffer_;
  LowLatencyCase c_;
  cudaStream_t stream_;
  int rank_, num_ranks_, num_experts_, num_tokens_;
  uint64_t step_seed_ = 0, combine_seed_ = 0;
  std::vector<std::vector<int64_t>> topk_;
  std::vector<std::vector<float>> weights_;
  std::vector<std::vector<ref::RecvRow>> rows_;  // per local expert
  std::vector<int32_t> mask_;                    // empty: no rank masked
  void route();                                  // rows_ from topk_ and mask_
  std::vector<int> expected_stats_;

  DeviceArray<uint16_t> x_;
  DeviceArray<int64_t> topk_idx_;
  DeviceArray<float> topk_weights_;
  DeviceArray<int> stats_;
  DeviceArray<uint8_t> packed_x_;
  DeviceArray<int32_t> packed_scales_;
  DeviceArray<int> packed_count_, src_info_;
  DeviceArray<int64_t> layout_range_;
  DeviceArray<int32_t> topk_slots_;  // [R, M, K, 2] with rank_reduced
  DeviceArray<uint16_t> expert_out_, combined_;
  LowLatencyHandle handle_{};
  int combine_set_ = -1;
  bool combine_rank_ = false;  // the combine's order (set_combine_rank_reduced)
};

}  // namespace epx::harness
