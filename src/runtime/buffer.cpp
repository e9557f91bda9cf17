// Buffer creation and teardown (CUDA IPC mapping of every peer's NVLink buffer), failure reporting.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/diagnostics.hpp"
#include "runtime/shrink.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

constexpr uint32_t kPeerInfoMagic = 0x65707831;  // "epx1"

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// The first CUDA call of a Buffer failed. Without a GPU or a driver the CUDA runtime answers
// cudaErrorInsufficientDriver or cudaErrorNoDevice, whose own texts do not say that: say it in words, keeping the
// CUDA error's name. Other errors are reported as they are.
[[noreturn]] void raise_first_cuda_failure(cudaError_t err, const char* call) {
  const std::string cuda = cat("(", call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), ")");
  constexpr const char* kNeeds =
      "epx needs an NVIDIA GPU (Hopper, sm_90) with its driver; without one, only the "
      "host-side API works (configs, size hints, limits, the reference model)";
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed (or libcuda.so cannot be loaded)
  cudaRuntimeGetVersion(&runtime);
  if (err == cudaErrorNoDevice)
    raise(Status::kCuda,
          "no NVIDIA GPU was found: the driver is there but sees no GPU (check nvidia-smi, and that "
          "CUDA_VISIBLE_DEVICES is not empty or wrong). ",
          kNeeds, " ", cuda);
  if (err == cudaErrorInsufficientDriver && driver == 0)
    raise(Status::kCuda,
          "no NVIDIA GPU driver was found on this machine (libcuda.so is not installed or could not "
          "be loaded), so no GPU can be used. ",
          kNeeds, " ", cuda);
  if (err == cudaErrorInsufficientDriver)
    raise(Status::kCuda, "the NVIDIA driver is too old for this libepx: it supports CUDA ", driver / 1000, ".",
          driver % 1000 / 10, ", libepx was built with CUDA ", runtime / 1000, ".", runtime % 1000 / 10,
          ": update the driver. ", cuda);
  raise(Status::kCuda, call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

}  // namespace

void Buffer::Impl::enter(const char* op) {
  if (!alive) raise(Status::kFailedState, op, ": the buffer was destroyed");
  if (failed) raise(Status::kFailedState, op, ": the buffer is unusable after an earlier failure: ", failure);
  int now = -1;
  if (cudaGetDevice(&now) != cudaSuccess || now != device) EPX_CUDA_CHECK(cudaSetDevice(device));
}

void Buffer::Impl::check_launch(cudaError_t err, const char* op) {
  if (err != cudaSuccess) raise_device_failure(err, op);
}

void Buffer::Impl::raise_device_failure(cudaError_t err, const char* op) {
  // A trapping kernel writes its diagnostic before it traps; give the PCIe writes a moment to land.
  std::atomic_thread_fence(std::memory_order_acquire);
  const DeviceDiag diag = read_diag(&host->fatal);
  failed = true;
  std::string msg = cat(op, ": ");
  Status status = Status::kCuda;
  if (diag.code == kErrTimeout) {
    status = Status::kTimeout;
    msg += describe_fatal(diag, timeout_s);
  } else if (diag.code == kErrAbortedByPeer) {
    status = Status::kRemote;
    msg += describe_fatal(diag, timeout_s);
  } else {
    msg += cat("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  msg += msg.back() == '?' ? " " : ". ";  // a diagnosis may end in a question
  msg += "The buffer is unusable: destroy it";
  if (err != cudaSuccess) msg += "; the CUDA context is lost, so the process must restart to use the GPU again";
  failure = msg;
  throw Error(status, msg);
}

void Buffer::Impl::raise_if_input_error(const char* op, cudaStream_t stream) {
  volatile HostShared* h = host;
  const int code = h->op_error;
  if (code == 0) return;
  const int who = h->op_error_rank;
  std::string msg;
  Status status;
  const int me = internode ? rank : nvl_rank;  // the rank numbers the notify of this mode reports
  if (who == me || code == kErrWorstTokensExceeded || code == kErrShapeMismatch || code == kErrRecvRegionExceeded) {
    const DeviceDiag diag = read_diag(&host->input);
    msg = describe_input(code, diag, who);
    status = code == kErrRecvRegionExceeded ? Status::kBufferTooSmall : Status::kInvalidArgument;
  } else {
    msg = cat("rank ", who, " reported invalid input (", error_name(code), "); see that rank's error");
    status = Status::kRemote;
  }
  // Clear the sticky state on this rank; every rank's call reports the same error.
  h->op_error = 0;
  h->input.code = 0;
  cudaMemsetAsync(&control()->op_error, 0, sizeof(int32_t) * 2, stream);
  raise(status, op, ": ", msg);
}

void Buffer::Impl::require_not_capturing(cudaStream_t stream, const char* op) const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();  // a query that failed leaves no error behind; the launch reports a bad stream
    return;
  }
  if (status != cudaStreamCaptureStatusNone)
    raise(
        Status::kInvalidArgument, op,
        ": the stream is being captured into a CUDA graph, but this dispatch waits on the host for its counts, which "
        "a captured count exchange never delivers; pass num_worst_tokens (worst-case mode: no host wait) to capture a "
        "dispatch with a layout, or a handle (cached dispatch)");
}

