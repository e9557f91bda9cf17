// Low-latency dispatch (SPEC section 4): no count exchange before the data, fixed-size receive areas.
//
// Send phase: block b stages tokens b, b+G, ... in shared memory (quantized to FP8 if asked), then sends the
// token once to each rank that holds one of its experts (not once per expert): into that rank's records at
// [this rank][token] (kWarps / R warps per destination, each writing part of the record), and for each slot
// (t, k) the token index into the rank's row map at (local expert, this rank, position of (t, k) among this
// rank's selections of that expert in (t, k) order): rows keep token order with no atomics. Each writer warp
// bumps a local per-expert counter for every slot of the token at its rank; the warp that owns expert e waits for all of its
// selections and sends count + 1 to e's rank. Before writing into a rank's set, a warp waits (a local poll)
// until that rank has received every earlier op on the set (the set's epochs, runtime/ll_layout.hpp; once per
// rank and warp). Writes into other ranks go through kernels/ll_transport.cuh (peer pointer or NVSHMEM); with
// NVSHMEM peers the staged record is also copied to symmetric memory, where puts can read it.
// Receive phase: the block owning a local expert waits for all ranks' counts, lays the rows out by source
// rank ascending, reads each row's source token from the row map (all at once, into shared memory), copies the
// rows from the records into the packed outputs (FP8 scales token-minor) in work items of one load round
// each, spread over all warps, and clears its count slots; every block then adds its completion to every
// rank's epoch counter (recv_seen), which (once all blocks have) lets the next op on this set write here. The
// receive phase is a function of its own (__noinline__, the parameters __grid_constant__), so that its
// registers do not add to the send phase's.
#include <cuda_runtime.h>

#include "device/fp8.cuh"
#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/wait.cuh"
#include "device/warp_copy.cuh"
#include "kernels/ll_epochs.cuh"
#include "kernels/ll_params.hpp"
#include "kernels/ll_transport.cuh"

namespace epx {
namespace {

using namespace dev;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kFullMask = 0xffffffffu;

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The block's copy of topk_idx as int16 in shared memory (indices outside [-1, E) become -2, which no expert
// matches), so that the scans below cost shared-memory latency instead of one L2 round trip per 32 entries.
__device__ void load_topk(const LowLatencyDispatchParams& p, int16_t* s_topk) {
  for (int i = threadIdx.x; i < p.num_tokens * p.num_topk; i += kThreads) {
    const int64_t e = p.topk_idx[i];
    s_topk[i] = int16_t(e >= -1 && e < p.num_experts ? e : -2);
  }
}

// Selections of expert e before slot (t, k), in (token, slot) order: the row's position in its block.
__device__ int position_of(const int16_t* s_topk, int t, int k, int num_topk, int e, int lane) {
  int n = 0;
  for (int i = lane; i < t * num_topk + k; i += 32) n += s_topk[i] == e ? 1 : 0;
  return warp_sum(n);
}

__device__ int selections_of(const int16_t* s_topk, int num_entries, int e, int lane) {
  int n = 0;
  for (int i = lane; i < num_entries; i += 32) n += s_topk[i] == e ? 1 : 0;
  return warp_sum(n);
}

// The top-k slots whose row map entries record-writer part `part` of `parts` writes: k = part, part + parts, ...
__device__ __forceinline__ uint32_t slots_of_part(int part, int parts) {
  uint32_t m = 0;
  for (int k = part; k < 32; k += parts) m |= 1u << k;
  return m;
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
      const uint2 raw = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(src) + g * kFp8GroupSize + lane * 4);
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
}

// Token t's record in symmetric memory, the source of NVSHMEM puts.
__device__ __forceinline__ int4* staged_record(const LowLatencyDispatchParams& p, const LowLatencyRecord& rec, int t) {
  return reinterpret_cast<int4*>(p.layout.dispatch_stage(p.peers.local, p.set) + int64_t(t) * rec.bytes);
}

__device__ void send_phase(const LowLatencyDispatchParams& p, uint8_t* s_rec, int16_t* s_topk) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens, K = p.num_topk, me = p.env.rank;
  const int L = p.num_experts / R;
  const LowLatencyRecord rec = LowLatencyRecord::make(p.hidden, p.fp8 != 0);
  int32_t* sent = p.layout.sent(p.peers.local, p.set);
  const uint64_t* recv_seen = p.layout.recv_seen(p.peers.local, p.set);
  // Earlier ops on this set, of either kind: every peer must have received them before this one writes there.
  // This block's receive count on the set (kernels/ll_epochs.cuh), written by an earlier kernel.
  const uint32_t k_ops = ops_before(p.layout, p.peers, p.set);
  // Addresses in this rank's region name the same offsets in every peer's region (kernels/ll_transport.cuh).
  load_topk(p, s_topk);  // made visible by the __syncthreads after staging

