// Internal state of a Buffer: device memory, the peer map, the host-mapped block, failure state.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "layout/fail_state.hpp"
#include "layout/host_shared.hpp"
#include "layout/internode_layout.hpp"
#include "layout/ll_params.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/peer_map.hpp"
#include "runtime/dispatch_split.hpp"
#include "runtime/domains.hpp"
#include "runtime/low_latency_launch.hpp"
#include "runtime/transport.hpp"

namespace epx {

// What every rank publishes when a Buffer is created (runtime/buffer.cpp gathers it, runtime/peer_map.cpp maps
// the peers from it).
struct PeerInfo {
  uint32_t magic;
  int32_t rank;
  int32_t device;
  int32_t pci_domain, pci_bus, pci_device;
  int32_t num_nvl_ranks;
  int32_t low_latency_mode;
  int32_t ll_transport;  // LowLatencyTransport: the same build and switches on every rank
  int32_t ll_force_nvshmem;
  int32_t ll_early_launch;
  int32_t enable_shrink;
  int32_t num_sms;  // the low-latency grid is the smallest over the ranks (the same everywhere)
  int64_t alloc_bytes;
  char hostname[64];
  cudaIpcMemHandle_t handle;
};

struct Buffer::Impl {
  Bootstrap* bootstrap = nullptr;  // must outlive the Buffer (creation and destroy are collective)
  BufferOptions options{};
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  int num_nvl_ranks = 0;   // NVLink domain size G
  int nvl_rank = 0;        // index inside the domain
  int num_domains = 1;     // D = num_ranks / num_nvl_ranks
  bool internode = false;  // the internode kernels serve this buffer (D > 1, or forced)
  int num_device_sms = 0;
  double timeout_s = kDefaultTimeoutSeconds;

  void* local = nullptr;  // this rank's NVLink buffer: NvlControl, ring data, output region, low-latency sets
  int64_t alloc_bytes = 0;
  // How kernels reach every rank's memory (layout/peer_map.hpp): the NVLink buffers of the domain through CUDA
  // IPC, the low-latency region through CUDA IPC or NVSHMEM. Built by map_peers.
  PeerMap peer_map{};
  HostShared* host = nullptr;      // host view of the host-mapped block
  HostShared* host_dev = nullptr;  // device view
  int host_seq = 0;                // sequence numbers of notify calls waited for by the host

  // The output region of a dispatch into the buffer (layout/recv_region.hpp): options.num_recv_bytes at recv_offset
  // of the IPC buffer, after the ring data.
  int64_t recv_offset = 0;
  // Low-latency region: two buffer sets of ll_set_bytes each, after the ring region of the IPC buffer
  // (kCudaIpc) or in NVSHMEM symmetric memory (kNvshmem). See runtime/transport.hpp.
  int64_t ll_offset = 0;
  int64_t ll_set_bytes = 0;
  int ll_next_set = 0;           // alternates on every low-latency call (dispatch or combine)
  LowLatencyLaunch ll_launch{};  // the same grid on every rank (create)
  // Graphs of repeated low-latency launches (runtime/launch_graphs.hpp); off with EPX_LL_GRAPH_LAUNCH=0.
  LaunchGraphs ll_graphs{destroy_launch_graph};
  // $EPX_HT_DISPATCH_SPLIT at creation (has_dispatch_split), else the defaults per row format (dispatch_split.hpp)
  bool has_dispatch_split = false;
  DispatchSplit dispatch_split{};
  int in_buffer_self_warps = 0;          // $EPX_HT_IN_BUFFER_SELF_WARPS at creation; 0: default_in_buffer_self_warps
  bool in_buffer_notify_kernel = false;  // $EPX_HT_IN_BUFFER_NOTIFY_KERNEL at creation (in_buffer_ops.cpp)
  bool sized_notify_kernel = false;      // $EPX_HT_SIZED_NOTIFY_KERNEL at creation (intranode_ops.cpp)
  bool early_senders = true;             // $EPX_HT_EARLY_SENDERS at creation, default on (intranode_ops.cpp)
  // Per set: the call sent there and not yet received (0 none, 1 dispatch, 2 combine). A rank receives a call
  // before it sends the next one on the same set (docs/semantics.md); the kernels rely on it (their epochs).
  int ll_waiting[2] = {0, 0};
  int ll_waiting_format[2] = {0, 0};  // a call waiting there: its row format (dispatch: fp8 | ue8m0 << 1; combine:
                                      // use_logfmt)
  // ... and which call it is: two pointers its receive must repeat (dispatch: its recv_src_info and
  // recv_layout_range; combine: the handle's recv_src_info and combined_x), so that a stale hook is rejected
  // unless it names the very same tensors.
  const void* ll_waiting_id[2][2] = {};
  LowLatencyTransport ll_transport = LowLatencyTransport::kNone;
  bool ll_force_nvshmem = false;
  // Rank masking (options.enable_shrink; kernels/low_latency/shrink.cuh): the mask is NvlControl::ll_mask.
  bool shrink = false;
  double shrink_timeout_s = kDefaultShrinkTimeoutSeconds;
  // Set when a rank is unmasked: the signals may hold what a masked rank wrote (or missed), so the next low-latency
  // call needs clean_low_latency_buffer first (runtime/low_latency_mask.cpp).
  bool ll_clean_needed = false;

