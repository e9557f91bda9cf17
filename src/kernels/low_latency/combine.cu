// Low-latency combine (semantics.md section 5).
//
// Send phase: rows are cut into work items of kChunk int4 (BF16 rows, few of them: 32, small_items), spread over the
// whole grid's warps; a row goes back into its source rank's receive area at [global expert][source token] once every
// rank has received every earlier op on this buffer set (their epochs, kernels/low_latency/epochs.cuh; polls of local
// memory, once per rank and block). Before its rows, the sender posts every (expert, source) pair's target at the
// source: the value the source's arrival counter for that expert reaches once this op's items of the pair are written
// (a running total over the set's combines, tagged with the op's number; relaxed, it orders nothing). Each block counts
// its items per pair in shared memory and, after its last one, adds the counts to the sources' arrival counters behind
// one system-scope fence: no completion step per warp, and the adds land right behind the data. Writes into other ranks
// go through device/transport.cuh (peer pointer or NVSHMEM); for NVSHMEM peers a row that is not already in the
// symmetric region (zero-copy) is first copied to its place in this set's combine-send area. A row for this rank itself
// is copied only when the receive runs in a later launch (hook); with both phases in one launch it stays in x and its
// receive slot holds its row index instead (a copy less on the critical path; docs/bench-notes.md). Receive phase:
// block b reduces tokens b, b+G, ..., each once the arrival counters of its experts have reached their targets: out[t]
// = bf16(sum over k ascending of w[t][k] * row(e_k, t)), float32 multiply then add, one rounding; then the block adds
// its completion to every rank's epoch counter (kernels/low_latency/epochs.cuh): no last block.
// LogFMT (use_logfmt, docs/logfmt.md): the send phase encodes each work item into one block of the LogFMT row and
// writes that instead (NVSHMEM peers: staged at the item's own place in the combine-send area, which the block never
// outgrows), every row including this rank's own (no rows read in place); the receive phase decodes each slot's row
// to float32 before the same weighted sum. A separate instantiation of each phase, so the BF16 path is unchanged.
// Rank-reduced (EPX_REDUCE_RANK): the same targets and counters; a token's partial (that part of all its rows here,
// summed with the weights and slots from the dispatch, recv_topk_slots) goes into the slot of its first row here
// (lowest slot k). At 2 ranks, while every source token fits a block's list (send_rank_phase), each block lists the
// first rows and the grid's warps take items of those rows only, each item counting as sent for every row of its token;
// past that, items go over all rows and only a first row's items sum and send (send_partial_item). The source sums one
// partial per rank (receive_rank_phase). Own rows are never read in place. A separate instantiation of each phase too.
// Rank masking (enable_shrink, kernels/low_latency/shrink.cuh): no targets, rows or arrival adds go to a rank left
// out (its pairs' running totals stay as they are), and a slot whose expert is on a rank left out, or on a rank
// masked while this call waited for it, counts as -1.
#include <cuda_runtime.h>

#include "device/bf16.cuh"
#include "device/logfmt.cuh"
#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "kernels/low_latency/epochs.cuh"
#include "kernels/low_latency/launch.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/limits.hpp"
#include "layout/ll_params.hpp"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = kCopyItemInt4;  // int4 per send work item (device/transport.cuh)

// The slot of (expert rank, its local expert) in the arrival counters and targets (layout/ll_layout.hpp). Not the
// global expert: a call with another expert count on the same buffer maps global experts to other ranks, and
// the running totals (combine_sent at the sender, combine_arrived at the source) must keep pairing up.
__device__ __forceinline__ int arrival_slot(int rank, int local_expert, int num_ranks) {
  return rank * (kLowLatencyMaxExperts / num_ranks) + local_expert;
}

// Where a row this rank returns to itself leaves its index in x (its receive slot's first word) when the
// receive phase reads it in place.
__device__ __forceinline__ int32_t* local_row_of(int4* receive, int64_t slot, int row_int4) {
  return reinterpret_cast<int32_t*>(receive + slot * row_int4);
}

