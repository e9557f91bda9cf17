// How the high-throughput kernels (intranode and internode) split a rank's tokens over channels: channel c is the
// same contiguous range of every rank's tokens, so every stream of a channel is in token order.
#pragma once

#include "layout/limits.hpp"

namespace epx {

// Tokens [begin, end) of channel c when num_tokens are split over num_channels.
struct ChannelRange {
  int begin;
  int end;
  EPX_HD static ChannelRange of(int num_tokens, int num_channels, int channel) {
    const int per = ceil_div(num_tokens, num_channels);
    const int b = per * channel < num_tokens ? per * channel : num_tokens;
    const int e = b + per < num_tokens ? b + per : num_tokens;
    return {b, e};
  }
};

}  // namespace epx
