// Internode combine (semantics.md sections 3 and 6): the dispatch run backwards. Two blocks per channel c.
//
// Block 2c:
//  - NVLink senders (G > 1): for every other rank s of this domain and source domain i, the rows this rank received
//    from (i, s) in channel c go back, in order, into s's sub-ring for (this rank, i): row, then its top-k weights.
//    Their coordinator publishes each sub-ring's tail at s.
//  - network receivers: this rank's tokens of channel c, one warp per token in turn: for every domain m the token
//    went to (send_rdma_head [8]), wait until the ring from (m, g) holds its record (the tail), then reduce:
//    two-level: acc = 0; += float(P_m) for m ascending (one partial per domain); flat: += float(row) for every row
//    of every domain in ascending global rank order; then += bias0, += bias1; one rounding. Weights: the sum over the
//    ranks that received the token, in ascending global order, in float32. Their coordinator returns network credit.
// Block 2c + 1 (forwarders): the tokens that (i, g) sent here in channel c, in its network stream order. Each
//    destination domain has its own group of forwarder warps (record p of its stream to warp p % group size): the
//    receivers at the source need every domain's record of a token before they free any ring, so a warp waiting for
//    one domain's credit must not hold back another domain's records. For each token
//    and every rank j of this domain that received it (send_nvl_head [9]): its row from this rank's own x (j = g)
//    or from j's sub-ring here. Two-level: one row passes unchanged, several are summed in ascending j in float32
//    and rounded once; flat: the rows travel as they are. The record is put to (i, g); a warp completes its puts
//    (quiet) and publishes its progress every few records and before it waits. The forwarder coordinator turns the
//    progress into the ring's tail at (i, g) (a signal after a fence) and returns NVLink credit (head) to every j.
#include <cuda_runtime.h>

#include "device/bf16.cuh"
#include "kernels/internode/common.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = kDataThreads;
constexpr int kWarps = kThreads / 32;

// Warps of block 2c: NVLink senders and their coordinator (G > 1), then network receivers and their coordinator
// (the last warp).
struct ReturnRoles {
  int nvl_senders;
  int receivers;
  __device__ static ReturnRoles of(int num_nvl_ranks) {
    if (num_nvl_ranks == 1) return {0, kWarps - 1};
    const int senders = (kWarps - 2) / 2;
    return {senders, kWarps - 2 - senders};
  }
};

struct ReturnShared {
  int next[kMaxNvlStreams > kWarps ? kMaxNvlStreams : kWarps];  // NVLink senders: next ordinal per (stream, slice)
  uint64_t base[kMaxNvlStreams];                                // NVLink senders: each sub-ring's start
  int need[kWarps][kMaxDomains];               // network receivers: ring positions below this are no longer needed
  const uint8_t* record[kWarps][kMaxDomains];  // network receivers: the current token's record per domain
  const int4* rows[kWarps][kMaxRanks];         // network receivers: the current token's rows in summation order
};

struct ForwardShared {
  int progress[kWarps][kMaxDomains];
  const int4* rows[kWarps][kMaxNvlRanks];        // forwarders: the current token's rows in ascending j
  uint64_t nvl_base[kMaxNvlRanks][kMaxDomains];  // sub-ring (from j, domain i) positions at the start
};

// Records a forwarder warp writes before it completes its puts and publishes its progress (and before any wait).
constexpr int kAnnounceEvery = 4;

// ---- NVLink senders -----------------------------------------------------------------------------------------------

// NVLink senders: row o of stream (i, s) goes, with its top-k weights, into slot base + o of s's sub-ring once s has
// consumed the row a capacity before it (the head).
__device__ __forceinline__ void nvl_sender(const InternodeCombineParams& p, int channel, int w, int warps,
                                           ReturnShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const NvlStreams streams = NvlStreams::of(D, G, warps);
  InternodeNvlControl* ctrl = internode_nvl(p.peers, p.peers.rank);
  serve_nvl_streams(
      p.h, p.fail, kRoleCombineNvlSender, channel, C, g, G, w, warps, streams, sh.next, sh.base,
      ctrl->combine_head[channel],  // pairs with s's forwarder coordinator
      [&](uint64_t pos, uint64_t head) { return pos + 1 <= head + p.nvl.capacity; },
      [&](uint64_t pos) { return pos + 1 - p.nvl.capacity; },
      [&](int i, int s, int row, uint64_t pos) {
        uint8_t* slot = p.nvl.slot(p.peers.nvl.peer[s], channel, g, i, pos);
        const float weight = lane < p.num_topk ? ld_nc(p.topk_weights + int64_t(row) * p.num_topk + lane) : 0.f;
        write_rows<kInternodeCopyUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(row) * p.x_int4, p.x_int4, lane,
                                         LoadNc{});
        if (lane < p.num_topk) reinterpret_cast<float*>(slot + p.nvl_weight_offset)[lane] = weight;
      });
}

