#include "ll_common.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

#include "epx/launcher.hpp"

namespace epx::gpu_test {

using harness::LowLatencyCase;
using harness::LowLatencySession;

LowLatencyCase small_ll_case(int num_ranks, uint64_t seed) {
  LowLatencyCase c;
  c.tokens = {32};
  c.max_tokens = 32;
  c.hidden = 2048;
  c.num_experts = num_ranks <= 16 ? 16 / num_ranks * num_ranks : num_ranks;
  c.num_topk = 4;
  c.fp8 = true;
  c.empty_slot_prob = 0.05;
  c.seed = seed;
  return c;
}

BufferOptions small_ll_options(int num_ranks) {
  const LowLatencyCase c = small_ll_case(num_ranks, 0);
  BufferOptions o = default_buffer_options();
  o.num_rdma_bytes = low_latency_size_hint(c.max_tokens, c.hidden, num_ranks, c.num_experts);
  o.low_latency_mode = 1;
  return o;
}

std::string capture_step(LowLatencySession& s, cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) return "capture failed to begin\n";
  s.dispatch(kLowLatencyBothPhases, /*counted=*/false);
  s.combine(kLowLatencyBothPhases);
  cudaError_t e = cudaStreamEndCapture(stream, graph);
  if (e != cudaSuccess) return std::string("capture failed: ") + cudaGetErrorString(e) + "\n";
  e = cudaGraphInstantiate(exec, *graph, 0);
  if (e != cudaSuccess) return std::string("instantiate failed: ") + cudaGetErrorString(e) + "\n";
  return std::string();
}

int run_in_processes(int num_ranks, double timeout_s, const std::string& title,
                     const std::function<int(Bootstrap&, cudaStream_t)>& body) {
  const LaunchResult r = launch_local(
      num_ranks,
      [&](Bootstrap& bs) -> int {
        cudaSetDevice(bs.rank());
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        return body(bs, stream);
      },
      timeout_s, 60);
  std::printf("[%s] %s\n", r.num_failed == 0 ? "PASS" : "FAIL", title.c_str());
  if (r.num_failed) std::printf("%s", r.summary.c_str());
  return r.num_failed == 0 ? 0 : 1;
}

std::string rank0_times_out(Bootstrap& bs, Buffer& buffer, LowLatencySession& s, cudaStream_t stream, double budget,
                            const std::function<std::string(const std::string&, double)>& more) {
  bs.barrier();
  std::string problem;
  if (bs.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    try {
      s.dispatch(kLowLatencyBothPhases);
      buffer.check(stream);
      problem = "no error";
    } catch (const Error& e) {
      const std::string what = e.what();
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("[rank 0] failed after %.1f s as expected: %s\n", took, what.c_str());
      if (e.status() != Status::kTimeout) problem = "want kTimeout";
      problem += more(what, took);
      if (took > budget + 10) problem += " took too long";
    }
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(2 * budget));
  }
  return problem;
}

}  // namespace epx::gpu_test
