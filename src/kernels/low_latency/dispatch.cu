// Low-latency dispatch (semantics.md section 4): no exchange of counts before the data, fixed-size receive areas.
//
// Send phase: every warp owning an expert counts this rank's selections of it and sends the count (+ 1) to
// the expert's rank at once, before any row, as a relaxed store (it carries no data; a release would wait for
// the block's rows to land): the receiver lays its rows out while they are in flight. Block b
// stages tokens b, b+G, ... in shared memory (quantized to FP8 if asked) and sends each once to every rank
// that holds one of its experts (not once per expert), one writer warp per destination rank (the block's last
// R warps): the record at [this rank][token], then for each slot (t, k) at that rank the token index (+ 1)
// into its row map at (local expert, this rank, position of (t, k) among this rank's selections of that
// expert in (t, k) order): rows keep token order with no atomics. After its last token the writer adds one per
// slot to the destination's arrival counter of (local expert, this rank): one fence, then relaxed adds,
// a release that publishes the records and map entries before it (deferred to the end so that no token
// waits for an earlier one's stores to land).
// Before any write into a rank's set, the block waits (a local poll) until that rank has received
// every earlier op on the set (the set's epochs, layout/ll_layout.hpp; once per rank and block). Writes into other
// ranks go through device/transport.cuh (peer pointer or NVSHMEM); with NVSHMEM peers the staged record
// is also copied to symmetric memory, where puts can read it.
// Receive phase (the block's warps other than the writers, so that it starts while the block's own stores
// drain): the block owning a local expert (a group of up to kGroupExperts of them, as one range of items) waits
// for all ranks' counts, lays the rows out by source rank ascending and copies them from the records into the
// packed outputs (FP8 scales token-minor) in work items of one load round each, a contiguous range of them per
// warp; an item waits until every row of its (expert, source) has arrived (the arrival counter), so the rows of
// early sources are copied while later ones are in flight. Then it clears the counts and arrival counters; every
// block's completion goes to every rank's epoch counter (recv_seen; kernels/low_latency/epochs.cuh says when), which
// (once all blocks' have) lets the next op on this set write here.
// Rank masking (enable_shrink, kernels/low_latency/shrink.cuh): nothing is sent to a rank left out (records, map
// entries, counts, arrivals); a source left out counts 0 rows; a source masked after its count arrived keeps its
// rows in the layout, not copied (their contents are unspecified). The receive
// phase is a function of its own (__noinline__, the parameters __grid_constant__), so that its registers do
// not add to the send phase's.
// With topk_weights (for the rank-reduced combine) each record also carries the token's top-k experts and weights;
// the receive turns them into recv_topk_slots (note_topk_slot), the expert rank's table of which packed rows and
// weights make each source token's partial sum. Without them nothing of this runs.
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>

#include "device/fp8.cuh"
#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "device/wait.cuh"
#include "device/warp.cuh"
#include "device/warp_copy.cuh"
#include "kernels/low_latency/epochs.cuh"
#include "kernels/low_latency/launch.cuh"
#include "kernels/low_latency/shrink.cuh"
#include "layout/ll_params.hpp"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// The record of this call: with topk_weights it carries the token's top-k (LowLatencyRecord).
__host__ __device__ __forceinline__ LowLatencyRecord record_of(const LowLatencyDispatchParams& p) {
  return LowLatencyRecord::make(p.hidden, p.fp8 != 0, p.topk_weights != nullptr ? p.num_topk : 0);
}

// The block's copy of topk_idx as int16 in shared memory (indices outside [-1, E) become -2, which no expert
// matches), so that the scans below cost shared-memory latency instead of one L2 round trip per 32 entries.
__device__ void load_topk(const LowLatencyDispatchParams& p, int16_t* s_topk) {
  for (int i = threadIdx.x; i < p.num_tokens * p.num_topk; i += kThreads) {
    const int64_t e = p.topk_idx[i];
    s_topk[i] = int16_t(e >= -1 && e < p.num_experts ? e : -2);
  }
}

