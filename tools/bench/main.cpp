// epx-bench: benchmarks of epx on the GPUs of this machine, one process per GPU.
//   epx-bench intranode [options]     (epx-bench SUBCOMMAND --help for the options)
// Exit codes: 0 done, 1 a check or a rank failed, 2 bad command line, 3 no (or too few) GPUs here, 4 this build
// cannot run the mode (internode without NVSHMEM).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "internode_bench.hpp"
#include "intranode_bench.hpp"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  // argv: the subcommand's own arguments
};

// Add a mode here (e.g. low-latency): it gets the arguments after its name.
constexpr Subcommand kSubcommands[] = {
    {"intranode", "high-throughput dispatch / combine inside one NVLink domain, vs NCCL all-to-all",
     epx::bench::run_intranode},
    {"internode", "high-throughput dispatch / combine over D NVLink domains (--domains), vs NCCL all-to-all",
     epx::bench::run_internode},
    {"low-latency", "decoding-sized dispatch / combine latency (no CPU sync), vs NCCL all-to-all",
     epx::bench::run_low_latency},
};

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: epx-bench SUBCOMMAND [options]   (epx-bench SUBCOMMAND --help for its options)\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-12s %s\n", s.name, s.summary);
}

// NVLink multicast (NVLS) can put a shared host out of service: keep it off in this process and
// the ranks it forks, unless the caller set these already. Done before anything can load NCCL or CUDA.
void keep_multicast_off() {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 0);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
}

}  // namespace

int main(int argc, char** argv) {
  keep_multicast_off();
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const char* cmd = argv[1];
  if (std::strcmp(cmd, "--help") == 0 || std::strcmp(cmd, "-h") == 0 || std::strcmp(cmd, "help") == 0) {
    print_usage(stdout);
    return 0;
  }
  for (const Subcommand& s : kSubcommands)
    if (std::strcmp(cmd, s.name) == 0) return s.run(argc - 2, argv + 2);
  std::fprintf(stderr, "epx-bench: unknown subcommand '%s'\n", cmd);
  print_usage(stderr);
  return 2;
}
