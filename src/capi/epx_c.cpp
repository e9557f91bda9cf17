// The C ABI: a thin exception-to-status layer over the C++ API.
#include <memory>
#include <string>
#include <vector>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "runtime/errors.hpp"

struct epx_buffer {
  std::unique_ptr<epx::CallbackBootstrap> bootstrap;  // outlives `buffer`: destroy() uses it
  std::unique_ptr<epx::Buffer> buffer;
  std::vector<int> counts;  // backs epx_dispatch_counts::num_recv_tokens_per_expert
};

namespace {

thread_local std::string g_last_error;

template <typename F>
epx_status guarded(F&& f) {
  try {
    g_last_error.clear();
    f();
    return EPX_OK;
  } catch (const epx::Error& e) {
    g_last_error = e.what();
    return static_cast<epx_status>(e.status());
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return EPX_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return EPX_ERR_INTERNAL;
  }
}

// A dispatch's counts to the caller; the per-expert array lives in the epx_buffer until its next such call.
void report_counts(epx_buffer* buffer, epx::DispatchCounts c, epx_dispatch_counts* counts) {
  buffer->counts = std::move(c.num_recv_tokens_per_expert);
  counts->num_recv_tokens = c.num_recv_tokens;
  counts->num_rdma_recv_tokens = c.num_rdma_recv_tokens;
  counts->num_local_experts = int(buffer->counts.size());
  counts->num_recv_tokens_per_expert = buffer->counts.data();
}

template <typename T>
void require_non_null(const T* p, const char* what) {
  if (p == nullptr) epx::raise(epx::Status::kInvalidArgument, what, " is NULL");
}

epx::Buffer& live(epx_buffer* b) {
  require_non_null(b, "buffer");
  if (!b->buffer) epx::raise(epx::Status::kFailedState, "the buffer was destroyed");
  return *b->buffer;
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

extern "C" {

const char* epx_last_error(void) { return g_last_error.c_str(); }

const char* epx_status_string(epx_status status) { return epx::status_string(static_cast<epx::Status>(status)); }

int epx_version(void) { return EPX_VERSION_MAJOR * 100 + EPX_VERSION_MINOR; }

int epx_built_with_nvshmem(void) { return epx::built_with_nvshmem() ? 1 : 0; }

epx_status epx_buffer_create(const epx_bootstrap* bootstrap, const epx_buffer_options* options, epx_buffer** out) {
  return guarded([&] {
    if (out != nullptr) *out = nullptr;  // whatever fails below
    require_non_null(bootstrap, "bootstrap");
    require_non_null(options, "options");
    require_non_null(out, "out");
    if (bootstrap->allgather == nullptr) epx::raise(epx::Status::kInvalidArgument, "bootstrap.allgather is NULL");
    auto b = std::make_unique<epx_buffer>();
    b->bootstrap = std::make_unique<epx::CallbackBootstrap>(*bootstrap);
    b->buffer = std::make_unique<epx::Buffer>(*b->bootstrap, *options);
    *out = b.release();
  });
}

epx_status epx_buffer_destroy(epx_buffer* buffer) {
  if (buffer == nullptr) return guarded([] {});  // a no-op that succeeds, clearing the last error like any success
  const epx_status s = guarded([&] {
    if (buffer->buffer) buffer->buffer->destroy();
  });
  buffer->buffer.reset();
  delete buffer;
  return s;
}

epx_status epx_buffer_info(const epx_buffer* buffer, int* rank, int* num_ranks, int* device, int* num_nvl_ranks) {
  return guarded([&] {
    epx::Buffer& b = live(const_cast<epx_buffer*>(buffer));
    if (rank) *rank = b.rank();
    if (num_ranks) *num_ranks = b.num_ranks();
    if (device) *device = b.device();
    if (num_nvl_ranks) *num_nvl_ranks = b.num_nvl_ranks();
  });
}

epx_status epx_buffer_is_internode(const epx_buffer* buffer, int* internode) {
  return guarded([&] {
    require_non_null(internode, "internode");
    *internode = live(const_cast<epx_buffer*>(buffer)).internode() ? 1 : 0;
  });
}

epx_status epx_buffer_set_timeout(epx_buffer* buffer, double seconds) {
  return guarded([&] { live(buffer).set_timeout(seconds); });
}

epx_status epx_buffer_ll_transport(const epx_buffer* buffer, epx_ll_transport_info* info) {
  return guarded([&] {
    require_non_null(info, "info");
    *info = live(const_cast<epx_buffer*>(buffer)).low_latency_transport();
  });
}

epx_status epx_buffer_check(epx_buffer* buffer, void* stream) {
  return guarded([&] { live(buffer).check(as_stream(stream)); });
}

epx_status epx_buffer_region(epx_buffer* buffer, int which, void** ptr, int64_t* bytes) {
  return guarded([&] {
    require_non_null(ptr, "ptr");
    require_non_null(bytes, "bytes");
    *ptr = nullptr;
    *bytes = 0;
    // Checked before the buffer, so that a bad argument says so even without one (and on a CPU).
    if (which != EPX_REGION_NVL && which != EPX_REGION_RDMA)
      epx::raise(epx::Status::kInvalidArgument, "which must be EPX_REGION_NVL (", EPX_REGION_NVL,
                 ") or EPX_REGION_RDMA (", EPX_REGION_RDMA, "), got ", which);
    const epx::MemoryRegion r = live(buffer).local_region(which);
    *ptr = r.ptr;
    *bytes = r.bytes;
  });
}

epx_status epx_get_limits(epx_limits* out) {
  return guarded([&] {
    require_non_null(out, "out");
    *out = epx::limits();
  });
}

epx_status epx_config_num_channels(const epx_config* config, int* out) {
  return guarded([&] {
    require_non_null(config, "config");
    require_non_null(out, "out");
    *out = epx::num_channels(*config);
  });
}

epx_status epx_default_dispatch_config(int num_ranks, epx_config* out) {
  return guarded([&] {
    require_non_null(out, "out");
    *out = epx::default_dispatch_config(num_ranks);
  });
}

epx_status epx_default_combine_config(int num_ranks, epx_config* out) {
  return guarded([&] {
    require_non_null(out, "out");
    *out = epx::default_combine_config(num_ranks);
  });
}

epx_status epx_config_nvl_size_hint(const epx_config* config, int64_t hidden_bytes, int num_ranks, int64_t* bytes) {
  return guarded([&] {
    require_non_null(config, "config");
    require_non_null(bytes, "bytes");
    *bytes = epx::nvl_size_hint(*config, hidden_bytes, num_ranks);
  });
}

epx_status epx_recv_region_size_hint(int rows, int hidden, int dtype, int num_scales, int num_topk, int64_t* bytes) {
  return guarded([&] {
    require_non_null(bytes, "bytes");
    *bytes = epx::recv_region_size_hint(rows, hidden, dtype, num_scales, num_topk);
  });
}

epx_status epx_config_internode_size_hints(const epx_config* config, int64_t hidden_bytes, int num_ranks,
                                           int num_nvl_ranks, int64_t* nvl_bytes, int64_t* rdma_bytes) {
  return guarded([&] {
    require_non_null(config, "config");
    require_non_null(nvl_bytes, "nvl_bytes");
    require_non_null(rdma_bytes, "rdma_bytes");
    const epx::InternodeSizes s = epx::internode_size_hints(*config, hidden_bytes, num_ranks, num_nvl_ranks);
    *nvl_bytes = s.nvl_bytes;
    *rdma_bytes = s.rdma_bytes;
  });
}

epx_status epx_get_dispatch_layout(epx_buffer* buffer, const epx_layout_args* args, const epx_layout_outputs* outputs,
                                   void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(outputs, "outputs");
    live(buffer).get_dispatch_layout(*args, *outputs, as_stream(stream));
  });
}

epx_status epx_notify_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               epx_dispatch_handle* handle, epx_dispatch_counts* counts, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(counts, "counts");
    report_counts(buffer, live(buffer).notify_dispatch(*args, *config, *handle, as_stream(stream)), counts);
  });
}

