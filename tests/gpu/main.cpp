// epx_gpu_tests: the GPU test suite, one process per GPU through the local launcher.
//   epx_gpu_tests [--gpus N] [--filter SUBSTRING] [--no-timeout-suite] [--budget SECONDS]
//                 [--expect-transport cuda-ipc|nvshmem|nvshmem-forced] [--internode DxG | --no-internode]
//                 [--build-info] [--process-suites-only]
// By default the suite runs on one NVLink domain of all ranks, then (builds with NVSHMEM) the internode suite on
// every split D x G of the ranks (G <= 8; 1 x R forced); --internode DxG runs only that split.
// The low-latency transport follows the build and EPX_DISABLE_NVSHMEM / EPX_LL_FORCE_NVSHMEM (docs/design.md);
// the suite prints it, and --expect-transport makes a different one a failure. --process-suites-only runs only the
// suites that start their own processes (the timeout suites, the low-latency process suites).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "epx/launcher.hpp"
#include "gpu_test.hpp"

namespace epx::gpu_test {
namespace {

struct Result {
  int ok;
  int fatal;
  double seconds;
  char message[2000];
};

struct Options {
  int gpus = 0;
  std::string filter;
  bool timeout_suite = true;  // and the other suites that run in their own processes
  bool in_process = true;     // the cases of suite(); false with --process-suites-only
  double budget_s = 20;
  std::string expect_transport;
  int internode_domains = 0;  // > 0: the internode suite on this many domains (--internode DxG)
  bool internode = true;      // run the internode suites by default (builds with NVSHMEM)
};

constexpr const char* kLowLatencyProcessSuites = "ll: create / destroy cycles and missing ranks (own processes)";
constexpr const char* kShrinkProcessSuite = "ll: shrink, a silent rank with and without enable_shrink (own processes)";

int suite(Bootstrap& bs, const Options& opt) {
  const int rank = bs.rank(), R = bs.size();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  cudaSetDevice(rank % devices);
  const Config dcfg = default_dispatch_config(R), ccfg = default_combine_config(R);
  const bool internode = opt.internode_domains > 0;
  BufferOptions o = default_buffer_options();
  if (internode) {
    o = internode_suite_options(R, R / opt.internode_domains);
  } else {
    o.num_nvl_bytes = nvl_size_hint(dcfg, 7168 * 2, R);
    o.num_rdma_bytes = std::max(low_latency_size_hint(128, 8192, R, 288), low_latency_size_hint(256, 4096, R, 288));
    // The in-buffer cases' largest shape: 4096 tokens a rank of BF16 h7168, top-8 (in_buffer_cases()).
    o.num_recv_bytes = recv_region_size_hint(4096 * R, 7168, EPX_BF16, 0, 8);
  }
  Buffer buffer(bs, o);
  buffer.set_timeout(opt.budget_s);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  Context ctx{bs, buffer, stream, rank, R, o.num_nvl_bytes, dcfg, ccfg};
  std::vector<Case> cases = high_throughput_cases(internode);
  if (internode) {
    if (rank == 0)
      std::printf("internode suite: %d domains x %d ranks%s\n", opt.internode_domains, R / opt.internode_domains,
                  opt.internode_domains == 1 ? " (forced)" : "");
    for (auto& c : internode_cases()) cases.push_back(std::move(c));
  } else {
    const LowLatencyTransportInfo transport = buffer.low_latency_transport();
    if (rank == 0) std::printf("low-latency transport: %s\n", describe_low_latency_transport(transport).c_str());
    for (auto& c : low_latency_transport_cases(transport, opt.expect_transport)) cases.push_back(std::move(c));
    for (auto& c : low_latency_cases()) cases.push_back(std::move(c));
    for (auto& c : shrink_cases()) cases.push_back(std::move(c));
    for (auto& c : lifecycle_cases()) cases.push_back(std::move(c));
  }
  int failed = 0, run = 0;
  for (const Case& c : cases) {
    if (!opt.filter.empty() && c.name.find(opt.filter) == std::string::npos) continue;
    ++run;
    Result mine{};
    const auto start = std::chrono::steady_clock::now();
    std::string msg;
    try {
      msg = c.run(ctx);
      const cudaError_t e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) msg += std::string("stream error: ") + cudaGetErrorString(e);
    } catch (const Error& e) {
      msg = std::string("epx::Error (") + status_string(e.status()) + "): " + e.what();
      mine.fatal = e.status() == Status::kFailedState || e.status() == Status::kTimeout || e.status() == Status::kCuda;
    } catch (const std::exception& e) {
      msg = std::string("exception: ") + e.what();
      // A CUDA error seen first by the test's own copies (a kernel trapped): the buffer's diagnostic says why.
      try {
        buffer.check(stream);
      } catch (const Error& diag) {
        msg += std::string("\n  diagnostic: ") + diag.what();
        mine.fatal = 1;
      }
    }
    mine.ok = msg.empty();
    mine.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::snprintf(mine.message, sizeof(mine.message), "%s", msg.c_str());
    std::vector<Result> all(R);
    bs.all_gather(&mine, all.data(), sizeof(Result));
    bool ok = true, fatal = false;
    double seconds = 0;
    for (const Result& r : all) ok &= r.ok != 0, fatal |= r.fatal != 0, seconds = std::max(seconds, r.seconds);
    failed += ok ? 0 : 1;
    if (rank == 0) {
      std::printf("[%s] %s (%.2f s)\n", ok ? "PASS" : "FAIL", c.name.c_str(), seconds);
      for (int r = 0; r < R; ++r)
        if (!all[r].ok) std::printf("  rank %d:\n%s\n", r, all[r].message);
      std::fflush(stdout);
    }
    if (fatal) {
      if (rank == 0) std::printf("a fatal error makes the buffer unusable: stopping the suite\n");
      failed += 1;
      break;
    }
  }
  if (rank == 0)
    std::printf("GPU suite on %d ranks%s: %d of %d cases passed\n", R,
                internode ? (" (internode " + std::to_string(opt.internode_domains) + " x " +
                             std::to_string(R / opt.internode_domains) + ")")
                                .c_str()
                          : "",
                run - failed, run);
  buffer.destroy();
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace epx::gpu_test

int main(int argc, char** argv) {
  using namespace epx;
  gpu_test::Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gpus" && i + 1 < argc) {
      opt.gpus = std::atoi(argv[++i]);
    } else if (a == "--filter" && i + 1 < argc) {
      opt.filter = argv[++i];
    } else if (a == "--build-info") {  // for scripts: what this build has, without touching a GPU
      std::printf("nvshmem: %s\n", built_with_nvshmem() ? "yes" : "no");
      return 0;
    } else if (a == "--no-timeout-suite") {
      opt.timeout_suite = false;
    } else if (a == "--process-suites-only") {
      opt.in_process = false;
    } else if (a == "--budget" && i + 1 < argc) {
      opt.budget_s = std::atof(argv[++i]);
    } else if (a == "--expect-transport" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "cuda-ipc" || std::string(argv[i + 1]) == "nvshmem" ||
                std::string(argv[i + 1]) == "nvshmem-forced")) {
      opt.expect_transport = argv[++i];
    } else if (a == "--internode" && i + 1 < argc) {
      int d = 0, g = 0;
      if (std::sscanf(argv[++i], "%dx%d", &d, &g) != 2 || d < 1 || g < 1) {
        std::fprintf(stderr, "--internode takes DxG (domains x ranks per domain), e.g. 2x1\n");
        return 2;
      }
      opt.internode_domains = d;
      opt.gpus = d * g;
    } else if (a == "--no-internode") {
      opt.internode = false;
    } else {
      const bool help = a == "--help" || a == "-h";
      std::fprintf(help ? stdout : stderr,
                   "usage: %s [--gpus N] [--filter SUBSTRING] [--no-timeout-suite] [--budget SECONDS]\n"
                   "       [--expect-transport cuda-ipc|nvshmem|nvshmem-forced] [--internode DxG | --no-internode]\n"
                   "       [--process-suites-only]\n",
                   argv[0]);
      return help ? 0 : 2;
    }
  }
  if (!opt.in_process && !opt.timeout_suite) {
    std::fprintf(stderr, "--process-suites-only and --no-timeout-suite together leave nothing to run\n");
    return 2;
  }
  const int available = count_local_gpus();
  if (available <= 0) {
    std::printf("epx_gpu_tests: no CUDA GPU visible on this machine; nothing to test here\n");
    return 0;
  }
  const int R = opt.gpus > 0 ? opt.gpus : available;
  if (R > available) {
    std::fprintf(stderr, "epx_gpu_tests: --gpus %d but only %d GPUs are visible\n", R, available);
    return 2;
  }
  // The splits to run: the one asked for, or (default) one domain of all ranks, then every internode split.
  std::vector<int> splits;  // domains; 0 = the single-domain suite
  if (opt.internode_domains > 0) {
    splits.push_back(opt.internode_domains);
  } else {
    splits.push_back(0);
    if (opt.internode && built_with_nvshmem())
      for (int d = R; d >= 1; --d)
        if (R % d == 0 && R / d <= 8) splits.push_back(d);
  }
  int rc = 0;
  for (int d : splits) {
    gpu_test::Options o = opt;
    o.internode_domains = d;
    if (opt.in_process) {
      const LaunchResult res = launch_local(
          R, [&](Bootstrap& bs) { return gpu_test::suite(bs, o); }, 3600, 60);
      rc |= res.num_failed == 0 ? 0 : 1;
      if (res.num_failed) std::printf("%s", res.summary.c_str());
    }
    if (d > 0 && opt.timeout_suite && opt.filter.empty() && R >= 2)
      rc |= gpu_test::run_internode_timeout_suite(R, R / d);
  }
  if (opt.internode_domains == 0) {
    if (opt.timeout_suite && opt.filter.empty() && R >= 2) rc |= gpu_test::run_timeout_suite(R);
    if (opt.timeout_suite && std::string(gpu_test::kLowLatencyProcessSuites).find(opt.filter) != std::string::npos &&
        R >= 2)
      rc |= gpu_test::run_low_latency_process_suites(R, opt.expect_transport);
    if (opt.timeout_suite && std::string(gpu_test::kShrinkProcessSuite).find(opt.filter) != std::string::npos && R >= 2)
      rc |= gpu_test::run_shrink_process_suite(R);
  }
  std::printf("epx_gpu_tests on %d GPUs: %s\n", R, rc == 0 ? "ALL PASSED" : "FAILURES");
  return rc;
}
