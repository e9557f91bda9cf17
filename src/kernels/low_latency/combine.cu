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
// = bf16(sum over k ascending of w[t][k] * row(e_k, t)), float32 multiply then add, one rounding; then the block's
// completion goes to every rank's epoch counter (kernels/low_latency/epochs.cuh says when): no last block.
// LogFMT (use_logfmt, docs/logfmt.md): the send phase encodes each work item into one block of the LogFMT row and
// writes that instead (NVSHMEM peers: staged at the item's own place in the combine-send area, which the block never
// outgrows), every row including this rank's own (no rows read in place); the receive phase decodes each slot's row
// to float32 before the same weighted sum. A separate instantiation of each phase, so the BF16 path is unchanged.
// Rank-reduced (EPX_REDUCE_RANK): the same targets and counters, one partial row per (token, rank)
// (kernels/low_latency/rank_reduced.cuh). A separate instantiation of each phase too.
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
#include "kernels/low_latency/combine_common.cuh"
#include "kernels/low_latency/epochs.cuh"
#include "kernels/low_latency/launch.cuh"
#include "kernels/low_latency/rank_reduced.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/limits.hpp"
#include "layout/ll_params.hpp"

namespace epx {
namespace {

using namespace dev;
using namespace dev::ll_combine;

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

// Block b reduces tokens b, b+G, ... as soon as the arrival counters of that token's experts reach their
// targets (no grid-wide wait), then counts its completion for every rank's epoch counter (finish_receive), which
// (once all blocks' have arrived) lets the next op on this set, of either kind, write here.
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
  finish_receive<kShrink>(p.layout, p.peers.ll, p.set, k_ops, p.peers.rank, p.num_ranks, mask);
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
  wait_prior_grids();                              // before any memory access (runtime/low_latency_launch.cpp)
  allow_next_grid();
  // The order is chosen before the row format: the runtime's format word carries the reduction in bit 1 (2 for
  // rank-reduced), and the runtime refuses LogFMT with the rank-reduced order; only bit 0 means LogFMT rows.
  // A buffer with rank masking runs the phases instantiated for it (kShrink), one without runs none of its code;
  // the rank-reduced order is refused with rank masking.
  const bool shrink = p.mask.words != nullptr;
  if (!shrink) announce_receives(p.layout, p.peers.ll, p.peers.rank, p.num_ranks);
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

LowLatencyKernel combine_kernel() {
  return LowLatencyKernel{reinterpret_cast<const void*>(low_latency_combine_kernel), kThreads, 0};
}

}  // namespace EPX_LL_BUILD
}  // namespace epx