// Publishes each sub-ring's tail at its reader s: base + the least next ordinal over the stream's slices.
__device__ void nvl_sender_coordinator(const InternodeCombineParams& p, int channel, ReturnShared& sh) {
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const NvlStreams streams = NvlStreams::of(D, G, ReturnRoles::of(G).nvl_senders);
  coordinate_nvl_streams(p.h, p.fail, kRoleCombineNvlSenderCoordinator, channel, C, g, G, streams, sh.next, sh.base,
                         [&](int i, int s) { return &internode_nvl(p.peers, s)->combine_tail[channel][g][i]; });
}

// ---- network receivers --------------------------------------------------------------------------------------------

// Token t's reduction from the records in records[m] (null where the token did not go), into combined_x. rows:
// this warp's list (shared), filled here with the rows to sum in the order semantics.md section 6 names: two-level, one
// partial per domain in ascending m; flat, every rank's row in ascending global rank.
__device__ void reduce_token(const InternodeCombineParams& p, int t, const uint8_t* const* records, const int4** rows,
                             int lane) {
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, R = p.num_ranks;
  const uint8_t* in = p.h.is_token_in_rank + int64_t(t) * R;
  const int n = p.x_int4;
  int count = 0;
  if (p.two_level) {
    const bool present = lane < D && records[lane] != nullptr;
    const uint32_t bits = __ballot_sync(kFullMask, present);
    if (present) rows[__popc(bits & ((1u << lane) - 1))] = reinterpret_cast<const int4*>(records[lane]);
    count = __popc(bits);
  } else {
    const int row_int4 = int(p.net_record.row_bytes / 16);
    for (int r0 = 0; r0 < R; r0 += 32) {  // ranks r0 + lane; a domain's rows sit in its record in ascending j
      const int r = r0 + lane;
      const bool present = r < R && in[r] != 0;
      const uint32_t bits = __ballot_sync(kFullMask, present);
      if (present) {
        const int m = r / G, j = r % G;
        int before = 0;  // ranks of domain m below j that received the token: rows ahead of r's in m's record
        for (int jj = 0; jj < j; ++jj) before += in[m * G + jj] != 0 ? 1 : 0;
        rows[count + __popc(bits & ((1u << lane) - 1))] =
            reinterpret_cast<const int4*>(records[m]) + int64_t(before) * row_int4;
      }
      count += __popc(bits);
    }
  }
  __syncwarp();
  const int4* b0 = p.bias0 != nullptr ? p.bias0 + int64_t(t) * n : nullptr;
  const int4* b1 = p.bias1 != nullptr ? p.bias1 + int64_t(t) * n : nullptr;
  sum_rows_bf16<kReduceBatch, kReduceVectors>(p.combined_x + int64_t(t) * n, rows, count, n, b0, b1, lane);
  if (p.combined_topk_weights != nullptr && lane < p.num_topk) {
    float acc = 0.f;
    for (int m = 0; m < D; ++m) {
      if (records[m] == nullptr) continue;
      const float* w = reinterpret_cast<const float*>(records[m] + p.net_record.weight_offset);
      for (int j = 0; j < G; ++j)
        if (in[m * G + j]) acc += __int_as_float(ld_cg(reinterpret_cast<const int32_t*>(w) + j * p.num_topk + lane));
    }
    p.combined_topk_weights[int64_t(t) * p.num_topk + lane] = acc;
  }
}

