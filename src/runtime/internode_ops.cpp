// The internode (hierarchical) mode, semantics.md section 6: validation, ring geometry, kernel parameters, launches and
// the bounded host wait for the counts. The public Buffer methods (runtime/buffer_ops.cpp) call these for a buffer
// whose ranks span several NVLink domains (or that forces this mode). docs/internode.md describes the protocol.
#include <algorithm>
#include <cstdint>

#include "layout/internode_params.hpp"
#include "runtime/buffer_impl.hpp"
#include "runtime/config.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/ops.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

constexpr int kOpDispatch = 1, kOpCombine = 2;

// What every rank of one collective operation must agree on (the notify's signature).
int op_signature(int op_kind, int64_t record_bytes, const Config& c, int two_level) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t v : {uint64_t(op_kind), uint64_t(record_bytes), uint64_t(c.num_sms), uint64_t(c.num_max_recv_tokens),
                     uint64_t(c.num_max_rdma_send_tokens), uint64_t(c.num_max_rdma_recv_tokens), uint64_t(two_level)})
    h = (h ^ v) * 1099511628211ull;
  return int(h ^ (h >> 32));
}

// The network rings of one operation: the config's capacity, or as many slots as num_rdma_bytes holds (at least
// two steps).
NetRing net_ring(const Buffer::Impl& b, const Config& c, int64_t record_bytes, const char* op) {
  const int C = num_channels(c), D = b.num_domains, S = c.num_max_rdma_send_tokens;
  const int64_t stride = align_up(record_bytes, kAlign);
  const int64_t per_slot = int64_t(C) * D * 2 * stride;
  const int cap = int(std::min<int64_t>(c.num_max_rdma_recv_tokens, b.options.num_rdma_bytes / per_slot));
  if (cap < 2 * S)
    raise(Status::kBufferTooSmall, op, ": num_rdma_bytes is ", b.options.num_rdma_bytes, " but the network rings need ",
          per_slot * 2 * S, " at least (", C, " channels x ", D, " domains x send and receive halves x 2 x ", S,
          " records x ", stride, " bytes) and ", per_slot * c.num_max_rdma_recv_tokens,
          " for the config's capacity; create the Buffer with epx_config_internode_size_hints' rdma_bytes");
  return NetRing{D, cap, S, stride};
}

// The NVLink sub-rings of one operation (none are used when a domain has one GPU).
NvlSubRing nvl_ring(const Buffer::Impl& b, const Config& c, int64_t record_bytes, const char* op) {
  const int C = num_channels(c), G = b.num_nvl_ranks, D = b.num_domains;
  const int64_t stride = align_up(record_bytes, kAlign);
  if (G == 1) return NvlSubRing{G, D, 1, stride};
  const int64_t per_slot = int64_t(C) * G * D * stride;
  const int cap = int(std::min<int64_t>(c.num_max_recv_tokens / D, b.options.num_nvl_bytes / per_slot));
  if (cap < 1)
    raise(Status::kBufferTooSmall, op, ": num_nvl_bytes is ", b.options.num_nvl_bytes,
          " but the NVLink sub-rings need ", per_slot, " at least (", C, " channels x ", G, " ranks x ", D,
          " domains x ", stride, " bytes) and ", per_slot * (c.num_max_recv_tokens / D),
          " for the config's capacity; see epx_config_internode_size_hints");
  return NvlSubRing{G, D, cap, stride};
}

InternodeRecord dispatch_record_of(const DispatchArgs& a) {
  return InternodeRecord::make(row_bytes(a.dtype, a.hidden), a.dtype == EPX_FP8_E4M3 ? a.num_scales : 0, a.num_topk);
}

void check_config(const Buffer::Impl& b, const Config& c, const char* op) {
  validate_internode_config(c, b.num_nvl_ranks, b.num_domains);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms (", c.num_sms, ") exceeds the device's ",
              b.num_device_sms, " SMs");
}

InternodeHandleView view_of(const DispatchHandle& h) {
  InternodeHandleView v{};
  v.is_token_in_rank = h.is_token_in_rank;
  v.rdma_channel_prefix_matrix = h.rdma_channel_prefix_matrix;
  v.gbl_channel_prefix_matrix = h.channel_prefix_matrix;
  v.recv_rdma_channel_prefix_matrix = h.recv_rdma_channel_prefix_matrix;
  v.recv_rdma_rank_prefix_sum = h.recv_rdma_rank_prefix_sum;
  v.recv_gbl_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  v.recv_gbl_rank_prefix_sum = h.recv_gbl_rank_prefix_sum;
  v.recv_src_meta = h.recv_src_meta;
  v.send_rdma_head = h.send_rdma_head;
  v.send_nvl_head = h.send_nvl_head;
  return v;
}