  // Addresses of this rank's map, naming the same offsets at every peer.
  int32_t* row_map = p.layout.dispatch_row_map(p.peers.local, p.set, R, M, rec.bytes);
  ReadyRanks ready;  // lane 0's
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    stage_token(p, rec, t, s_rec);
    __syncthreads();
    if (uses_nvshmem(p.peers)) {  // NVSHMEM puts read their source from symmetric memory: a copy there
      int4* staged = staged_record(p, rec, t);
      for (int i = threadIdx.x; i < int(rec.bytes / 16); i += kThreads)
        staged[i] = reinterpret_cast<const int4*>(s_rec)[i];
      __threadfence();  // before any warp of the block hands the record to NVSHMEM
      __syncthreads();
    }
    // Warp roles per token: kWarps / R warps per destination rank d (record writers), each writing a contiguous
    // part of the record once if the token has an expert at d; the part-p warp also writes the row map entries
    // of the token's slots k = p, p + parts, ... that are at d.
    const int parts = kWarps / R, d = warp / parts, part = warp % parts;
    if (warp == 0 && lane < K && s_topk[t * K + lane] == -2)  // skipped, never written: Buffer::check()
      report_input_error(p.env.self, p.env.host, kErrTopkOutOfRange, kRoleLowLatencySend, t, lane,
                         p.topk_idx[int64_t(t) * K + lane]);
    if (d < R) {
      const int e = lane < K ? int(s_topk[t * K + lane]) : -1;  // lane k holds slot k's expert
      const bool here = e >= d * L && e < (d + 1) * L;          // -1 and -2 are at no rank
      const uint32_t at_d = __ballot_sync(kFullMask, here);
      if (at_d != 0) {
        // Back-pressure: d has received every earlier op on this set (its blocks add their completions here
        // after copying), so nothing is overwritten while a slow peer still reads it. A local poll, once per rank and
        // op for this warp (later tokens rely on that acquire); pairs with d's release at the end of its
        // receive phase (finish_receive).
        if (lane == 0)
          wait_rank_ready(ready, recv_seen, d, k_ops, p.env, WaitSite{kRoleLowLatencySend, -1, d, -1});
        __syncwarp();
        int4* dst = reinterpret_cast<int4*>(p.layout.dispatch_records(p.peers.local, p.set) +
                                            (int64_t(me) * M + t) * rec.bytes);
        const int4* src = has_peer_pointer(p.peers, d) ? reinterpret_cast<const int4*>(s_rec) : staged_record(p, rec, t);
        const int n = int(rec.bytes / 16), first = n * part / parts, last = n * (part + 1) / parts;
        // On return this lane's part of the record is written (peer pointer) or complete at d (NVSHMEM).
        put_warp<2>(p.peers, d, dst + first, src + first, last - first, lane, [](const int4* q) { return *q; });
        for (uint32_t mine = at_d & slots_of_part(part, parts); mine != 0; mine &= mine - 1) {
          const int k = __ffs(mine) - 1;  // the same k in every lane: position_of is warp-collective
          const int ek = __shfl_sync(kFullMask, e, k);
          const int slot = position_of(s_topk, t, k, K, ek, lane);
          if (lane == 0 && slot < M)
            put_int(p.peers, d, row_map + (int64_t(ek % L) * R + me) * M + slot, t);
          else if (lane == 0)  // only with an expert listed twice in a token: M rows per expert and source at most
            report_input_error(p.env.self, p.env.host, kErrExpertRowsExceeded, kRoleLowLatencySend, ek, slot + 1, M);
        }
        __syncwarp();  // every lane's part and the map entries are written before the releases below
        // One per part and slot: the count sender of slot k's expert acquires it, then its signal (a release)
        // publishes the record and the map entry too.
        if (here) atomic_add_release_gpu(&sent[e], 1);
      }
    }
    __syncthreads();  // the staged record is free again
  }

  // Count senders: warp (block b, warp w) owns experts b * kWarps + w, stride G * kWarps.
  __syncthreads();  // s_topk is complete even if this block staged no token
  for (int e = blockIdx.x * kWarps + warp; e < p.num_experts; e += gridDim.x * kWarps) {
    const int expected = selections_of(s_topk, p.num_tokens * K, e, lane);
    if (lane == 0) {
      if (expected > 0)  // every part of every row
        wait_at_least_i32(&sent[e], expected * (kWarps / R), p.env, WaitSite{kRoleLowLatencySend, -1, int(e / L), e});
      sent[e] = 0;  // only this warp reads it; the next op on this set starts in a later kernel
      const int dest = e / L;
      int32_t* count = p.layout.dispatch_count(p.peers.local, p.set) + (e % L) * R + me;
      if (expected == 0)  // no row went there, so no token warp waited for the slot to be free
        wait_rank_ready(ready, recv_seen, dest, k_ops, p.env, WaitSite{kRoleLowLatencySend, -1, dest, e});
      // The acquire above saw every part announced; this release publishes them. Pairs with the receiver's
      // wait_nonzero. Rows beyond M were not sent (an input error the writer reported).
      signal(p.peers, dest, count, min(expected, M) + 1);
    }
  }
}

