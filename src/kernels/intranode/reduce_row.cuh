// The combine's sum of one token's rows (semantics.md section 3), shared by the ring combine (combine.cu) and the
// combine from the buffer (combine_in_buffer.cu).
#pragma once

#include <cuda_runtime.h>

#include "device/bf16.cuh"
#include "device/ptx.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

using namespace dev;

// Sums the 16-byte positions [begin, n) of token t's rows from every rank in `valid` (ascending), then the biases;
// one rounding. kRanks is the rank count rounded up to 2, 4 or 8 (register arrays are sized by it); each lane
// handles kVectors 16-byte positions per step, so up to kVectors * kRanks loads are in flight and a row takes
// x_int4 / (32 * kVectors) dependent steps. n is at most x_int4 (a part of the row: begin > 0 or n < x_int4).
template <int kRanks, int kVectors>
__device__ __forceinline__ void reduce_row(const CombineParams& p, int t, const int4* const (&rows)[kRanks],
                                           uint32_t valid, int lane, int begin, int n) {
  const int64_t row = int64_t(t) * p.x_int4;
  int4* out = p.combined_x + row;
  const int4* b0 = p.bias0 != nullptr ? p.bias0 + row : nullptr;
  const int4* b1 = p.bias1 != nullptr ? p.bias1 + row : nullptr;
  for (int base = begin + lane; base < n; base += 32 * kVectors) {
    int4 v[kVectors][kRanks];
#pragma unroll
    for (int u = 0; u < kVectors; ++u)
#pragma unroll
      for (int j = 0; j < kRanks; ++j)
        if (((valid >> j) & 1u) && base + 32 * u < n) v[u][j] = ld_cg(rows[j] + base + 32 * u);
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int i = base + 32 * u;
      if (i >= n) break;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kRanks; ++j)
        if ((valid >> j) & 1u) add_bf16x8(acc, v[u][j]);
      if (b0 != nullptr) add_bf16x8(acc, ld_nc(b0 + i));
      if (b1 != nullptr) add_bf16x8(acc, ld_nc(b1 + i));
      st_na(out + i, pack_bf16x8(acc));
    }
  }
}

}  // namespace
}  // namespace epx