// Rank-reduced (kRank): the item [first, last) of row `row` (source s, token t, local expert i = row / (R*M), global
// expert e). Only the token's first row here (its lowest slot k on this rank, recv_topk_slots) sends: the item's
// part of the partial bf16(sum over the token's slots on this rank, k ascending, of w * float(row)), float32
// multiply then add from 0, one rounding, into the source's slot of expert e. The other rows' items send nothing;
// they still count as sent, so every pair's target stays the flat combine's and the source awaits the first
// expert's counter. kPer: int4 per lane (the item is kPer * 32 int4).
template <int kPer>
__device__ __noinline__ void send_partial_item(const LowLatencyCombineParams& p, int64_t row, int s, int t, int e,
                                               int first, int last, int lane, int4* receive, int4* stage) {
  const int K = p.num_topk, row_int4 = p.hidden / 8;
  const int2 entry = lane < K ? p.recv_topk_slots[(int64_t(s) * p.max_tokens + t) * K + lane] : make_int2(-1, 0);
  const uint32_t here = __ballot_sync(kFullMask, entry.x >= 0);
  if (here == 0 || __shfl_sync(kFullMask, entry.x, __ffs(here) - 1) != int(row)) return;  // not the first row
  // Every row's part on its way to L2 at once (a lane per slot): the sum below loads the rows one after another,
  // and waits on L2 for all but the first instead of on memory (docs/bench-notes.md).
  if (entry.x >= 0) prefetch_l2(p.x + int64_t(entry.x) * row_int4 + first, uint32_t(last - first) * 16);
  // kPart int4 a lane summed at a time, in passes over the token's rows: all kPer at once (4: 32 float sums and 16
  // loaded registers) spills at the 64 registers a thread of a 1024-thread block has.
  constexpr int kPart = kPer < 2 ? kPer : 2;
  int4 out[kPer];
#pragma unroll
  for (int j0 = 0; j0 < kPer; j0 += kPart) {
    float acc[kPart][8] = {};
    for (uint32_t m = here; m != 0; m &= m - 1) {
      const int k = __ffs(m) - 1;  // ascending
      const int64_t rk = __shfl_sync(kFullMask, entry.x, k);
      const float w = __int_as_float(__shfl_sync(kFullMask, entry.y, k));
      const int4* src = p.x + rk * row_int4 + first;
      int4 v[kPart];
#pragma unroll
      for (int j = 0; j < kPart; ++j)
        if (first + (j0 + j) * 32 + lane < last) v[j] = ld_nc(src + (j0 + j) * 32 + lane);
#pragma unroll
      for (int j = 0; j < kPart; ++j) {
        if (first + (j0 + j) * 32 + lane >= last) continue;
        add_weighted_bf16x8(acc[j], v[j], w);
      }
    }
#pragma unroll
    for (int j = 0; j < kPart; ++j) out[j0 + j] = pack_bf16x8(acc[j]);
  }
  // NVSHMEM peers: staged at the row's own place in the combine-send area (with zero-copy that is x itself: this
  // item's part of the row, which only this item reads, and its loads are done).
  put_warp_values<kPer>(p.peers.ll, s, receive + (int64_t(e) * p.max_tokens + t) * row_int4 + first, out, last - first,
                        lane, stage + row * row_int4 + first);
}

// The start of every send phase: the rows per (local expert, source) into shared memory (s_range: (begin, count) of
// each pair's rows among its expert's, by source ascending), s_items zeroed, and the back-pressure wait. -> the ranks
// this op leaves out (rank masking; 0 without).
template <bool kShrink>
__device__ __forceinline__ uint32_t begin_send(const LowLatencyCombineParams& p, int2* s_range, int* s_items) {
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  const uint64_t* recv_seen = p.layout.recv_seen(p.peers.ll.local, p.set);
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // earlier ops on this set, of either kind
  // Rows per (local expert, source) and their begins, from the layout ranges: one load per pair, all threads at once.
  for (int pair = threadIdx.x; pair < L * R; pair += kThreads) {
    const int64_t range = p.recv_layout_range[pair];
    s_range[pair] = int2{int(range >> 32), int(range & 0xffffffff)};
    s_items[pair] = 0;
  }
  // Back-pressure, once per block instead of once per warp and destination (4224 warps polling the same R
  // words): every rank has received every earlier op on this set, so nothing unread is overwritten. Thread r's
  // acquire (alongside the range loads) pairs with the release at the end of r's receive phase
  // (finish_receive); the barrier orders every thread's writes into r's set after it.
  // With rank masking a rank left out is not waited for, one silent past the shrink budget is masked, and s_skip
  // holds the ranks this op leaves out (as the mask says after the waits).
  __shared__ uint32_t s_skip;
  if (warp == 0) {
    if (lane < R)
      wait_blocks_of_rank(recv_seen + lane, k_ops * gridDim.x, mask, me, lane, p.fail,
                          WaitSite{kRoleLowLatencyCombineSend, -1, lane, -1});
    if (kShrink) {
      __syncwarp();  // the lanes' masking stores (atomicExch) come before lane 0's reads
      if (lane == 0) s_skip = left_out_ranks(mask, me, R);
    }
  }
  __syncthreads();
  return kShrink ? s_skip : 0u;
}

// s_first from s_range: row g of the concatenation of every local expert's packed rows belongs to expert i when
// s_first[i] <= g < s_first[i + 1] (warp 0's scan; s_first[L] is the total).
__device__ __forceinline__ void prefix_rows(const LowLatencyCombineParams& p, const int2* s_range, int* s_first) {
  const int R = p.num_ranks, L = p.num_experts / R;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < L; base += 32) {
      const int i = base + lane;
      int n = 0;
      if (i < L)
        for (int s = 0; s < R; ++s) n += s_range[i * R + s].y;
      const int incl = warp_inclusive_scan(n);
      if (i < L) s_first[i] = carry + incl - n;
      carry += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) s_first[L] = carry;
  }
  __syncthreads();
}

