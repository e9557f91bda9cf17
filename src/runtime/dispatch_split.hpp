// How the two blocks of an intranode dispatch channel share the work at 2 ranks (DispatchParams::self_sender_warps
// and ring_receiver_warps; kernels/intranode/dispatch.cu). The sender block's first warps write the peer's ring,
// its last sender warps copy this rank's own tokens; the receiver block's first warps read the peer's ring and
// the rest copy own tokens too. Pushing a row over NVLink costs a warp more time than copying one in local memory,
// so the defaults give the own-token copy warps of both blocks (docs/bench-notes.md has the sweep).
#pragma once

#include "layout/limits.hpp"

namespace epx {

struct DispatchSplit {
  int self_sender_warps = 0;                 // in [0, kDataWarps - 2]: the peer's group keeps one warp
  int ring_receiver_warps = kDataWarps / 2;  // in [1, kDataWarps - 1]
  bool operator==(const DispatchSplit& o) const {
    return self_sender_warps == o.self_sender_warps && ring_receiver_warps == o.ring_receiver_warps;
  }
};

// The default for rows of BF16 (fp8 false) or FP8 tokens in blocks of `warps` warps (kDataWarps, or
// kWideDispatchWarps: wide_dispatch in layout/limits.hpp): the best of a sweep on 2 x H200.
DispatchSplit default_dispatch_split(bool fp8, int warps = kDataWarps);

// The dispatch into the buffer (kernels/intranode/dispatch_in_buffer.cu): warps of each 24-warp block that write this
// rank's own rows; the others are shared equally by the peers. At 2 ranks it depends on the grid (num_sms blocks),
// from sweeps on 2 x H200 (docs/bench-notes.md); at more ranks an equal share per rank.
int default_in_buffer_self_warps(int num_ranks, int num_sms);

// $EPX_HT_IN_BUFFER_SELF_WARPS: that count for every dispatch into the buffer (tuning); null or empty: 0 (the
// default). Anything but an integer in [1, kDataWarps - 1] throws kInvalidArgument naming the variable.
int parse_in_buffer_self_warps(const char* value);

// $EPX_HT_DISPATCH_SPLIT: "S,W" sets both counts for every dispatch of the Buffer (tuning for another GPU); null
// or empty: *out untouched, false. Anything else throws kInvalidArgument naming the variable and the ranges.
bool parse_dispatch_split(const char* value, DispatchSplit* out);

}  // namespace epx
