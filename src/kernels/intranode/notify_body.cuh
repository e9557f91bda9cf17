// The count exchange in front of a dispatch with a layout, with the epoch barrier (epoch_barrier.cuh), and the barrier
// alone in front of the low-latency buffer clean: one block's work. Three kernels run it: the notify kernel
// (notify.cu), a grid of this one block in front of the data kernel, and the dispatch into the buffer
// (dispatch_in_buffer.cu) and the sized ring dispatch (dispatch.cu), whose grid's last block runs it and starts the
// data blocks of the same grid as soon as their rows' places are known.
//
// Every rank writes one message into every peer's buffer (the barrier's header, then its tokens-per-rank row and the
// counts for that peer's experts and channels), then publishes the operation's epoch in the peer's notify_flag.
// Errors are collective: every rank computes the same op_error from the same messages, and the data kernels of every
// rank skip when it is set.
#pragma once

#include <cuda_runtime.h>

#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// is_token_in_rank loads a lane has in flight before it adds them up: a channel's tokens (a few hundred) then
// cost one or two memory latencies instead of one per 32 tokens.
constexpr int kCountBatch = 16;

// Tokens this rank sends to rank j in channel c, for all (j, c).
__device__ void count_channels(const NotifyParams& p, int (*s_counts)[kMaxChannels]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const int R = p.num_ranks, C = p.num_channels;
  for (int pair = warp; pair < R * C; pair += num_warps) {
    const int j = pair / C, c = pair % C;
    const ChannelRange range = ChannelRange::of(p.num_tokens, C, c);
    int n = 0;
    for (int t0 = range.begin + lane; t0 < range.end; t0 += 32 * kCountBatch) {
      uint8_t in[kCountBatch];
#pragma unroll
      for (int u = 0; u < kCountBatch; ++u) {
        const int t = t0 + 32 * u;
        in[u] = t < range.end ? p.is_token_in_rank[int64_t(t) * R + j] : 0;
      }
#pragma unroll
      for (int u = 0; u < kCountBatch; ++u) n += in[u] ? 1 : 0;
    }
    n = warp_sum(n);
    if (lane == 0) s_counts[j][c] = n;
  }
}

// The value of field `field` of the message this rank sends to rank j.
__device__ int message_field(const NotifyParams& p, int j, int field, const EpochEntry& e,
                             int (*s_counts)[kMaxChannels]) {
  const int R = p.num_ranks;
  if (field < NotifyMsg::kHeader) return header_field(field, e, p.num_tokens, p.signature, p.row_bound);
  if (field < NotifyMsg::tokens_per_rank(R)) return p.num_tokens_per_rank[field - NotifyMsg::tokens_per_rank(0)];
  if (field < NotifyMsg::expert(kMaxLocalExperts)) {
    const int L = p.num_experts / R;
    const int i = field - NotifyMsg::expert(0);
    return i < L ? p.num_tokens_per_expert[j * L + i] : 0;
  }
  return s_counts[j][field - NotifyMsg::channel(0)];
}