// Row g (< s_first[L]) of the concatenation -> its local expert i, its index n among i's rows, its source s.
__device__ __forceinline__ void row_of(const int* s_first, const int2* s_range, int L, int R, int g, int* i, int* n,
                                       int* s) {
  int lo = 0, hi = L;  // largest i with s_first[i] <= g
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s_first[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  *i = lo;
  *n = g - s_first[lo];
  int src = 0;
  while (src < R - 1 && *n >= s_range[lo * R + src].x + s_range[lo * R + src].y) ++src;  // by source, ascending
  *s = src;
}

// Every (local expert, source) pair's target at the source, one warp per pair, also for pairs without rows (the
// source may wait for them: it only knows which experts its tokens chose): this op's items of the pair, `parts` per
// row, on top of the pair's running total. Only this rank adds to the source's counter for this expert, and only
// the warp of the pair's index writes the total (the grid is the same in every call); the slot at the source is
// free to overwrite since the back-pressure wait (its receivers of the last combine on the set are done).
__device__ __forceinline__ void post_targets(const LowLatencyCombineParams& p, const int2* s_range, int parts,
                                             uint32_t skip) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  int32_t* sent = p.layout.combine_sent(p.peers.ll.local, p.set);  // running totals per (local expert, source)
  uint64_t* targets = p.layout.combine_target(p.peers.ll.local, p.set);
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);
  for (int pair = blockIdx.x * kWarps + warp; pair < L * R; pair += gridDim.x * kWarps) {
    if (lane != 0) continue;
    const int i = pair / R, s = pair % R;
    if (skip >> s & 1) continue;  // left out: its running total stays
    const int32_t target = int32_t(uint32_t(sent[pair]) + uint32_t(s_range[pair].y * parts));  // wraps
    sent[pair] = target;
    post64(p.peers.ll, s, targets + arrival_slot(me, i, R), uint64_t(k_ops + 1u) << 32 | uint32_t(target));
  }
}

// The end of every send phase: the block's items are issued; one fence (it waits for every store the block issued,
// the barrier putting them before it), then one add per pair the block wrote to, at the pair's source. Every lane of
// warp 0 runs the one fence, so that each of its adds is a write of the same thread after it (a release pattern; one
// fence however many pairs the block's items touched). Pairs with the receiver's acquire of arrived[e] (receive_phase).
// The waits of the receive phase start only after this (its threads k < K are warp 0's; the other warps block at its
// barrier): waits or row loads while the SM's stores still drain made the combine slower (docs/bench-notes.md).
__device__ __forceinline__ void end_send(const LowLatencyCombineParams& p, const int* s_items) {
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  int32_t* arrived = p.layout.combine_arrived(p.peers.ll.local, p.set);  // addresses here = offsets at every peer
  __syncthreads();
  if (threadIdx.x < 32) {
    bool any = false;
    for (int pair = threadIdx.x; pair < L * R; pair += 32) any |= s_items[pair] != 0;
    if (!__any_sync(kFullMask, any)) return;  // the block wrote nothing
    fence_acq_rel_sys();
    for (int pair = threadIdx.x; pair < L * R; pair += 32) {
      const int n = s_items[pair];
      if (n != 0) add_after_fence(p.peers.ll, pair % R, arrived + arrival_slot(me, pair / R, R), n);
    }
  }
}