// Entries of s_topk below `limit` that name expert e (>= 0), over the warp: eight int16 entries per lane and load
// (one int4, compared two at a time), so a scan of 1024 entries is 4 rounds of shared loads, not 32. Reads whole
// int4 words up to the end of the padded array (dispatch_smem_bytes).
__device__ int count_in_topk(const int16_t* s_topk, int limit, int e, int lane) {
  const int4* words = reinterpret_cast<const int4*>(s_topk);
  const uint32_t key = uint32_t(e & 0xffff) * 0x10001u;  // e in both halves
  int bits = 0;                                          // 16 per match
  for (int c = lane; c * 8 < limit; c += 32) {
    const int4 q = words[c];
    const int valid = min(limit - c * 8, 8);  // entries of this word below limit
    const uint32_t w[4] = {uint32_t(q.x), uint32_t(q.y), uint32_t(q.z), uint32_t(q.w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t below = (2 * j < valid ? 0xffffu : 0u) | (2 * j + 1 < valid ? 0xffff0000u : 0u);
      bits += __popc(__vcmpeq2(w[j], key) & below);
    }
  }
  return warp_sum(bits) >> 4;
}

// Selections of expert e before slot (t, k), in (token, slot) order: the row's position in its block.
__device__ __forceinline__ int position_of(const int16_t* s_topk, int t, int k, int num_topk, int e, int lane) {
  return count_in_topk(s_topk, t * num_topk + k, e, lane);
}

// Stages token t as a record in shared memory: BF16 row, or e4m3 row + per-128 scales.
__device__ void stage_token(const LowLatencyDispatchParams& p, const LowLatencyRecord& rec, int t, uint8_t* s_rec) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int4* src = p.x + int64_t(t) * (p.hidden / 8);
  if (!p.fp8) {
    for (int i = threadIdx.x; i < p.hidden / 8; i += kThreads) reinterpret_cast<int4*>(s_rec)[i] = ld_nc(src + i);
  } else {
    // One warp per 128-element group: 4 values per lane.
    const int groups = p.hidden / kFp8GroupSize;
    float* s_scales = reinterpret_cast<float*>(s_rec + rec.scale_offset);
    for (int g = warp; g < groups; g += kWarps) {
      const uint2 raw =
          *reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(src) + g * kFp8GroupSize + lane * 4);
      const float v[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                          __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u)};
      float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
      amax = warp_max(amax);
      const float scale = fp8_scale(amax, p.round_scale != 0);
      uint32_t packed = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) packed |= uint32_t(to_e4m3(__fdiv_rn(v[j], scale))) << (8 * j);
      reinterpret_cast<uint32_t*>(s_rec)[g * 32 + lane] = packed;
      if (lane == 0) s_scales[g] = scale;
    }
  }
  if (p.topk_weights != nullptr && threadIdx.x < p.num_topk) {  // the token's top-k, for the rank-reduced combine
    // From global memory: s_topk is complete only after the barrier that follows staging.
    const int k = threadIdx.x, K = p.num_topk;
    const int64_t e = p.topk_idx[int64_t(t) * K + k];
    reinterpret_cast<float*>(s_rec + rec.topk_offset)[k] = p.topk_weights[int64_t(t) * K + k];
    reinterpret_cast<int16_t*>(s_rec + rec.topk_offset + 4 * K)[k] = int16_t(e >= -1 && e < p.num_experts ? e : -2);
  }
}

// Token t's record in symmetric memory, the source of NVSHMEM puts.
__device__ __forceinline__ int4* staged_record(const LowLatencyDispatchParams& p, const LowLatencyRecord& rec, int t) {
  return reinterpret_cast<int4*>(p.layout.dispatch_stage(p.peers.ll.local, p.set) + int64_t(t) * rec.bytes);
}

