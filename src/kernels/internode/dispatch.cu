// Internode dispatch (SPEC sections 2 and 6): tokens cross the network once per destination domain and are
// forwarded inside it over NVLink. Two blocks per channel c; channel c is the same contiguous token range of every
// rank (ChannelRange), so every stream below is in token order.
//
// Block 2c (network side):
//  - network senders: every sender warp scans the channel's tokens (is_token_in_rank) 32 at a time, so all know
//    each token's position in the stream to every domain m and its ordinal among the tokens for each rank of m
//    without talking. The stream to m is cut into chunks of ring.chunk records; chunk k belongs to sender warp
//    (k * D + m) % senders, which writes its records (row, scales, meta: the G-bit mask of m's ranks that get the
//    token and the token's ordinal for each, global top-k ids and weights) into its send slots, then puts the chunk
//    to the peer (m, g) with a chunk signal (put with signal). Own-domain records go straight into this rank's
//    receive half and are announced by a release of the signal. Also writes send_rdma_head [8].
//  - the sender coordinator (warp 0): relays each ring's credit (the head, added to by the receiving peer) into
//    shared memory, where the sender warps wait for room; pads the outputs in worst-case mode.
//  - NVLink receivers (G > 1): read the sub-rings that the other ranks of this domain forward into (one per source
//    domain and local rank s), copy each record to its recv_x row (recv_gbl_channel_prefix_matrix + ordinal) and its
//    small fields; their coordinator (the block's last warp) returns NVLink credit (head) to each forwarder.
// Block 2c + 1 (forwarders): the records of source domain i arrive in this rank's ring from (i, g); chunk k of it
// belongs to forwarder warp (k * D + i) % forwarders, processed in (k, i) order. Each record goes to every rank j
// of this domain its mask names: to this rank's own outputs directly, to the others into this rank's sub-ring in
// j's buffer (slot = its ordinal for j). Also writes send_nvl_head [9]. The forwarder coordinator (last warp) turns
// the warps' progress into the sub-rings' tails (ordinals below the first unfinished record, read from the record
// before it) and into network credit for (i, g).
// Ring positions never reset; an operation's network ring starts at a whole chunk (NetRing::start), both ends
// computing it from the same raw position (the sender's head, the receiver's base), equal once the notify in
// front of every operation has completed the previous one's credits.
#include <cuda_runtime.h>

#include "kernels/internode/common.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = kDataThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = kMaxDomains * (kMaxNvlRanks - 1);  // NVLink sub-rings one rank reads per channel

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
  uint64_t head[kMaxDomains];  // network credit per domain, as the sender coordinator last read it
  int senders_done;
  // NVLink receivers: per (stream, slice) the next ordinal the slice has not copied, and each stream's base.
  int next[kMaxStreams > kWarps ? kMaxStreams : kWarps];
  uint64_t base[kMaxStreams];
};

struct ForwardShared {
  int progress[kWarps][kMaxDomains];       // warp w: every record of domain i below this that w owns is done
  uint64_t nvl_base[kMaxNvlRanks][kMaxDomains];  // sub-ring (to j, domain i) positions at the start
};

__device__ __forceinline__ int chunk_owner(int chunk, int domain, int num_domains, int warps) {
  return (chunk * num_domains + domain) % warps;
}

// The first chunk of domain i at or after `from` that warp w owns, as a position (n if none).
__device__ __forceinline__ int next_owned(int from_chunk, int i, int n, int D, int S, int w, int warps) {
  for (int k = from_chunk; k * S < n; ++k)
    if (chunk_owner(k, i, D, warps) == w) return k * S;
  return n;
}

