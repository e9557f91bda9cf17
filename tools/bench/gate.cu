#include "gate.hpp"

#include <cstdint>

namespace epx::bench {
namespace {

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

}  // namespace

cudaError_t launch_gate(cudaStream_t stream, int us) {
  gate_kernel<<<1, 1, 0, stream>>>(uint64_t(us) * 1000);
  return cudaGetLastError();
}

}  // namespace epx::bench
