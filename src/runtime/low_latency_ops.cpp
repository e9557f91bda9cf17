// The low-latency mode (semantics.md sections 4 and 5): validation, buffer-set alternation, launches. No host
// synchronization. The public Buffer methods (runtime/buffer_ops.cpp) call these.
#include <cstdint>

#include "layout/ll_params.hpp"
#include "layout/logfmt.hpp"
#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/low_latency_launch.hpp"
#include "runtime/ops.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

// The order of the calls on the two buffer sets, kept on the host (Buffer::Impl::ll_waiting). The kernels
// count the ops of a set by the receives this rank completed there (kernels/low_latency/epochs.cuh), which is right
// only if every earlier call on the set was received before the next is sent.
enum LowLatencyCall { kNoCall = 0, kDispatchCall = 1, kCombineCall = 2 };
const char* call_name(int c) { return c == kDispatchCall ? "dispatch" : "combine"; }

// The set a call uses, checked against the calls waiting on the sets; nothing changes until commit_set.
int choose_set(const Buffer::Impl& b, LowLatencyCall call, int phases, int receive_set, const void* id0,
               const void* id1, const char* op) {
  if (phases & kLowLatencySendPhase) {
    const int set = b.ll_next_set;
    EPX_REQUIRE(b.ll_waiting[set] == kNoCall, op, ": buffer set ", set, " still holds a ", call_name(b.ll_waiting[set]),
                " that this rank has not received; call its receive (the hook) before "
                "sending the call after next");
    return set;
  }
  EPX_REQUIRE(receive_set == 0 || receive_set == 1, op, ": the receive call needs the send call's buffer set");
  EPX_REQUIRE(b.ll_waiting[receive_set] == call, op, ": no ", call_name(call), " sent on buffer set ", receive_set,
              " is waiting to be received (received twice, or cleaned since it was sent)");
  EPX_REQUIRE(b.ll_waiting_id[receive_set][0] == id0 && b.ll_waiting_id[receive_set][1] == id1, op,
              ": this receive names other tensors than the ", call_name(call), " waiting on buffer set ", receive_set,
              " (a stale hook, or a handle or output of another call?)");
  return receive_set;
}

// After every check of the call, just before its launch.
void commit_set(Buffer::Impl& b, LowLatencyCall call, int phases, int set, const void* id0, const void* id1) {
  if (phases & kLowLatencySendPhase) b.ll_next_set ^= 1;
  b.ll_waiting[set] = phases == kLowLatencySendPhase ? call : kNoCall;
  b.ll_waiting_id[set][0] = id0;
  b.ll_waiting_id[set][1] = id1;
}

// After a rank was unmasked the signals may hold what it wrote while masked, or lack what it skipped.
void require_clean_after_unmask(const Buffer::Impl& b, const char* op) {
  EPX_REQUIRE(!b.ll_clean_needed, op,
              ": a rank was unmasked (low_latency_update_mask_buffer(rank, false) or low_latency_clean_mask_buffer); "
              "call clean_low_latency_buffer on every rank before the next low-latency call");
}

void require_phases(int phases, const char* op) {
  EPX_REQUIRE(phases == kLowLatencySendPhase || phases == kLowLatencyRecvPhase || phases == kLowLatencyBothPhases, op,
              ": phases must be send (1), receive (2) or both (3), got ", phases);
}

void validate_shape(const Buffer::Impl& b, int num_tokens, int hidden, int num_topk, int num_experts, int max_tokens,
                    bool fp8, bool ue8m0, const char* op) {
  validate_low_latency_shape(b.num_ranks, max_tokens, hidden, num_experts, op);  // what low_latency_size_hint checks
  EPX_REQUIRE(num_tokens >= 0 && num_tokens <= max_tokens, op, ": num_tokens (", num_tokens,
              ") must be in [0, num_max_dispatch_tokens_per_rank = ", max_tokens, "]");
  EPX_REQUIRE(!fp8 || hidden % kFp8GroupSize == 0, op, ": FP8 needs hidden % 128 == 0, got ", hidden);
  EPX_REQUIRE(!ue8m0 || hidden % (4 * kFp8GroupSize) == 0, op, ": UE8M0 scales need hidden % 512 == 0, got ", hidden);
  EPX_REQUIRE(num_topk >= 1 && num_topk <= kLowLatencyMaxTopk, op, ": num_topk must be in [1, ", kLowLatencyMaxTopk,
              "], got ", num_topk);
  EPX_REQUIRE(b.ll_set_bytes > 0, op,
              ": the buffer has no low-latency region: create it with num_rdma_bytes from "
              "low_latency_size_hint");
  const LowLatencyLayout layout = LowLatencyLayout::make(b.ll_set_bytes, max_tokens, hidden, num_experts);
  if (!layout.fits())
    raise(Status::kBufferTooSmall, op, ": num_rdma_bytes is ", 2 * b.ll_set_bytes, " but M = ", max_tokens,
          ", hidden = ", hidden, ", ", num_experts, " experts need ",
          2 * LowLatencyLayout::required_set_bytes(max_tokens, hidden, num_experts), " (low_latency_size_hint)");
}

