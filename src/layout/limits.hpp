// Named limits of the library, each explained once. Host and device code include this.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPX_HD __host__ __device__ __forceinline__
#else
#define EPX_HD inline
#endif

namespace epx {

// Ranks inside one NVLink domain. A sender block gives every peer at least one warp, and a named barrier
// per peer (16 hardware barriers per block, id 0 kept for __syncthreads).
constexpr int kMaxNvlRanks = 8;
// Channels of the high-throughput kernels (num_sms / 2, config.cpp's num_channels).
constexpr int kMaxChannels = 64;
// Top-k slots per token: one lane per slot in the kernels.
constexpr int kMaxTopk = 32;
// Local experts per rank: sizes the count messages of notify and the host-mapped per-expert counters.
constexpr int kMaxLocalExperts = 1024;
// Experts in total: the layout kernel keeps one shared-memory counter per expert.
constexpr int kMaxExperts = 8192;
// NVLink domains of the internode mode (one lane per domain in its kernels' scans; one notify message per domain).
constexpr int kMaxDomains = 16;
// Ranks of a Buffer: every domain full (16 x 8).
constexpr int kMaxRanks = kMaxDomains * kMaxNvlRanks;
// Largest hidden size we accept (bytes of one row are bounded by the ring record size).
constexpr int kMaxHidden = 32768;
// FP8 scales are per group of this many elements (semantics.md section 2 and 4).
constexpr int kFp8GroupSize = 128;
// Every device region starts on this alignment; rows are moved in 16-byte vectors.
constexpr int64_t kAlign = 128;
// Threads of a high-throughput data block: 24 warps, enough loads in flight per SM to saturate NVLink.
constexpr int kDataThreads = 768;
constexpr int kDataWarps = kDataThreads / 32;
// The 2-rank dispatch's blocks when its rows are a whole number of its copy rounds (wide_dispatch): 20 warps, so up
// to 96 registers each, every lane with 7 x 16 bytes in flight per round (7 divides a 7168-hidden row in BF16, 28
// vectors per lane, and in FP8, 14). Measured against 24 warps with 4 in flight on 2 x H200 (docs/bench-notes.md,
// eighth session, call 5).
constexpr int kWideDispatchWarps = 20;
constexpr int kWideDispatchUnroll = 7;
// Whether a dispatch at num_ranks ranks of rows of x_int4 16-byte vectors runs in the wide blocks.
EPX_HD constexpr bool wide_dispatch(int num_ranks, int64_t x_int4) {
  return num_ranks == 2 && x_int4 % (32 * kWideDispatchUnroll) == 0;
}
// Default wait budget (semantics.md section 7).
constexpr double kDefaultTimeoutSeconds = 100.0;
// Budget of a low-latency wait for one rank under rank masking (enable_shrink) before the rank is masked.
constexpr double kDefaultShrinkTimeoutSeconds = 1.0;

EPX_HD constexpr int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
EPX_HD constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace epx
