// The output region of a dispatch into the buffer (semantics.md section 2, "Outputs in the buffer"): a part of
// every rank's NVLink buffer, options.num_recv_bytes long, right after the ring data, so at the same offset in every
// rank's buffer. The senders write each row, and its small fields, straight to its output row in the receiving
// rank's region; nothing is copied at the receiver. Host (sizes, the views it hands out) and device (addresses).
//
//   [ x: capacity rows of x_bytes | scales: capacity x num_scales f32 | src_idx: capacity int32 |
//     topk_idx: capacity x num_topk int64 | topk_weights: capacity x num_topk f32 ]   every array on kAlign
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

struct RecvRegion {
  int capacity;  // rows every array holds
  int64_t x_bytes;
  int num_scales;
  int num_topk;
  int64_t scale_offset;  // from the region's start; x is at 0
  int64_t src_offset;
  int64_t topk_offset;
  int64_t weight_offset;

  // Bytes of one row over all arrays, and the alignment slack of the four arrays after x.
  EPX_HD static int64_t row_bytes(int64_t x_bytes, int num_scales, int num_topk) {
    return x_bytes + int64_t(num_scales) * 4 + 4 + int64_t(num_topk) * 12;
  }
  EPX_HD static constexpr int64_t slack() { return 4 * kAlign; }
  // Bytes a region of `rows` rows needs.
  EPX_HD static int64_t bytes_for(int rows, int64_t x_bytes, int num_scales, int num_topk) {
    return int64_t(rows) * row_bytes(x_bytes, num_scales, num_topk) + slack();
  }
  // The layout of a region of region_bytes for rows of x_bytes (a multiple of 16) with these small fields: as
  // many rows as fit (capacity 0 when none does).
  EPX_HD static RecvRegion make(int64_t region_bytes, int64_t x_bytes, int num_scales, int num_topk) {
    RecvRegion r{};
    r.x_bytes = x_bytes;
    r.num_scales = num_scales;
    r.num_topk = num_topk;
    const int64_t fit =
        region_bytes > slack() ? (region_bytes - slack()) / row_bytes(x_bytes, num_scales, num_topk) : 0;
    r.capacity = fit > int64_t(0x7fffffff) ? 0x7fffffff : int(fit);
    const int64_t n = r.capacity;
    r.scale_offset = align_up(n * x_bytes, kAlign);
    r.src_offset = align_up(r.scale_offset + n * num_scales * 4, kAlign);
    r.topk_offset = align_up(r.src_offset + n * 4, kAlign);
    r.weight_offset = align_up(r.topk_offset + n * num_topk * 8, kAlign);
    return r;
  }
  // The end of the last array, from the region's start (<= region_bytes by construction).
  EPX_HD int64_t end() const { return weight_offset + int64_t(capacity) * num_topk * 4; }
};

}  // namespace epx
