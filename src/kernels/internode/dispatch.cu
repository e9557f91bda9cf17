// Internode dispatch (semantics.md sections 2 and 6): tokens cross the network once per destination domain and are
// forwarded inside it over NVLink. Two blocks per channel c; channel c is the same contiguous token range of every
// rank (ChannelRange), so every stream below is in token order.
//
// Block 2c (network side):
//  - network senders: every sender warp scans the channel's tokens (is_token_in_rank) 32 at a time, so all know
//    each token's position in the stream to every domain m and its ordinal among the tokens for each rank of m
//    without talking; the record at position p of a stream is written by sender warp p % senders: row, scales,
//    meta (the G-bit mask of m's ranks that get the token and the token's ordinal for each), global top-k ids and
//    weights, into its send slot, then put to the peer (m, g) (a nonblocking put; own-domain records go straight
//    into this rank's receive half). After each window, and before it waits for ring room, a warp completes its
//    puts (quiet) and publishes its progress per stream in shared memory: every position below it that the warp
//    owns has arrived. Also writes send_rdma_head [8].
//  - the sender coordinator (warp 0): turns the least progress over the sender warps into each ring's tail at the
//    receiver (a signal after a fence; own domain: a release); pads the outputs in worst-case mode.
//  - NVLink receivers (G > 1): read the sub-rings that the other ranks of this domain forward into (one per source
//    domain and local rank s), copy each record to its recv_x row (recv_gbl_channel_prefix_matrix + ordinal) and its
//    small fields; their coordinator (the block's last warp) returns NVLink credit (head) to each forwarder.
// Block 2c + 1 (forwarders): the records of source domain i arrive in this rank's ring from (i, g), announced by its
// tail; domain i has its own group of forwarder warps, record p to warp p % group size. Each record goes to every
// rank j of this domain its mask names: to this rank's own outputs directly, to the others into this rank's
// sub-ring in j's buffer (slot = its ordinal for j). Also writes send_nvl_head [9]. The forwarder coordinator (last
// warp) turns the warps' progress into the sub-rings' tails (ordinals below the first unfinished record, read from
// the record before it) and into network credit for (i, g).
// Ring positions never reset: an operation starts where the last one ended (the sender at its head, the receiver at
// its base, equal once the notify in front of every operation has completed the previous one's credits).
// No warp waits while it holds written records it has not announced, so no ring capacity can deadlock.
#include <cuda_runtime.h>

#include "kernels/internode/common.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = kDataThreads;
constexpr int kWarps = kThreads / 32;

// Warps of the network-side block: warp 0 coordinates the senders, then the senders, then the NVLink receivers
// and (last warp) their coordinator. A domain of one GPU has nothing to receive over NVLink.
struct SendRoles {
  int senders;
  int receivers;
  __device__ static SendRoles of(int num_nvl_ranks) {
    if (num_nvl_ranks == 1) return {kWarps - 1, 0};
    const int senders = (kWarps - 2) / 2;
    return {senders, kWarps - 2 - senders};
  }
};

struct SendShared {
  int progress[kWarps][kMaxDomains];  // sender warp w: every position of stream m below this it owns has arrived
  // NVLink receivers: per (stream, slice) the next ordinal the slice has not copied, and each stream's base.
  int next[kMaxNvlStreams > kWarps ? kMaxNvlStreams : kWarps];
  uint64_t base[kMaxNvlStreams];
};

struct ForwardShared {
  int progress[kWarps][kMaxDomains];             // warp w: every record of domain i below this that w owns is done
  uint64_t nvl_base[kMaxNvlRanks][kMaxDomains];  // sub-ring (to j, domain i) positions at the start
};

// Writes token t's record for one domain into a ring slot: row, scales, meta (mask, this lane's ordinal if
// lane < G), global top-k ids and weights. Warp-collective.
__device__ __forceinline__ void write_record(const InternodeDispatchParams& p, int t, uint8_t* slot, uint32_t mask,
                                             int ordinal, int lane) {
  write_rows<kInternodeCopyUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(t) * p.x_int4, p.x_int4, lane,
                                   LoadNc{});
  int32_t* scales = reinterpret_cast<int32_t*>(slot + p.record.scale_offset);
  const ScaleRow src_scales = p.x_scales.token(t);  // the caller's strides; records hold them contiguous
  for (int i = lane; i < p.num_scales; i += 32) scales[i] = ld_nc(src_scales.at(i));
  int32_t* meta = reinterpret_cast<int32_t*>(slot + p.record.meta_offset);
  if (lane == 0) meta[0] = int32_t(mask);
  if (lane < p.peers.net.num_local) meta[1 + lane] = ordinal;
  if (lane < p.num_topk) {
    reinterpret_cast<int32_t*>(slot + p.record.topk_offset)[lane] =
        int32_t(ld_nc(p.topk_idx + int64_t(t) * p.num_topk + lane));
    reinterpret_cast<float*>(slot + p.record.weight_offset)[lane] =
        p.topk_weights != nullptr ? ld_nc(p.topk_weights + int64_t(t) * p.num_topk + lane) : 0.f;
  }
}

