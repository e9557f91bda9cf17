// epx C++ API. The argument structs are the C ABI's (epx.h); this header adds RAII, exceptions and
// bootstrap objects. Every operation takes an explicit CUDA stream and is collective over the ranks of
// the Buffer: all ranks call the same operations in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/epx.h"

typedef struct CUstream_st* cudaStream_t;

namespace epx {

enum class Status : int {
  kOk = EPX_OK,
  kInvalidArgument = EPX_ERR_INVALID_ARGUMENT,
  kBufferTooSmall = EPX_ERR_BUFFER_TOO_SMALL,
  kCuda = EPX_ERR_CUDA,
  kTimeout = EPX_ERR_TIMEOUT,
  kBootstrap = EPX_ERR_BOOTSTRAP,
  kNotSupported = EPX_ERR_NOT_SUPPORTED,
  kFailedState = EPX_ERR_FAILED_STATE,
  kInternal = EPX_ERR_INTERNAL,
  kRemote = EPX_ERR_REMOTE,
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

// "All-gather these bytes" over the ranks of a job.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes `bytes` bytes; `recv` receives size() * bytes, rank-major. Throws epx::Error.
  virtual void all_gather(const void* send, void* recv, size_t bytes) = 0;
  void barrier();
};

// Adapts a C callback (what other languages pass through the C ABI).
class CallbackBootstrap : public Bootstrap {
 public:
  explicit CallbackBootstrap(const epx_bootstrap& c) : c_(c) {}
  int rank() const override { return c_.rank; }
  int size() const override { return c_.size; }
  void all_gather(const void* send, void* recv, size_t bytes) override;

 private:
  epx_bootstrap c_;
};

using Config = epx_config;
using Limits = epx_limits;
using BufferOptions = epx_buffer_options;
using LayoutArgs = epx_layout_args;
using LayoutOutputs = epx_layout_outputs;
using DispatchArgs = epx_dispatch_args;
using DispatchHandle = epx_dispatch_handle;
using DispatchOutputs = epx_dispatch_outputs;
using RecvRegionViews = epx_recv_region;
using CombineArgs = epx_combine_args;
using CombineOutputs = epx_combine_outputs;
using LowLatencyDispatchArgs = epx_ll_dispatch_args;
using LowLatencyDispatchOutputs = epx_ll_dispatch_outputs;
using LowLatencyHandle = epx_ll_handle;
using LowLatencyCombineArgs = epx_ll_combine_args;
using LowLatencyTransportInfo = epx_ll_transport_info;
constexpr int kLowLatencySendPhase = EPX_LL_SEND;
constexpr int kLowLatencyRecvPhase = EPX_LL_RECV;
constexpr int kLowLatencyBothPhases = EPX_LL_BOTH;

// The library's limits (epx_get_limits).
Limits limits();
// Channels of the high-throughput kernels under a config: num_sms / 2.
int num_channels(const Config& config);
Config default_dispatch_config(int num_ranks);
Config default_combine_config(int num_ranks);
void validate_config(const Config& config, int num_ranks);
// num_nvl_bytes a config needs for rows of hidden_bytes, assuming the largest scales and top-k we accept.
int64_t nvl_size_hint(const Config& config, int64_t hidden_bytes, int num_ranks);
// num_recv_bytes for an output region of `rows` rows of this shape (epx_recv_region_size_hint).
int64_t recv_region_size_hint(int rows, int hidden, int dtype, int num_scales, int num_topk);
// The internode mode over num_ranks = D x num_nvl_ranks: num_nvl_bytes and num_rdma_bytes a config needs.
struct InternodeSizes {
  int64_t nvl_bytes = 0;
  int64_t rdma_bytes = 0;
};
InternodeSizes internode_size_hints(const Config& config, int64_t hidden_bytes, int num_ranks, int num_nvl_ranks);
BufferOptions default_buffer_options();
// num_rdma_bytes for low-latency calls of up to M tokens per rank (both buffer sets).
int64_t low_latency_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts);
// Whether this libepx has the NVSHMEM transport of the low-latency mode.
bool built_with_nvshmem();
// E.g. "nvshmem: 1 rank through peer pointers, 3 through NVSHMEM puts", "cuda-ipc: 4 ranks through peer pointers".
std::string describe_low_latency_transport(const LowLatencyTransportInfo& info);

// One region of a buffer's memory on this rank (see epx_buffer_region).
struct MemoryRegion {
  void* ptr = nullptr;  // device pointer; nullptr when bytes == 0
  int64_t bytes = 0;
};

struct DispatchCounts {
  int num_recv_tokens = -1;       // -1 in worst-case mode (not waited for)
  int num_rdma_recv_tokens = -1;  // internode: records this rank's network rings receive
  std::vector<int> num_recv_tokens_per_expert;
};

class Buffer {
 public:
  // Collective: maps every peer's NVLink buffer through CUDA IPC.
  Buffer(Bootstrap& bootstrap, const BufferOptions& options);
  ~Buffer();  // calls destroy() if still alive (collective)
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Collective. Frees device and host memory, unmaps peers. Safe to call twice.
  void destroy();
  bool alive() const;

