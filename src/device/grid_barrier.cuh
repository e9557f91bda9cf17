// Grid-wide arrival of one cooperative launch: the last block to arrive learns it and sees the others' work.
// The counter only grows and stays at a multiple of the grid size after every block has arrived.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"

namespace epx::dev {

// Called by one thread per block after the block's work (and a __syncthreads); true in the block that arrives
// last, which then sees every block's work before its arrival. No block waits.
__device__ __forceinline__ bool grid_arrive_is_last(uint64_t* counter) {
  __threadfence();  // release: this block's work (ordered before by the caller's __syncthreads) before the arrival
  const uint64_t arrived = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
  const bool last = arrived % gridDim.x == gridDim.x - 1;
  if (last) __threadfence();  // acquire: the other arrivals (an RMW chain on one counter) and their work
  return last;
}

}  // namespace epx::dev