// Count senders: warps cw = 0 .. ncw-1 of block b own experts b + G * cw, stride G * ncw. Each sends its
// selections of the expert (uncapped, + 1) to the expert's rank (called after the block's back-pressure poll
// and a barrier: the rank has received every earlier op on this set), except to the ranks in `skip` (left out by rank
// masking). The count carries no data: the rows are published by the arrival counters.
__device__ void send_counts(const LowLatencyDispatchParams& p, const int16_t* s_topk, int cw, int ncw, uint32_t skip) {
  const int lane = threadIdx.x % 32;
  const int R = p.num_ranks, me = p.peers.rank;
  const int L = p.num_experts / R;
  for (int e = blockIdx.x + gridDim.x * cw; e < p.num_experts; e += gridDim.x * ncw) {
    const int expected = count_in_topk(s_topk, p.num_tokens * p.num_topk, e, lane);  // all selections of e
    const int dest = e / L;
    if (lane == 0 && !(skip >> dest & 1)) {
      post(p.peers.ll, dest, p.layout.dispatch_count(p.peers.ll.local, p.set) + (e % L) * R + me, expected + 1);
    }
  }
}

// The first of the R writer warps (one per destination rank) of a send phase: the block's last warps.
__device__ __forceinline__ int first_writer(int num_ranks) { return kWarps - num_ranks; }

template <bool kShrink>
__device__ void send_phase(const LowLatencyDispatchParams& p, uint8_t* s_rec, int16_t* s_topk) {
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, K = p.num_topk, me = p.peers.rank;
  const int L = p.num_experts / R;
  const LowLatencyRecord rec = record_of(p);
  const uint64_t* recv_seen = p.layout.recv_seen(p.peers.ll.local, p.set);
  // Earlier ops on this set, of either kind: every peer must have received them before this one writes there.
  // This block's receive count on the set (kernels/low_latency/epochs.cuh), written by an earlier kernel.
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);
  // Addresses in this rank's region name the same offsets in every peer's region (device/transport.cuh).
  load_topk(p, s_topk);  // made visible by the __syncthreads after staging (or before the counts below)
  // Back-pressure (wait_back_pressure), once per rank and block (not once per writer or count warp and destination),
  // by the last warp (the lightest stager: FP8 groups and BF16 int4 run out before it). The barrier after staging (or
  // before the counts when the block has no token) orders every thread's writes into a rank's set after the wait for
  // it, and s_skip (the ranks this op leaves out, rank masking) is read after that same barrier.
  __shared__ uint32_t s_skip;
  if (warp == kWarps - 1)
    wait_back_pressure<kShrink>(recv_seen, k_ops, mask, me, R, p.fail, kRoleLowLatencySend, &s_skip);

  int32_t* row_map = p.layout.dispatch_row_map(p.peers.ll.local, p.set, R, M, rec.bytes);
  const int writer0 = first_writer(R), d = warp - writer0;  // d: this warp's destination if it is a writer
  bool counted = false;
  uint32_t skip = 0;  // the ranks left out: s_skip, once the first barrier below has passed
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    stage_token(p, rec, t, s_rec);
    __syncthreads();
    if (kShrink) skip = s_skip;
    if (uses_nvshmem(p.peers.ll)) {  // NVSHMEM puts read their source from symmetric memory: a copy there
      int4* staged = staged_record(p, rec, t);
      for (int i = threadIdx.x; i < int(rec.bytes / 16); i += kThreads)
        staged[i] = reinterpret_cast<const int4*>(s_rec)[i];
      __threadfence();  // before any warp of the block hands the record to NVSHMEM
      __syncthreads();
    }
    if (warp == 0 && lane < K && s_topk[t * K + lane] == -2)  // skipped, never written: Buffer::check()
      report_input_error(p.fail.self, p.fail.host, kErrTopkOutOfRange, kRoleLowLatencySend, t, lane,
                         p.topk_idx[int64_t(t) * K + lane]);
    if (d >= 0) {
      // Writer of destination d: the whole record once if the token has an expert at d, then the row map entry
      // of each of the token's slots at d.
      const int e = lane < K ? int(s_topk[t * K + lane]) : -1;              // lane k holds slot k's expert
      const bool here = e >= d * L && e < (d + 1) * L && !(skip >> d & 1);  // -1 and -2 are at no rank
      const uint32_t at_d = __ballot_sync(kFullMask, here);
      if (at_d != 0) {
        int4* dst = reinterpret_cast<int4*>(p.layout.dispatch_records(p.peers.ll.local, p.set) +
                                            (int64_t(me) * M + t) * rec.bytes);
        const int4* src =
            has_peer_pointer(p.peers.ll, d) ? reinterpret_cast<const int4*>(s_rec) : staged_record(p, rec, t);
        // On return this lane's stores are issued (peer pointer) or complete at d (NVSHMEM); published by the
        // arrival adds after the token loop.
        put_warp<2>(p.peers.ll, d, dst, src, int(rec.bytes / 16), lane, [](const int4* q) { return *q; });
        for (uint32_t mine = at_d; mine != 0; mine &= mine - 1) {
          const int k = __ffs(mine) - 1;  // the same k in every lane: position_of is warp-collective
          const int ek = __shfl_sync(kFullMask, e, k);
          const int slot = position_of(s_topk, t, k, K, ek, lane);
          if (lane == 0 && slot < M)
            put_int(p.peers.ll, d, row_map + (int64_t(ek % L) * R + me) * M + slot, t + 1);
          else if (lane == 0)  // only with an expert listed twice in a token: M rows per expert and source at most
            report_input_error(p.fail.self, p.fail.host, kErrExpertRowsExceeded, kRoleLowLatencySend, ek, slot + 1, M);
        }
      }
    } else if (!counted) {
      send_counts(p, s_topk, warp, writer0, skip);
    }
    counted = true;
    __syncthreads();  // the staged record is free again (every lane's loads of it have returned)
  }
  if (!counted) {     // no token here: every warp sends counts
    __syncthreads();  // s_topk (and s_skip) is complete
    if (kShrink) skip = s_skip;
    send_counts(p, s_topk, warp, kWarps, skip);
  }
  if (d >= 0 && !(skip >> d & 1)) {
    // Publication, one add per slot at d (also for slots past M, which the receiver's count includes but that
    // were not written: it waits for the arrivals its count names). One fence per lane that adds, however many of
    // the block's tokens it adds for (a system-scope release costs ~1.5 us even with nothing to wait for:
    // tools/probes/fence_cost.cu), then relaxed adds, each a release through that fence: every lane's record
    // stores and lane 0's map entries (ordered by the __syncwarp) land before them. Pairs with the receiver's
    // wait_at_least on dispatch_arrived. The lanes find first whether they add at all, so that those that do fence
    // together, one fence for the warp (a fence before each lane's first add would run once per distinct token).
    __syncwarp();
    int32_t* arrived = p.layout.dispatch_arrived(p.peers.ll.local, p.set);
    bool adds = false;
    for (int t = blockIdx.x; t < p.num_tokens && !adds; t += gridDim.x) {
      const int e = lane < K ? int(s_topk[t * K + lane]) : -1;
      adds = e >= d * L && e < (d + 1) * L;
    }
    if (adds) fence_release_sys();
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
      const int e = lane < K ? int(s_topk[t * K + lane]) : -1;
      if (e >= d * L && e < (d + 1) * L) add_after_fence(p.peers.ll, d, arrived + (e % L) * R + me, 1);
    }
  }
}

