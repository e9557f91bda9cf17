// Low-latency combine (semantics.md section 5).
//
// Send phase: rows are cut into work items of kChunk int4, one per warp at a time over the whole grid; a row
// goes back into its source rank's receive area at [global expert][source token] once every rank has received
// every earlier op on this buffer set (their epochs, kernels/low_latency/epochs.cuh; polls of local memory, once per
// rank and block). Before its rows, the sender posts every (expert, source) pair's target at the source: the value the
// source's arrival counter for that expert reaches once this op's items of the pair are written (a running total over
// the set's combines, tagged with the op's number; relaxed, it orders nothing). Each block counts its items per pair in
// shared memory and, after its last one, adds the counts to the sources' arrival counters behind one system-scope
// fence: no completion step per warp, and the adds land right behind the data. Writes into other ranks go through
// device/transport.cuh (peer pointer or NVSHMEM); for NVSHMEM peers a row that is not already in the symmetric region
// (zero-copy) is first copied to its place in this set's combine-send area. A row for this rank itself is copied only
// when the receive runs in a later launch (hook); with both phases in one launch it stays in x and its receive slot
// holds its row index instead (a copy less on the critical path; docs/bench-notes.md). Receive phase: block b reduces
// tokens b, b+G, ..., each once the arrival counters of its experts have reached their targets: out[t] = bf16(sum over
// k ascending of w[t][k] * row(e_k, t)), float32 multiply then add, one rounding; then the block adds its completion to
// every rank's epoch counter (kernels/low_latency/epochs.cuh): no last block.
// LogFMT (use_logfmt, docs/logfmt.md): the send phase encodes each work item into one block of the LogFMT row and
// writes that instead (NVSHMEM peers: staged at the item's own place in the combine-send area, which the block never
// outgrows), every row including this rank's own (no rows read in place); the receive phase decodes each slot's row
// to float32 before the same weighted sum. A separate instantiation of each phase, so the BF16 path is unchanged.
// Rank-reduced (EPX_REDUCE_RANK): the same targets and counters; the work items are the (source, token) pairs with a
// row here (listed from the layout, the same list in every block) times the row's parts, spread block-minor over the
// grid. An item sums that part of all the token's rows here (weights and slots from the dispatch, recv_topk_slots),
// their loads in flight together, and sends the bf16 partial into the slot of the token's first expert here; it
// counts once toward the pair of each of those rows, so every pair's count stays the flat one. The source sums one
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