void Buffer::Impl::wait_notify(int seq, const char* op, cudaStream_t stream) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto budget = std::chrono::duration<double>(timeout_s + 5.0);  // the device wait fails first
  volatile int32_t* flag = &host->notify_seq;
  for (uint64_t spin = 0;; ++spin) {
    if (*flag == seq) break;
    if ((spin & 1023) == 1023) {
      const cudaError_t err = cudaStreamQuery(stream);
      if (err != cudaSuccess && err != cudaErrorNotReady) raise_device_failure(err, op);
      if (*flag == seq) break;
      if (clock::now() - start > budget)
        raise(Status::kTimeout, op, ": rank ", rank, " waited ", timeout_s + 5.0,
              " s for the count exchange; a peer did not call it, or the stream is blocked by earlier work");
      if (clock::now() - start > std::chrono::milliseconds(5)) std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // pairs with notify's st.release.sys of notify_seq
}

void Buffer::Impl::create(Bootstrap& bs, const BufferOptions& opts) {
  bootstrap = &bs;
  options = opts;
  rank = bs.rank();
  num_ranks = bs.size();
  timeout_s = opts.timeout_s > 0 ? opts.timeout_s : kDefaultTimeoutSeconds;
  validate_num_ranks(num_ranks, "Buffer", "bootstrap size");  // as the default configs and size hints check it
  EPX_REQUIRE(rank >= 0 && rank < num_ranks, "bootstrap rank ", rank, " is outside [0, ", num_ranks, ")");
  EPX_REQUIRE(opts.num_nvl_bytes >= 0 && opts.num_rdma_bytes >= 0 && opts.num_recv_bytes >= 0,
              "buffer sizes must be >= 0");
  const DomainChoice domains = choose_domains(bs, opts);  // collective
  num_nvl_ranks = domains.num_nvl_ranks;
  internode = domains.internode;
  num_domains = num_ranks / num_nvl_ranks;
  nvl_rank = rank % num_nvl_ranks;
  // Rank masking is a feature of the low-latency region (an internode buffer's num_rdma_bytes are its rings).
  shrink = opts.enable_shrink != 0;
  shrink_timeout_s = shrink_timeout_seconds(opts.shrink_timeout_s, std::getenv("EPX_LL_SHRINK_TIMEOUT_S"));
  EPX_REQUIRE(!shrink || (!internode && opts.num_rdma_bytes > 0),
              "enable_shrink (rank masking) needs a low-latency region: num_rdma_bytes > 0 (low_latency_size_hint) "
              "in a buffer over one NVLink domain");
  if (internode) {
    if (!built_with_nvshmem())
      raise(Status::kNotSupported, "the internode mode (", num_domains, " NVLink domains of ", num_nvl_ranks, " ranks",
            num_domains == 1 ? ", forced" : "",
            ") needs a libepx built with NVSHMEM: configure with "
            "-DEPX_NVSHMEM=ON -DEPX_NVSHMEM_DIR=... (or run EPX_NVSHMEM=1 scripts/setup.sh)");
    if (opts.low_latency_mode)
      raise(Status::kNotSupported,
            "low_latency_mode in a buffer over several NVLink domains: the low-latency mode "
            "runs inside one domain (create a separate buffer for it)");
  }

  int device_count = 0;
  // The Buffer's first CUDA call: where a machine without a GPU or driver is found out.
  const cudaError_t count_err = cudaGetDeviceCount(&device_count);
  if (count_err != cudaSuccess) raise_first_cuda_failure(count_err, "cudaGetDeviceCount");
  if (device_count == 0) raise_first_cuda_failure(cudaErrorNoDevice, "cudaGetDeviceCount");
  if (opts.device >= 0) {
    EPX_REQUIRE(opts.device < device_count, "device ", opts.device, " does not exist (", device_count, " visible)");
    device = opts.device;
  } else {
    EPX_CUDA_CHECK(cudaGetDevice(&device));
  }
  EPX_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  num_device_sms = prop.multiProcessorCount;

  EPX_REQUIRE(opts.num_recv_bytes == 0 || !internode,
              "num_recv_bytes (the output region of a dispatch into the buffer) is for buffers over one NVLink domain");
  recv_offset = nvl_data_offset() + align_up(opts.num_nvl_bytes, kAlign);
  ll_offset = recv_offset + align_up(opts.num_recv_bytes, kAlign);
  // An internode buffer's num_rdma_bytes are its network rings (attach_network_region).
  ll_set_bytes = internode ? 0 : align_up(opts.num_rdma_bytes, 2 * kAlign) / 2;
  const LowLatencyTransportChoice transport = choose_low_latency_transport_from_env(ll_set_bytes > 0);
  ll_transport = transport.transport;
  ll_force_nvshmem = transport.force_nvshmem;
  ll_launch.early = parse_env_switch("EPX_LL_EARLY_LAUNCH", std::getenv("EPX_LL_EARLY_LAUNCH"));
  if (const char* graphs = std::getenv("EPX_LL_GRAPH_LAUNCH");
      graphs != nullptr && !parse_env_switch("EPX_LL_GRAPH_LAUNCH", graphs))
    ll_graphs.turn_off();
  has_dispatch_split = parse_dispatch_split(std::getenv("EPX_HT_DISPATCH_SPLIT"), &dispatch_split);
  in_buffer_self_warps = parse_in_buffer_self_warps(std::getenv("EPX_HT_IN_BUFFER_SELF_WARPS"));
  in_buffer_notify_kernel =
      parse_env_switch("EPX_HT_IN_BUFFER_NOTIFY_KERNEL", std::getenv("EPX_HT_IN_BUFFER_NOTIFY_KERNEL"));
  sized_notify_kernel = parse_env_switch("EPX_HT_SIZED_NOTIFY_KERNEL", std::getenv("EPX_HT_SIZED_NOTIFY_KERNEL"));
  if (const char* early = std::getenv("EPX_HT_EARLY_SENDERS"); early != nullptr)
    early_senders = parse_env_switch("EPX_HT_EARLY_SENDERS", early);
  // With NVSHMEM the low-latency region is a symmetric allocation of its own (attach_low_latency_region).
  alloc_bytes = ll_offset + (ll_transport == LowLatencyTransport::kCudaIpc ? 2 * ll_set_bytes : 0);
  EPX_CUDA_CHECK(cudaMalloc(&local, alloc_bytes));
  EPX_CUDA_CHECK(cudaMemset(local, 0, nvl_data_offset()));
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(HostShared), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(HostShared));
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());

  PeerInfo mine{};
  mine.magic = kPeerInfoMagic;
  mine.rank = rank;
  mine.device = device;
  mine.pci_domain = prop.pciDomainID;
  mine.pci_bus = prop.pciBusID;
  mine.pci_device = prop.pciDeviceID;
  mine.num_nvl_ranks = num_nvl_ranks;
  mine.low_latency_mode = opts.low_latency_mode;
  mine.ll_transport = int32_t(ll_transport);
  mine.ll_force_nvshmem = ll_force_nvshmem;
  mine.ll_early_launch = ll_launch.early;
  mine.enable_shrink = shrink;
  mine.num_sms = num_device_sms;
  mine.alloc_bytes = alloc_bytes;
  gethostname(mine.hostname, sizeof(mine.hostname) - 1);
  EPX_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, local));
  std::vector<PeerInfo> all(num_ranks);
  bs.all_gather(&mine, all.data(), sizeof(PeerInfo));

  for (int i = 0; i < num_ranks; ++i) {
    const PeerInfo& p = all[i];
    EPX_REQUIRE(p.magic == kPeerInfoMagic && p.rank == i, "bootstrap all-gather returned garbage for rank ", i,
                " (is every rank creating a Buffer at the same time, with the same library version?)");
    EPX_REQUIRE(
        p.alloc_bytes == alloc_bytes && p.num_nvl_ranks == num_nvl_ranks && p.low_latency_mode == mine.low_latency_mode,
        "buffer options differ between ranks: rank ", i, " has ", p.alloc_bytes, " bytes / num_nvl_ranks ",
        p.num_nvl_ranks, ", rank ", rank, " has ", alloc_bytes, " / ", num_nvl_ranks);
    EPX_REQUIRE(p.ll_transport == mine.ll_transport && p.ll_force_nvshmem == mine.ll_force_nvshmem,
                "ranks disagree on the low-latency transport: rank ", i, " chose ",
                transport_name(LowLatencyTransport(p.ll_transport)), p.ll_force_nvshmem ? " (forced)" : "", ", rank ",
                rank, " chose ", transport_name(ll_transport), ll_force_nvshmem ? " (forced)" : "",
                " (EPX_DISABLE_NVSHMEM and EPX_LL_FORCE_NVSHMEM must be the same on every rank, and libepx the same"
                " build)");
    EPX_REQUIRE(p.enable_shrink == mine.enable_shrink, "enable_shrink differs between ranks: rank ", i, " has ",
                p.enable_shrink, ", rank ", rank, " has ", mine.enable_shrink);
    EPX_REQUIRE(p.ll_early_launch == mine.ll_early_launch, "EPX_LL_EARLY_LAUNCH differs between ranks: rank ", i,
                " has ", p.ll_early_launch, ", rank ", rank, " has ", mine.ll_early_launch);
  }
  // The low-latency kernels count completed blocks per op (kernels/low_latency/epochs.cuh): every rank launches the
  // same grid, one block per SM of the smallest GPU (and at most kLowLatencyMaxBlocks).
  ll_launch.grid = kLowLatencyMaxBlocks;
  for (const PeerInfo& p : all) ll_launch.grid = std::min(ll_launch.grid, low_latency_grid(p.num_sms));
  EPX_REQUIRE(ll_launch.grid >= 1, "a rank reported no SMs");
  map_peers(all);
  alive = true;
  bs.barrier();  // no rank writes into a peer's buffer before every rank has mapped and zeroed its own
}

