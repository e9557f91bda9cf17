// RAII device memory for the harness (tests and benchmark).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace epx::harness {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// n elements at device address p (any device memory, e.g. a Buffer's output region), after `s` has synchronized.
template <typename T>
std::vector<T> download_from(const T* p, size_t n, cudaStream_t s) {
  std::vector<T> v(n);
  if (n) cuda_check(cudaMemcpyAsync(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, s), "download");
  cuda_check(cudaStreamSynchronize(s), "download sync");
  return v;
}

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { resize(n); }
  ~DeviceArray() { release(); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), n_(o.n_), cap_(o.cap_) { o.ptr_ = nullptr, o.n_ = o.cap_ = 0; }

  void resize(size_t n) {  // contents are not kept
    if (n <= cap_) {
      n_ = n;
      return;
    }
    release();
    cuda_check(cudaMalloc(&ptr_, (n ? n : 1) * sizeof(T)), "cudaMalloc");
    n_ = cap_ = n;
  }
  void release() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = cap_ = 0;
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& v, cudaStream_t s) {
    resize(v.size());
    if (!v.empty())
      cuda_check(cudaMemcpyAsync(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s), "upload");
  }
  std::vector<T> download(size_t n, cudaStream_t s) const { return download_from<T>(ptr_, n, s); }
  void fill_bytes(int value, cudaStream_t s) {
    if (n_) cuda_check(cudaMemsetAsync(ptr_, value, n_ * sizeof(T), s), "memset");
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
  size_t cap_ = 0;
};

}  // namespace epx::harness
