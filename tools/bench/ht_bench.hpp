// What the high-throughput benchmarks (`epx-bench intranode`, `epx-bench internode`) share: one rank's state,
// checks gathered to rank 0, timed rows, the NCCL all-to-all on a session's routing, the report, and the
// process set-up around them.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "high_throughput.hpp"
#include "nccl_baseline.hpp"
#include "options.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace epx::bench {

// A non-blocking stream: it does not serialise with the legacy default stream other libraries may use.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// What one rank's run carries around.
struct Bench {
  Bootstrap& bs;
  Buffer& buffer;
  cudaStream_t stream;
  const HtOptions& opt;
  TimingPlan plan;
  uint64_t next_seed;     // of the next data refresh
  std::vector<Row> rows;  // every measurement, all ranks' numbers (the same on every rank)
};

// Rank 0's lines on stdout, flushed at once: the ranks' stdout and stderr interleave.
void say(const std::string& text);

// The benchmark's case: uniform top-k routing of the options' shape, top-k and weights passed, no biases; dispatches
// with a layout sized (dispatch_sized) where runs_sized says.
harness::HtCase make_case(const HtOptions& o, epx_dtype dtype);

// Runs a check and turns an exception into its failure text, so that every rank reaches the gather.
std::string guarded(const std::function<std::string()>& check);

// Gathers every rank's failure text; true when all are empty. *report gets "rank r:\n<text>" per failed rank.
bool all_passed(Bootstrap& bs, const std::string& mine, std::string* report);

template <typename T>
std::vector<T> gather_value(Bootstrap& bs, const T& mine) {
  std::vector<T> all(bs.size());
  bs.all_gather(&mine, all.data(), sizeof(T));
  return all;
}

// Times `run` on every rank together and adds the row (every rank's numbers) to b.rows. bytes: what this rank
// receives (the GB/s numerator); net_bytes: of those, what crossed the network hop (internode dispatch).
void measure(Bench& b, Op op, Impl impl, const Config& cfg, double bytes, const std::function<void(int)>& prepare,
             const std::function<void()>& run, double net_bytes = 0);

// prepare() for a timed op that reads x: fresh x before the first iteration of the series, then every
// refresh_every timed iterations. Regenerating x happens on the host, outside the events.
std::function<void(int)> refresh_x(Bench& b, harness::HtSession& s);
void no_prepare(int);

// Bytes of one token row: BF16, and FP8 with its scales.
size_t bf16_row_bytes(int hidden);
size_t fp8_row_bytes(int hidden);

// dlopens NCCL on every rank; null unless every rank has it (the ranks must agree to use it). *note: the
// header's NCCL line.
std::unique_ptr<NcclLibrary> load_nccl(Bootstrap& bs, std::string* note);

// One NCCL all-to-all compared with an epx op: the tokens routed to each rank, row_bytes each; to_sources
// (combine) sends them back the other way.
struct NcclTransfer {
  Op op;
  size_t row_bytes;
  bool to_sources;
  double bytes;  // the numerator of the epx row it is compared with
};

// NCCL on the routing of `routing`, after epx: its communicator (and its threads) exist only while it is timed.
// Adds a row per transfer; if the communicator cannot be made, says so in info.nccl instead.
void nccl_baseline(Bench& b, const NcclLibrary& lib, const harness::HtSession& routing,
                   const std::vector<NcclTransfer>& transfers, RunInfo& info);

std::string device_name(int device);
std::string describe(const Config& c);

// The sweep less configs wider than the smallest GPU, dropped on every rank alike.
std::vector<Config> runnable_configs(Bench& b, const std::vector<Config>& sweep);

// The RunInfo fields every high-throughput mode fills alike.
RunInfo make_run_info(const char* benchmark, const HtOptions& o, int num_ranks, int device);

// Rank 0: the table, the JSON (--json) and the closing line "epx-bench <benchmark>: done in N s".
void report(Bench& b, const RunInfo& info, std::chrono::steady_clock::time_point started);

// The steps every high-throughput mode's run takes in this order, around its own sweep (b.opt: the options):
// The start: NCCL loaded on every rank unless --no-nccl (info.nccl says how that went), then rank 0 prints the
// header.
std::unique_ptr<NcclLibrary> open_run(Bench& b, RunInfo& info);
// The options' case in `dtype` at the default configs: the sessions a run checks and times (BF16 and FP8).
harness::HtSession default_session(Bench& b, epx_dtype dtype);
// The check before any timing: check_session(bf16, --seed), then (fp8, --seed), on every rank (in sequence: each
// runs collective operations), then the Buffer's check(); gathered to rank 0, which says PASS, or FAIL with every
// rank's failures. Sets info.check; true when every rank passed.
bool check_before_timing(Bench& b, harness::HtSession& bf16, harness::HtSession& fp8,
                         const std::function<std::string(harness::HtSession&, uint64_t)>& check_session, RunInfo& info);
// The end: with nccl, the NCCL all-to-alls of the rows of the BF16 and FP8 dispatches and of the BF16 combine (on
// bf16's routing); then the report.
void finish_run(Bench& b, const NcclLibrary* nccl, const harness::HtSession& bf16, const harness::HtSession& fp8,
                RunInfo& info, std::chrono::steady_clock::time_point started);

// Parses the options of `epx-bench <name>` into *opt. Returns the exit code when the command ends here: 0 after
// --help (the usage on stdout), 2 after a usage error (the message and the usage on stderr); nullopt otherwise.
template <typename Options>
std::optional<int> parse_or_exit(const char* name, int argc, char** argv, Options (*parse)(int, char**, bool*),
                                 const char* (*usage)(), Options* opt) {
  bool help = false;
  try {
    *opt = parse(argc, argv, &help);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench %s: %s\n\n%s", name, e.message.c_str(), usage());
    return 2;
  }
  if (help) {
    std::printf("%s", usage());
    return 0;
  }
  return std::nullopt;
}

// The body of one rank's process: the stream and the Buffer on GPU bs.rank(), then body(bench). Returns the
// body's exit code; on an exception the process leaves at once (the launcher then stops the other ranks).
int run_rank_process(Bootstrap& bs, const HtOptions& opt, const BufferOptions& buffer_options,
                     const std::function<int(Bench&)>& body);

// The rank count: --gpus, or every visible GPU. Returns 0 and sets *num_ranks, or the exit code after saying
// why not (3: no or too few GPUs here, 2: more asked for than there are).
int choose_ranks(const HtOptions& o, int* num_ranks);

// Runs body on num_ranks local processes; 0 when all ranks returned 0, else 1 after printing the summary.
int launch_ranks(int num_ranks, const std::function<int(Bootstrap&)>& body);

}  // namespace epx::bench
