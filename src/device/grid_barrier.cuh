// A barrier over all blocks of one cooperative launch (co-residency is guaranteed by the launch). The counter
// only grows: a launch of G blocks whose counter starts at a multiple of G waits for the next multiple.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/wait.cuh"

namespace epx::dev {

__device__ __forceinline__ void grid_barrier(uint64_t* counter, const FailEnv& env, const WaitSite& site) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's writes before the arrival (release side of the barrier)
    const uint64_t arrived = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
    const uint64_t target = (arrived / gridDim.x + 1) * gridDim.x;
    wait_at_least(counter, target, env, site);  // acquire: every block's writes before its arrival
  }
  __syncthreads();
}

}  // namespace epx::dev