// Writes token t's record for one domain into a ring slot: row, scales, meta (mask, this lane's ordinal if
// lane < G), global top-k ids and weights. Warp-collective.
__device__ __forceinline__ void write_record(const InternodeDispatchParams& p, int t, uint8_t* slot, uint32_t mask,
                                             int ordinal, int lane) {
  write_rows<kInternodeCopyUnroll>(reinterpret_cast<int4*>(slot), p.x + int64_t(t) * p.x_int4, p.x_int4, lane,
                                   LoadNc{});
  int32_t* scales = reinterpret_cast<int32_t*>(slot + p.record.scale_offset);
  const int32_t* src_scales = reinterpret_cast<const int32_t*>(p.x_scales) + int64_t(t) * p.num_scales;
  for (int i = lane; i < p.num_scales; i += 32) scales[i] = ld_nc(src_scales + i);
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

// Chunk [chunk_start, + n) of the ring to domain m is written: put it to the peer with its signal, or, for this
// rank's own domain (written straight into the receive half), release the signal here.
__device__ __forceinline__ void send_chunk(const InternodeDispatchParams& p, int channel, int m, uint64_t chunk_start,
                                           int n, int lane) {
  const NetworkMap& net = p.peers.net;
  NetControl* ctrl = net_control(p.peers);
  uint64_t* signal = &ctrl->dispatch_signal[channel][net.domain][p.ring.signal_slot(chunk_start)];
  __syncwarp();  // every lane's record stores come before the put or the release
  if (m == net.domain) {
    if (lane == 0) publish(signal, p.ring.signal_value(chunk_start));  // pairs with the forwarder's acquire
    return;
  }
  // At the peer, its receive half for this rank's domain, the same slots.
  net_put_signal_warp(p.ring.slot(ctrl, channel, net.domain, 1, chunk_start),
                      p.ring.slot(ctrl, channel, m, 0, chunk_start), size_t(n) * p.ring.stride, signal,
                      p.ring.signal_value(chunk_start), net.pe(m));
}

// Network sender warp w of `warps`.
__device__ void net_sender(const InternodeDispatchParams& p, int channel, int w, int warps, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int R = p.num_ranks, G = net.num_local, D = net.num_domains, C = p.num_channels;
  const int S = p.ring.chunk, cap = p.ring.capacity;
  NetControl* ctrl = net_control(p.peers);
  const ChannelRange range = ChannelRange::of(p.num_tokens, C, channel);
  // Lane m: the ring to domain m (its start and this channel's records) and the counts so far.
  uint64_t start = 0;
  int total = 0, pos = 0;
  int count[kMaxNvlRanks] = {};  // lane m: tokens so far for rank m * G + j
  if (lane < D) {
    start = p.ring.start(read_idle(&ctrl->dispatch_head[channel][lane]));  // idle ring: head == receiver's base
    total = channel_count(p.h.rdma_channel_prefix_matrix, lane, channel, C);
  }
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
      int ordinal = 0;  // after the loop: lane j holds nothing; each lane keeps its own token's ordinals in turn
      int ordinals[kMaxNvlRanks];
#pragma unroll
      for (int j = 0; j < kMaxNvlRanks; ++j) {
        if (j >= G) break;
        const uint32_t to_j = __ballot_sync(kFullMask, (mask >> j) & 1u);
        ordinals[j] = __shfl_sync(kFullMask, count[j], m) + __popc(to_j & lanemask_lt());
        if (lane == m) count[j] += __popc(to_j);
      }
      if (lane == m) pos += __popc(routed);
      if (window % warps == w && valid) p.h.send_rdma_head[int64_t(t) * D + m] = mask != 0 ? my_pos : -my_pos - 1;
      uint32_t mine = __ballot_sync(kFullMask, mask != 0 && chunk_owner(my_pos / S, m, D, warps) == w);
      const uint64_t m_start = __shfl_sync(kFullMask, start, m);
      const int m_total = __shfl_sync(kFullMask, total, m);
      for (; mine != 0; mine &= mine - 1) {
        const int l = __ffs(mine) - 1;
        const int rp = __shfl_sync(kFullMask, my_pos, l);
        const uint32_t rmask = __shfl_sync(kFullMask, mask, l);
#pragma unroll
        for (int j = 0; j < kMaxNvlRanks; ++j) {
          if (j >= G) break;
          const int v = __shfl_sync(kFullMask, ordinals[j], l);
          if (lane == j) ordinal = v;
        }
        const int k = rp / S;
        const uint64_t chunk_end_pos = m_start + uint64_t(k) * S + S;
        if (rp == k * S && lane == 0 && chunk_end_pos > uint64_t(cap)) {  // the chunk's first record: its slots
          const uint64_t need = chunk_end_pos - cap;                        // must be free
          SpinBudget budget;
          for (uint64_t h; (h = ld_acquire_cta(&sh.head[m])) < need;)  // pairs with the coordinator's release
            budget.tick(p.fail, WaitSite{kRoleNetSender, channel, m, rp}, int64_t(h), int64_t(need));
        }
        __syncwarp();
        uint8_t* slot = p.ring.slot(ctrl, channel, m, m == net.domain ? 1 : 0, m_start + rp);
        write_record(p, cursor + l, slot, rmask, ordinal, lane);
        const int chunk_end = min((k + 1) * S, m_total);
        if (rp == chunk_end - 1) send_chunk(p, channel, m, m_start + uint64_t(k) * S, chunk_end - k * S, lane);
      }
    }
  }
  __syncwarp();
  if (lane == 0) atomicAdd_block(&sh.senders_done, 1);
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