// The whole block. With data_blocks > 0 the block is the last of a data grid: once the verdict and the rows' places
// (the three prefix matrices) are written it releases the start words of blocks [0, data_blocks) of its grid
// (kStartGo or kStartSkip), and finishes the rest (the expert counts, the host's words) while they run. Not inlined:
// the data roles' registers stay as they were.
static __device__ __noinline__ void run_notify(const NotifyParams& p, int data_blocks) {
  __shared__ int s_counts[kMaxNvlRanks][kMaxChannels];       // [j][c]: what this rank sends to j in channel c
  __shared__ int s_recv_counts[kMaxNvlRanks][kMaxChannels];  // [s][c]: what s sends this rank in channel c
  __shared__ int s_sent[kMaxNvlRanks][kMaxNvlRanks];         // [i][j]: tokens rank i sends to rank j
  __shared__ int s_bound[kMaxNvlRanks];                      // [i]: rank i's NotifyMsg::kRowBound
  __shared__ int s_error;
  __shared__ int s_error_rank;
  __shared__ int s_worst_rank;
  __shared__ int s_region_rank;
  __shared__ int s_resize_rank;
  __shared__ uint32_t s_epoch;
  const int tid = threadIdx.x;
  const int R = p.num_ranks, C = p.num_channels, me = p.peers.rank;
  NvlControl* self = nvl_self(p.peers);

  if (tid == 0) {
    check_abort(p.fail, WaitSite{kRoleNotify, -1, -1, 0});  // a peer failed earlier: fail now, not after the budget
    const EpochEntry e = enter_epoch(self, me);
    s_epoch = e.epoch;
    s_error = e.error;
    s_error_rank = e.error_rank;
    s_worst_rank = R;
    s_region_rank = R;
    s_resize_rank = R;
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const int parity = epoch & 1;

  if (!p.barrier_only) {
    count_channels(p, s_counts);
    __syncthreads();
    if (tid < R) {
      int sent = 0;
      for (int c = 0; c < C; ++c) {
        sent += s_counts[tid][c];
        p.channel_prefix_matrix[tid * C + c] = sent;  // row tid (what this rank sends to tid), inclusive
      }
      const int claimed = p.num_tokens_per_rank[tid];
      if (sent != claimed && atomicCAS(&s_error, 0, kErrLayoutMismatch) == 0) {
        s_error_rank = me;
        write_diag(&p.fail.host->input, kErrLayoutMismatch, me, kRoleNotify, tid, claimed, sent);
      }
    }
    __syncthreads();
  }

  // Messages to every rank (this one included), then the epoch flag.
  const EpochEntry entry{epoch, s_error, s_error_rank};
  const int fields = p.barrier_only ? NotifyMsg::kHeader : NotifyMsg::channel(C);
  for (int i = tid; i < R * fields; i += blockDim.x) {
    const int j = i / fields, field = i % fields;
    const bool unused = field >= NotifyMsg::tokens_per_rank(R) && field < NotifyMsg::expert(0);
    const bool unused_expert = field >= NotifyMsg::expert(0) && field < NotifyMsg::channel(0) &&
                               field - NotifyMsg::expert(0) >= (p.num_experts ? p.num_experts / R : 0);
    if (unused || unused_expert) continue;
    write_word(&nvl_control(p.peers, j)->notify_msg[parity][me][field], message_field(p, j, field, entry, s_counts));
  }
  // Every thread's message stores precede the flag stores through the block barrier; one release store per
  // peer carries them (release is cumulative), so no thread needs a fence of its own.
  __syncthreads();
  if (tid < R) publish(&nvl_control(p.peers, tid)->notify_flag[me], epoch);  // pairs with wait_equal below
  // Acquire: peer tid's messages to this rank are visible to this thread, and after the barrier below to
  // every thread of the block.
  if (tid < R) wait_equal(&self->notify_flag[tid], epoch, p.fail, WaitSite{kRoleNotify, -1, tid, int64_t(epoch)});
  __syncthreads();

  auto msg = [&](int s, int field) { return dev::ld_cg(&self->notify_msg[parity][s][field]); };
  if (tid < 32) {
    const Verdict v = collective_verdict(self, parity, R, p.signature, p.fail, me);
    if (tid == 0) {
      s_error = v.code;
      s_error_rank = v.rank;
    }
  } else if (!p.barrier_only) {
    // The peers' counts into shared memory, one load per thread, all in flight at once; the prefix sums below then
    // read shared memory.
    for (int i = tid - 32; i < R * R; i += blockDim.x - 32)
      s_sent[i / R][i % R] = msg(i / R, NotifyMsg::tokens_per_rank(i % R));
    for (int i = tid - 32; i < R * C; i += blockDim.x - 32)
      s_recv_counts[i / C][i % C] = msg(i / C, NotifyMsg::channel(i % C));
    for (int i = tid - 32; i < R; i += blockDim.x - 32) s_bound[i] = msg(i, NotifyMsg::kRowBound);
  }
  __syncthreads();
  const int collective_error = s_error;
  const int collective_error_rank = s_error_rank;

  if (!p.barrier_only && tid < R) {
    // Column tid of rank_prefix_matrix; rank tid's row bound (from its header) is checked for every rank, by every
    // rank, so all reach the same verdict.
    int acc = 0;
    for (int i = 0; i < R; ++i) {
      acc += s_sent[i][tid];
      p.rank_prefix_matrix[i * R + tid] = acc;
    }
    const int bound = s_bound[tid];
    if (bound > 0 && acc > bound) atomicMin(&s_worst_rank, tid);
    if (bound < 0 && acc > -bound - 1) atomicMin(&s_resize_rank, tid);
    if (p.recv_capacity > 0 && acc > p.recv_capacity) atomicMin(&s_region_rank, tid);
    // Row tid of recv_channel_prefix_matrix: where tokens from source tid, channel c, start (a ring receiver's rows).
    int row = 0;
    for (int i = 0; i < tid; ++i) row += s_sent[i][me];
    for (int c = 0; c < C; ++c) {
      p.recv_channel_prefix_matrix[tid * C + c] = row;
      row += s_recv_counts[tid][c];
    }
  }
  if (data_blocks > 0) {
    // The three prefix matrices' stores (threads tid < R, here and after the counts) precede the releases through the
    // block barrier; each release is cumulative over them. The word says whether the operation has an error (the
    // verdict, a rank's rows past its row bound or the output region), the same on every rank.
    __syncthreads();
    const bool fails = collective_error != 0 || s_worst_rank < R || s_region_rank < R || s_resize_rank < R;
    const uint32_t start = fails ? kStartSkip : kStartGo;
    for (int b = tid; b < data_blocks; b += blockDim.x)
      publish(&self->block_start[b], start);  // pairs with wait_for_start
  }

  int num_recv = 0;
  if (!p.barrier_only) {
    const int L = p.num_experts / R;
    for (int i = tid; i < L; i += blockDim.x) {
      int n = 0;
#pragma unroll
      for (int s = 0; s < kMaxNvlRanks; ++s) n += s < R ? msg(s, NotifyMsg::expert(i)) : 0;  // R loads in flight
      const int a = p.expert_alignment;
      p.fail.host->num_recv_tokens_per_expert[i] = (n + a - 1) / a * a;
    }
    for (int s = 0; s < R; ++s) num_recv += s_sent[s][me];
  }
  __syncthreads();

  if (tid == 0) {
    int code = collective_error, rank = collective_error_rank;
    if (code == 0 && s_worst_rank < R) {
      code = kErrWorstTokensExceeded;
      rank = s_worst_rank;
      int rows = 0;
      for (int s = 0; s < R; ++s) rows += msg(s, NotifyMsg::tokens_per_rank(rank));
      write_diag(&p.fail.host->input, kErrWorstTokensExceeded, rank, kRoleNotify, rank, rows, s_bound[rank]);
    } else if (code == 0 && s_region_rank < R) {
      code = kErrRecvRegionExceeded;
      rank = s_region_rank;
      int rows = 0;
      for (int s = 0; s < R; ++s) rows += msg(s, NotifyMsg::tokens_per_rank(rank));
      write_diag(&p.fail.host->input, kErrRecvRegionExceeded, rank, kRoleNotify, rank, rows, p.recv_capacity);
    } else if (code == 0 && s_resize_rank < R) {
      code = kVerdictResize;  // no diagnostic: every rank's host repeats the count exchange
      rank = s_resize_rank;
    }
    HostShared* host = p.fail.host;
    write_verdict(self, host, code, rank, num_recv);
    // No system fence: the host reads these words, and the per-expert counts above, after its acquire of
    // notify_seq, whose release store here is cumulative over them (the block barrier above orders the other
    // threads' stores before it), or in worst-case mode (no host_seq) only once the stream has synchronized.
    if (p.host_seq > 0) publish(&host->notify_seq, p.host_seq);  // pairs with the host's acquire poll
  }
}

// A data block of a grid whose last block runs the notify: true once its start word says go, false when the
// operation has an error (every block of every rank returns then).
__device__ __forceinline__ bool start_after_notify_block(const FailState& fail, NvlControl* self) {
  __shared__ uint32_t s_start;
  if (threadIdx.x == 0) s_start = wait_for_start(fail, self);  // acquire: the notify block's prefix matrices, epoch
  __syncthreads();
  return s_start == kStartGo;
}

}  // namespace
}  // namespace epx