  int rank() const;
  int num_ranks() const;
  int device() const;
  int num_nvl_ranks() const;
  // Whether the internode (hierarchical) kernels serve this buffer (several NVLink domains, or forced).
  bool internode() const;
  int num_sms_on_device() const;
  void set_timeout(double seconds);
  double timeout() const;
  // Where the low-latency region lives and how each rank is reached (fixed at creation).
  LowLatencyTransportInfo low_latency_transport() const;

  // Waits for `stream`, then throws any error a kernel of this buffer recorded.
  void check(cudaStream_t stream);
  // This rank's memory of EPX_REGION_NVL (num_nvl_bytes of ring area) or EPX_REGION_RDMA (num_rdma_bytes of
  // low-latency area). Valid until destroy(); the operations of that mode overwrite it.
  MemoryRegion local_region(int which) const;

  void get_dispatch_layout(const LayoutArgs& args, const LayoutOutputs& outputs, cudaStream_t stream);

  // Dispatch step 1: count exchange. Fills handle's prefix matrices; unless args.num_worst_tokens > 0
  // waits (bounded) for the counts. handle.num_recv_tokens is set from the result.
  DispatchCounts notify_dispatch(const DispatchArgs& args, const Config& config, DispatchHandle& handle,
                                 cudaStream_t stream);
  // Both steps into outputs of outputs.num_rows rows, sized by a guess (epx_dispatch_sized); num_recv_tokens -1 in
  // the result: some rank's rows did not fit, and this rank repeats the dispatch with notify_dispatch and dispatch.
  DispatchCounts dispatch_sized(const DispatchArgs& args, const Config& config, DispatchHandle& handle,
                                const DispatchOutputs& outputs, cudaStream_t stream);
  // Dispatch step 2: data.
  void dispatch(const DispatchArgs& args, const Config& config, const DispatchHandle& handle,
                const DispatchOutputs& outputs, cudaStream_t stream);
  // Same routing as `handle`, new data; no count exchange, no host wait.
  void dispatch_cached(const DispatchArgs& args, const Config& config, const DispatchHandle& handle,
                       const DispatchOutputs& outputs, cudaStream_t stream);
  void combine(const CombineArgs& args, const Config& config, const DispatchHandle& handle,
               const CombineOutputs& outputs, cudaStream_t stream);
  // A dispatch into this rank's output region (epx_dispatch_in_buffer): cached false does notify_dispatch's work and
  // the data (its counts returned); cached true repeats handle's routing (empty counts).
  DispatchCounts dispatch_in_buffer(const DispatchArgs& args, const Config& config, DispatchHandle& handle, bool cached,
                                    RecvRegionViews& region, cudaStream_t stream);
  // Where a combine from the buffer reads this rank's expert outputs: recv_x (bf16 [capacity, hidden]) and
  // recv_topk_weights ([capacity, num_topk], null for 0); the other views null (epx_combine_region).
  RecvRegionViews combine_region(int hidden, int num_topk) const;
  // A combine whose rows every rank has put in its output region (epx_combine_in_buffer).
  void combine_in_buffer(const CombineArgs& args, const Config& config, const DispatchHandle& handle,
                         const CombineOutputs& outputs, cudaStream_t stream);

  // ---- low-latency mode: no host synchronization, fixed-size outputs, CUDA-graph capturable ----
  // Collective: zeroes the signalling areas of both buffer sets, then a barrier.
  void clean_low_latency_buffer(cudaStream_t stream);
  // phases kLowLatencySendPhase or kLowLatencyBothPhases fill `handle`; kLowLatencyRecvPhase completes the
  // dispatch that `handle` describes (same args and outputs).
  void low_latency_dispatch(const LowLatencyDispatchArgs& args, const LowLatencyDispatchOutputs& outputs, int phases,
                            LowLatencyHandle& handle, cudaStream_t stream);
  // Returns the buffer set used (pass it back with kLowLatencyRecvPhase). args.use_logfmt: the rows travel as
  // LogFMT (docs/logfmt.md), the receive call repeating it.
  int low_latency_combine(const LowLatencyCombineArgs& args, const LowLatencyHandle& handle, void* combined_x,
                          int phases, int buffer_set, cudaStream_t stream);
  // Where the next low-latency call reads zero-copy combine inputs: bf16 [L, R*M, hidden].
  void* next_low_latency_combine_buffer(const LowLatencyHandle& handle);
  // Rank masking (BufferOptions::enable_shrink; semantics.md section 9): this rank's device-side mask of the ranks its
  // low-latency calls leave out. Stream-ordered and local (see epx_ll_update_mask). After unmasking a rank, every
  // rank calls clean_low_latency_buffer before its next low-latency call.
  void low_latency_update_mask_buffer(int rank, bool mask, cudaStream_t stream);
  // Copies the mask into mask_status: num_ranks() int32 in device memory, 1 = masked.
  void low_latency_query_mask_buffer(int32_t* mask_status, cudaStream_t stream);
  void low_latency_clean_mask_buffer(cudaStream_t stream);
  bool shrink_enabled() const;
  double shrink_timeout() const;  // seconds a low-latency wait for one rank lasts before it masks the rank

  struct Impl;
  Impl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

const char* status_string(Status status);

}  // namespace epx
