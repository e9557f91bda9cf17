// epx-bench low-latency: decoding-sized dispatch / combine latency per rank, checked against the reference model
// first, with the NCCL all-to-all of the same tokens as a baseline.
//   epx-bench low-latency [--gpus N] [--tokens 128] [--hidden 7168] [--topk 8] [--experts 288] [--bf16]
//                         [--logfmt | --rank-reduced] [--iters 200] [--warmup 20] [--no-nccl] [--fixed-gate]
//                         [--seed S]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "epx/launcher.hpp"
#include "low_latency.hpp"
#include "nccl_baseline.hpp"
#include "options.hpp"
#include "timing.hpp"

namespace epx::bench {
namespace {

struct LowLatencyOptions {
  int gpus = 0;
  int tokens = 128;
  int hidden = 7168;
  int topk = 8;
  int experts = 288;
  bool fp8 = true;
  bool logfmt = false;        // combine with use_logfmt (docs/logfmt.md)
  bool rank_reduced = false;  // dispatch with the weights; rank-reduced combine rows beside the flat ones
  int iters = 200;
  int warmup = 20;
  bool nccl = true;
  bool fixed_gate = false;  // queued rows: a fixed gate per rank (the method before v0.18), not a common release
  uint64_t seed = 1;
  std::string json;
};

const char* kUsage =
    "usage: epx-bench low-latency [--gpus N] [--tokens 128] [--hidden 7168] [--topk 8] [--experts 288] [--bf16]\n"
    "                             [--logfmt | --rank-reduced] [--iters 200] [--warmup 20] [--no-nccl]\n"
    "                             [--fixed-gate] [--seed S] [--json FILE]\n"
    "Times low-latency dispatch (FP8 unless --bf16), combine (LogFMT rows with --logfmt), dispatch + combine,\n"
    "and the send / receive phases with the receive hook, per rank (CUDA events, median), after checking one\n"
    "step against the reference model; NCCL all-to-all of the same tokens (one row per token per destination\n"
    "rank) as baseline, and of the combine's own rows (one per selected expert: twice those bytes at the\n"
    "defaults).\n"
    "Rows '..., 10 in a row' time 10 calls back to back and give the time per call (steady state).\n"
    "Row 'launch floor' times an empty kernel launched as the low-latency kernels are (cooperative, a block\n"
    "of 1024 threads per SM) as a single call: what every single-call row carries before any work. Row\n"
    "'..., host part of a single call' is the host's time from the start event's record to the stop's.\n"
    "Rows marked queued issue the call while a gate kernel holds the stream, and every rank's gate lets go\n"
    "at the same moment (rank 0 releases them 200 us after the ranks' shared start): the GPU's time only,\n"
    "without the host's launch latency (which the single-call rows include) or the ranks' launch skew.\n"
    "--fixed-gate: each rank's gate ends 200 us after its own launch instead (as before v0.18; the ranks'\n"
    "launch skew then lands in the queued rows).\n"
    "--rank-reduced: every dispatch also carries the weights (its rows include that cost), and rows 'combine\n"
    "rank-reduced' (EPX_REDUCE_RANK: one partial row per token and expert rank) follow the flat combine's.\n";

LowLatencyOptions parse(int argc, char** argv, bool* help) {
  LowLatencyOptions o;
  *help = false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError{a + " needs a value"};
      return argv[++i];
    };
    if (a == "--help" || a == "-h")
      *help = true;
    else if (a == "--gpus")
      o.gpus = parse_int(a, value(), 1, 8);
    else if (a == "--tokens")
      o.tokens = parse_int(a, value(), 1, 4096);
    else if (a == "--hidden")
      o.hidden = parse_int(a, value(), epx::limits().fp8_group_size, epx::limits().max_hidden);
    else if (a == "--topk")
      o.topk = parse_int(a, value(), 1, 32);
    else if (a == "--experts")
      o.experts = parse_int(a, value(), 1, 1024);
    else if (a == "--bf16")
      o.fp8 = false;
    else if (a == "--logfmt")
      o.logfmt = true;
    else if (a == "--rank-reduced")
      o.rank_reduced = true;
    else if (a == "--iters")
      o.iters = parse_int(a, value(), 1, 100000);
    else if (a == "--warmup")
      o.warmup = parse_int(a, value(), 0, 100000);
    else if (a == "--no-nccl")
      o.nccl = false;
    else if (a == "--fixed-gate")
      o.fixed_gate = true;
    else if (a == "--seed")
      o.seed = parse_u64(a, value());
    else if (a == "--json")
      o.json = value();
    else
      throw UsageError{"unknown option " + a};
  }
  if (o.logfmt && o.rank_reduced) throw UsageError{"--logfmt and --rank-reduced exclude each other"};
  return o;
}