// Rows this rank sends back, in items of kItem int4 spread over the whole grid's warps, kBatch adjacent ones per warp
// at a time. s_items counts the block's items per (local expert, source) pair.
// kLogfmt: each item goes as its LogFMT block (an item of kChunk int4 is 8 groups: one block).
// kRank: the rank-reduced order (send_partial_item), past the first-row list's capacity (send_rank_phase).
template <bool kLogfmt, bool kRank, bool kShrink, int kItem = kChunk, int kBatch = 2>
__device__ __noinline__ void send_phase(const LowLatencyCombineParams& p, int* s_first, int2* s_range, int* s_items) {
  static_assert(kChunk == kLogfmtGroupsPerBlock * kLogfmtGroupInt4, "a work item encodes into one LogFMT block");
  static_assert(kItem == kChunk || !kLogfmt, "a LogFMT item is one block of kChunk int4");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, me = p.peers.rank;
  const int L = p.num_experts / R;
  const int row_int4 = p.hidden / 8;
  const int64_t rows_per_expert = int64_t(R) * M;
  int4* receive = reinterpret_cast<int4*>(p.layout.receive(p.peers.ll.local, p.set));
  int4* stage = reinterpret_cast<int4*>(p.layout.combine_send(p.peers.ll.local, p.set));
  const uint32_t skip = begin_send<kShrink>(p, s_range, s_items);
  prefix_rows(p, s_range, s_first);
  const int total = s_first[L];
  const int warps = gridDim.x * kWarps;
  // Work items of kItem int4 (one round of loads per lane each): ceil(row_int4 / kItem) per row. With an
  // NVSHMEM peer each item is a put and a quiet (put_warp).
  const int parts = (row_int4 + kItem - 1) / kItem;
  post_targets(p, s_range, parts, skip);
  // With both phases in this launch, this rank's own rows are not copied: the receive phase reads them from x
  // in place, through the row index each one leaves in its receive slot (local_row_of). A send-only launch
  // (hook) copies them, since x may change before the hook runs.
  const bool local_in_place = !kLogfmt && !kRank && (p.phases & kLowLatencyRecv) != 0;
  const int64_t slot_int4 = kLogfmt ? logfmt_row_bytes(p.hidden) / 16 : row_int4;  // a receive slot (one row)
  // A warp takes kBatch adjacent items at a time (w0, w0 + 1, ...: 4 KB of one row, or the end of one row and
  // the start of the next): faster than items a grid apart, than 4 adjacent ones, and than spreading a block's
  // warps over many rows (docs/bench-notes.md). The block completes its items once, after this loop.
  for (int w0 = (blockIdx.x * kWarps + warp) * kBatch; w0 < total * parts; w0 += kBatch * warps) {
    int b_pair[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int w = w0 + j;
      b_pair[j] = -1;                    // every slot is set, also those past the end: lane 0 reads them all
      if (w >= total * parts) continue;  // (a break here left slots j + 1.. unset once kBatch > 2)
      const int g = w / parts, part = w % parts;
      int i, n, s;
      row_of(s_first, s_range, L, R, g, &i, &n, &s);
      if (skip >> s & 1) continue;  // a source left out: nothing is written there (b_pair[j] stays -1)
      const int e = me * L + i;
      const int64_t row = int64_t(i) * rows_per_expert + n;
      const int t = p.recv_src_info[row];
      const int first = part * kItem, last = min(first + kItem, row_int4);
      const int4* src = p.x + row * row_int4 + first;
      if constexpr (kLogfmt) {
        int4* block = receive + (int64_t(e) * M + t) * slot_int4 + part * (kLogfmtBlockBytes / 16);
        const int n = last - first, block_int4 = 1 + n / kLogfmtGroupInt4 * (kLogfmtGroupBytes / 16);
        if (has_peer_pointer(p.peers.ll, s)) {
          logfmt_encode_block<kChunk / 32>(at_peer(p.peers.ll, s, block), src, n, lane, LoadNc{}, StoreNa{});
        } else {  // NVSHMEM puts read symmetric memory; src itself when zero-copy (every load is done first)
          int4* staged = stage + row * row_int4 + first;
          logfmt_encode_block<kChunk / 32>(staged, src, n, lane, LoadNc{}, StoreNa{});
          __threadfence();  // visible to whatever reads the put's source (this warp, or a NIC)
          __syncwarp();
          put_warp_once<kChunk / 32>(p.peers.ll, s, block, staged, block_int4, lane, LoadNc{});
        }
      } else if constexpr (kRank) {
        send_partial_item<kItem / 32>(p, row, s, t, e, first, last, lane, receive, stage);
      } else if (s == me && local_in_place) {
        if (part == 0 && lane == 0)  // published like the data items (the block's fence and add)
          *local_row_of(receive, int64_t(e) * M + t, row_int4) = int32_t(row);
      } else {
        if (!has_peer_pointer(p.peers.ll, s) && !p.x_in_region) {  // NVSHMEM puts read symmetric memory
          warp_copy<4>(stage + row * row_int4 + first, src, last - first, lane, LoadNc{}, StoreNa{});
          __threadfence();  // visible to whatever reads the put's source (this warp, or a NIC)
          __syncwarp();
          src = stage + row * row_int4 + first;
        }
        put_warp_once<kItem / 32>(p.peers.ll, s, receive + (int64_t(e) * M + t) * row_int4 + first, src, last - first,
                                  lane, LoadNc{});
      }
      b_pair[j] = i * R + s;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (lane == 0 && b_pair[j] >= 0) atomicAdd_block(&s_items[b_pair[j]], 1);
  }
  end_send(p, s_items);
}

// Rank-reduced send with the first-row list (send_rank_phase): the item [first, first + 32 * kPer) of the partial of
// source s's token t, whose first row here (its lowest slot k on this rank) is `row`. Loads the token's slots
// (recv_topk_slots), counts a sent item for the pair of every row of the token here (so that each pair's target
// stays rows x parts, as in the flat order), sums that part of those rows, k ascending, kRows rows' loads in flight at
// a time, float32 multiply then add from 0, one rounding, and sends the bf16 partial into the source's slot of the
// first row's expert.
template <int kPer>
__device__ __noinline__ void send_first_row_item(const LowLatencyCombineParams& p, int64_t row, int s, int t, int first,
                                                 int lane, int* s_items) {
  constexpr int kRows = kPer == 1 ? 4 : 2;  // rows' loads in flight: 4 * kPer int4 per lane, within the registers
  const int K = p.num_topk, R = p.num_ranks, M = p.max_tokens, row_int4 = p.hidden / 8;
  const int rows_per_expert = R * M;  // packed rows < L * R * M fit an int (layout/ll_layout.hpp)
  const int last = min(first + 32 * kPer, row_int4);
  const int2 entry = lane < K ? p.recv_topk_slots[(int64_t(s) * M + t) * K + lane] : make_int2(-1, 0);
  if (entry.x >= 0) atomicAdd_block(&s_items[entry.x / rows_per_expert * R + s], 1);
  uint32_t m = __ballot_sync(kFullMask, entry.x >= 0);
  // Rows past the first kRows: on their way to L2 while the first ones are summed.
  if (entry.x >= 0 && __popc(m & lanemask_lt()) >= kRows)
    prefetch_l2(p.x + int64_t(entry.x) * row_int4 + first, uint32_t(last - first) * 16);
  float acc[kPer][8] = {};
  while (m != 0) {
    int4 v[kRows][kPer];
    float w[kRows];
    const int loaded = min(__popc(m), kRows);  // slots in this group (warp-uniform: m is a ballot)
#pragma unroll
    for (int q = 0; q < kRows; ++q) {  // the next `loaded` slots here, k ascending
      w[q] = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[q][j] = make_int4(0, 0, 0, 0);  // nothing carried between groups
      if (q >= loaded) continue;
      const int k = __ffs(m) - 1;
      m &= m - 1;
      const int rk = __shfl_sync(kFullMask, entry.x, k);
      w[q] = __int_as_float(__shfl_sync(kFullMask, entry.y, k));
      const int4* src = p.x + int64_t(rk) * row_int4 + first;
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (first + j * 32 + lane < last) v[q][j] = ld_nc(src + j * 32 + lane);
    }
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (q >= loaded) continue;  // no slot: nothing added (0 * a stale register could be a NaN)
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (first + j * 32 + lane >= last) continue;
        add_weighted_bf16x8(acc[j], v[q][j], w[q]);
      }
    }
  }
  int4 out[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = pack_bf16x8(acc[j]);
  const int e = p.peers.rank * (p.num_experts / R) + int(row) / rows_per_expert;
  // NVSHMEM peers: staged at the row's own place in the combine-send area (with zero-copy that is x itself: this
  // item's part of the row, which only this item reads, and its loads are done).
  int4* receive = reinterpret_cast<int4*>(p.layout.receive(p.peers.ll.local, p.set));
  int4* stage = reinterpret_cast<int4*>(p.layout.combine_send(p.peers.ll.local, p.set));
  put_warp_values<kPer>(p.peers.ll, s, receive + (int64_t(e) * M + t) * row_int4 + first, out, last - first, lane,
                        stage + row * row_int4 + first);
}