epx_status epx_dispatch_sized(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                              epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs,
                              epx_dispatch_counts* counts, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(outputs, "outputs");
    require_non_null(counts, "counts");
    report_counts(buffer, live(buffer).dispatch_sized(*args, *config, *handle, *outputs, as_stream(stream)), counts);
  });
}

epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                        const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(outputs, "outputs");
    live(buffer).dispatch(*args, *config, *handle, *outputs, as_stream(stream));
  });
}

epx_status epx_dispatch_cached(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(outputs, "outputs");
    live(buffer).dispatch_cached(*args, *config, *handle, *outputs, as_stream(stream));
  });
}

epx_status epx_dispatch_in_buffer(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                                  epx_dispatch_handle* handle, int cached, epx_dispatch_counts* counts,
                                  epx_recv_region* region, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(region, "region");
    if (!cached) require_non_null(counts, "counts");
    epx::DispatchCounts c =
        live(buffer).dispatch_in_buffer(*args, *config, *handle, cached != 0, *region, as_stream(stream));
    if (!cached) report_counts(buffer, std::move(c), counts);
  });
}

epx_status epx_combine_region(epx_buffer* buffer, int hidden, int num_topk, epx_recv_region* region) {
  return guarded([&] {
    require_non_null(region, "region");
    *region = live(buffer).combine_region(hidden, num_topk);
  });
}

