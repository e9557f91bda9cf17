// The operations of each mode, behind the public Buffer methods (runtime/buffer_ops.cpp, which checks the buffer
// is usable and picks the mode). One file per mode: runtime/intranode_ops.cpp, runtime/internode_ops.cpp,
// runtime/low_latency_ops.cpp.
#pragma once

#include "layout/intranode_params.hpp"
#include "layout/scales.hpp"
#include "runtime/buffer_impl.hpp"

namespace epx {

// What the intranode and internode modes fill alike in their kernels' parameters (each mode has its own structs,
// with these fields under the same names); each mode sets the rest.

// A notify with counts (NotifyParams, InternodeNotifyParams): the buffer, the caller's counts and options, and the
// host sequence number it publishes the counts under (worst-case mode: 0, not waited for). Each caller sets its own
// row bound (intranode NotifyParams.row_bound, internode num_worst_tokens).
template <typename NotifyParamsT>
void fill_notify_params(NotifyParamsT& p, Buffer::Impl& b, const DispatchArgs& a, int num_channels) {
  p.fail = b.fail_state();
  p.peers = b.peer_map;
  p.num_ranks = b.num_ranks;
  p.num_tokens_per_rank = a.num_tokens_per_rank;
  p.num_tokens_per_expert = a.num_tokens_per_expert;
  p.num_tokens = a.num_tokens;
  p.num_experts = a.num_tokens_per_expert != nullptr ? a.num_experts : 0;
  p.num_channels = num_channels;
  p.expert_alignment = a.expert_alignment > 0 ? a.expert_alignment : 1;
  p.host_seq = a.num_worst_tokens == 0 ? ++b.host_seq : 0;
  if (b.host_seq == (1 << 30)) b.host_seq = 0;
}

// A dispatch (DispatchParams, InternodeDispatchParams): the buffer, the caller's tokens (x of x_bytes a row, its
// scales, top-k) and the outputs.
template <typename DispatchParamsT>
void fill_dispatch_params(DispatchParamsT& p, const Buffer::Impl& b, const DispatchArgs& a, const DispatchHandle& h,
                          const DispatchOutputs& o, int64_t x_bytes) {
  p.fail = b.fail_state();
  p.peers = b.peer_map;
  p.num_ranks = b.num_ranks;
  p.num_channels = h.num_channels;
  p.num_tokens = a.num_tokens;
  p.x_int4 = int(x_bytes / 16);
  p.num_scales = a.dtype == EPX_FP8_E4M3 ? a.num_scales : 0;
  p.num_topk = a.num_topk;
  p.experts_per_rank = a.num_topk > 0 ? a.num_experts / b.num_ranks : 0;
  p.x = static_cast<const int4*>(a.x);
  p.x_scales = ScaleView::of(a.x_scales, a.num_scales, a.x_scales_stride_token, a.x_scales_stride_group);
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.recv_x = static_cast<int4*>(o.recv_x);
  p.recv_x_scales = o.recv_x_scales;
  p.recv_topk_idx = o.recv_topk_idx;
  p.recv_topk_weights = o.recv_topk_weights;
  p.num_worst_tokens = a.num_worst_tokens;
}

// A combine (CombineParams, InternodeCombineParams): the buffer, the caller's rows, weights and biases, and the
// outputs.
template <typename CombineParamsT>
void fill_combine_params(CombineParamsT& p, const Buffer::Impl& b, const CombineArgs& a, const DispatchHandle& h,
                         const CombineOutputs& o) {
  p.fail = b.fail_state();
  p.peers = b.peer_map;
  p.num_ranks = b.num_ranks;
  p.num_channels = h.num_channels;
  p.num_tokens = h.num_tokens;
  p.num_topk = a.num_topk;
  p.x = static_cast<const int4*>(a.x);
  p.topk_weights = a.topk_weights;
  p.bias0 = static_cast<const int4*>(a.bias0);
  p.bias1 = static_cast<const int4*>(a.bias1);
  p.combined_x = static_cast<int4*>(o.combined_x);
  p.combined_topk_weights = o.combined_topk_weights;
}

// Mode-neutral (runtime/intranode_ops.cpp).
void get_dispatch_layout(Buffer::Impl& b, const LayoutArgs& a, const LayoutOutputs& o, cudaStream_t stream,
                         const char* op);
// A dispatch's outputs hold `rows` rows (num_worst_tokens, or the tokens the notify counted): enough rows, recv_x
// 16-byte aligned, the handle's per-row source array src_rows (src_rows_missing: what to say when it is null) and,
// for FP8, recv_x_scales.
void check_dispatch_outputs(const DispatchArgs& a, const DispatchOutputs& o, int rows, const void* src_rows,
                            const char* src_rows_missing, const char* op);
// After a notify launched under host sequence number host_seq: waits for its counts, raises an input error the
// notify found, and returns the received tokens (also set in h.num_recv_tokens) and the tokens per local expert
// (num_experts: the notify's, 0 without per-expert counts).
DispatchCounts wait_dispatch_counts(Buffer::Impl& b, int host_seq, int num_experts, DispatchHandle& h,
                                    cudaStream_t stream, const char* op);
// The same once the host has seen the counts (Buffer::Impl::wait_notify).
DispatchCounts read_dispatch_counts(Buffer::Impl& b, int num_experts, DispatchHandle& h, cudaStream_t stream,
                                    const char* op);
// The collective barrier kernel (the notify kernel without the count exchange: the epoch barrier alone): every
// rank's earlier operations on its stream are done, and every rank agrees on the operation's signature. Cached
// dispatch and combine run the same barrier inside their data kernel instead (kernels/intranode/epoch_barrier.cuh).
void launch_barrier(Buffer::Impl& b, int signature, cudaStream_t stream, const char* op);

namespace intranode {
// Operation kinds of the signature that every rank of an operation must agree on (NotifyMsg::kSignature).
constexpr int kOpDispatch = 1, kOpCombine = 2, kOpDispatchInBuffer = 3, kOpCombineInBuffer = 4;
int op_signature(int op_kind, int64_t record_bytes, const Config& c);
// A handle usable with this buffer, config and token count (else kInvalidArgument).
void validate_handle(const DispatchHandle& h, const Buffer::Impl& b, const Config& c, int num_tokens, const char* op);

// Checks the handle's arrays, fills its fields and returns the notify's parameters of a dispatch with a layout
// (recv_capacity > 0: the output region's rows, checked for every rank), which the caller runs.
NotifyParams dispatch_notify_params(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                    int signature, int recv_capacity, const char* op);
// The same, with the notify kernel queued; returns its parameters (host_seq, num_experts).
NotifyParams launch_dispatch_notify(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                    int signature, int recv_capacity, cudaStream_t stream, const char* op);
// The count exchange, with the host's wait unless worst-case mode. Repeats the exchange while a peer's guess was too
// small (kVerdictResize).
DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op);
// The count exchange and the data kernel queued back to back (one grid where the device has an SM for the notify)
// into outputs of o.num_rows rows (a guess), then the host's wait. num_recv_tokens -1 in the result: some rank's rows
// did not fit, no rank moved data, and the caller repeats the dispatch with notify_dispatch and dispatch (its peers
// repeat their count exchange by themselves). In worst-case mode (num_worst_tokens > 0, at most o.num_rows) the same
// launch without the host's wait: empty counts, as notify_dispatch gives.
DispatchCounts dispatch_sized(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                              const DispatchOutputs& o, cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op);
void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op);
// The data kernel into the output region with the notify as its last block (unless cached, or where the device has
// no SM for it: then a notify kernel before it), then the host's wait for the counts.
DispatchCounts dispatch_in_buffer(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                  bool cached, RecvRegionViews& views, cudaStream_t stream, const char* op);
void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op);
// runtime/in_buffer_ops.cpp: where a combine from the buffer reads this rank's rows (hidden * 2 bytes each) and
// weights, and the combine itself (args.x / topk_weights must be those views).
RecvRegionViews combine_region(const Buffer::Impl& b, int hidden, int num_topk, const char* op);
void combine_in_buffer(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h,
                       const CombineOutputs& o, cudaStream_t stream, const char* op);
}  // namespace intranode

namespace internode {
DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op);
void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op);
void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op);
}  // namespace internode

namespace low_latency {
void clean(Buffer::Impl& b, cudaStream_t stream, const char* op);
void dispatch(Buffer::Impl& b, const LowLatencyDispatchArgs& a, const LowLatencyDispatchOutputs& o, int phases,
              LowLatencyHandle& h, cudaStream_t stream, const char* op);
int combine(Buffer::Impl& b, const LowLatencyCombineArgs& a, const LowLatencyHandle& h, void* combined_x, int phases,
            int buffer_set, cudaStream_t stream, const char* op);
void* next_combine_buffer(Buffer::Impl& b, const LowLatencyHandle& h, const char* op);
// Rank masking (runtime/low_latency_mask.cpp).
void update_mask(Buffer::Impl& b, int rank, bool mask, cudaStream_t stream, const char* op);
void query_mask(Buffer::Impl& b, int32_t* out, cudaStream_t stream, const char* op);
void clean_mask(Buffer::Impl& b, cudaStream_t stream, const char* op);
}  // namespace low_latency

}  // namespace epx
