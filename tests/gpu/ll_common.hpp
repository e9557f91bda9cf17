// What the low-latency test files (low_latency_cases.cpp, ll_transport_cases.cpp, shrink_cases.cpp) share: the
// small case and its buffer options, a dispatch + combine captured in a CUDA graph, the scaffolding of a suite that
// runs in its own processes, and the check that rank 0's call times out while the other ranks stay away.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

#include "../../tools/harness/low_latency.hpp"
#include "gpu_test.hpp"

namespace epx::gpu_test {

// A small low-latency step: M 32, hidden 2048, FP8, top-4 of 16 experts (or of one per rank when R > 16), 5%
// empty slots; routing and data from `seed`.
harness::LowLatencyCase small_ll_case(int num_ranks, uint64_t seed);
// Options of a low-latency buffer sized for small_ll_case.
BufferOptions small_ll_options(int num_ranks);

// Captures one dispatch + combine of s (both phases; the dispatch uncounted: each replay is counted with
// note_replayed_dispatch) into *graph and instantiates *exec. "" when it worked, else what failed.
std::string capture_step(harness::LowLatencySession& s, cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec);

// Runs body(bs, stream) on num_ranks local processes (the launcher's limit: timeout_s), each on GPU bs.rank() with
// a non-blocking stream of its own; then prints "[PASS] title" or "[FAIL] title" and the launcher's summary.
// Returns 0 when every rank's body returned 0, else 1.
int run_in_processes(int num_ranks, double timeout_s, const std::string& title,
                     const std::function<int(Bootstrap&, cudaStream_t)>& body);

// After a barrier, rank 0 dispatches s while every other rank stays away for two budgets: rank 0's call must fail
// with kTimeout within budget + 10 s; more(message, seconds) adds the caller's own checks of that failure. Returns
// rank 0's problems ("" when right, and on the other ranks).
std::string rank0_times_out(Bootstrap& bs, Buffer& buffer, harness::LowLatencySession& s, cudaStream_t stream,
                            double budget, const std::function<std::string(const std::string&, double)>& more);

}  // namespace epx::gpu_test
