// High-throughput combine from the buffer (semantics.md section 3, "Inputs in the buffer"): every rank's expert
// outputs are rows of its output region (layout/recv_region.hpp, rows of hidden * 2 bytes), at the rows where a
// dispatch with this handle put the tokens; the token's source rank reads them there, through the peers' NVLink
// mappings and locally, and sums them. No ring, no sending warps.
//
// The kernel runs the epoch barrier first (start_operation): once it is through, every rank has finished the work it
// queued before this combine, so the rows are written; no rank writes a region again before the next operation's
// barrier, which waits for this kernel on every rank. Then every warp of the grid takes tokens round robin, the last
// partial round's tokens in steps (combine_in_buffer_kernel). For token t of channel c, rank j's row is where the
// dispatch's writer put it: the rows of the ranks before this one at j, this rank's rows of channels before c
// (rank_prefix_matrix, channel_prefix_matrix), then send_head[t][j]. The sum is reduce_row's: ascending rank order in
// float32, then the biases, one rounding.
#include <cuda_runtime.h>

#include "device/ptx.cuh"
#include "device/transport.cuh"
#include "device/warp.cuh"
#include "kernels/intranode/epoch_barrier.cuh"
#include "kernels/intranode/reduce_row.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// The 16-byte positions [begin, end) of token t's combined row, and its combined weights when `weights` (the part
// that starts the row). rank j's row is where the dispatch's writer put it: this rank's first row at j (`before`,
// lane j), this rank's rows of channels before t's (channel_prefix_matrix), then send_head[t][j].
template <int kRanks>
__device__ __forceinline__ void combine_token(const CombineParams& p, int t, int before, int per_channel, int begin,
                                              int end, bool weights, int lane) {
  const int R = p.num_ranks, C = p.num_channels;
  int row = -1;
  if (lane < R) {
    const int pos = p.send_head[int64_t(t) * R + lane];
    const int c = t / per_channel;
    if (pos >= 0) row = before + (c > 0 ? p.channel_prefix_matrix[lane * C + c - 1] : 0) + pos;
  }
  const uint32_t valid = __ballot_sync(kFullMask, row >= 0);
  const int4* rows[kRanks];
  int row_of[kRanks];
#pragma unroll
  for (int j = 0; j < kRanks; ++j) {
    row_of[j] = __shfl_sync(kFullMask, row, j);
    const uint8_t* region =
        j < R ? reinterpret_cast<const uint8_t*>(nvl_control(p.peers, j)) + p.region_offset : nullptr;
    rows[j] = (valid >> j) & 1u ? reinterpret_cast<const int4*>(region) + int64_t(row_of[j]) * p.x_int4 : nullptr;
  }
  // The weights first, so that row_of is dead before the row loop (registers).
  if (weights && p.combined_topk_weights != nullptr && lane < p.num_topk) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kRanks; ++j)
      if ((valid >> j) & 1u) {
        const uint8_t* region = reinterpret_cast<const uint8_t*>(nvl_control(p.peers, j)) + p.region_offset;
        const int32_t* w = reinterpret_cast<const int32_t*>(region + p.region.weight_offset);
        acc += __int_as_float(ld_cg(w + int64_t(row_of[j]) * p.num_topk + lane));
      }
    p.combined_topk_weights[int64_t(t) * p.num_topk + lane] = acc;
  }
  reduce_row<kRanks, 8 / kRanks>(p, t, rows, valid, lane, begin, end);
}

// kRanks: the rank count rounded up to 2, 4 or 8 (reduce_row's register arrays). Whole tokens go round robin over
// the grid's warps while every warp gets one; the tokens of the last, partial round are cut into whole 32-lane steps
// of reduce_row, and each warp takes an even share of those steps in order (a share may end in one token and go on in
// the next), so that the links stay busy to the end instead of a few warps finishing the last tokens alone. Every
// position is summed in the same order whoever takes it, so the result does not depend on the cut.
template <int kRanks>
__global__ void __launch_bounds__(kDataThreads, 1) combine_in_buffer_kernel(const __grid_constant__ CombineParams p) {
  if (!start_operation(p.fail, p.peers, p.num_ranks, true, p.signature)) return;  // every rank skips
  const int lane = threadIdx.x % 32, R = p.num_ranks, me = p.peers.rank;
  const int per_channel = ceil_div(p.num_tokens, p.num_channels);  // ChannelRange's tokens of a channel
  // Lane j < R: this rank's first row at rank j.
  const int before = lane < R && me > 0 ? p.rank_prefix_matrix[(me - 1) * R + lane] : 0;
  const int warps = gridDim.x * kDataWarps, warp = blockIdx.x * kDataWarps + threadIdx.x / 32;
  const int whole = p.num_tokens / warps * warps;  // tokens below whole go whole, the rest in steps
  const int step = 32 * 8 / kRanks;                // reduce_row's 16-byte positions per step of a warp
  const int steps = ceil_div(p.x_int4, step);      // a token's
  const int64_t tail = int64_t(p.num_tokens - whole) * steps;
  int64_t u = tail * warp / warps;  // this warp's steps of the tail: [u, end)
  const int64_t end = tail * (warp + 1) / warps;
  // One call site of combine_token (two would hold both inlined copies' registers).
  for (int next = warp;;) {
    int t, k, n;  // token t's steps [k, k + n)
    if (next < whole) {
      t = next, k = 0, n = steps;
      next += warps;
    } else if (u < end) {
      t = whole + int(u / steps), k = int(u % steps), n = end - u < steps - k ? int(end - u) : steps - k;
      u += n;
    } else {
      break;
    }
    combine_token<kRanks>(p, t, before, per_channel, k * step, min(p.x_int4, (k + n) * step), k == 0, lane);
  }
}

}  // namespace

void launch_combine_in_buffer(const CombineParams& p, cudaStream_t stream) {
  const int blocks = p.num_channels * 2;
  if (p.num_ranks <= 2)
    combine_in_buffer_kernel<2><<<blocks, kDataThreads, 0, stream>>>(p);
  else if (p.num_ranks <= 4)
    combine_in_buffer_kernel<4><<<blocks, kDataThreads, 0, stream>>>(p);
  else
    combine_in_buffer_kernel<8><<<blocks, kDataThreads, 0, stream>>>(p);
}

}  // namespace epx