// Sender coordinator: relays every ring's credit into shared memory until the sender warps are done.
__device__ void sender_coordinator(const InternodeDispatchParams& p, int channel, int senders, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  if (p.num_worst_tokens > 0) pad_rows(p, channel);
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < p.peers.net.num_domains;
  uint64_t seen = active ? sh.head[lane] : 0;
  coordinate(p.fail, kRoleNetSenderCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (ld_acquire_cta(&sh.senders_done) == senders) return 0;
    if (!active) return 2;
    const uint64_t h = acquire(&ctrl->dispatch_head[channel][lane]);  // the receiver's credit (net_add)
    if (h == seen) {
      peer = lane;
      a = int(h);
      return 2;
    }
    seen = h;
    st_release_cta(&sh.head[lane], h);  // pairs with the sender warps' acquire
    return 1;
  });
}

// NVLink receivers: stream st = (source domain i, local rank s != this one) is the sub-ring s forwards into for
// domain i; slices of a stream take ordinals o with o % slices == slice.
struct RecvStreams {
  int count;   // D * (G - 1)
  int slices;  // per stream
  __device__ static RecvStreams of(int D, int G, int warps) {
    const int n = D * (G - 1);
    return {n, n == 0 || n >= warps ? 1 : warps / n};
  }
  __device__ static void source(int st, int g, int G, int& i, int& s) {
    i = st / (G - 1);
    s = st % (G - 1);
    s += s >= g ? 1 : 0;
  }
};

__device__ void nvl_receiver(const InternodeDispatchParams& p, int channel, int w, int warps, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const RecvStreams streams = RecvStreams::of(D, G, warps);
  InternodeNvlControl* ctrl = internode_nvl(p.peers, p.peers.rank);
  uint8_t* buffer = p.peers.nvl.local;
  // This warp's items: (stream, slice) with index item = stream * slices + slice; items w, w + warps, ...
  const int items = streams.count * streams.slices;
  SpinBudget budget;
  while (true) {
    bool progressed = false, done = true;
    int wait_peer = -1;
    uint64_t wait_seen = 0, wait_need = 0;
    for (int item = w; item < items; item += warps) {
      const int st = item / streams.slices, slice = item % streams.slices;
      int i, s;
      RecvStreams::source(st, g, G, i, s);
      const RowRange rows = source_rows(p.h, i * G + s, channel, C);
      const int n = rows.end - rows.begin;
      int o = sh.next[item];
      if (o >= n) continue;
      done = false;
      const uint64_t base = sh.base[st];
      uint64_t tail = 0;
      if (lane == 0) tail = acquire(&ctrl->dispatch_tail[channel][s][i]);  // pairs with the forwarder's release
      tail = __shfl_sync(kFullMask, tail, 0);
      for (; o < n && base + o < tail; o += streams.slices) {
        write_output_row(p, p.nvl.slot(buffer, channel, s, i, base + o), rows.begin + o, i, lane);
        progressed = true;
      }
      __syncwarp();
      if (lane == 0) st_release_cta(&sh.next[item], o);  // pairs with the receiver coordinator's acquire
      if (o < n) wait_peer = s, wait_seen = tail, wait_need = base + o;
    }
    if (done) return;
    if (progressed) {
      budget.start = 0;
    } else {
      budget.tick(p.fail, WaitSite{kRoleNvlReceiver, channel, wait_peer, -1}, int64_t(wait_seen), int64_t(wait_need));
    }
  }
}

// Returns NVLink credit: head of stream (i, s) = its base + the least next ordinal over its slices.
__device__ void nvl_receiver_coordinator(const InternodeDispatchParams& p, int channel, SendShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  const RecvStreams streams = RecvStreams::of(D, G, SendRoles::of(G).receivers);
  int published[kMaxStreams / 32 + 1] = {};
  coordinate(p.fail, kRoleNvlReceiverCoordinator, channel, [&](int& peer, int& a, int& b) {
    int state = 0;
    for (int round = 0; round * 32 < streams.count; ++round) {
      const int st = round * 32 + lane;
      if (st >= streams.count) continue;
      int i, s;
      RecvStreams::source(st, g, G, i, s);
      const RowRange rows = source_rows(p.h, i * G + s, channel, C);
      const int n = rows.end - rows.begin;
      int low = n;
      for (int slice = 0; slice < streams.slices; ++slice) low = min(low, ld_acquire_cta(&sh.next[st * streams.slices + slice]));
      if (low > published[round]) {
        publish(&internode_nvl(p.peers, s)->dispatch_head[channel][g][i], sh.base[st] + low);  // pairs with the
        published[round] = low;                                                                  // forwarder's acquire
        state = max(state, 1);
      } else if (low < n) {
        state = 2;
        peer = s, a = low, b = n;
      }
    }
    return state;
  });
}