// The local expert of packed row g of the concatenation of every local expert's rows: the largest i with
// s_first[i] <= g (s_first: the exclusive prefix of the experts' row counts, s_first[L] the total). It and
// source_of serve the rank-reduced send; send_phase's item loop spells out the same searches, so that the flat and
// LogFMT instantiations compile as they did (through these helpers their PTX differs).
__device__ __forceinline__ int local_expert_of(const int* s_first, int L, int g) {
  int lo = 0, hi = L;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s_first[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The source rank of row n of local expert i: rows are by source, ascending (s_range: (begin, count) per pair).
__device__ __forceinline__ int source_of(const int2* s_range, int i, int R, int n) {
  int s = 0;
  while (s < R - 1 && n >= s_range[i * R + s].x + s_range[i * R + s].y) ++s;
  return s;
}

// acc[e] += w * float(element e of the 8 bf16 in v), the product rounded to float32 before the add (no fused
// multiply-add: the reference multiplies, then adds).
__device__ __forceinline__ void add_weighted_bf16x8(float (&acc)[8], float w, const int4& v) {
  const uint32_t words[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    acc[2 * c] = __fadd_rn(acc[2 * c], __fmul_rn(w, __uint_as_float(words[c] << 16)));
    acc[2 * c + 1] = __fadd_rn(acc[2 * c + 1], __fmul_rn(w, __uint_as_float(words[c] & 0xffff0000u)));
  }
}

// int4 per lane of a rank-reduced item (kChunk int4): slice j is int4 first + 32 j + lane of its rows.
constexpr int kSlices = kChunk / 32;
// Row loads per lane in flight in the rank-reduced send (the registers a 1024-thread block allows).
constexpr int kPartialLoads = 8;

// Where lane `lane` reads slice j of a row of the item [first, last): past the row's end (its last item) the last
// int4 instead, so that no load is predicated (those lanes store nothing).
__device__ __forceinline__ int slice_offset(int first, int last, int j, int lane) {
  return min(first + j * 32 + lane, last - 1);
}

// The kRows rows of a rank-reduced item summed into its partial (lane m of `row` / `weight`: the m-th row here,
// ascending k, and its weight bits), every slice stored to out[32 j] (+ lane) once its rows are added. A round
// issues the loads of as many whole slices as kPartialLoads allows, then adds them in ascending k.
template <int kRows>
__device__ __forceinline__ void sum_partial_rows(const int4* x, int row_int4, int row, int weight, int first, int last,
                                                 int lane, int4* out) {
  constexpr int kPerRound =
      kRows >= kPartialLoads ? 1 : (kPartialLoads / kRows < kSlices ? kPartialLoads / kRows : kSlices);
  static_assert(kSlices % kPerRound == 0, "rounds of whole slices");
#pragma unroll
  for (int j0 = 0; j0 < kSlices; j0 += kPerRound) {
    int4 v[kPerRound][kRows];
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      const int4* src = x + int64_t(__shfl_sync(kFullMask, row, m)) * row_int4;
#pragma unroll
      for (int jj = 0; jj < kPerRound; ++jj) v[jj][m] = ld_nc(src + slice_offset(first, last, j0 + jj, lane));
    }
#pragma unroll
    for (int jj = 0; jj < kPerRound; ++jj) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kRows; ++m)
        add_weighted_bf16x8(acc, __int_as_float(__shfl_sync(kFullMask, weight, m)), v[jj][m]);
      if (first + (j0 + jj) * 32 + lane < last) st_na(out + (j0 + jj) * 32, pack_bf16x8(acc));
    }
  }
}

// sum_partial_rows for more than kPartialLoads rows (top-k above 8): a slice at a time, its rows in rounds of
// kPartialLoads (the sum carried across rounds).
__device__ __forceinline__ void sum_many_partial_rows(const int4* x, int row_int4, int rows, int row, int weight,
                                                      int first, int last, int lane, int4* out) {
  for (int j = 0; j < kSlices; ++j) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int m0 = 0; m0 < rows; m0 += kPartialLoads) {
      int4 v[kPartialLoads];
#pragma unroll
      for (int q = 0; q < kPartialLoads; ++q) {  // past the last row: row m0 again, not added
        const int m = m0 + q < rows ? m0 + q : m0;
        v[q] = ld_nc(x + int64_t(__shfl_sync(kFullMask, row, m)) * row_int4 + slice_offset(first, last, j, lane));
      }
#pragma unroll
      for (int q = 0; q < kPartialLoads; ++q)
        if (m0 + q < rows) add_weighted_bf16x8(acc, __int_as_float(__shfl_sync(kFullMask, weight, m0 + q)), v[q]);
    }
    if (first + j * 32 + lane < last) st_na(out + j * 32, pack_bf16x8(acc));
  }
}

