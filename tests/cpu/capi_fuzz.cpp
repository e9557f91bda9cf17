// The fuzzer of capi_fuzz.hpp. Case i calls target i % (number of targets) with inputs drawn from its own seed, and
// holds the call to these rules:
//  - A C ABI function returns one of the epx_status values: EPX_OK exactly when its inputs are valid (the oracles
//    below say which are, from the limits the library exports and the rules of semantics.md section 7), with an empty
//    epx_last_error(); otherwise a non-empty message. Outputs that a failed call resets (epx.h, capi_test.cpp) are
//    reset. What a successful size hint returns is enough for the shape it was asked about.
//  - A check of the C++ side throws epx::Error with the right status (kInvalidArgument; kNotSupported where a switch
//    asks for what the build lacks) exactly when its inputs break a rule, with a message naming its operation.
//  - The reference model throws std::invalid_argument with a message exactly when its inputs are out of range.
//  - Nothing crashes, leaks or runs into undefined behaviour (scripts/fuzz.sh runs this under ASan and UBSan).
//
// Buffers: an epx_buffer* is checked for NULL and for having been destroyed through the C++ object it owns, but
// epx_buffer_destroy frees the handle itself, so a freed or forged pointer cannot be detected by the ABI: calling
// with one is undefined behaviour, and the fuzzer never does. Without a GPU no buffer can be created at all, so the
// operations are fuzzed with NULL buffers (every other argument drawn as usual, and the checks they run first
// exercised), and the argument checks behind them (runtime/validate.hpp, config.hpp, domains.hpp, transport.hpp)
// are fuzzed directly, with fake device pointers that they never dereference.
//
// Reference model: every function checks its inputs (std::invalid_argument); the fuzzer draws the edges too: a rank
// outside [0, R) for recv_rows / dispatch_meta, num_topk < 0, an expert_alignment near INT_MAX, T + C beyond
// INT_MAX for channel_of, a rank of INT_MAX for low_latency_rows (no rows), a token outside [0, T) for domain_mask,
// no sources for low_latency_rows, a negative hidden for combine.
#include "capi_fuzz.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "epx/launcher.hpp"
#include "epx/reference.hpp"
#include "layout/internode_layout.hpp"
#include "layout/ll_layout.hpp"
#include "layout/nvl_layout.hpp"
#include "layout/recv_region.hpp"
#include "runtime/config.hpp"
#include "runtime/domains.hpp"
#include "runtime/transport.hpp"
#include "runtime/validate.hpp"

namespace epx_fuzz {
namespace {

// The ring capacity the configs accept at most (config.cpp: "unreasonably large" beyond it).
constexpr int kMaxRingTokens = 1 << 20;
constexpr size_t kMaxFailuresKept = 50;

char g_current_case[160] = "epx_capi_fuzz: not started";

// splitmix64: the same numbers on every platform and standard library (std's distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // [lo, hi] (either order), for bounds inside the int range.
  int64_t range(int64_t lo, int64_t hi) {
    if (hi < lo) std::swap(lo, hi);
    return lo + int64_t(next() % uint64_t(hi - lo + 1));
  }
  int irange(int lo, int hi) { return int(range(lo, hi)); }
  bool chance(int percent) { return int(next() % 100) < percent; }
  template <typename T>
  T pick(std::initializer_list<T> values) {
    return values.begin()[next() % values.size()];
  }

 private:
  uint64_t s_;
};

int clamp_int(int64_t v) { return int(std::clamp<int64_t>(v, INT_MIN, INT_MAX)); }

// Integers a check is likely to get wrong: inside [lo, hi] (half the time), its ends, just outside, 0, -1, the int
// extremes, anything.
int edgy(Rng& r, int lo, int hi) {
  switch (r.irange(0, 9)) {
    case 0:
      return lo;
    case 1:
      return hi;
    case 2:
      return clamp_int(int64_t(lo) - r.range(1, 3));
    case 3:
      return clamp_int(int64_t(hi) + r.range(1, 3));
    case 4:
      return r.pick({0, -1, 1, INT_MIN, INT_MAX, INT_MAX / 2 + 1});
    case 5:
      return int(uint32_t(r.next()));
    default:
      return r.irange(lo, hi);
  }
}

// Integers that break "v >= lo" (below) or "v <= hi" (above): just past the bound, far past it, the extremes.
int below(Rng& r, int lo) {
  if (lo == INT_MIN) return lo;  // nothing is below: callers pass bounds > INT_MIN
  return r.pick({lo - 1, clamp_int(int64_t(lo) - r.range(1, 1000)), INT_MIN, clamp_int(int64_t(lo) - (1ll << 31))});
}
int above(Rng& r, int hi) {
  if (hi == INT_MAX) return hi;
  return r.pick({hi + 1, clamp_int(int64_t(hi) + r.range(1, 1000)), INT_MAX, clamp_int(int64_t(hi) + (1ll << 31))});
}

// Device pointers as the checks see them: never dereferenced on the host, so any value will do.
const void* aligned_ptr(Rng& r) {
  return reinterpret_cast<const void*>(uintptr_t(0x100000 + 16 * r.range(0, 1 << 20)));
}
const void* misaligned_ptr(Rng& r) {
  return reinterpret_cast<const void*>(uintptr_t(0x100000 + 16 * r.range(0, 1 << 20) + r.range(1, 15)));
}
const void* any_ptr(Rng& r) {
  switch (r.irange(0, 3)) {
    case 0:
      return nullptr;
    case 1:
      return misaligned_ptr(r);
    default:
      return aligned_ptr(r);
  }
}
template <typename T>
T* as(const void* p) {
  return static_cast<T*>(const_cast<void*>(p));
}
void* fake_stream(Rng& r) { return r.chance(50) ? nullptr : as<void>(any_ptr(r)); }

double edgy_double(Rng& r) {
  return r.pick<double>(
      {0.0, -1.0, 1e-9, 5.0, 1e7, 1e300, -INFINITY, INFINITY, NAN, DBL_MIN, double(r.range(-100, 100))});
}

const char* status_name(int s) {
  static const char* const kNames[] = {"EPX_OK",
                                       "EPX_ERR_INVALID_ARGUMENT",
                                       "EPX_ERR_BUFFER_TOO_SMALL",
                                       "EPX_ERR_CUDA",
                                       "EPX_ERR_TIMEOUT",
                                       "EPX_ERR_BOOTSTRAP",
                                       "EPX_ERR_NOT_SUPPORTED",
                                       "EPX_ERR_FAILED_STATE",
                                       "EPX_ERR_INTERNAL",
                                       "EPX_ERR_REMOTE"};
  return s >= 0 && s < int(std::size(kNames)) ? kNames[s] : nullptr;
}

std::string str(const epx_config& c) {
  std::ostringstream os;
  os << "{" << c.num_sms << ", " << c.num_max_send_tokens << ", " << c.num_max_recv_tokens << ", "
     << c.num_max_rdma_send_tokens << ", " << c.num_max_rdma_recv_tokens << "}";
  return os.str();
}

template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// ---- oracles: the rules of semantics.md section 7, from the limits the library exports
// --------------------------------

struct Rules {
  epx_limits l{};

