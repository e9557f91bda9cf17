/*
 * A libepx look-alike for timing the Python layer on a CPU (tests/python/overhead_cpu.py): every function of
 * epx.h, with the header's prototypes, doing no work. Only what the Python layer reads back is filled in
 * (the version, the low-latency handle, the dispatch counts), so that the measured time is Python's and
 * ctypes' alone. Never a real library: it launches nothing and checks nothing.
 */
#include "epx/epx.h"

static int g_counts[64];

const char* epx_last_error(void) { return ""; }
const char* epx_status_string(epx_status status) { return status == EPX_OK ? "ok" : "stub error"; }
int epx_version(void) { return EPX_VERSION_MAJOR * 100 + EPX_VERSION_MINOR; }
int epx_built_with_nvshmem(void) { return 0; }

epx_status epx_buffer_create(const epx_bootstrap* b, const epx_buffer_options* o, epx_buffer** out) {
  (void)b, (void)o;
  *out = (epx_buffer*)0x1000;
  return EPX_OK;
}
epx_status epx_buffer_destroy(epx_buffer* buffer) {
  (void)buffer;
  return EPX_OK;
}
epx_status epx_buffer_info(const epx_buffer* buffer, int* rank, int* num_ranks, int* device, int* num_nvl_ranks) {
  (void)buffer, (void)rank, (void)num_ranks, (void)device, (void)num_nvl_ranks;
  return EPX_OK;
}
epx_status epx_buffer_is_internode(const epx_buffer* buffer, int* internode) {
  (void)buffer;
  *internode = 0;
  return EPX_OK;
}
epx_status epx_buffer_set_timeout(epx_buffer* buffer, double seconds) {
  (void)buffer, (void)seconds;
  return EPX_OK;
}
epx_status epx_buffer_ll_transport(const epx_buffer* buffer, epx_ll_transport_info* info) {
  (void)buffer;
  if (info) info->transport = EPX_LL_TRANSPORT_CUDA_IPC, info->num_peer_pointer_ranks = 0, info->num_nvshmem_ranks = 0;
  return EPX_OK;
}
epx_status epx_buffer_check(epx_buffer* buffer, void* stream) {
  (void)buffer, (void)stream;
  return EPX_OK;
}
epx_status epx_buffer_region(epx_buffer* buffer, int which, void** ptr, int64_t* bytes) {
  (void)buffer, (void)which;
  *ptr = 0, *bytes = 0;
  return EPX_OK;
}

epx_status epx_get_limits(epx_limits* out) {
  out->max_nvl_ranks = 8, out->max_ranks = 64, out->max_channels = 64, out->max_topk = 32, out->max_hidden = 32768;
  out->max_local_experts = 1024, out->max_experts = 8192, out->fp8_group_size = 128;
  out->ll_max_ranks = 8, out->ll_max_tokens = 4096, out->ll_max_experts = 1024, out->ll_max_topk = 32;
  return EPX_OK;
}
epx_status epx_config_num_channels(const epx_config* c, int* out) {
  *out = c->num_sms / 2;
  return EPX_OK;
}
epx_status epx_default_dispatch_config(int num_ranks, epx_config* out) {
  (void)num_ranks;
  out->num_sms = 24, out->num_max_send_tokens = 6, out->num_max_recv_tokens = 256;
  out->num_max_rdma_send_tokens = 8, out->num_max_rdma_recv_tokens = 128;
  return EPX_OK;
}
epx_status epx_default_combine_config(int num_ranks, epx_config* out) {
  return epx_default_dispatch_config(num_ranks, out);
}
epx_status epx_config_nvl_size_hint(const epx_config* c, int64_t hidden_bytes, int num_ranks, int64_t* bytes) {
  (void)c, (void)hidden_bytes, (void)num_ranks;
  *bytes = 1 << 20;
  return EPX_OK;
}
epx_status epx_config_internode_size_hints(const epx_config* c, int64_t hidden_bytes, int num_ranks, int num_nvl_ranks,
                                           int64_t* nvl_bytes, int64_t* rdma_bytes) {
  (void)c, (void)hidden_bytes, (void)num_ranks, (void)num_nvl_ranks;
  *nvl_bytes = 1 << 20, *rdma_bytes = 1 << 20;
  return EPX_OK;
}

