// Bounded waits. Every spin in epx goes through here: it has a budget, watches the abort flag that a failing
// peer raises, and on failure leaves a diagnostic in host-mapped memory (rank, role, channel, peer and the
// queue positions), tells every peer to abort, and traps so that the call fails instead of hanging.
#pragma once

#include <cstdint>

#include "device/ptx.cuh"
#include "device/report.cuh"
#include "device/transport.cuh"
#include "layout/fail_state.hpp"

namespace epx::dev {

// Where a wait happens, for the diagnostic.
struct WaitSite {
  int role;
  int channel;
  int peer;
  int64_t extra;  // role-specific third value (e.g. a token index)
};

static __device__ __noinline__ void fail_fatal(const FailState& env, int code, const WaitSite& site, int64_t seen,
                                               int64_t awaited) {
  if (atomicCAS(&env.self->fatal_claimed, 0, 1) == 0) {
    volatile DeviceDiag* d = &env.host->fatal;
    d->channel = site.channel;
    d->peer = site.peer;
    write_diag(d, code, env.rank, site.role, seen, awaited, site.extra);
    __threadfence_system();
  }
  if (code != kErrAbortedByPeer) {
    for (int p = 0; p < env.num_ranks; ++p) post(env.abort_words[p], int32_t(env.rank + 1));
#if EPX_NVSHMEM_DEVICE
    if (env.net_abort != nullptr) {
      for (int pe = 0; pe < env.num_pes; ++pe) nvshmem_int_p(env.net_abort, env.rank + 1, pe);
      nvshmem_quiet();
    }
#endif
  }
  __threadfence_system();
  __trap();
}

__device__ __forceinline__ void check_abort(const FailState& env, const WaitSite& site) {
  const int32_t a = ld_relaxed_sys(env.abort_word);
  if (a != 0) fail_fatal(env, kErrAbortedByPeer, site, a - 1, 0);
}

// How a wait polls. Both end in an acquire on the value that ends the wait, so the caller's later reads see what
// was published before it.
//   kAcquire  every poll is an ld.acquire.sys (LDG.STRONG.SYS + CCTL.IVALL: the SM's L1 invalidated at each poll).
//   kRelaxed  polls with ld.relaxed.sys and runs one fence_acquire_sys once the value is reached (the relaxed read
//             and the fence are an acquire pattern): one L1 invalidation per wait. The low-latency kernels use it
//             (their waits poll words in this rank's own memory); the intranode and internode kernels keep
//             kAcquire (the intranode FP8 dispatch measured slower with kRelaxed at 2 ranks: docs/bench-notes.md).
enum class Poll { kAcquire, kRelaxed };

template <Poll P, typename T>
__device__ __forceinline__ T poll_load(const T* p) {
  if constexpr (P == Poll::kAcquire)
    return ld_acquire_sys(p);
  else
    return ld_relaxed_sys(p);
}

// After a poll_load<P> that saw the awaited value: makes it an acquire (kRelaxed), or nothing (kAcquire: it was one).
template <Poll P>
__device__ __forceinline__ void poll_reached() {
  if constexpr (P == Poll::kRelaxed) fence_acquire_sys();
}

// The loop every wait below shares: polls *p (as P says) until reached(v), watching the budget and the abort flag;
// on timeout the diagnostic records the value seen and `awaited`. Returns the value seen, acquired.
template <Poll P = Poll::kAcquire, typename T, typename Reached>
__device__ __forceinline__ T wait_until(const T* p, Reached reached, int64_t awaited, const FailState& env,
                                        const WaitSite& site) {
  T v = poll_load<P>(p);
  if (reached(v)) {
    poll_reached<P>();
    return v;
  }
  const uint64_t start = globaltimer_ns();
  while (true) {
    v = poll_load<P>(p);
    if (reached(v)) {
      poll_reached<P>();
      return v;
    }
    check_abort(env, site);
    if (globaltimer_ns() - start > env.budget_ns) fail_fatal(env, kErrTimeout, site, int64_t(v), awaited);
  }
}

// A wait for one rank under rank masking (enable_shrink, kernels/low_latency/shrink.cuh): polls as wait_until does,
// but gives up without failing once `rank` is left out: its mask word (or this rank's own, `me`) is set by another
// thread, or the wait has lasted mask.budget_ns, when it sets the word itself (atomicExch: the first of the waits
// that run out masks the rank, every later read of the word sees it) and the call goes on without the rank. The
// abort flag and the hang budget (env.budget_ns, for a shrink budget set longer) still fail the call. Returns true
// with *seen set once reached(v), false when the rank is left out.
template <Poll P = Poll::kAcquire, typename T, typename Reached>
__device__ __forceinline__ bool wait_until_or_mask(const T* p, Reached reached, int64_t awaited, const RankMask& mask,
                                                   int me, int rank, const FailState& env, const WaitSite& site,
                                                   T* seen) {
  const uint64_t start = globaltimer_ns();
  while (true) {
    const T v = poll_load<P>(p);
    if (reached(v)) {
      poll_reached<P>();
      *seen = v;
      return true;
    }
    // Relaxed: the word carries no data; a mask set by another thread is seen a few polls later at most.
    if (ld_relaxed_sys(mask.words + rank) != 0 || ld_relaxed_sys(mask.words + me) != 0) return false;
    check_abort(env, site);
    const uint64_t waited = globaltimer_ns() - start;
    if (waited > mask.budget_ns) {
      atomicExch(mask.words + rank, 1);
      return false;
    }
    if (waited > env.budget_ns) fail_fatal(env, kErrTimeout, site, int64_t(v), awaited);
  }
}

// Waits until *p >= target (acquire). Returns the value seen.
__device__ __forceinline__ uint64_t wait_at_least(const uint64_t* p, uint64_t target, const FailState& env,
                                                  const WaitSite& site) {
  return wait_until(
      p, [target](uint64_t v) { return v >= target; }, int64_t(target), env, site);
}

// Waits until *p >= target (acquire), for 32-bit counters.
__device__ __forceinline__ int32_t wait_at_least_i32(const int32_t* p, int32_t target, const FailState& env,
                                                     const WaitSite& site) {
  return wait_until(
      p, [target](int32_t v) { return v >= target; }, target, env, site);
}

// Waits until the monotonic 32-bit counter *p has reached target (acquire), comparing so that the counter may
// wrap (the two are never 2^31 apart).
template <Poll P = Poll::kAcquire>
__device__ __forceinline__ int32_t wait_epoch(const int32_t* p, int32_t target, const FailState& env,
                                              const WaitSite& site) {
  return wait_until<P>(
      p, [target](int32_t v) { return int32_t(uint32_t(v) - uint32_t(target)) >= 0; }, target, env, site);
}

// Waits until *p == target (acquire), for epoch flags.
__device__ __forceinline__ void wait_equal(const uint32_t* p, uint32_t target, const FailState& env,
                                           const WaitSite& site) {
  wait_until(
      p, [target](uint32_t v) { return v == target; }, int64_t(target), env, site);
}

// Waits until *p == target (acquire), for 64-bit epoch flags (signal words).
__device__ __forceinline__ void wait_equal(const uint64_t* p, uint64_t target, const FailState& env,
                                           const WaitSite& site) {
  wait_until(
      p, [target](uint64_t v) { return v == target; }, int64_t(target), env, site);
}

// Waits until *p != 0 (acquire) and returns it, for count messages that are nonzero once written.
__device__ __forceinline__ int32_t wait_nonzero(const int32_t* p, const FailState& env, const WaitSite& site) {
  return wait_until(
      p, [](int32_t v) { return v != 0; }, 1, env, site);
}

// A spin with no memory to watch (a coordinator waiting on its own block) still has a budget.
struct SpinBudget {
  uint64_t start = 0;
  // `budgets`: how many of env.budget_ns the wait may last. The start words' waits take 2, so that when a rank does
  // not call, the wait that names it (one budget) reports first and these stop on the abort word it raises.
  __device__ __forceinline__ void tick(const FailState& env, const WaitSite& site, int64_t seen, int64_t awaited,
                                       uint32_t budgets = 1) {
    if (start == 0) start = globaltimer_ns();
    check_abort(env, site);
    if (globaltimer_ns() - start > budgets * env.budget_ns) fail_fatal(env, kErrTimeout, site, seen, awaited);
  }
  // The same spin for a caller that writes its own report: checks the abort flag, returns true once the budget
  // is spent.
  __device__ __forceinline__ bool expired(const FailState& env, const WaitSite& site) {
    if (start == 0) start = globaltimer_ns();
    check_abort(env, site);
    return globaltimer_ns() - start > env.budget_ns;
  }
};

}  // namespace epx::dev