__device__ __forceinline__ void net_receiver(const InternodeCombineParams& p, int channel, int w, int warps,
                                             ReturnShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int D = net.num_domains, C = p.num_channels;
  NetControl* ctrl = net_control(p.peers);
  const int warp = threadIdx.x / 32;
  const ChannelRange range = ChannelRange::of(p.num_tokens, C, channel);
  uint64_t base = 0, tail_seen = 0;  // lane m: the ring from domain m
  if (lane < D) base = tail_seen = read_idle(&ctrl->combine_base[channel][lane]);
  for (int t = range.begin + w; t < range.end; t += warps) {
    if (lane < D) {
      const int pos = p.h.send_rdma_head[int64_t(t) * D + lane];
      st_release_cta(&sh.need[warp][lane], pos >= 0 ? pos : -pos - 1);  // positions below are no longer needed
      const uint8_t* rec = nullptr;
      if (pos >= 0) {
        if (tail_seen <= base + pos)  // pairs with the forwarder coordinator's signal (or release, own domain)
          tail_seen = wait_at_least(&ctrl->combine_tail[channel][lane], base + pos + 1, p.fail,
                                    WaitSite{kRoleCombineNetReceiver, channel, lane, t});
        rec = p.ring.slot(ctrl, channel, lane, 1, base + pos);
      }
      sh.record[warp][lane] = rec;
    }
    __syncwarp();
    reduce_token(p, t, sh.record[warp], sh.rows[warp], lane);
    __syncwarp();  // this token's records are consumed before the next need is published
  }
  if (lane < D) st_release_cta(&sh.need[warp][lane], INT_MAX);
}

// Returns network credit to the forwarder of every domain: the least position any receiver warp still needs.
__device__ void net_receiver_coordinator(const InternodeCombineParams& p, int channel, int first_receiver,
                                         int receivers, ReturnShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int D = net.num_domains, C = p.num_channels;
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < D;
  const int m = lane;
  uint64_t base;
  int n;
  lane_ring(active, ctrl->combine_base[channel], p.h.rdma_channel_prefix_matrix, m, channel, C, base, n);
  int credited = 0;  // positions below this are credited to the forwarder
  coordinate(p.fail, kRoleCombineNetReceiverCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (!active || credited == n) return 0;
    int low = INT_MAX;
    for (int w = first_receiver; w < first_receiver + receivers; ++w) low = min(low, ld_acquire_cta(&sh.need[w][m]));
    if (low > n) low = n;
    if (low > credited && (low - credited >= p.ring.step || low == n)) {
      if (m == net.domain)
        publish(&ctrl->combine_head[channel][m], base + low);  // this rank's own forwarders (acquire)
      else
        net_add(&ctrl->combine_head[channel][net.domain], uint64_t(low - credited), net.pe(m));
      credited = low;
      return 1;
    }
    peer = m, a = low, b = n;
    return 2;
  });
  if (active) ctrl->combine_base[channel][m] = base + n;  // where the next operation's ring starts
}

__device__ void return_block(const InternodeCombineParams& p, int channel) {
  __shared__ ReturnShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank;
  const ReturnRoles roles = ReturnRoles::of(G);
  const NvlStreams streams = NvlStreams::of(D, G, roles.nvl_senders > 0 ? roles.nvl_senders : 1);
  if (roles.nvl_senders > 0)  // idle sub-rings: head == base
    init_nvl_streams(sh.next, sh.base, streams, g, G, internode_nvl(p.peers, p.peers.rank)->combine_head[channel]);
  for (int x = threadIdx.x; x < kWarps * kMaxDomains; x += blockDim.x) sh.need[x / kMaxDomains][x % kMaxDomains] = 0;
  __syncthreads();
  const int first_receiver = roles.nvl_senders > 0 ? roles.nvl_senders + 1 : 0;
  if (warp < roles.nvl_senders)
    nvl_sender(p, channel, warp, roles.nvl_senders, sh);
  else if (roles.nvl_senders > 0 && warp == roles.nvl_senders)
    nvl_sender_coordinator(p, channel, sh);
  else if (warp < first_receiver + roles.receivers)
    net_receiver(p, channel, warp - first_receiver, roles.receivers, sh);
  else
    net_receiver_coordinator(p, channel, first_receiver, roles.receivers, sh);
}

// ---- forwarders ---------------------------------------------------------------------------------------------------