// The rank-reduced send at 2 ranks (or 1) while every source token fits the first-row list (R * M <= kFirstRowsMax; 3
// or more ranks keep the items over all rows until measured there): each block lists the source tokens that reached
// this rank with their first row here (lowest slot k), by source and token, and the grid's warps take the list's items
// of 32 * kPer int4. Every warp then sums a partial (send_first_row_item); no warp takes an item of a row that sends
// nothing, as the items over all rows do (send_phase<..., kRank>: three in four at top-8 of 2 ranks). Every block
// builds the same list, so the blocks agree on whose item is whose. Nothing here needs the rows' prefix (s_first).
// While every source token's items fit the grid's warps one each, there is no list (below).
constexpr int kFirstRowsMax = 2048;

__device__ __forceinline__ bool first_rows_fit(const LowLatencyCombineParams& p) {
  return p.num_ranks <= 2 && p.num_ranks * p.max_tokens <= kFirstRowsMax;
}

// Whether packed row r, named by a slot of source s's token t, is one of this dispatch's rows from s (within the
// pair's range, s_range) whose source token is t: a slot of a token that did not reach this rank is an earlier call's
// or never written, and names no such row.
__device__ __forceinline__ bool row_of_token(const LowLatencyCombineParams& p, const int2* s_range, int r, int s,
                                             int t) {
  const int R = p.num_ranks, rows_per_expert = R * p.max_tokens, L = p.num_experts / R;
  if (r < 0 || r >= L * rows_per_expert) return false;
  const int2 range = s_range[r / rows_per_expert * R + s];
  const int n = r % rows_per_expert;
  return n >= range.x && n < range.x + range.y && p.recv_src_info[r] == t;
}

