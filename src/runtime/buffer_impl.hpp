// Internal state of a Buffer: device memory, peer mappings, host-mapped block, failure state.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "epx/epx.hpp"
#include "layout/fail_state.hpp"
#include "layout/host_shared.hpp"
#include "runtime/transport.hpp"
#include "layout/nvl_layout.hpp"

namespace epx {

struct Buffer::Impl {
  Bootstrap* bootstrap = nullptr;  // must outlive the Buffer (creation and destroy are collective)
  BufferOptions options{};
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  int num_nvl_ranks = 0;           // NVLink domain size
  int nvl_rank = 0;                // index inside the domain
  int num_device_sms = 0;
  double timeout_s = kDefaultTimeoutSeconds;

  void* local = nullptr;           // this rank's buffer: NvlControl, then ring data
  int64_t alloc_bytes = 0;
  void* peers[kMaxNvlRanks] = {};  // every domain rank's buffer as mapped here (peers[nvl_rank] == local)
  HostShared* host = nullptr;      // host view of the host-mapped block
  HostShared* host_dev = nullptr;  // device view
  int host_seq = 0;                // sequence numbers of notify calls waited for by the host

  // Low-latency region: two buffer sets of ll_set_bytes each, after the ring region of the IPC buffer
  // (kCudaIpc) or in NVSHMEM symmetric memory (kNvshmem). See runtime/ll_transport.hpp.
  int64_t ll_offset = 0;
  int64_t ll_set_bytes = 0;
  int ll_next_set = 0;             // alternates on every low-latency call (dispatch or combine)
  int ll_grid = 0;                 // blocks of every low-latency launch, the same on every rank (create)
  // Per set: the call sent there and not yet received (0 none, 1 dispatch, 2 combine). A rank receives a call
  // before it sends the next one on the same set (docs/semantics.md); the kernels rely on it (their epochs).
  int ll_waiting[2] = {0, 0};
  int ll_waiting_format[2] = {0, 0};  // a dispatch waiting there: its record format (fp8 | ue8m0 << 1)
  // ... and which call it is: two pointers its receive must repeat (dispatch: its recv_src_info and
  // recv_layout_range; combine: the handle's recv_src_info and combined_x), so that a stale hook is rejected
  // unless it names the very same tensors.
  const void* ll_waiting_id[2][2] = {};
  LowLatencyTransport ll_transport = LowLatencyTransport::kNone;
  bool ll_force_nvshmem = false;
  uint8_t* ll_local = nullptr;                // this rank's region
  uint8_t* ll_direct[kMaxNvlRanks] = {};      // rank r's region as mapped here; nullptr: through NVSHMEM
  int ll_num_nvshmem = 0;                     // ranks reached through NVSHMEM

  bool alive = false;
  bool failed = false;
  std::string failure;

  NvlControl* control() const { return static_cast<NvlControl*>(local); }
  int64_t ring_bytes_available() const { return options.num_nvl_bytes; }
  FailEnv fail_env() const;

  // Throws kFailedState if an earlier failure made the buffer unusable; switches to the buffer's device.
  void enter(const char* op);
  // After a launch or query: turns a CUDA error into a fatal failure with the kernel's diagnostic.
  void check_launch(cudaError_t err, const char* op);
  [[noreturn]] void raise_device_failure(cudaError_t err, const char* op);
  // Reports (and clears on this rank) the collective input error the last notify recorded, if any.
  void raise_if_input_error(const char* op, cudaStream_t stream);
  // Polls the host-mapped block until notify with sequence `seq` has published its counts (bounded).
  void wait_notify(int seq, const char* op, cudaStream_t stream);

  void create(Bootstrap& bs, const BufferOptions& opts);
  void destroy();
  // The low-latency region's memory and peer access (runtime/ll_region.cpp): after the IPC mapping in create,
  // before the barrier in destroy. Collective.
  void attach_low_latency_region();
  void detach_low_latency_region(bool usable);
  // Unmaps the peers' buffers, then (after a barrier) frees this rank's. Collective.
  void release_ipc_buffer();
};

}  // namespace epx
