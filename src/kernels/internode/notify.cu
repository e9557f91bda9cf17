// Internode notify: the count exchange in front of an internode dispatch, in two phases, and the barrier in front of
// cached dispatch and combine (barrier_only: the same two phases with headers only).
//
// One block. Phase 1 (network): rank (d, g) puts one message to its peer (m, g) of every domain (put with signal;
// its own domain's by a local copy): its tokens for each rank of m, per channel the tokens that need m and those
// for each rank of m, and its tokens per expert of m. Phase 2 (NVLink): for every rank j of its domain it relays
// what the sources (i, g), i = 0..D-1, send to j (tokens, per channel) and their per-expert sums for j's experts.
// Each phase ends when every expected message's epoch flag has arrived (bounded waits naming the hop and the peer).
// Seeing every flag means every rank has finished its previous operation's kernels (they precede notify on its
// stream), so every ring is idle and the message slots of this epoch's parity are free.
//
// Errors: phase 1 carries each rank's input error and signature, so the ranks of one local index agree on a
// verdict; phase 2 relays every group's verdict and signature, so every rank of every domain computes the same
// one (the first error in local-rank order). Worst-case overflows are known only at the rank that receives too
// much: it reports one of its own (Buffer::check, the next operation) and its kernels drop the rows that do not fit.
#include <cuda_runtime.h>

#include "kernels/internode/common.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kNotifyThreads = 1024;

struct Shared {
  int counts[kMaxRanks][kMaxChannels];           // this rank's tokens to rank j in channel c
  int domain_counts[kMaxDomains][kMaxChannels];  // this rank's tokens that need domain m in channel c
  int error, error_rank;
  uint32_t epoch;
};

// Tokens this rank sends to rank j, and that need domain m, per channel.
__device__ void count_channels(const InternodeNotifyParams& p, Shared& s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int R = p.num_ranks, C = p.num_channels, G = p.peers.net.num_local, D = p.peers.net.num_domains;
  for (int pair = warp; pair < (R + D) * C; pair += warps) {
    const int row = pair / C, c = pair % C;
    const ChannelRange range = ChannelRange::of(p.num_tokens, C, c);
    int n = 0;
    for (int t = range.begin + lane; t < range.end; t += 32) {
      const uint8_t* in = p.h.is_token_in_rank + int64_t(t) * R;
      if (row < R) {
        n += in[row] ? 1 : 0;
      } else {
        bool any = false;
        for (int j = 0; j < G; ++j) any |= in[(row - R) * G + j] != 0;
        n += any ? 1 : 0;
      }
    }
    n = warp_sum(n);
    if (lane == 0) (row < R ? s.counts[row][c] : s.domain_counts[row - R][c]) = n;
  }
}

// Field f of the phase-1 message to domain m.
__device__ int net_field(const InternodeNotifyParams& p, const Shared& s, int m, int f) {
  const int G = p.peers.net.num_local, C = p.num_channels;
  if (f == NetMsg::kErrorCode) return s.error;
  if (f == NetMsg::kErrorRank) return s.error ? s.error_rank : -1;
  if (f == NetMsg::kNumTokens) return p.num_tokens;
  if (f == NetMsg::kSignature) return p.signature;
  if (f < NetMsg::domain_channel(0)) {
    const int j = f - NetMsg::tokens_to(0);
    return j < G ? p.num_tokens_per_rank[m * G + j] : 0;
  }
  if (f < NetMsg::rank_channel(0, 0)) {
    const int c = f - NetMsg::domain_channel(0);
    return c < C ? s.domain_counts[m][c] : 0;
  }
  if (f < NetMsg::expert(0)) {
    const int j = (f - NetMsg::rank_channel(0, 0)) / kMaxChannels, c = (f - NetMsg::rank_channel(0, 0)) % kMaxChannels;
    return j < G && c < C ? s.counts[m * G + j][c] : 0;
  }
  const int L = p.num_experts / p.num_ranks, e = f - NetMsg::expert(0);
  return e < G * L ? p.num_tokens_per_expert[int64_t(m) * G * L + e] : 0;
}