struct Row {
  std::string what;
  std::vector<double> median_us;  // per rank
  int overruns = -1;              // queued rows: iterations (all ranks) whose host part outlasted half the gate
};

Row measure(Bootstrap& bs, cudaStream_t stream, const std::string& what, const TimingPlan& plan,
            const std::function<void(int)>& prepare, const std::function<void()>& op) {
  const Stats mine = summarize(time_iterations(bs, stream, plan, prepare, op));
  Row r{what, std::vector<double>(bs.size())};
  bs.all_gather(&mine.median_us, r.median_us.data(), sizeof(double));
  return r;
}

// Steady state: kInARow calls back to back inside one pair of events, reported per call. A decoding step runs
// layer after layer, so a call there rarely starts on an idle GPU; each single-call row above does (the ranks
// meet at a ~1 ms start barrier first) and also carries the launch latency.
constexpr int kInARow = 10;

Row measure_in_a_row(Bootstrap& bs, cudaStream_t stream, const std::string& what, const TimingPlan& plan,
                     const std::function<void()>& op) {
  Row r = measure(
      bs, stream, what + ", " + std::to_string(kInARow) + " in a row", plan, [](int) {},
      [&] {
        for (int i = 0; i < kInARow; ++i) op();
      });
  for (double& v : r.median_us) v /= kInARow;
  return r;
}

// Launch queued: the call is issued while a kGateUs gate kernel holds the stream, so the events time the GPU
// work only (block launch included), as in a decoding step whose launches run ahead of the GPU and as kernel
// durations read by a profiler. The single-call rows above carry the host's launch latency as well.
constexpr int kGateUs = 200;

Row measure_queued(
    Bootstrap& bs, cudaStream_t stream, const std::string& what, const TimingPlan& plan,
    const std::function<void()>& op, const std::function<void(int)>& prepare = [](int) {}) {
  int overruns = 0;
  TimingPlan queued = plan;
  queued.gate_us = kGateUs;
  queued.gate_overruns = &overruns;
  Row r = measure(bs, stream, what, queued, prepare, op);
  std::vector<int> all(bs.size());
  bs.all_gather(&overruns, all.data(), sizeof(int));
  r.overruns = 0;
  for (int v : all) r.overruns += v;
  return r;
}

// This rank's ReleaseLine, detached on every way out of rank_main (a no-op when it never attached).
struct OwnedReleaseLine {
  ReleaseLine line;
  ~OwnedReleaseLine() { detach_release_line(&line); }
};

