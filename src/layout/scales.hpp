// The FP8 scales of a high-throughput dispatch's input, as the kernels address them: num_scales 32-bit words per token
// at any element strides (row-major, column-major as grouped GEMMs keep them, or padded), read in place. Ring records
// and recv_x_scales hold them row-major. Built by the host runtime (runtime/intranode_ops.cpp, internode_ops.cpp)
// from the C ABI's strides; nothing else turns those strides into addresses.
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

// One token's scales: word g at words[g * stride].
struct ScaleRow {
  const int32_t* words;
  int64_t stride;
  EPX_HD const int32_t* at(int g) const { return words + g * stride; }
};

struct ScaleView {
  const int32_t* words;  // token 0, scale 0; null without scales
  int64_t token_stride;  // elements between tokens
  int64_t group_stride;  // elements between a token's scales
  EPX_HD ScaleRow token(int64_t t) const { return ScaleRow{words + t * token_stride, group_stride}; }
  // epx_dispatch_args' fields: strides 0 and 0 mean contiguous row-major (num_scales, 1).
  static ScaleView of(const float* x_scales, int num_scales, int64_t stride_token, int64_t stride_group) {
    if (stride_token == 0 && stride_group == 0) stride_token = num_scales, stride_group = 1;
    return ScaleView{reinterpret_cast<const int32_t*>(x_scales), stride_token, stride_group};
  }
};

}  // namespace epx
