// The rank-reduced order of the low-latency combine (semantics.md section 5; EPX_REDUCE_RANK), used by
// kernels/low_latency/combine.cu: the same targets and counters as the flat order; a token's partial (that part of all
// its rows here, summed with the weights and slots from the dispatch, recv_topk_slots) goes into the slot of its first
// row here (lowest slot k). At 2 ranks, while every source token fits a block's list (send_rank_phase), each block
// lists the first rows and the grid's warps take items of those rows only, each item counting as sent for every row of
// its token (no list while every source token's items fit the grid's warps one each); past that, items go over all rows
// and only a first row's items sum and send (send_partial_item, from combine.cu's send_phase). The source sums one
// partial per rank (receive_rank_phase). Own rows are never read in place. No rank masking in this order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/bf16.cuh"
#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "kernels/low_latency/combine_common.cuh"
#include "kernels/low_latency/epochs.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/limits.hpp"
#include "layout/ll_params.hpp"

namespace epx::dev::ll_combine {
namespace {  // internal linkage: a __noinline__ function here gets its kernel's register budget

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

// Rank-reduced send with the first-row list (send_rank_phase): the item [first, first + 32 * kPer) of the partial of
// source s's token t, whose first row here (its lowest slot k on this rank) is `row`. Loads the token's slots
// (recv_topk_slots), counts a sent item for the pair of every row of the token here (so that each pair's target
// stays rows x parts, as in the flat order), and sends the bf16 partial into the source's slot of the first row's
// expert in passes of 32 int4 (one per lane): each pass sums that part of the token's rows here, k ascending, kRows
// rows' loads in flight at a time, float32 multiply then add from 0, one rounding, and stores it before the next
// pass loads, so that one pass's stores cross the link while the next one's rows come from memory.
template <int kPer>
__device__ __noinline__ void send_first_row_item(const LowLatencyCombineParams& p, int64_t row, int s, int t, int first,
                                                 int lane, int* s_items) {
  constexpr int kRows = 4;  // rows' loads in flight: 4 int4 per lane, within the registers
  const int K = p.num_topk, R = p.num_ranks, M = p.max_tokens, row_int4 = p.hidden / 8;
  const int rows_per_expert = R * M;  // packed rows < L * R * M fit an int (layout/ll_layout.hpp)
  const int last = min(first + 32 * kPer, row_int4);
  const int2 entry = lane < K ? p.recv_topk_slots[(int64_t(s) * M + t) * K + lane] : make_int2(-1, 0);
  if (entry.x >= 0) atomicAdd_block(&s_items[entry.x / rows_per_expert * R + s], 1);
  const uint32_t here = __ballot_sync(kFullMask, entry.x >= 0);
  // On their way to L2 while the first pass is summed: rows past the first kRows whole, the first kRows from the
  // second pass on.
  if (entry.x >= 0) {
    const int from = __popc(here & lanemask_lt()) >= kRows ? first : first + 32;
    if (from < last) prefetch_l2(p.x + int64_t(entry.x) * row_int4 + from, uint32_t(last - from) * 16);
  }
  const int e = p.peers.rank * (p.num_experts / R) + int(row) / rows_per_expert;
  // NVSHMEM peers: staged at the row's own place in the combine-send area (with zero-copy that is x itself: this
  // item's part of the row, which only this item reads, and its loads are done).
  int4* receive = reinterpret_cast<int4*>(p.layout.receive(p.peers.ll.local, p.set)) + (int64_t(e) * M + t) * row_int4;
  int4* stage = reinterpret_cast<int4*>(p.layout.combine_send(p.peers.ll.local, p.set)) + row * row_int4;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int part = first + j * 32;
    if (part >= last) break;  // warp-uniform
    const bool mine = part + lane < last;
    float acc[8] = {};
    for (uint32_t m = here; m != 0;) {
      int4 v[kRows];
      float w[kRows];
      const int loaded = min(__popc(m), kRows);  // slots in this group (warp-uniform: m is a ballot)
#pragma unroll
      for (int q = 0; q < kRows; ++q) {  // the next `loaded` slots here, k ascending
        w[q] = 0.f;
        v[q] = make_int4(0, 0, 0, 0);  // nothing carried between groups
        if (q >= loaded) continue;
        const int k = __ffs(m) - 1;
        m &= m - 1;
        const int rk = __shfl_sync(kFullMask, entry.x, k);
        w[q] = __int_as_float(__shfl_sync(kFullMask, entry.y, k));
        if (mine) v[q] = ld_nc(p.x + int64_t(rk) * row_int4 + part + lane);
      }
#pragma unroll
      for (int q = 0; q < kRows; ++q)
        if (q < loaded && mine) add_weighted_bf16x8(acc, v[q], w[q]);  // no slot: nothing added (0 * NaN)
    }
    const int4 out[1] = {pack_bf16x8(acc)};
    // This pass's 32 int4 (fewer at the row's end): an NVSHMEM put of last - part would also send the next
    // pass's part of the staging area before that pass has written it.
    put_warp_values<1>(p.peers.ll, s, receive + part, out, min(last - part, 32), lane, stage + part);
  }
}

// The rank-reduced send at 2 ranks (or 1) while every source token fits the first-row list (R * M <= kFirstRowsMax; 3
// or more ranks keep the items over all rows, which at 4 ranks were faster than the list): each block lists the source
// tokens that reached this rank with their first row here (lowest slot k), by source and token, and the grid's warps
// take the list's items of 32 * kPer int4. Every warp then sums a partial (send_first_row_item); no warp takes an item
// of a row that sends nothing, as the items over all rows do (send_phase<..., kRank>: three in four at top-8 of 2
// ranks). Every block builds the same list, so the blocks agree on whose item is whose. Nothing here needs the rows'
// prefix (s_first). While every source token's items fit the grid's warps one each, there is no list (below).
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
        const uint64_t posted = wait_until<Poll::kRelaxed>(
            targets + slot, [tag](uint64_t v) { return uint32_t(v >> 32) == tag; }, tag, p.fail, site);
        wait_epoch<Poll::kRelaxed>(arrived + slot, int32_t(uint32_t(posted)), p.fail, site);
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
  finish_receive<false>(p.layout, p.peers.ll, p.set, k_ops, p.peers.rank, p.num_ranks,
                        shrink_mask<false>(p.mask));  // no rank masking in this order
}

}  // namespace
}  // namespace epx::dev::ll_combine
