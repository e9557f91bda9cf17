// Launch floor probe: how long an empty kernel of the low-latency kernels' shape (one block per SM) takes,
// event to event, by launch kind (cooperative or not), block size and dynamic shared memory, timed three ways:
// single call on an idle stream (1 ms host idle first, like epx-bench), queued behind a 200 us gate kernel (the
// GPU's part only), and 10 in a row (per call). Not part of the build; one GPU:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o launch_floor tools/probes/launch_floor.cu && ./launch_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.hpp"

__global__ void __launch_bounds__(1024) empty_kernel(int* sink) {
  extern __shared__ int smem[];
  if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = smem[0];  // never taken (sink is null)
}

__global__ void gate_kernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  int* sink = nullptr;
  std::printf("grid %d blocks; median of 200 after 20 warm-up, us\n", sms);
  std::printf("%-6s %7s %9s | %8s %8s %10s\n", "launch", "threads", "smem KB", "single", "queued", "10 in row");
  for (int coop : {1, 0})
    for (int threads : {1024, 512, 256})
      for (int smem_kb : {0, 64}) {
        const size_t smem = size_t(smem_kb) * 1024;
        auto launch = [&] {
          void* args[] = {&sink};
          if (coop)
            CHECK(cudaLaunchCooperativeKernel((void*)empty_kernel, dim3(sms), dim3(threads), args, smem, stream));
          else
            empty_kernel<<<sms, threads, smem, stream>>>(sink);
        };
        double med[3];
        for (int mode = 0; mode < 3; ++mode) {
          std::vector<double> v;
          for (int i = 0; i < 220; ++i) {
            CHECK(cudaStreamSynchronize(stream));
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
            while (std::chrono::steady_clock::now() < until) {
            }
            if (mode == 1) gate_kernel<<<1, 1, 0, stream>>>(200000);
            CHECK(cudaEventRecord(start, stream));
            for (int k = 0; k < (mode == 2 ? 10 : 1); ++k) launch();
            CHECK(cudaEventRecord(stop, stream));
            CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (i >= 20) v.push_back(ms * 1e3 / (mode == 2 ? 10 : 1));
          }
          std::sort(v.begin(), v.end());
          med[mode] = v[v.size() / 2];
        }
        std::printf("%-6s %7d %9d | %8.1f %8.1f %10.1f\n", coop ? "coop" : "normal", threads, smem_kb, med[0], med[1],
                    med[2]);
      }
  return 0;
}
