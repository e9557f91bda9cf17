// The intranode mode (one NVLink domain, semantics.md sections 2 and 3) and the layout: validation, kernel parameters,
// launches, and the bounded host wait for the counts. The public Buffer methods (runtime/buffer_ops.cpp) call these.
#include <cstdint>

#include "layout/intranode_params.hpp"
#include "runtime/buffer_impl.hpp"
#include "runtime/config.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/ops.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

RingLayout ring_for(const Buffer::Impl& b, const Config& c, int64_t record_bytes, const char* op) {
  const RingLayout ring{b.num_nvl_ranks, c.num_max_recv_tokens, record_bytes};
  const int64_t need = ring.bytes(num_channels(c));
  if (need > b.ring_bytes_available())
    raise(Status::kBufferTooSmall, op, ": num_nvl_bytes is ", b.ring_bytes_available(), " but this call needs ", need,
          " (", num_channels(c), " channels x ", ring.rings(), " rings x ", c.num_max_recv_tokens, " tokens x ",
          ring.stride(), " bytes per token); create the Buffer with at least that, e.g. from nvl_size_hint");
  return ring;
}

}  // namespace

namespace intranode {

// What every rank of one collective operation must agree on (see NotifyMsg::kSignature).
int op_signature(int op_kind, int64_t record_bytes, const Config& c) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t v : {uint64_t(op_kind), uint64_t(record_bytes), uint64_t(c.num_sms), uint64_t(c.num_max_recv_tokens)})
    h = (h ^ v) * 1099511628211ull;
  return int(h ^ (h >> 32));
}

void validate_handle(const DispatchHandle& h, const Buffer::Impl& b, const Config& c, int num_tokens, const char* op) {
  EPX_REQUIRE(h.num_ranks == b.num_ranks, op, ": the handle is for ", h.num_ranks, " ranks, the buffer has ",
              b.num_ranks);
  EPX_REQUIRE(h.num_channels == num_channels(c), op, ": the handle was made with ", h.num_channels,
              " channels (num_sms ", 2 * h.num_channels, "); use the same num_sms, got ", c.num_sms);
  EPX_REQUIRE(h.num_tokens == num_tokens, op, ": the handle is for ", h.num_tokens, " tokens, got ", num_tokens);
  EPX_REQUIRE(h.rank_prefix_matrix && h.channel_prefix_matrix && h.recv_channel_prefix_matrix, op,
              ": handle prefix matrices are null (was notify_dispatch called?)");
  EPX_REQUIRE(num_tokens == 0 || (h.send_head != nullptr && h.is_token_in_rank != nullptr), op,
              ": handle.send_head / is_token_in_rank are null");
}

}  // namespace intranode

void get_dispatch_layout(Buffer::Impl& b, const LayoutArgs& a, const LayoutOutputs& o, cudaStream_t stream,
                         const char* op) {
  EPX_REQUIRE(a.num_tokens >= 0, op, ": num_tokens must be >= 0, got ", a.num_tokens);
  EPX_REQUIRE(a.num_topk >= 1 && a.num_topk <= kMaxTopk, op, ": num_topk must be in [1, ", kMaxTopk, "], got ",
              a.num_topk);
  EPX_REQUIRE(a.num_experts > 0 && a.num_experts % b.num_ranks == 0 && a.num_experts <= kMaxExperts, op,
              ": num_experts (", a.num_experts, ") must be a positive multiple of the number of ranks (", b.num_ranks,
              ") and <= ", kMaxExperts);
  EPX_REQUIRE(a.num_tokens == 0 || a.topk_idx != nullptr, op, ": topk_idx is null");
  EPX_REQUIRE(o.num_tokens_per_rank && o.num_tokens_per_expert, op, ": output counts are null");
  EPX_REQUIRE(a.num_tokens == 0 || o.is_token_in_rank != nullptr, op, ": is_token_in_rank is null");
  EPX_REQUIRE(o.num_tokens_per_rdma_rank == nullptr || b.num_nvl_ranks < b.num_ranks, op,
              ": num_tokens_per_rdma_rank is only for ranks spanning several NVLink domains");
  LayoutParams p{};
  p.topk_idx = a.topk_idx;
  p.num_tokens = a.num_tokens;
  p.num_topk = a.num_topk;
  p.num_experts = a.num_experts;
  p.num_ranks = b.num_ranks;
  p.num_nvl_ranks = b.num_nvl_ranks;
  p.num_tokens_per_rank = o.num_tokens_per_rank;
  p.num_tokens_per_rdma_rank = o.num_tokens_per_rdma_rank;
  p.num_tokens_per_expert = o.num_tokens_per_expert;
  p.is_token_in_rank = o.is_token_in_rank;
  p.self = b.control();
  p.host = b.host_dev;
  launch_layout(p, b.num_device_sms, stream);
  b.check_launch(cudaGetLastError(), op);
}