// Writes the record of one token for domain i at dst: its partial (two-level) or its rows (flat), and every rank's
// top-k weights (0 for ranks without the token). rows[j] / weights[j]: rank j's row and weights, null if absent;
// list: this warp's scratch list (shared).
__device__ __forceinline__ void write_combine_record(const InternodeCombineParams& p, uint8_t* dst,
                                                     const int4* const (&rows)[kMaxNvlRanks],
                                                     const float* const (&weights)[kMaxNvlRanks], const int4** list,
                                                     int lane) {
  const int G = p.peers.net.num_local, n = p.x_int4;
  int count = 0;
#pragma unroll
  for (int j = 0; j < kMaxNvlRanks; ++j) count += rows[j] != nullptr ? 1 : 0;
  int4* out = reinterpret_cast<int4*>(dst);
  if (!p.two_level || count == 1) {  // rows pass unchanged, in ascending j
    int r = 0;
#pragma unroll
    for (int j = 0; j < kMaxNvlRanks; ++j) {
      if (rows[j] == nullptr) continue;
      warp_copy<kInternodeCopyUnroll>(out + int64_t(r++) * n, rows[j], n, lane, LoadCg{}, StoreNa{});
    }
  } else {  // one partial: ascending j in float32 from 0, one rounding
    if (lane == 0) {
      int r = 0;
#pragma unroll
      for (int j = 0; j < kMaxNvlRanks; ++j)
        if (rows[j] != nullptr) list[r++] = rows[j];
    }
    __syncwarp();
    sum_rows_bf16<kReduceBatch, kReduceVectors>(out, list, count, n, nullptr, nullptr, lane);
  }
  float* w = reinterpret_cast<float*>(dst + p.net_record.weight_offset);
  for (int x = lane; x < G * p.num_topk; x += 32) {
    const int j = x / p.num_topk, k = x % p.num_topk;
    float v = 0.f;
#pragma unroll
    for (int jj = 0; jj < kMaxNvlRanks; ++jj)
      if (jj == j && weights[jj] != nullptr)
        v = __int_as_float(ld_cg(reinterpret_cast<const int32_t*>(weights[jj]) + k));
    w[x] = v;
  }
}

__device__ __forceinline__ void forwarder(const InternodeCombineParams& p, int channel, int w, int warps,
                                          ForwardShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, d = net.domain, C = p.num_channels;
  const uint64_t cap = p.ring.capacity;
  const ForwardGroup group = ForwardGroup::of(w, warps, D);
  if (group.domain < 0) return;
  const int i = group.domain;
  NetControl* ctrl = net_control(p.peers);
  InternodeNvlControl* nvl_ctrl = internode_nvl(p.peers, p.peers.rank);
  int* progress = &sh.progress[w][i];
  const uint64_t base = read_idle(&ctrl->combine_head[channel][i]);  // idle ring: head == the receiver's base
  const int n = channel_count(p.h.recv_rdma_channel_prefix_matrix, i, channel, C);
  const int index0 = net_record_base(p.h, i, channel, C);
  const int own_first = source_rows(p.h, i * G + g, channel, C).begin;
  uint64_t head_seen = base;
  int pending = 0;  // records whose puts are not yet announced
  // Completes this warp's puts, then says every record below `upto` that it owns has arrived.
  auto announce = [&](int upto) {
    if (pending > 0 && i != d) net_quiet();
    pending = 0;
    __syncwarp();
    if (lane == 0) st_release_cta(progress, upto);  // pairs with the coordinator's acquire
  };
  for (int pos = group.index; pos < n; pos += group.warps) {
    const uint64_t slot_pos = base + pos;
    if (slot_pos + 1 > head_seen + cap) {  // the slot is free once (i, g) has consumed position pos - cap
      announce(pos);
      if (lane == 0)  // pairs with the receiver coordinator's credit
        head_seen = wait_at_least(&ctrl->combine_head[channel][i], slot_pos + 1 - cap, p.fail,
                                  WaitSite{kRoleCombineForwarder, channel, i, pos});
      head_seen = __shfl_sync(kFullMask, head_seen, 0);
    }
    const int index = index0 + pos;
    const int head = lane < G ? p.h.send_nvl_head[int64_t(index) * G + lane] : -1;
    const int4* rows[kMaxNvlRanks];
    const float* weights[kMaxNvlRanks];
#pragma unroll
    for (int j = 0; j < kMaxNvlRanks; ++j) {
      const int o = __shfl_sync(kFullMask, head, j);
      rows[j] = nullptr;
      weights[j] = nullptr;
      if (j >= G || o < 0) continue;
      if (j == g) {
        const int row = own_first + o;
        rows[j] = p.x + int64_t(row) * p.x_int4;
        weights[j] = p.num_topk > 0 ? p.topk_weights + int64_t(row) * p.num_topk : nullptr;
        continue;
      }
      const uint64_t nvl_pos = sh.nvl_base[j][i] + o;
      uint64_t tail = 0;
      if (lane == 0) tail = acquire(&nvl_ctrl->combine_tail[channel][j][i]);
      if (__shfl_sync(kFullMask, tail, 0) <= nvl_pos) {
        announce(pos);  // records below pos are done: their heads can pass them
        if (lane == 0)
          wait_at_least(&nvl_ctrl->combine_tail[channel][j][i], nvl_pos + 1, p.fail,  // pairs with j's sender
                        WaitSite{kRoleCombineForwarder, channel, j, -1});             // coordinator's release
        __syncwarp();
      }
      const uint8_t* slot = p.nvl.slot(p.peers.nvl.local, channel, j, i, nvl_pos);
      rows[j] = reinterpret_cast<const int4*>(slot);
      weights[j] = p.num_topk > 0 ? reinterpret_cast<const float*>(slot + p.nvl_weight_offset) : nullptr;
    }
    uint8_t* record = p.ring.slot(ctrl, channel, i, i == d ? 1 : 0, slot_pos);
    write_combine_record(p, record, rows, weights, sh.rows[w], lane);
    if (i != d) {
      __syncwarp();  // the record's stores come before the put reads them
      // At (i, g), its receive half for this rank's domain, the same slot.
      net_put_warp(p.ring.slot(ctrl, channel, d, 1, slot_pos), record, size_t(p.net_record.bytes), net.pe(i));
    }
    if (++pending >= kAnnounceEvery || pos + group.warps >= n) announce(min(pos + group.warps, n));
  }
}

