// A kernel that holds a stream for a fixed time, so that the host can queue the timed operation behind it.
#pragma once

#include <cuda_runtime.h>

namespace epx::bench {

// Launches one thread that spins on %globaltimer for `us` microseconds (bounded: it ends by the clock).
cudaError_t launch_gate(cudaStream_t stream, int us);

}  // namespace epx::bench