namespace intranode {

NotifyParams dispatch_notify_params(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                    int signature, int recv_capacity, const char* op) {
  EPX_REQUIRE(h.rank_prefix_matrix && h.channel_prefix_matrix && h.recv_channel_prefix_matrix, op,
              ": handle arrays rank_prefix_matrix [R, R], channel_prefix_matrix and recv_channel_prefix_matrix [R, C]"
              " must be allocated by the caller");
  EPX_REQUIRE(a.num_tokens == 0 || h.send_head != nullptr, op, ": handle.send_head [num_tokens, R] must be allocated");
  h.num_ranks = b.num_ranks;
  h.num_channels = num_channels(c);
  h.num_tokens = a.num_tokens;
  h.num_recv_tokens = -1;
  h.is_token_in_rank = a.is_token_in_rank;

  NotifyParams p{};
  fill_notify_params(p, b, a, h.num_channels);
  p.barrier_only = 0;
  p.is_token_in_rank = a.is_token_in_rank;
  p.rank_prefix_matrix = h.rank_prefix_matrix;
  p.channel_prefix_matrix = h.channel_prefix_matrix;
  p.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  p.recv_capacity = recv_capacity;
  p.row_bound = a.num_worst_tokens;  // a hard bound, or none
  p.signature = signature;
  return p;
}

NotifyParams launch_dispatch_notify(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                    int signature, int recv_capacity, cudaStream_t stream, const char* op) {
  const NotifyParams p = dispatch_notify_params(b, a, c, h, signature, recv_capacity, op);
  launch_notify(p, stream);
  b.check_launch(cudaGetLastError(), op);
  return p;
}

namespace {

// The ring dispatch's signature. It tells worst-case mode (no host wait) from the rest: a rank that sized its outputs
// by a guess may need every rank to repeat the count exchange (kVerdictResize), which only a waiting host can do.
int dispatch_signature(const DispatchArgs& a, const Config& c) {
  return op_signature(kOpDispatch, dispatch_record(a).bytes ^ (int64_t(a.num_worst_tokens > 0) << 40), c);
}

// What a ring dispatch with a layout checks before it queues anything (notify_dispatch, dispatch_sized).
void check_dispatch_with_layout(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const char* op) {
  validate_config(c, b.num_nvl_ranks);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms (", c.num_sms, ") exceeds the device's ",
              b.num_device_sms, " SMs");
  validate_dispatch_args(a, b.num_ranks, false, op);
  ring_for(b, c, dispatch_record(a).bytes, op);
}

// After the host's wait for a notify: true when its verdict is kVerdictResize (some rank's rows exceed the outputs
// it sized by a guess; no rank's data kernel moved rows). Clears the verdict, as raise_if_input_error clears an
// error, so that the next operation's epoch barrier does not report it.
bool take_resize_verdict(Buffer::Impl& b, cudaStream_t stream) {
  volatile HostShared* host = b.host;
  if (host->op_error != kVerdictResize) return false;
  host->op_error = 0;
  cudaMemsetAsync(&b.control()->op_error, 0, sizeof(int32_t) * 2, stream);
  return true;
}

// Count exchanges one dispatch may repeat: a rank whose guess was too small repeats its own without a guess.
constexpr int kMaxCountExchanges = 4;

}  // namespace