constexpr int kChunk = kCopyItemInt4;  // int4 per receive work item (device/transport.cuh)

// The scales (FP8, token-minor) of row n of local expert i, from its record at src, and its source token index:
// every load issued before the first store, so the item costs one load latency.
__device__ __forceinline__ void copy_row_meta(const LowLatencyDispatchParams& p, const uint8_t* src, int i, int n,
                                              int token, int lane) {
  const LowLatencyRecord rec = record_of(p);
  const int groups = p.hidden / kFp8GroupSize;
  const int64_t rows_per_expert = int64_t(p.num_ranks) * p.max_tokens;
  if (p.fp8 && p.ue8m0) {  // 4 exponent bytes per int32, token-minor: [L][H/512][R*M]
    const int words = groups / 4;
    const int4* scales = reinterpret_cast<const int4*>(src + rec.scale_offset);  // 4 floats per word
    for (int q0 = 0; q0 < words; q0 += 32) {
      const int q = q0 + lane;
      if (q >= words) break;
      const int4 v = ld_cg(scales + q);
      const uint32_t packed = uint32_t(ue8m0_of(__int_as_float(v.x))) | uint32_t(ue8m0_of(__int_as_float(v.y))) << 8 |
                              uint32_t(ue8m0_of(__int_as_float(v.z))) << 16 |
                              uint32_t(ue8m0_of(__int_as_float(v.w))) << 24;
      static_cast<uint32_t*>(p.packed_recv_scales)[(int64_t(i) * words + q) * rows_per_expert + n] = packed;
    }
  } else if (p.fp8) {  // token-minor: [L][H/128][R*M]; 64 groups (hidden 8192) per round
    const int32_t* scales = reinterpret_cast<const int32_t*>(src + rec.scale_offset);
    for (int g0 = 0; g0 < groups; g0 += 64) {
      const int ga = g0 + lane, gb = g0 + 32 + lane;
      const int32_t a = ga < groups ? ld_cg(scales + ga) : 0, b = gb < groups ? ld_cg(scales + gb) : 0;
      float* out = static_cast<float*>(p.packed_recv_scales);
      if (ga < groups) out[(int64_t(i) * groups + ga) * rows_per_expert + n] = __int_as_float(a);
      if (gb < groups) out[(int64_t(i) * groups + gb) * rows_per_expert + n] = __int_as_float(b);
    }
  }
  if (lane == 0) p.recv_src_info[int64_t(i) * rows_per_expert + n] = token;
}

