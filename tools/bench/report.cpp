#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace epx::bench {
namespace {

const Row* find_nccl(const std::vector<Row>& rows, Op op) {
  for (const Row& r : rows)
    if (r.impl == Impl::kNccl && r.op == baseline_of(op)) return &r;
  return nullptr;
}

// "1.43x" of epx over NCCL (min-over-ranks bandwidth), or "-" without a baseline.
std::string speedup(const Row& row, const std::vector<Row>& rows) {
  const Row* nccl = find_nccl(rows, row.op);
  if (row.impl != Impl::kEpx || nccl == nullptr || nccl->min_gbps() <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2fx", row.min_gbps() / nccl->min_gbps());
  return buf;
}

void print_table_header(std::FILE* out, int num_ranks, bool with_net) {
  std::fprintf(out, "%-13s %-4s %4s %5s %5s |", "op", "impl", "sms", "chunk", "ring");
  for (int r = 0; r < num_ranks; ++r) std::fprintf(out, " %8s", ("r" + std::to_string(r) + " GB/s").c_str());
  std::fprintf(out, " |");
  for (int r = 0; r < num_ranks; ++r) std::fprintf(out, " %7s", ("r" + std::to_string(r) + " us").c_str());
  std::fprintf(out, " | %8s %7s", "min GB/s", "vs NCCL");
  if (with_net) {
    std::fprintf(out, " |");
    for (int r = 0; r < num_ranks; ++r) std::fprintf(out, " %8s", ("r" + std::to_string(r) + " net").c_str());
    std::fprintf(out, " %8s", "min net");
  }
  std::fprintf(out, "\n");
}

void print_row(std::FILE* out, const Row& row, const std::vector<Row>& rows, bool with_net) {
  if (row.impl == Impl::kEpx)
    std::fprintf(out, "%-13s %-4s %4d %5d %5d |", op_name(row.op), "epx", row.config.num_sms,
                 row.config.num_max_send_tokens, row.config.num_max_recv_tokens);
  else
    std::fprintf(out, "%-13s %-4s %4s %5s %5s |", op_name(row.op), "nccl", "-", "-", "-");
  for (size_t r = 0; r < row.ranks.size(); ++r) std::fprintf(out, " %8.1f", row.gbps(int(r)));
  std::fprintf(out, " |");
  for (const RankTiming& t : row.ranks) std::fprintf(out, " %7.0f", t.median_us);
  std::fprintf(out, " | %8.1f %7s", row.min_gbps(), speedup(row, rows).c_str());
  if (with_net) {
    std::fprintf(out, " |");
    for (size_t r = 0; r < row.ranks.size(); ++r) {
      if (row.has_net())
        std::fprintf(out, " %8.1f", row.net_gbps(int(r)));
      else
        std::fprintf(out, " %8s", "-");
    }
    if (row.has_net())
      std::fprintf(out, " %8.1f", row.min_net_gbps());
    else
      std::fprintf(out, " %8s", "-");
  }
  std::fprintf(out, "\n");
}

void print_best(std::FILE* out, const std::vector<Row>& rows, bool with_net) {
  std::fprintf(out, "best per op (highest min-over-ranks GB/s):\n");
  for (Op op : kOps) {
    const Row* best = nullptr;
    for (const Row& r : rows)
      if (r.impl == Impl::kEpx && r.op == op && (best == nullptr || r.min_gbps() > best->min_gbps())) best = &r;
    if (best == nullptr) continue;
    std::fprintf(out, "  %-13s sms %2d chunk %3d ring %4d: %7.1f GB/s, %6.0f us (slowest rank's median)", op_name(op),
                 best->config.num_sms, best->config.num_max_send_tokens, best->config.num_max_recv_tokens,
                 best->min_gbps(), best->max_median_us());
    if (with_net && best->has_net()) std::fprintf(out, ", net %.1f GB/s", best->min_net_gbps());
    if (const Row* nccl = find_nccl(rows, op))
      std::fprintf(out, "; NCCL %.1f GB/s, %s", nccl->min_gbps(), speedup(*best, rows).c_str());
    std::fprintf(out, "\n");
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// [f(0), f(1), ...] over the ranks of a row.
template <typename F>
std::string json_per_rank(const Row& row, F f) {
  std::string out = "[";
  for (size_t r = 0; r < row.ranks.size(); ++r) out += (r ? ", " : "") + json_number(f(int(r)));
  return out + "]";
}

std::string json_row(const Row& row, const std::vector<Row>& rows, bool internode) {
  std::string s = "    {\"op\": " + json_string(op_name(row.op)) +
                  ", \"impl\": " + json_string(row.impl == Impl::kEpx ? "epx" : "nccl") + ", \"config\": ";
  if (row.impl == Impl::kEpx)
    s += "{\"num_sms\": " + std::to_string(row.config.num_sms) +
         ", \"num_max_send_tokens\": " + std::to_string(row.config.num_max_send_tokens) +
         ", \"num_max_recv_tokens\": " + std::to_string(row.config.num_max_recv_tokens) +
         (internode ? ", \"num_max_rdma_send_tokens\": " + std::to_string(row.config.num_max_rdma_send_tokens) +
                          ", \"num_max_rdma_recv_tokens\": " + std::to_string(row.config.num_max_rdma_recv_tokens)
                    : std::string()) +
         "}";
  else
    s += "null";
  s += ",\n     \"bytes\": " + json_per_rank(row, [&](int r) { return row.ranks[r].bytes; });
  s += ",\n     \"median_us\": " + json_per_rank(row, [&](int r) { return row.ranks[r].median_us; });
  s += ",\n     \"min_us\": " + json_per_rank(row, [&](int r) { return row.ranks[r].min_us; });
  s += ",\n     \"max_us\": " + json_per_rank(row, [&](int r) { return row.ranks[r].max_us; });
  s += ",\n     \"gbps\": " + json_per_rank(row, [&](int r) { return row.gbps(r); });
  if (internode) {
    const bool net = row.has_net();
    s += ",\n     \"net_bytes\": " + (net ? json_per_rank(row, [&](int r) { return row.ranks[r].net_bytes; }) : "null");
    s += ",\n     \"net_gbps\": " + (net ? json_per_rank(row, [&](int r) { return row.net_gbps(r); }) : "null");
    s += ", \"min_net_gbps\": " + (net ? json_number(row.min_net_gbps()) : "null");
  }
  s += ",\n     \"min_gbps\": " + json_number(row.min_gbps());
  const Row* nccl = row.impl == Impl::kEpx ? find_nccl(rows, row.op) : nullptr;
  s += ", \"nccl_min_gbps\": " + (nccl ? json_number(nccl->min_gbps()) : std::string("null")) + "}";
  return s;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kDispatchBf16:
      return "dispatch bf16";
    case Op::kDispatchFp8:
      return "dispatch fp8";
    case Op::kCachedBf16:
      return "cached bf16";
    case Op::kCombineBf16:
      return "combine bf16";
    case Op::kCombineTwoLevel:
      return "combine 2-lvl";
    case Op::kCombineFlat:
      return "combine flat";
  }
  return "?";
}

Op baseline_of(Op op) {
  switch (op) {
    case Op::kCachedBf16:
      return Op::kDispatchBf16;
    case Op::kCombineTwoLevel:
    case Op::kCombineFlat:
      return Op::kCombineBf16;
    default:
      return op;
  }
}

bool is_dispatch(Op op) { return op == Op::kDispatchBf16 || op == Op::kDispatchFp8 || op == Op::kCachedBf16; }

double Row::gbps(int rank) const {
  const RankTiming& t = ranks.at(rank);
  return t.median_us > 0 ? t.bytes / (t.median_us * 1e-6) / 1e9 : 0;
}

double Row::min_gbps() const {
  double m = ranks.empty() ? 0 : gbps(0);
  for (size_t r = 1; r < ranks.size(); ++r) m = std::min(m, gbps(int(r)));
  return m;
}

double Row::net_gbps(int rank) const {
  const RankTiming& t = ranks.at(rank);
  return t.median_us > 0 ? t.net_bytes / (t.median_us * 1e-6) / 1e9 : 0;
}

double Row::min_net_gbps() const {
  double m = ranks.empty() ? 0 : net_gbps(0);
  for (size_t r = 1; r < ranks.size(); ++r) m = std::min(m, net_gbps(int(r)));
  return m;
}

double Row::max_median_us() const {
  double m = 0;
  for (const RankTiming& t : ranks) m = std::max(m, t.median_us);
  return m;
}

void print_header(std::FILE* out, const RunInfo& i) {
  std::fprintf(out,
               "epx-bench %s: %d ranks x %s, %d tokens/rank, hidden %d, top-%d of %d experts (%s routing), "
               "median of %d iterations after %d warm-up, seed %llu\n",
               i.benchmark.c_str(), i.num_ranks, i.gpu.c_str(), i.tokens, i.hidden, i.topk, i.experts,
               i.routing.c_str(), i.iters, i.warmup, static_cast<unsigned long long>(i.seed));
  if (i.worst_case)
    std::fprintf(out, "dispatch in worst-case mode: num_worst_tokens = %d (all ranks' tokens), no host wait\n",
                 i.tokens * i.num_ranks);
  if (i.benchmark == "intranode" && !i.in_buffer && i.two_step) {
    std::fprintf(out, "dispatch with a layout: notify_dispatch, then dispatch\n");
  } else if (i.benchmark == "intranode" && !i.in_buffer) {
    char guess[128] = "all ranks' tokens";
    if (i.guess_offset)
      std::snprintf(guess, sizeof guess, "the rows received %+d%s", *i.guess_offset,
                    *i.guess_offset < 0 ? "; too small, so every rank repeats the count exchange" : "");
    std::fprintf(out,
                 "dispatch with a layout: dispatch_sized (count exchange and data kernel in one launch, outputs "
                 "sized by a guess: %s)\n",
                 guess);
  }
  if (i.in_buffer)
    std::fprintf(out,
                 "outputs in the buffer: the dispatch's senders write rows to their output rows in the receiver's "
                 "region, the combine's source rank reads every row there; no ring\n");
  if (i.num_domains > 0)
    std::fprintf(out, "NVLink domains: %d x %d GPUs%s\n", i.num_domains, i.num_nvl_ranks,
                 i.num_domains == 1 ? " (internode kernels forced inside one domain: the NVLink forwarding alone)"
                                    : "; the internode kernels' network hop between them");
  std::fprintf(out, "%s\n", i.nccl.c_str());
}

void print_results(std::FILE* out, const RunInfo& info, const std::vector<Row>& rows) {
  if (rows.empty()) return;
  const bool with_net = info.num_domains > 0;
  std::fprintf(out, "GB/s = bytes received by the rank (own included) / median time; us = median time per rank\n");
  if (with_net)
    std::fprintf(out,
                 "net = GB/s of the bytes that crossed the network hop into the rank (rows from another domain), "
                 "dispatch rows\n");
  print_table_header(out, int(rows.front().ranks.size()), with_net);
  for (Op op : kOps) {
    for (const Row& r : rows)
      if (r.op == op && r.impl == Impl::kEpx) print_row(out, r, rows, with_net);
    for (const Row& r : rows)
      if (r.op == op && r.impl == Impl::kNccl) print_row(out, r, rows, with_net);
  }
  std::fprintf(out, "\n");
  print_best(out, rows, with_net);
}

void write_json(const std::string& path, const RunInfo& i, const std::vector<Row>& rows) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  std::string s = "{\n";
  s += "  \"benchmark\": " + json_string(i.benchmark) + ",\n";
  s += "  \"num_ranks\": " + std::to_string(i.num_ranks) + ", \"gpu\": " + json_string(i.gpu) + ",\n";
  if (i.num_domains > 0)
    s += "  \"num_domains\": " + std::to_string(i.num_domains) +
         ", \"num_nvl_ranks\": " + std::to_string(i.num_nvl_ranks) +
         ", \"forced_internode\": " + (i.num_domains == 1 ? "true" : "false") + ",\n";
  s += "  \"tokens_per_rank\": " + std::to_string(i.tokens) + ", \"hidden\": " + std::to_string(i.hidden) +
       ", \"num_topk\": " + std::to_string(i.topk) + ", \"num_experts\": " + std::to_string(i.experts) +
       ", \"routing\": " + json_string(i.routing) + ", \"worst_case\": " + (i.worst_case ? "true" : "false") +
       ", \"in_buffer\": " + (i.in_buffer ? "true" : "false") + ",\n";
  s += "  \"iters\": " + std::to_string(i.iters) + ", \"warmup\": " + std::to_string(i.warmup) +
       ", \"seed\": " + std::to_string(i.seed) + ",\n";
  s += "  \"check\": " + json_string(i.check) + ", \"nccl\": " + json_string(i.nccl) + ",\n";
  s += "  \"rows\": [\n";
  for (size_t k = 0; k < rows.size(); ++k)
    s += json_row(rows[k], rows, i.num_domains > 0) + (k + 1 < rows.size() ? ",\n" : "\n");
  s += "  ]\n}\n";
  const bool ok = std::fwrite(s.data(), 1, s.size(), f) == s.size();
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write " + path);
}

}  // namespace epx::bench