DispatchCounts notify_dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                               cudaStream_t stream, const char* op) {
  check_dispatch_with_layout(b, a, c, op);
  if (a.num_worst_tokens == 0) b.require_not_capturing(stream, op);
  for (int exchange = 1;; ++exchange) {
    const NotifyParams p = launch_dispatch_notify(b, a, c, h, dispatch_signature(a, c), 0, stream, op);
    if (a.num_worst_tokens != 0) return DispatchCounts{};  // worst-case mode: not waited for
    b.wait_notify(p.host_seq, op, stream);
    if (!take_resize_verdict(b, stream)) return read_dispatch_counts(b, p.num_experts, h, stream, op);
    // A peer's guessed outputs were too small: every rank's data kernel skips, and every rank exchanges again.
    if (exchange == kMaxCountExchanges)
      raise(Status::kInternal, op, ": the count exchange was repeated ", exchange,
            " times because a rank's outputs sized by a guess were too small each time; a rank keeps guessing");
  }
}

}  // namespace intranode

namespace {

// The rows a dispatch's outputs need: num_worst_tokens in worst-case mode, else the counts the handle was given.
int dispatch_rows(const DispatchArgs& a, const DispatchHandle& h, const char* op) {
  const int rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : h.num_recv_tokens;
  EPX_REQUIRE(rows >= 0, op,
              ": the handle does not know how many tokens arrive (notify_dispatch not waited for);"
              " pass num_worst_tokens");
  return rows;
}

// The sender blocks of a sized ring dispatch start before their start word (kernels/intranode/early_senders.cuh): at
// exactly 2 ranks, unless $EPX_HT_EARLY_SENDERS=0 turned it off when the buffer was created.
bool early_senders(const Buffer::Impl& b) { return b.num_ranks == 2 && b.early_senders; }

// cached: the kernel runs the epoch barrier first (a cached dispatch has no notify in front of it). rows: what the
// outputs must hold. notify: the notify the grid runs as its last block (a sized dispatch), or null.
void launch_dispatch_data(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                          const DispatchOutputs& o, int rows, bool cached, cudaStream_t stream, const char* op,
                          const NotifyParams* notify = nullptr) {
  const DispatchRecord record = dispatch_record(a);
  const RingLayout ring = ring_for(b, c, record.bytes, op);
  check_dispatch_outputs(a, o, rows, h.recv_src_idx, ": handle.recv_src_idx [rows] must be allocated", op);
  DispatchParams p{};
  fill_dispatch_params(p, b, a, h, o, record.x_bytes);
  p.barrier = cached ? 1 : 0;
  p.signature = intranode::op_signature(intranode::kOpDispatch, record.bytes, c);
  p.ring = ring;
  p.record = record;
  p.num_send_chunk = dispatch_send_chunk(c, record.bytes, b.num_ranks);
  p.is_token_in_rank = h.is_token_in_rank;
  p.rank_prefix_matrix = h.rank_prefix_matrix;
  p.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  p.send_head = h.send_head;
  p.recv_src_idx = h.recv_src_idx;
  const int warps = wide_dispatch(p.num_ranks, p.x_int4) ? kWideDispatchWarps : kDataWarps;
  const DispatchSplit split =
      b.has_dispatch_split ? b.dispatch_split : default_dispatch_split(a.dtype == EPX_FP8_E4M3, warps);
  EPX_REQUIRE(split.self_sender_warps <= warps - 2 && split.ring_receiver_warps <= warps - 1, op,
              ": EPX_HT_DISPATCH_SPLIT ", split.self_sender_warps, ",", split.ring_receiver_warps, " does not fit the ",
              warps, "-warp blocks of this dispatch (S <= ", warps - 2, ", W <= ", warps - 1, ")");
  p.self_sender_warps = split.self_sender_warps;
  p.ring_receiver_warps = split.ring_receiver_warps;
  p.notify_block = notify != nullptr ? 1 : 0;
  p.early_senders = early_senders(b) && p.notify_block ? 1 : 0;
  launch_dispatch(p, notify != nullptr ? *notify : NotifyParams{}, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace

namespace intranode {

DispatchCounts dispatch_sized(Buffer::Impl& b, const DispatchArgs& a, const Config& c, DispatchHandle& h,
                              const DispatchOutputs& o, cudaStream_t stream, const char* op) {
  check_dispatch_with_layout(b, a, c, op);
  EPX_REQUIRE(o.num_rows >= 0 && o.num_rows < (1 << 30), op, ": outputs.num_rows must be in [0, 2^30), got ",
              o.num_rows);
  // Worst-case mode: num_worst_tokens rows, a hard bound, and no host wait; else the outputs' rows, a guess.
  const bool worst_case = a.num_worst_tokens > 0;
  const int rows = worst_case ? a.num_worst_tokens : o.num_rows;
  if (!worst_case) b.require_not_capturing(stream, op);
  // Every check of the data kernel's launch before the notify is queued: a rank must not leave its peers waiting.
  check_dispatch_outputs(a, o, rows, h.recv_src_idx, ": handle.recv_src_idx [rows] must be allocated", op);
  NotifyParams p = dispatch_notify_params(b, a, c, h, dispatch_signature(a, c), 0, op);
  if (!worst_case) p.row_bound = -(o.num_rows + 1);
  // The notify runs as the data grid's last block where the device has an SM for it beside the data blocks (and
  // $EPX_HT_SIZED_NOTIFY_KERNEL does not ask for a kernel of its own, which the data grid follows).
  const bool notify_block = !b.sized_notify_kernel && c.num_sms + 1 <= b.num_device_sms;
  if (!notify_block) {
    launch_notify(p, stream);
    b.check_launch(cudaGetLastError(), op);
  }
  launch_dispatch_data(b, a, c, h, o, rows, false, stream, op, notify_block ? &p : nullptr);
  if (worst_case) return DispatchCounts{};  // not waited for
  // The host waits for the counts only now, while the data kernel runs.
  b.wait_notify(p.host_seq, op, stream);
  if (take_resize_verdict(b, stream)) {
    DispatchCounts none;  // num_recv_tokens -1: the caller repeats the dispatch with notify_dispatch and dispatch
    return none;
  }
  return read_dispatch_counts(b, p.num_experts, h, stream, op);
}

void dispatch(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
              const DispatchOutputs& o, cudaStream_t stream, const char* op) {
  validate_config(c, b.num_nvl_ranks);
  validate_dispatch_args(a, b.num_ranks, false, op);
  validate_handle(h, b, c, a.num_tokens, op);
  launch_dispatch_data(b, a, c, h, o, dispatch_rows(a, h, op), false, stream, op);
}

void dispatch_cached(Buffer::Impl& b, const DispatchArgs& a, const Config& c, const DispatchHandle& h,
                     const DispatchOutputs& o, cudaStream_t stream, const char* op) {
  validate_config(c, b.num_nvl_ranks);
  validate_dispatch_args(a, b.num_ranks, true, op);
  validate_handle(h, b, c, a.num_tokens, op);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms exceeds the device's SMs");
  launch_dispatch_data(b, a, c, h, o, dispatch_rows(a, h, op), true, stream, op);
}

void combine(Buffer::Impl& b, const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
             cudaStream_t stream, const char* op) {
  EPX_REQUIRE(a.reduction == EPX_REDUCE_DEFAULT || a.reduction == EPX_REDUCE_FLAT, op,
              ": inside one NVLink domain combine sums in the flat order (EPX_REDUCE_DEFAULT or EPX_REDUCE_FLAT); "
              "the two-level order is the internode mode's, got reduction ",
              a.reduction);
  validate_config(c, b.num_nvl_ranks);
  EPX_REQUIRE(c.num_sms <= b.num_device_sms, op, ": config.num_sms exceeds the device's SMs");
  validate_handle(h, b, c, h.num_tokens, op);
  validate_combine_args(a, o, h.num_tokens, h.num_recv_tokens, op);
  const CombineRecord record = CombineRecord::make(a.hidden, a.num_topk);
  const RingLayout ring = ring_for(b, c, record.bytes, op);

  CombineParams p{};
  fill_combine_params(p, b, a, h, o);
  p.signature = op_signature(kOpCombine, record.bytes, c);  // the kernel runs the epoch barrier first
  p.ring = ring;
  p.record = record;
  p.num_send_chunk = c.num_max_send_tokens;
  p.x_int4 = int(record.x_bytes / 16);
  p.rank_prefix_matrix = h.rank_prefix_matrix;
  p.channel_prefix_matrix = h.channel_prefix_matrix;
  p.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix;
  p.send_head = h.send_head;
  launch_combine(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace intranode

void check_dispatch_outputs(const DispatchArgs& a, const DispatchOutputs& o, int rows, const void* src_rows,
                            const char* src_rows_missing, const char* op) {
  EPX_REQUIRE(o.num_rows >= rows, op, ": outputs have ", o.num_rows, " rows, need ", rows);
  if (rows > 0) {
    EPX_REQUIRE(o.recv_x != nullptr && aligned16(o.recv_x), op, ": recv_x must be a 16-byte aligned device pointer");
    EPX_REQUIRE(src_rows != nullptr, op, src_rows_missing);
    EPX_REQUIRE(a.dtype != EPX_FP8_E4M3 || o.recv_x_scales != nullptr, op, ": FP8 dispatch needs recv_x_scales");
    const uint64_t row = uint64_t(row_bytes(a.dtype, a.hidden));
    EPX_REQUIRE(!overlaps(a.x, a.num_tokens * row, o.recv_x, uint64_t(rows) * row), op,
                ": recv_x must not overlap x (the dispatch reads x while it writes recv_x)");
  }
}

DispatchCounts wait_dispatch_counts(Buffer::Impl& b, int host_seq, int num_experts, DispatchHandle& h,
                                    cudaStream_t stream, const char* op) {
  b.wait_notify(host_seq, op, stream);
  return read_dispatch_counts(b, num_experts, h, stream, op);
}

DispatchCounts read_dispatch_counts(Buffer::Impl& b, int num_experts, DispatchHandle& h, cudaStream_t stream,
                                    const char* op) {
  b.raise_if_input_error(op, stream);
  const volatile HostShared* host = b.host;
  DispatchCounts counts;
  counts.num_recv_tokens = host->num_recv_tokens;
  const int local_experts = num_experts / b.num_ranks;
  counts.num_recv_tokens_per_expert.resize(local_experts);
  for (int i = 0; i < local_experts; ++i) counts.num_recv_tokens_per_expert[i] = host->num_recv_tokens_per_expert[i];
  h.num_recv_tokens = counts.num_recv_tokens;
  return counts;
}

void launch_barrier(Buffer::Impl& b, int signature, cudaStream_t stream, const char* op) {
  NotifyParams p{};
  p.fail = b.fail_state();
  p.peers = b.peer_map;
  p.num_ranks = b.num_ranks;
  p.barrier_only = 1;
  p.signature = signature;
  launch_notify(p, stream);
  b.check_launch(cudaGetLastError(), op);
}

}  // namespace epx