// Publishes the tail of the ring to every domain i at (i, g) (a signal after a fence; own domain: a release) and
// returns NVLink credit to every rank j of this domain (the rows of its sub-ring for i below the first unfinished
// token are consumed).
__device__ void forwarder_coordinator(const InternodeCombineParams& p, int channel, int warps, ForwardShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < D;
  const int i = lane;
  uint64_t base;  // idle ring: head == the receiver's base
  int n;
  lane_ring(active, ctrl->combine_head[channel], p.h.recv_rdma_channel_prefix_matrix, i, channel, C, base, n);
  const int index0 = active ? net_record_base(p.h, i, channel, C) : 0;
  int done = 0;
  coordinate(p.fail, kRoleCombineForwarderCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (!active || done == n) return 0;
    int low = n;
    for (int w = 0; w < warps; ++w) low = min(low, ld_acquire_cta(&sh.progress[w][i]));  // pairs with the warps'
    if (low == done) {                                                                   // announcements
      peer = i, a = low, b = n;
      return 2;
    }
    if (i == net.domain)
      publish(&ctrl->combine_tail[channel][i], base + low);  // cumulative over the records the warps wrote here
    else
      net_signal(&ctrl->combine_tail[channel][net.domain], base + low, net.pe(i));  // their puts are complete
    for (int j = 0; j < G; ++j) {
      if (j == g) continue;
      const int head = p.h.send_nvl_head[int64_t(index0 + low - 1) * G + j];
      const int below = head >= 0 ? head + 1 : -head - 1;
      publish(&internode_nvl(p.peers, j)->combine_head[channel][g][i], sh.nvl_base[j][i] + below);  // pairs with
    }  // j's NVLink senders
    done = low;
    return 1;
  });
  if (!active || n == 0) return;
  for (int j = 0; j < G; ++j) {  // where the next operation's sub-rings start: every row of this one is consumed
    if (j == g) continue;
    const int head = p.h.send_nvl_head[int64_t(index0 + n - 1) * G + j];
    internode_nvl(p.peers, p.peers.rank)->combine_base[channel][j][i] =
        sh.nvl_base[j][i] + (head >= 0 ? head + 1 : -head - 1);
  }
}

__device__ void forward_block(const InternodeCombineParams& p, int channel) {
  __shared__ ForwardShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, C = p.num_channels;
  constexpr int kForwarders = kWarps - 1;
  init_forward_block(sh.nvl_base, sh.progress, kForwarders, internode_nvl(p.peers, p.peers.rank)->combine_base[channel],
                     G, D, p.h.recv_rdma_channel_prefix_matrix, channel, C);
  if (warp < kForwarders)
    forwarder(p, channel, warp, kForwarders, sh);
  else
    forwarder_coordinator(p, channel, kForwarders, sh);
}

__global__ void __launch_bounds__(kThreads, 1)
    internode_combine_kernel(const __grid_constant__ InternodeCombineParams p) {
  run_channel_blocks<return_block, forward_block>(p);
}

}  // namespace

void launch_internode_combine(const InternodeCombineParams& p, cudaStream_t stream) {
  internode_combine_kernel<<<p.num_channels * 2, kThreads, 0, stream>>>(p);
}

}  // namespace epx
