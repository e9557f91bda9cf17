// Rows of measurements and how rank 0 prints them: a header, a table with one row per (op, config) and per-rank
// numbers, an NCCL row per op, the best config per op, and optionally the same rows as JSON. Internode runs add
// the domains and, for dispatch, the bandwidth of the bytes that crossed the network hop.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx::bench {

// kCombineBf16: the intranode combine, and the NCCL rows of combine (the internode combine rows are one per
// reduction order, compared with that NCCL row).
enum class Op { kDispatchBf16, kDispatchFp8, kCachedBf16, kCombineBf16, kCombineTwoLevel, kCombineFlat };
// In the order of the table.
constexpr Op kOps[] = {Op::kDispatchBf16,    Op::kDispatchFp8, Op::kCachedBf16,
                       Op::kCombineTwoLevel, Op::kCombineFlat, Op::kCombineBf16};
const char* op_name(Op op);
// The NCCL measurement an op is compared with: cached dispatch moves the same bytes as BF16 dispatch, and every
// combine order the same as the BF16 combine.
Op baseline_of(Op op);
// Dispatch ops (tokens to the experts' ranks): the internode table gives their network-hop bandwidth too.
bool is_dispatch(Op op);

enum class Impl { kEpx, kNccl };

// One rank's result of one measurement. Plain data: it travels through the bootstrap all-gather.
struct RankTiming {
  double bytes = 0;  // bytes received by this rank, own included (the byte count bandwidth is reported on)
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
  double net_bytes = 0;  // internode dispatch: bytes of the rows that crossed the network hop into this rank
};

struct Row {
  Op op;
  Impl impl;
  Config config{};  // epx rows only
  std::vector<RankTiming> ranks;

  double gbps(int rank) const;  // bytes / median time, 1 GB = 1e9 bytes
  double min_gbps() const;      // the slowest rank's bandwidth: what the collective delivers
  double max_median_us() const;
  double net_gbps(int rank) const;  // net_bytes / median time
  double min_net_gbps() const;
  bool has_net() const { return impl == Impl::kEpx && is_dispatch(op); }  // in an internode run
};

struct RunInfo {
  std::string benchmark;  // "intranode", "internode"
  int num_ranks = 0;
  int num_domains = 0;  // internode: D NVLink domains of num_nvl_ranks GPUs (and the net columns); 0 otherwise
  int num_nvl_ranks = 0;
  std::string gpu;
  int tokens = 0, hidden = 0, topk = 0, experts = 0;
  std::string routing;
  bool worst_case = false;          // the dispatches ran with num_worst_tokens (no host wait)
  bool in_buffer = false;           // the dispatches wrote into the buffer's output region
  bool two_step = false;            // dispatches with a layout ran as notify_dispatch, then dispatch
  std::optional<int> guess_offset;  // dispatch_sized's guess: the rows received + this (else all ranks' tokens)
  int iters = 0, warmup = 0;
  uint64_t seed = 0;
  std::string check;  // "PASS", or what failed
  std::string nccl;   // "NCCL 2.28.9 (path)", "NCCL: not found (set EPX_NCCL_LIB)", ...
};

void print_header(std::FILE* out, const RunInfo& info);
// The table (grouped by op; epx rows in measurement order, then the op's NCCL row) and the best-per-op summary;
// an internode run's (info.num_domains > 0) with the net GB/s columns.
void print_results(std::FILE* out, const RunInfo& info, const std::vector<Row>& rows);
// Throws std::runtime_error if the file cannot be written.
void write_json(const std::string& path, const RunInfo& info, const std::vector<Row>& rows);

}  // namespace epx::bench
