#include <sys/mman.h>

#include <cstdint>

#include "gate.hpp"

namespace epx::bench {
namespace {

constexpr size_t kPage = 4096;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void gate_kernel(uint64_t ns) {
  const uint64_t start = now_ns();
  while (now_ns() - start < ns) {
  }
}

// Volatile loads of host-mapped memory: every poll goes to the host page (no data is read behind the word, so
// no acquire is needed).
__global__ void release_gate_kernel(const volatile uint32_t* word, uint32_t seq, uint32_t* expired, uint64_t max_ns) {
  const uint64_t start = now_ns();
  while (int32_t(*word - seq) < 0) {
    if (now_ns() - start > max_ns) {
      atomicAdd(expired, 1u);
      return;
    }
  }
}

__global__ void __launch_bounds__(1024) empty_kernel() {}

}  // namespace

cudaError_t launch_gate(cudaStream_t stream, int us) {
  gate_kernel<<<1, 1, 0, stream>>>(uint64_t(us) * 1000);
  return cudaGetLastError();
}

cudaError_t launch_empty_like_low_latency(cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(empty_kernel), dim3(sms), dim3(1024), nullptr, 0,
                                     stream);
}

void* create_release_page() {
  void* p = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;  // zero-filled: word 0, so the first release is 1
}

void free_release_page(void* page) {
  if (page) munmap(page, kPage);
}

bool attach_release_line(void* page, bool leader, ReleaseLine* line) {
  *line = ReleaseLine{};
  if (!page) return false;
  void* word_dev = nullptr;
  void* expired = nullptr;
  void* expired_dev = nullptr;
  if (cudaHostRegister(page, kPage, cudaHostRegisterMapped) != cudaSuccess ||
      cudaHostGetDevicePointer(&word_dev, page, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (cudaHostAlloc(&expired, sizeof(uint32_t), cudaHostAllocMapped) != cudaSuccess ||
      cudaHostGetDevicePointer(&expired_dev, expired, 0) != cudaSuccess) {
    cudaGetLastError();
    cudaHostUnregister(page);
    if (expired) cudaFreeHost(expired);
    return false;
  }
  line->word = static_cast<uint32_t*>(page);
  line->word_dev = static_cast<const uint32_t*>(word_dev);
  line->expired = static_cast<uint32_t*>(expired);
  line->expired_dev = static_cast<uint32_t*>(expired_dev);
  *line->expired = 0;
  line->leader = leader;
  line->seq = 0;  // the page is fresh (zero) and no rank waits before every rank has attached
  return true;
}

void detach_release_line(ReleaseLine* line) {
  if (line->word) cudaHostUnregister(line->word);
  if (line->expired) cudaFreeHost(line->expired);
  *line = ReleaseLine{};
}

cudaError_t launch_release_gate(cudaStream_t stream, const ReleaseLine& line, uint32_t seq, int max_us) {
  release_gate_kernel<<<1, 1, 0, stream>>>(line.word_dev, seq, line.expired_dev, uint64_t(max_us) * 1000);
  return cudaGetLastError();
}

void release(ReleaseLine& line, uint32_t seq) { __atomic_store_n(line.word, seq, __ATOMIC_RELEASE); }

}  // namespace epx::bench
