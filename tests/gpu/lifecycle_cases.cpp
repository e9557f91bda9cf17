// Buffer creation and teardown on the GPU: no leak over many cycles, errors that name the problem.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_test.hpp"

namespace epx::gpu_test {

std::vector<Case> lifecycle_cases() {
  std::vector<Case> cases;
  cases.push_back(Case{"create and destroy 100 buffers of 256 MiB without leaking", [](Context& ctx) {
                         BufferOptions o = default_buffer_options();
                         o.num_nvl_bytes = int64_t(256) << 20;
                         size_t free_before = 0, free_after = 0, total = 0;
                         cudaDeviceSynchronize();
                         // One cycle first: the driver keeps some bookkeeping for IPC peers after the first mapping.
                         { Buffer warm(ctx.bootstrap, o); }
                         cudaMemGetInfo(&free_before, &total);
                         for (int i = 0; i < 100; ++i) {
                           Buffer b(ctx.bootstrap, o);
                           if (!b.alive()) return std::string("buffer not alive after creation\n");
                           b.destroy();
                           if (b.alive()) return std::string("buffer alive after destroy\n");
                         }
                         cudaMemGetInfo(&free_after, &total);
                         const double lost_mib = (double(free_before) - double(free_after)) / (1 << 20);
                         if (lost_mib > 64)
                           return "device memory shrank by " + std::to_string(lost_mib) + " MiB over 100 cycles\n";
                         return std::string();
                       }});
  cases.push_back(Case{"calls after destroy fail cleanly", [](Context& ctx) {
                         BufferOptions o = default_buffer_options();
                         o.num_nvl_bytes = 1 << 20;
                         Buffer b(ctx.bootstrap, o);
                         b.destroy();
                         try {
                           b.check(ctx.stream);
                         } catch (const Error& e) {
                           return e.status() == Status::kFailedState ? std::string()
                                                                     : std::string("wrong status: ") + e.what() + "\n";
                         }
                         return std::string("expected kFailedState\n");
                       }});
  cases.push_back(Case{
      "local regions: the sizes asked for, aligned, apart, writable, gone after destroy", [](Context& ctx) {
        BufferOptions o = default_buffer_options();
        o.num_nvl_bytes = (1 << 20) + 48;  // not multiples of the layout's alignment: the regions are what was asked
        o.num_rdma_bytes = (1 << 20) + 16;
        o.low_latency_mode = 1;
        Buffer b(ctx.bootstrap, o);
        const MemoryRegion nvl = b.local_region(EPX_REGION_NVL), rdma = b.local_region(EPX_REGION_RDMA);
        std::string err;
        if (nvl.bytes != o.num_nvl_bytes || rdma.bytes != o.num_rdma_bytes)
          err += "sizes " + std::to_string(nvl.bytes) + " / " + std::to_string(rdma.bytes) + "\n";
        if (nvl.ptr == nullptr || rdma.ptr == nullptr) return err + "a region has no pointer\n";
        if (reinterpret_cast<uintptr_t>(nvl.ptr) % 16 != 0 || reinterpret_cast<uintptr_t>(rdma.ptr) % 16 != 0)
          err += "a region is not 16-byte aligned\n";
        // Apart, in either order: with NVSHMEM the RDMA region is a symmetric allocation of its own, anywhere.
        const auto* n0 = static_cast<const uint8_t*>(nvl.ptr);
        const auto* r0 = static_cast<const uint8_t*>(rdma.ptr);
        if (n0 < r0 + rdma.bytes && r0 < n0 + nvl.bytes) err += "the regions overlap\n";
        for (const MemoryRegion& r : {nvl, rdma}) {
          std::vector<uint8_t> pattern(64), back(64);
          for (int i = 0; i < 64; ++i) pattern[i] = uint8_t(i * 7 + ctx.rank);
          for (int64_t at : {int64_t(0), r.bytes - 64}) {  // both ends
            uint8_t* where = static_cast<uint8_t*>(r.ptr) + at;
            if (cudaMemcpy(where, pattern.data(), 64, cudaMemcpyHostToDevice) != cudaSuccess ||
                cudaMemcpy(back.data(), where, 64, cudaMemcpyDeviceToHost) != cudaSuccess || back != pattern)
              err += "region write/read back failed at offset " + std::to_string(at) + "\n";
          }
        }
        BufferOptions nvl_only = default_buffer_options();
        nvl_only.num_nvl_bytes = 1 << 20;
        {
          Buffer c(ctx.bootstrap, nvl_only);
          const MemoryRegion none = c.local_region(EPX_REGION_RDMA);
          if (none.ptr != nullptr || none.bytes != 0) err += "a buffer without num_rdma_bytes has an RDMA region\n";
        }
        b.destroy();
        try {
          b.local_region(EPX_REGION_NVL);
          err += "local_region after destroy did not fail\n";
        } catch (const Error& e) {
          if (e.status() != Status::kFailedState) err += std::string("after destroy: wrong status: ") + e.what() + "\n";
        }
        return err;
      }});
  return cases;
}

}  // namespace epx::gpu_test