// A sender warp's announcement: its puts so far are complete at their peers, then lane m (< D) publishes
// progress[m] = `upto` (every position of stream m below it that this warp owns has arrived).
__device__ __forceinline__ void announce(int* progress, int num_domains, int upto, bool puts, int lane) {
  if (puts) net_quiet();  // every lane: its share of the warp's puts is complete
  __syncwarp();           // every lane's record stores (and completed puts) come before lane m's release
  if (lane < num_domains) st_release_cta(progress + lane, upto);  // pairs with the coordinator's acquire
}

// Network sender warp w of `warps`.
__device__ void net_sender(const InternodeDispatchParams& p, int channel, int w, int warps, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int R = p.num_ranks, G = net.num_local, D = net.num_domains, d = net.domain, C = p.num_channels;
  const uint64_t cap = p.ring.capacity;
  NetControl* ctrl = net_control(p.peers);
  int* progress = sh.progress[threadIdx.x / 32];
  const ChannelRange range = ChannelRange::of(p.num_tokens, C, channel);
  // Lane m: the ring to domain m (its start: the receiver's base), the credit last seen, the counts so far.
  uint64_t base = 0, head_seen = 0;
  int pos = 0;
  int count[kMaxNvlRanks] = {};  // lane m: tokens so far for rank m * G + j
  if (lane < D) base = head_seen = read_idle(&ctrl->dispatch_head[channel][lane]);  // idle ring: head == base
  bool puts = false;  // puts issued since the last announcement
  for (int cursor = range.begin, window = 0; cursor < range.end; cursor += 32, ++window) {
    const int t = cursor + lane;
    const bool valid = t < range.end;
    uint32_t ranks[kMaxRanks / 32] = {};
    if (valid) {
      const uint8_t* in = p.h.is_token_in_rank + int64_t(t) * R;
      for (int r = 0; r < R; ++r)
        if (in[r]) ranks[r / 32] |= 1u << (r % 32);
    }
    for (int m = 0; m < D; ++m) {
      uint32_t mask = 0;  // this lane's token: ranks of domain m it goes to
      for (int j = 0; j < G; ++j) {
        const int r = m * G + j;
        mask |= ((ranks[r / 32] >> (r % 32)) & 1u) << j;
      }
      const uint32_t routed = __ballot_sync(kFullMask, mask != 0);
      const int my_pos = __shfl_sync(kFullMask, pos, m) + __popc(routed & lanemask_lt());
      int ordinals[kMaxNvlRanks];
#pragma unroll
      for (int j = 0; j < kMaxNvlRanks; ++j) {
        if (j >= G) break;
        const uint32_t to_j = __ballot_sync(kFullMask, (mask >> j) & 1u);
        ordinals[j] = __shfl_sync(kFullMask, count[j], m) + __popc(to_j & lanemask_lt());
        if (lane == m) count[j] += __popc(to_j);
      }
      if (window % warps == w && valid) p.h.send_rdma_head[int64_t(t) * D + m] = mask != 0 ? my_pos : -my_pos - 1;
      const uint64_t m_base = __shfl_sync(kFullMask, base, m);
      for (uint32_t mine = __ballot_sync(kFullMask, mask != 0 && my_pos % warps == w); mine != 0; mine &= mine - 1) {
        const int l = __ffs(mine) - 1;
        const int rp = __shfl_sync(kFullMask, my_pos, l);
        const uint32_t rmask = __shfl_sync(kFullMask, mask, l);
        int ordinal = 0;
#pragma unroll
        for (int j = 0; j < kMaxNvlRanks; ++j) {
          if (j >= G) break;
          const int v = __shfl_sync(kFullMask, ordinals[j], l);
          if (lane == j) ordinal = v;
        }
        // Room: the slot of position rp is free once the receiver has consumed position rp - cap.
        const uint64_t slot_pos = m_base + rp;
        const uint64_t seen = __shfl_sync(kFullMask, head_seen, m);
        if (slot_pos + 1 > seen + cap) {
          // Announce first (this stream up to rp, the others as far as this window has gone), so that the tails
          // can reach whatever the receiver needs to free the slot.
          announce(progress, D, lane == m ? rp : pos, puts, lane);
          puts = false;
          uint64_t h = 0;
          if (lane == 0)  // pairs with the receiver's credit (net_add, or its coordinator's release, own domain)
            h = wait_at_least(&ctrl->dispatch_head[channel][m], slot_pos + 1 - cap, p.fail,
                              WaitSite{kRoleNetSender, channel, m, rp});
          h = __shfl_sync(kFullMask, h, 0);
          if (lane == m) head_seen = h;
        }
        const bool own = m == d;
        uint8_t* slot = p.ring.slot(ctrl, channel, m, own ? 1 : 0, slot_pos);
        write_record(p, cursor + l, slot, rmask, ordinal, lane);
        if (!own) {
          __syncwarp();  // the record's stores come before the put reads them
          // At the peer, its receive half for this rank's domain, the same slot.
          net_put_warp(p.ring.slot(ctrl, channel, d, 1, slot_pos), slot, size_t(p.record.bytes), net.pe(m));
          puts = true;
        }
      }
      if (lane == m) pos += __popc(routed);
    }
    announce(progress, D, pos, puts, lane);  // the window is done: every stream up to its count so far
    puts = false;
  }
}

