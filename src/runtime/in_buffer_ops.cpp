// The operations whose data lives in the output region of the NVLink buffer (layout/recv_region.hpp; semantics.md
// sections 2 and 3): the dispatch into the buffer and the combine from it, inside one NVLink domain.
#include <cstdint>

#include "layout/intranode_params.hpp"
#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/ops.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

// The region's layout for rows of x_bytes with these small fields; kBufferTooSmall when no row fits.
RecvRegion region_of(const Buffer::Impl& b, int64_t x_bytes, int num_scales, int num_topk, const char* op) {
  const RecvRegion region = RecvRegion::make(b.options.num_recv_bytes, x_bytes, num_scales, num_topk);
  if (region.capacity == 0)
    raise(Status::kBufferTooSmall, op, ": the buffer's output region (num_recv_bytes ", b.options.num_recv_bytes,
          ") holds no row of this shape; create the Buffer with num_recv_bytes from recv_region_size_hint");
  return region;
}

// This rank's arrays of the region, as the caller sees them (null where the shape has none).
RecvRegionViews views_of(const Buffer::Impl& b, const RecvRegion& region) {
  uint8_t* base = static_cast<uint8_t*>(b.local) + b.recv_offset;
  RecvRegionViews v{};
  v.recv_x = base;
  v.recv_x_scales = region.num_scales > 0 ? reinterpret_cast<float*>(base + region.scale_offset) : nullptr;
  v.recv_topk_idx = region.num_topk > 0 ? reinterpret_cast<int64_t*>(base + region.topk_offset) : nullptr;
  v.recv_topk_weights = region.num_topk > 0 ? reinterpret_cast<float*>(base + region.weight_offset) : nullptr;
  v.recv_src_idx = reinterpret_cast<int*>(base + region.src_offset);
  v.capacity = region.capacity;
  return v;
}

}  // namespace

namespace intranode {

DispatchCounts dispatch_in_buffer(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                  bool cached, RecvRegionViews& views, cudaStream_t stream, const char* op) {
  validate_config(c, b.num_nvl_ranks);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms (", c.num_sms, ") exceeds the device's ",
              b.num_device_sms, " SMs");
  validate_dispatch_args(a, b.num_ranks, cached, op);
  const DispatchRecord record = dispatch_record(a);
  const RecvRegion region = region_of(b, record.x_bytes, a.dtype == EPX_FP8_E4M3 ? a.num_scales : 0, a.num_topk, op);
  if (a.num_worst_tokens > region.capacity)
    raise(Status::kBufferTooSmall, op, ": num_worst_tokens (", a.num_worst_tokens, ") exceeds the ", region.capacity,
          " rows the output region (num_recv_bytes ", b.options.num_recv_bytes, ") holds of this shape");
  // Every rank must agree on the region's rows as well: they place each other's rows.
  const int signature = op_signature(kOpDispatchInBuffer, record.bytes ^ (int64_t(region.capacity) << 24), c);
  if (cached) {
    validate_handle(h, b, c, a.num_tokens, op);
    EPX_REQUIRE(h.num_recv_tokens <= region.capacity, op, ": the handle's ", h.num_recv_tokens, " rows exceed the ",
                region.capacity, " the output region holds of this shape");
    EPX_REQUIRE(a.num_worst_tokens > 0 || h.num_recv_tokens >= 0, op,
                ": the handle does not know how many tokens arrive (made in worst-case mode); pass num_worst_tokens");
  }

  if (!cached && a.num_worst_tokens == 0) b.require_not_capturing(stream, op);
  views = views_of(b, region);
  // The notify runs as the data grid's last block where the device has an SM for it beside the data blocks (and
  // $EPX_HT_IN_BUFFER_NOTIFY_KERNEL does not ask for a kernel of its own, which the data grid follows).
  const bool notify_block = !cached && !b.in_buffer_notify_kernel && c.num_sms + 1 <= b.num_device_sms;
  NotifyParams notify{};  // what the host waits for (no notify for a cached dispatch)
  if (!cached) {
    notify = notify_block ? dispatch_notify_params(b, a, c, h, signature, region.capacity, op)
                          : launch_dispatch_notify(b, a, c, h, signature, region.capacity, stream, op);
    h.recv_src_idx = views.recv_src_idx;
  }