void Buffer::Impl::destroy() {
  if (!alive) return;
  alive = false;
  DeviceGuard guard(device);
  // A failed (trapped) context answers every call with an error; free what can be freed, keep the barriers.
  const char context_ok = cudaDeviceSynchronize() == cudaSuccess ? 1 : 0;
  std::string ok(size_t(num_ranks), '\0');
  bootstrap->all_gather(&context_ok, ok.data(), 1);  // every rank's kernels are done with every buffer
  ll_graphs.clear();                                 // their launches are complete (the synchronize above)
  unmap_peers(ok.find('\0') == std::string::npos);
  release_ipc_buffer();
}

// ---- Buffer ----------------------------------------------------------------------------------------------------

Buffer::Buffer(Bootstrap& bootstrap, const BufferOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->create(bootstrap, options);
}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (...) {
    // A destructor must not throw; destroy() explicitly to see teardown errors.
  }
}

void Buffer::destroy() { impl_->destroy(); }
bool Buffer::alive() const { return impl_->alive; }
int Buffer::rank() const { return impl_->rank; }
int Buffer::num_ranks() const { return impl_->num_ranks; }
int Buffer::device() const { return impl_->device; }
int Buffer::num_nvl_ranks() const { return impl_->num_nvl_ranks; }
bool Buffer::internode() const { return impl_->internode; }
int Buffer::num_sms_on_device() const { return impl_->num_device_sms; }
double Buffer::timeout() const { return impl_->timeout_s; }