// Worst-case mode: rows [received, num_worst_tokens) of the outputs, this channel's share, hold no token.
__device__ void pad_rows(const InternodeDispatchParams& p, int channel) {
  const int lane = threadIdx.x % 32;
  const int received = p.h.recv_gbl_rank_prefix_sum[p.num_ranks - 1];
  if (received >= p.num_worst_tokens) return;
  const ChannelRange share = ChannelRange::of(p.num_worst_tokens - received, p.num_channels, channel);
  for (int row = received + share.begin; row < received + share.end; ++row) {
    if (lane == 0) {
      p.h.recv_src_meta[2 * int64_t(row)] = -1;
      p.h.recv_src_meta[2 * int64_t(row) + 1] = 0;
    }
    if (lane < p.num_topk) {
      if (p.recv_topk_idx != nullptr) p.recv_topk_idx[int64_t(row) * p.num_topk + lane] = -1;
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[int64_t(row) * p.num_topk + lane] = 0.f;
    }
  }
}

// Sender coordinator: lane m publishes the tail of the ring to domain m at its receiver = base + the least
// progress over the sender warps, whenever it grows, until every record of the channel has arrived.
__device__ void sender_coordinator(const InternodeDispatchParams& p, int channel, int first_sender, int senders,
                                   SendShared& sh) {
  const int lane = threadIdx.x % 32;
  if (p.num_worst_tokens > 0) pad_rows(p, channel);
  const NetworkMap& net = p.peers.net;
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < net.num_domains;
  const int m = lane;
  uint64_t base;  // idle ring: head == the receiver's base
  int total, published = 0;
  lane_ring(active, ctrl->dispatch_head[channel], p.h.rdma_channel_prefix_matrix, m, channel, p.num_channels, base,
            total);
  coordinate(p.fail, kRoleNetSenderCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (!active || published == total) return 0;
    int low = total;
    for (int w = first_sender; w < first_sender + senders; ++w)
      low = min(low, ld_acquire_cta(&sh.progress[w][m]));  // pairs with the senders' announcements
    if (low == published) {
      peer = m, a = published, b = total;
      return 2;
    }
    if (m == net.domain)
      publish(&ctrl->dispatch_tail[channel][m], base + low);  // cumulative over the records the warps wrote here
    else
      net_signal(&ctrl->dispatch_tail[channel][net.domain], base + low, net.pe(m));  // their puts are complete
    published = low;
    return 1;
  });
}

// NVLink receivers: each record of stream (i, s) that s's forwarder has released (below the tail) goes to its
// recv_x row.
__device__ void nvl_receiver(const InternodeDispatchParams& p, int channel, int w, int warps, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const NvlStreams streams = NvlStreams::of(D, G, warps);
  InternodeNvlControl* ctrl = internode_nvl(p.peers, p.peers.rank);
  uint8_t* buffer = p.peers.nvl.local;
  serve_nvl_streams(
      p.h, p.fail, kRoleNvlReceiver, channel, C, g, G, w, warps, streams, sh.next, sh.base,
      ctrl->dispatch_tail[channel], [](uint64_t pos, uint64_t tail) { return pos < tail; },
      [](uint64_t pos) { return pos; },
      [&](int i, int s, int row, uint64_t pos) {
        write_output_row(p, p.nvl.slot(buffer, channel, s, i, pos), row, i, lane);
      });
}