// With topk_weights (for the rank-reduced combine): row n of local expert i, from source s (its slot-th row of
// that pair, source token `token`), is one of the token's top-k slots; finds which from the top-k its record
// carries and writes (packed row, weight bits) into recv_topk_slots[s][token][k]. The row of the token's first
// slot on this rank (lowest k) also writes (-1, 0) into the slots whose expert is elsewhere: every slot on this
// rank has a row here (one writer each), so this dispatch writes all K entries of every token that reached this
// rank. Read after the arrival acquire of the row (the top-k travels in the record, under the same release).
__device__ __noinline__ void note_topk_slot(const LowLatencyDispatchParams& p, const uint8_t* src,
                                            const int32_t* pair_map, int i, int s, int n, int slot, int token,
                                            int lane) {
  const LowLatencyRecord rec = record_of(p);
  const int K = p.num_topk, R = p.num_ranks, M = p.max_tokens;
  const int L = p.num_experts / R, first_expert = p.peers.rank * L;
  int e = -1;
  int32_t w = 0;
  if (lane < K) {
    w = ld_cg(reinterpret_cast<const int32_t*>(src + rec.topk_offset) + lane);
    e = int16_t(ld_cg(reinterpret_cast<const uint16_t*>(src + rec.topk_offset + 4 * K) + lane));
  }
  const uint32_t here = __ballot_sync(kFullMask, e >= first_expert && e < first_expert + L);
  const uint32_t mine = __ballot_sync(kFullMask, e == first_expert + i);
  // A token that lists expert i more than once has that many consecutive rows of (i, s), in slot order: this
  // row's occurrence is the number of rows right before it with the same token.
  const int occurrences = __popc(mine);
  int before = 0;
  while (before + 1 < occurrences && slot - before - 1 >= 0 && ld_cg(pair_map + slot - before - 1) == token + 1)
    ++before;
  uint32_t m = mine;
  for (int j = 0; j < before; ++j) m &= m - 1;
  if (m == 0) return;  // the record names no slot of expert i: a broken protocol (reads stay in bounds)
  const int k = __ffs(m) - 1;
  int2* slots = reinterpret_cast<int2*>(p.recv_topk_slots) + (int64_t(s) * M + token) * K;
  if (lane == k)
    slots[k] = make_int2(int(int64_t(i) * R * M + n), w);
  else if (k == __ffs(here) - 1 && lane < K && !(here >> lane & 1))
    slots[lane] = make_int2(-1, 0);
}

// Local experts a block lays out and copies together, as one range of work items: with more local experts than
// blocks (144 at 2 ranks and 288 experts, 132 SMs) the blocks holding two copied them one after the other, the
// slowest blocks of the call (docs/bench-notes.md).
constexpr int kGroupExperts = 4;