__device__ void send_block(const InternodeDispatchParams& p, int channel) {
  __shared__ SendShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank;
  const SendRoles roles = SendRoles::of(G);
  const RecvStreams streams = RecvStreams::of(D, G, roles.receivers > 0 ? roles.receivers : 1);
  NetControl* ctrl = net_control(p.peers);
  if (threadIdx.x < D) sh.head[threadIdx.x] = read_idle(&ctrl->dispatch_head[channel][threadIdx.x]);
  if (threadIdx.x == 0) sh.senders_done = 0;
  if (roles.receivers > 0) {
    for (int item = threadIdx.x; item < streams.count * streams.slices; item += blockDim.x)
      sh.next[item] = item % streams.slices;
    for (int st = threadIdx.x; st < streams.count; st += blockDim.x) {
      int i, s;
      RecvStreams::source(st, g, G, i, s);
      sh.base[st] = read_idle(&internode_nvl(p.peers, p.peers.rank)->dispatch_tail[channel][s][i]);  // idle
    }
  }
  __syncthreads();
  if (warp == 0) {
    sender_coordinator(p, channel, roles.senders, sh);
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
  const int S = p.ring.chunk;
  NetControl* ctrl = net_control(p.peers);
  InternodeNvlControl* nvl_ctrl = internode_nvl(p.peers, p.peers.rank);
  // Lane i: the ring from domain i.
  uint64_t start = 0;
  int total = 0, first_index = 0, max_total = 0;
  if (lane < D) {
    start = p.ring.start(read_idle(&ctrl->dispatch_base[channel][lane]));
    total = channel_count(p.h.recv_rdma_channel_prefix_matrix, lane, channel, C);
    first_index = net_record_base(p.h, lane, channel, C);
  }
  max_total = total;
  for (int o = 16; o > 0; o >>= 1) max_total = max(max_total, __shfl_xor_sync(kFullMask, max_total, o));
  for (int k = 0; k * S < max_total; ++k) {
    for (int i = 0; i < D; ++i) {
      if (chunk_owner(k, i, D, warps) != w) continue;
      const int n = __shfl_sync(kFullMask, total, i);
      if (k * S >= n) continue;
      const uint64_t chunk_start = __shfl_sync(kFullMask, start, i) + uint64_t(k) * S;
      const int index0 = __shfl_sync(kFullMask, first_index, i);
      if (lane == 0)  // pairs with the sender's put with signal (or its release, own domain)
        wait_until(&ctrl->dispatch_signal[channel][i][p.ring.signal_slot(chunk_start)],
                   [v = p.ring.signal_value(chunk_start)](uint64_t x) { return x >= v; },
                   int64_t(p.ring.signal_value(chunk_start)), p.fail, WaitSite{kRoleForwarder, channel, i, k * S});
      __syncwarp();
      const int end = min((k + 1) * S, n);
      for (int pos = k * S; pos < end; ++pos) {
        const uint8_t* rec = p.ring.slot(ctrl, channel, i, 1, chunk_start + (pos - k * S));
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
            write_output_row(p, rec, source_rows(p.h, i * G + g, channel, C).begin + o, i, lane);
            continue;
          }
          const uint64_t nvl_pos = sh.nvl_base[j][i] + o;
          if (lane == 0) {
            const uint64_t need = nvl_pos + 1 - p.nvl.capacity;
            if (nvl_pos + 1 > uint64_t(p.nvl.capacity) && acquire(&nvl_ctrl->dispatch_head[channel][j][i]) < need) {
              st_release_cta(&sh.progress[w][i], pos);  // records below pos are done: the tails can pass them
              wait_at_least(&nvl_ctrl->dispatch_head[channel][j][i], need, p.fail,  // pairs with the receiver
                            WaitSite{kRoleForwarder, channel, j, -1});             // coordinator's release
            }
          }
          __syncwarp();
          write_rows<kInternodeCopyUnroll>(
              reinterpret_cast<int4*>(p.nvl.slot(p.peers.nvl.peer[j], channel, g, i, nvl_pos)),
              reinterpret_cast<const int4*>(rec), int(p.record.bytes / 16), lane, LoadCg{});
        }
      }
      __syncwarp();
      if (lane == 0)  // pairs with the forwarder coordinator's acquire
        st_release_cta(&sh.progress[w][i], next_owned(k + 1, i, n, D, S, w, warps));
    }
  }
}