int rank_main(Bootstrap& bs, const LowLatencyOptions& o, void* release_page) {
  const int rank = bs.rank(), R = bs.size();
  cudaSetDevice(rank);
  // The queued rows' common start (gate.hpp); without it (every rank must have it) they fall back to a fixed
  // gate per rank, and the header says so.
  OwnedReleaseLine owned;
  ReleaseLine& line = owned.line;
  int have_line = !o.fixed_gate && attach_release_line(release_page, rank == 0, &line) ? 1 : 0;
  {
    std::vector<int> lines(R);
    bs.all_gather(&have_line, lines.data(), sizeof(int));
    have_line = *std::min_element(lines.begin(), lines.end());
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const int experts = o.experts / R * R;
  BufferOptions bo = default_buffer_options();
  bo.num_rdma_bytes = low_latency_size_hint(o.tokens, o.hidden, R, experts);
  bo.low_latency_mode = 1;
  Buffer buffer(bs, bo);

  harness::LowLatencyCase c;
  c.tokens = {o.tokens};
  c.max_tokens = o.tokens;
  c.hidden = o.hidden;
  c.num_experts = experts;
  c.num_topk = o.topk;
  c.fp8 = o.fp8;
  c.logfmt = o.logfmt;
  c.rank_reduced = o.rank_reduced;
  c.seed = o.seed;
  harness::LowLatencySession s(buffer, c, stream);
  s.set_combine_rank_reduced(false);  // the flat rows; the rank-reduced ones switch it on around themselves

  // Correctness first (with --rank-reduced: both orders).
  s.dispatch(kLowLatencyBothPhases);
  std::string err = s.check_dispatch();
  s.set_combine_inputs(o.seed + 1);
  s.combine(kLowLatencyBothPhases);
  err += s.check_combine();
  if (o.rank_reduced) {
    s.set_combine_rank_reduced(true);
    s.combine(kLowLatencyBothPhases);
    err += s.check_combine();
    s.set_combine_rank_reduced(false);
  }
  char mine[512] = {};
  std::snprintf(mine, sizeof(mine), "%s", err.c_str());
  std::vector<char> all(size_t(R) * sizeof(mine));
  bs.all_gather(mine, all.data(), sizeof(mine));
  bool ok = true;
  for (int r = 0; r < R; ++r) ok &= all[size_t(r) * sizeof(mine)] == 0;
  if (rank == 0) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf(
        "epx-bench low-latency: %d ranks x %s, %d tokens/rank, hidden %d, top-%d of %d experts, %s dispatch, "
        "%s combine, median of %d iterations after %d warm-up\n",
        R, prop.name, o.tokens, o.hidden, o.topk, experts, o.fp8 ? "FP8" : "BF16",
        o.logfmt ? "LogFMT" : (o.rank_reduced ? "BF16 (flat and rank-reduced)" : "BF16"), o.iters, o.warmup);
    std::printf("low-latency transport: %s\n", describe_low_latency_transport(buffer.low_latency_transport()).c_str());
    std::printf("check vs reference model: %s\n", ok ? "PASS" : "FAIL");
    if (have_line)
      std::printf("queued rows: every rank's gate released at once by rank 0 (a shared host word)\n");
    else
      std::printf("queued rows: a fixed 200 us gate per rank (%s: ranks may start apart)\n",
                  o.fixed_gate ? "--fixed-gate" : "no shared host word");
    for (int r = 0; r < R && !ok; ++r)
      if (all[size_t(r) * sizeof(mine)]) std::printf("rank %d:\n%s\n", r, &all[size_t(r) * sizeof(mine)]);
  }
  if (!ok) return 1;

  TimingPlan plan{o.warmup, o.iters};
  if (have_line) plan.release_line = &line;
  auto none = [](int) {};
  const std::string combine_name = o.logfmt ? "combine logfmt" : "combine bf16";
  std::vector<Row> rows;
  // Each timed op is balanced by its partner (untimed) so that buffer sets keep alternating on every rank.
  rows.push_back(measure(bs, stream, "launch floor (empty kernel, single call)", plan, none,
                         [&] { harness::cuda_check(launch_empty_like_low_latency(stream), "empty kernel"); }));
  {
    std::vector<double> host_us;
    TimingPlan with_host = plan;
    with_host.host_us = &host_us;
    const std::string name = std::string("dispatch ") + (o.fp8 ? "fp8" : "bf16");
    rows.push_back(measure(bs, stream, name, with_host, none, [&] { s.dispatch(kLowLatencyBothPhases); }));
    const double mine = summarize(host_us).median_us;
    Row host{name + ", host part of a single call", std::vector<double>(bs.size())};
    bs.all_gather(&mine, host.median_us.data(), sizeof(double));
    rows.push_back(host);
  }
  rows.push_back(measure(bs, stream, combine_name, plan, none, [&] { s.combine(kLowLatencyBothPhases); }));
  // --rank-reduced: the same row in that order, beside the flat one.
  const auto rank_reduced_row = [&](auto&& measure_row) {
    if (!o.rank_reduced) return;
    s.set_combine_rank_reduced(true);
    rows.push_back(measure_row());
    s.set_combine_rank_reduced(false);
  };
  rank_reduced_row([&] {
    return measure(bs, stream, "combine rank-reduced", plan, none, [&] { s.combine(kLowLatencyBothPhases); });
  });
  rows.push_back(measure(bs, stream, "dispatch + combine", plan, none, [&] {
    s.dispatch(kLowLatencyBothPhases);
    s.combine(kLowLatencyBothPhases);
  }));
  rows.push_back(measure_in_a_row(bs, stream, std::string("dispatch ") + (o.fp8 ? "fp8" : "bf16"), plan,
                                  [&] { s.dispatch(kLowLatencyBothPhases); }));
  rows.push_back(measure_in_a_row(bs, stream, combine_name, plan, [&] { s.combine(kLowLatencyBothPhases); }));
  rank_reduced_row([&] {
    return measure_in_a_row(bs, stream, "combine rank-reduced", plan, [&] { s.combine(kLowLatencyBothPhases); });
  });
  rows.push_back(measure_in_a_row(bs, stream, "dispatch + combine", plan, [&] {
    s.dispatch(kLowLatencyBothPhases);
    s.combine(kLowLatencyBothPhases);
  }));
  s.dispatch(kLowLatencySendPhase);  // each prepare() receives the previous send
  rows.push_back(measure(
      bs, stream, "dispatch send phase (hook)", plan,
      [&](int) {
        s.dispatch(kLowLatencyRecvPhase);  // completes the previous iteration's dispatch
      },
      [&] { s.dispatch(kLowLatencySendPhase); }));
  s.dispatch(kLowLatencyRecvPhase);
  rows.push_back(measure(
      bs, stream, "dispatch recv phase (hook)", plan,
      [&](int) {
        s.dispatch(kLowLatencySendPhase);
        cudaStreamSynchronize(stream);
      },
      [&] { s.dispatch(kLowLatencyRecvPhase); }));
  s.combine(kLowLatencySendPhase);
  rows.push_back(measure(
      bs, stream, "combine send phase (hook)", plan, [&](int) { s.combine(kLowLatencyRecvPhase); },
      [&] { s.combine(kLowLatencySendPhase); }));
  // The send phase alone on the GPU (no host launch latency): how far the rows' transfer is from the links'
  // rate (tools/probes/link_rate.cu).
  rows.push_back(measure_queued(
      bs, stream, "combine send phase (hook, queued)", plan, [&] { s.combine(kLowLatencySendPhase); },
      [&](int) { s.combine(kLowLatencyRecvPhase); }));
  s.combine(kLowLatencyRecvPhase);
  rows.push_back(measure(
      bs, stream, "combine recv phase (hook)", plan,
      [&](int) {
        s.combine(kLowLatencySendPhase);
        cudaStreamSynchronize(stream);
      },
      [&] { s.combine(kLowLatencyRecvPhase); }));
  // The same three rows in the rank-reduced order (a receive must repeat its send's order, so each block of calls
  // starts and ends with no send outstanding in the other order).
  rank_reduced_row([&] {
    s.combine(kLowLatencySendPhase);
    return measure(
        bs, stream, "combine rank-reduced send phase (hook)", plan, [&](int) { s.combine(kLowLatencyRecvPhase); },
        [&] { s.combine(kLowLatencySendPhase); });
  });
  rank_reduced_row([&] {
    Row r = measure_queued(
        bs, stream, "combine rank-reduced send phase (hook, queued)", plan, [&] { s.combine(kLowLatencySendPhase); },
        [&](int) { s.combine(kLowLatencyRecvPhase); });
    s.combine(kLowLatencyRecvPhase);
    return r;
  });
  rank_reduced_row([&] {
    return measure(
        bs, stream, "combine rank-reduced recv phase (hook)", plan,
        [&](int) {
          s.combine(kLowLatencySendPhase);
          cudaStreamSynchronize(stream);
        },
        [&] { s.combine(kLowLatencyRecvPhase); });
  });

  rows.push_back(measure_queued(bs, stream, std::string("dispatch ") + (o.fp8 ? "fp8" : "bf16") + " (queued)", plan,
                                [&] { s.dispatch(kLowLatencyBothPhases); }));
  rows.push_back(
      measure_queued(bs, stream, combine_name + " (queued)", plan, [&] { s.combine(kLowLatencyBothPhases); }));
  rank_reduced_row([&] {
    return measure_queued(bs, stream, "combine rank-reduced (queued)", plan, [&] { s.combine(kLowLatencyBothPhases); });
  });

  // The same tokens through a CUDA graph (dispatch + combine), as frameworks run decoding.
  {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
    s.dispatch(kLowLatencyBothPhases, /*counted=*/false);
    s.combine(kLowLatencyBothPhases);
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      rows.push_back(
          measure(bs, stream, "dispatch + combine (graph)", plan, none, [&] { cudaGraphLaunch(exec, stream); }));
      rows.push_back(measure_queued(bs, stream, "dispatch + combine (graph, queued)", plan,
                                    [&] { cudaGraphLaunch(exec, stream); }));
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
  }
  buffer.check(stream);

  // NCCL: every token's bf16 (or fp8 + scales) row once to each destination rank it selects, and back.
  std::string nccl_note = "NCCL: skipped";
  if (o.nccl) {
    std::string why;
    std::unique_ptr<NcclLibrary> lib = NcclLibrary::load(&why);
    int have = lib != nullptr, all_have = 0;
    std::vector<int> flags(R);
    bs.all_gather(&have, flags.data(), sizeof(int));
    all_have = *std::min_element(flags.begin(), flags.end());
    if (all_have) {
      NcclComm comm(*lib, bs);
      const size_t row = o.fp8 ? size_t(o.hidden) + o.hidden / epx::limits().fp8_group_size * 4 : size_t(o.hidden) * 2;
      // Uniform routing: about T * (1 - (1 - 1/R)^K) tokens per destination; use T per destination (upper bound).
      std::vector<size_t> bytes(R, size_t(o.tokens) * row);
      harness::DeviceArray<uint8_t> send(bytes[0] * R), recv(bytes[0] * R);
      send.fill_bytes(0x3c, stream);
      rows.push_back(measure(bs, stream, "nccl all-to-all (dispatch bytes)", plan, none,
                             [&] { comm.all_to_all(send.get(), bytes, recv.get(), bytes, stream); }));
      std::vector<size_t> back(R, size_t(o.tokens) * o.hidden * 2);
      harness::DeviceArray<uint8_t> send2(back[0] * R), recv2(back[0] * R);
      send2.fill_bytes(0x3c, stream);
      rows.push_back(measure(bs, stream, "nccl all-to-all (combine bytes)", plan, none,
                             [&] { comm.all_to_all(send2.get(), back, recv2.get(), back, stream); }));
      rows.push_back(measure_queued(bs, stream, "nccl all-to-all (dispatch bytes, queued)", plan,
                                    [&] { comm.all_to_all(send.get(), bytes, recv.get(), bytes, stream); }));
      rows.push_back(measure_queued(bs, stream, "nccl all-to-all (combine bytes, queued)", plan,
                                    [&] { comm.all_to_all(send2.get(), back, recv2.get(), back, stream); }));
      // The combine's own rows per peer (a row per selected expert, not per token and rank): the same bytes
      // as our combine moves.
      const std::vector<size_t> to = s.combine_rows_to(), from = s.combine_rows_from();
      std::vector<size_t> rows_out(R), rows_in(R);
      size_t total_out = 0, total_in = 0;
      for (int r = 0; r < R; ++r) {
        rows_out[r] = to[r] * o.hidden * 2;
        rows_in[r] = from[r] * o.hidden * 2;
        total_out += rows_out[r];
        total_in += rows_in[r];
      }
      harness::DeviceArray<uint8_t> send3(std::max<size_t>(total_out, 16)), recv3(std::max<size_t>(total_in, 16));
      send3.fill_bytes(0x3c, stream);
      rows.push_back(measure(bs, stream, "nccl all-to-all (combine's rows)", plan, none,
                             [&] { comm.all_to_all(send3.get(), rows_out, recv3.get(), rows_in, stream); }));
      rows.push_back(measure_queued(bs, stream, "nccl all-to-all (combine's rows, queued)", plan,
                                    [&] { comm.all_to_all(send3.get(), rows_out, recv3.get(), rows_in, stream); }));
      rows.push_back(measure_in_a_row(bs, stream, "nccl (dispatch bytes)", plan,
                                      [&] { comm.all_to_all(send.get(), bytes, recv.get(), bytes, stream); }));
      rows.push_back(measure_in_a_row(bs, stream, "nccl (combine bytes)", plan,
                                      [&] { comm.all_to_all(send2.get(), back, recv2.get(), back, stream); }));
      nccl_note = "NCCL " + lib->version() + ": " + lib->path() + " (T rows to every rank: an upper bound on bytes)";
    } else {
      nccl_note = "NCCL: not found (set EPX_NCCL_LIB)";
    }
  }
  // Gates that ran out of time before rank 0's release: those iterations did not start together.
  std::vector<uint32_t> expired(R);
  const uint32_t my_expired = have_line ? __atomic_load_n(line.expired, __ATOMIC_ACQUIRE) : 0;
  bs.all_gather(&my_expired, expired.data(), sizeof(uint32_t));
  uint32_t total_expired = 0;
  for (uint32_t v : expired) total_expired += v;
  if (rank == 0) {
    std::printf("%s\n", nccl_note.c_str());
    std::printf("%-41s |", "op (median us per rank)");
    for (int r = 0; r < R; ++r) std::printf("  rank%-3d", r);
    std::printf(" |   max us\n");
    for (const Row& row : rows) {
      std::printf("%-41s |", row.what.c_str());
      for (double v : row.median_us) std::printf(" %8.1f", v);
      std::printf(" | %8.1f\n", *std::max_element(row.median_us.begin(), row.median_us.end()));
    }
    for (const Row& row : rows)
      if (row.overruns > 0)
        std::printf(
            "warning: %s: in %d timed iterations (all ranks) the host took more than half of the %d us "
            "gate to queue the call; those may include launch latency\n",
            row.what.c_str(), row.overruns, kGateUs);
    if (total_expired > 0)
      std::printf(
          "warning: %u queued iterations (all ranks) left their gate by its time bound, not at rank 0's "
          "release: those ranks did not start together\n",
          total_expired);
  }
  if (rank == 0 && !o.json.empty()) {
    if (std::FILE* f = std::fopen(o.json.c_str(), "w")) {
      std::fprintf(f,
                   "{\"mode\": \"low-latency\", \"ranks\": %d, \"tokens\": %d, \"hidden\": %d, \"topk\": %d, "
                   "\"experts\": %d, \"fp8\": %s, \"logfmt\": %s, \"rank_reduced\": %s, \"transport\": \"%s\", "
                   "\"queued_start\": "
                   "\"%s\", \"gate_expired\": %u, \"rows\": [",
                   R, o.tokens, o.hidden, o.topk, experts, o.fp8 ? "true" : "false", o.logfmt ? "true" : "false",
                   o.rank_reduced ? "true" : "false",
                   describe_low_latency_transport(buffer.low_latency_transport()).c_str(),
                   have_line ? "released together" : "fixed gate", total_expired);
      for (size_t i = 0; i < rows.size(); ++i) {
        std::fprintf(f, "%s{\"op\": \"%s\", \"median_us\": [", i ? ", " : "", rows[i].what.c_str());
        for (int r = 0; r < R; ++r) std::fprintf(f, "%s%.2f", r ? ", " : "", rows[i].median_us[r]);
        std::fprintf(f, "]");
        if (rows[i].overruns >= 0) std::fprintf(f, ", \"queue_overruns\": %d", rows[i].overruns);
        std::fprintf(f, "}");
      }
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  }
  buffer.destroy();
  return 0;
}

}  // namespace

