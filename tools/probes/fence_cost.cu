// Fence-cost probe: how long one thread's system-scope fence takes after its block's stores, by what the block
// stored (nothing, rows in this GPU's memory, rows in a peer GPU's memory over NVLink), how much (bytes per block),
// how many blocks do it at once (one, or one per SM as the low-latency kernels do), and which fence or release.
// The low-latency combine ends every block's send this way (kernels/low_latency/combine_common.cuh, end_send), and
// its phase stamps put ~4 us there (docs/bench-notes.md). GPU 0 stores into GPU 1 (GPU 1 idle); the block's 1024
// threads store, a barrier, then thread 0 reads %globaltimer (ns) and clock64 (SM cycles) around the fence. Median
// and max over blocks and 50 launches after 5 warm-up, and the kernel's event-to-event time (us, median). Not part
// of the build; two GPUs:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o fence_cost tools/probes/fence_cost.cu && ./fence_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"

enum Mode : int {
  kReleaseSys = 0,  // fence.release.sys (end_send's fence)
  kScSys = 1,       // fence.sc.sys
  kAcqRelGpu = 2,   // fence.acq_rel.gpu: not enough for a peer reader; its cost beside the others
  kRedRelease = 3,  // red.release.sys.global.add to a word at the peer, no separate fence (the timer covers issue)
  kModes = 4
};
const char* kModeName[kModes] = {"fence.release.sys", "fence.sc.sys", "fence.acq_rel.gpu", "red.release.sys"};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(1024) fence_kernel(int mode, int4* dst, int bytes_per_block, int active_blocks,
                                                     int* peer_word, uint64_t* out_ns, uint64_t* out_cycles) {
  if (int(blockIdx.x) >= active_blocks) return;
  const int n = bytes_per_block / 16;
  int4* mine = dst + int64_t(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int4 v = make_int4(i, int(blockIdx.x), 1, 2);
    asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(mine + i), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  const long long c0 = clock64();
  switch (mode) {
    case kReleaseSys:
      asm volatile("fence.release.sys;" ::: "memory");
      break;
    case kScSys:
      asm volatile("fence.sc.sys;" ::: "memory");
      break;
    case kAcqRelGpu:
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      break;
    default:
      asm volatile("red.release.sys.global.add.s32 [%0], 1;" ::"l"(peer_word) : "memory");
      break;
  }
  // A dependent read of the timer after the fence: the fence must complete before the timer is read again.
  const long long c1 = clock64();
  const uint64_t t1 = now_ns();
  out_ns[blockIdx.x] = t1 - t0;
  out_cycles[blockIdx.x] = uint64_t(c1 - c0);
}

int main() {
  int gpus = 0;
  CHECK(cudaGetDeviceCount(&gpus));
  if (gpus < 2) {
    std::fprintf(stderr, "fence_cost needs 2 GPUs, found %d\n", gpus);
    return 1;
  }
  int can = 0;
  CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (!can) {
    std::fprintf(stderr, "GPU 0 cannot reach GPU 1's memory\n");
    return 1;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int kMaxBytes = 64 * 1024;
  int4* remote = nullptr;
  int* peer_word = nullptr;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMalloc(&remote, size_t(sms) * kMaxBytes));
  CHECK(cudaMalloc(&peer_word, 4));
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0));
  int4* local = nullptr;
  uint64_t* out = nullptr;
  uint64_t* cycles = nullptr;
  CHECK(cudaMalloc(&local, size_t(sms) * kMaxBytes));
  CHECK(cudaMalloc(&out, size_t(sms) * sizeof(uint64_t)));
  CHECK(cudaMalloc(&cycles, size_t(sms) * sizeof(uint64_t)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::printf("GPU 0 -> GPU 1, %d SMs; fence ns: median / max over blocks and launches; kernel us: median\n", sms);
  std::printf("%-18s %-7s %8s %7s | %9s %9s | %9s %9s | %9s\n", "fence", "target", "bytes", "blocks", "median", "max",
              "cyc med", "cyc max", "kernel");
  const int sizes[] = {0, 1024, 14336, kMaxBytes};
  for (int mode = 0; mode < kModes; ++mode)
    for (int where = 0; where < 2; ++where)
      for (int bytes : sizes)
        for (int blocks : {1, sms}) {
          if (bytes == 0 && where == 1) continue;  // nothing stored: one row of "local"
          std::vector<uint64_t> ns, cyc;
          std::vector<float> kernel_us;
          std::vector<uint64_t> host(sms);
          for (int it = 0; it < 55; ++it) {
            CHECK(cudaEventRecord(start, stream));
            fence_kernel<<<sms, 1024, 0, stream>>>(mode, where ? remote : local, bytes, blocks, peer_word, out, cycles);
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(stop, stream));
            CHECK(cudaEventSynchronize(stop));
            if (it < 5) continue;
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            kernel_us.push_back(ms * 1e3f);
            CHECK(cudaMemcpy(host.data(), out, size_t(blocks) * sizeof(uint64_t), cudaMemcpyDeviceToHost));
            ns.insert(ns.end(), host.begin(), host.begin() + blocks);
            CHECK(cudaMemcpy(host.data(), cycles, size_t(blocks) * sizeof(uint64_t), cudaMemcpyDeviceToHost));
            cyc.insert(cyc.end(), host.begin(), host.begin() + blocks);
          }
          std::sort(ns.begin(), ns.end());
          std::sort(cyc.begin(), cyc.end());
          std::sort(kernel_us.begin(), kernel_us.end());
          std::printf("%-18s %-7s %8d %7d | %9llu %9llu | %9llu %9llu | %9.1f\n", kModeName[mode],
                      where ? "peer" : "local", bytes, blocks, (unsigned long long)ns[ns.size() / 2],
                      (unsigned long long)ns.back(), (unsigned long long)cyc[cyc.size() / 2],
                      (unsigned long long)cyc.back(), kernel_us[kernel_us.size() / 2]);
        }
  return 0;
}