epx_status epx_combine_in_buffer(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                                 const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(outputs, "outputs");
    live(buffer).combine_in_buffer(*args, *config, *handle, *outputs, as_stream(stream));
  });
}

epx_status epx_combine(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                       const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(config, "config");
    require_non_null(handle, "handle");
    require_non_null(outputs, "outputs");
    live(buffer).combine(*args, *config, *handle, *outputs, as_stream(stream));
  });
}

epx_status epx_ll_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts,
                            int64_t* bytes) {
  return guarded([&] {
    require_non_null(bytes, "bytes");
    *bytes = epx::low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
  });
}

epx_status epx_ll_clean(epx_buffer* buffer, void* stream) {
  return guarded([&] { live(buffer).clean_low_latency_buffer(as_stream(stream)); });
}

epx_status epx_ll_dispatch(epx_buffer* buffer, const epx_ll_dispatch_args* args, const epx_ll_dispatch_outputs* outputs,
                           int phases, epx_ll_handle* handle, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(outputs, "outputs");
    require_non_null(handle, "handle");
    live(buffer).low_latency_dispatch(*args, *outputs, phases, *handle, as_stream(stream));
  });
}

epx_status epx_ll_combine(epx_buffer* buffer, const epx_ll_combine_args* args, const epx_ll_handle* handle,
                          void* combined_x, int phases, int* buffer_set, void* stream) {
  return guarded([&] {
    require_non_null(args, "args");
    require_non_null(handle, "handle");
    require_non_null(buffer_set, "buffer_set");
    *buffer_set = live(buffer).low_latency_combine(*args, *handle, combined_x, phases, *buffer_set, as_stream(stream));
  });
}

epx_status epx_ll_next_combine_buffer(epx_buffer* buffer, const epx_ll_handle* handle, void** ptr) {
  return guarded([&] {
    require_non_null(handle, "handle");
    require_non_null(ptr, "ptr");
    *ptr = live(buffer).next_low_latency_combine_buffer(*handle);
  });
}

epx_status epx_ll_update_mask(epx_buffer* buffer, int rank, int mask, void* stream) {
  return guarded([&] { live(buffer).low_latency_update_mask_buffer(rank, mask != 0, as_stream(stream)); });
}

epx_status epx_ll_query_mask(epx_buffer* buffer, int32_t* out, void* stream) {
  return guarded([&] {
    require_non_null(out, "out");
    live(buffer).low_latency_query_mask_buffer(out, as_stream(stream));
  });
}

epx_status epx_ll_clean_mask(epx_buffer* buffer, void* stream) {
  return guarded([&] { live(buffer).low_latency_clean_mask_buffer(as_stream(stream)); });
}

}  // extern "C"
