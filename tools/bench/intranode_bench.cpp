#include "intranode_bench.hpp"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "device_array.hpp"
#include "epx/launcher.hpp"
#include "gen.hpp"
#include "high_throughput.hpp"
#include "nccl_baseline.hpp"
#include "options.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace epx::bench {
namespace {

using harness::cuda_check;
using harness::DeviceArray;
using harness::HtCase;
using harness::HtSession;

constexpr int kMinRanks = 2;
// Per-rank failure text gathered to rank 0 (the harness reports at most a few mismatches per check).
constexpr size_t kMessageBytes = 4000;
// Seeds of the data refreshes are derived from --seed with this salt, so they never repeat the check's data.
constexpr uint64_t kRefreshSalt = 0xbe4c;
constexpr uint64_t kNcclDataSalt = 0x4cc1;
// Whole-run limit of the launcher; every wait of the library has its own, shorter bound.
constexpr double kLaunchTimeoutS = 1800;
constexpr double kLaunchGraceS = 30;

// A non-blocking stream: it does not serialise with the legacy default stream other libraries may use.
class Stream {
 public:
  Stream() { cuda_check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~Stream() { cudaStreamDestroy(s_); }
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
  const IntranodeOptions& opt;
  TimingPlan plan;
  uint64_t next_seed;     // of the next data refresh
  std::vector<Row> rows;  // every measurement, all ranks' numbers (the same on every rank)
};

// Rank 0's lines on stdout, flushed at once: the ranks' stdout and stderr interleave.
void say(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

HtCase make_case(const IntranodeOptions& o, epx_dtype dtype) {
  HtCase c;
  c.name = dtype == EPX_BF16 ? "bench bf16" : "bench fp8";
  c.tokens = {o.tokens};
  c.hidden = o.hidden;
  c.dtype = dtype;  // FP8: the harness adds hidden / 128 scales per row
  c.with_topk = true;
  c.with_weights = true;
  c.routing.kind = harness::Routing::kUniform;
  c.routing.num_experts = o.experts;
  c.routing.num_topk = o.topk;
  c.routing.empty_slot_prob = 0.0;
  c.routing.seed = o.seed;
  c.num_biases = 0;
  c.combine_weights = true;
  c.seed = o.seed;
  return c;
}

// Runs a check and turns an exception into its failure text, so that every rank reaches the gather.
std::string guarded(const std::function<std::string()>& check) {
  try {
    return check();
  } catch (const Error& e) {
    return std::string("epx::Error (") + status_string(e.status()) + "): " + e.what() + "\n";
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what() + "\n";
  }
}

// The whole chain on the current config: layout, dispatch, combine, each compared with the reference model.
std::string check_session(HtSession& s, uint64_t combine_seed) {
  s.layout();
  std::string msg = s.check_layout();
  s.dispatch();
  msg += s.check_dispatch();
  s.set_combine_inputs(combine_seed);
  s.combine();
  msg += s.check_combine();
  return msg;
}

// Gathers every rank's failure text; true when all are empty. *report gets "rank r:\n<text>" per failed rank.
bool all_passed(Bootstrap& bs, const std::string& mine, std::string* report) {
  std::vector<char> msg(kMessageBytes, '\0'), all(kMessageBytes * size_t(bs.size()));
  std::memcpy(msg.data(), mine.data(), std::min(mine.size(), kMessageBytes - 1));
  bs.all_gather(msg.data(), all.data(), kMessageBytes);
  bool ok = true;
  report->clear();
  for (int r = 0; r < bs.size(); ++r) {
    const char* text = all.data() + size_t(r) * kMessageBytes;
    if (*text == '\0') continue;
    ok = false;
    *report += "  rank " + std::to_string(r) + ":\n" + text;
  }
  return ok;
}

template <typename T>
std::vector<T> gather_value(Bootstrap& bs, const T& mine) {
  std::vector<T> all(bs.size());
  bs.all_gather(&mine, all.data(), sizeof(T));
  return all;
}

// Times `op` on every rank together and adds the row (every rank's numbers) to b.rows.
void measure(Bench& b, Op op, Impl impl, const Config& cfg, double bytes, const std::function<void(int)>& prepare,
             const std::function<void()>& run) {
  const Stats st = summarize(time_iterations(b.bs, b.stream, b.plan, prepare, run));
  // A kernel's recorded error (timeout, bad input) must fail the run, not become a number.
  b.buffer.check(b.stream);
  const RankTiming mine{bytes, st.median_us, st.min_us, st.max_us};
  b.rows.push_back(Row{op, impl, cfg, gather_value(b.bs, mine)});
}

// prepare() for a timed op that reads x: fresh x before the first iteration of the series, then every
// refresh_every timed iterations. Regenerating x happens on the host, outside the events.
std::function<void(int)> refresh_x(Bench& b, HtSession& s) {
  return [&b, &s, first = true](int timed) mutable {
    const int every = b.opt.refresh_every;
    if (first || (timed >= 0 && every > 0 && timed % every == 0)) s.set_x(harness::mix(b.next_seed++));
    first = false;
  };
}

void no_prepare(int) {}

// One config: full BF16 dispatch, cached BF16 dispatch and combine on the handle it left, full FP8 dispatch.
void time_config(Bench& b, HtSession& bf16, HtSession& fp8, const Config& cfg) {
  bf16.set_configs(cfg, cfg);  // combine needs the dispatch's num_sms: one config for both
  fp8.set_configs(cfg, cfg);
  // Inside the events: notify kernel, the host's bounded wait for the counts, the data kernel.
  measure(b, Op::kDispatchBf16, Impl::kEpx, cfg, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch(); });
  // Same routing, new x each time: the handle of the last dispatch above, no count exchange, no host wait.
  measure(b, Op::kCachedBf16, Impl::kEpx, cfg, bf16.recv_bytes(), refresh_x(b, bf16), [&] { bf16.dispatch_cached(); });
  // Expert outputs are regenerated once per config: generating them per iteration would cost ~0.5 s each.
  bf16.set_combine_inputs(harness::mix(b.next_seed++));
  measure(b, Op::kCombineBf16, Impl::kEpx, cfg, bf16.combine_bytes(), no_prepare, [&] { bf16.combine(); });
  measure(b, Op::kDispatchFp8, Impl::kEpx, cfg, fp8.recv_bytes(), refresh_x(b, fp8), [&] { fp8.dispatch(); });
}

// --check-all: the outputs the config's last timed iterations left, against the reference model.
std::string check_after_timing(const HtSession& bf16, const HtSession& fp8) {
  return bf16.check_dispatch() + bf16.check_combine() + fp8.check_dispatch();
}

// Fills a device array with bytes that are neither zeros nor a pattern (GPU.md: never zeros).
void fill_random(DeviceArray<uint8_t>& a, uint64_t seed, cudaStream_t stream) {
  std::vector<uint8_t> host(a.size());
  for (size_t i = 0; i < host.size(); i += 8) {
    const uint64_t v = harness::mix(seed, i);
    std::memcpy(host.data() + i, &v, std::min<size_t>(8, host.size() - i));
  }
  a.upload(host, stream);
  cuda_check(cudaStreamSynchronize(stream), "fill_random");
}

std::vector<size_t> bytes_of(const std::vector<int>& rows, size_t row_bytes) {
  std::vector<size_t> out;
  for (int n : rows) out.push_back(size_t(n) * row_bytes);
  return out;
}

size_t sum(const std::vector<size_t>& v) {
  size_t s = 0;
  for (size_t x : v) s += x;
  return s;
}

// NCCL all-to-all moving the same rows as epx: to rank j the tokens routed to j, packed (packing is not timed:
// the send buffer is already packed, with random bytes). Combine is the reverse direction.
void time_nccl(Bench& b, NcclComm& comm, const HtSession& bf16, const HtSession& fp8) {
  const int R = b.bs.size(), me = b.bs.rank(), H = b.opt.hidden;
  std::vector<int> to(R), from(R);  // rows this rank sends to / receives from each rank
  for (int j = 0; j < R; ++j) {
    to[j] = bf16.num_tokens_routed(me, j);
    from[j] = bf16.num_tokens_routed(j, me);
  }
  const size_t bf16_row = size_t(H) * 2, fp8_row = size_t(H) + size_t(H / epx::limits().fp8_group_size) * sizeof(float);
  struct Transfer {
    Op op;
    std::vector<size_t> send, recv;
    double bytes;  // the numerator of the epx row it is compared with
  };
  const Transfer transfers[] = {
      {Op::kDispatchBf16, bytes_of(to, bf16_row), bytes_of(from, bf16_row), bf16.recv_bytes()},
      {Op::kDispatchFp8, bytes_of(to, fp8_row), bytes_of(from, fp8_row), fp8.recv_bytes()},
      {Op::kCombineBf16, bytes_of(from, bf16_row), bytes_of(to, bf16_row), bf16.combine_bytes()},
  };
  size_t send_cap = 0, recv_cap = 0;
  for (const Transfer& t : transfers) {
    send_cap = std::max(send_cap, sum(t.send));
    recv_cap = std::max(recv_cap, sum(t.recv));
  }
  // The harness's byte counts and the routing's row counts must describe the same traffic.
  if (double(sum(transfers[0].recv)) != bf16.recv_bytes() || double(sum(transfers[1].recv)) != fp8.recv_bytes())
    throw std::runtime_error("NCCL baseline: row counts of the routing disagree with the session's recv_bytes()");
  DeviceArray<uint8_t> send(send_cap), recv(recv_cap);
  fill_random(send, harness::mix(b.opt.seed, kNcclDataSalt, me), b.stream);
  fill_random(recv, harness::mix(b.opt.seed, kNcclDataSalt + 1, me), b.stream);
  for (const Transfer& t : transfers)
    measure(b, t.op, Impl::kNccl, Config{}, t.bytes, no_prepare,
            [&] { comm.all_to_all(send.get(), t.send, recv.get(), t.recv, b.stream); });
}

// dlopens NCCL on every rank; null unless every rank has it (the ranks must agree to use it).
std::unique_ptr<NcclLibrary> load_nccl(Bootstrap& bs, std::string* note) {
  std::string why;
  std::unique_ptr<NcclLibrary> lib = NcclLibrary::load(&why);
  const std::vector<int> loaded = gather_value(bs, int(lib != nullptr));
  if (std::count(loaded.begin(), loaded.end(), 1) != bs.size()) {
    *note = "NCCL: not found (set EPX_NCCL_LIB)";
    if (bs.rank() == 0 && !why.empty()) std::fprintf(stderr, "epx-bench: tried to load NCCL from:\n%s", why.c_str());
    return nullptr;
  }
  const std::string version = lib->version();
  *note = "NCCL" + (version.empty() ? std::string() : " " + version) + ": " + lib->path();
  return lib;
}

int64_t buffer_bytes(const std::vector<Config>& sweep, int hidden, int num_ranks) {
  const int64_t row = int64_t(hidden) * 2;  // the BF16 row covers FP8 rows with their scales
  int64_t bytes = std::max(nvl_size_hint(default_dispatch_config(num_ranks), row, num_ranks),
                           nvl_size_hint(default_combine_config(num_ranks), row, num_ranks));
  for (const Config& c : sweep) bytes = std::max(bytes, nvl_size_hint(c, row, num_ranks));
  return bytes;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  cuda_check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.name;
}

std::string describe(const Config& c) {
  return "sms " + std::to_string(c.num_sms) + " chunk " + std::to_string(c.num_max_send_tokens) + " ring " +
         std::to_string(c.num_max_recv_tokens);
}

RunInfo make_run_info(const IntranodeOptions& o, int num_ranks, int device) {
  RunInfo info;
  info.benchmark = "intranode";
  info.num_ranks = num_ranks;
  info.gpu = device_name(device);
  info.tokens = o.tokens, info.hidden = o.hidden, info.topk = o.topk, info.experts = o.experts;
  info.routing = "uniform";
  info.iters = o.iters, info.warmup = o.warmup, info.seed = o.seed;
  info.nccl = "NCCL: skipped (--no-nccl)";
  return info;
}

// The sweep less configs wider than the smallest GPU, dropped on every rank alike.
std::vector<Config> runnable_configs(Bench& b, const std::vector<Config>& sweep) {
  const std::vector<int> sms = gather_value(b.bs, b.buffer.num_sms_on_device());
  const int device_sms = *std::min_element(sms.begin(), sms.end());
  std::vector<Config> out;
  for (const Config& c : sweep) {
    if (c.num_sms <= device_sms)
      out.push_back(c);
    else if (b.bs.rank() == 0)
      std::fprintf(stderr, "epx-bench: skipping %s: the GPU has %d SMs\n", describe(c).c_str(), device_sms);
  }
  return out;
}

// NCCL on the same routing, after epx: its communicator (and its threads) exist only while it is timed.
void nccl_baseline(Bench& b, const NcclLibrary& lib, const HtSession& bf16, const HtSession& fp8, RunInfo& info) {
  if (b.bs.rank() == 0) std::fprintf(stderr, "[epx-bench] NCCL baseline\n");
  std::unique_ptr<NcclComm> comm;
  const std::string why = guarded([&] {
    comm = std::make_unique<NcclComm>(lib, b.bs);  // throws on every rank alike
    return std::string();
  });
  if (comm) {
    time_nccl(b, *comm, bf16, fp8);
    return;
  }
  info.nccl = "NCCL: initialisation failed, no baseline: " + why.substr(0, why.find_last_not_of('\n') + 1);
  if (b.bs.rank() == 0) say(info.nccl + "\n");
}

// Everything after the Buffer exists. Returns the rank's exit code; throws on errors.
int run_rank(Bench& b, const std::vector<Config>& sweep) {
  const auto started = std::chrono::steady_clock::now();
  const IntranodeOptions& o = b.opt;
  const int R = b.bs.size();
  const bool lead = b.bs.rank() == 0;
  RunInfo info = make_run_info(o, R, b.buffer.device());
  std::unique_ptr<NcclLibrary> nccl = o.nccl ? load_nccl(b.bs, &info.nccl) : nullptr;
  if (lead) print_header(stdout, info);

  // 1. Correctness on the default configs, BF16 and FP8, before any timing.
  const Config dcfg = default_dispatch_config(R), ccfg = default_combine_config(R);
  HtSession bf16(b.buffer, make_case(o, EPX_BF16), dcfg, ccfg, b.stream);
  HtSession fp8(b.buffer, make_case(o, EPX_FP8_E4M3), dcfg, ccfg, b.stream);
  std::string failures;
  const bool ok = all_passed(b.bs, guarded([&] {
                               std::string msg =
                                   check_session(bf16, o.seed);  // in sequence: each runs collective operations
                               msg += check_session(fp8, o.seed);
                               b.buffer.check(b.stream);
                               return msg;
                             }),
                             &failures);
  info.check = ok ? "PASS" : "FAIL";
  if (lead) say(std::string("check vs reference model: ") + (ok ? "PASS\n" : "FAIL\n" + failures));
  if (!ok) return 1;

  // 2. The sweep.
  const std::vector<Config> configs = runnable_configs(b, sweep);
  for (size_t k = 0; k < configs.size(); ++k) {
    if (lead)
      std::fprintf(stderr, "[epx-bench] config %zu/%zu: %s\n", k + 1, configs.size(), describe(configs[k]).c_str());
    time_config(b, bf16, fp8, configs[k]);
    if (o.check_all && !all_passed(b.bs, guarded([&] { return check_after_timing(bf16, fp8); }), &failures)) {
      if (lead) say("check vs reference model after timing " + describe(configs[k]) + ": FAIL\n" + failures);
      return 1;
    }
  }
  if (o.check_all && lead) say("check vs reference model after every config: PASS\n");

  // 3. NCCL all-to-all of the same rows.
  if (nccl) nccl_baseline(b, *nccl, bf16, fp8, info);

  // 4. Report.
  if (lead) {
    print_results(stdout, b.rows);
    if (!o.json_path.empty()) {
      write_json(o.json_path, info, b.rows);
      std::printf("wrote %s\n", o.json_path.c_str());
    }
    std::printf("epx-bench intranode: done in %.0f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    std::fflush(stdout);
  }
  return 0;
}

// The body of one rank's process.
int rank_main(Bootstrap& bs, const IntranodeOptions& opt, const std::vector<Config>& sweep) {
  const int rank = bs.rank(), R = bs.size();
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");
  Stream stream;
  BufferOptions bo = default_buffer_options();
  bo.num_nvl_bytes = buffer_bytes(sweep, opt.hidden, R);
  bo.device = rank;
  Buffer buffer(bs, bo);
  try {
    Bench b{bs, buffer, stream.get(), opt, TimingPlan{opt.warmup, opt.iters}, harness::mix(opt.seed, kRefreshSalt), {}};
    const int rc = run_rank(b, sweep);
    buffer.destroy();  // collective: every rank gets here on the same path (the check result is gathered)
    return rc;
  } catch (const std::exception& e) {
    // An error on one rank leaves the others inside some collective call: skip the Buffer's collective teardown
    // (it would pair up with their calls) and leave now; the launcher then aborts the other ranks.
    std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
    std::fflush(stderr);
    std::fflush(stdout);
    _exit(1);
  }
}

}  // namespace

int run_intranode(int argc, char** argv) {
  IntranodeOptions opt;
  bool help = false;
  try {
    opt = parse_intranode_options(argc, argv, &help);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench intranode: %s\n\n%s", e.message.c_str(), intranode_usage());
    return 2;
  }
  if (help) {
    std::printf("%s", intranode_usage());
    return 0;
  }
  // Counted in a child process: this one must stay free of CUDA to fork the ranks.
  const int available = count_local_gpus();
  if (available == 0) {
    std::printf("epx-bench: no CUDA GPU visible on this machine; nothing to benchmark\n");
    return 3;
  }
  if (opt.gpus > available) {
    std::fprintf(stderr, "epx-bench: --gpus %d, but only %d GPU%s visible\n", opt.gpus, available,
                 available == 1 ? " is" : "s are");
    return 2;
  }
  const int R = opt.gpus > 0 ? opt.gpus : available;
  if (R < kMinRanks) {
    std::printf("epx-bench: only %d CUDA GPU visible; the benchmark needs at least %d\n", R, kMinRanks);
    return 3;
  }
  std::vector<std::string> skipped;
  std::vector<Config> sweep;
  try {
    validate_intranode_options(opt, R);
    sweep = sweep_configs(opt, R, &skipped);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench intranode: %s\n", e.message.c_str());
    return 2;
  }
  for (const std::string& s : skipped) std::fprintf(stderr, "epx-bench: skipping %s\n", s.c_str());
  if (sweep.empty()) {
    std::fprintf(stderr, "epx-bench intranode: no valid config in the sweep\n");
    return 2;
  }
  const LaunchResult res = launch_local(
      R, [&](Bootstrap& bs) { return rank_main(bs, opt, sweep); }, kLaunchTimeoutS, kLaunchGraceS);
  if (res.num_failed == 0) return 0;
  std::fprintf(stderr, "%s", res.summary.c_str());
  return 1;
}

}  // namespace epx::bench