__device__ __noinline__ void send_rank_phase(const LowLatencyCombineParams& p, int2* s_range, int* s_items) {
  __shared__ int2 s_list[kFirstRowsMax];  // (first row, s * M + t) of each source token here, by s * M + t
  __shared__ int s_warp_count[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, K = p.num_topk;
  const int row_int4 = p.hidden / 8;
  begin_send<false>(p, s_range, s_items);
  const int warps = gridDim.x * kWarps;
  // While the items of every source token, listed here or not, fit the grid's warps one each, no list: the warp of
  // each item of (s, t) finds the token's first row here from its slots (the lowest k's, checked as below), and a
  // warp whose token did not reach this rank sends nothing. This saves the list's block barriers and its loads in
  // front of every item; with more items than warps a warp would walk unlisted tokens one after another.
  {
    const int per = (R * M * ((row_int4 + 31) / 32) <= warps) ? 1 : 2;
    const int parts = (row_int4 + 32 * per - 1) / (32 * per);
    if (R * M * parts <= warps) {
      post_targets(p, s_range, parts, 0u);
      const int w = warp * gridDim.x + blockIdx.x;  // as below: item w on block w % G
      if (w < R * M * parts) {
        const int st = w / parts, s = st / M, t = st % M;
        const int2 entry = lane < K ? p.recv_topk_slots[int64_t(st) * K + lane] : make_int2(-1, 0);
        const uint32_t here = __ballot_sync(kFullMask, entry.x >= 0);
        // The lowest k's row; warp-uniform (a shuffle of a ballot's lane), so the whole warp takes the item or not.
        const int r = here != 0 ? __shfl_sync(kFullMask, entry.x, __ffs(here) - 1) : -1;
        if (row_of_token(p, s_range, r, s, t)) {
          const int first = (w % parts) * 32 * per;
          if (per == 1)
            send_first_row_item<1>(p, r, s, t, first, lane, s_items);
          else
            send_first_row_item<2>(p, r, s, t, first, lane, s_items);
        }
      }
      end_send(p, s_items);
      return;
    }
  }
  // The list, a thread per source token (s, t) = (st / M, st % M): its slots here name its rows here, the lowest k's
  // first (the dispatch wrote all K entries of every token that reached this rank, note_topk_slot). The entries of a
  // token that did not reach this rank are an earlier call's or never written: the row they name counts only if it is
  // one of this dispatch's rows from s (within the pair's range) whose source token is t, and then (s, t) did reach
  // this rank.
  int listed = 0;  // the same in every thread
  for (int base = 0; base < R * M; base += kThreads) {
    const int st = base + threadIdx.x;
    bool first = false;
    int r = -1;
    if (st < R * M) {
      const int s = st / M, t = st % M;
      const int2* slots = p.recv_topk_slots + int64_t(st) * K;
      for (int k0 = 0; k0 < K && r < 0; k0 += 8) {
        int2 e[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (k0 + j < K) e[j] = slots[k0 + j];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (r < 0 && k0 + j < K && e[j].x >= 0) r = e[j].x;
      }
      first = row_of_token(p, s_range, r, s, t);
    }
    const uint32_t ballot = __ballot_sync(kFullMask, first);
    if (lane == 0) s_warp_count[warp] = __popc(ballot);
    __syncthreads();
    int at = listed, all = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int c = s_warp_count[w];
      at += w < warp ? c : 0;
      all += c;
    }
    at += __popc(ballot & lanemask_lt());
    if (first) s_list[at] = int2{r, st};  // at < R * M <= kFirstRowsMax
    listed += all;
    __syncthreads();  // s_warp_count is rewritten next round; s_list is complete after the last
  }
  // Items of 32 int4 (one load per lane and row) while they fit the grid's warps one each, else of 64.
  const int per = (listed * ((row_int4 + 31) / 32) <= warps) ? 1 : 2;
  const int parts = (row_int4 + 32 * per - 1) / (32 * per);
  post_targets(p, s_range, parts, 0u);
  // Item w on block w % G: the items spread over every SM (each SM's loads and link stores are limited), parts of a
  // row on adjacent blocks.
  for (int w = warp * gridDim.x + blockIdx.x; w < listed * parts; w += warps) {
    const int2 item = s_list[w / parts];
    const int first = (w % parts) * 32 * per;
    if (per == 1)
      send_first_row_item<1>(p, item.x, item.y / M, item.y % M, first, lane, s_items);
    else
      send_first_row_item<2>(p, item.x, item.y / M, item.y % M, first, lane, s_items);
  }
  end_send(p, s_items);
}

// out[t] from token t's LogFMT rows, once they have arrived (s_row / s_weight: its slots' rows, null where skipped):
// each thread decodes 8 elements of kRows rows at a time (their loads in flight together) and adds them in ascending
// k, w * value rounded to float32 before the add, as receive_phase does with BF16 rows.
__device__ __forceinline__ void reduce_logfmt_token(const LowLatencyCombineParams& p, int t, const int4* const* s_row,
                                                    const float* s_weight) {
  constexpr int kRows = 4;
  const int K = p.num_topk, row_int4 = p.hidden / 8;
  for (int h = threadIdx.x; h < row_int4; h += kThreads) {
    const int group = h / kLogfmtGroupInt4, j = h % kLogfmtGroupInt4;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < K; k0 += kRows) {
      LogfmtPiece piece[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        if (k0 + i < K && s_row[k0 + i] != nullptr)
          piece[i] = logfmt_load_piece(reinterpret_cast<const uint8_t*>(s_row[k0 + i]), group, j);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (k0 + i >= K || s_row[k0 + i] == nullptr) continue;
        const float w = s_weight[k0 + i];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, logfmt_element(piece[i], e)));
      }
    }
    st_na(p.out + int64_t(t) * row_int4 + h, pack_bf16x8(acc));
  }
}

// Rank-reduced (p.rank_reduced): block b sums tokens b, b+G, ..., each from one partial row per rank that holds
// any of its experts, in ascending rank order: out[t] = bf16(sum over r ascending of float(partial_r)), float32
// from 0, one rounding. Rank r's partial sits in the slot of the token's first expert on r (lowest k), written by
// r's send phase (send_partial_item) and published by that expert's arrival counter, awaited as in the flat order.
__device__ __noinline__ void receive_rank_phase(const LowLatencyCombineParams& p) {
  __shared__ const int4* s_partial[kMaxNvlRanks];  // rank r's partial row of token t, null where r has none
  const int M = p.max_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
  const int L = E / R;
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // the send phase's too (same block, same op)
  const int32_t* arrived = p.layout.combine_arrived(p.peers.ll.local, p.set);
  const uint64_t* targets = p.layout.combine_target(p.peers.ll.local, p.set);
  const int row_int4 = p.hidden / 8;
  const int4* recv = reinterpret_cast<const int4*>(p.layout.receive(p.peers.ll.local, p.set));
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    if (threadIdx.x < 32) {  // warp 0: a lane per slot (K <= 32) and per rank (R <= 32)
      const int lane = threadIdx.x;
      if (lane < R) s_partial[lane] = nullptr;
      __syncwarp();
      const int64_t e = lane < K ? p.topk_idx[int64_t(t) * K + lane] : -1;
      const bool valid = e >= 0 && e < E;
      const int r = valid ? int(e) / L : -1;
      const uint32_t same_rank = __match_any_sync(kFullMask, r) & __ballot_sync(kFullMask, valid);
      if (valid && (same_rank & lanemask_lt()) == 0) {  // the token's first slot on rank r
        // Acquire, as in receive_phase: pairs with the adds of r's blocks after their last items (each behind a
        // fence); the __syncthreads below orders every thread's row loads after it.
        const uint32_t tag = k_ops + 1u;
        const WaitSite site{kRoleLowLatencyCombineRecv, -1, r, int(e)};
        const int slot = arrival_slot(r, int(e) % L, R);
        const uint64_t posted = wait_until(
            targets + slot, [tag](uint64_t v) { return uint32_t(v >> 32) == tag; }, tag, p.fail, site);
        wait_epoch(arrived + slot, int32_t(uint32_t(posted)), p.fail, site);
        s_partial[r] = recv + (e * M + t) * row_int4;
      }
    }
    __syncthreads();
    for (int h = threadIdx.x; h < row_int4; h += kThreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      // kRanksAtOnce partials' loads in flight, then added r ascending (one group up to 4 ranks; 8 int4 would spill).
      constexpr int kRanksAtOnce = 4;
      for (int r0 = 0; r0 < R; r0 += kRanksAtOnce) {
        int4 v[kRanksAtOnce];
#pragma unroll
        for (int q = 0; q < kRanksAtOnce; ++q)
          if (r0 + q < R && s_partial[r0 + q] != nullptr) v[q] = ld_cg(s_partial[r0 + q] + h);
#pragma unroll
        for (int q = 0; q < kRanksAtOnce; ++q) {
          if (r0 + q >= R || s_partial[r0 + q] == nullptr) continue;
          add_bf16x8(acc, v[q]);
        }
      }
      st_na(p.out + int64_t(t) * row_int4 + h, pack_bf16x8(acc));
    }
    __syncthreads();  // s_partial is rewritten for the next token
  }
  finish_receive(p.layout, p.peers.ll, p.set, k_ops, p.peers.rank, p.num_ranks,
                 shrink_mask<false>(p.mask));  // no rank masking in this order
}