  bool alive = false;
  bool failed = false;
  std::string failure;

  NvlControl* control() const { return static_cast<NvlControl*>(local); }
  // Where the ring data of the NVLink buffer starts (after the control blocks of the buffer's mode).
  int64_t nvl_data_offset() const { return internode ? InternodeNvlLayout::data_offset() : RingLayout::data_offset(); }
  NetControl* net_control() const { return reinterpret_cast<NetControl*>(peer_map.net.local); }
  int64_t ring_bytes_available() const { return options.num_nvl_bytes; }
  FailState fail_state() const;
  // What the low-latency kernels get of the mask: null words without enable_shrink.
  RankMask rank_mask() const;

  // Throws kFailedState if an earlier failure made the buffer unusable; switches to the buffer's device.
  void enter(const char* op);
  // After a launch or query: turns a CUDA error into a fatal failure with the kernel's diagnostic.
  void check_launch(cudaError_t err, const char* op);
  [[noreturn]] void raise_device_failure(cudaError_t err, const char* op);
  // Reports (and clears on this rank) the collective input error the last notify recorded, if any.
  void raise_if_input_error(const char* op, cudaStream_t stream);
  // Polls the host-mapped block until notify with sequence `seq` has published its counts (bounded).
  void wait_notify(int seq, const char* op, cudaStream_t stream);
  // Before queueing an operation whose host waits for its counts: kInvalidArgument if the stream is being captured
  // into a CUDA graph (the captured notify never runs, so the wait could only time out).
  void require_not_capturing(cudaStream_t stream, const char* op) const;

  void create(Bootstrap& bs, const BufferOptions& opts);
  void destroy();
  // The peer map (runtime/peer_map.cpp). map_peers: after every rank's PeerInfo is known; opens the domain's
  // NVLink buffers and attaches the low-latency region. unmap_peers: the reverse, before this rank's memory is
  // freed; `usable` is false when some rank's CUDA context is lost. Both collective.
  void map_peers(const std::vector<PeerInfo>& all);
  void unmap_peers(bool usable);
  // Unmaps the peers' buffers, then (after a barrier) frees this rank's. Collective.
  void release_ipc_buffer();

 private:
  void attach_low_latency_region();
  void detach_low_latency_region(bool usable);
  // The internode network region: NetControl, then num_rdma_bytes of ring data, in NVSHMEM symmetric memory.
  void attach_network_region();
  void detach_network_region(bool usable);
};

}  // namespace epx