// Receive warps: warps 0 .. recv_warps - 1 of the block (every warp without a send phase in this launch; with
// one, all but the writers, which join at the end once their arrival adds are issued). The block's local experts
// i0, i0 + G, ... go in groups of up to kGroupExperts (fewer where a lane of warp 0 per (expert, source) would not
// fit): the group's rows are numbered by (expert, source, slot) and cut into one range of work items.
// What every receive warp's item loop reads, per block, in shared memory. Held in registers instead, these values
// spill at the 64 registers a thread of a 1024-thread block gets, and the loop reloads them from local memory (L2 at
// this stack size) inside every item's dependency chain.
struct ReceiveConsts {
  const uint8_t* records;
  const int32_t* row_map;
  int32_t* arrived;
  int4* out;                // packed_recv_x
  int64_t rows_per_expert;  // R * M
  int rec_bytes, row_int4, chunks, items;
};

template <bool kShrink, bool kTopk>
__device__ __noinline__ void receive_phase(const LowLatencyDispatchParams& p, int recv_warps) {
  const RankMask mask = shrink_mask<kShrink>(p.mask);
  __shared__ int s_begin[kGroupExperts][kMaxNvlRanks + 1];  // per expert of the group: where each source's rows begin
  __shared__ int s_expected[kGroupExperts][kMaxNvlRanks];   // per source: its count as sent, the arrivals to await
  __shared__ int s_first[kGroupExperts + 1];                // expert j's rows in the group: [s_first[j], s_first[j+1])
  const uint32_t k_ops = ops_before(p.layout, p.peers.ll, p.set);  // the send phase's too (same block, same op)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, G = gridDim.x;
  const int L = p.num_experts / R;
  const LowLatencyRecord rec = record_of(p);
  const int64_t rows_per_expert = int64_t(R) * M;
  const uint8_t* records = p.layout.dispatch_records(p.peers.ll.local, p.set);
  const int32_t* row_map = p.layout.dispatch_row_map(p.peers.ll.local, p.set, R, M, rec.bytes);
  int32_t* counts = p.layout.dispatch_count(p.peers.ll.local, p.set);
  int32_t* arrived = p.layout.dispatch_arrived(p.peers.ll.local, p.set);
  const int row_int4 = int(rec.row_bytes / 16);
  const int chunks = (row_int4 + kChunk - 1) / kChunk, items = chunks + 1;
  const int threads = recv_warps * 32;
  const int group = min(kGroupExperts, 32 / R);  // (expert, source) pairs of a group: one bit each below
  __shared__ ReceiveConsts s_c;                  // written here, read after the first group's layout barrier
  if (threadIdx.x == 0)
    s_c =
        ReceiveConsts{records,  row_map, arrived, static_cast<int4*>(p.packed_recv_x), rows_per_expert, int(rec.bytes),
                      row_int4, chunks,  items};

  for (int i0 = blockIdx.x; i0 < L && warp < recv_warps; i0 += G * group) {
    const int ng = min(group, (L - 1 - i0) / G + 1);  // the group's experts: i0 + j * G, j < ng
    if (warp == 0) {
      const int j = lane / R, r = lane % R;  // lane: (expert j of the group, source r)
      const bool active = j < ng;
      const int i = i0 + j * G;
      int count = 0;
      if (active) {
        // The count carries no data (its rows are published by the arrival counter below), so it is sent
        // before them; rows past M (an expert listed twice in a token) were reported and not written.
        // A source left out by rank masking (or masked by this wait) sends no rows: 0.
        int32_t seen = 1;
        wait_for_rank(
            counts + i * R + r, [](int32_t v) { return v != 0; }, 1, mask, p.peers.rank, r, p.fail,
            WaitSite{kRoleLowLatencyRecv, -1, r, i}, &seen);
        const int expected = seen - 1;
        s_expected[j][r] = expected;
        count = min(expected, M);
      }
      int before = 0, total = 0;  // over expert j's sources: those below r, and all
      for (int q = 0; q < R; ++q) {
        const int c = __shfl_sync(kFullMask, count, (j * R + q) & 31);
        before += q < r ? c : 0;
        total += c;
      }
      int first = 0, all = 0;  // over the group's experts: the rows of those below j, and of all
      for (int q = 0; q < ng; ++q) {
        const int c = __shfl_sync(kFullMask, total, q * R);
        first += q < j ? c : 0;
        all += c;
      }
      if (active) {
        s_begin[j][r] = before;
        p.recv_layout_range[int64_t(i) * R + r] = (int64_t(before) << 32) | int64_t(count);
      }
      if (active && r == 0) {
        s_begin[j][R] = total;
        s_first[j] = first;
        p.packed_recv_count[i] = total;
        if (p.cumulative_stats != nullptr) p.cumulative_stats[i] += total;
      }
      if (lane == 0) s_first[ng] = all;
    }
    named_barrier(1, threads);  // s_begin, s_expected and s_first are written
    // The group's rows are numbered by (expert, source, slot); work items of kChunk int4 per row (one round of
    // loads per lane each) plus one for the row's scales and source token. Each receive warp takes a contiguous
    // range of items, so that it waits for one source (two where its range crosses a boundary) and loads each
    // row's map entry once: with items dealt round-robin every warp would hold items of every source and wait for
    // them in source order, so a late source would be polled only after the earlier ones' copies.
    const int all_items = s_first[ng] * items, per_warp = (all_items + recv_warps - 1) / recv_warps;
    const int w_end = min(all_items, (warp + 1) * per_warp);
    uint32_t complete = 0;  // lane 0's: (expert, source) pairs (bit j * R + s) whose rows have all arrived
    uint32_t dropped = 0;   // lane 0's: pairs of sources masked (rank masking) before all their rows arrived
    int j = 0, s = 0;
    for (int w = warp * per_warp; w < w_end;) {
      // The warp's items of group row g: [c0, c1) (data chunks below `chunks`, then the row's scales and token).
      const int its = s_c.items;
      const int g = w / its, c0 = w % its, c1 = min(w_end - g * its, its);
      w = g * its + c1;
      while (g >= s_first[j + 1]) {  // rows ascend, so j and s only move forward
        ++j;
        s = 0;
      }
      const int n = g - s_first[j], i = i0 + j * G;  // row n of expert i
      while (n >= s_begin[j][s + 1]) ++s;
      const uint32_t pair_bit = 1u << (j * R + s);
      if (lane == 0 && !((complete | dropped) & pair_bit)) {
        // Acquire; pairs with the writers' release adds (send_phase): the rows' records and map entries are here.
        const int32_t target = s_expected[j][s];
        int32_t seen = 0;
        const bool here = wait_for_rank(
            s_c.arrived + i * R + s, [target](int32_t v) { return v >= target; }, target, mask, p.peers.rank, s, p.fail,
            WaitSite{kRoleLowLatencyRecv, -1, s, i}, &seen);
        (here ? complete : dropped) |= pair_bit;
      }
      __syncwarp();  // lane 0's acquire orders every lane's loads below
      if (kShrink && (__shfl_sync(kFullMask, dropped, 0) & pair_bit)) continue;
      // The entry is token + 1, below M + 1 unless a sender broke the protocol (or the receive call named
      // another shape); clamped, so that even then every read stays inside the records.
      const int slot = n - s_begin[j][s];
      const int32_t* pair_map = s_c.row_map + (int64_t(i) * R + s) * M;
      const int token = min(max(ld_cg(pair_map + slot) - 1, 0), M - 1);
      const uint8_t* src = s_c.records + (int64_t(s) * M + token) * s_c.rec_bytes;
      const int64_t row = int64_t(i) * s_c.rows_per_expert + n;
      const int row_chunks = s_c.chunks, row_len = s_c.row_int4;  // from s_c, as above
      // The data chunks one at a time (4 int4 per lane in flight).
      const int end4 = min(min(c1, row_chunks) * kChunk, row_len);
      for (int first = c0 * kChunk; first < end4; first += kChunk)
        warp_copy_once<kChunk / 32>(s_c.out + row * row_len + first, reinterpret_cast<const int4*>(src) + first,
                                    min(kChunk, end4 - first), lane, LoadCg{}, StoreNa{});
      if (c1 > row_chunks) copy_row_meta(p, src, i, n, token, lane);
      if (kTopk && c1 > row_chunks) note_topk_slot(p, src, pair_map, i, s, n, slot, token, lane);
    }
    named_barrier(1, threads);  // every row of the group is copied; no warp reads s_begin / s_expected any more
    // The count and arrival slots are free for the next op on this set (published by the block's completion
    // below). Every arrival of a source with rows was awaited above; a source without rows sent none.
    if (warp == 0 && lane < ng * R) {
      const int i = i0 + lane / R * G, r = lane % R;
      counts[i * R + r] = 0;
      arrived[i * R + r] = 0;
    }
  }
  finish_receive<kShrink>(p.layout, p.peers.ll, p.set, k_ops, p.peers.rank, p.num_ranks, mask);
}