int run_low_latency(int argc, char** argv) {
  bool help = false;
  LowLatencyOptions o;
  try {
    o = parse(argc, argv, &help);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "epx-bench low-latency: %s\n%s", e.message.c_str(), kUsage);
    return 2;
  }
  if (help) {
    std::printf("%s", kUsage);
    return 0;
  }
  const int gpus = count_local_gpus();
  if (gpus <= 0) {
    std::printf("epx-bench: no CUDA GPU visible on this machine; nothing to benchmark\n");
    return 3;
  }
  const int R = o.gpus > 0 ? o.gpus : gpus;
  if (R < 2 || R > gpus) {
    std::fprintf(stderr, "epx-bench low-latency: needs 2..%d GPUs here, asked for %d\n", gpus, R);
    return R < 2 && gpus < 2 ? 3 : 2;
  }
  // Shared by the ranks' processes: made here, before launch_local forks them (gate.hpp).
  void* release_page = create_release_page();
  const LaunchResult res = launch_local(
      R, [&](Bootstrap& bs) { return rank_main(bs, o, release_page); }, 1200, 60);
  free_release_page(release_page);
  if (res.num_failed) std::fprintf(stderr, "%s", res.summary.c_str());
  return res.num_failed ? 1 : 0;
}

}  // namespace epx::bench