// Turns the forwarders' progress into NVLink tails (for every rank j of this domain) and network credit (for the
// peer of every domain), until every record is forwarded and credited; then records where the next operation's
// rings start.
__device__ void forwarder_coordinator(const InternodeDispatchParams& p, int channel, int warps, ForwardShared& sh) {
  const int lane = threadIdx.x % 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, g = net.local_rank, C = p.num_channels;
  NetControl* ctrl = net_control(p.peers);
  const bool active = lane < D;
  const int i = lane;
  uint64_t raw = 0, start = 0;
  int n = 0;
  if (active) {
    raw = read_idle(&ctrl->dispatch_base[channel][i]);
    start = p.ring.start(raw);
    n = channel_count(p.h.recv_rdma_channel_prefix_matrix, i, channel, C);
  }
  uint64_t credited = raw;  // the sender's head as this rank last raised it
  int forwarded = 0;        // records below this are forwarded (tails published)
  coordinate(p.fail, kRoleForwarderCoordinator, channel, [&](int& peer, int& a, int& b) {
    if (!active) return 0;
    int low = n;
    for (int w = 0; w < warps; ++w) low = min(low, ld_acquire_cta(&sh.progress[w][i]));  // pairs with the warps'
    int state = low == n && credited == start + n ? 0 : 2;                               // releases
    if (low > forwarded) {
      // Tails: the ordinals below record `low` for rank j, from the record before it (still in the ring: its
      // credit is returned below, after this).
      const uint8_t* prev = p.ring.slot(ctrl, channel, i, 1, start + low - 1);
      const int32_t* meta = reinterpret_cast<const int32_t*>(prev + p.record.meta_offset);
      const uint32_t mask = uint32_t(ld_cg(meta));
      for (int j = 0; j < G; ++j) {
        if (j == g) continue;
        const int below = ld_cg(meta + 1 + j) + int((mask >> j) & 1u);
        publish(&internode_nvl(p.peers, j)->dispatch_tail[channel][g][i], sh.nvl_base[j][i] + below);  // pairs with
      }                                                                                           // the receiver
      forwarded = low;
      state = 1;
    }
    const uint64_t target = start + uint64_t(forwarded);
    if (target > credited && (target - credited >= uint64_t(p.ring.chunk) || forwarded == n)) {
      if (i == net.domain)
        publish(&ctrl->dispatch_head[channel][i], target);  // this rank's own senders (acquire)
      else
        net_add(&ctrl->dispatch_head[channel][net.domain], target - credited, net.pe(i));
      credited = target;
      state = 1;
    }
    if (state == 2) peer = i, a = low, b = n;
    return state;
  });
  if (active) ctrl->dispatch_base[channel][i] = start + n;  // the next operation's raw start
}

__device__ void forward_block(const InternodeDispatchParams& p, int channel) {
  __shared__ ForwardShared sh;
  const int warp = threadIdx.x / 32;
  const NetworkMap& net = p.peers.net;
  const int G = net.num_local, D = net.num_domains, C = p.num_channels, S = p.ring.chunk;
  constexpr int kForwarders = kWarps - 1;
  InternodeNvlControl* nvl_ctrl = internode_nvl(p.peers, p.peers.rank);
  for (int x = threadIdx.x; x < G * D; x += blockDim.x)
    sh.nvl_base[x / D][x % D] = read_idle(&nvl_ctrl->dispatch_head[channel][x / D][x % D]);  // idle sub-rings
  for (int x = threadIdx.x; x < kForwarders * D; x += blockDim.x) {
    const int w = x / D, i = x % D;
    const int n = channel_count(p.h.recv_rdma_channel_prefix_matrix, i, channel, C);
    sh.progress[w][i] = next_owned(0, i, n, D, S, w, kForwarders);
  }
  __syncthreads();
  if (warp < kForwarders)
    forwarder(p, channel, warp, kForwarders, sh);
  else
    forwarder_coordinator(p, channel, kForwarders, sh);
}

__global__ void __launch_bounds__(kThreads, 1)
    internode_dispatch_kernel(const __grid_constant__ InternodeDispatchParams p) {
  if (ld_relaxed_sys(&nvl_self(p.peers)->op_error) != 0) return;  // collective: every rank skips
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0)
    send_block(p, channel);
  else
    forward_block(p, channel);
}

}  // namespace

void launch_internode_dispatch(const InternodeDispatchParams& p, cudaStream_t stream) {
  internode_dispatch_kernel<<<p.num_channels * 2, kThreads, 0, stream>>>(p);
}

}  // namespace epx
