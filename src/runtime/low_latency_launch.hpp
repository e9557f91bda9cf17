// How a Buffer launches its low-latency kernels (runtime/low_latency_launch.cpp).
#pragma once

#include <cuda_runtime.h>

#include "layout/ll_params.hpp"
#include "runtime/launch_graphs.hpp"

namespace epx {

// Launches k with the one parameter struct at `params` (params_bytes long) on `stream`: a programmatic dependent
// launch with launch.early, else a cooperative one, through a launch graph where `graphs` has one for this launch
// (runtime/launch_graphs.hpp). The caller checks cudaGetLastError as for any launch.
void launch_low_latency(const LowLatencyKernel& k, const void* params, size_t params_bytes,
                        const LowLatencyLaunch& launch, LaunchGraphs& graphs, cudaStream_t stream);

// cudaGraphExecDestroy, as LaunchGraphs takes it.
void destroy_launch_graph(cudaGraphExec_t exec);

}  // namespace epx