constexpr int kChunk = kCopyItemInt4;  // int4 per receive work item (kernels/ll_transport.cuh)

// The scales (FP8, token-minor) of row n of local expert i, from its record at src, and its source token index:
// every load issued before the first store, so the item costs one load latency.
__device__ __forceinline__ void copy_row_meta(const LowLatencyDispatchParams& p, const uint8_t* src, int i, int n,
                                              int token, int lane) {
  const LowLatencyRecord rec = LowLatencyRecord::make(p.hidden, p.fp8 != 0);
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
                              uint32_t(ue8m0_of(__int_as_float(v.z))) << 16 | uint32_t(ue8m0_of(__int_as_float(v.w))) << 24;
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

// s_source: window_rows ints of shared memory (the send phase's staging area, free by now): per row of the
// window, its source rank << 24 | its source token.
__device__ __noinline__ void receive_phase(const LowLatencyDispatchParams& p, int* s_source, int window_rows) {
  __shared__ int s_begin[kMaxNvlRanks + 1];
  __syncthreads();  // the send phase before this one (same launch) no longer reads the staging area
  const uint32_t k_ops = ops_before(p.layout, p.peers, p.set);  // the send phase's too (same block, same op)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.num_ranks, M = p.max_tokens;
  const int L = p.num_experts / R;
  const LowLatencyRecord rec = LowLatencyRecord::make(p.hidden, p.fp8 != 0);
  const int64_t rows_per_expert = int64_t(R) * M;
  const uint8_t* records = p.layout.dispatch_records(p.peers.local, p.set);
  const int32_t* row_map = p.layout.dispatch_row_map(p.peers.local, p.set, R, M, rec.bytes);
  const int row_int4 = int(rec.row_bytes / 16);
  const int chunks = (row_int4 + kChunk - 1) / kChunk, items = chunks + 1;

  for (int i = blockIdx.x; i < L; i += gridDim.x) {
    if (warp == 0) {
      int count = 0;
      if (lane < R) {
        int32_t* c = p.layout.dispatch_count(p.peers.local, p.set) + i * R + lane;
        count = wait_nonzero(c, p.env, WaitSite{kRoleLowLatencyRecv, -1, lane, i}) - 1;  // pairs with the sender
      }
      int incl = count;  // inclusive scan over source ranks
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += v;
      }
      if (lane < R) {
        s_begin[lane] = incl - count;
        p.recv_layout_range[int64_t(i) * R + lane] = (int64_t(incl - count) << 32) | int64_t(count);
      }
      const int total = __shfl_sync(kFullMask, incl, R - 1);
      if (lane == 0) {
        s_begin[R] = total;
        p.packed_recv_count[i] = total;
        if (p.cumulative_stats != nullptr) p.cumulative_stats[i] += total;
      }
    }
    __syncthreads();  // warp 0's acquires of the counts now order every thread's loads below
    const int total = s_begin[R];
    // Rows of expert i are numbered by (source, slot). A window of window_rows of them at a time (one for any
    // realistic shape): first every row's source token from the row map, all loads at once, then work items
    // of kChunk int4 per row (one round of loads per lane each) plus one for the row's scales and source token,
    // spread over all warps.
    for (int w0 = 0; w0 < total; w0 += window_rows) {
      const int rows = min(window_rows, total - w0);
      for (int n = threadIdx.x; n < rows; n += kThreads) {
        int s = 0;
        while (w0 + n >= s_begin[s + 1]) ++s;
        s_source[n] = s << 24 | ld_cg(row_map + (int64_t(i) * R + s) * M + (w0 + n - s_begin[s]));  // token < M
      }
      __syncthreads();
      for (int w = warp; w < rows * items; w += kWarps) {
        const int n = w / items, c = w % items;
        // The token is below M unless a sender broke the protocol (or the receive call named another shape);
        // clamped, so that even then every read stays inside the records.
        const int source = s_source[n], token = min(source & 0xffffff, M - 1);
        const uint8_t* src = records + (int64_t(source >> 24) * M + token) * rec.bytes;
        const int64_t row = int64_t(i) * rows_per_expert + w0 + n;
        if (c < chunks) {
          const int first = c * kChunk;
          warp_copy_once<kChunk / 32>(static_cast<int4*>(p.packed_recv_x) + row * row_int4 + first,
                                      reinterpret_cast<const int4*>(src) + first, min(kChunk, row_int4 - first),
                                      lane, LoadCg{}, StoreNa{});
        } else {
          copy_row_meta(p, src, i, w0 + n, token, lane);
        }
      }
      __syncthreads();  // the window's sources are rewritten next
    }
    __syncthreads();  // every row of expert i is copied and every warp has read s_begin (none if no rows)
    // The count slots are free for the next op on this set (published by the block's completion below).
    if (warp == 0 && lane < R) p.layout.dispatch_count(p.peers.local, p.set)[i * R + lane] = 0;
  }
  finish_receive(p.layout, p.peers, p.set, k_ops, p.env.rank, p.num_ranks);
}