// Block b reduces tokens b, b+G, ... as soon as the arrival counters of that token's experts reach their
// targets (no grid-wide wait), then adds its completion to every rank's epoch counter, which (once all blocks
// have) lets the next op on this set, of either kind, write here.
// kInPlace: this launch's send phase left this rank's own rows in x (both phases in one launch). A separate
// instantiation, so that the receive of a hook reads every row from the receive area without a pointer per slot
// (fewer spills; one version for both measured within the noise, docs/bench-notes.md).
// kLogfmt: every slot holds a LogFMT row (layout/logfmt.hpp), decoded to float32 before the weighted sum.
template <bool kInPlace, bool kLogfmt, bool kShrink>
__device__ __noinline__ void receive_phase(const LowLatencyCombineParams& p) {
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  static_assert(!(kInPlace && kLogfmt), "LogFMT rows are all in the receive area");
  __shared__ int s_expert[kMaxTopk];  // token t's experts, -1 where skipped
  __shared__ float s_weight[kMaxTopk];
  __shared__ const int4* s_row[kMaxTopk];  // token t's row of slot k: in the receive area, or in x (own rows);
                                           // LogFMT: null where skipped
  const int M = p.max_tokens, K = p.num_topk, E = p.num_experts;
  const int L = E / p.num_ranks;
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // the send phase's too (same block, same op)
  const int32_t* arrived = p.layout.combine_arrived(p.peers.ll.local, p.set);
  const uint64_t* targets = p.layout.combine_target(p.peers.ll.local, p.set);
  const int row_int4 = p.hidden / 8;
  int4* recv = reinterpret_cast<int4*>(p.layout.receive(p.peers.ll.local, p.set));
  const int me = p.peers.rank;
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    if (threadIdx.x < K) {
      const int k = threadIdx.x;
      const int64_t e = p.topk_idx[int64_t(t) * K + k];
      bool valid = e >= 0 && e < E;
      const float w = valid ? p.topk_weights[int64_t(t) * K + k] : 0.f;
      if constexpr (kLogfmt) s_row[k] = nullptr;  // set below once the row is there
      // e's target for this op (tagged with its number; posted by e's rank before its rows), then the arrival
      // counter up to it. Acquire; pairs with the adds of e's rank's blocks after their last items (each
      // behind a fence). The __syncthreads below orders every thread's row loads after it. With rank masking a
      // slot on a rank left out (or masked by these waits) counts as -1.
      if (valid) {
        const uint32_t tag = k_ops + 1u;
        const WaitSite site{kRoleLowLatencyCombineRecv, -1, int(e) / L, int(e)};
        const int slot = arrival_slot(int(e) / L, int(e) % L, p.num_ranks);
        uint64_t posted = 0;
        valid = wait_for_rank(
            targets + slot, [tag](uint64_t v) { return uint32_t(v >> 32) == tag; }, tag, mask, me, int(e) / L, p.fail,
            site, &posted);
        const int32_t total = int32_t(uint32_t(posted));
        int32_t seen = 0;
        if (valid)
          valid = wait_for_rank(
              arrived + slot, [total](int32_t v) { return int32_t(uint32_t(v) - uint32_t(total)) >= 0; }, total, mask,
              me, int(e) / L, p.fail, site, &seen);
      }
      s_expert[k] = valid ? int(e) : -1;
      s_weight[k] = valid ? w : 0.f;
      if (valid) {
        if constexpr (kInPlace) {
          const int64_t slot = e * M + t;
          s_row[k] = recv + slot * row_int4;
          if (int(e) / L == me)  // written by this launch's send phase before its block's arrival add
            s_row[k] = p.x + int64_t(ld_cg(local_row_of(recv, slot, row_int4))) * row_int4;
        }
        if constexpr (kLogfmt) s_row[k] = recv + (e * M + t) * (logfmt_row_bytes(p.hidden) / 16);
      }
    }
    __syncthreads();
    if constexpr (kLogfmt) {
      reduce_logfmt_token(p, t, s_row, s_weight);
    } else {
      for (int h = threadIdx.x; h < row_int4; h += kThreads) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k0 = 0; k0 < K; k0 += 8) {  // 8 rows' loads in flight, then k ascending as the reference adds
          int4 v[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (k0 + j < K && s_expert[k0 + j] >= 0)
              v[j] = kInPlace ? ld_cg(s_row[k0 + j] + h)
                              : ld_cg(recv + (int64_t(s_expert[k0 + j]) * M + t) * row_int4 + h);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (k0 + j >= K || s_expert[k0 + j] < 0) continue;
            add_weighted_bf16x8(acc, v[j], s_weight[k0 + j]);
          }
        }
        st_na(p.out + int64_t(t) * row_int4 + h, pack_bf16x8(acc));
      }
    }
    __syncthreads();  // s_expert / s_weight are rewritten for the next token
  }
  // The counters stay as they are (running totals; an add no token here waited for may still be on its way,
  // and lands before any of its sender's later writes to this set, which wait for this block's epoch).
  finish_receive(p.layout, p.peers.ll, p.set, k_ops, p.peers.rank, p.num_ranks, mask);
}

