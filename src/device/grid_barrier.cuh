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

// Arrival without waiting, on the same counter: called by one thread per block after the block's work (and a
// __syncthreads); true in the block that arrives last, which then sees every block's work before its arrival.
// Keeps the counter at a multiple of gridDim.x after every block has arrived, as grid_barrier expects.
__device__ __forceinline__ bool grid_arrive_is_last(uint64_t* counter) {
  __threadfence();  // release: this block's work (ordered before by the caller's __syncthreads) before the arrival
  const uint64_t arrived = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
  const bool last = arrived % gridDim.x == gridDim.x - 1;
  if (last) __threadfence();  // acquire: the other arrivals (an RMW chain on one counter) and their work
  return last;
}

}  // namespace epx::dev