// Dynamic shared memory of a launch: the staged record and topk as int16 (send), the row window (receive).
__host__ __device__ __forceinline__ size_t dispatch_smem_bytes(const LowLatencyDispatchParams& p) {
  return size_t(LowLatencyRecord::make(p.hidden, p.fp8 != 0).bytes) + size_t(p.num_tokens) * p.num_topk * sizeof(int16_t);
}

__global__ void __launch_bounds__(kThreads, 1) low_latency_dispatch_kernel(const __grid_constant__ LowLatencyDispatchParams p) {
  extern __shared__ __align__(16) uint8_t s_rec[];  // [staged record][topk as int16]
  int16_t* s_topk = reinterpret_cast<int16_t*>(s_rec + LowLatencyRecord::make(p.hidden, p.fp8 != 0).bytes);
  if (p.phases & kLowLatencySend) send_phase(p, s_rec, s_topk);
  if (p.phases & kLowLatencyRecv) receive_phase(p, reinterpret_cast<int*>(s_rec), int(dispatch_smem_bytes(p) / sizeof(int)));
}

}  // namespace

int low_latency_grid(int num_device_sms) { return num_device_sms; }

void launch_low_latency_dispatch(const LowLatencyDispatchParams& p, int grid, cudaStream_t stream) {
  const size_t smem = dispatch_smem_bytes(p);
  cudaFuncSetAttribute(low_latency_dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // waits across blocks: every block must be resident
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, low_latency_dispatch_kernel, p);
}

}  // namespace epx
