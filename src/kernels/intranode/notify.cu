// notify: the count exchange in front of a dispatch with a layout, and the barrier alone in front of the low-latency
// buffer clean, as a grid of one block (notify_body.cuh has the work and its protocol).
#include <cuda_runtime.h>

#include "kernels/intranode/notify_body.cuh"
#include "layout/intranode_params.hpp"

namespace epx {
namespace {

constexpr int kNotifyThreads = 1024;

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyParams p) {
  run_notify(p, 0);
}

}  // namespace

void launch_notify(const NotifyParams& p, cudaStream_t stream) { notify_kernel<<<1, kNotifyThreads, 0, stream>>>(p); }

}  // namespace epx
