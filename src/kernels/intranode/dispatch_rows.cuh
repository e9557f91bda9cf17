// What both intranode dispatch kernels (dispatch.cu through the rings, dispatch_in_buffer.cu into the buffer) do per
// token: its small fields as a destination's row carries them, and the 32-token windows of the token scan that
// every sending warp of a channel runs.
#pragma once

#include <cuda_runtime.h>

#include "device/ptx.cuh"
#include "device/warp.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// 16-byte loads in flight per lane in row copies (8 measured no faster for dispatch, slower for combine).
constexpr int kCopyUnroll = 4;

// Scale words a lane preloads (up to 128 scales, hidden 16384 in FP8); the rest are copied after the row.
constexpr int kScaleWordsPerLane = 4;

// The small fields of a record, loaded before the row so that their latency hides behind the row copy.
struct SmallFields {
  int32_t scale[kScaleWordsPerLane];
  int32_t src_idx;
  int32_t topk;    // lane k < K: (rebased) expert id
  int32_t weight;  // lane k < K: weight bits
};

// Token t's small fields as dest's record carries them: scales, top-k rebased to dest's local experts (-1 for
// the others) and their weights (0 there).
__device__ __forceinline__ SmallFields token_fields(const DispatchParams& p, int t, int dest, int lane) {
  SmallFields f{};
  const ScaleRow src_scales = p.x_scales.token(t);
#pragma unroll
  for (int j = 0; j < kScaleWordsPerLane; ++j)
    if (lane + 32 * j < p.num_scales) f.scale[j] = ld_nc(src_scales.at(lane + 32 * j));
  f.src_idx = t;
  if (lane < p.num_topk) {  // tokens exist here, so topk_idx is not null
    const int64_t e = ld_nc(p.topk_idx + int64_t(t) * p.num_topk + lane);
    const int64_t first = int64_t(dest) * p.experts_per_rank;
    f.topk = (e >= first && e < first + p.experts_per_rank) ? int(e - first) : -1;
    const float w = p.topk_weights != nullptr ? ld_nc(p.topk_weights + int64_t(t) * p.num_topk + lane) : 0.f;
    f.weight = __float_as_int(f.topk >= 0 ? w : 0.f);
  }
  return f;
}

// Writes a token's scales to dst (row-major): the preloaded ones from f, the rest from src_scales (load).
template <typename Load>
__device__ __forceinline__ void store_scales(const DispatchParams& p, int32_t* dst, const SmallFields& f,
                                             ScaleRow src_scales, int lane, Load load) {
#pragma unroll
  for (int j = 0; j < kScaleWordsPerLane; ++j)
    if (lane + 32 * j < p.num_scales) dst[lane + 32 * j] = f.scale[j];
  for (int i = lane + 32 * kScaleWordsPerLane; i < p.num_scales; i += 32) dst[i] = load(src_scales.at(i));
}

// One 32-token window of the token scan that the own-token copy, the coordinated senders and the in-buffer writers
// share: returns the mask of the window's tokens routed to rank `dest`. Every warp of a group scans every window (so
// all know every stream position); the window's owner (window % gwarps == gwarp) records send_head[t][dest] for its
// tokens: the token's stream position, or -position - 1 where it is not routed there.
__device__ __forceinline__ uint32_t scan_window(const DispatchParams& p, int cursor, int end, int window, int dest,
                                                int routed, int gwarp, int gwarps) {
  const int lane = threadIdx.x % 32, R = p.num_ranks;
  const int t = cursor + lane;
  const bool in = t < end && p.is_token_in_rank[int64_t(t) * R + dest];
  const uint32_t mask = __ballot_sync(kFullMask, in);
  if (window % gwarps == gwarp && t < end) {
    const int pos = routed + __popc(mask & lanemask_lt());
    p.send_head[int64_t(t) * R + dest] = in ? pos : -pos - 1;
  }
  return mask;
}

// The lanes of a scanned window (mask: its routed tokens, the first of them at stream position `routed`) whose token's
// position is warp gwarp's of gwarps (position % gwarps == gwarp): one remainder a lane a window, where testing each
// routed token in turn costs every warp of the group one remainder a token.
__device__ __forceinline__ uint32_t owned_lanes(uint32_t mask, int routed, int gwarp, int gwarps) {
  const int lane = threadIdx.x % 32;
  const int pos = routed + __popc(mask & lanemask_lt());
  return __ballot_sync(kFullMask, (mask >> lane & 1u) != 0 && pos % gwarps == gwarp);
}

// The stream position of lane l's routed token in a window (mask and routed as for owned_lanes).
__device__ __forceinline__ int window_position(uint32_t mask, int routed, int l) {
  return routed + __popc(mask & ((1u << l) - 1u));
}

}  // namespace
}  // namespace epx
