// Buffer creation and teardown on the GPU: no leak over many cycles, errors that name the problem.
#include <cuda_runtime.h>

#include <string>

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
      return e.status() == Status::kFailedState ? std::string() : std::string("wrong status: ") + e.what() + "\n";
    }
    return std::string("expected kFailedState\n");
  }});
  return cases;
}

}  // namespace epx::gpu_test
