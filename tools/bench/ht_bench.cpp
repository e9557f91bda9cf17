#include "ht_bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "device_array.hpp"
#include "epx/launcher.hpp"
#include "gen.hpp"

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

// Fills a device array with bytes that are neither zeros nor a pattern (a benchmark never moves zeros).
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
// the send buffer is already packed, with random bytes). to_sources is the reverse direction.
void time_nccl(Bench& b, NcclComm& comm, const HtSession& routing, const std::vector<NcclTransfer>& transfers) {
  const int R = b.bs.size(), me = b.bs.rank();
  std::vector<int> to(R), from(R);  // rows this rank sends to / receives from each rank
  for (int j = 0; j < R; ++j) {
    to[j] = routing.num_tokens_routed(me, j);
    from[j] = routing.num_tokens_routed(j, me);
  }
  struct Sizes {
    std::vector<size_t> send, recv;
  };
  std::vector<Sizes> sizes;
  size_t send_cap = 0, recv_cap = 0;
  for (const NcclTransfer& t : transfers) {
    Sizes s{bytes_of(t.to_sources ? from : to, t.row_bytes), bytes_of(t.to_sources ? to : from, t.row_bytes)};
    // The harness's byte counts and the routing's row counts must describe the same traffic.
    if (double(sum(t.to_sources ? s.send : s.recv)) != t.bytes)
      throw std::runtime_error(std::string("NCCL baseline (") + op_name(t.op) +
                               "): row counts of the routing disagree with the session's byte count");
    send_cap = std::max(send_cap, sum(s.send));
    recv_cap = std::max(recv_cap, sum(s.recv));
    sizes.push_back(std::move(s));
  }
  DeviceArray<uint8_t> send(send_cap), recv(recv_cap);
  fill_random(send, harness::mix(b.opt.seed, kNcclDataSalt, me), b.stream);
  fill_random(recv, harness::mix(b.opt.seed, kNcclDataSalt + 1, me), b.stream);
  for (size_t k = 0; k < transfers.size(); ++k)
    measure(b, transfers[k].op, Impl::kNccl, Config{}, transfers[k].bytes, no_prepare,
            [&] { comm.all_to_all(send.get(), sizes[k].send, recv.get(), sizes[k].recv, b.stream); });
}

}  // namespace

