// A tiny collective test runner: every rank runs every case; rank 0 prints one line per case with the
// failures of all ranks. A case returns "" on success or a description of what was wrong.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx::harness {
class HtSession;
}

namespace epx::gpu_test {

struct Context {
  Bootstrap& bootstrap;
  Buffer& buffer;
  cudaStream_t stream;
  int rank;
  int num_ranks;
  int64_t num_nvl_bytes;
  Config dispatch_config;
  Config combine_config;
};

struct Case {
  std::string name;
  std::function<std::string(Context&)> run;
};

// The high-throughput cases; on an internode buffer without the two whose errors are collective only inside one
// domain (internode_cases() has the internode versions).
std::vector<Case> high_throughput_cases(bool internode);
std::vector<Case> internode_cases();
// Buffer options of the internode suite over num_ranks ranks in domains of num_nvl_ranks (forced when one domain).
BufferOptions internode_suite_options(int num_ranks, int num_nvl_ranks);
// A rank that never calls, on an internode buffer, in its own processes.
int run_internode_timeout_suite(int num_ranks, int num_nvl_ranks);
std::vector<Case> low_latency_cases();
// Rank masking (enable_shrink) in the low-latency mode: cases on buffers of their own, and (own processes) a rank that
// stays silent, with and without enable_shrink.
std::vector<Case> shrink_cases();
int run_shrink_process_suite(int num_ranks);
std::vector<Case> lifecycle_cases();
// Which low-latency transport runs (checked against `expected`: "", "cuda-ipc", "nvshmem" or "nvshmem-forced"),
// and a second low-latency buffer beside the first.
std::vector<Case> low_latency_transport_cases(const LowLatencyTransportInfo& info, const std::string& expected);
// "" when info is what `expected` names, else what differs.
std::string transport_mismatch(const LowLatencyTransportInfo& info, int num_ranks, const std::string& expected);

// Runs the timeout scenarios, a rank missing from a dispatch, a cached dispatch and a combine, each in its own
// processes (a timed-out rank's CUDA context is lost).
int run_timeout_suite(int num_ranks);
// The missing-rank scenario on one rank, after the session's layout: every rank but 0 comes to the dispatch two
// budgets late, so rank 0's waits expire. Rank 0 must fail with kTimeout soon after `budget` seconds, with a
// message that says "timed out" and contains `rank0_names`; every other rank with kTimeout or kRemote. Destroys the
// buffer; returns the process's exit code (0: as expected).
int missing_rank_dispatch(Bootstrap& bs, Buffer& buffer, harness::HtSession& s, cudaStream_t stream, double budget,
                          const std::string& rank0_names);
// Low-latency buffers created and destroyed several times in one process, and a missing rank on the
// low-latency transport, each in its own processes.
int run_low_latency_process_suites(int num_ranks, const std::string& expected);

}  // namespace epx::gpu_test