// Rank-reduced (kRank): the item `part` (int4 [first, last) of the row) of the partial row of source s's token t,
// one of the (source, token) pairs with a row here (list_partial_tokens). The partial is bf16(sum over the token's
// slots on this rank, k ascending, of w * float(row)), float32 multiply then add from 0, one rounding (weights and
// rows from the dispatch, recv_topk_slots); it goes into the source's slot of the token's first expert here (lowest
// k). The item counts once toward the pair (local expert, s) of every one of the token's rows, so that over all
// items each pair counts rows x parts, the flat combine's target: the source awaits the first expert's counter,
// which thus covers this item.
__device__ __noinline__ void send_partial_item(const LowLatencyCombineParams& p, int s, int t, int part, int lane,
                                               int4* receive, int4* stage, int* s_items) {
  const int K = p.num_topk, R = p.num_ranks, M = p.max_tokens, row_int4 = p.hidden / 8;
  const int L = p.num_experts / R;
  const int rows_per_expert = R * M;  // packed rows: L * R * M <= E * M, far below 2^31
  // Lane k: slot k's (packed row, weight bits); -1 where the slot's expert is on another rank. Every entry of a
  // listed token was written by the dispatch. The bound keeps the loads inside x even if the protocol broke.
  const int2 entry = lane < K ? p.recv_topk_slots[(int64_t(s) * M + t) * K + lane] : make_int2(-1, 0);
  const bool mine = entry.x >= 0 && entry.x < L * rows_per_expert;
  const uint32_t rows = __ballot_sync(kFullMask, mine);
  if (rows == 0) return;  // a listed token has a row here: only a broken protocol gets here
  if (mine) atomicAdd_block(&s_items[entry.x / rows_per_expert * R + s], 1);
  const int n = __popc(rows);
  // Lane m < n: the m-th row here (ascending k) and its weight.
  uint32_t below = rows;
  for (int m = 0; m < min(lane, n); ++m) below &= below - 1;
  const int from = below != 0 ? __ffs(below) - 1 : 0;
  const int row = __shfl_sync(kFullMask, entry.x, from), weight = __shfl_sync(kFullMask, entry.y, from);
  const int first = part * kChunk, last = min(first + kChunk, row_int4);
  const int row0 = __shfl_sync(kFullMask, row, 0);  // the token's first row here
  const int e = p.peers.rank * L + row0 / rows_per_expert;
  int4* dst = receive + (int64_t(e) * M + t) * row_int4 + first;
  // NVSHMEM peers: staged at the first row's own place in the combine-send area (with zero-copy that is x itself:
  // this item's part of that row, which only this item reads; each lane stores a slice after its own load of it).
  int4* staged = stage + int64_t(row0) * row_int4 + first;
  const bool direct = has_peer_pointer(p.peers.ll, s);
  int4* out = (direct ? at_peer(p.peers.ll, s, dst) : staged) + lane;
  switch (n) {  // the same in every lane: every shuffle below sees the whole warp
    case 1:
      sum_partial_rows<1>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 2:
      sum_partial_rows<2>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 3:
      sum_partial_rows<3>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 4:
      sum_partial_rows<4>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 5:
      sum_partial_rows<5>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 6:
      sum_partial_rows<6>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 7:
      sum_partial_rows<7>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    case 8:
      sum_partial_rows<8>(p.x, row_int4, row, weight, first, last, lane, out);
      break;
    default:
      sum_many_partial_rows(p.x, row_int4, n, row, weight, first, last, lane, out);
  }
  if (direct) return;
  __threadfence();  // visible to whatever reads the put's source (this warp, or a NIC)
  __syncwarp();
  put_warp_once<kSlices>(p.peers.ll, s, dst, staged, last - first, lane, LoadNc{});
}

// Words of the rank-reduced send's token bitmap over [R][M] (list_partial_tokens).
__host__ __device__ __forceinline__ int partial_token_words(int num_ranks, int max_tokens) {
  return (num_ranks * max_tokens + 31) / 32;
}

