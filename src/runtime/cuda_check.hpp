// CUDA error checks for host code that has no Buffer to blame (creation, helpers).
#pragma once

#include <cuda_runtime.h>

#include "runtime/errors.hpp"

#define EPX_CUDA_CHECK(call)                                                                   \
  do {                                                                                         \
    const cudaError_t epx_err_ = (call);                                                       \
    if (epx_err_ != cudaSuccess)                                                               \
      ::epx::raise(::epx::Status::kCuda, #call, " failed: ", cudaGetErrorName(epx_err_), " (", \
                   cudaGetErrorString(epx_err_), ") at ", __FILE__, ":", __LINE__);            \
  } while (0)