Stream::Stream() { cuda_check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
Stream::~Stream() { cudaStreamDestroy(s_); }

void say(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

HtCase make_case(const HtOptions& o, epx_dtype dtype) {
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
  c.worst_case = o.worst_case;  // num_worst_tokens = the sum of all ranks' tokens
  c.in_buffer = o.in_buffer;
  c.sized = runs_sized(o);  // the harness sizes inside one domain only
  c.sized_offset = {o.guess_offset.value_or(HtCase::kLargest)};
  c.seed = o.seed;
  return c;
}

std::string guarded(const std::function<std::string()>& check) {
  try {
    return check();
  } catch (const Error& e) {
    return std::string("epx::Error (") + status_string(e.status()) + "): " + e.what() + "\n";
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what() + "\n";
  }
}

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

void measure(Bench& b, Op op, Impl impl, const Config& cfg, double bytes, const std::function<void(int)>& prepare,
             const std::function<void()>& run, double net_bytes) {
  const Stats st = summarize(time_iterations(b.bs, b.stream, b.plan, prepare, run));
  // A kernel's recorded error (timeout, bad input) must fail the run, not become a number.
  b.buffer.check(b.stream);
  const RankTiming mine{bytes, st.median_us, st.min_us, st.max_us, net_bytes};
  b.rows.push_back(Row{op, impl, cfg, gather_value(b.bs, mine)});
}

std::function<void(int)> refresh_x(Bench& b, HtSession& s) {
  return [&b, &s, first = true](int timed) mutable {
    const int every = b.opt.refresh_every;
    if (first || (timed >= 0 && every > 0 && timed % every == 0)) s.set_x(harness::mix(b.next_seed++));
    first = false;
  };
}

void no_prepare(int) {}

size_t bf16_row_bytes(int hidden) { return size_t(hidden) * 2; }

size_t fp8_row_bytes(int hidden) {
  return size_t(hidden) + size_t(hidden / epx::limits().fp8_group_size) * sizeof(float);
}

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

void nccl_baseline(Bench& b, const NcclLibrary& lib, const HtSession& routing,
                   const std::vector<NcclTransfer>& transfers, RunInfo& info) {
  if (b.bs.rank() == 0) std::fprintf(stderr, "[epx-bench] NCCL baseline\n");
  std::unique_ptr<NcclComm> comm;
  const std::string why = guarded([&] {
    comm = std::make_unique<NcclComm>(lib, b.bs);  // throws on every rank alike
    return std::string();
  });
  if (comm) {
    time_nccl(b, *comm, routing, transfers);
    return;
  }
  info.nccl = "NCCL: initialisation failed, no baseline: " + why.substr(0, why.find_last_not_of('\n') + 1);
  if (b.bs.rank() == 0) say(info.nccl + "\n");
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

RunInfo make_run_info(const char* benchmark, const HtOptions& o, int num_ranks, int device) {
  RunInfo info;
  info.benchmark = benchmark;
  info.num_ranks = num_ranks;
  info.gpu = device_name(device);
  info.tokens = o.tokens, info.hidden = o.hidden, info.topk = o.topk, info.experts = o.experts;
  info.routing = "uniform";
  info.worst_case = o.worst_case;
  info.in_buffer = o.in_buffer;
  info.two_step = o.two_step;
  info.guess_offset = o.guess_offset;
  info.iters = o.iters, info.warmup = o.warmup, info.seed = o.seed;
  info.nccl = "NCCL: skipped (--no-nccl)";
  return info;
}

void report(Bench& b, const RunInfo& info, std::chrono::steady_clock::time_point started) {
  if (b.bs.rank() != 0) return;
  print_results(stdout, info, b.rows);
  if (!b.opt.json_path.empty()) {
    write_json(b.opt.json_path, info, b.rows);
    std::printf("wrote %s\n", b.opt.json_path.c_str());
  }
  std::printf("epx-bench %s: done in %.0f s\n", info.benchmark.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  std::fflush(stdout);
}

std::unique_ptr<NcclLibrary> open_run(Bench& b, RunInfo& info) {
  std::unique_ptr<NcclLibrary> nccl = b.opt.nccl ? load_nccl(b.bs, &info.nccl) : nullptr;
  if (b.bs.rank() == 0) print_header(stdout, info);
  return nccl;
}

HtSession default_session(Bench& b, epx_dtype dtype) {
  const int R = b.bs.size();
  return HtSession(b.buffer, make_case(b.opt, dtype), default_dispatch_config(R), default_combine_config(R), b.stream);
}

bool check_before_timing(Bench& b, HtSession& bf16, HtSession& fp8,
                         const std::function<std::string(HtSession&, uint64_t)>& check_session, RunInfo& info) {
  const uint64_t seed = b.opt.seed;
  std::string failures;
  const bool ok = all_passed(b.bs, guarded([&] {
                               // In sequence: each runs collective operations.
                               std::string msg = check_session(bf16, seed);
                               msg += check_session(fp8, seed);
                               b.buffer.check(b.stream);
                               return msg;
                             }),
                             &failures);
  info.check = ok ? "PASS" : "FAIL";
  if (b.bs.rank() == 0) say(std::string("check vs reference model: ") + (ok ? "PASS\n" : "FAIL\n" + failures));
  return ok;
}

void finish_run(Bench& b, const NcclLibrary* nccl, const HtSession& bf16, const HtSession& fp8, RunInfo& info,
                std::chrono::steady_clock::time_point started) {
  if (nccl) {
    const size_t bf16_row = bf16_row_bytes(b.opt.hidden), fp8_row = fp8_row_bytes(b.opt.hidden);
    nccl_baseline(b, *nccl, bf16,
                  {{Op::kDispatchBf16, bf16_row, false, bf16.recv_bytes()},
                   {Op::kDispatchFp8, fp8_row, false, fp8.recv_bytes()},
                   {Op::kCombineBf16, bf16_row, true, bf16.combine_bytes()}},
                  info);
  }
  report(b, info, started);
}

int run_rank_process(Bootstrap& bs, const HtOptions& opt, const BufferOptions& buffer_options,
                     const std::function<int(Bench&)>& body) {
  const int rank = bs.rank();
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");
  Stream stream;
  BufferOptions bo = buffer_options;
  bo.device = rank;
  Buffer buffer(bs, bo);
  try {
    Bench b{bs, buffer, stream.get(), opt, TimingPlan{opt.warmup, opt.iters}, harness::mix(opt.seed, kRefreshSalt), {}};
    const int rc = body(b);
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

int choose_ranks(const HtOptions& o, int* num_ranks) {
  // Counted in a child process: this one must stay free of CUDA to fork the ranks.
  const int available = count_local_gpus();
  if (available == 0) {
    std::printf("epx-bench: no CUDA GPU visible on this machine; nothing to benchmark\n");
    return 3;
  }
  if (o.gpus > available) {
    std::fprintf(stderr, "epx-bench: --gpus %d, but only %d GPU%s visible\n", o.gpus, available,
                 available == 1 ? " is" : "s are");
    return 2;
  }
  const int R = o.gpus > 0 ? o.gpus : available;
  if (R < kMinRanks) {
    std::printf("epx-bench: only %d CUDA GPU visible; the benchmark needs at least %d\n", R, kMinRanks);
    return 3;
  }
  *num_ranks = R;
  return 0;
}

int launch_ranks(int num_ranks, const std::function<int(Bootstrap&)>& body) {
  const LaunchResult res = launch_local(num_ranks, body, kLaunchTimeoutS, kLaunchGraceS);
  if (res.num_failed == 0) return 0;
  std::fprintf(stderr, "%s", res.summary.c_str());
  return 1;
}

}  // namespace epx::bench
