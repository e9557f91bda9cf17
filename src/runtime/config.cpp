// Configs of the high-throughput kernels (intranode and internode): defaults per rank count, validation, buffer
// size hints.
#include "runtime/config.hpp"

#include <cstdio>

#include "layout/internode_layout.hpp"
#include "layout/ll_layout.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/recv_region.hpp"
#include "runtime/dispatch_split.hpp"
#include "runtime/domains.hpp"
#include "runtime/errors.hpp"
#include "runtime/validate.hpp"

namespace epx {
namespace {

// Default SMs: 24 of an H200's 132; both kernels split them into senders and receivers.
constexpr int kDefaultNumSms = 24;
// Ring capacity per (channel, peer): enough that a sender rarely waits for its receiver.
constexpr int kDefaultRingTokens = 256;
// Internode network rings: records per chunk (one put with signal each) and capacity per (channel, domain).
constexpr int kDefaultNetChunk = 8;
constexpr int kDefaultNetRingTokens = 128;

// A chunk of two tokens per sender warp keeps every warp of a peer group busy (kDataWarps / R warps).
int default_chunk(int num_ranks) {
  const int r = num_ranks < 1 ? 1 : (num_ranks > kMaxNvlRanks ? kMaxNvlRanks : num_ranks);
  return 2 * (kDataWarps / r);
}

// Dispatch senders also scan the routing once per chunk, so a longer chunk pays off sooner: at 4 ranks 24 tokens
// (the best of a sweep for FP8 rows; dispatch_send_chunk caps BF16 rows at 12; the combine stays at two tokens per
// warp). Other rank counts keep two tokens per warp (8 ranks not measured). The sweep is in docs/bench-notes.md.
int default_dispatch_chunk(int num_ranks) { return num_ranks == 4 ? 24 : default_chunk(num_ranks); }

// The defaults are for the rank counts a Buffer can have: any other is an error here, not a config.
void require_default_ranks(int num_ranks) { validate_num_ranks(num_ranks, "default configs"); }

// The size hints take hidden_bytes, a BF16 row (hidden * 2, which also covers an FP8 row of that hidden with its
// scales): its hidden must be one that every operation accepts.
int hidden_of_row(int64_t hidden_bytes, const char* op) {
  EPX_REQUIRE(hidden_bytes % 2 == 0, op, ": hidden_bytes must be a BF16 row (hidden * 2), got ", hidden_bytes);
  validate_bf16_hidden(hidden_bytes / 2, op, "hidden_bytes / 2");
  return int(hidden_bytes / 2);
}

// Record bytes the internode rings need for rows of hidden_bytes (BF16: covers FP8 and its scales), the largest K.
struct InternodeRecordBytes {
  int64_t net;  // network ring slot: the dispatch record or a two-level combine record
  int64_t nvl;  // NVLink sub-ring slot: the dispatch record or a combine row with its weights
};
InternodeRecordBytes internode_record_bytes(int64_t hidden_bytes, int num_nvl_ranks) {
  const int64_t dispatch = InternodeRecord::make(hidden_bytes, 0, kMaxTopk).bytes;
  const int64_t combine_net = CombineNetRecord::make(int(hidden_bytes / 2), 1, num_nvl_ranks, kMaxTopk).bytes;
  const int64_t combine_nvl = CombineRecord::make(int(hidden_bytes / 2), kMaxTopk).bytes;
  return {align_up(dispatch > combine_net ? dispatch : combine_net, kAlign),
          align_up(dispatch > combine_nvl ? dispatch : combine_nvl, kAlign)};
}

// A chunked sender publishes its tail after at most this many bytes of records (7,472-byte FP8 records: 24 tokens;
// 14,416-byte BF16 records: 12).
constexpr int64_t kSendChunkBytes = 180 << 10;

}  // namespace

int dispatch_send_chunk(const Config& config, int64_t record_bytes, int num_ranks) {
  const int64_t floor = default_chunk(num_ranks), by_bytes = kSendChunkBytes / record_bytes;
  const int64_t chunk = by_bytes > floor ? by_bytes : floor;
  return int(chunk < config.num_max_send_tokens ? chunk : config.num_max_send_tokens);
}

Limits limits() {
  Limits l{};
  l.max_nvl_ranks = kMaxNvlRanks;
  l.max_ranks = kMaxRanks;
  l.max_channels = kMaxChannels;
  l.max_topk = kMaxTopk;
  l.max_hidden = kMaxHidden;
  l.max_local_experts = kMaxLocalExperts;
  l.max_experts = kMaxExperts;
  l.fp8_group_size = kFp8GroupSize;
  l.ll_max_ranks = kLowLatencyMaxRanks;
  l.ll_max_tokens = kLowLatencyMaxTokens;
  l.ll_max_experts = kLowLatencyMaxExperts;
  l.ll_max_topk = kLowLatencyMaxTopk;
  return l;
}

int num_channels(const Config& config) {
  EPX_REQUIRE(config.num_sms >= 2 && config.num_sms % 2 == 0 && config.num_sms / 2 <= kMaxChannels,
              "config.num_sms must be even and in [2, ", 2 * kMaxChannels, "], got ", config.num_sms);
  return config.num_sms / 2;
}

Config default_dispatch_config(int num_ranks) {
  require_default_ranks(num_ranks);
  return Config{kDefaultNumSms, default_dispatch_chunk(num_ranks), kDefaultRingTokens, kDefaultNetChunk,
                kDefaultNetRingTokens};
}

Config default_combine_config(int num_ranks) {
  require_default_ranks(num_ranks);
  return Config{kDefaultNumSms, default_chunk(num_ranks), kDefaultRingTokens, kDefaultNetChunk, kDefaultNetRingTokens};
}

void validate_config(const Config& c, int num_ranks) {
  num_channels(c);  // num_sms even and in range
  EPX_REQUIRE(c.num_max_send_tokens >= 1, "config.num_max_send_tokens must be >= 1, got ", c.num_max_send_tokens);
  EPX_REQUIRE(c.num_max_recv_tokens >= c.num_max_send_tokens, "config.num_max_recv_tokens (ring capacity, ",
              c.num_max_recv_tokens, ") must be >= num_max_send_tokens (", c.num_max_send_tokens, ")");
  EPX_REQUIRE(c.num_max_recv_tokens <= (1 << 20),
              "config.num_max_recv_tokens is unreasonably large: ", c.num_max_recv_tokens);
  EPX_REQUIRE(num_ranks >= 1 && num_ranks <= kMaxNvlRanks, "high-throughput kernels run on 1..", kMaxNvlRanks,
              " ranks of one NVLink domain, got num_ranks = ", num_ranks);
}

int64_t nvl_size_hint(const Config& config, int64_t hidden_bytes, int num_ranks) {
  validate_config(config, num_ranks);  // what the intranode operations check, with the buffer's ranks
  const int hidden = hidden_of_row(hidden_bytes, "nvl_size_hint");
  // The BF16 row covers an FP8 row of the same hidden plus its scales, and the combine row; top-k metadata at the
  // largest K we accept.
  const int64_t dispatch = DispatchRecord::make(hidden_bytes, 0, kMaxTopk).bytes;
  const int64_t combine = CombineRecord::make(hidden, kMaxTopk).bytes;
  const RingLayout ring{num_ranks, config.num_max_recv_tokens, dispatch > combine ? dispatch : combine};
  return align_up(ring.bytes(num_channels(config)), kAlign);
}

int64_t recv_region_size_hint(int rows, int hidden, int code, int num_scales, int num_topk) {
  const char* op = "recv_region_size_hint";
  EPX_REQUIRE(code == EPX_BF16 || code == EPX_FP8_E4M3, op, ": dtype must be EPX_BF16 or EPX_FP8_E4M3, got ", code);
  const epx_dtype dtype = code == EPX_BF16 ? EPX_BF16 : EPX_FP8_E4M3;
  EPX_REQUIRE(rows >= 0, op, ": rows must be >= 0, got ", rows);
  EPX_REQUIRE(hidden > 0 && hidden <= kMaxHidden && row_bytes(dtype, hidden) % 16 == 0, op, ": hidden must be in [1, ",
              kMaxHidden, "] with a row of x a multiple of 16 bytes, got ", hidden);
  EPX_REQUIRE(dtype == EPX_FP8_E4M3 ? num_scales >= 1 && num_scales <= hidden : num_scales == 0, op,
              ": num_scales must be in [1, hidden] for FP8 and 0 for BF16, got ", num_scales);
  EPX_REQUIRE(num_topk >= 0 && num_topk <= kMaxTopk, op, ": num_topk must be in [0, ", kMaxTopk, "], got ", num_topk);
  return RecvRegion::bytes_for(rows, row_bytes(dtype, hidden), num_scales, num_topk);
}

void validate_internode_config(const Config& c, int num_nvl_ranks, int num_domains) {
  num_channels(c);
  EPX_REQUIRE(num_nvl_ranks >= 1 && num_nvl_ranks <= kMaxNvlRanks && num_domains >= 1 && num_domains <= kMaxDomains,
              "the internode mode runs on 1..", kMaxDomains, " domains of 1..", kMaxNvlRanks, " ranks, got ",
              num_domains, " x ", num_nvl_ranks);
  EPX_REQUIRE(c.num_max_send_tokens >= 1, "config.num_max_send_tokens must be >= 1, got ", c.num_max_send_tokens);
  EPX_REQUIRE(c.num_max_recv_tokens >= num_domains && c.num_max_recv_tokens <= (1 << 20),
              "config.num_max_recv_tokens (", c.num_max_recv_tokens, ") must be in [number of domains (", num_domains,
              "), 2^20]: the NVLink ring of a channel holds one sub-ring per source domain");
  EPX_REQUIRE(c.num_max_rdma_send_tokens >= 1,
              "config.num_max_rdma_send_tokens (the step of network tails and "
              "credit) must be >= 1, got ",
              c.num_max_rdma_send_tokens);
  const int64_t two_chunks = 2 * int64_t(c.num_max_rdma_send_tokens);  // int64: no overflow at any int
  EPX_REQUIRE(c.num_max_rdma_recv_tokens >= two_chunks && c.num_max_rdma_recv_tokens <= (1 << 20),
              "config.num_max_rdma_recv_tokens (network ring capacity, ", c.num_max_rdma_recv_tokens,
              ") must be in [2 x num_max_rdma_send_tokens (", two_chunks, "), 2^20]");
}

InternodeSizes internode_size_hints(const Config& config, int64_t hidden_bytes, int num_ranks, int num_nvl_ranks) {
  const char* op = "internode_size_hints";
  // Checked as Buffer creation checks its ranks and options.num_nvl_ranks; the default domain (0) is what a host
  // of 8 GPUs gives, which must divide num_ranks as well.
  validate_num_ranks(num_ranks, op);
  validate_requested_nvl_ranks(num_ranks, num_nvl_ranks, op);
  const int G = num_nvl_ranks > 0 ? num_nvl_ranks : (num_ranks < kMaxNvlRanks ? num_ranks : kMaxNvlRanks);
  validate_requested_nvl_ranks(num_ranks, G, op);
  const int D = num_ranks / G;
  validate_internode_config(config, G, D);  // what the internode operations check
  hidden_of_row(hidden_bytes, op);
  const InternodeRecordBytes record = internode_record_bytes(hidden_bytes, G);
  const int C = num_channels(config);
  const NetRing net{D, config.num_max_rdma_recv_tokens, config.num_max_rdma_send_tokens, record.net};
  const NvlSubRing nvl{G, D, config.num_max_recv_tokens / D, record.nvl};
  InternodeSizes s;
  s.rdma_bytes = align_up(net.bytes(C), kAlign);
  s.nvl_bytes = G > 1 ? align_up(nvl.bytes(C), kAlign) : 0;  // one GPU per domain forwards to itself only
  return s;
}

DispatchSplit default_dispatch_split(bool fp8, int warps) {
  // 24 SMs, 4096 tokens x 7168, top-8 of 256. 24-warp blocks: BF16 rows best at 6 sender warps, FP8 rows (half the
  // bytes per token against the same per-token work) at 5; 16 ring readers for both. 20-warp blocks (one run per
  // split, eighth session): BF16 5, FP8 4, 13 ring readers.
  if (warps == kWideDispatchWarps) return DispatchSplit{fp8 ? 4 : 5, 13};
  return DispatchSplit{fp8 ? 5 : 6, 16};
}

int default_in_buffer_self_warps(int num_ranks, int num_sms) {
  if (num_ranks != 2 || num_sms <= 0) return kDataWarps / (num_ranks > 0 ? num_ranks : 1);
  // 2 ranks: about 192 warps over the grid push rows to the peer, the rest of each block copies own rows. More pushing
  // warps than that slow the link down, fewer leave it idle (sweeps of 12-32 SMs on 2 x H200 with 7 loads a lane in
  // flight, docs/bench-notes.md; FP8 rows were best at 192-224).
  const int pushing = 192;
  const int per_block = (pushing + num_sms - 1) / num_sms;
  const int self = kDataWarps - per_block;
  return self < 1 ? 1 : (self > kDataWarps - 1 ? kDataWarps - 1 : self);
}

int parse_in_buffer_self_warps(const char* value) {
  if (value == nullptr || value[0] == '\0') return 0;
  int n = -1, end = 0;
  const bool ok = value[0] >= '0' && value[0] <= '9' && std::sscanf(value, "%d%n", &n, &end) == 1 &&
                  value[end] == '\0' && n >= 1 && n <= kDataWarps - 1;
  EPX_REQUIRE(ok, "EPX_HT_IN_BUFFER_SELF_WARPS must be an integer in [1, ", kDataWarps - 1,
              "] (warps of a block that write this rank's own rows), got '", value, "'");
  return n;
}

bool parse_dispatch_split(const char* value, DispatchSplit* out) {
  if (value == nullptr || value[0] == '\0') return false;
  int s = -1, w = -1, end = 0;
  const bool ok = std::sscanf(value, "%d,%d%n", &s, &w, &end) == 2 && value[end] == '\0' && s >= 0 &&
                  s <= kDataWarps - 2 && w >= 1 && w <= kDataWarps - 1;
  EPX_REQUIRE(ok, "EPX_HT_DISPATCH_SPLIT must be \"S,W\" with S in [0, ", kDataWarps - 2,
              "] (sender warps copying own ", "tokens) and W in [1, ", kDataWarps - 1,
              "] (receiver warps reading the peer's ring), got '", value, "'");
  *out = DispatchSplit{s, w};
  return true;
}

}  // namespace epx
