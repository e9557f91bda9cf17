// The peer map of a Buffer (layout/peer_map.hpp): which rank's memory a kernel reaches how. Built once at creation
// from every rank's PeerInfo: the NVLink buffers of the domain through CUDA IPC, the low-latency region inside the
// NVLink buffer or in NVSHMEM symmetric memory (runtime/transport.hpp chooses which).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "layout/ll_layout.hpp"
#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#if EPX_HAVE_NVSHMEM
#include "runtime/symmetric_memory.hpp"
#endif

namespace epx {
namespace {

std::string pci_id(const PeerInfo& p) {
  char id[32];
  std::snprintf(id, sizeof id, "%04x:%02x:%02x", unsigned(p.pci_domain), unsigned(p.pci_bus), unsigned(p.pci_device));
  return id;
}

// "GPU 0 (rank 0, PCI 0000:1b:00) and GPU 1 (rank 1, PCI 0000:43:00)": device numbers are each process's own.
std::string gpu_pair(const PeerInfo& mine, const PeerInfo& p) {
  return cat("GPU ", mine.device, " (rank ", mine.rank, ", PCI ", pci_id(mine), ") and GPU ", p.device, " (rank ",
             p.rank, ", PCI ", pci_id(p), ")");
}

// What a missing peer access means, after the sentence that names the pair.
constexpr const char* kNoPeerAccess =
    "The ranks of one NVLink domain read and write each other's GPU memory directly, so these GPUs cannot be ranks "
    "of one domain: use GPUs that have peer access between every pair (`nvidia-smi topo -m` shows the links, "
    "`nvidia-smi topo -p2p r` which pairs allow it; PCIe peer access can be blocked by the platform's ACS/IOMMU "
    "settings or a virtual machine)";

}  // namespace

FailState Buffer::Impl::fail_state() const {
  FailState f{};
  f.host = host_dev;
  f.self = control();
  f.budget_ns = uint64_t(timeout_s * 1e9);
  if (internode) {
    // Every rank of every domain polls its network abort word, and a failing kernel raises it everywhere.
    f.abort_word = &net_control()->abort;
    f.net_abort = &net_control()->abort;
    f.num_pes = num_ranks;
    f.rank = rank;
    return f;
  }
  f.abort_word = &control()->abort;
  for (int i = 0; i < num_nvl_ranks; ++i) f.abort_words[i] = &nvl_control(peer_map, i)->abort;
  f.num_ranks = num_nvl_ranks;
  f.rank = nvl_rank;
  return f;
}

void Buffer::Impl::map_peers(const std::vector<PeerInfo>& all) {
  const PeerInfo& mine = all[rank];
  const int domain_first = rank - nvl_rank;
  peer_map = PeerMap{};
  peer_map.rank = nvl_rank;
  peer_map.num_ranks = num_nvl_ranks;
  peer_map.nvl.local = static_cast<uint8_t*>(local);
  for (int j = 0; j < num_nvl_ranks; ++j) {
    const PeerInfo& p = all[domain_first + j];
    if (j == nvl_rank) {
      peer_map.nvl.peer[j] = peer_map.nvl.local;
      continue;
    }
    EPX_REQUIRE(std::strncmp(p.hostname, mine.hostname, sizeof(mine.hostname)) == 0, "rank ", p.rank, " is on host '",
                p.hostname, "', rank ", rank, " on '", mine.hostname, "': an NVLink domain must be one host");
    EPX_REQUIRE(!(p.pci_domain == mine.pci_domain && p.pci_bus == mine.pci_bus && p.pci_device == mine.pci_device),
                "ranks ", p.rank, " and ", rank, " use the same GPU (device ", device,
                "); use one GPU per rank (set the device before creating the Buffer, or options.device)");
    int can = 0;
    const cudaError_t query = cudaDeviceCanAccessPeer(&can, device, p.device);
    if (query == cudaErrorInvalidDevice)
      raise(Status::kNotSupported, "rank ", p.rank, " uses GPU ", p.device, " of its process (PCI ", pci_id(p),
            "), which is not a GPU of rank ", rank, "'s process (", gpu_pair(mine, p),
            "): every rank of a domain must see all GPUs of the domain, numbered alike (the same "
            "CUDA_VISIBLE_DEVICES in every rank, and cudaSetDevice per rank)");
    EPX_CUDA_CHECK(query);
    if (!can)
      raise(Status::kNotSupported, gpu_pair(mine, p),
            p.device == device
                ? " have the same device number in their processes, so they do not see the same GPUs (set the same "
                  "CUDA_VISIBLE_DEVICES in every rank and select each rank's GPU with cudaSetDevice or options.device)"
                : cat(" cannot reach each other over NVLink or PCIe peer-to-peer (cudaDeviceCanAccessPeer says no). ",
                      kNoPeerAccess));
    void* mapped = nullptr;
    const cudaError_t opened = cudaIpcOpenMemHandle(&mapped, p.handle, cudaIpcMemLazyEnablePeerAccess);
    if (opened != cudaSuccess) {
      const bool p2p = opened == cudaErrorPeerAccessUnsupported || opened == cudaErrorPeerAccessNotEnabled ||
                       opened == cudaErrorInvalidDevice;
      raise(Status::kCuda, "rank ", rank, " could not map the buffer of rank ", p.rank, " (", gpu_pair(mine, p),
            ") with cudaIpcOpenMemHandle: ", cudaGetErrorName(opened), " (", cudaGetErrorString(opened), ")",
            p2p ? cat(". The two GPUs cannot reach each other over NVLink or PCIe peer-to-peer. ", kNoPeerAccess)
                : std::string());
    }
    peer_map.nvl.peer[j] = static_cast<uint8_t*>(mapped);
  }
  try {
    attach_low_latency_region();
    attach_network_region();
  } catch (...) {
    detach_low_latency_region(true);
    release_ipc_buffer();  // its errors are raised on every rank alike, so every rank gets here
    throw;
  }
}

void Buffer::Impl::unmap_peers(bool usable) {
  detach_network_region(usable);
  detach_low_latency_region(usable);
}

void Buffer::Impl::attach_network_region() {
  NetworkMap& net = peer_map.net;
  net = NetworkMap{};
  if (!internode) return;
  net.domain = rank / num_nvl_ranks;
  net.num_domains = num_domains;
  net.local_rank = nvl_rank;
  net.num_local = num_nvl_ranks;
#if EPX_HAVE_NVSHMEM
  // Every peer of the network hop is reached through NVSHMEM operations, never a peer pointer (PeerMap::net).
  const int64_t bytes = NetRing::data_offset() + align_up(options.num_rdma_bytes, kAlign);
  net.local = static_cast<uint8_t*>(symmetric_alloc(*bootstrap, bytes));
  EPX_CUDA_CHECK(cudaMemset(net.local, 0, NetRing::data_offset()));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
#else
  raise(Status::kInternal, "the internode mode was chosen in a build without NVSHMEM");
#endif
}

void Buffer::Impl::detach_network_region(bool usable) {
#if EPX_HAVE_NVSHMEM
  if (peer_map.net.local != nullptr) symmetric_free(peer_map.net.local, usable);
#else
  (void)usable;
#endif
  peer_map.net = NetworkMap{};
}

void Buffer::Impl::attach_low_latency_region() {
  RegionMap& ll = peer_map.ll;
  ll = RegionMap{};
  if (ll_transport == LowLatencyTransport::kNone) return;
  // Low-latency ranks are the ranks of the one NVLink domain (create() rejects anything else), so the index a
  // kernel uses for a rank, its NVSHMEM PE and its bootstrap rank are the same number.
  if (ll_transport == LowLatencyTransport::kCudaIpc) {
    ll.local = peer_map.nvl.local + ll_offset;
    for (int r = 0; r < num_nvl_ranks; ++r) ll.peer[r] = peer_map.nvl.peer[r] + ll_offset;
  } else {
#if EPX_HAVE_NVSHMEM
    ll.local = static_cast<uint8_t*>(symmetric_alloc(*bootstrap, 2 * ll_set_bytes));
    for (int r = 0; r < num_nvl_ranks; ++r) {
      // This rank's own region is local memory: always written directly, also when NVSHMEM is forced.
      void* direct = r == nvl_rank ? ll.local : ll_force_nvshmem ? nullptr : symmetric_peer_pointer(ll.local, r);
      ll.peer[r] = static_cast<uint8_t*>(direct);
      ll.num_nvshmem += direct == nullptr ? 1 : 0;
    }
#else
    raise(Status::kInternal, "the NVSHMEM transport was chosen in a build without NVSHMEM");
#endif
  }
  for (int set = 0; set < 2; ++set)
    EPX_CUDA_CHECK(
        cudaMemset(ll.local + set * ll_set_bytes, 0, std::min<int64_t>(LowLatencyLayout::kSignalsBytes, ll_set_bytes)));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
}

void Buffer::Impl::detach_low_latency_region(bool usable) {
  RegionMap& ll = peer_map.ll;
#if EPX_HAVE_NVSHMEM
  if (ll_transport == LowLatencyTransport::kNvshmem && ll.local != nullptr) symmetric_free(ll.local, usable);
#else
  (void)usable;
#endif
  ll = RegionMap{};
}

void Buffer::Impl::release_ipc_buffer() {
  for (int j = 0; j < num_nvl_ranks; ++j)
    if (j != nvl_rank && peer_map.nvl.peer[j] != nullptr) cudaIpcCloseMemHandle(peer_map.nvl.peer[j]);
  bootstrap->barrier();  // nobody maps this rank's buffer any more
  cudaFree(local);
  cudaFreeHost(host);
  local = nullptr;
  host = host_dev = nullptr;
  peer_map.nvl = RegionMap{};
  cudaGetLastError();
}

LowLatencyTransportInfo Buffer::low_latency_transport() const {
  const Impl& b = *impl_;
  LowLatencyTransportInfo info{};
  info.transport = int(b.ll_transport);  // LowLatencyTransport mirrors EPX_LL_TRANSPORT_*
  if (b.ll_transport != LowLatencyTransport::kNone) {
    info.num_nvshmem_ranks = b.peer_map.ll.num_nvshmem;
    info.num_peer_pointer_ranks = b.num_nvl_ranks - b.peer_map.ll.num_nvshmem;
  }
  return info;
}

}  // namespace epx