// Rank-reduced (kRank): the (source, token) pairs this rank sends a partial row for, as a bitmap over [R][M] in
// s_bits (s_word_first: the set bits before each word; the return value: all of them), the same in every block.
// A token is listed iff a row of this layout names it (recv_src_info of a row of the pair (i, s), read from the
// layout ranges): exactly the tokens whose recv_topk_slots entries the dispatch wrote (all K of them,
// note_topk_slot). The entries of other tokens are never written and never read. Sources in `skip` are left out.
__device__ __noinline__ int list_partial_tokens(const LowLatencyCombineParams& p, const int* s_first,
                                                const int2* s_range, uint32_t skip, uint32_t* s_bits,
                                                int* s_word_first) {
  constexpr int kRowsPerRound = 4;  // rows per thread whose source-info loads are in flight together
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens;
  const int L = p.num_experts / R;
  const int64_t rows_per_expert = int64_t(R) * M;
  const int words = partial_token_words(R, M), total = s_first[L];
  for (int w = threadIdx.x; w < words; w += kThreads) s_bits[w] = 0;
  __syncthreads();
  for (int g0 = threadIdx.x; g0 < total; g0 += kRowsPerRound * kThreads) {
    int src[kRowsPerRound], token[kRowsPerRound];
#pragma unroll
    for (int q = 0; q < kRowsPerRound; ++q) {
      const int g = g0 + q * kThreads;
      src[q] = -1;
      if (g >= total) continue;
      const int i = local_expert_of(s_first, L, g), n = g - s_first[i];
      src[q] = source_of(s_range, i, R, n);
      token[q] = p.recv_src_info[int64_t(i) * rows_per_expert + n];
    }
#pragma unroll
    for (int q = 0; q < kRowsPerRound; ++q) {
      const int s = src[q], t = token[q];
      if (s < 0 || (skip >> s & 1) || t < 0 || t >= M) continue;  // a token outside [0, M): a broken protocol
      const int bit = s * M + t;
      atomicOr_block(&s_bits[bit / 32], 1u << (bit % 32));
    }
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < words; base += 32) {
      const int w = base + lane;
      const int n = w < words ? __popc(s_bits[w]) : 0;
      const int incl = warp_inclusive_scan(n);
      if (w < words) s_word_first[w] = carry + incl - n;
      carry += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) s_word_first[words] = carry;
  }
  __syncthreads();
  return s_word_first[words];
}

// Rank-reduced (kRank): the partial rows of the listed tokens, in items of kChunk int4 (one per token and part).
// Listed token c goes to block c % G, whose warps take its tokens' items in turn: every SM reads its share of the
// local rows, and a block's items touch few (local expert, source) pairs (one arrival add each at the end).
// s_items counts the block's items per pair (send_partial_item).
__device__ __noinline__ void send_partials(const LowLatencyCombineParams& p, const int* s_first, const int2* s_range,
                                           int* s_items, uint32_t skip, int4* receive, int4* stage) {
  extern __shared__ uint32_t s_dynamic[];  // combine_smem_bytes
  const int M = p.max_tokens, words = partial_token_words(p.num_ranks, M);
  uint32_t* s_bits = s_dynamic;
  int* s_word_first = reinterpret_cast<int*>(s_dynamic + words);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int parts = (p.hidden / 8 + kChunk - 1) / kChunk;
  const int tokens = list_partial_tokens(p, s_first, s_range, skip, s_bits, s_word_first);
  for (int w = warp;; w += kWarps) {  // the block's w-th item: part w % parts of its (w / parts)-th token
    const int c = blockIdx.x + w / parts * gridDim.x, part = w % parts;
    if (c >= tokens) break;
    int lo = 0, hi = words;  // the word holding the c-th listed token: the largest with s_word_first <= c
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s_word_first[mid] <= c)
        lo = mid;
      else
        hi = mid;
    }
    uint32_t m = s_bits[lo];
    for (int k = s_word_first[lo]; k < c; ++k) m &= m - 1;
    const int bit = lo * 32 + __ffs(m) - 1;
    send_partial_item(p, bit / M, bit % M, part, lane, receive, stage, s_items);
  }
}

