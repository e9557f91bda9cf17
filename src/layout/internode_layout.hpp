// Layouts of the internode (hierarchical) mode, shared by the host (sizes, validation) and the kernels (addresses).
// R = D x G ranks, rank r = d * G + g; between domains only ranks of the same local index g talk ("the network"),
// inside a domain through the NVLink buffer. docs/internode.md describes the protocol.
//
// Network region (NVSHMEM symmetric memory, the same offsets on every rank):
//   [ NetControl | pad to kAlign | ring data: [channel][domain][send, recv][slot] records ]
// For the ring between this rank and its peer in domain m, channel c: the send half holds records staged here
// for m (the sources of the puts), the recv half the records m put here. Own-domain records skip the send half.
//
// NVLink buffer of a hierarchical Buffer: [ NvlControl | InternodeNvlControl | pad | sub-ring data ]; the sub-ring
// data is [channel][local rank s][domain i][slot] records in the buffer of the rank that reads them.
#pragma once

#include <cstdint>

#include "layout/limits.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

// Notify phase 1: what rank (d, g) tells its peer (m, g), ints. Fields at fixed offsets; the put carries the
// prefix up to expert(G * L).
struct NetMsg {
  static constexpr int kErrorCode = 0;  // first input error the sender knows of (DeviceError), 0 if none
  static constexpr int kErrorRank = 1;  // global rank that saw it
  static constexpr int kNumTokens = 2;  // sender's tokens (diagnostics)
  static constexpr int kSignature = 3;  // hash of the operation's shape: every rank must send the same
  static constexpr int kHeader = 4;
  // Tokens the sender sends to rank m * G + j.
  EPX_HD static constexpr int tokens_to(int j) { return kHeader + j; }
  // Tokens of the sender's channel c that need domain m (the records of its network ring to m).
  EPX_HD static constexpr int domain_channel(int c) { return kHeader + kMaxNvlRanks + c; }
  // Tokens of the sender's channel c that go to rank m * G + j.
  EPX_HD static constexpr int rank_channel(int j, int c) {
    return kHeader + kMaxNvlRanks + kMaxChannels + j * kMaxChannels + c;
  }
  // Tokens of the sender that select expert e of domain m (e < G * L, domain-local numbering).
  EPX_HD static constexpr int expert(int e) {
    return kHeader + kMaxNvlRanks + kMaxChannels + kMaxNvlRanks * kMaxChannels + e;
  }
  static constexpr int kInts = kHeader + kMaxNvlRanks + kMaxChannels + kMaxNvlRanks * kMaxChannels +
                               kMaxNvlRanks * kMaxLocalExperts;  // expert(G * L) at most
};

// Notify phase 2: what rank (d, s) tells rank (d, j) of its domain about the sources (i, s), ints.
struct NvlNetMsg {
  static constexpr int kErrorCode = 0;  // the collective error of the sender's phase 1 (0 if none)
  static constexpr int kErrorRank = 1;
  static constexpr int kSignature = 2;  // the operation's shape as the sender's group agreed on it
  static constexpr int kHeader = 3;
  // Tokens source (i, s) sends to (d, j).
  EPX_HD static constexpr int source_tokens(int i) { return kHeader + i; }
  // Of those, the tokens of source channel c.
  EPX_HD static constexpr int source_channel(int i, int c) { return kHeader + kMaxDomains + i * kMaxChannels + c; }
  // Tokens of every source (i, s), i = 0..D-1, that select local expert e of (d, j).
  EPX_HD static constexpr int expert(int e) { return kHeader + kMaxDomains + kMaxDomains * kMaxChannels + e; }
  static constexpr int kInts = kHeader + kMaxDomains + kMaxDomains * kMaxChannels + kMaxLocalExperts;  // expert(L)
};

// Start of the network region. Zeroed at creation; ring positions only grow (never reset).
struct NetControl {
  int32_t abort;  // 1 + the global rank that failed a wait; raised by any rank of any domain through NVSHMEM
  int32_t pad0[3];
  // Phase-1 flags: notify_flag[m] = the epoch of the last message from domain m (put with signal, set).
  uint64_t notify_flag[kMaxDomains];
  // Ring positions, per (channel, peer domain m); they only grow. Receiver side: tail = how far the sender in m
  // has delivered (set by m's coordinator with a signal, after the records' puts are complete), base = where the
  // next operation starts (this operation's end, written by this rank). Sender side: head = how far the receiver
  // in m has consumed (credit, added to by m). When an operation starts every ring is idle: head == base == tail.
  uint64_t dispatch_tail[kMaxChannels][kMaxDomains];
  uint64_t dispatch_base[kMaxChannels][kMaxDomains];
  uint64_t dispatch_head[kMaxChannels][kMaxDomains];
  uint64_t combine_tail[kMaxChannels][kMaxDomains];
  uint64_t combine_base[kMaxChannels][kMaxDomains];
  uint64_t combine_head[kMaxChannels][kMaxDomains];
  // Phase-1 messages, by epoch parity: received from each domain, and staged here as the sources of the puts.
  int32_t notify_in[2][kMaxDomains][NetMsg::kInts];
  int32_t notify_out[2][kMaxDomains][NetMsg::kInts];
};