epx_status epx_get_dispatch_layout(epx_buffer* buffer, const epx_layout_args* args, const epx_layout_outputs* outputs,
                                   void* stream) {
  (void)buffer, (void)args, (void)outputs, (void)stream;
  return EPX_OK;
}
epx_status epx_notify_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               epx_dispatch_handle* handle, epx_dispatch_counts* counts, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)stream;
  counts->num_recv_tokens = args->num_tokens;
  counts->num_rdma_recv_tokens = args->num_tokens;
  counts->num_local_experts = 4;
  counts->num_recv_tokens_per_expert = g_counts;
  return EPX_OK;
}
/* Every token arrives once (num_recv_tokens = num_tokens), as the stub's notify says: outputs of fewer rows make the
 * caller repeat in two steps. */
epx_status epx_dispatch_sized(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                              epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs,
                              epx_dispatch_counts* counts, void* stream) {
  epx_status s = epx_notify_dispatch(buffer, args, config, handle, counts, stream);
  if (outputs->num_rows < args->num_tokens) counts->num_recv_tokens = -1;
  return s;
}
epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                        const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)outputs, (void)stream;
  return EPX_OK;
}
epx_status epx_dispatch_cached(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                               const epx_dispatch_handle* handle, const epx_dispatch_outputs* outputs, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)outputs, (void)stream;
  return EPX_OK;
}
epx_status epx_dispatch_in_buffer(epx_buffer* buffer, const epx_dispatch_args* args, const epx_config* config,
                                  epx_dispatch_handle* handle, int cached, epx_dispatch_counts* counts,
                                  epx_recv_region* region, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)cached, (void)counts, (void)region, (void)stream;
  return EPX_OK;
}
epx_status epx_combine_region(epx_buffer* buffer, int hidden, int num_topk, epx_recv_region* region) {
  (void)buffer, (void)hidden, (void)num_topk, (void)region;
  return EPX_OK;
}
epx_status epx_combine_in_buffer(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                                 const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)outputs, (void)stream;
  return EPX_OK;
}
epx_status epx_recv_region_size_hint(int rows, int hidden, int dtype, int num_scales, int num_topk, int64_t* bytes) {
  (void)rows, (void)hidden, (void)dtype, (void)num_scales, (void)num_topk;
  *bytes = 1 << 20;
  return EPX_OK;
}
epx_status epx_combine(epx_buffer* buffer, const epx_combine_args* args, const epx_config* config,
                       const epx_dispatch_handle* handle, const epx_combine_outputs* outputs, void* stream) {
  (void)buffer, (void)args, (void)config, (void)handle, (void)outputs, (void)stream;
  return EPX_OK;
}

epx_status epx_ll_size_hint(int m, int hidden, int num_ranks, int num_experts, int64_t* bytes) {
  (void)m, (void)hidden, (void)num_ranks, (void)num_experts;
  *bytes = 1 << 30;
  return EPX_OK;
}
epx_status epx_ll_clean(epx_buffer* buffer, void* stream) {
  (void)buffer, (void)stream;
  return EPX_OK;
}
epx_status epx_ll_update_mask(epx_buffer* buffer, int rank, int mask, void* stream) {
  (void)buffer, (void)rank, (void)mask, (void)stream;
  return EPX_OK;
}
epx_status epx_ll_query_mask(epx_buffer* buffer, int32_t* out, void* stream) {
  (void)buffer, (void)out, (void)stream;
  return EPX_OK;
}
epx_status epx_ll_clean_mask(epx_buffer* buffer, void* stream) {
  (void)buffer, (void)stream;
  return EPX_OK;
}
epx_status epx_ll_dispatch(epx_buffer* buffer, const epx_ll_dispatch_args* args, const epx_ll_dispatch_outputs* outputs,
                           int phases, epx_ll_handle* handle, void* stream) {
  (void)buffer, (void)stream;
  if (phases != EPX_LL_RECV) { /* what combine checks its arguments against */
    handle->buffer_set = 0;
    handle->num_tokens = args->num_tokens;
    handle->hidden = args->hidden;
    handle->num_topk = args->num_topk;
    handle->num_experts = args->num_experts;
    handle->num_max_dispatch_tokens_per_rank = args->num_max_dispatch_tokens_per_rank;
    handle->recv_src_info = outputs->recv_src_info;
    handle->recv_layout_range = outputs->recv_layout_range;
  }
  return EPX_OK;
}
epx_status epx_ll_combine(epx_buffer* buffer, const epx_ll_combine_args* args, const epx_ll_handle* handle,
                          void* combined_x, int phases, int* buffer_set, void* stream) {
  (void)buffer, (void)args, (void)handle, (void)combined_x, (void)phases, (void)stream;
  *buffer_set = 0;
  return EPX_OK;
}
epx_status epx_ll_next_combine_buffer(epx_buffer* buffer, const epx_ll_handle* handle, void** ptr) {
  (void)buffer, (void)handle;
  *ptr = 0;
  return EPX_OK;
}