// Dynamic shared memory of a launch: the staged record and topk as int16 (send), the latter padded to whole int4
// words (count_in_topk reads them whole).
__host__ __device__ __forceinline__ size_t dispatch_smem_bytes(const LowLatencyDispatchParams& p) {
  const size_t topk_bytes = size_t(p.num_tokens) * p.num_topk * sizeof(int16_t);
  return size_t(record_of(p).bytes) + (topk_bytes + 15) / 16 * 16;
}

__global__ void __launch_bounds__(kThreads, 1)
    low_latency_dispatch_kernel(const __grid_constant__ LowLatencyDispatchParams p) {
  extern __shared__ __align__(16) uint8_t s_rec[];  // [staged record][topk as int16]
  int16_t* s_topk = reinterpret_cast<int16_t*>(s_rec + record_of(p).bytes);
  wait_prior_grids();  // before any memory access (runtime/low_latency_launch.cpp)
  allow_next_grid();
  const bool shrink = p.mask.words != nullptr, topk = p.recv_topk_slots != nullptr;
  if (!shrink) announce_receives(p.layout, p.peers.ll, p.peers.rank, p.num_ranks);
  if (p.phases & kLowLatencySend) {
    if (shrink)
      send_phase<true>(p, s_rec, s_topk);
    else
      send_phase<false>(p, s_rec, s_topk);
  }
  if (p.phases & kLowLatencyRecv) {
    const int recv_warps = (p.phases & kLowLatencySend) ? first_writer(p.num_ranks) : kWarps;
    if (shrink && topk)
      receive_phase<true, true>(p, recv_warps);
    else if (shrink)
      receive_phase<true, false>(p, recv_warps);
    else if (topk)
      receive_phase<false, true>(p, recv_warps);
    else
      receive_phase<false, false>(p, recv_warps);
  }
}