  DispatchOutputs none{};
  DispatchParams p{};
  fill_dispatch_params(p, b, a, h, none, record.x_bytes);
  p.barrier = cached ? 1 : 0;
  p.signature = signature;
  p.record = record;
  p.is_token_in_rank = h.is_token_in_rank;
  p.rank_prefix_matrix = h.rank_prefix_matrix;
  p.channel_prefix_matrix = h.channel_prefix_matrix;
  p.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  p.send_head = h.send_head;
  p.region_offset = b.recv_offset;
  p.region = region;
  p.in_buffer_self_warps =
      b.in_buffer_self_warps > 0 ? b.in_buffer_self_warps : default_in_buffer_self_warps(b.num_ranks, c.num_sms);
  EPX_REQUIRE(
      b.num_ranks == 1 || (p.in_buffer_self_warps >= 1 && kDataWarps - p.in_buffer_self_warps >= b.num_ranks - 1), op,
      ": EPX_HT_IN_BUFFER_SELF_WARPS ", p.in_buffer_self_warps, " leaves no warp for a peer (", kDataWarps,
      " warps a block, ", b.num_ranks - 1, " peers)");
  p.notify_block = notify_block ? 1 : 0;
  launch_dispatch_in_buffer(p, notify, stream);
  b.check_launch(cudaGetLastError(), op);
  // The host waits for the counts only now, while the data kernel runs (worst-case mode: not at all).
  if (cached || a.num_worst_tokens != 0) return DispatchCounts{};
  return wait_dispatch_counts(b, notify.host_seq, notify.num_experts, h, stream, op);
}

RecvRegionViews combine_region(const Buffer::Impl& b, int hidden, int num_topk, const char* op) {
  validate_bf16_hidden(hidden, op);
  EPX_REQUIRE(num_topk >= 0 && num_topk <= kMaxTopk, op, ": num_topk must be in [0, ", kMaxTopk, "], got ", num_topk);
  RecvRegionViews v = views_of(b, region_of(b, int64_t(hidden) * 2, 0, num_topk, op));
  v.recv_x_scales = nullptr;
  v.recv_topk_idx = nullptr;
  v.recv_src_idx = nullptr;  // the combine's arrays: rows and weights
  return v;
}

void combine_in_buffer(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h,
                       const CombineOutputs& o, cudaStream_t stream, const char* op) {
  EPX_REQUIRE(a.reduction == EPX_REDUCE_DEFAULT || a.reduction == EPX_REDUCE_FLAT, op,
              ": inside one NVLink domain combine sums in the flat order (EPX_REDUCE_DEFAULT or EPX_REDUCE_FLAT), "
              "got reduction ",
              a.reduction);
  validate_config(c, b.num_nvl_ranks);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms exceeds the device's SMs");
  validate_handle(h, b, c, h.num_tokens, op);
  validate_combine_args(a, o, h.num_tokens, h.num_recv_tokens, op);
  const RecvRegion region = region_of(b, int64_t(a.hidden) * 2, 0, a.num_topk, op);
  const RecvRegionViews views = views_of(b, region);
  EPX_REQUIRE(a.x == views.recv_x && (a.num_topk == 0 || a.topk_weights == views.recv_topk_weights), op,
              ": x and topk_weights must be the views of the output region that combine_region gives for this hidden "
              "size and num_topk (every rank's rows are read where its views are)");
  EPX_REQUIRE(a.num_rows <= region.capacity, op, ": ", a.num_rows, " rows exceed the ", region.capacity,
              " the output region holds of this shape");

  CombineParams p{};
  fill_combine_params(p, b, a, h, o);
  // Every rank must agree on the rows' layout in the regions as well.
  p.signature = op_signature(kOpCombineInBuffer,
                             CombineRecord::make(a.hidden, a.num_topk).bytes ^ (int64_t(region.capacity) << 24), c);
  p.x_int4 = int(int64_t(a.hidden) * 2 / 16);
  p.rank_prefix_matrix = h.rank_prefix_matrix;
  p.channel_prefix_matrix = h.channel_prefix_matrix;
  p.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  p.send_head = h.send_head;
  p.region_offset = b.recv_offset;
  p.region = region;
  launch_combine_in_buffer(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace intranode
}  // namespace epx