// The prefix matrices a notify fills: the caller allocates them with the shapes of epx.h.
void require_matrices(const DispatchHandle& h, const char* op) {
  EPX_REQUIRE(
      h.channel_prefix_matrix && h.recv_channel_prefix_matrix && h.rdma_channel_prefix_matrix &&
          h.recv_rdma_channel_prefix_matrix && h.recv_rdma_rank_prefix_sum && h.recv_gbl_rank_prefix_sum,
      op,
      ": an internode handle needs channel_prefix_matrix and recv_channel_prefix_matrix [R, C], "
      "rdma_channel_prefix_matrix and recv_rdma_channel_prefix_matrix [D, C], recv_rdma_rank_prefix_sum [D] and "
      "recv_gbl_rank_prefix_sum [R], allocated by the caller");
}

void validate_handle(const DispatchHandle& h, const Buffer::Impl& b, const Config& c, int num_tokens, const char* op) {
  EPX_REQUIRE(h.num_ranks == b.num_ranks && h.num_domains == b.num_domains && h.num_nvl_ranks == b.num_nvl_ranks, op,
              ": the handle is for ", h.num_domains, " x ", h.num_nvl_ranks, " ranks, the buffer has ", b.num_domains,
              " x ", b.num_nvl_ranks, " (was it made by an internode dispatch of this buffer?)");
  EPX_REQUIRE(h.num_channels == num_channels(c), op, ": the handle was made with ", h.num_channels,
              " channels (num_sms ", 2 * h.num_channels, "); use the same num_sms, got ", c.num_sms);
  EPX_REQUIRE(h.num_tokens == num_tokens, op, ": the handle is for ", h.num_tokens, " tokens, got ", num_tokens);
  require_matrices(h, op);
  EPX_REQUIRE(num_tokens == 0 || (h.send_rdma_head != nullptr && h.is_token_in_rank != nullptr), op,
              ": handle.send_rdma_head [num_tokens, D] and is_token_in_rank are null");
}