// Returns NVLink credit: head of stream (i, s) = its base + the least next ordinal over its slices.
__device__ void nvl_receiver_coordinator(const InternodeDispatchParams& p, int channel, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const NvlStreams streams = NvlStreams::of(D, G, SendRoles::of(G).receivers);
  coordinate_nvl_streams(p.h, p.fail, kRoleNvlReceiverCoordinator, channel, C, g, G, streams, sh.next, sh.base,
                         [&](int i, int s) { return &internode_nvl(p.peers, s)->dispatch_head[channel][g][i]; });
  for (int st = lane; st < streams.count; st += 32) {  // where the next operation's sub-rings start
    int i, s;
    NvlStreams::source(st, g, G, i, s);
    const RowRange rows = source_rows(p.h, i * G + s, channel, C);
    internode_nvl(p.peers, p.peers.rank)->dispatch_base[channel][s][i] = sh.base[st] + (rows.end - rows.begin);
  }
}

__device__ void send_block(const InternodeDispatchParams& p, int channel) {
  __shared__ SendShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank;
  const SendRoles roles = SendRoles::of(G);
  const NvlStreams streams = NvlStreams::of(D, G, roles.receivers > 0 ? roles.receivers : 1);
  for (int x = threadIdx.x; x < kWarps * kMaxDomains; x += blockDim.x)
    sh.progress[x / kMaxDomains][x % kMaxDomains] = 0;
  if (roles.receivers > 0)
    init_nvl_streams(sh.next, sh.base, streams, g, G, internode_nvl(p.peers, p.peers.rank)->dispatch_base[channel]);
  __syncthreads();
  if (warp == 0) {
    sender_coordinator(p, channel, 1, roles.senders, sh);
  } else if (warp <= roles.senders) {
    net_sender(p, channel, warp - 1, roles.senders, sh);
  } else if (warp < kWarps - 1) {
    nvl_receiver(p, channel, warp - 1 - roles.senders, roles.receivers, sh);
  } else if (roles.receivers > 0) {
    nvl_receiver_coordinator(p, channel, sh);
  }
}

// ---- forwarders ---------------------------------------------------------------------------------------------------

__device__ void forwarder(const InternodeDispatchParams& p, int channel, int w, int warps, ForwardShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const ForwardGroup group = ForwardGroup::of(w, warps, D);
  if (group.domain < 0) return;
  const int i = group.domain;
  NetControl* ctrl = net_control(p.peers);
  InternodeNvlControl* nvl_ctrl = internode_nvl(p.peers, p.peers.rank);
  const uint64_t base = read_idle(&ctrl->dispatch_base[channel][i]);
  const int n = channel_count(p.h.recv_rdma_channel_prefix_matrix, i, channel, C);
  const int index0 = net_record_base(p.h, i, channel, C);
  const int own_first = source_rows(p.h, i * G + g, channel, C).begin;
  uint64_t tail_seen = base;
  for (int pos = group.index; pos < n; pos += group.warps) {
    if (tail_seen <= base + pos) {  // pairs with the sender coordinator's signal (or release, own domain)
      if (lane == 0)
        tail_seen = wait_at_least(&ctrl->dispatch_tail[channel][i], base + pos + 1, p.fail,
                                  WaitSite{kRoleForwarder, channel, i, pos});
      tail_seen = __shfl_sync(kFullMask, tail_seen, 0);
    }
    const uint8_t* rec = p.ring.slot(ctrl, channel, i, 1, base + pos);
    const int32_t* meta = reinterpret_cast<const int32_t*>(rec + p.record.meta_offset);
    const uint32_t mask = uint32_t(ld_cg(meta));
    const int ordinal = lane < G ? ld_cg(meta + 1 + lane) : 0;
    const int index = index0 + pos;
    if (lane < G && (p.num_worst_tokens == 0 || index < p.num_worst_tokens))
      p.h.send_nvl_head[int64_t(index) * G + lane] = (mask >> lane) & 1u ? ordinal : -ordinal - 1;
    for (uint32_t left = mask; left != 0; left &= left - 1) {
      const int j = __ffs(left) - 1;
      const int o = __shfl_sync(kFullMask, ordinal, j);
      if (j == g) {
        write_output_row(p, rec, own_first + o, i, lane);
        continue;
      }
      const uint64_t nvl_pos = sh.nvl_base[j][i] + o;
      if (lane == 0 && nvl_pos + 1 > uint64_t(p.nvl.capacity) &&
          acquire(&nvl_ctrl->dispatch_head[channel][j][i]) < nvl_pos + 1 - p.nvl.capacity) {
        st_release_cta(&sh.progress[w][i], pos);  // records below pos are done: the tails can pass them
        wait_at_least(&nvl_ctrl->dispatch_head[channel][j][i], nvl_pos + 1 - p.nvl.capacity, p.fail,  // pairs with
                      WaitSite{kRoleForwarder, channel, j, -1});  // the receiver coordinator's release
      }
      __syncwarp();
      write_rows<kInternodeCopyUnroll>(reinterpret_cast<int4*>(p.nvl.slot(p.peers.nvl.peer[j], channel, g, i, nvl_pos)),
                                       reinterpret_cast<const int4*>(rec), int(p.record.bytes / 16), lane, LoadCg{});
    }
    __syncwarp();
    if (lane == 0) st_release_cta(&sh.progress[w][i], min(pos + group.warps, n));  // pairs with the coordinator
  }
}

