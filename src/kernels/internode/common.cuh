// What the internode kernels share: where the control blocks are, the progress words between a role's warps and
// its coordinator, and the receiving end of a dispatch record (a recv_x row and its small fields).
#pragma once

#include <climits>
#include <cstdint>

#include "device/bf16.cuh"
#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "layout/internode_params.hpp"

namespace epx::dev {

// 16-byte loads in flight per lane in row copies.
constexpr int kInternodeCopyUnroll = 4;

__device__ __forceinline__ NetControl* net_control(const PeerMap& m) {
  return reinterpret_cast<NetControl*>(m.net.local);
}

// Local rank r's internode NVLink control block as mapped here.
__device__ __forceinline__ InternodeNvlControl* internode_nvl(const PeerMap& m, int r) {
  return reinterpret_cast<InternodeNvlControl*>(m.nvl.peer[r] + InternodeNvlLayout::control_offset());
}

// Rows [begin, end) of recv_x that source rank src sends in channel c (the handle's [5], [6]).
struct RowRange {
  int begin;
  int end;
};
__device__ __forceinline__ RowRange source_rows(const InternodeHandleView& h, int src, int channel, int num_channels) {
  const int begin = h.recv_gbl_channel_prefix_matrix[src * num_channels + channel];
  const int end = channel + 1 < num_channels ? h.recv_gbl_channel_prefix_matrix[src * num_channels + channel + 1]
                                             : h.recv_gbl_rank_prefix_sum[src];
  return {begin, end};
}

// Per-channel count of an inclusive prefix matrix row: m[row][c] - m[row][c - 1].
__device__ __forceinline__ int channel_count(const int* matrix, int row, int channel, int num_channels) {
  const int* r = matrix + row * num_channels;
  return r[channel] - (channel > 0 ? r[channel - 1] : 0);
}

// The network-received index of the first record of (source domain m, channel c): [4][m - 1] + [3][m][c - 1].
__device__ __forceinline__ int net_record_base(const InternodeHandleView& h, int domain, int channel,
                                               int num_channels) {
  return (domain > 0 ? h.recv_rdma_rank_prefix_sum[domain - 1] : 0) +
         (channel > 0 ? h.recv_rdma_channel_prefix_matrix[domain * num_channels + channel - 1] : 0);
}

// send_nvl_head entry -> how many of the source's tokens before this one (in its channel) went to that rank.
__device__ __forceinline__ int ordinal_of(int head) { return head >= 0 ? head : -head - 1; }

// Writes a dispatch record (at rec, in a ring) to output row `row`: the row, its scales, the top-k rebased to this
// rank's experts (-1 elsewhere, weight 0), and recv_src_meta (source domain, mask). Warp-collective. In worst-case
// mode a row past the outputs is dropped and reported (the notify reported the overflow already).
__device__ __forceinline__ void write_output_row(const InternodeDispatchParams& p, const uint8_t* rec, int row,
                                                 int src_domain, int lane) {
  if (p.num_worst_tokens > 0 && row >= p.num_worst_tokens) return;
  const int32_t* meta = reinterpret_cast<const int32_t*>(rec + p.record.meta_offset);
  const int32_t mask = ld_cg(meta);
  const int32_t* topk = reinterpret_cast<const int32_t*>(rec + p.record.topk_offset);
  const int32_t* weights = reinterpret_cast<const int32_t*>(rec + p.record.weight_offset);
  int32_t e = -1, w = 0;
  if (lane < p.num_topk) {
    e = ld_cg(topk + lane);
    w = ld_cg(weights + lane);
  }
  warp_copy<kInternodeCopyUnroll>(p.recv_x + int64_t(row) * p.x_int4, reinterpret_cast<const int4*>(rec), p.x_int4,
                                  lane, LoadCg{}, StoreNa{});
  const int32_t* scales = reinterpret_cast<const int32_t*>(rec + p.record.scale_offset);
  for (int i = lane; i < p.num_scales; i += 32)
    reinterpret_cast<int32_t*>(p.recv_x_scales)[int64_t(row) * p.num_scales + i] = ld_cg(scales + i);
  if (lane < p.num_topk) {
    const int64_t first = int64_t(p.peers.net.pe(p.peers.net.domain)) * p.experts_per_rank;
    const bool mine = e >= first && e < first + p.experts_per_rank;
    if (p.recv_topk_idx != nullptr) p.recv_topk_idx[int64_t(row) * p.num_topk + lane] = mine ? e - first : -1;
    if (p.recv_topk_weights != nullptr)
      p.recv_topk_weights[int64_t(row) * p.num_topk + lane] = mine ? __int_as_float(w) : 0.f;
  }
  if (lane == 0) {
    p.h.recv_src_meta[2 * int64_t(row)] = src_domain;
    p.h.recv_src_meta[2 * int64_t(row) + 1] = mask;
  }
}

// out[v] = bf16(float(rows[0][v]) + float(rows[1][v]) + ... + float(rows[count - 1][v]) + b0[v] + b1[v]) for the n
// 16-byte positions v of a row: float32 from 0, the rows in list order, then the biases (null: none), one rounding.
// Each lane loads kVectors positions of kBatch rows before it adds them, so kBatch * kVectors loads are in flight;
// the additions keep the list order. Warp-collective; rows is this warp's list (shared memory).
template <int kBatch, int kVectors>
__device__ __forceinline__ void sum_rows_bf16(int4* out, const int4* const* rows, int count, int n, const int4* b0,
                                              const int4* b1, int lane) {
  for (int base = lane; base < n; base += 32 * kVectors) {
    float acc[kVectors][8];
#pragma unroll
    for (int u = 0; u < kVectors; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
    for (int r0 = 0; r0 < count; r0 += kBatch) {
      int4 v[kBatch][kVectors];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (r0 + b >= count) continue;
        const int4* row = rows[r0 + b];
#pragma unroll
        for (int u = 0; u < kVectors; ++u)
          if (base + 32 * u < n) v[b][u] = ld_cg(row + base + 32 * u);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (r0 + b >= count) continue;
#pragma unroll
        for (int u = 0; u < kVectors; ++u)
          if (base + 32 * u < n) add_bf16x8(acc[u], v[b][u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int i = base + 32 * u;
      if (i >= n) break;
      if (b0 != nullptr) add_bf16x8(acc[u], ld_nc(b0 + i));
      if (b1 != nullptr) add_bf16x8(acc[u], ld_nc(b1 + i));
      st_na(out + i, pack_bf16x8(acc[u]));
    }
  }
}

// Rows of a combine reduction loaded together per lane (sum_rows_bf16's kBatch and kVectors).
constexpr int kReduceBatch = 2;
constexpr int kReduceVectors = 2;

// The forwarder warps that serve domain i (the records' source domain in the dispatch, their destination in the
// combine): warps [i * per, (i + 1) * per), per = warps / D, the rest idle. Each domain has its own warps, so a
// warp waiting on one domain never holds back another's records.
struct ForwardGroup {
  int domain;  // -1: idle
  int index;
  int warps;
  __device__ static ForwardGroup of(int warp, int warps, int num_domains) {
    const int per = warps / num_domains;
    if (warp >= per * num_domains) return {-1, 0, per};
    return {warp / per, warp % per, per};
  }
};

// Block-wide, before the forwarders start: progress[w][i] = the first record of domain i (channel `channel`)
// forwarder warp w owns, or all n of them where w does not serve domain i (it never holds that domain back).
// recv_rdma_channel_prefix_matrix: the handle's [D, C] matrix ([3]).
__device__ __forceinline__ void init_forward_progress(int (*progress)[kMaxDomains], int forwarders, int num_domains,
                                                      const int* recv_rdma_channel_prefix_matrix, int channel,
                                                      int num_channels) {
  for (int x = threadIdx.x; x < forwarders * num_domains; x += blockDim.x) {
    const int w = x / num_domains, i = x % num_domains;
    const int n = channel_count(recv_rdma_channel_prefix_matrix, i, channel, num_channels);
    const ForwardGroup group = ForwardGroup::of(w, forwarders, num_domains);
    progress[w][i] = group.domain == i ? min(group.index, n) : n;
  }
}

// Block-wide set-up of a forwarder block (2c + 1), then a barrier: nvl_base[j][i] = where the sub-ring of (local rank
// j, domain i) starts this operation, read from idle[j][i] (in this rank's control block), and the forwarders'
// progress (init_forward_progress).
__device__ __forceinline__ void init_forward_block(uint64_t (*nvl_base)[kMaxDomains], int (*progress)[kMaxDomains],
                                                   int forwarders, const uint64_t (*idle)[kMaxDomains], int G, int D,
                                                   const int* recv_rdma_channel_prefix_matrix, int channel,
                                                   int num_channels) {
  for (int x = threadIdx.x; x < G * D; x += blockDim.x) nvl_base[x / D][x % D] = read_idle(&idle[x / D][x % D]);
  init_forward_progress(progress, forwarders, D, recv_rdma_channel_prefix_matrix, channel, num_channels);
  __syncthreads();
}

// The body of the internode dispatch and combine kernels: nothing after an earlier error (the check is collective:
// every rank skips), else block 2c runs First(p, c) and block 2c + 1 Second(p, c).
template <auto First, auto Second, typename Params>
__device__ __forceinline__ void run_channel_blocks(const Params& p) {
  if (ld_relaxed_sys(&nvl_self(p.peers)->op_error) != 0) return;  // collective: every rank skips
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0)
    First(p, channel);
  else
    Second(p, channel);
}

// Lane m of a coordinator whose lanes m < D (`active`) each keep the ring to or from domain m: base = where the ring
// starts this operation, read from idle[m] (idle here), and n = how many records it carries in this channel, row m
// of an inclusive [D, C] prefix matrix. The other lanes get 0 and 0.
__device__ __forceinline__ void lane_ring(bool active, const uint64_t* idle, const int* matrix, int m, int channel,
                                          int num_channels, uint64_t& base, int& n) {
  base = 0;
  n = 0;
  if (active) {
    base = read_idle(&idle[m]);
    n = channel_count(matrix, m, channel, num_channels);
  }
}

// A coordinator's loop: until done(), call step(); spin with a budget only while a step made no progress.
template <typename Step>
__device__ __forceinline__ void coordinate(const FailState& fail, int role, int channel, Step step) {
  SpinBudget budget;
  while (true) {
    int peer = -1, seen = 0, target = 0;
    const int state = step(peer, seen, target);  // 0 done, 1 progressed, 2 waiting
    if (__all_sync(kFullMask, state == 0)) return;
    if (__any_sync(kFullMask, state == 1)) {
      budget.start = 0;
      continue;
    }
    budget.tick(fail, WaitSite{role, channel, peer, 0}, seen, target);
  }
}

// The NVLink streams of a channel in block 2c: stream st = (source domain i, local rank s != this one), D * (G - 1)
// of them (dispatch: the sub-ring s forwards into here for domain i, read by the NVLink receivers; combine: the
// sub-ring at s this rank returns domain i's rows into, written by the NVLink senders). The warps that serve them
// split each stream into slices; slice k of a stream takes the ordinals o with o % slices == k.
constexpr int kMaxNvlStreams = kMaxDomains * (kMaxNvlRanks - 1);
struct NvlStreams {
  int count;   // D * (G - 1)
  int slices;  // per stream
  __device__ static NvlStreams of(int D, int G, int warps) {
    const int n = D * (G - 1);
    return {n, n == 0 || n >= warps ? 1 : warps / n};
  }
  __device__ static void source(int st, int g, int G, int& i, int& s) {
    i = st / (G - 1);
    s = st % (G - 1);
    s += s >= g ? 1 : 0;
  }
};

// Block-wide, before the NVLink stream warps start: next[item] = the first ordinal of item = st * slices + slice (its
// slice), base[st] = where stream (i, s) starts this operation, read from idle[s][i] (in this rank's control block).
__device__ __forceinline__ void init_nvl_streams(int* next, uint64_t* base, const NvlStreams& streams, int g, int G,
                                                 const uint64_t (*idle)[kMaxDomains]) {
  for (int item = threadIdx.x; item < streams.count * streams.slices; item += blockDim.x)
    next[item] = item % streams.slices;
  for (int st = threadIdx.x; st < streams.count; st += blockDim.x) {
    int i, s;
    NvlStreams::source(st, g, G, i, s);
    base[st] = read_idle(&idle[s][i]);
  }
}

// NVLink stream warp w of `warps` (dispatch: a receiver; combine: a sender). Its items are item = st * slices +
// slice for item = w, w + warps, ...; next[item] is the slice's next ordinal o, base[st] the stream's start. Stream
// (i, s) has the rows of source rank i * G + s in this channel (source_rows). For an item with ordinals left it reads
// the word words[s][i] that s advances (acquire), then serve(i, s, row, pos) for row = the rows' begin + o and
// pos = base + o while ready(pos, word), and releases the next o to the coordinator. When no item moved, the spin
// budget ticks at (role, s) with the word and need(pos) of the last item that waits. Returns once every item is done.
template <typename Ready, typename Need, typename Serve>
__device__ __forceinline__ void serve_nvl_streams(const InternodeHandleView& h, const FailState& fail, int role,
                                                  int channel, int num_channels, int g, int G, int w, int warps,
                                                  const NvlStreams& streams, int* next, const uint64_t* base,
                                                  const uint64_t (*words)[kMaxDomains], Ready ready, Need need,
                                                  Serve serve) {
  const int lane = threadIdx.x % 32;
  const int items = streams.count * streams.slices;
  SpinBudget budget;
  while (true) {
    bool progressed = false, done = true;
    int wait_peer = -1;
    uint64_t wait_seen = 0, wait_need = 0;
    for (int item = w; item < items; item += warps) {
      const int st = item / streams.slices;
      int i, s;
      NvlStreams::source(st, g, G, i, s);
      const RowRange rows = source_rows(h, i * G + s, channel, num_channels);
      const int n = rows.end - rows.begin;
      int o = next[item];
      if (o >= n) continue;
      done = false;
      const uint64_t start = base[st];
      uint64_t word = 0;
      if (lane == 0) word = acquire(&words[s][i]);  // pairs with s's release
      word = __shfl_sync(kFullMask, word, 0);
      for (; o < n && ready(start + o, word); o += streams.slices) {
        serve(i, s, rows.begin + o, start + o);
        progressed = true;
      }
      __syncwarp();
      if (lane == 0) st_release_cta(&next[item], o);  // pairs with the coordinator's acquire
      if (o < n) wait_peer = s, wait_seen = word, wait_need = need(start + o);
    }
    if (done) return;
    if (progressed)
      budget.start = 0;
    else
      budget.tick(fail, WaitSite{role, channel, wait_peer, -1}, int64_t(wait_seen), int64_t(wait_need));
  }
}

// The coordinator of the NVLink stream warps: for every stream (i, s), publishes base[st] + the least next ordinal
// over its slices at word(i, s) (in s's control block) whenever it grows, until every stream is done.
template <typename Word>
__device__ __forceinline__ void coordinate_nvl_streams(const InternodeHandleView& h, const FailState& fail, int role,
                                                       int channel, int num_channels, int g, int G,
                                                       const NvlStreams& streams, const int* next, const uint64_t* base,
                                                       Word word) {
  const int lane = threadIdx.x % 32;
  int published[kMaxNvlStreams / 32 + 1] = {};
  coordinate(fail, role, channel, [&](int& peer, int& a, int& b) {
    int state = 0;
    for (int round = 0; round * 32 < streams.count; ++round) {
      const int st = round * 32 + lane;
      if (st >= streams.count) continue;
      int i, s;
      NvlStreams::source(st, g, G, i, s);
      const RowRange rows = source_rows(h, i * G + s, channel, num_channels);
      const int n = rows.end - rows.begin;
      int low = n;
      for (int slice = 0; slice < streams.slices; ++slice)
        low = min(low, ld_acquire_cta(&next[st * streams.slices + slice]));  // pairs with the warps' releases
      if (low > published[round]) {
        publish(word(i, s), base[st] + low);  // pairs with s's acquire
        published[round] = low;
        state = max(state, 1);
      } else if (low < n) {
        state = 2;
        peer = s, a = low, b = n;
      }
    }
    return state;
  });
}

}  // namespace epx::dev
