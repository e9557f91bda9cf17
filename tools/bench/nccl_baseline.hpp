// The NCCL all-to-all baseline. libnccl is opened with dlopen at run time, never linked: the binary runs (without
// the column) where NCCL is missing, and uses whatever NCCL the machine has (e.g. torch's pip package).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx::bench {

class NcclLibrary {
 public:
  // Tries $EPX_NCCL_LIB, libnccl.so.2 (the loader's search path), the CUDA toolkit and Python site-packages
  // (nvidia/nccl/lib), in that order. Returns null and sets *why (every path tried and its error) on failure.
  static std::unique_ptr<NcclLibrary> load(std::string* why);
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const std::string& path() const { return path_; }
  std::string version() const;  // "2.28.9", or "" when the library does not say

  struct Api;  // resolved entry points (types from nccl.h; defined in nccl_baseline.cpp)
  const Api& api() const { return *api_; }

 private:
  NcclLibrary(void* handle, std::string path, std::unique_ptr<Api> api);
  void* handle_;  // never dlclosed (see the destructor)
  std::string path_;
  std::unique_ptr<Api> api_;
};

// An NCCL communicator over the ranks of a bootstrap, on the current CUDA device.
class NcclComm {
 public:
  // Collective. The unique id travels through the bootstrap; every rank throws (std::runtime_error) if any
  // rank failed to initialise, so the ranks stay in step.
  NcclComm(const NcclLibrary& lib, Bootstrap& bs);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Enqueues one grouped all-to-all on `stream`. `send` holds the bytes for rank 0, then rank 1, ... packed
  // (send_bytes[j] each); `recv` receives rank 0's bytes, then rank 1's, ... (recv_bytes[j] each). Own included.
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, cudaStream_t stream);

 private:
  const NcclLibrary& lib_;
  int rank_, size_;
  void* comm_ = nullptr;  // ncclComm_t
};

}  // namespace epx::bench