void Buffer::set_timeout(double seconds) {
  EPX_REQUIRE(seconds > 0 && seconds < 1e7, "timeout must be in (0, 1e7) seconds, got ", seconds);
  impl_->timeout_s = seconds;
}

void Buffer::check(cudaStream_t stream) {
  Impl& b = *impl_;
  b.enter("check");
  const cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) b.raise_device_failure(err, "check");
  b.raise_if_input_error("check", stream);
  // An input error of this rank's own kernels that no notify has shared yet (low-latency mode, layout).
  volatile HostShared* h = b.host;
  if (h->input.code != 0) {
    const DeviceDiag diag = read_diag(&h->input);
    h->input.code = 0;
    cudaMemsetAsync(&b.control()->local_error, 0, sizeof(int32_t), stream);
    cudaStreamSynchronize(stream);
    raise(Status::kInvalidArgument, "check: ", describe_input(diag.code, diag, b.rank));
  }
}

MemoryRegion Buffer::local_region(int which) const {
  const Impl& b = *impl_;
  EPX_REQUIRE(which == EPX_REGION_NVL || which == EPX_REGION_RDMA, "local_region: which must be EPX_REGION_NVL (",
              EPX_REGION_NVL, ") or EPX_REGION_RDMA (", EPX_REGION_RDMA, "), got ", which);
  if (!b.alive) raise(Status::kFailedState, "local_region: the buffer was destroyed");
  // The layout of the allocation is create()'s: control block, ring area, low-latency sets. The regions are
  // what the caller asked for, not the padding after them.
  const bool nvl = which == EPX_REGION_NVL;
  MemoryRegion r;
  r.bytes = nvl ? b.options.num_nvl_bytes : b.options.num_rdma_bytes;
  // The RDMA region is the low-latency region: inside the CUDA IPC allocation (at ll_offset), or, with NVSHMEM,
  // a symmetric allocation of its own, which the IPC allocation has no room for.
  if (r.bytes > 0)
    r.ptr = nvl           ? static_cast<uint8_t*>(b.local) + b.nvl_data_offset()
            : b.internode ? b.peer_map.net.local + NetRing::data_offset()
                          : b.peer_map.ll.local;
  return r;
}

BufferOptions default_buffer_options() {
  BufferOptions o{};
  o.timeout_s = kDefaultTimeoutSeconds;
  o.device = -1;
  return o;
}

}  // namespace epx