  int max_domains() const { return l.max_ranks / l.max_nvl_ranks; }
  bool channels_ok(const epx_config& c) const {
    return c.num_sms >= 2 && c.num_sms % 2 == 0 && c.num_sms / 2 <= l.max_channels;
  }
  // validate_config: the intranode operations, and nvl_size_hint.
  bool intranode_config_ok(const epx_config& c, int num_ranks) const {
    return channels_ok(c) && c.num_max_send_tokens >= 1 && c.num_max_recv_tokens >= c.num_max_send_tokens &&
           c.num_max_recv_tokens <= kMaxRingTokens && num_ranks >= 1 && num_ranks <= l.max_nvl_ranks;
  }
  // validate_internode_config: the internode operations, and internode_size_hints.
  bool internode_config_ok(const epx_config& c, int G, int D) const {
    return channels_ok(c) && G >= 1 && G <= l.max_nvl_ranks && D >= 1 && D <= max_domains() &&
           c.num_max_send_tokens >= 1 && c.num_max_recv_tokens >= D && c.num_max_recv_tokens <= kMaxRingTokens &&
           c.num_max_rdma_send_tokens >= 1 &&
           int64_t(c.num_max_rdma_recv_tokens) >= 2 * int64_t(c.num_max_rdma_send_tokens) &&
           c.num_max_rdma_recv_tokens <= kMaxRingTokens;
  }
  bool bf16_hidden_ok(int64_t h) const { return h >= 8 && h <= l.max_hidden && h % 8 == 0; }
  bool row_ok(int64_t hidden_bytes) const { return hidden_bytes % 2 == 0 && bf16_hidden_ok(hidden_bytes / 2); }
  bool ranks_ok(int64_t r) const { return r >= 1 && r <= l.max_ranks; }
  bool ll_shape_ok(int R, int M, int H, int E) const {
    return R >= 1 && R <= l.ll_max_ranks && M >= 1 && M <= l.ll_max_tokens && bf16_hidden_ok(H) && E > 0 &&
           E % R == 0 && E <= l.ll_max_experts;
  }
};

// ---- the fuzzer ---------------------------------------------------------------------------------------------------

// Unsets an environment variable for its lifetime, then restores it.
class EnvKeeper {
 public:
  explicit EnvKeeper(const char* name) : name_(name) {
    const char* v = std::getenv(name);
    if (v != nullptr) saved_ = v, had_ = true;
    unsetenv(name);
  }
  ~EnvKeeper() {
    if (had_)
      setenv(name_, saved_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::string saved_;
  bool had_ = false;
};

enum class Want { kOk, kError, kAny };

class Fuzzer {
 public:
  explicit Fuzzer(const Options& o) : opt_(o) {
    epx_get_limits(&rules_.l);
    add("epx_version", &Fuzzer::version);
    add("epx_built_with_nvshmem", &Fuzzer::built_with_nvshmem);
    add("epx_status_string", &Fuzzer::status_string);
    add("epx_last_error", &Fuzzer::last_error);
    add("epx_buffer_create", &Fuzzer::buffer_create);
    add("epx_buffer_destroy", &Fuzzer::buffer_destroy);
    add("epx_buffer_info", &Fuzzer::buffer_info);
    add("epx_buffer_is_internode", &Fuzzer::buffer_is_internode);
    add("epx_buffer_set_timeout", &Fuzzer::buffer_set_timeout);
    add("epx_buffer_ll_transport", &Fuzzer::buffer_ll_transport);
    add("epx_buffer_check", &Fuzzer::buffer_check);
    add("epx_buffer_region", &Fuzzer::buffer_region);
    add("epx_get_limits", &Fuzzer::get_limits);
    add("epx_default_dispatch_config", &Fuzzer::default_dispatch_config);
    add("epx_default_combine_config", &Fuzzer::default_combine_config);
    add("epx_config_num_channels", &Fuzzer::config_num_channels);
    add("epx_config_nvl_size_hint", &Fuzzer::nvl_size_hint);
    add("epx_config_internode_size_hints", &Fuzzer::internode_size_hints);
    add("epx_get_dispatch_layout", &Fuzzer::get_dispatch_layout);
    add("epx_notify_dispatch", &Fuzzer::notify_dispatch);
    add("epx_dispatch_sized", &Fuzzer::dispatch_sized);
    add("epx_dispatch", &Fuzzer::dispatch);
    add("epx_dispatch_cached", &Fuzzer::dispatch_cached);
    add("epx_dispatch_in_buffer", &Fuzzer::dispatch_in_buffer);
    add("epx_recv_region_size_hint", &Fuzzer::recv_region_size_hint);
    add("epx_combine_region", &Fuzzer::combine_region);
    add("epx_combine_in_buffer", &Fuzzer::combine_in_buffer);
    add("epx_combine", &Fuzzer::combine);
    add("epx_ll_size_hint", &Fuzzer::ll_size_hint);
    add("epx_ll_clean", &Fuzzer::ll_clean);
    add("epx_ll_dispatch", &Fuzzer::ll_dispatch);
    add("epx_ll_combine", &Fuzzer::ll_combine);
    add("epx_ll_next_combine_buffer", &Fuzzer::ll_next_combine_buffer);
    add("epx_ll_update_mask", &Fuzzer::ll_update_mask);
    add("epx_ll_query_mask", &Fuzzer::ll_query_mask);
    add("epx_ll_clean_mask", &Fuzzer::ll_clean_mask);
    num_c_abi_ = targets_.size();
    add("epx::validate_dispatch_args", &Fuzzer::validate_dispatch_args);
    add("epx::validate_combine_args", &Fuzzer::validate_combine_args);
    add("epx::validate_config", &Fuzzer::validate_config);
    add("epx::validate_internode_config", &Fuzzer::validate_internode_config);
    add("epx::choose_domains", &Fuzzer::choose_domains);
    add("epx::parse_env_switch", &Fuzzer::parse_env_switch);
    add("epx::choose_low_latency_transport", &Fuzzer::choose_transport);
    add("epx::ref::dispatch_layout", &Fuzzer::ref_dispatch_layout);
    add("epx::ref::dispatch_meta", &Fuzzer::ref_dispatch_meta);
    add("epx::ref::low_latency_rows", &Fuzzer::ref_low_latency_rows);
    add("epx::ref::internode_handle", &Fuzzer::ref_internode_handle);
    add("epx::ref::channel_of", &Fuzzer::ref_channel_of);
    add("epx::ref::domain_mask", &Fuzzer::ref_domain_mask);
    add("epx::ref::combine", &Fuzzer::ref_combine);
    add("epx::ref::quantize_fp8_row", &Fuzzer::ref_quantize);
    add("epx::ref::low_latency_combine_row", &Fuzzer::ref_ll_combine_row);
    add("epx::ref::low_latency_combine_row_rank_reduced", &Fuzzer::ref_ll_combine_row_rank_reduced);
    add("epx::ref numerics", &Fuzzer::ref_numerics);
  }

  std::vector<std::string> c_abi_names() const {
    std::vector<std::string> names;
    for (size_t i = 0; i < num_c_abi_; ++i) names.push_back(targets_[i].name);
    return names;
  }

  ~Fuzzer() {
    if (trace_ >= 0) close(trace_);
  }

  Report run() {
    if (!opt_.trace_file.empty()) trace_ = open(opt_.trace_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    // On a machine with a GPU a valid create would make a real buffer; the fuzzer keeps to invalid ones there.
    gpus_ = epx::count_local_gpus();
    // The domain switches of the environment take part in Buffer creation: the fuzzer sets them itself, per case,
    // and puts back what the process had.
    const EnvKeeper keep_num_nvl_ranks("EPX_NUM_NVL_RANKS"), keep_force_internode("EPX_FORCE_INTERNODE");
    Report rep;
    for (int64_t i = opt_.first_case; i < opt_.first_case + opt_.cases; ++i) {
      case_ = i;
      Entry& e = targets_[size_t(i % int64_t(targets_.size()))];
      const int n = std::snprintf(g_current_case, sizeof g_current_case,
                                  "epx_capi_fuzz: case %lld (%s); replay with --seed %llu --first %lld --cases 1\n",
                                  (long long)i, e.name.c_str(), (unsigned long long)opt_.seed, (long long)i);
      if (trace_ >= 0) {  // survives an end the process does not see coming (a sanitizer's report, a kill)
        [[maybe_unused]] int rc = ftruncate(trace_, 0);
        [[maybe_unused]] ssize_t w =
            pwrite(trace_, g_current_case, size_t(std::min<int>(n, sizeof g_current_case - 1)), 0);
      }
      current_ = &e;
      Rng r(opt_.seed * 0x9e3779b97f4a7c15ull ^ uint64_t(i) * 0xd1b54a32d192ed03ull);
      ++e.stats.cases;
      try {
        (this->*e.fn)(r);
      } catch (const std::exception& ex) {
        fail(cat("unexpected exception escaped the case: ", ex.what()));
      }
      ++rep.cases;
    }
    for (const Entry& e : targets_) rep.targets.push_back(e.stats);
    rep.failures = failures_;
    rep.num_failures = num_failures_;
    rep.last_error_checks = last_error_checks_;
    return rep;
  }

 private:
  using Fn = void (Fuzzer::*)(Rng&);
  struct Entry {
    std::string name;
    Fn fn;
    Target stats;
  };
  void add(const char* name, Fn fn) {
    targets_.push_back(Entry{name, fn, Target{}});
    targets_.back().stats.name = name;
  }

  void outcome(const std::string& what) { ++current_->stats.outcomes[what]; }
  void fail(const std::string& what) {
    ++num_failures_;
    if (failures_.size() < kMaxFailuresKept)
      failures_.push_back(
          cat("case ", case_, " (replay: --seed ", opt_.seed, " --first ", case_, " --cases 1): ", what));
  }

  // The rules every C ABI status obeys; `call` describes the call for a failure.
  void check(epx_status s, Want want, const std::string& call) {
    const int v = int(s);
    const char* name = status_name(v);
    outcome(name != nullptr ? name : cat("status ", v));
    const std::string message = epx_last_error() != nullptr ? epx_last_error() : "(null)";
    ++last_error_checks_;
    if (name == nullptr) return fail(cat(call, ": returned ", v, ", which is no epx_status"));
    const char* text = epx_status_string(s);
    if (text == nullptr || text[0] == '\0') fail(cat(call, ": epx_status_string(", name, ") is empty"));
    if (s == EPX_OK && !message.empty()) fail(cat(call, ": EPX_OK but epx_last_error() says '", message, "'"));
    if (s != EPX_OK && message.empty()) fail(cat(call, ": ", name, " with an empty epx_last_error()"));
    if (want == Want::kError && s == EPX_OK) fail(cat(call, ": EPX_OK for invalid input"));
    if (want == Want::kOk && s != EPX_OK) fail(cat(call, ": ", name, " for valid input: ", message));
  }
  void check_is(epx_status s, std::initializer_list<epx_status> allowed, const std::string& call) {
    check(s, Want::kError, call);
    if (std::find(allowed.begin(), allowed.end(), s) == allowed.end())
      fail(cat(call, ": ", status_name(int(s)) ? status_name(int(s)) : "?",
               " is not the status this error has: ", epx_last_error()));
  }

  // A C++ check: throws epx::Error(want_status) exactly when `invalid`, naming `op` (when given) in its message.
  void check_throws(const std::function<void()>& f, bool invalid, const std::string& call, const char* op,
                    epx::Status want_status = epx::Status::kInvalidArgument) {
    try {
      f();
      outcome("returned");
      if (invalid) fail(cat(call, ": accepted invalid input"));
    } catch (const epx::Error& e) {
      const char* name = status_name(int(e.status()));
      outcome(cat("epx::Error ", name != nullptr ? name + 4 : "?"));
      if (!invalid) return fail(cat(call, ": rejected valid input: ", e.what()));
      if (e.status() != want_status) fail(cat(call, ": status ", int(e.status()), " (", e.what(), ")"));
      if (std::strlen(e.what()) == 0) fail(cat(call, ": empty message"));
      if (op != nullptr && std::string(e.what()).find(op) == std::string::npos)
        fail(cat(call, ": the message does not name ", op, ": ", e.what()));
    } catch (const std::exception& e) {
      outcome("other exception");
      fail(cat(call, ": threw something other than epx::Error: ", e.what()));
    }
  }
  // The reference model: std::invalid_argument with a message exactly when `invalid`.
  void check_model(const std::function<void()>& f, bool invalid, const std::string& call) {
    try {
      f();
      outcome("returned");
      if (invalid) fail(cat(call, ": accepted invalid input"));
    } catch (const std::invalid_argument& e) {
      outcome("std::invalid_argument");
      if (!invalid) fail(cat(call, ": rejected valid input: ", e.what()));
      if (std::strlen(e.what()) == 0) fail(cat(call, ": empty message"));
    } catch (const std::exception& e) {
      outcome("other exception");
      fail(cat(call, ": threw something other than std::invalid_argument: ", e.what()));
    }
  }
  void value(bool ok, const std::string& what, const std::string& call) {
    outcome(what);
    if (!ok) fail(cat(call, ": ", what));
  }

  // ---- argument structs with every field drawn (the NULL-buffer calls never read them) -------------------------
  epx_config random_config(Rng& r) {
    epx_config c{};
    if (r.chance(50)) {
      const int ranks = r.irange(1, rules_.l.max_ranks);
      c = r.chance(50) ? epx::default_dispatch_config(ranks) : epx::default_combine_config(ranks);
      for (int k = r.irange(0, 2); k > 0; --k) {
        switch (r.irange(0, 4)) {
          case 0:
            c.num_sms = edgy(r, 2, 2 * rules_.l.max_channels);
            break;
          case 1:
            c.num_max_send_tokens = edgy(r, 1, c.num_max_recv_tokens);
            break;
          case 2:
            c.num_max_recv_tokens = edgy(r, c.num_max_send_tokens, kMaxRingTokens);
            break;
          case 3:
            c.num_max_rdma_send_tokens = edgy(r, 1, 64);
            break;
          default:
            c.num_max_rdma_recv_tokens = edgy(r, clamp_int(2 * int64_t(c.num_max_rdma_send_tokens)), kMaxRingTokens);
        }
      }
    } else {
      c.num_sms = edgy(r, 2, 2 * rules_.l.max_channels) & (r.chance(80) ? ~1 : ~0);
      c.num_max_send_tokens = edgy(r, 1, 64);
      c.num_max_recv_tokens = r.chance(70) ? r.irange(std::max(c.num_max_send_tokens, 1), 4096)
                                           : edgy(r, c.num_max_send_tokens, kMaxRingTokens);
      c.num_max_rdma_send_tokens = edgy(r, 1, 32);
      c.num_max_rdma_recv_tokens =
          r.chance(70) ? r.irange(2 * std::clamp(c.num_max_rdma_send_tokens, 1, 32), 4096) : edgy(r, 2, kMaxRingTokens);
    }
    return c;
  }
  epx_dispatch_args random_dispatch_args(Rng& r) {
    epx_dispatch_args a{};
    a.x = any_ptr(r);
    a.dtype = r.chance(50) ? EPX_BF16 : EPX_FP8_E4M3;
    a.num_tokens = edgy(r, 0, 4096);
    a.hidden = edgy(r, 8, rules_.l.max_hidden);
    a.x_scales = as<const float>(any_ptr(r));
    a.num_scales = edgy(r, 0, 256);
    a.topk_idx = as<const int64_t>(any_ptr(r));
    a.topk_weights = as<const float>(any_ptr(r));
    a.num_topk = edgy(r, 0, rules_.l.max_topk);
    a.num_experts = edgy(r, 1, 1024);
    a.num_tokens_per_rank = as<const int>(any_ptr(r));
    a.num_tokens_per_expert = as<const int>(any_ptr(r));
    a.is_token_in_rank = as<const uint8_t>(any_ptr(r));
    a.expert_alignment = edgy(r, 0, 128);
    a.num_worst_tokens = edgy(r, 0, 1 << 16);
    return a;
  }
  epx_dispatch_handle random_handle(Rng& r) {
    epx_dispatch_handle h{};
    h.num_ranks = edgy(r, 1, 8);
    h.num_channels = edgy(r, 1, 64);
    h.num_tokens = edgy(r, 0, 4096);
    h.num_recv_tokens = edgy(r, -1, 4096);
    h.rank_prefix_matrix = as<int>(any_ptr(r));
    h.channel_prefix_matrix = as<int>(any_ptr(r));
    h.recv_channel_prefix_matrix = as<int>(any_ptr(r));
    h.recv_src_idx = as<int>(any_ptr(r));
    h.is_token_in_rank = as<const uint8_t>(any_ptr(r));
    h.send_head = as<int>(any_ptr(r));
    h.num_domains = edgy(r, 1, 16);
    h.num_nvl_ranks = edgy(r, 1, 8);
    h.num_rdma_recv_tokens = edgy(r, -1, 4096);
    h.rdma_channel_prefix_matrix = as<int>(any_ptr(r));
    h.recv_rdma_channel_prefix_matrix = as<int>(any_ptr(r));
    h.recv_rdma_rank_prefix_sum = as<int>(any_ptr(r));
    h.recv_gbl_rank_prefix_sum = as<int>(any_ptr(r));
    h.recv_src_meta = as<int32_t>(any_ptr(r));
    h.send_rdma_head = as<int>(any_ptr(r));
    h.send_nvl_head = as<int>(any_ptr(r));
    return h;
  }
  epx_ll_handle random_ll_handle(Rng& r) {
    epx_ll_handle h{};
    h.buffer_set = edgy(r, 0, 1);
    h.num_tokens = edgy(r, 0, 128);
    h.hidden = edgy(r, 8, 8192);
    h.num_topk = edgy(r, 1, 9);
    h.num_experts = edgy(r, 1, 288);
    h.num_max_dispatch_tokens_per_rank = edgy(r, 1, 4096);
    h.recv_src_info = as<const int>(any_ptr(r));
    h.recv_layout_range = as<const int64_t>(any_ptr(r));
    h.recv_topk_slots = as<const int32_t>(any_ptr(r));
    return h;
  }
  template <typename T>
  T* maybe(Rng& r, T& object, int null_percent = 15) {
    return r.chance(null_percent) ? nullptr : &object;
  }

  // ---- C ABI: functions without arguments to check ----------------------------------------------------------------
  void version(Rng&) {
    const int v = epx_version();
    value(v == EPX_VERSION_MAJOR * 100 + EPX_VERSION_MINOR,
          v == EPX_VERSION_MAJOR * 100 + EPX_VERSION_MINOR ? "the version of epx.h"
                                                           : cat("version ", v, ", epx.h says otherwise"),
          "epx_version()");
  }
  void built_with_nvshmem(Rng&) {
    const int v = epx_built_with_nvshmem();
    value(v == 0 || v == 1, v == 0 || v == 1 ? cat("returned ", v) : cat("returned ", v, ", not 0 or 1"),
          "epx_built_with_nvshmem()");
  }
  void status_string(Rng& r) {
    // Every value an epx_status can hold in C++ (its enumerators need 4 bits), named or not.
    const int v = r.irange(0, 15);
    const char* text = epx_status_string(static_cast<epx_status>(v));
    const bool ok = text != nullptr && text[0] != '\0';
    value(ok, ok ? (status_name(v) ? "a status's text" : "a text for a value no status has") : "NULL or empty",
          cat("epx_status_string(", v, ")"));
  }
  void last_error(Rng& r) {
    // The message of this thread's last call: set by a failure, cleared by a success, not shared between threads.
    epx_limits l{};
    const bool fail_first = r.chance(50);
    if (fail_first) {
      epx_get_limits(nullptr);
    } else {
      epx_get_limits(&l);
    }
    const std::string mine = epx_last_error();
    value(fail_first != mine.empty(), fail_first ? "set after a failure" : "empty after a success", "epx_last_error()");
    if (r.chance(10)) {
      std::string other = "unset";
      std::thread([&] { other = epx_last_error(); }).join();
      value(other.empty(), other.empty() ? "empty in another thread" : "leaked into another thread",
            "epx_last_error() in a new thread");
    }
  }

  // ---- C ABI: buffers ---------------------------------------------------------------------------------------------
  struct Gather {
    int mode;  // 0 copy, 1 fail, 2 garbage
    int size;
    uint64_t seed;
  };
  static int gather(void* ctx, const void* send, void* recv, size_t bytes) {
    Gather& g = *static_cast<Gather*>(ctx);
    if (g.mode == 1) return 7;
    auto* out = static_cast<unsigned char*>(recv);
    if (g.mode == 2) {
      Rng r(g.seed);
      for (size_t i = 0; i < bytes * size_t(g.size); ++i) out[i] = static_cast<unsigned char>(r.next());
      return 0;
    }
    for (int i = 0; i < g.size; ++i) std::memcpy(out + size_t(i) * bytes, send, bytes);
    return 0;
  }

  void buffer_create(Rng& r) {
    // A valid single-rank create, then defects; without a GPU even a valid one fails (no device, or a mode this
    // build lacks), so every create must fail here, with the status of its first defect.
    Gather g{0, 1, r.next()};
    epx_bootstrap bs{0, 1, &Fuzzer::gather, &g};
    epx_buffer_options o{};
    o.num_nvl_bytes = r.chance(50) ? r.range(0, 1 << 30) : 0;
    o.num_rdma_bytes = r.chance(50) ? r.range(0, 1 << 30) : 0;
    o.low_latency_mode = r.irange(0, 1);
    o.num_nvl_ranks = r.irange(0, 1);
    o.timeout_s = edgy_double(r);
    o.device = r.irange(-1, 3);
    o.force_internode = r.chance(20) ? 1 : 0;
    // Rank masking is valid with a low-latency region of one domain, and a budget <= 0 (the default) or in (0, 1e7).
    o.enable_shrink = o.num_rdma_bytes > 0 && !o.force_internode && r.chance(30) ? 1 : 0;
    o.shrink_timeout_s = r.pick({0.0, -1.0, 0.25, 3.0});
    epx_buffer* out = reinterpret_cast<epx_buffer*>(uintptr_t(0x10));  // must become NULL
    const epx_bootstrap* bs_arg = &bs;
    const epx_buffer_options* o_arg = &o;
    epx_buffer** out_arg = &out;
    const char* env_name = nullptr;  // set for this call only
    int defects = (r.chance(30) && gpus_ == 0) ? 0 : r.irange(1, 3);
    std::string what;
    for (int d = 0; d < defects; ++d) {
      switch (r.irange(0, 13)) {
        case 0:
          bs_arg = nullptr, what += " bootstrap NULL";
          break;
        case 1:
          o_arg = nullptr, what += " options NULL";
          break;
        case 2:
          out_arg = nullptr, what += " out NULL";
          break;
        case 3:
          bs.allgather = nullptr, what += " allgather NULL";
          break;
        case 4:
          bs.size = r.chance(50) ? below(r, 1) : above(r, rules_.l.max_ranks);
          g.size = 1;  // never reached: the size is checked first
          what += cat(" size ", bs.size);
          break;
        case 5:
          bs.rank = r.chance(50) ? below(r, 0) : above(r, std::max(bs.size, 1) - 1);
          what += cat(" rank ", bs.rank);
          break;
        case 6:
          (r.chance(50) ? o.num_nvl_bytes : o.num_rdma_bytes) = -r.range(1, int64_t(1) << 40);
          what += " negative bytes";
          break;
        case 7:
          o.num_nvl_ranks = r.pick({-1, INT_MIN, 2, 3, 8, 9, INT_MAX});
          what += cat(" num_nvl_ranks ", o.num_nvl_ranks);
          break;
        case 8:
          g.mode = 1, what += " all-gather fails";
          break;
        case 9:
          g.mode = 2, what += " all-gather returns garbage";
          break;
        case 10:
          env_name = "EPX_NUM_NVL_RANKS", o.num_nvl_ranks = 0;
          setenv(env_name, r.pick({"0", "9", "two", "-1", "1x", " 2"}), 1);
          what += cat(" ", env_name, "=", std::getenv(env_name));
          break;
        case 12:
          if (r.chance(50)) {
            o.shrink_timeout_s = r.pick({std::nan(""), HUGE_VAL, 1e7, 1e300});
            what += cat(" shrink_timeout_s ", o.shrink_timeout_s);
          } else {
            o.enable_shrink = 1, o.num_rdma_bytes = 0;
            what += " enable_shrink without num_rdma_bytes";
          }
          break;
        case 13:
          env_name = "EPX_LL_SHRINK_TIMEOUT_S";
          setenv(env_name, r.pick({"0", "-1", "nan", "inf", "1e7", "0.5s", "", "1 "}), 1);
          if (std::getenv(env_name)[0] == '\0') setenv(env_name, "x", 1);  // "" means unset
          what += cat(" ", env_name, "=", std::getenv(env_name));
          break;
        default:
          env_name = "EPX_FORCE_INTERNODE", o.force_internode = 0;
          setenv(env_name, r.pick({"2", "yes", "true", "01", "1 ", "-1"}), 1);
          what += cat(" ", env_name, "=", std::getenv(env_name));
      }
    }
    const std::string call = cat("epx_buffer_create(", defects == 0 ? "valid single rank" : what, ")");
    const epx_status s = epx_buffer_create(bs_arg, o_arg, out_arg);
    unsetenv("EPX_NUM_NVL_RANKS");
    unsetenv("EPX_FORCE_INTERNODE");
    unsetenv("EPX_LL_SHRINK_TIMEOUT_S");
    if (defects == 0)
      check_is(s, {EPX_ERR_CUDA, EPX_ERR_NOT_SUPPORTED}, call);
    else
      check_is(s, {EPX_ERR_INVALID_ARGUMENT, EPX_ERR_BOOTSTRAP}, call);
    if (s == EPX_OK && out_arg != nullptr) epx_buffer_destroy(out);
    if (s != EPX_OK && out_arg != nullptr && out != nullptr) fail(cat(call, ": a failed create left *out set"));
  }
  void buffer_destroy(Rng&) {
    // NULL is the only handle the ABI can recognise without a live buffer (it is a no-op, as free(NULL)).
    check(epx_buffer_destroy(nullptr), Want::kOk, "epx_buffer_destroy(NULL)");
  }
  void buffer_info(Rng& r) {
    int a = -7, b = -7, c = -7, d = -7;
    check_is(epx_buffer_info(nullptr, maybe(r, a, 30), maybe(r, b, 30), maybe(r, c, 30), maybe(r, d, 30)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_buffer_info(NULL, ...)");
  }
  void buffer_is_internode(Rng& r) {
    int v = -7;
    check_is(epx_buffer_is_internode(nullptr, maybe(r, v, 30)), {EPX_ERR_INVALID_ARGUMENT},
             "epx_buffer_is_internode(NULL, ...)");
  }
  void buffer_set_timeout(Rng& r) {
    const double t = edgy_double(r);
    check_is(epx_buffer_set_timeout(nullptr, t), {EPX_ERR_INVALID_ARGUMENT},
             cat("epx_buffer_set_timeout(NULL, ", t, ")"));
  }
  void buffer_ll_transport(Rng& r) {
    epx_ll_transport_info info{};
    check_is(epx_buffer_ll_transport(nullptr, maybe(r, info, 30)), {EPX_ERR_INVALID_ARGUMENT},
             "epx_buffer_ll_transport(NULL, ...)");
  }
  void buffer_check(Rng& r) {
    check_is(epx_buffer_check(nullptr, fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT}, "epx_buffer_check(NULL, stream)");
  }
  void buffer_region(Rng& r) {
    const int which = r.chance(60) ? r.irange(0, 1) : edgy(r, 0, 1);
    void* p = as<void>(aligned_ptr(r));
    int64_t n = 42;
    void** p_arg = r.chance(15) ? nullptr : &p;
    int64_t* n_arg = r.chance(15) ? nullptr : &n;
    const std::string call =
        cat("epx_buffer_region(NULL, ", which, ", ", p_arg ? "&ptr" : "NULL", ", ", n_arg ? "&bytes" : "NULL", ")");
    check_is(epx_buffer_region(nullptr, which, p_arg, n_arg), {EPX_ERR_INVALID_ARGUMENT}, call);
    if (p_arg && n_arg && (p != nullptr || n != 0)) fail(cat(call, ": a failed call left a region behind"));
  }
  void get_dispatch_layout(Rng& r) {
    // Field by field: the structs grow, and a zeroed new field is what the ABI expects of callers that predate it.
    epx_layout_args a{};
    a.topk_idx = as<const int64_t>(any_ptr(r));
    a.num_tokens = edgy(r, 0, 4096);
    a.num_topk = edgy(r, 1, 32);
    a.num_experts = edgy(r, 1, 8192);
    epx_layout_outputs o{};
    o.num_tokens_per_rank = as<int>(any_ptr(r));
    o.num_tokens_per_rdma_rank = as<int>(any_ptr(r));
    o.num_tokens_per_expert = as<int>(any_ptr(r));
    o.is_token_in_rank = as<uint8_t>(any_ptr(r));
    check_is(epx_get_dispatch_layout(nullptr, maybe(r, a), maybe(r, o), fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT},
             "epx_get_dispatch_layout(NULL, ...)");
  }
  void notify_dispatch(Rng& r) {
    epx_dispatch_args a = random_dispatch_args(r);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_dispatch_counts counts{};
    check_is(epx_notify_dispatch(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, counts), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_notify_dispatch(NULL, ...)");
  }
  epx_dispatch_outputs random_outputs(Rng& r) {
    epx_dispatch_outputs o{};
    o.recv_x = as<void>(any_ptr(r));
    o.recv_x_scales = as<float>(any_ptr(r));
    o.recv_topk_idx = as<int64_t>(any_ptr(r));
    o.recv_topk_weights = as<float>(any_ptr(r));
    o.num_rows = edgy(r, 0, 4096);
    return o;
  }
  void dispatch(Rng& r) {
    epx_dispatch_args a = random_dispatch_args(r);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_dispatch_outputs o = random_outputs(r);
    check_is(epx_dispatch(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, o), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_dispatch(NULL, ...)");
  }
  void dispatch_sized(Rng& r) {
    epx_dispatch_args a = random_dispatch_args(r);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_dispatch_outputs o = random_outputs(r);
    epx_dispatch_counts n{};
    check_is(
        epx_dispatch_sized(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, o), maybe(r, n), fake_stream(r)),
        {EPX_ERR_INVALID_ARGUMENT}, "epx_dispatch_sized(NULL, ...)");
  }
  void dispatch_cached(Rng& r) {
    epx_dispatch_args a = random_dispatch_args(r);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_dispatch_outputs o = random_outputs(r);
    check_is(epx_dispatch_cached(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, o), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_dispatch_cached(NULL, ...)");
  }
  void dispatch_in_buffer(Rng& r) {
    epx_dispatch_args a = random_dispatch_args(r);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_dispatch_counts n{};
    epx_recv_region v{};
    check_is(epx_dispatch_in_buffer(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), r.irange(0, 1), maybe(r, n),
                                    maybe(r, v), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_dispatch_in_buffer(NULL, ...)");
  }
  void combine_region(Rng& r) {
    epx_recv_region v{};
    check_is(epx_combine_region(nullptr, edgy(r, 8, rules_.l.max_hidden), edgy(r, 0, rules_.l.max_topk), maybe(r, v)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_combine_region(NULL, ...)");
  }
  void combine_in_buffer(Rng& r) {
    epx_combine_args a{};
    a.x = any_ptr(r);
    a.num_rows = edgy(r, 0, 4096);
    a.hidden = edgy(r, 8, rules_.l.max_hidden);
    a.num_topk = edgy(r, 0, rules_.l.max_topk);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_combine_outputs o{};
    check_is(epx_combine_in_buffer(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, o), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_combine_in_buffer(NULL, ...)");
  }
  void recv_region_size_hint(Rng& r) {
    const int rows = r.chance(70) ? r.irange(0, 1 << 16) : edgy(r, 0, INT_MAX);
    const int dtype = r.chance(80) ? r.pick({int(EPX_BF16), int(EPX_FP8_E4M3)}) : r.pick({-1, 2, 7, INT_MIN});
    const int hidden = r.chance(60) ? 16 * r.irange(1, rules_.l.max_hidden / 16) : edgy(r, 1, rules_.l.max_hidden);
    const bool fp8 = dtype == int(EPX_FP8_E4M3);
    const int scales = r.chance(70) ? (fp8 ? std::max(1, hidden / rules_.l.fp8_group_size) : 0) : edgy(r, 0, 1024);
    const int K = r.chance(70) ? r.irange(0, rules_.l.max_topk) : edgy(r, 0, rules_.l.max_topk);
    int64_t bytes = -7;
    const bool b_null = r.chance(5);
    const std::string call =
        cat("epx_recv_region_size_hint(", rows, ", ", hidden, ", ", dtype, ", ", scales, ", ", K, ")");
    const bool dtype_ok = dtype == int(EPX_BF16) || fp8;
    const bool hidden_ok = hidden >= 1 && hidden <= rules_.l.max_hidden && (fp8 ? hidden % 16 : hidden % 8) == 0;
    const bool valid = !b_null && dtype_ok && rows >= 0 && hidden_ok &&
                       (fp8 ? scales >= 1 && scales <= hidden : scales == 0) && K >= 0 && K <= rules_.l.max_topk;
    const epx_status s = epx_recv_region_size_hint(rows, hidden, dtype, scales, K, b_null ? nullptr : &bytes);
    check(s, valid ? Want::kOk : Want::kError, call);
    if (s != EPX_OK) return;
    // A region of exactly this many bytes holds `rows` rows of the shape, its arrays inside it.
    const int64_t x_bytes = int64_t(hidden) * (fp8 ? 1 : 2);
    const epx::RecvRegion region = epx::RecvRegion::make(bytes, x_bytes, scales, K);
    if (region.capacity < rows || region.end() > bytes)
      fail(cat(call, " = ", bytes, ": holds ", region.capacity, " rows, ends at ", region.end()));
  }
  void combine(Rng& r) {
    epx_combine_args a{};
    a.x = any_ptr(r);
    a.num_rows = edgy(r, 0, 4096);
    a.hidden = edgy(r, 8, rules_.l.max_hidden);
    a.topk_weights = as<const float>(any_ptr(r));
    a.num_topk = edgy(r, 0, rules_.l.max_topk);
    a.bias0 = any_ptr(r);
    a.bias1 = any_ptr(r);
    a.reduction = edgy(r, 0, 2);
    epx_config c = random_config(r);
    epx_dispatch_handle h = random_handle(r);
    epx_combine_outputs o{};
    o.combined_x = as<void>(any_ptr(r));
    o.combined_topk_weights = as<float>(any_ptr(r));
    check_is(epx_combine(nullptr, maybe(r, a), maybe(r, c), maybe(r, h), maybe(r, o), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, "epx_combine(NULL, ...)");
  }
  void ll_clean(Rng& r) {
    check_is(epx_ll_clean(nullptr, fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT}, "epx_ll_clean(NULL, stream)");
  }
  void ll_dispatch(Rng& r) {
    epx_ll_dispatch_args a{};
    a.x = any_ptr(r);
    a.num_tokens = edgy(r, 0, 128);
    a.hidden = edgy(r, 8, 8192);
    a.topk_idx = as<const int64_t>(any_ptr(r));
    a.num_topk = edgy(r, 1, 9);
    a.num_experts = edgy(r, 1, 288);
    a.num_max_dispatch_tokens_per_rank = edgy(r, 1, 4096);
    a.use_fp8 = edgy(r, 0, 1);
    a.round_scale = edgy(r, 0, 1);
    a.use_ue8m0 = edgy(r, 0, 1);
    a.cumulative_local_expert_recv_stats = as<int>(any_ptr(r));
    a.topk_weights = as<const float>(any_ptr(r));
    epx_ll_dispatch_outputs o{};
    o.packed_recv_x = as<void>(any_ptr(r));
    o.packed_recv_x_scales = as<void>(any_ptr(r));
    o.packed_recv_count = as<int>(any_ptr(r));
    o.recv_src_info = as<int>(any_ptr(r));
    o.recv_layout_range = as<int64_t>(any_ptr(r));
    o.recv_topk_slots = as<int32_t>(any_ptr(r));
    epx_ll_handle h = random_ll_handle(r);
    const int phases = edgy(r, 1, 3);
    check_is(epx_ll_dispatch(nullptr, maybe(r, a), maybe(r, o), phases, maybe(r, h), fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, cat("epx_ll_dispatch(NULL, ..., phases ", phases, ")"));
  }
  void ll_combine(Rng& r) {
    epx_ll_combine_args a{};
    a.x = any_ptr(r);
    a.zero_copy = edgy(r, 0, 1);
    a.topk_idx = as<const int64_t>(any_ptr(r));
    a.topk_weights = as<const float>(any_ptr(r));
    a.use_logfmt = edgy(r, 0, 1);
    a.reduction = edgy(r, 0, 3);
    epx_ll_handle h = random_ll_handle(r);
    int set = edgy(r, 0, 1);
    const int set_before = set;
    const int phases = edgy(r, 1, 3);
    int* set_arg = maybe(r, set);
    const std::string call = cat("epx_ll_combine(NULL, ..., phases ", phases, ")");
    check_is(epx_ll_combine(nullptr, maybe(r, a), maybe(r, h), as<void>(any_ptr(r)), phases, set_arg, fake_stream(r)),
             {EPX_ERR_INVALID_ARGUMENT}, call);
    if (set != set_before) fail(cat(call, ": a failed call changed *buffer_set"));
  }
  void ll_next_combine_buffer(Rng& r) {
    epx_ll_handle h = random_ll_handle(r);
    void* p = nullptr;
    check_is(epx_ll_next_combine_buffer(nullptr, maybe(r, h), maybe(r, p)), {EPX_ERR_INVALID_ARGUMENT},
             "epx_ll_next_combine_buffer(NULL, ...)");
  }

  // Rank masking: without a live buffer every call is an invalid argument, whatever the rank, mask or pointer.
  void ll_update_mask(Rng& r) {
    const int rank = edgy(r, 0, 7), mask = edgy(r, 0, 1);
    check_is(epx_ll_update_mask(nullptr, rank, mask, fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT},
             cat("epx_ll_update_mask(NULL, ", rank, ", ", mask, ", stream)"));
  }
  void ll_query_mask(Rng& r) {
    check_is(epx_ll_query_mask(nullptr, as<int32_t>(any_ptr(r)), fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT},
             "epx_ll_query_mask(NULL, ...)");
  }
  void ll_clean_mask(Rng& r) {
    check_is(epx_ll_clean_mask(nullptr, fake_stream(r)), {EPX_ERR_INVALID_ARGUMENT}, "epx_ll_clean_mask(NULL, stream)");
  }

  // ---- C ABI: limits, configs, size hints -----------------------------------------------------------------------
  void get_limits(Rng& r) {
    if (r.chance(25)) return check(epx_get_limits(nullptr), Want::kError, "epx_get_limits(NULL)");
    epx_limits l{};
    check(epx_get_limits(&l), Want::kOk, "epx_get_limits(&limits)");
    const bool sane = l.max_nvl_ranks >= 1 && l.max_ranks >= l.max_nvl_ranks && l.max_channels >= 1 &&
                      l.max_topk >= 1 && l.max_hidden >= 8 && l.max_local_experts >= 1 &&
                      l.max_experts >= l.max_local_experts && l.fp8_group_size >= 1 && l.ll_max_ranks >= 1 &&
                      l.ll_max_ranks <= l.max_nvl_ranks && l.ll_max_tokens >= 1 && l.ll_max_experts >= 1 &&
                      l.ll_max_topk >= 1 && std::memcmp(&l, &rules_.l, sizeof l) == 0;
    if (!sane) fail("epx_get_limits: limits that contradict each other or change between calls");
  }
  void default_config(Rng& r, bool dispatch) {
    const int ranks = edgy(r, 1, rules_.l.max_ranks);
    epx_config c{};
    const bool out_null = r.chance(10);
    const char* name = dispatch ? "epx_default_dispatch_config" : "epx_default_combine_config";
    const std::string call = cat(name, "(", ranks, out_null ? ", NULL)" : ", &config)");
    const epx_status s = dispatch ? epx_default_dispatch_config(ranks, out_null ? nullptr : &c)
                                  : epx_default_combine_config(ranks, out_null ? nullptr : &c);
    check(s, !out_null && rules_.ranks_ok(ranks) ? Want::kOk : Want::kError, call);
    if (s != EPX_OK) return;
    // A default is a config the operations take: intranode at up to 8 ranks, internode for any split.
    const int G = std::min(ranks, rules_.l.max_nvl_ranks);
    if (!rules_.intranode_config_ok(c, G) || (ranks % G == 0 && !rules_.internode_config_ok(c, G, ranks / G)))
      fail(cat(call, ": the default ", str(c), " is not a valid config for ", ranks, " ranks"));
  }
  void default_dispatch_config(Rng& r) { default_config(r, true); }
  void default_combine_config(Rng& r) { default_config(r, false); }
  void config_num_channels(Rng& r) {
    epx_config c = random_config(r);
    int n = -7;
    const bool c_null = r.chance(8), n_null = r.chance(8);
    const std::string call = cat("epx_config_num_channels(", c_null ? "NULL" : str(c), n_null ? ", NULL)" : ", &n)");
    const epx_status s = epx_config_num_channels(c_null ? nullptr : &c, n_null ? nullptr : &n);
    check(s, !c_null && !n_null && rules_.channels_ok(c) ? Want::kOk : Want::kError, call);
    if (s == EPX_OK && n != c.num_sms / 2) fail(cat(call, ": ", n, " channels, not num_sms / 2"));
  }
  int64_t random_hidden_bytes(Rng& r) {
    if (r.chance(60)) return 16 * r.range(1, rules_.l.max_hidden / 8);  // a valid BF16 row
    return r.pick<int64_t>({0, -16, 8, 17, 24, 100, 14000, 14002, 2 * int64_t(rules_.l.max_hidden),
                            2 * int64_t(rules_.l.max_hidden) + 16, int64_t(1) << 33, int64_t(1) << 40, INT64_MIN,
                            INT64_MAX, int64_t(INT_MAX) + 1, int64_t(r.next())});
  }
  void nvl_size_hint(Rng& r) {
    const bool usual = r.chance(30);  // a default config, a BF16 row and a rank count of one domain
    const int ranks = usual ? r.irange(1, rules_.l.max_nvl_ranks) : edgy(r, 1, rules_.l.max_nvl_ranks);
    epx_config c = usual ? epx::default_dispatch_config(ranks) : random_config(r);
    const int64_t hb = usual ? 16 * r.range(1, rules_.l.max_hidden / 8) : random_hidden_bytes(r);
    int64_t bytes = -7;
    const bool c_null = r.chance(5), b_null = r.chance(5);
    const std::string call = cat("epx_config_nvl_size_hint(", c_null ? "NULL" : str(c), ", ", hb, ", ", ranks,
                                 b_null ? ", NULL)" : ", &bytes)");
    const bool valid = !c_null && !b_null && rules_.intranode_config_ok(c, ranks) && rules_.row_ok(hb);
    const epx_status s = epx_config_nvl_size_hint(c_null ? nullptr : &c, hb, ranks, b_null ? nullptr : &bytes);
    check(s, valid ? Want::kOk : Want::kError, call);
    if (s != EPX_OK) return;
    // Enough for every record the operations may put in the rings (ring_for in runtime/intranode_ops.cpp): BF16 and
    // FP8 rows of this hidden (per-128 scales) with any top-k, and combine rows.
    const int hidden = int(hb / 2), C = c.num_sms / 2;
    const int K = r.irange(0, rules_.l.max_topk);
    const int fp8_hidden = hidden / 16 * 16;
    const int64_t records[] = {
        epx::DispatchRecord::make(2 * int64_t(hidden), 0, K).bytes,
        epx::DispatchRecord::make(fp8_hidden, (fp8_hidden + rules_.l.fp8_group_size - 1) / rules_.l.fp8_group_size, K)
            .bytes,
        epx::CombineRecord::make(hidden, K).bytes};
    for (int64_t record : records) {
      const int64_t need = epx::RingLayout{ranks, c.num_max_recv_tokens, record}.bytes(C);
      if (bytes < need) fail(cat(call, " = ", bytes, ": a record of ", record, " bytes needs ", need));
    }
    if (bytes % 128 != 0) fail(cat(call, " = ", bytes, ": not a multiple of 128"));
  }
  void internode_size_hints(Rng& r) {
    const bool usual = r.chance(30);  // a default config, a BF16 row, 2^k ranks in domains of 2^j
    const int ranks = usual || r.chance(50) ? 1 << r.irange(0, 7) : edgy(r, 1, rules_.l.max_ranks);
    // usual: G = 2^j, at least ranks / max_domains (at most that many domains)
    const int nvl = usual          ? std::max(std::min(ranks, 1 << r.irange(0, 3)), ranks / rules_.max_domains())
                    : r.chance(60) ? r.pick({0, 1, 2, 4, 8})
                                   : edgy(r, 0, rules_.l.max_nvl_ranks);
    epx_config c = usual ? epx::default_dispatch_config(std::clamp(ranks, 1, rules_.l.max_ranks)) : random_config(r);
    const int64_t hb = usual ? 16 * r.range(1, rules_.l.max_hidden / 8) : random_hidden_bytes(r);
    int64_t nb = -7, rb = -7;
    const bool c_null = r.chance(5), nb_null = r.chance(5), rb_null = r.chance(5);
    const std::string call = cat("epx_config_internode_size_hints(", c_null ? "NULL" : str(c), ", ", hb, ", ", ranks,
                                 ", ", nvl, nb_null ? ", NULL" : ", &nvl", rb_null ? ", NULL)" : ", &rdma)");
    bool valid = !c_null && !nb_null && !rb_null && rules_.ranks_ok(ranks) && nvl >= 0 && rules_.row_ok(hb);
    int G = 0, D = 0;
    if (valid) {
      G = nvl > 0 ? nvl : std::min(ranks, rules_.l.max_nvl_ranks);
      valid = G <= rules_.l.max_nvl_ranks && ranks % G == 0;
      if (valid) D = ranks / G, valid = rules_.internode_config_ok(c, G, D);
    }
    const epx_status s = epx_config_internode_size_hints(c_null ? nullptr : &c, hb, ranks, nvl, nb_null ? nullptr : &nb,
                                                         rb_null ? nullptr : &rb);
    check(s, valid ? Want::kOk : Want::kError, call);
    if (s != EPX_OK) return;
    // Enough for the network rings of a BF16 dispatch at the largest top-k (net_ring in runtime/internode_ops.cpp),
    // and NVLink sub-rings exactly when a domain has more than one GPU.
    const int C = c.num_sms / 2;
    const int64_t stride = epx::align_up(epx::InternodeRecord::make(hb, 0, rules_.l.max_topk).bytes, epx::kAlign);
    const int64_t per_slot = int64_t(C) * D * 2 * stride;
    if (rb / per_slot < c.num_max_rdma_recv_tokens)
      fail(cat(call, ": rdma_bytes ", rb, " hold ", rb / per_slot, " slots of a BF16 record, the config asks ",
               c.num_max_rdma_recv_tokens));
    if ((nb > 0) != (G > 1)) fail(cat(call, ": nvl_bytes ", nb, " for domains of ", G));
  }
  void ll_size_hint(Rng& r) {
    const int R = r.chance(70) ? r.irange(1, rules_.l.ll_max_ranks) : edgy(r, 1, rules_.l.ll_max_ranks);
    const int M = r.chance(70) ? r.irange(1, 512) : edgy(r, 1, rules_.l.ll_max_tokens);
    const int H = r.chance(50)   ? 8 * r.irange(1, 1024)
                  : r.chance(50) ? r.pick({7000, 7168, 7004, 7001, 4096, 2048, 0, -8, 32768, 32776})
                                 : edgy(r, 8, rules_.l.max_hidden);
    const bool R_ok = R >= 1 && R <= rules_.l.ll_max_ranks;
    const int E =
        R_ok && r.chance(70) ? R * r.irange(1, rules_.l.ll_max_experts / R) : edgy(r, 1, rules_.l.ll_max_experts);
    int64_t bytes = -7;
    const bool b_null = r.chance(5);
    const std::string call = cat("epx_ll_size_hint(", M, ", ", H, ", ", R, ", ", E, b_null ? ", NULL)" : ", &bytes)");
    const epx_status s = epx_ll_size_hint(M, H, R, E, b_null ? nullptr : &bytes);
    check(s, !b_null && rules_.ll_shape_ok(R, M, H, E) ? Want::kOk : Want::kError, call);
    if (s != EPX_OK) return;
    // A buffer of exactly this many bytes fits the shape (validate_shape in runtime/low_latency_ops.cpp); one
    // alignment step less does not: the hint is the least that works.
    using epx::LowLatencyLayout;
    const int64_t set = epx::align_up(bytes, 2 * epx::kAlign) / 2;
    if (bytes <= 0 || !LowLatencyLayout::make(set, M, H, E).fits())
      fail(cat(call, " = ", bytes, ": a buffer of that size does not fit the shape"));
    if (LowLatencyLayout::make(set - epx::kAlign, M, H, E).fits())
      fail(cat(call, " = ", bytes, ": more than the shape needs"));
  }

  // ---- C++ checks behind the operations (runtime/validate.hpp and the like) ---------------------------------------
  void validate_dispatch_args(Rng& r) {
    // A valid dispatch, then defects from different groups (each breaks a rule no other defect can mend).
    const int R = r.chance(70) ? r.irange(1, 8) : r.irange(1, rules_.l.max_ranks);
    const bool cached = r.chance(30);
    epx_dispatch_args a{};
    const bool fp8 = r.chance(50);
    a.dtype = fp8 ? EPX_FP8_E4M3 : EPX_BF16;
    a.hidden = fp8 ? 16 * r.irange(1, rules_.l.max_hidden / 16) : 8 * r.irange(1, rules_.l.max_hidden / 8);
    a.num_tokens = r.chance(20) ? 0 : r.irange(1, 4096);
    const bool tokens = a.num_tokens > 0;
    a.x = tokens || r.chance(50) ? aligned_ptr(r) : nullptr;
    if (fp8) {
      a.num_scales = r.irange(1, 256);
      a.x_scales = as<const float>(tokens || r.chance(50) ? aligned_ptr(r) : nullptr);
      switch (r.irange(0, 2)) {  // row-major (0, 0), padded rows, or column-major
        case 0:
          break;
        case 1:
          a.x_scales_stride_token = a.num_scales + r.irange(0, 3), a.x_scales_stride_group = 1;
          break;
        default:
          a.x_scales_stride_token = 1, a.x_scales_stride_group = std::max(a.num_tokens, 1);
      }
    }
    a.num_topk = r.chance(25) ? 0 : r.irange(1, rules_.l.max_topk);
    if (a.num_topk > 0) {
      a.topk_idx = as<const int64_t>(tokens || r.chance(50) ? aligned_ptr(r) : nullptr);
      a.topk_weights = as<const float>(r.chance(50) ? aligned_ptr(r) : nullptr);
    }
    a.num_tokens_per_expert = as<const int>(r.chance(50) ? aligned_ptr(r) : nullptr);
    a.num_experts = a.num_topk > 0 || a.num_tokens_per_expert ? R * r.irange(1, rules_.l.max_local_experts)
                                                              : edgy(r, INT_MIN, INT_MAX);
    a.is_token_in_rank = as<const uint8_t>(tokens || r.chance(50) ? aligned_ptr(r) : nullptr);
    a.num_tokens_per_rank = as<const int>(!cached || r.chance(50) ? aligned_ptr(r) : nullptr);
    a.expert_alignment = r.irange(0, 128);
    a.num_worst_tokens = r.chance(50) ? 0 : r.irange(1, 1 << 20);

    const int defects = r.chance(35) ? 0 : r.irange(1, 3);
    bool used[11] = {};
    std::string what;
    for (int d = 0; d < defects; ++d) {
      const int group = r.irange(0, 10);
      if (used[group]) continue;
      used[group] = true;
      switch (group) {
        case 0: {  // a dtype C or Python passed as an int: epx_dtype holds any int there
          const int v = r.pick({2, 3, -1, 255, INT_MAX, INT_MIN});
          std::memcpy(&a.dtype, &v, sizeof v);
          what += cat(" dtype ", v);
          break;
        }
        case 1:
          a.num_tokens = below(r, 0), what += cat(" num_tokens ", a.num_tokens);
          break;
        case 2:
          if (r.chance(50)) {
            a.hidden = r.pick({0, -8, -16, INT_MIN, rules_.l.max_hidden + 16, INT_MAX - 15});
          } else {  // in range, but not whole 16-byte vectors of this dtype
            a.hidden = fp8 ? 16 * r.irange(1, rules_.l.max_hidden / 16 - 1) + r.irange(1, 15)
                           : 8 * r.irange(1, rules_.l.max_hidden / 8 - 1) + r.irange(1, 7);
          }
          what += cat(" hidden ", a.hidden);
          break;
        case 3:
          if (r.chance(50)) {
            a.x = misaligned_ptr(r), what += " x misaligned";
          } else {
            a.num_tokens = std::max(a.num_tokens, 1), a.x = nullptr, what += " x NULL";
          }
          break;
        case 4:
          if (fp8 && r.chance(50)) {
            a.num_scales = below(r, 1), what += cat(" num_scales ", a.num_scales);
          } else if (fp8) {
            a.num_tokens = std::max(a.num_tokens, 1), a.x_scales = nullptr, what += " x_scales NULL";
          } else if (r.chance(50)) {
            a.x_scales = as<const float>(aligned_ptr(r)), what += " x_scales with BF16";
          } else {
            a.num_scales = r.chance(50) ? r.irange(1, 64) : -1, what += cat(" num_scales ", a.num_scales, " with BF16");
          }
          break;
        case 5:
          switch (r.irange(0, 2)) {
            case 0:
              a.num_topk = r.pick({-1, INT_MIN, rules_.l.max_topk + 1, INT_MAX}), what += cat(" num_topk ", a.num_topk);
              break;
            case 1:
              a.num_topk = std::max(a.num_topk, 1), a.num_tokens = std::max(a.num_tokens, 1), a.topk_idx = nullptr;
              a.num_experts = R * r.irange(1, 8), what += " topk_idx NULL";
              used[6] = true;  // the experts stay valid, or no rule would be left broken
              break;
            default:
              a.num_topk = 0, what += " top-k data with num_topk 0";
              if (r.chance(50))
                a.topk_idx = as<const int64_t>(aligned_ptr(r));
              else
                a.topk_weights = as<const float>(aligned_ptr(r));
          }
          break;
        case 6:
          if (a.num_topk == 0 && a.num_tokens_per_expert == nullptr)
            a.num_tokens_per_expert = as<const int>(aligned_ptr(r));
          a.num_experts =
              R == 1 ? r.pick({0, -1, INT_MIN, rules_.l.max_local_experts + 1})
                     : r.pick({0, -R, R + 1, R * rules_.l.max_local_experts + R, R * (rules_.l.max_local_experts + 1)});
          what += cat(" num_experts ", a.num_experts, " over ", R, " ranks");
          break;
        case 7:
          if (!cached && r.chance(50)) {
            a.num_tokens_per_rank = nullptr, what += " num_tokens_per_rank NULL";
          } else {
            a.num_tokens = std::max(a.num_tokens, 1), a.is_token_in_rank = nullptr, what += " is_token_in_rank NULL";
          }
          break;
        case 8:
          a.expert_alignment = below(r, 0), what += cat(" expert_alignment ", a.expert_alignment);
          break;
        case 9:  // the scales' strides and alignment
          if (!fp8) {
            (r.chance(50) ? a.x_scales_stride_token : a.x_scales_stride_group) = r.range(1, 64);
            what += " scale strides with BF16";
            break;
          }
          switch (r.irange(0, 3)) {
            case 0:
              (r.chance(50) ? a.x_scales_stride_token : a.x_scales_stride_group) = r.pick<int64_t>({-1, INT64_MIN});
              what += " a negative scale stride";
              break;
            case 1:
              a.num_tokens = std::max(a.num_tokens, 2), a.x_scales_stride_token = 0, a.x_scales_stride_group = 1;
              what += " token stride 0 with several tokens";
              break;
            case 2:
              a.num_tokens = std::max(a.num_tokens, 3), a.x_scales_stride_token = INT64_MAX / 2;
              a.x_scales_stride_group = 1, what += " scale strides beyond any allocation";
              break;
            default:
              a.x_scales = as<const float>(static_cast<const char*>(aligned_ptr(r)) + r.pick({1, 2, 3}));
              what += " x_scales not 4-byte aligned";
          }
          break;
        default:
          a.num_worst_tokens = below(r, 0), what += cat(" num_worst_tokens ", a.num_worst_tokens);
      }
    }
    const bool invalid = !what.empty();
    check_throws(
        [&] { epx::validate_dispatch_args(a, R, cached, "fuzz_dispatch"); }, invalid,
        cat("validate_dispatch_args(", invalid ? what : " valid", ", ", R, " ranks", cached ? ", cached)" : ")"),
        "fuzz_dispatch");
  }
  void validate_combine_args(Rng& r) {
    epx_combine_args a{};
    epx_combine_outputs o{};
    a.hidden = 8 * r.irange(1, rules_.l.max_hidden / 8);
    int num_tokens = r.chance(20) ? 0 : r.irange(1, 4096);
    int num_recv = r.chance(20) ? -1 : r.irange(0, 8192);
    a.num_rows = num_recv < 0 ? r.irange(0, 8192) : num_recv + (r.chance(50) ? 0 : r.irange(1, 64));
    a.x = a.num_rows > 0 || r.chance(50) ? aligned_ptr(r) : nullptr;
    a.num_topk = r.chance(25) ? 0 : r.irange(1, rules_.l.max_topk);
    if (a.num_topk > 0) {
      a.topk_weights = as<const float>(a.num_rows > 0 || r.chance(50) ? aligned_ptr(r) : nullptr);
      o.combined_topk_weights = as<float>(num_tokens > 0 || r.chance(50) ? aligned_ptr(r) : nullptr);
    }
    // combined_x past the end of x (the two may not share a byte), or anywhere when x is null.
    const uint64_t x_bytes = uint64_t(a.num_rows) * a.hidden * 2;
    const void* out =
        a.x == nullptr ? aligned_ptr(r) : static_cast<const char*>(a.x) + x_bytes + 16 * uint64_t(r.range(0, 1 << 20));
    o.combined_x = as<void>(num_tokens > 0 || r.chance(50) ? out : nullptr);
    a.bias0 = r.chance(50) ? aligned_ptr(r) : nullptr;
    a.bias1 = r.chance(50) ? aligned_ptr(r) : nullptr;
    a.reduction = edgy(r, 0, 2);  // checked by the operation of each mode, not here

    const int defects = r.chance(35) ? 0 : r.irange(1, 3);
    bool used[7] = {};
    std::string what;
    for (int d = 0; d < defects; ++d) {
      const int group = r.irange(0, 6);
      if (used[group]) continue;
      used[group] = true;
      switch (group) {
        case 6:  // combined_x starting inside x (both 16-byte aligned and not null)
          if (a.x == nullptr || (reinterpret_cast<uintptr_t>(a.x) & 15u) != 0 || a.num_rows <= 0 || num_tokens <= 0)
            break;
          o.combined_x = as<void>(static_cast<const char*>(a.x) + 16 * uint64_t(r.range(0, x_bytes / 16 - 1)));
          what += " combined_x over x";
          break;
        case 0:
          a.hidden = r.chance(50) ? r.pick({0, -8, 4, 4100, 7001, rules_.l.max_hidden + 8, INT_MAX, INT_MIN})
                                  : 8 * r.irange(1, rules_.l.max_hidden / 8 - 1) + r.irange(1, 7);
          what += cat(" hidden ", a.hidden);
          break;
        case 1:
          if (r.chance(50) || num_recv <= 0) {
            a.num_rows = below(r, 0), what += cat(" num_rows ", a.num_rows);
          } else {
            a.num_rows = num_recv - r.irange(1, num_recv), what += cat(" ", a.num_rows, " rows of ", num_recv);
          }
          break;
        case 2:
          a.num_rows = std::max(a.num_rows, 1), num_recv = std::min(num_recv, a.num_rows);
          a.x = r.chance(50) ? nullptr : misaligned_ptr(r), what += " x NULL or misaligned";
          break;
        case 3:
          switch (r.irange(0, 3)) {
            case 0:
              a.num_topk = r.pick({-1, INT_MIN, rules_.l.max_topk + 1, INT_MAX}), what += cat(" num_topk ", a.num_topk);
              break;
            case 1:
              a.num_topk = std::max(a.num_topk, 1), a.num_rows = std::max(a.num_rows, 1);
              num_recv = std::min(num_recv, a.num_rows), a.topk_weights = nullptr, what += " topk_weights NULL";
              break;
            case 2:
              a.num_topk = std::max(a.num_topk, 1), num_tokens = std::max(num_tokens, 1);
              o.combined_topk_weights = nullptr, what += " combined_topk_weights NULL";
              break;
            default:
              a.num_topk = 0, what += " weights with num_topk 0";
              if (r.chance(50))
                a.topk_weights = as<const float>(aligned_ptr(r));
              else
                o.combined_topk_weights = as<float>(aligned_ptr(r));
          }
          break;
        case 4:
          num_tokens = std::max(num_tokens, 1), o.combined_x = as<void>(r.chance(50) ? nullptr : misaligned_ptr(r));
          what += " combined_x NULL or misaligned";
          break;
        default:
          (r.chance(50) ? a.bias0 : a.bias1) = misaligned_ptr(r), what += " bias misaligned";
      }
    }
    const bool invalid = !what.empty();
    check_throws(
        [&] { epx::validate_combine_args(a, o, num_tokens, num_recv, "fuzz_combine"); }, invalid,
        cat("validate_combine_args(", invalid ? what : " valid", ", ", num_tokens, " tokens, ", num_recv, " received)"),
        "fuzz_combine");
  }
  void validate_config(Rng& r) {
    const epx_config c = random_config(r);
    const int ranks = edgy(r, 1, rules_.l.max_nvl_ranks);
    check_throws([&] { epx::validate_config(c, ranks); }, !rules_.intranode_config_ok(c, ranks),
                 cat("validate_config(", str(c), ", ", ranks, ")"), nullptr);
  }
  void validate_internode_config(Rng& r) {
    const epx_config c = random_config(r);
    const int G = edgy(r, 1, rules_.l.max_nvl_ranks), D = edgy(r, 1, rules_.max_domains());
    check_throws([&] { epx::validate_internode_config(c, G, D); }, !rules_.internode_config_ok(c, G, D),
                 cat("validate_internode_config(", str(c), ", ", G, ", ", D, ")"), nullptr);
  }
  void choose_domains(Rng& r) {
    // Hosts of D domains of G consecutive ranks each (a valid job), maybe broken; or an explicit domain size.
    const int G = r.irange(1, rules_.l.max_nvl_ranks + 2), D = r.irange(1, 6);
    std::vector<std::string> hosts;
    for (int d = 0; d < D; ++d)
      for (int g = 0; g < G; ++g) hosts.push_back(cat("host", d));
    bool hosts_ok = G <= rules_.l.max_nvl_ranks;
    std::string what = cat(D, " hosts of ", G);
    if (r.chance(25) && D >= 2 && G >= 2) {
      std::swap(hosts[0], hosts[size_t(G)]), hosts_ok = false, what += ", ranks 0 and G swapped";
    } else if (r.chance(20) && D >= 2 && G >= 2) {
      hosts.resize(hosts.size() - size_t(r.irange(1, G - 1))), hosts_ok = false, what += ", last host short";
    }
    const int R = int(hosts.size());
    const int requested = r.chance(50) ? 0 : edgy(r, 1, rules_.l.max_nvl_ranks);
    const bool force = r.chance(30);
    const bool valid =
        requested > 0 ? requested <= rules_.l.max_nvl_ranks && R % requested == 0 : requested == 0 && hosts_ok;
    const int want_G = requested > 0 ? requested : G;
    epx::DomainChoice got{};
    const std::string call = cat("choose_domains(", what, ", requested ", requested, force ? ", forced)" : ")");
    check_throws([&] { got = epx::choose_domains(hosts, requested, force); }, !valid, call,
                 requested != 0 ? "Buffer" : nullptr);
    if (valid && (got.num_nvl_ranks != want_G || got.internode != (force || want_G < R)))
      fail(cat(call, ": chose ", got.num_nvl_ranks, got.internode ? " (internode)" : "", ", expected ", want_G));
  }
  const char* random_switch(Rng& r) {
    return r.pick<const char*>({nullptr, "", "0", "1", "2", "yes", "01", " 1", "1 ", "true", "on", "-0", "10"});
  }
  static bool switch_ok(const char* v) {
    return v == nullptr || v[0] == '\0' || std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0;
  }
  void parse_env_switch(Rng& r) {
    const char* v = random_switch(r);
    bool on = false;
    const std::string call = cat("parse_env_switch(EPX_TEST, ", v ? cat("'", v, "'") : "NULL", ")");
    check_throws([&] { on = epx::parse_env_switch("EPX_TEST", v); }, !switch_ok(v), call, "EPX_TEST");
    if (switch_ok(v) && on != (v != nullptr && std::strcmp(v, "1") == 0)) fail(cat(call, ": read as ", on));
  }
  void choose_transport(Rng& r) {
    const bool region = r.chance(70), built = r.chance(50);
    const char* disable = random_switch(r);
    const char* force = random_switch(r);
    const bool parses = switch_ok(disable) && switch_ok(force);
    const bool d = parses && disable && std::strcmp(disable, "1") == 0,
               f = parses && force && std::strcmp(force, "1") == 0;
    const bool contradiction = d && f;
    const bool unsupported = parses && !contradiction && region && f && !built;
    const std::string call = cat("choose_low_latency_transport(region ", region, ", nvshmem ", built, ", ",
                                 disable ? disable : "NULL", ", ", force ? force : "NULL", ")");
    epx::LowLatencyTransportChoice c{};
    check_throws([&] { c = epx::choose_low_latency_transport(region, built, disable, force); },
                 !parses || contradiction || unsupported, call, nullptr,
                 unsupported ? epx::Status::kNotSupported : epx::Status::kInvalidArgument);
    if (!parses || contradiction || unsupported) return;
    using T = epx::LowLatencyTransport;
    const T want = !region ? T::kNone : (!built || d) ? T::kCudaIpc : T::kNvshmem;
    if (c.transport != want || c.force_nvshmem != (want == T::kNvshmem && f)) fail(cat(call, ": another transport"));
  }

  // ---- the reference model --------------------------------------------------------------------------------------
  // Sources of R ranks with T tokens each (at most max_tokens), top-k ids drawn in [-1, E) and, with out_of_range,
  // outside it; is_token_in_rank random.
  struct World {
    std::vector<std::vector<int64_t>> idx;
    std::vector<std::vector<float>> weights;
    std::vector<std::vector<uint8_t>> in_rank;
    std::vector<epx::ref::Source> sources;
  };
  static int64_t draw_id(Rng& r, int E, bool out_of_range) {
    if (out_of_range && r.chance(5)) return r.pick<int64_t>({-2, E, int64_t(E) + 7, INT64_MIN, INT64_MAX, -1000});
    return r.chance(20) ? -1 : r.range(0, std::max(E, 1) - 1);
  }
  World make_world(Rng& r, int R, int K, int E, int max_tokens, bool out_of_range) {
    World w;
    w.idx.resize(size_t(R)), w.weights.resize(size_t(R)), w.in_rank.resize(size_t(R));
    for (int s = 0; s < R; ++s) {
      const int T = r.irange(0, max_tokens);
      for (int i = 0; i < T * std::max(K, 0); ++i) {
        w.idx[s].push_back(draw_id(r, E, out_of_range));
        w.weights[s].push_back(float(r.range(-1000, 1000)) / 64.f);
      }
      for (int i = 0; i < T * R; ++i) w.in_rank[s].push_back(uint8_t(r.chance(40)));
      epx::ref::Source src;
      src.num_tokens = T;
      src.is_token_in_rank = w.in_rank[s].data();
      src.topk_idx = w.idx[s].data();
      src.topk_weights = w.weights[s].data();
      w.sources.push_back(src);
    }
    return w;
  }

  // Experts for the model over R ranks: a multiple of R the model can hold (it allocates per expert), or a count it
  // must refuse.
  static int draw_experts(Rng& r, int R) {
    if (R >= 1 && r.chance(80)) return R * r.irange(1, 16);
    if (R > 1 && r.chance(50)) return R * r.irange(0, 16) + r.irange(1, R - 1);
    return r.pick({0, -1, clamp_int(-int64_t(R)), INT_MIN});
  }

  void ref_dispatch_layout(Rng& r) {
    const int T = r.chance(90) ? r.irange(0, 48) : r.pick({-1, -7, INT_MIN});
    const int K = r.chance(85) ? r.irange(1, 9) : r.pick({0, -1, INT_MIN});
    const int R = r.chance(90) ? r.irange(1, 16) : r.pick({0, -1, INT_MIN});
    const int E = draw_experts(r, R);
    const int G = r.chance(50) ? 0 : r.irange(-1, std::max(R, 1) + 1);
    std::vector<int64_t> idx;
    bool ids_ok = true;
    const bool out_of_range = r.chance(30);
    if (T > 0 && K > 0)
      for (int i = 0; i < T * K; ++i) {
        idx.push_back(draw_id(r, E, out_of_range));
        ids_ok = ids_ok && idx.back() >= -1 && idx.back() < E;
      }
    const bool shapes_ok = T >= 0 && K >= 1 && R >= 1 && E > 0 && E % R == 0 && (G <= 0 || G >= R || R % G == 0);
    const bool valid = shapes_ok && ids_ok;
    epx::ref::Layout out;
    const std::string call =
        cat("dispatch_layout(", T, " tokens, top-", K, ", ", E, " experts, ", R, " ranks, G ", G, ")");
    check_model([&] { out = epx::ref::dispatch_layout(idx.empty() ? nullptr : idx.data(), T, K, E, R, G); }, !valid,
                call);
    if (!valid) return;
    // Counts from the ids: every slot counts for its expert, every token once for every rank it goes to.
    std::vector<int> per_expert(size_t(E), 0), per_rank(size_t(R), 0);
    for (int t = 0; t < T; ++t) {
      std::vector<bool> to(size_t(R), false);
      for (int k = 0; k < K; ++k) {
        const int64_t e = idx[size_t(t) * K + k];
        if (e < 0) continue;
        ++per_expert[size_t(e)];
        to[size_t(e / (E / R))] = true;
      }
      for (int j = 0; j < R; ++j) {
        per_rank[size_t(j)] += to[size_t(j)];
        if (out.is_token_in_rank[size_t(t) * R + j] != to[size_t(j)]) return fail(cat(call, ": is_token_in_rank"));
      }
    }
    if (out.num_tokens_per_expert != per_expert || out.num_tokens_per_rank != per_rank)
      fail(cat(call, ": counts that are not the ids'"));
    const bool rdma = G > 0 && G < R;
    if (out.num_tokens_per_rdma_rank.size() != (rdma ? size_t(R / G) : 0)) fail(cat(call, ": rdma counts' size"));
  }
  void ref_low_latency_rows(Rng& r) {
    const int R = r.chance(5) ? 0 : r.irange(1, 8);
    const int K = r.irange(0, 9);
    const int E = R == 0 ? 8 : draw_experts(r, R);
    const int rank = r.chance(5) ? INT_MAX : r.irange(-2, R + 2);
    World w = make_world(r, R, K, E, 12, true);
    const bool valid = R >= 1 && E > 0 && E % R == 0;
    std::vector<std::vector<epx::ref::RecvRow>> rows;
    const std::string call = cat("low_latency_rows(", R, " ranks, top-", K, ", ", E, " experts, rank ", rank, ")");
    check_model([&] { rows = epx::ref::low_latency_rows(w.sources, K, E, rank); }, !valid, call);
    if (!valid) return;
    const int L = E / R;
    size_t want = 0, got = 0;
    for (const auto& s : w.idx)
      for (int64_t e : s) want += e >= int64_t(rank) * L && e < (int64_t(rank) + 1) * L;
    for (const auto& v : rows) got += v.size();
    if (rows.size() != size_t(L) || got != want) fail(cat(call, ": ", got, " rows, the ids say ", want));
  }
  void ref_dispatch_meta(Rng& r) {
    const int R = r.irange(1, 8);
    const int rank = r.chance(10) ? R + r.irange(0, 3) : r.irange(0, R - 1);
    const int K = r.chance(5) ? -1 : r.irange(0, 9);
    const int E = draw_experts(r, R);
    const int align = r.chance(80) ? r.irange(1, 64) : r.chance(50) ? r.pick({0, -1, INT_MIN}) : INT_MAX;
    const bool with_topk = r.chance(80), with_weights = with_topk && r.chance(50);
    World w = make_world(r, R, K, E, 12, true);
    const bool valid = rank >= 0 && rank < R && (!with_topk || (K >= 0 && E > 0 && E % R == 0 && align >= 1));
    epx::ref::RecvMeta meta;
    const std::string call = cat("dispatch_meta(", R, " ranks, rank ", rank, ", top-", K, ", ", E, " experts, align ",
                                 align, with_topk ? ", top-k" : "", with_weights ? ", weights)" : ")");
    check_model([&] { meta = epx::ref::dispatch_meta(w.sources, rank, K, E, align, with_topk, with_weights); }, !valid,
                call);
    if (!valid) return;
    const std::vector<epx::ref::RecvRow> rows = epx::ref::recv_rows(w.sources, rank);
    const std::vector<int> prefix = epx::ref::rank_prefix_matrix(w.sources);
    if (meta.recv_src_idx.size() != rows.size() || int(rows.size()) != prefix[size_t(R - 1) * R + rank])
      fail(cat(call, ": rows disagree with recv_rows / rank_prefix_matrix"));
    for (int c : meta.num_recv_tokens_per_expert)
      if (c % align != 0) fail(cat(call, ": a count not aligned to ", align));
  }
  void ref_internode_handle(Rng& r) {
    const int R = r.irange(1, 16);
    const int G = r.chance(70) ? r.pick({1, 2, 4, 8, R}) : edgy(r, 1, 32);
    const int C = r.chance(80) ? r.irange(1, 6) : r.pick({0, -1, INT_MIN});
    const int rank = r.chance(85) ? r.irange(0, R - 1) : r.pick({-1, R, INT_MAX, INT_MIN});
    World w = make_world(r, R, 0, 1, 10, false);
    const bool valid = G >= 1 && G <= 32 && R % G == 0 && C >= 1 && rank >= 0 && rank < R;
    epx::ref::InternodeHandle h;
    const std::string call = cat("internode_handle(", R, " ranks, rank ", rank, ", G ", G, ", ", C, " channels)");
    check_model([&] { h = epx::ref::internode_handle(w.sources, rank, G, C); }, !valid, call);
    if (valid &&
        (h.gbl_channel_prefix_matrix.size() != size_t(R) * C ||
         h.rdma_channel_prefix_matrix.size() != size_t(R / G) * C || h.recv_gbl_rank_prefix_sum.size() != size_t(R)))
      fail(cat(call, ": arrays of the wrong shapes"));
  }
  void ref_channel_of(Rng& r) {
    const int T = edgy(r, 1, INT_MAX), C = edgy(r, 1, 64);
    const int last = T > 0 ? T - 1 : 0;
    const int t = r.chance(80) ? r.irange(0, last) : edgy(r, 0, last);
    const bool valid = T > 0 && C >= 1 && t >= 0 && t < T;
    int c = -1;
    const std::string call = cat("channel_of(", T, ", ", C, ", ", t, ")");
    check_model([&] { c = epx::ref::channel_of(T, C, t); }, !valid, call);
    if (valid && (c < 0 || c >= C)) fail(cat(call, " = ", c, ": not a channel"));
  }
  void ref_domain_mask(Rng& r) {
    const int R = r.irange(1, 16);
    const int G = r.chance(70) ? r.pick({1, 2, 4, 8, R}) : edgy(r, 1, 32);
    const int T = r.irange(1, 8);
    std::vector<uint8_t> in_rank(size_t(T) * R);
    for (auto& b : in_rank) b = uint8_t(r.chance(50));
    const epx::ref::Source src{.num_tokens = T, .is_token_in_rank = in_rank.data()};
    const int token = r.chance(10) ? T : r.irange(0, T - 1);
    const int D = G >= 1 ? R / G : 1;
    const int domain = r.chance(80) ? r.irange(0, std::max(D - 1, 0)) : edgy(r, 0, std::max(D - 1, 0));
    const bool valid = G >= 1 && G <= 32 && R % G == 0 && domain >= 0 && domain < D && token >= 0 && token < T;
    uint32_t mask = 0;
    const std::string call = cat("domain_mask(", R, " ranks, G ", G, ", token ", token, ", domain ", domain, ")");
    check_model([&] { mask = epx::ref::domain_mask(src, R, G, token, domain); }, !valid, call);
    if (valid && G < 32 && mask >> G != 0) fail(cat(call, ": bits beyond the domain's ranks"));
  }
  void ref_combine(Rng& r) {
    // The flat order, and the two-level order of the same contributions: one domain without biases must agree.
    const int R = r.irange(1, 8);
    const int hidden = r.chance(5) ? -8 : r.irange(0, 48);
    const int K = r.irange(0, 9);
    const int G = r.chance(70) ? r.pick({1, 2, 4, 8, R}) : edgy(r, 1, 32);
    World w = make_world(r, 1, K, 1, 6, false);
    std::vector<uint8_t> in_rank(size_t(w.sources[0].num_tokens) * R);
    for (auto& b : in_rank) b = uint8_t(r.chance(50));
    const epx::ref::Source own{.num_tokens = w.sources[0].num_tokens, .is_token_in_rank = in_rank.data()};
    const int T = own.num_tokens;
    std::vector<uint16_t> rows(size_t(R) * T * std::max(hidden, 0) + 1),
        biases(2 * size_t(T) * std::max(hidden, 0) + 1);
    std::vector<float> weights(size_t(R) * T * K + 1);
    for (auto& v : rows) v = uint16_t(r.next());
    for (auto& v : biases) v = uint16_t(r.next());
    for (auto& v : weights) v = float(r.range(-512, 512)) / 32.f;
    bool out_of_range = false;
    epx::ref::ContributionRow row = [&](int j, int t) {
      out_of_range |= j < 0 || j >= R || t < 0 || t >= T;
      return rows.data() + (size_t(j) * T + t) * std::max(hidden, 0);
    };
    epx::ref::ContributionWeights wts;
    if (r.chance(50)) wts = [&](int j, int t) { return weights.data() + (size_t(j) * T + t) * K; };
    const bool with_bias = r.chance(50);
    const uint16_t* b0 = with_bias ? biases.data() : nullptr;
    const uint16_t* b1 = with_bias && r.chance(50) ? biases.data() + size_t(T) * std::max(hidden, 0) : nullptr;
    epx::ref::Combined flat, two;
    const std::string call = cat("combine(", R, " ranks, ", T, " tokens, hidden ", hidden, ", top-", K, ", G ", G, ")");
    check_model([&] { flat = epx::ref::combine(own, R, hidden, K, row, wts, b0, b1); }, hidden < 0, call);
    const bool valid2 = G >= 1 && G <= 32 && R % G == 0 && hidden >= 0;
    check_model([&] { two = epx::ref::combine_two_level(own, R, G, hidden, K, row, wts, b0, b1); }, !valid2,
                "combine_two_level: " + call);
    if (out_of_range) fail(cat(call, ": asked for a row of a rank or token that does not exist"));
    if (valid2 && G == R && !with_bias && flat.x != two.x) fail(cat(call, ": one domain, two orders, other sums"));
    if (valid2 && flat.weights != two.weights) fail(cat(call, ": the weights differ between the orders"));
  }
  void ref_quantize(Rng& r) {
    const int hidden = r.chance(75) ? 128 * r.irange(0, 8) : r.pick({1, 7, 64, 129, 200, -128, -1});
    std::vector<uint16_t> x(size_t(std::max(hidden, 0)) + 1);
    for (auto& v : x) v = r.chance(95) ? uint16_t(r.next()) : r.pick<uint16_t>({0x7f80, 0xff80, 0x7fc0, 0, 0x8000});
    std::vector<uint8_t> q(x.size());
    std::vector<float> scales(x.size() / 128 + 1);
    const bool round = r.chance(50);
    const std::string call = cat("quantize_fp8_row(hidden ", hidden, round ? ", round_scale)" : ")");
    check_model([&] { epx::ref::quantize_fp8_row(x.data(), hidden, round, q.data(), scales.data()); },
                hidden % 128 != 0, call);
  }
  void ref_ll_combine_row(Rng& r) {
    const int hidden = r.irange(0, 64), K = r.irange(0, 9), E = r.irange(1, 64);
    std::vector<int64_t> idx(size_t(K) + 1);
    std::vector<float> w(size_t(K) + 1);
    for (auto& e : idx) e = draw_id(r, E, true);
    for (auto& v : w) v = float(r.range(-512, 512)) / 32.f;
    std::vector<uint16_t> rows(size_t(E) * hidden + 1), out(size_t(hidden) + 1);
    for (auto& v : rows) v = uint16_t(r.next());
    bool out_of_range = false;
    const epx::ref::ExpertRow row = [&](int64_t e) {
      out_of_range |= e < 0 || e >= E;
      return rows.data() + size_t(std::clamp<int64_t>(e, 0, E - 1)) * hidden;
    };
    const std::string call = cat("low_latency_combine_row(hidden ", hidden, ", top-", K, ", ", E, " experts)");
    check_model([&] { epx::ref::low_latency_combine_row(hidden, idx.data(), w.data(), K, E, row, out.data()); }, false,
                call);
    if (out_of_range) fail(cat(call, ": read the row of an expert outside [0, E)"));
  }
  void ref_ll_combine_row_rank_reduced(Rng& r) {
    // Mostly valid sizes (E a multiple of R), sometimes not.
    const int hidden = r.chance(5) ? -1 : r.irange(0, 64), K = r.chance(5) ? -1 : r.irange(0, 9);
    const int R = r.chance(5) ? r.irange(-1, 1) : r.irange(1, 9);
    const int E = r.chance(10) ? r.irange(0, 64) : std::max(R, 1) * r.irange(1, 8);
    std::vector<int64_t> idx(size_t(std::max(K, 0)) + 1);
    std::vector<float> w(idx.size());
    for (auto& e : idx) e = draw_id(r, std::max(E, 1), true);
    for (auto& v : w) v = float(r.range(-512, 512)) / 32.f;
    std::vector<uint16_t> rows(size_t(std::max(E, 1)) * std::max(hidden, 0) + 1), out(size_t(std::max(hidden, 0)) + 1);
    for (auto& v : rows) v = uint16_t(r.next());
    bool out_of_range = false;
    const epx::ref::ExpertRow row = [&](int64_t e) {
      out_of_range |= e < 0 || e >= E;
      return rows.data() + size_t(std::clamp<int64_t>(e, 0, std::max(E, 1) - 1)) * std::max(hidden, 0);
    };
    const bool invalid = hidden < 0 || K < 0 || R < 1 || E < R || E % R != 0;
    const std::string call =
        cat("low_latency_combine_row_rank_reduced(hidden ", hidden, ", top-", K, ", ", E, " experts, ", R, " ranks)");
    check_model(
        [&] { epx::ref::low_latency_combine_row_rank_reduced(hidden, idx.data(), w.data(), K, E, R, row, out.data()); },
        invalid, call);
    if (out_of_range) fail(cat(call, ": read the row of an expert outside [0, E)"));
  }
  void ref_numerics(Rng& r) {
    using namespace epx::ref;
    const uint16_t b = uint16_t(r.next());
    const uint16_t back = float_to_bf16(bf16_to_float(b));
    const bool nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
    const uint16_t want = nan ? uint16_t((b & 0x8000) | 0x7fc0) : b;
    const uint8_t e = uint8_t(r.next());
    const bool e_nan = (e & 0x7f) == 0x7f;
    uint32_t bits = uint32_t(r.next());
    float f;
    std::memcpy(&f, &bits, sizeof f);
    const uint8_t q = float_to_e4m3(f);
    const bool q_ok = std::isnan(f) ? q == 0x7f : (q & 0x7f) != 0x7f && std::fabs(e4m3_to_float(q)) <= 448.f;
    const bool ok = back == want && (e_nan || float_to_e4m3(e4m3_to_float(e)) == e) && q_ok;
    value(ok, ok ? "round trips exact" : "a round trip changed the value",
          cat("bf16 ", b, ", e4m3 ", int(e), ", float bits ", bits));
  }

  Options opt_;
  int trace_ = -1;
  Rules rules_;
  int gpus_ = 0;
  std::vector<Entry> targets_;
  size_t num_c_abi_ = 0;
  Entry* current_ = nullptr;
  int64_t case_ = 0;
  int64_t last_error_checks_ = 0;
  std::vector<std::string> failures_;
  int64_t num_failures_ = 0;
};

}  // namespace

Report run(const Options& options) { return Fuzzer(options).run(); }

const char* current_case() { return g_current_case; }

std::vector<std::string> c_abi_entry_points() { return Fuzzer(Options{}).c_abi_names(); }

std::string format(const Report& report) {
  size_t width = 6;
  for (const Target& t : report.targets) width = std::max(width, t.name.size());
  std::ostringstream os;
  os << "target" << std::string(width - 6, ' ') << "  cases  outcomes\n";
  for (const Target& t : report.targets) {
    std::string cases = std::to_string(t.cases);
    os << t.name << std::string(width - t.name.size(), ' ') << std::string(7 - std::min<size_t>(7, cases.size()), ' ')
       << cases << "  ";
    bool first = true;
    for (const auto& [what, n] : t.outcomes) os << (first ? "" : ", ") << what << " " << n, first = false;
    os << "\n";
  }
  os << report.cases << " cases; epx_last_error() checked after " << report.last_error_checks
     << " of them (every C ABI status); " << report.num_failures << " failures\n";
  for (const std::string& f : report.failures) os << "FAILURE " << f << "\n";
  return os.str();
}

}  // namespace epx_fuzz
