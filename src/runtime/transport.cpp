#include "runtime/transport.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/errors.hpp"

namespace epx {

static_assert(int(LowLatencyTransport::kNone) == EPX_LL_TRANSPORT_NONE &&
                  int(LowLatencyTransport::kCudaIpc) == EPX_LL_TRANSPORT_CUDA_IPC &&
                  int(LowLatencyTransport::kNvshmem) == EPX_LL_TRANSPORT_NVSHMEM,
              "LowLatencyTransport mirrors EPX_LL_TRANSPORT_*");

bool parse_env_switch(const char* name, const char* value) {
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  raise(Status::kInvalidArgument, name, " must be 0 or 1, got '", value, "'");
}

LowLatencyTransportChoice choose_low_latency_transport(bool has_low_latency_region, bool built_with_nvshmem,
                                                       const char* disable_nvshmem_env, const char* force_nvshmem_env) {
  const bool disable = parse_env_switch("EPX_DISABLE_NVSHMEM", disable_nvshmem_env);
  const bool force = parse_env_switch("EPX_LL_FORCE_NVSHMEM", force_nvshmem_env);
  if (disable && force)
    raise(Status::kInvalidArgument, "EPX_LL_FORCE_NVSHMEM=1 and EPX_DISABLE_NVSHMEM=1 contradict each other");
  LowLatencyTransportChoice c;
  if (!has_low_latency_region) return c;  // nothing to carry; the switches are still checked above
  if (force && !built_with_nvshmem)
    raise(Status::kNotSupported,
          "EPX_LL_FORCE_NVSHMEM=1 but this libepx was built without NVSHMEM "
          "(configure with -DEPX_NVSHMEM=ON -DEPX_NVSHMEM_DIR=...)");
  if (!built_with_nvshmem || disable) {
    c.transport = LowLatencyTransport::kCudaIpc;
    return c;
  }
  c.transport = LowLatencyTransport::kNvshmem;
  c.force_nvshmem = force;
  return c;
}

bool built_with_nvshmem() {
#if EPX_HAVE_NVSHMEM
  return true;
#else
  return false;
#endif
}

LowLatencyTransportChoice choose_low_latency_transport_from_env(bool has_low_latency_region) {
  return choose_low_latency_transport(has_low_latency_region, built_with_nvshmem(), std::getenv("EPX_DISABLE_NVSHMEM"),
                                      std::getenv("EPX_LL_FORCE_NVSHMEM"));
}

std::string describe_low_latency_transport(const LowLatencyTransportInfo& info) {
  const auto ranks = [](int n) { return cat(n, n == 1 ? " rank" : " ranks"); };
  switch (info.transport) {
    case EPX_LL_TRANSPORT_NONE:
      return "none (no low-latency region)";
    case EPX_LL_TRANSPORT_CUDA_IPC:
      return cat("cuda-ipc: ", ranks(info.num_peer_pointer_ranks), " through peer pointers");
    case EPX_LL_TRANSPORT_NVSHMEM:
      return cat("nvshmem: ", ranks(info.num_peer_pointer_ranks), " through peer pointers, ", info.num_nvshmem_ranks,
                 " through NVSHMEM puts");
  }
  return cat("unknown transport ", info.transport);
}

int64_t nvshmem_heap_bytes(int64_t region_bytes) {
  // NVSHMEM's own symmetric objects (team and barrier state) are small; 512 MiB also leaves room for a few
  // small buffers created while the first one lives. Larger ones need NVSHMEM_SYMMETRIC_SIZE.
  constexpr int64_t kSlack = int64_t(512) << 20;
  constexpr int64_t kMiB = int64_t(1) << 20;
  return (region_bytes + kSlack + kMiB - 1) / kMiB * kMiB;
}

const char* transport_name(LowLatencyTransport t) {
  switch (t) {
    case LowLatencyTransport::kNone:
      return "none";
    case LowLatencyTransport::kCudaIpc:
      return "cuda-ipc";
    case LowLatencyTransport::kNvshmem:
      return "nvshmem";
  }
  return "?";
}

}  // namespace epx