// BF16 send (flat without rank masking, or rank-reduced past the first-row list): items of 32 int4, one per warp,
// when the rows here (about num_tokens * num_topk when the ranks hold about as many tokens each) fit the grid's warps
// that way; otherwise kChunk-int4 items, two per warp. Few rows in small items put more warps on them (in the
// rank-reduced order each sending item loads all of a token's rows here); with many rows the larger items cost less
// per byte (docs/bench-notes.md). Every block decides alike (same parameters, same grid).
__device__ __forceinline__ int64_t send_items(const LowLatencyCombineParams& p, int item_int4) {
  return int64_t(p.num_tokens) * p.num_topk * ((p.hidden / 8 + item_int4 - 1) / item_int4);
}
__device__ __forceinline__ bool small_items(const LowLatencyCombineParams& p, int warps) {
  return send_items(p, 32) <= warps;
}
// Rank-reduced, between the two: kChunk-int4 items one per warp while they fit the grid's warps. A sending item
// sums a chain of rows, so two of them on one warp take twice as long, and with items to spare no warp needs two.
__device__ __forceinline__ bool one_chunk_per_warp(const LowLatencyCombineParams& p, int warps) {
  return send_items(p, kChunk) <= warps;
}

__global__ void __launch_bounds__(kThreads, 1)
    low_latency_combine_kernel(const __grid_constant__ LowLatencyCombineParams p) {
  __shared__ int s_first[kLowLatencyMaxExperts + 1];
  __shared__ int2 s_range[kLowLatencyMaxExperts];  // [L * R] (begin, count) of every (local expert, source)
  __shared__ int s_items[kLowLatencyMaxExperts];   // [L * R] this block's work items per pair
  wait_prior_grids();                              // before any memory access (kernels/low_latency/launch.cuh)
  allow_next_grid();
  // The order is chosen before the row format: the runtime's format word carries the reduction in bit 1 (2 for
  // rank-reduced), and the runtime refuses LogFMT with the rank-reduced order; only bit 0 means LogFMT rows.
  // A buffer with rank masking runs the phases instantiated for it (kShrink), one without runs none of its code;
  // the rank-reduced order is refused with rank masking.
  const bool shrink = p.mask.words != nullptr;
  if (p.phases & kLowLatencySend) {
    const bool small = small_items(p, gridDim.x * kWarps);
    if (p.rank_reduced && first_rows_fit(p))
      send_rank_phase(p, s_range, s_items);
    else if (p.rank_reduced && small)
      send_phase<false, true, false, 32, 1>(p, s_first, s_range, s_items);
    else if (p.rank_reduced && one_chunk_per_warp(p, gridDim.x * kWarps))
      send_phase<false, true, false, kChunk, 1>(p, s_first, s_range, s_items);
    else if (p.rank_reduced)
      send_phase<false, true, false>(p, s_first, s_range, s_items);
    else if ((p.logfmt & 1) && shrink)
      send_phase<true, false, true>(p, s_first, s_range, s_items);
    else if (p.logfmt & 1)
      send_phase<true, false, false>(p, s_first, s_range, s_items);
    else if (shrink)
      send_phase<false, false, true>(p, s_first, s_range, s_items);
    else if (small)
      send_phase<false, false, false, 32, 1>(p, s_first, s_range, s_items);
    else
      send_phase<false, false, false>(p, s_first, s_range, s_items);
  }
  if (p.phases & kLowLatencyRecv) {
    const bool in_place = (p.phases & kLowLatencySend) != 0;
    if (p.rank_reduced)
      receive_rank_phase(p);
    else if ((p.logfmt & 1) && shrink)
      receive_phase<false, true, true>(p);
    else if (p.logfmt & 1)
      receive_phase<false, true, false>(p);
    else if (in_place && shrink)
      receive_phase<true, false, true>(p);
    else if (in_place)
      receive_phase<true, false, false>(p);
    else if (shrink)
      receive_phase<false, false, true>(p);
    else
      receive_phase<false, false, false>(p);
  }
}

}  // namespace

namespace EPX_LL_BUILD {

void launch_low_latency_combine(const LowLatencyCombineParams& p, const LowLatencyLaunch& launch, cudaStream_t stream) {
  launch_low_latency_kernel(low_latency_combine_kernel, p, launch, kThreads, 0, stream);
}

}  // namespace EPX_LL_BUILD
}  // namespace epx
