// Parameters of the internode (hierarchical) kernels and their launch functions. Filled by the host runtime
// (runtime/internode_ops.cpp), read by the kernels (kernels/internode/). Plain data: passed by value.
#pragma once

#include <vector_types.h>  // int4

#include <cstdint>

#include "layout/channels.hpp"
#include "layout/fail_state.hpp"
#include "layout/internode_layout.hpp"
#include "layout/peer_map.hpp"
#include "layout/scales.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace epx {

// The handle of an internode dispatch as the kernels see it (deep_ep's element numbers in brackets; docs/internode.md).
struct InternodeHandleView {
  const uint8_t* is_token_in_rank;       // [T, R] [0]
  int* rdma_channel_prefix_matrix;       // [D, C] [1]
  int* gbl_channel_prefix_matrix;        // [R, C] [2]
  int* recv_rdma_channel_prefix_matrix;  // [D, C] [3]
  int* recv_rdma_rank_prefix_sum;        // [D] [4]
  int* recv_gbl_channel_prefix_matrix;   // [R, C] [5]
  int* recv_gbl_rank_prefix_sum;         // [R] [6]
  int32_t* recv_src_meta;                // [N, 2] [7]
  int* send_rdma_head;                   // [T, D] [8]
  int* send_nvl_head;                    // [N_rdma, G] [9]
};

struct InternodeNotifyParams {
  FailState fail;
  PeerMap peers;
  int num_ranks;
  int barrier_only;                  // cached dispatch and combine: only the two-phase handshake (and errors)
  const int* num_tokens_per_rank;    // [R]
  const int* num_tokens_per_expert;  // [E] or null
  int num_tokens;
  int num_experts;  // 0 when num_tokens_per_expert is null
  int num_channels;
  int expert_alignment;
  int num_worst_tokens;
  InternodeHandleView h;  // writes [1] .. [6]
  int host_seq;           // > 0: publish the counts to the host under this sequence number
  int signature;          // shape of the operation: every rank must agree
};

struct InternodeDispatchParams {
  FailState fail;
  PeerMap peers;
  NetRing ring;    // network rings
  NvlSubRing nvl;  // NVLink sub-rings
  InternodeRecord record;
  int num_ranks;
  int num_channels;
  int num_tokens;
  int x_int4;  // row bytes / 16
  int num_scales;
  int num_topk;          // 0 without top-k
  int experts_per_rank;  // L
  const int4* x;
  ScaleView x_scales;  // read in place at the caller's strides
  const int64_t* topk_idx;
  const float* topk_weights;
  InternodeHandleView h;
  int4* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int num_worst_tokens;  // > 0: outputs have this many rows; pad the rest
};

struct InternodeCombineParams {
  FailState fail;
  PeerMap peers;
  NetRing ring;
  NvlSubRing nvl;
  CombineNetRecord net_record;  // a network ring record (one row: two-level; G rows: flat)
  int64_t nvl_weight_offset;    // NVLink sub-ring record: [row][weights f32 * K]
  int two_level;                // 1: two-level order (one partial per domain); 0: flat (every row travels)
  int num_ranks;
  int num_channels;
  int num_tokens;             // this rank's dispatched tokens (rows of combined_x)
  int x_int4;                 // hidden * 2 / 16
  int num_topk;               // 0 without weights
  const int4* x;              // [N, hidden] bf16, rows aligned with the dispatch's recv_x
  const float* topk_weights;  // [N, K]
  InternodeHandleView h;
  const int4* bias0;
  const int4* bias1;
  int4* combined_x;
  float* combined_topk_weights;
};

void launch_internode_notify(const InternodeNotifyParams& p, cudaStream_t stream);
void launch_internode_dispatch(const InternodeDispatchParams& p, cudaStream_t stream);
void launch_internode_combine(const InternodeCombineParams& p, cudaStream_t stream);

}  // namespace epx