// NVSHMEM puts read dispatch records staged in the combine-send area (LowLatencyLayout::dispatch_stage).
// Records without the top-k always fit (M records, E * M combine rows); with it (topk_weights) they may not
// for a single expert of a small hidden size.
void check_staging(const Buffer::Impl& b, const LowLatencyLayout& layout, int max_tokens, int hidden, bool fp8,
                   int topk_carried, const char* op) {
  const int64_t record = LowLatencyRecord::make(hidden, fp8, topk_carried).bytes;
  if (b.peer_map.ll.num_nvshmem > 0 && !layout.dispatch_stage_fits(max_tokens, record))
    raise(Status::kNotSupported, op, ": the NVSHMEM transport stages ", max_tokens, " records of ", record,
          " bytes in the combine-send area of ", layout.combine_send_bytes, " bytes; use more experts");
}

// The fields both low-latency kernels take, for the shape a handle describes (dispatch: its own arguments).
template <typename Params>
Params low_latency_params(const Buffer::Impl& b, const LowLatencyHandle& h, int set, int phases) {
  Params p{};
  p.fail = b.fail_state();
  p.mask = b.rank_mask();
  p.peers = b.peer_map;
  p.layout = LowLatencyLayout::make(b.ll_set_bytes, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts);
  p.set = set;
  p.phases = phases;
  p.num_ranks = b.num_ranks;
  p.num_tokens = h.num_tokens;
  p.max_tokens = h.num_max_dispatch_tokens_per_rank;
  p.hidden = h.hidden;
  p.num_topk = h.num_topk;
  p.num_experts = h.num_experts;
  return p;
}

// The NVSHMEM build of the kernels only where a rank is reached through NVSHMEM puts (layout/ll_params.hpp).
void launch_dispatch(Buffer::Impl& b, const LowLatencyDispatchParams& p, cudaStream_t stream) {
#if EPX_HAVE_NVSHMEM
  const LowLatencyKernel k =
      b.peer_map.ll.num_nvshmem > 0 ? ll_nvshmem::dispatch_kernel(p) : ll_peer_pointers::dispatch_kernel(p);
#else
  const LowLatencyKernel k = ll_peer_pointers::dispatch_kernel(p);
#endif
  launch_low_latency(k, &p, sizeof(p), b.ll_launch, b.ll_graphs, stream);
}

void launch_combine(Buffer::Impl& b, const LowLatencyCombineParams& p, cudaStream_t stream) {
#if EPX_HAVE_NVSHMEM
  const LowLatencyKernel k =
      b.peer_map.ll.num_nvshmem > 0 ? ll_nvshmem::combine_kernel() : ll_peer_pointers::combine_kernel();
#else
  const LowLatencyKernel k = ll_peer_pointers::combine_kernel();
#endif
  launch_low_latency(k, &p, sizeof(p), b.ll_launch, b.ll_graphs, stream);
}

}  // namespace

// The hint sizes a buffer for the shape the calls check (validate_shape), whatever their FP8 choice: BF16 records
// are the larger, so a BF16 hidden that FP8 does not take (hidden % 128 != 0) is still a valid shape here.
int64_t low_latency_size_hint(int max_tokens, int hidden, int num_ranks, int num_experts) {
  validate_low_latency_shape(num_ranks, max_tokens, hidden, num_experts, "low_latency_size_hint");
  return 2 * align_up(LowLatencyLayout::required_set_bytes(max_tokens, hidden, num_experts), kAlign);
}