// Rows this rank sends back, in items of kChunk int4 spread over the whole grid's warps. Row g of the
// concatenation of every local expert's packed rows belongs to expert i (s_first[i] <= g < s_first[i + 1]) and
// source rank s (from the layout range). s_items counts the block's items per (local expert, source) pair.
// kLogfmt: each item goes as its LogFMT block (an item of kChunk int4 is 8 groups: one block).
// kRank: the rank-reduced order (send_partials).
template <bool kLogfmt, bool kRank, bool kShrink>
__device__ __noinline__ void send_phase(const LowLatencyCombineParams& p, int* s_first, int2* s_range, int* s_items) {
  static_assert(kChunk == kLogfmtGroupsPerBlock * kLogfmtGroupInt4, "a work item encodes into one LogFMT block");
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, me = p.peers.rank;
  const int L = p.num_experts / R;
  const int row_int4 = p.hidden / 8;
  const int64_t rows_per_expert = int64_t(R) * M;
  int32_t* sent = p.layout.combine_sent(p.peers.ll.local, p.set);        // running totals per (local expert, source)
  int32_t* arrived = p.layout.combine_arrived(p.peers.ll.local, p.set);  // addresses here = offsets at every peer
  uint64_t* targets = p.layout.combine_target(p.peers.ll.local, p.set);
  const uint64_t* recv_seen = p.layout.recv_seen(p.peers.ll.local, p.set);
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // earlier ops on this set, of either kind
  int4* receive = reinterpret_cast<int4*>(p.layout.receive(p.peers.ll.local, p.set));
  int4* stage = reinterpret_cast<int4*>(p.layout.combine_send(p.peers.ll.local, p.set));
  // Rows per (local expert, source) and their begins, from the layout ranges: one load per pair, all threads
  // at once, into shared memory; then warp 0 turns the per-expert totals into the exclusive prefix s_first.
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
  const uint32_t skip = kShrink ? s_skip : 0u;
  if (warp == 0) {
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
  const int total = s_first[L];
  const int warps = gridDim.x * kWarps;
  // Work items of kChunk int4 (one round of loads per lane each): ceil(row_int4 / kChunk) per row. With an
  // NVSHMEM peer each item is a put and a quiet (put_warp).
  const int parts = (row_int4 + kChunk - 1) / kChunk;
  // Targets first, one warp per (local expert, source) pair, also for pairs without rows (the source may wait
  // for them: it only knows which experts its tokens chose). The running total is this pair's own (only this
  // rank adds to the source's counter for this expert, and only the warp of the pair's index writes it: the
  // grid is the same in every call); the slot at the source is free to overwrite since the back-pressure wait
  // above (its receivers of the last combine on the set are done).
  for (int pair = blockIdx.x * kWarps + warp; pair < L * R; pair += warps) {
    if (lane != 0) continue;
    const int i = pair / R, s = pair % R;
    if (skip >> s & 1) continue;  // left out: its running total stays
    const int32_t target = int32_t(uint32_t(sent[pair]) + uint32_t(s_range[pair].y * parts));  // wraps
    sent[pair] = target;
    post64(p.peers.ll, s, targets + arrival_slot(me, i, R), uint64_t(k_ops + 1u) << 32 | uint32_t(target));
  }
  if constexpr (kRank) {
    send_partials(p, s_first, s_range, s_items, skip, receive, stage);
  } else {
    // With both phases in this launch, this rank's own rows are not copied: the receive phase reads them from x
    // in place, through the row index each one leaves in its receive slot (local_row_of). A send-only launch
    // (hook) copies them, since x may change before the hook runs.
    const bool local_in_place = !kLogfmt && (p.phases & kLowLatencyRecv) != 0;
    const int64_t slot_int4 = kLogfmt ? logfmt_row_bytes(p.hidden) / 16 : row_int4;  // a receive slot (one row)
    // A warp takes kBatch adjacent items at a time (w0, w0 + 1, ...: 4 KB of one row, or the end of one row and
    // the start of the next): faster than items a grid apart, than 4 adjacent ones, and than spreading a block's
    // warps over many rows (docs/bench-notes.md). The block completes its items once, after this loop.
    constexpr int kBatch = 2;
    for (int w0 = (blockIdx.x * kWarps + warp) * kBatch; w0 < total * parts; w0 += kBatch * warps) {
      int b_pair[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int w = w0 + j;
        b_pair[j] = -1;                    // every slot is set, also those past the end: lane 0 reads them all
        if (w >= total * parts) continue;  // (a break here left slots j + 1.. unset once kBatch > 2)
        const int g = w / parts, part = w % parts;
        int lo = 0, hi = L;  // largest i with s_first[i] <= g
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          if (s_first[mid] <= g)
            lo = mid;
          else
            hi = mid;
        }
        const int i = lo, n = g - s_first[i];
        int s = 0;
        while (s < R - 1 && n >= s_range[i * R + s].x + s_range[i * R + s].y) ++s;  // rows are by source, ascending
        if (skip >> s & 1) continue;  // a source left out: nothing is written there (b_pair[j] stays -1)
        const int e = me * L + i;
        const int64_t row = int64_t(i) * rows_per_expert + n;
        const int t = p.recv_src_info[row];
        const int first = part * kChunk, last = min(first + kChunk, row_int4);
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
          put_warp_once<kChunk / 32>(p.peers.ll, s, receive + (int64_t(e) * M + t) * row_int4 + first, src,
                                     last - first, lane, LoadNc{});
        }
        b_pair[j] = i * R + s;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (lane == 0 && b_pair[j] >= 0) atomicAdd_block(&s_items[b_pair[j]], 1);
    }
  }
  // The block's items are issued: one fence (it waits for every store the block issued, the barrier putting
  // them before it), then one add per pair the block wrote to, at the pair's source. Each lane that adds runs
  // the fence itself (a release pattern is a fence and a write of the same thread; the warp's lanes share one
  // fence instruction). Pairs with the receiver's acquire of arrived[e] (receive_phase). The waits of the receive
  // phase start only after this (its threads k < K are warp 0's; the other warps block at its barrier): waits or
  // row loads while the SM's stores still drain made the combine slower (docs/bench-notes.md).
  __syncthreads();
  if (warp == 0) {
    for (int base = 0; base < L * R; base += 32) {
      const int pair = base + lane;
      const int n = pair < L * R ? s_items[pair] : 0;
      if (n == 0) continue;
      fence_acq_rel_sys();
      add_after_fence(p.peers.ll, pair % R, arrived + arrival_slot(me, pair / R, R), n);
    }
  }
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
      int4 v[kMaxNvlRanks];
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r)  // every partial's load in flight, then r ascending
        if (r < R && s_partial[r] != nullptr) v[r] = ld_cg(s_partial[r] + h);
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kMaxNvlRanks; ++r) {
        if (r >= R || s_partial[r] == nullptr) continue;
        const uint32_t words[4] = {uint32_t(v[r].x), uint32_t(v[r].y), uint32_t(v[r].z), uint32_t(v[r].w)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[2 * q] = __fadd_rn(acc[2 * q], __uint_as_float(words[q] << 16));
          acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __uint_as_float(words[q] & 0xffff0000u));
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
          if (e / L == me)  // written by this launch's send phase before its block's arrival add
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
            const float w = s_weight[k0 + j];
            const uint32_t words[4] = {uint32_t(v[j].x), uint32_t(v[j].y), uint32_t(v[j].z), uint32_t(v[j].w)};
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // no fused multiply-add: the reference multiplies, then adds
              acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, __uint_as_float(words[q] << 16)));
              acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, __uint_as_float(words[q] & 0xffff0000u)));
            }
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

// Dynamic shared memory of a launch: the rank-reduced send's token bitmap and its word prefix (send_partials); none
// for the other orders. Dynamic, so that it lies past every static shared array and moves none of them.
__host__ __device__ __forceinline__ size_t combine_smem_bytes(const LowLatencyCombineParams& p) {
  if (!p.rank_reduced || !(p.phases & kLowLatencySend)) return 0;
  return (2 * size_t(partial_token_words(p.num_ranks, p.max_tokens)) + 1) * sizeof(uint32_t);
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
    if (p.rank_reduced)
      send_phase<false, true, false>(p, s_first, s_range, s_items);
    else if ((p.logfmt & 1) && shrink)
      send_phase<true, false, true>(p, s_first, s_range, s_items);
    else if (p.logfmt & 1)
      send_phase<true, false, false>(p, s_first, s_range, s_items);
    else if (shrink)
      send_phase<false, false, true>(p, s_first, s_range, s_items);
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
  launch_low_latency_kernel(low_latency_combine_kernel, p, launch, kThreads, combine_smem_bytes(p), stream);
}

}  // namespace EPX_LL_BUILD
}  // namespace epx