// Dynamic shared memory past the 48 KiB any kernel may take needs the kernel's limit raised first. Raised once per
// device to the largest size asked so far, not on every launch: the call is host time inside the op (it used to
// run on every launch, although the bench defaults take ~9 KiB). A failure shows in the caller's
// cudaGetLastError.
void allow_dispatch_smem(size_t smem) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  constexpr int kDevices = 64;
  static std::atomic<size_t> allowed[kDevices] = {};  // per device: the limit set so far (0: the default)
  static std::mutex raising;                          // the attribute is only raised, under this lock
  if (smem <= kDefaultLimit) return;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return;
  if (device < kDevices && allowed[device].load(std::memory_order_acquire) >= smem) return;
  std::lock_guard<std::mutex> lock(raising);
  if (device < kDevices && allowed[device].load(std::memory_order_relaxed) >= smem) return;
  if (cudaFuncSetAttribute(low_latency_dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) ==
          cudaSuccess &&
      device < kDevices)
    allowed[device].store(smem, std::memory_order_release);
}

}  // namespace

namespace EPX_LL_BUILD {

LowLatencyKernel dispatch_kernel(const LowLatencyDispatchParams& p) {
  const size_t smem = dispatch_smem_bytes(p);
  allow_dispatch_smem(smem);
  return LowLatencyKernel{reinterpret_cast<const void*>(low_latency_dispatch_kernel), kThreads, smem};
}

}  // namespace EPX_LL_BUILD
}  // namespace epx