namespace low_latency {

void clean(Buffer::Impl& b, cudaStream_t stream, const char* op) {
  EPX_REQUIRE(b.ll_set_bytes > 0, op, ": the buffer has no low-latency region");
  // First barrier: every rank's earlier low-latency kernels (on this stream) are done, so no completion, count
  // or target of theirs can still land in the signals zeroed below (a stale one would let a send run early).
  launch_barrier(b, 0x11c1ea6, stream, op);
  for (int set = 0; set < 2; ++set)
    b.check_launch(
        cudaMemsetAsync(b.peer_map.ll.local + set * b.ll_set_bytes, 0, LowLatencyLayout::kSignalsBytes, stream), op);
  launch_barrier(b, 0x11c1ea7, stream, op);  // nobody sends into a peer before the peer has cleaned
  b.ll_next_set = 0;
  b.ll_waiting[0] = b.ll_waiting[1] = kNoCall;
  b.ll_clean_needed = false;
}

void dispatch(Buffer::Impl& b, const LowLatencyDispatchArgs& a, const LowLatencyDispatchOutputs& o, int phases,
              LowLatencyHandle& h, cudaStream_t stream, const char* op) {
  require_phases(phases, op);
  require_clean_after_unmask(b, op);
  validate_shape(b, a.num_tokens, a.hidden, a.num_topk, a.num_experts, a.num_max_dispatch_tokens_per_rank,
                 a.use_fp8 != 0, a.use_ue8m0 != 0, op);
  EPX_REQUIRE(!a.use_ue8m0 || (a.use_fp8 && a.round_scale), op, ": use_ue8m0 needs use_fp8 and round_scale");
  EPX_REQUIRE(a.num_tokens == 0 || (a.x != nullptr && aligned16(a.x)), op,
              ": x must be a 16-byte aligned device pointer");
  EPX_REQUIRE(a.num_tokens == 0 || a.topk_idx != nullptr, op, ": topk_idx is null");
  EPX_REQUIRE(
      o.packed_recv_x && aligned16(o.packed_recv_x) && o.packed_recv_count && o.recv_src_info && o.recv_layout_range,
      op, ": packed_recv_x (16-byte aligned), packed_recv_count, recv_src_info and recv_layout_range are needed");
  EPX_REQUIRE(!a.use_fp8 || o.packed_recv_x_scales != nullptr, op, ": FP8 dispatch needs packed_recv_x_scales");
  EPX_REQUIRE(!overlaps(a.x, uint64_t(a.num_tokens) * a.hidden * 2, o.packed_recv_x,
                        uint64_t(a.num_experts) * a.num_max_dispatch_tokens_per_rank * a.hidden * (a.use_fp8 ? 1 : 2)),
              op, ": packed_recv_x must not overlap x (the dispatch reads x while it writes packed_recv_x)");
  EPX_REQUIRE((a.topk_weights != nullptr) == (o.recv_topk_slots != nullptr), op,
              ": topk_weights and recv_topk_slots go together (both for a rank-reduced combine, or neither)");
  const int topk_carried = a.topk_weights != nullptr ? a.num_topk : 0;  // in every record (LowLatencyRecord)
  EPX_REQUIRE(a.num_tokens == 0 || topk_carried == 0 || aligned16(o.recv_topk_slots), op,
              ": recv_topk_slots must be 16-byte aligned");
  const LowLatencyRecord record = LowLatencyRecord::make(a.hidden, a.use_fp8 != 0, topk_carried);
  // Per block on Hopper: the staged token and topk as int16. The kernel pads the latter to 16 bytes; the bound is the
  // same, as the record's size and the limit are multiples of 16.
  constexpr int64_t kMaxSharedBytes = 227 * 1024;
  EPX_REQUIRE(record.bytes + int64_t(a.num_tokens) * a.num_topk * 2 <= kMaxSharedBytes, op, ": num_tokens * num_topk (",
              int64_t(a.num_tokens) * a.num_topk, ") with hidden ", a.hidden, " does not fit the ", kMaxSharedBytes,
              " bytes of shared memory a block can have");

  if (!(phases & kLowLatencySendPhase)) {
    EPX_REQUIRE(h.buffer_set == 0 || h.buffer_set == 1, op, ": the handle has no buffer set (send first)");
    EPX_REQUIRE(h.num_tokens == a.num_tokens && h.hidden == a.hidden && h.num_experts == a.num_experts &&
                    h.num_max_dispatch_tokens_per_rank == a.num_max_dispatch_tokens_per_rank,
                op, ": the receive call must repeat the send call's arguments");
  }
  const int set = choose_set(b, kDispatchCall, phases, h.buffer_set, o.recv_src_info, o.recv_layout_range, op);
  // The record format decides where the receive finds rows and scales: it must be the send call's.
  const int format = (a.use_fp8 ? 1 : 0) | (a.use_ue8m0 ? 2 : 0);
  if (phases == kLowLatencyRecvPhase)
    EPX_REQUIRE(b.ll_waiting_format[set] == format, op, ": the receive call must repeat the send call's use_fp8 (",
                b.ll_waiting_format[set] & 1, ") and use_ue8m0 (", b.ll_waiting_format[set] >> 1, "), got ", format & 1,
                " and ", format >> 1);
  if (phases == kLowLatencyRecvPhase)  // so does the top-k the records carry (the handle names the send's table)
    EPX_REQUIRE(h.recv_topk_slots == o.recv_topk_slots, op,
                ": the receive call must repeat the send call's topk_weights and recv_topk_slots");
  // The handle holds this call's shape: filled here (send; the caller's handle only once every check passed)
  // or checked against it above (receive; num_topk aside, which the send call's handle carries).
  const LowLatencyHandle shape = (phases & kLowLatencySendPhase) ? LowLatencyHandle{set,
                                                                                    a.num_tokens,
                                                                                    a.hidden,
                                                                                    a.num_topk,
                                                                                    a.num_experts,
                                                                                    a.num_max_dispatch_tokens_per_rank,
                                                                                    o.recv_src_info,
                                                                                    o.recv_layout_range,
                                                                                    o.recv_topk_slots}
                                                                 : h;
  auto p = low_latency_params<LowLatencyDispatchParams>(b, shape, set, phases);
  p.num_topk = a.num_topk;
  check_staging(b, p.layout, a.num_max_dispatch_tokens_per_rank, a.hidden, a.use_fp8 != 0, topk_carried, op);
  if (topk_carried > 0 &&
      !p.layout.dispatch_fits(b.num_ranks, a.num_max_dispatch_tokens_per_rank, a.num_experts, record.bytes))
    raise(Status::kNotSupported, op, ": records that carry the top-k (topk_weights) are ", record.bytes, " bytes; ",
          b.num_ranks, " x ", a.num_max_dispatch_tokens_per_rank, " of them and the row map exceed the ",
          p.layout.receive_bytes, "-byte receive area of this shape (", a.num_experts,
          " experts); use more experts per rank or a larger hidden size");
  p.fp8 = a.use_fp8 != 0;
  p.round_scale = a.round_scale != 0;
  p.ue8m0 = a.use_ue8m0 != 0;
  p.x = static_cast<const int4*>(a.x);
  p.topk_idx = a.topk_idx;
  p.cumulative_stats = a.cumulative_local_expert_recv_stats;
  p.packed_recv_x = o.packed_recv_x;
  p.packed_recv_scales = o.packed_recv_x_scales;
  p.packed_recv_count = o.packed_recv_count;
  p.recv_src_info = o.recv_src_info;
  p.recv_layout_range = o.recv_layout_range;
  p.topk_weights = a.topk_weights;
  p.recv_topk_slots = o.recv_topk_slots;
  commit_set(b, kDispatchCall, phases, set, o.recv_src_info, o.recv_layout_range);
  b.ll_waiting_format[set] = format;
  h = shape;
  launch_dispatch(b, p, stream);
  b.check_launch(cudaGetLastError(), op);
}

int combine(Buffer::Impl& b, const LowLatencyCombineArgs& a, const LowLatencyHandle& h, void* combined_x, int phases,
            int buffer_set, cudaStream_t stream, const char* op) {
  require_phases(phases, op);
  require_clean_after_unmask(b, op);
  validate_shape(b, h.num_tokens, h.hidden, h.num_topk, h.num_experts, h.num_max_dispatch_tokens_per_rank, false, false,
                 op);
  EPX_REQUIRE(h.recv_src_info != nullptr && h.recv_layout_range != nullptr, op, ": the handle is incomplete");
  EPX_REQUIRE(a.reduction == EPX_REDUCE_DEFAULT || a.reduction == EPX_REDUCE_FLAT || a.reduction == EPX_REDUCE_RANK, op,
              ": reduction must be EPX_REDUCE_DEFAULT (0), EPX_REDUCE_FLAT (1) or EPX_REDUCE_RANK (3), got ",
              a.reduction);
  const bool rank_reduced = a.reduction == EPX_REDUCE_RANK;
  EPX_REQUIRE(!rank_reduced || h.recv_topk_slots != nullptr, op,
              ": the rank-reduced order (EPX_REDUCE_RANK) needs a handle whose dispatch was given topk_weights (and "
              "recv_topk_slots): the expert ranks sum with the weights that travelled with the tokens");
  EPX_REQUIRE(!rank_reduced || !b.shrink, op,
              ": the rank-reduced order (EPX_REDUCE_RANK) is not offered on a Buffer with rank masking "
              "(enable_shrink): its partial sums would need a rank masked mid-call left out on the expert side too");
  EPX_REQUIRE(!rank_reduced || !a.use_logfmt, op,
              ": use_logfmt is not offered with the rank-reduced order (EPX_REDUCE_RANK): the partial sums "
              "travel as bf16");
  EPX_REQUIRE(
      h.num_tokens == 0 || (a.topk_idx != nullptr && (rank_reduced || a.topk_weights != nullptr)), op,
      rank_reduced ? ": topk_idx of the dispatch is needed" : ": topk_idx and topk_weights of the dispatch are needed");
  EPX_REQUIRE(h.num_tokens == 0 || (combined_x != nullptr && aligned16(combined_x)), op,
              ": combined_x must be a 16-byte aligned device pointer");
  EPX_REQUIRE(a.zero_copy || (a.x != nullptr && aligned16(a.x)), op,
              ": x must be a 16-byte aligned device pointer (or use zero_copy)");
  EPX_REQUIRE(!a.use_logfmt || h.hidden % kLogfmtGroup == 0, op, ": use_logfmt needs hidden % ", kLogfmtGroup,
              " == 0 (a LogFMT group), got ", h.hidden);

  const int set = choose_set(b, kCombineCall, phases, buffer_set, h.recv_src_info, combined_x, op);
  // The row format decides how the receive reads the slots: it must be the send call's.
  const int format = (a.use_logfmt ? 1 : 0) | (rank_reduced ? 2 : 0);
  if (phases == kLowLatencyRecvPhase)
    EPX_REQUIRE(b.ll_waiting_format[set] == format, op, ": the receive call must repeat the send call's use_logfmt (",
                b.ll_waiting_format[set] & 1, ") and reduction (", (b.ll_waiting_format[set] & 2) ? "rank" : "flat",
                "), got ", format & 1, " and ", rank_reduced ? "rank" : "flat");
  auto p = low_latency_params<LowLatencyCombineParams>(b, h, set, phases);
  p.x =
      static_cast<const int4*>(a.zero_copy ? static_cast<void*>(p.layout.combine_send(b.peer_map.ll.local, set)) : a.x);
  p.x_in_region = a.zero_copy ? 1 : 0;
  // x: [L, R*M, H] bf16 (with zero_copy, in this set's combine-send area)
  EPX_REQUIRE(!overlaps(combined_x, uint64_t(h.num_tokens) * h.hidden * 2, p.x,
                        uint64_t(h.num_experts) * h.num_max_dispatch_tokens_per_rank * h.hidden * 2),
              op, ": combined_x must not overlap x", a.zero_copy ? " (the zero-copy combine area)" : "",
              " (the combine reads x while it writes combined_x)");
  p.logfmt = a.use_logfmt ? 1 : 0;
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.recv_src_info = h.recv_src_info;
  p.recv_layout_range = h.recv_layout_range;
  p.out = static_cast<int4*>(combined_x);
  p.rank_reduced = rank_reduced ? 1 : 0;
  p.recv_topk_slots = reinterpret_cast<const int2*>(h.recv_topk_slots);
  commit_set(b, kCombineCall, phases, set, h.recv_src_info, combined_x);
  b.ll_waiting_format[set] = format;
  launch_combine(b, p, stream);
  b.check_launch(cudaGetLastError(), op);
  return set;
}

void* next_combine_buffer(Buffer::Impl& b, const LowLatencyHandle& h, const char* op) {
  validate_shape(b, h.num_tokens, h.hidden, h.num_topk, h.num_experts, h.num_max_dispatch_tokens_per_rank, false, false,
                 op);
  const LowLatencyLayout layout =
      LowLatencyLayout::make(b.ll_set_bytes, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts);
  return layout.combine_send(b.peer_map.ll.local, b.ll_next_set);
}

}  // namespace low_latency

}  // namespace epx
