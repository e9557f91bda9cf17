// Parameters of the high-throughput kernels and their launch functions. Filled by the host runtime
// (runtime/intranode_ops.cpp), read by the kernels (kernels/layout.cu, kernels/intranode/). Plain data: passed by
// value.
#pragma once

#include <vector_types.h>  // int4

#include <cstdint>

#include "layout/channels.hpp"
#include "layout/fail_state.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/peer_map.hpp"
#include "layout/recv_region.hpp"
#include "layout/scales.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace epx {

struct LayoutParams {
  const int64_t* topk_idx;
  int num_tokens;
  int num_topk;
  int num_experts;
  int num_ranks;
  int num_nvl_ranks;  // ranks per NVLink domain; num_tokens_per_rdma_rank has num_ranks / num_nvl_ranks entries
  int* num_tokens_per_rank;
  int* num_tokens_per_rdma_rank;  // may be null
  int* num_tokens_per_expert;
  uint8_t* is_token_in_rank;
  NvlControl* self;  // local_error
  HostShared* host;  // input diagnostic
};

struct NotifyParams {
  FailState fail;
  PeerMap peers;
  int num_ranks;
  int barrier_only;  // the low-latency buffer clean: only the epoch barrier (kernels/intranode/epoch_barrier.cuh)
  // Count exchange (barrier_only == 0).
  const int* num_tokens_per_rank;
  const int* num_tokens_per_expert;  // may be null
  const uint8_t* is_token_in_rank;
  int num_tokens;
  int num_experts;  // 0 when num_tokens_per_expert is null
  int num_channels;
  int expert_alignment;
  int row_bound;                    // this rank's NotifyMsg::kRowBound (> 0 num_worst_tokens, < 0 a guess, 0 none)
  int* rank_prefix_matrix;          // [R, R]
  int* channel_prefix_matrix;       // [R, C] inclusive over channels, of what this rank sends
  int* recv_channel_prefix_matrix;  // [R, C] first recv row of (source, channel)
  int recv_capacity;                // > 0 (dispatch into the buffer): rows each rank's output region holds
  int host_seq;                     // > 0: publish counts to the host under this sequence number
  int signature;                    // shape of the operation (op kind, record layout, channels, ring); all equal
};

struct DispatchParams {
  FailState fail;
  PeerMap peers;
  int barrier;    // 1: the kernel runs the epoch barrier first (cached dispatch); 0: notify ran it
  int signature;  // with barrier: the operation's shape, which every rank must agree on (NotifyMsg::kSignature)
  RingLayout ring;
  DispatchRecord record;
  int num_ranks;
  int num_channels;
  int num_tokens;
  int num_send_chunk;  // tokens per tail update
  int x_int4;          // row bytes / 16
  int num_scales;
  int num_topk;
  int experts_per_rank;  // L (0 without top-k)
  const int4* x;
  ScaleView x_scales;  // read in place at the caller's strides
  const int64_t* topk_idx;
  const float* topk_weights;
  const uint8_t* is_token_in_rank;
  const int* rank_prefix_matrix;
  const int* recv_channel_prefix_matrix;
  int* send_head;  // [T, R]
  int4* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int num_worst_tokens;  // > 0: pad rows [num_recv_tokens, num_worst_tokens)
  // 2 ranks: how the two blocks of a channel share the work (DispatchSplit): sender-block warps that copy this rank's
  // own tokens (the other sender warps write the peer's ring), and receiver-block warps that read the peer's ring
  // (the others copy own tokens too).
  int self_sender_warps;
  int ring_receiver_warps;
  // Dispatch into the buffer (launch_dispatch_in_buffer): the output region at region_offset of every rank's NVLink
  // buffer, what this rank sends to each rank per channel (inclusive prefix), and the warps of a channel's two blocks
  // that write this rank's own rows (the others are shared by the peers).
  int64_t region_offset;
  RecvRegion region;
  const int* channel_prefix_matrix;
  int in_buffer_self_warps;
  // 1: the grid has one more block, which runs the notify of this dispatch (notify_body.cuh) and starts the others
  // through their start words once the rows' places are known; 0: a notify kernel ran before, or (barrier) none.
  int notify_block;
  // 1 (exactly 2 ranks, with notify_block): the sender blocks write ring records before their start word and publish
  // them after it (kernels/intranode/early_senders.cuh); 0: every block waits for its start first.
  int early_senders;
};

struct CombineParams {
  FailState fail;
  PeerMap peers;
  int signature;  // the operation's shape, checked by the epoch barrier the kernel runs first
  RingLayout ring;
  CombineRecord record;
  int num_ranks;
  int num_channels;
  int num_tokens;  // tokens this rank dispatched (outputs rows)
  int num_send_chunk;
  int x_int4;     // hidden * 2 / 16
  int num_topk;   // 0 without weights
  const int4* x;  // [rows, hidden] expert outputs in recv order
  const float* topk_weights;
  const int* rank_prefix_matrix;
  const int* channel_prefix_matrix;
  const int* recv_channel_prefix_matrix;
  const int* send_head;
  const int4* bias0;
  const int4* bias1;
  int4* combined_x;
  float* combined_topk_weights;
  // Combine from the buffer (launch_combine_in_buffer): every rank's rows in its output region at region_offset of
  // its NVLink buffer (rows of hidden * 2 bytes, the weights at region.weight_offset); x and topk_weights unused.
  int64_t region_offset;
  RecvRegion region;
};

void launch_layout(const LayoutParams& p, int num_sms, cudaStream_t stream);
void launch_notify(const NotifyParams& p, cudaStream_t stream);
// notify: the notify's parameters where p.notify_block is set (ignored else).
void launch_dispatch(const DispatchParams& p, const NotifyParams& notify, cudaStream_t stream);
void launch_dispatch_in_buffer(const DispatchParams& p, const NotifyParams& notify, cudaStream_t stream);
void launch_combine(const CombineParams& p, cudaStream_t stream);
void launch_combine_in_buffer(const CombineParams& p, cudaStream_t stream);

}  // namespace epx