// The internode notify with headers only: the two-phase handshake in front of cached dispatch and combine.
void launch_net_barrier(Buffer::Impl& b, int signature, cudaStream_t stream, const char* op) {
  InternodeNotifyParams p{};
  p.fail = b.fail_state();
  p.peers = b.peer_map;
  p.num_ranks = b.num_ranks;
  p.barrier_only = 1;
  p.num_channels = 1;
  p.signature = signature;
  launch_internode_notify(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

// The dispatch data kernel's parameters, every argument and the buffer's room checked: a call that fails here has
// launched nothing (the cached dispatch's barrier included), as for every argument error (semantics.md), so this
// rank's buffer is as before the call.
InternodeDispatchParams dispatch_data_params(const Buffer::Impl& b, const DispatchArgs& a, const Config& c,
                                             const DispatchHandle& h, const DispatchOutputs& o, const char* op) {
  const InternodeRecord record = dispatch_record_of(a);
  const int rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : h.num_recv_tokens;
  const int rdma_rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : h.num_rdma_recv_tokens;
  EPX_REQUIRE(rows >= 0 && rdma_rows >= 0, op,
              ": the handle does not know how many tokens arrive (notify_dispatch "
              "not waited for); pass num_worst_tokens");
  check_dispatch_outputs(a, o, rows, h.recv_src_meta, ": handle.recv_src_meta [rows, 2] must be allocated", op);
  EPX_REQUIRE(rdma_rows == 0 || h.send_nvl_head != nullptr, op,
              ": handle.send_nvl_head [num_rdma_recv_tokens, G] must be allocated");
  InternodeDispatchParams p{};
  fill_dispatch_params(p, b, a, h, o, record.x_bytes);
  p.ring = net_ring(b, c, record.bytes, op);
  p.nvl = nvl_ring(b, c, record.bytes, op);
  p.record = record;
  p.h = view_of(h);
  return p;
}

void launch_dispatch_data(Buffer::Impl& b, const InternodeDispatchParams& p, cudaStream_t stream, const char* op) {
  launch_internode_dispatch(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace

namespace internode {

DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op) {
  check_config(b, c, op);
  validate_dispatch_args(a, b.num_ranks, false, op);
  const InternodeRecord record = dispatch_record_of(a);
  net_ring(b, c, record.bytes, op);
  nvl_ring(b, c, record.bytes, op);
  require_matrices(h, op);
  EPX_REQUIRE(a.num_tokens == 0 || h.send_rdma_head != nullptr, op,
              ": handle.send_rdma_head [num_tokens, D] must be allocated");
  if (a.num_worst_tokens == 0) b.require_not_capturing(stream, op);
  h.num_ranks = b.num_ranks;
  h.num_channels = num_channels(c);
  h.num_tokens = a.num_tokens;
  h.num_recv_tokens = -1;
  h.num_rdma_recv_tokens = -1;
  h.num_domains = b.num_domains;
  h.num_nvl_ranks = b.num_nvl_ranks;
  h.is_token_in_rank = a.is_token_in_rank;

  InternodeNotifyParams p{};
  fill_notify_params(p, b, a, h.num_channels);
  p.num_worst_tokens = a.num_worst_tokens;
  p.h = view_of(h);
  p.signature = op_signature(kOpDispatch, record.bytes, c, 0);
  launch_internode_notify(p, stream);
  b.check_launch(cudaGetLastError(), op);
  if (a.num_worst_tokens != 0) return DispatchCounts{};  // worst-case mode: not waited for
  DispatchCounts counts = wait_dispatch_counts(b, p.host_seq, p.num_experts, h, stream, op);
  const volatile HostShared* host = b.host;
  counts.num_rdma_recv_tokens = host->num_rdma_recv_tokens;
  h.num_rdma_recv_tokens = counts.num_rdma_recv_tokens;
  return counts;
}

void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op) {
  check_config(b, c, op);
  validate_dispatch_args(a, b.num_ranks, false, op);
  validate_handle(h, b, c, a.num_tokens, op);
  launch_dispatch_data(b, dispatch_data_params(b, a, c, h, o, op), stream, op);
}

void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op) {
  check_config(b, c, op);
  validate_dispatch_args(a, b.num_ranks, true, op);
  validate_handle(h, b, c, a.num_tokens, op);
  const InternodeDispatchParams p = dispatch_data_params(b, a, c, h, o, op);
  launch_net_barrier(b, op_signature(kOpDispatch, p.record.bytes, c, 0), stream, op);
  launch_dispatch_data(b, p, stream, op);
}

void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op) {
  check_config(b, c, op);
  validate_handle(h, b, c, h.num_tokens, op);
  validate_combine_args(a, o, h.num_tokens, h.num_recv_tokens, op);
  EPX_REQUIRE(
      a.reduction == EPX_REDUCE_DEFAULT || a.reduction == EPX_REDUCE_FLAT || a.reduction == EPX_REDUCE_TWO_LEVEL, op,
      ": reduction must be EPX_REDUCE_DEFAULT (0), EPX_REDUCE_FLAT (1) or EPX_REDUCE_TWO_LEVEL (2), got ", a.reduction);
  EPX_REQUIRE(h.num_rdma_recv_tokens >= 0 || h.send_nvl_head != nullptr, op, ": handle.send_nvl_head is null");
  const int two_level = a.reduction != EPX_REDUCE_FLAT ? 1 : 0;
  const int G = b.num_nvl_ranks;
  InternodeCombineParams p{};
  fill_combine_params(p, b, a, h, o);
  p.net_record = CombineNetRecord::make(a.hidden, two_level ? 1 : G, G, a.num_topk);
  p.ring = net_ring(b, c, p.net_record.bytes, op);
  const CombineRecord nvl_record = CombineRecord::make(a.hidden, a.num_topk);
  p.nvl = nvl_ring(b, c, nvl_record.bytes, op);
  p.nvl_weight_offset = nvl_record.weight_offset;
  p.two_level = two_level;
  p.x_int4 = a.hidden * 2 / 16;
  p.h = view_of(h);
  launch_net_barrier(b, op_signature(kOpCombine, p.net_record.bytes, c, two_level), stream, op);
  launch_internode_combine(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace internode
}  // namespace epx
