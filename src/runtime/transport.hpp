// Which transport carries the low-latency mode of a Buffer, decided once at creation from the build and the
// environment (pure functions: tested on CPU machines).
//
//   EPX_DISABLE_NVSHMEM=1   a build with NVSHMEM keeps the low-latency region in the CUDA IPC buffer instead
//   EPX_LL_FORCE_NVSHMEM=1  every other rank is reached through NVSHMEM puts and atomics, even when a peer
//                           pointer exists (tests that path on one machine); needs a build with NVSHMEM
//
// Values: unset, "" or "0" mean off, "1" means on; anything else is an error (a typo must not silently test
// the other path).
#pragma once

#include <cstdint>

namespace epx {

enum class LowLatencyTransport : int {
  kNone = 0,     // the buffer has no low-latency region (num_rdma_bytes == 0)
  kCudaIpc = 1,  // region inside the CUDA IPC buffer; every peer through a peer pointer
  kNvshmem = 2,  // region in NVSHMEM symmetric memory; peer pointer where nvshmem_ptr gives one, else NVSHMEM
};

struct LowLatencyTransportChoice {
  LowLatencyTransport transport = LowLatencyTransport::kNone;
  bool force_nvshmem = false;  // kNvshmem only: no peer pointers to other ranks
};

// Parses a 0/1 switch; throws kInvalidArgument naming the variable for anything else.
bool parse_env_switch(const char* name, const char* value);

// The transport for a buffer; throws kNotSupported / kInvalidArgument for contradictory switches.
LowLatencyTransportChoice choose_low_latency_transport(bool has_low_latency_region, bool built_with_nvshmem,
                                                       const char* disable_nvshmem_env, const char* force_nvshmem_env);
// The same, reading EPX_DISABLE_NVSHMEM and EPX_LL_FORCE_NVSHMEM.
LowLatencyTransportChoice choose_low_latency_transport_from_env(bool has_low_latency_region);

// NVSHMEM_SYMMETRIC_SIZE that epx sets (when the user did not) before initialising NVSHMEM for a first region
// of region_bytes: the region, room for NVSHMEM's own allocations and for a few small buffers created later in
// the same process, rounded up to a whole MiB.
int64_t nvshmem_heap_bytes(int64_t region_bytes);

const char* transport_name(LowLatencyTransport t);

}  // namespace epx