// The internode part of the NVLink buffer (after NvlControl). Zeroed at creation; positions only grow.
struct InternodeNvlControl {
  // Phase-2 flags and messages: notify_flag[s] = epoch of the last message from local rank s.
  uint32_t notify_flag[kMaxNvlRanks];
  int32_t notify_msg[2][kMaxNvlRanks][NvlNetMsg::kInts];
  // Sub-ring positions, per (channel, local rank, domain); they only grow. Each side starts an operation from an
  // index only it writes: the writer from its head (credit comes only after it writes), the reader from its base
  // (its own record of where the last operation ended; the tail may already be moving when it starts).
  // Dispatch: records forwarded by local rank s for sources of domain i. At the reader j ([c][s][i]): tail
  // (advanced by s) and base; at the forwarder s ([c][j][i]): head (advanced by j).
  uint64_t dispatch_tail[kMaxChannels][kMaxNvlRanks][kMaxDomains];
  uint64_t dispatch_base[kMaxChannels][kMaxNvlRanks][kMaxDomains];
  uint64_t dispatch_head[kMaxChannels][kMaxNvlRanks][kMaxDomains];
  // Combine: rows local rank j returns to forwarder s for domain i. At the reader s ([c][j][i]): tail (advanced by j)
  // and base; at j ([c][s][i]): head (advanced by s).
  uint64_t combine_tail[kMaxChannels][kMaxNvlRanks][kMaxDomains];
  uint64_t combine_base[kMaxChannels][kMaxNvlRanks][kMaxDomains];
  uint64_t combine_head[kMaxChannels][kMaxNvlRanks][kMaxDomains];
};

// Offsets inside the NVLink buffer of a hierarchical Buffer.
struct InternodeNvlLayout {
  EPX_HD static constexpr int64_t control_offset() { return align_up(int64_t(sizeof(NvlControl)), kAlign); }
  EPX_HD static constexpr int64_t data_offset() {
    return control_offset() + align_up(int64_t(sizeof(InternodeNvlControl)), kAlign);
  }
};

// Dispatch record (network and NVLink rings): one token for one domain.
//   [x: x_bytes][scales: num_scales * 4][meta: mask, ordinal[kMaxNvlRanks]][topk idx int32 * K][weights f32 * K]
// mask bit j: the token goes to rank d * G + j of the destination domain; ordinal[j]: the token's position among
// the source's tokens of this channel that go to that rank (the slot of its NVLink sub-ring, and its recv_x row
// past the channel's start there). Top-k ids are global; the final receiver rebases them.
struct InternodeRecord {
  int64_t x_bytes;
  int64_t scale_offset;
  int64_t meta_offset;
  int64_t topk_offset;
  int64_t weight_offset;
  int64_t bytes;
  static constexpr int kMetaInts = 1 + kMaxNvlRanks;
  EPX_HD static InternodeRecord make(int64_t x_bytes, int num_scales, int num_topk) {
    InternodeRecord r{};
    r.x_bytes = x_bytes;
    r.scale_offset = align_up(x_bytes, 16);
    r.meta_offset = r.scale_offset + align_up(int64_t(num_scales) * 4, 16);
    r.topk_offset = r.meta_offset + align_up(int64_t(kMetaInts) * 4, 16);
    r.weight_offset = r.topk_offset + int64_t(num_topk) * 4;
    r.bytes = align_up(r.weight_offset + int64_t(num_topk) * 4, 16);
    return r;
  }
};

// Combine record on the network ring: `rows` bf16 rows, then the top-k weights of every rank of the domain.
//   [rows * hidden * 2][weights f32: G x K]
// Two-level order: one row (the domain's partial); flat order: one row per rank of the domain that received the
// token, in ascending rank order (up to G).
struct CombineNetRecord {
  int64_t row_bytes;
  int64_t weight_offset;
  int64_t bytes;
  EPX_HD static CombineNetRecord make(int hidden, int rows, int num_nvl_ranks, int num_topk) {
    CombineNetRecord r{};
    r.row_bytes = int64_t(hidden) * 2;
    r.weight_offset = align_up(r.row_bytes * rows, 16);
    r.bytes = r.weight_offset + align_up(int64_t(num_nvl_ranks) * num_topk * 4, 16);
    return r;
  }
};

// A network ring's geometry for one operation: `capacity` slots of `stride` bytes per (channel, domain, half).
// Credit (the head) goes back in steps of at least `step` records (an operation's last may be shorter); tails move
// whenever the senders' progress grows. The ring holds at least two steps.
struct NetRing {
  int num_domains;
  int capacity;
  int step;
  int64_t stride;

  EPX_HD static constexpr int64_t data_offset() { return align_up(int64_t(sizeof(NetControl)), kAlign); }
  EPX_HD int64_t bytes(int num_channels) const { return int64_t(num_channels) * num_domains * 2 * capacity * stride; }
  // Slot of absolute position `position` in the send (0) or receive (1) half of ring (channel, domain).
  EPX_HD uint8_t* slot(void* region, int channel, int domain, int half, uint64_t position) const {
    const int64_t ring = (int64_t(channel) * num_domains + domain) * 2 + half;
    return static_cast<uint8_t*>(region) + data_offset() +
           (ring * capacity + int64_t(position % uint64_t(capacity))) * stride;
  }
};

// NVLink sub-rings of one operation: [channel][local rank s][domain i][slot] in the reader's buffer.
struct NvlSubRing {
  int num_nvl_ranks;
  int num_domains;
  int capacity;  // slots per sub-ring
  int64_t stride;

  EPX_HD int64_t bytes(int num_channels) const {
    return int64_t(num_channels) * num_nvl_ranks * num_domains * capacity * stride;
  }
  EPX_HD uint8_t* slot(void* buffer_base, int channel, int local_rank, int domain, uint64_t position) const {
    const int64_t ring = (int64_t(channel) * num_nvl_ranks + local_rank) * num_domains + domain;
    return static_cast<uint8_t*>(buffer_base) + InternodeNvlLayout::data_offset() +
           (ring * capacity + int64_t(position % uint64_t(capacity))) * stride;
  }
};

}  // namespace epx
