// The low-latency region of a Buffer: where its memory lives and how every rank's copy is reached
// (runtime/ll_transport.hpp chooses; kernels/ll_transport.cuh uses the result).
#include <algorithm>

#include "runtime/buffer_impl.hpp"
#include "runtime/cuda_check.hpp"
#include "layout/ll_layout.hpp"
#if EPX_HAVE_NVSHMEM
#include "runtime/symmetric_memory.hpp"
#endif

namespace epx {

void Buffer::Impl::attach_low_latency_region() {
  if (ll_transport == LowLatencyTransport::kNone) return;
  // Low-latency ranks are the ranks of the one NVLink domain (create() rejects anything else), so the index a
  // kernel uses for a rank, its NVSHMEM PE and its bootstrap rank are the same number.
  if (ll_transport == LowLatencyTransport::kCudaIpc) {
    ll_local = static_cast<uint8_t*>(local) + ll_offset;
    for (int r = 0; r < num_nvl_ranks; ++r) ll_direct[r] = static_cast<uint8_t*>(peers[r]) + ll_offset;
  } else {
#if EPX_HAVE_NVSHMEM
    ll_local = static_cast<uint8_t*>(symmetric_alloc(*bootstrap, 2 * ll_set_bytes));
    for (int r = 0; r < num_nvl_ranks; ++r) {
      // This rank's own region is local memory: always written directly, also when NVSHMEM is forced.
      void* direct = r == nvl_rank ? ll_local : ll_force_nvshmem ? nullptr : symmetric_peer_pointer(ll_local, r);
      ll_direct[r] = static_cast<uint8_t*>(direct);
      ll_num_nvshmem += direct == nullptr ? 1 : 0;
    }
#else
    raise(Status::kInternal, "the NVSHMEM transport was chosen in a build without NVSHMEM");
#endif
  }
  for (int set = 0; set < 2; ++set)
    EPX_CUDA_CHECK(cudaMemset(ll_local + set * ll_set_bytes, 0,
                              std::min<int64_t>(LowLatencyLayout::kSignalsBytes, ll_set_bytes)));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
}

void Buffer::Impl::detach_low_latency_region(bool usable) {
#if EPX_HAVE_NVSHMEM
  if (ll_transport == LowLatencyTransport::kNvshmem && ll_local != nullptr) symmetric_free(ll_local, usable);
#else
  (void)usable;
#endif
  ll_local = nullptr;
  for (auto& d : ll_direct) d = nullptr;
  ll_num_nvshmem = 0;
}

LowLatencyTransportInfo Buffer::low_latency_transport() const {
  const Impl& b = *impl_;
  LowLatencyTransportInfo info{};
  info.transport = int(b.ll_transport);  // LowLatencyTransport mirrors EPX_LL_TRANSPORT_*
  if (b.ll_transport != LowLatencyTransport::kNone) {
    info.num_nvshmem_ranks = b.ll_num_nvshmem;
    info.num_peer_pointer_ranks = b.num_nvl_ranks - b.ll_num_nvshmem;
  }
  return info;
}

}  // namespace epx