// Turns the forwarders' progress into NVLink tails (for every rank j of this domain) and network credit (for the
// peer of every domain), until every record is forwarded and credited; then records where the next operation's
// ring starts.
__device__ void forwarder_coordinator(const InternodeDispatchParams& p, int channel, int warps, ForwardShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < D;
  const int i = lane;
  uint64_t base;
  int n;
  lane_ring(active, ctrl->dispatch_base[channel], p.h.recv_rdma_channel_prefix_matrix, i, channel, C, base, n);
  int forwarded = 0, credited = 0;  // records below these are forwarded (tails published) / credited
  coordinate(p.fail, kRoleForwarderCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (!active) return 0;
    int low = n;
    for (int w = 0; w < warps; ++w) low = min(low, ld_acquire_cta(&sh.progress[w][i]));  // pairs with the warps'
    int state = low == n && credited == n ? 0 : 2;                                       // releases
    if (low > forwarded) {
      // Tails: the ordinals below record `low` for rank j, from the record before it (still in the ring: its
      // credit is returned below, after this).
      const uint8_t* prev = p.ring.slot(ctrl, channel, i, 1, base + low - 1);
      const int32_t* meta = reinterpret_cast<const int32_t*>(prev + p.record.meta_offset);
      const uint32_t mask = uint32_t(ld_cg(meta));
      for (int j = 0; j < G; ++j) {
        if (j == g) continue;
        const int below = ld_cg(meta + 1 + j) + int((mask >> j) & 1u);
        publish(&internode_nvl(p.peers, j)->dispatch_tail[channel][g][i], sh.nvl_base[j][i] + below);  // pairs with
      }                                                                                                // the receiver
      forwarded = low;
      state = 1;
    }
    if (forwarded > credited && (forwarded - credited >= p.ring.step || forwarded == n)) {
      if (i == net.domain)
        publish(&ctrl->dispatch_head[channel][i], base + forwarded);  // this rank's own senders (acquire)
      else
        net_add(&ctrl->dispatch_head[channel][net.domain], uint64_t(forwarded - credited), net.pe(i));
      credited = forwarded;
      state = 1;
    }
    if (state == 2) peer = i, a = low, b = n;
    return state;
  });
  if (active) ctrl->dispatch_base[channel][i] = base + n;  // where the next operation's ring starts
}

__device__ void forward_block(const InternodeDispatchParams& p, int channel) {
  __shared__ ForwardShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, C = p.num_channels;
  constexpr int kForwarders = kWarps - 1;
  // The sub-rings this rank forwards into are idle: each starts at its head.
  init_forward_block(sh.nvl_base, sh.progress, kForwarders,
                     internode_nvl(p.peers, p.peers.rank)->dispatch_head[channel], G, D,
                     p.h.recv_rdma_channel_prefix_matrix, channel, C);
  if (warp < kForwarders)
    forwarder(p, channel, warp, kForwarders, sh);
  else
    forwarder_coordinator(p, channel, kForwarders, sh);
}

__global__ void __launch_bounds__(kThreads, 1)
    internode_dispatch_kernel(const __grid_constant__ InternodeDispatchParams p) {
  run_channel_blocks<send_block, forward_block>(p);
}

}  // namespace

void launch_internode_dispatch(const InternodeDispatchParams& p, cudaStream_t stream) {
  internode_dispatch_kernel<<<p.num_channels * 2, kThreads, 0, stream>>>(p);
}

}  // namespace epx
