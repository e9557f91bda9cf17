// The public operations of a Buffer, whatever its mode: each checks that the buffer is usable, then runs the
// operation of the buffer's mode (runtime/ops.hpp).
#include "runtime/errors.hpp"
#include "runtime/ops.hpp"

namespace epx {

void Buffer::get_dispatch_layout(const LayoutArgs& a, const LayoutOutputs& o, cudaStream_t stream) {
  const char* op = "get_dispatch_layout";
  impl_->enter(op);
  epx::get_dispatch_layout(*impl_, a, o, stream, op);
}

DispatchCounts Buffer::notify_dispatch(const DispatchArgs& a, const Config& c, DispatchHandle& h, cudaStream_t stream) {
  const char* op = "notify_dispatch";
  impl_->enter(op);
  if (impl_->internode) return internode::notify_dispatch(*impl_, a, c, h, stream, op);
  return intranode::notify_dispatch(*impl_, a, c, h, stream, op);
}

DispatchCounts Buffer::dispatch_sized(const DispatchArgs& a, const Config& c, DispatchHandle& h,
                                      const DispatchOutputs& o, cudaStream_t stream) {
  const char* op = "dispatch_sized";
  impl_->enter(op);
  if (impl_->internode)
    raise(Status::kNotSupported, op, ": a dispatch into outputs sized by a guess runs inside one NVLink domain; this ",
          "buffer spans ", impl_->num_domains, " domains (or the internode mode was forced)");
  return intranode::dispatch_sized(*impl_, a, c, h, o, stream, op);
}

void Buffer::dispatch(const DispatchArgs& a, const Config& c, const DispatchHandle& h, const DispatchOutputs& o,
                      cudaStream_t stream) {
  const char* op = "dispatch";
  impl_->enter(op);
  if (impl_->internode) return internode::dispatch(*impl_, a, c, h, o, stream, op);
  intranode::dispatch(*impl_, a, c, h, o, stream, op);
}

DispatchCounts Buffer::dispatch_in_buffer(const DispatchArgs& a, const Config& c, DispatchHandle& h, bool cached,
                                          RecvRegionViews& region, cudaStream_t stream) {
  const char* op = cached ? "dispatch_in_buffer (cached)" : "dispatch_in_buffer";
  impl_->enter(op);
  if (impl_->internode)
    raise(Status::kNotSupported, op, ": a dispatch into the buffer runs inside one NVLink domain; this buffer spans ",
          impl_->num_domains, " domains (or the internode mode was forced)");
  return intranode::dispatch_in_buffer(*impl_, a, c, h, cached, region, stream, op);
}

RecvRegionViews Buffer::combine_region(int hidden, int num_topk) const {
  const char* op = "combine_region";
  if (!impl_->alive) raise(Status::kFailedState, op, ": the buffer was destroyed");
  if (impl_->internode) raise(Status::kNotSupported, op, ": a combine from the buffer runs inside one NVLink domain");
  return intranode::combine_region(*impl_, hidden, num_topk, op);
}

void Buffer::combine_in_buffer(const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
                               cudaStream_t stream) {
  const char* op = "combine_in_buffer";
  impl_->enter(op);
  if (impl_->internode)
    raise(Status::kNotSupported, op, ": a combine from the buffer runs inside one NVLink domain; this buffer spans ",
          impl_->num_domains, " domains (or the internode mode was forced)");
  intranode::combine_in_buffer(*impl_, a, c, h, o, stream, op);
}

void Buffer::dispatch_cached(const DispatchArgs& a, const Config& c, const DispatchHandle& h, const DispatchOutputs& o,
                             cudaStream_t stream) {
  const char* op = "dispatch (cached)";
  impl_->enter(op);
  if (impl_->internode) return internode::dispatch_cached(*impl_, a, c, h, o, stream, op);
  intranode::dispatch_cached(*impl_, a, c, h, o, stream, op);
}

void Buffer::combine(const CombineArgs& a, const Config& c, const DispatchHandle& h, const CombineOutputs& o,
                     cudaStream_t stream) {
  const char* op = "combine";
  impl_->enter(op);
  if (impl_->internode) return internode::combine(*impl_, a, c, h, o, stream, op);
  intranode::combine(*impl_, a, c, h, o, stream, op);
}

void Buffer::clean_low_latency_buffer(cudaStream_t stream) {
  const char* op = "clean_low_latency_buffer";
  impl_->enter(op);
  low_latency::clean(*impl_, stream, op);
}

void Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& a, const LowLatencyDispatchOutputs& o, int phases,
                                  LowLatencyHandle& h, cudaStream_t stream) {
  const char* op = "low_latency_dispatch";
  impl_->enter(op);
  low_latency::dispatch(*impl_, a, o, phases, h, stream, op);
}

int Buffer::low_latency_combine(const LowLatencyCombineArgs& a, const LowLatencyHandle& h, void* combined_x, int phases,
                                int buffer_set, cudaStream_t stream) {
  const char* op = "low_latency_combine";
  impl_->enter(op);
  return low_latency::combine(*impl_, a, h, combined_x, phases, buffer_set, stream, op);
}

void* Buffer::next_low_latency_combine_buffer(const LowLatencyHandle& h) {
  const char* op = "next_low_latency_combine_buffer";
  impl_->enter(op);
  return low_latency::next_combine_buffer(*impl_, h, op);
}

void Buffer::low_latency_update_mask_buffer(int rank, bool mask, cudaStream_t stream) {
  const char* op = "low_latency_update_mask_buffer";
  impl_->enter(op);
  low_latency::update_mask(*impl_, rank, mask, stream, op);
}

void Buffer::low_latency_query_mask_buffer(int32_t* mask_status, cudaStream_t stream) {
  const char* op = "low_latency_query_mask_buffer";
  impl_->enter(op);
  low_latency::query_mask(*impl_, mask_status, stream, op);
}

void Buffer::low_latency_clean_mask_buffer(cudaStream_t stream) {
  const char* op = "low_latency_clean_mask_buffer";
  impl_->enter(op);
  low_latency::clean_mask(*impl_, stream, op);
}

}  // namespace epx