__global__ void __launch_bounds__(kNotifyThreads, 1)
    internode_notify_kernel(const __grid_constant__ InternodeNotifyParams p) {
  __shared__ Shared s;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const NetworkMap& net = p.peers.net;
  const int R = p.num_ranks, C = p.num_channels, G = net.num_local, D = net.num_domains, d = net.domain,
            g = net.local_rank;
  const int me = net.pe(d);
  NvlControl* self = nvl_self(p.peers);
  NetControl* ctrl = net_control(p.peers);
  InternodeNvlControl* nvl_self_ctrl = internode_nvl(p.peers, p.peers.rank);

  if (tid == 0) {
    check_abort(p.fail, WaitSite{kRoleNotifyNetwork, -1, -1, 0});  // a peer failed earlier: fail now
    // Every network operation of this rank's earlier kernels (the last credits of a ring) is complete at its
    // peer before this rank's phase-1 messages announce that it is done with them.
    net_quiet();
    s.epoch = self->epoch + 1;
    self->epoch = s.epoch;
    // Sticky: an error stays until every rank's host has reported it (the runtime clears op_error then).
    s.error = self->op_error ? self->op_error : self->local_error;
    s.error_rank = self->op_error ? self->op_error_rank : me;
    self->local_error = 0;
  }
  __syncthreads();
  const uint32_t epoch = s.epoch;
  const int parity = epoch & 1;

  if (!p.barrier_only) {
    count_channels(p, s);
    __syncthreads();
    if (tid < R) {  // the layout must agree with is_token_in_rank
      int sent = 0;
      for (int c = 0; c < C; ++c) sent += s.counts[tid][c];
      const int claimed = p.num_tokens_per_rank[tid];
      if (sent != claimed && atomicCAS(&s.error, 0, kErrLayoutMismatch) == 0) {
        s.error_rank = me;
        write_diag(&p.fail.host->input, kErrLayoutMismatch, me, kRoleNotifyNetwork, tid, claimed, sent);
      }
    }
    // [1] and [2]: what this rank sends, inclusive over channels.
    if (tid < R + D) {
      int acc = 0;
      for (int c = 0; c < C; ++c) {
        if (tid < R) {
          acc += s.counts[tid][c];
          p.h.gbl_channel_prefix_matrix[tid * C + c] = acc;
        } else {
          acc += s.domain_counts[tid - R][c];
          p.h.rdma_channel_prefix_matrix[(tid - R) * C + c] = acc;
        }
      }
    }
    __syncthreads();
  }

  // ---- phase 1: one message to the peer of every domain -----------------------------------------------------
  const int L = p.num_experts / R;
  const int length = p.barrier_only ? NetMsg::kHeader : (p.num_experts ? NetMsg::expert(G * L) : NetMsg::expert(0));
  for (int i = tid; i < D * length; i += blockDim.x) {
    const int m = i / length, f = i % length;
    ctrl->notify_out[parity][m][f] = net_field(p, s, m, f);
  }
  __threadfence_system();  // the messages are in memory before a NIC reads them
  __syncthreads();
  if (warp < D) {
    const int m = warp;
    int32_t* in_slot = ctrl->notify_in[parity][d];  // the same address names the slot at every peer
    if (m == d) {
      for (int f = lane; f < length; f += 32) in_slot[f] = ctrl->notify_out[parity][m][f];
      __syncwarp();
      if (lane == 0) publish(&ctrl->notify_flag[d], uint64_t(epoch));  // pairs with the wait below
    } else {
      net_put_signal_warp(in_slot, ctrl->notify_out[parity][m], size_t(length) * 4, &ctrl->notify_flag[d], epoch,
                          net.pe(m));
    }
  }
  // Acquire: the message of domain tid is here (put with signal: the data before the flag).
  if (tid < D) wait_equal(&ctrl->notify_flag[tid], uint64_t(epoch), p.fail, WaitSite{kRoleNotifyNetwork, -1, tid, 0});
  __syncthreads();
  auto net_msg = [&](int m, int f) { return ld_cg(&ctrl->notify_in[parity][m][f]); };

  if (tid == 0) {  // the verdict of this local index's group: every member computes the same
    int code = 0, rank = -1;
    for (int m = 0; m < D && code == 0; ++m) {
      code = net_msg(m, NetMsg::kErrorCode);
      rank = net_msg(m, NetMsg::kErrorRank);
    }
    for (int m = 0; m < D && code == 0; ++m) {
      const int theirs = net_msg(m, NetMsg::kSignature);
      if (theirs == p.signature) continue;
      code = kErrShapeMismatch;
      rank = net.pe(m);
      write_diag(&p.fail.host->input, kErrShapeMismatch, me, kRoleNotifyNetwork, rank, theirs, p.signature);
    }
    s.error = code;
    s.error_rank = rank;
  }
  __syncthreads();

  int num_rdma_recv = 0;
  if (!p.barrier_only) {
    // [3], [4]: records arriving in this rank's network rings, from the peer of each domain.
    if (tid == 0) {
      for (int m = 0; m < D; ++m) {
        int acc = 0;
        for (int c = 0; c < C; ++c) {
          acc += net_msg(m, NetMsg::domain_channel(c));
          p.h.recv_rdma_channel_prefix_matrix[m * C + c] = acc;
        }
        num_rdma_recv += acc;
        p.h.recv_rdma_rank_prefix_sum[m] = num_rdma_recv;
      }
    }
  }

  // ---- phase 2: relay to every rank of this domain ------------------------------------------------------------
  const int length2 = p.barrier_only ? NvlNetMsg::kHeader : NvlNetMsg::expert(L);
  for (int i = tid; i < G * length2; i += blockDim.x) {
    const int j = i / length2, f = i % length2;
    int v = 0;
    if (f == NvlNetMsg::kErrorCode) {
      v = s.error;
    } else if (f == NvlNetMsg::kErrorRank) {
      v = s.error ? s.error_rank : -1;
    } else if (f == NvlNetMsg::kSignature) {
      v = p.signature;
    } else if (f < NvlNetMsg::source_channel(0, 0)) {
      const int src = f - NvlNetMsg::source_tokens(0);
      v = src < D ? net_msg(src, NetMsg::tokens_to(j)) : 0;
    } else if (f < NvlNetMsg::expert(0)) {
      const int src = (f - NvlNetMsg::source_channel(0, 0)) / kMaxChannels;
      const int c = (f - NvlNetMsg::source_channel(0, 0)) % kMaxChannels;
      v = src < D && c < C ? net_msg(src, NetMsg::rank_channel(j, c)) : 0;
    } else {
      const int e = f - NvlNetMsg::expert(0);
      for (int src = 0; src < D && p.num_experts; ++src) v += net_msg(src, NetMsg::expert(j * L + e));
    }
    write_word(&internode_nvl(p.peers, j)->notify_msg[parity][g][f], v);
  }
  // Every thread's message stores precede the flags through the barrier; one release per rank carries them.
  __syncthreads();
  if (tid < G) publish(&internode_nvl(p.peers, tid)->notify_flag[g], epoch);  // pairs with the wait below
  if (tid < G) wait_equal(&nvl_self_ctrl->notify_flag[tid], epoch, p.fail, WaitSite{kRoleNotifyNvl, -1, tid, 0});
  __syncthreads();
  auto nvl_msg = [&](int src, int f) { return ld_cg(&nvl_self_ctrl->notify_msg[parity][src][f]); };

  int num_recv = 0;
  if (tid == 0) {
    // The collective verdict: the first group (local index) with an error; groups that disagree on the shape.
    int code = 0, rank = -1;
    for (int src = 0; src < G && code == 0; ++src) {
      code = nvl_msg(src, NvlNetMsg::kErrorCode);
      rank = nvl_msg(src, NvlNetMsg::kErrorRank);
    }
    for (int src = 0; src < G && code == 0; ++src) {
      const int theirs = nvl_msg(src, NvlNetMsg::kSignature);
      if (theirs == p.signature) continue;
      code = kErrShapeMismatch;
      rank = d * G + src;
      write_diag(&p.fail.host->input, kErrShapeMismatch, me, kRoleNotifyNvl, rank, theirs, p.signature);
    }
    s.error = code;
    s.error_rank = rank;
    if (!p.barrier_only) {
      // [6] and [5]: rows per source rank (i, src) in global rank order, and where each channel's rows start.
      for (int r = 0; r < R; ++r) {
        const int i = r / G, src = r % G;
        int row = num_recv;
        for (int c = 0; c < C; ++c) {
          p.h.recv_gbl_channel_prefix_matrix[r * C + c] = row;
          row += nvl_msg(src, NvlNetMsg::source_channel(i, c));
        }
        num_recv += nvl_msg(src, NvlNetMsg::source_tokens(i));
        p.h.recv_gbl_rank_prefix_sum[r] = num_recv;
      }
    }
  }
  if (!p.barrier_only) {
    for (int e = tid; e < L; e += blockDim.x) {
      int n = 0;
      for (int src = 0; src < G; ++src) n += nvl_msg(src, NvlNetMsg::expert(e));
      const int a = p.expert_alignment;
      p.fail.host->num_recv_tokens_per_expert[e] = (n + a - 1) / a * a;
    }
  }
  __syncthreads();

  if (tid == 0) {
    const int code = s.error, rank = s.error_rank;
    if (code == 0 && p.num_worst_tokens > 0 && (num_recv > p.num_worst_tokens || num_rdma_recv > p.num_worst_tokens))
      report_input_error(self, p.fail.host, kErrWorstTokensExceeded, kRoleNotifyNvl, me,
                         num_recv > num_rdma_recv ? num_recv : num_rdma_recv, p.num_worst_tokens);
    HostShared* host = p.fail.host;
    write_verdict(self, host, code, rank, num_recv);
    host->num_rdma_recv_tokens = num_rdma_recv;
    __threadfence_system();
    if (p.host_seq > 0) publish(&host->notify_seq, p.host_seq);  // pairs with the host's acquire poll
  }
}

}  // namespace

void launch_internode_notify(const InternodeNotifyParams& p, cudaStream_t stream) {
  internode_notify_kernel<<<1, kNotifyThreads, 0, stream>>>(p);
}

}  // namespace epx
