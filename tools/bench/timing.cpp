#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "device_array.hpp"
#include "gate.hpp"

namespace epx::bench {
namespace {

using harness::cuda_check;
using Clock = std::chrono::steady_clock;

// How long after the last rank reached the barrier every rank starts. The bootstrap barrier releases waiting
// ranks with up to ~50 us of sleep granularity plus scheduler wake-up, which would land inside the first rank's
// events (it waits in notify for the others); a shared deadline removes that skew for a small idle gap.
constexpr auto kStartMargin = std::chrono::microseconds(1000);

// How long a release gate waits for rank 0's release before it lets its stream go anyway (and counts it in the
// line's expired): far beyond the gate's 200 us, so only a rank that fell behind (or a bug) reaches it.
constexpr int kReleaseGateBoundUs = 20000;

// A barrier whose ranks leave at the same moment: every rank contributes its arrival time (the all-gather is
// the barrier), then all spin until the last arrival + kStartMargin. steady_clock is CLOCK_MONOTONIC, one
// clock for every process of the host.
void start_together(Bootstrap& bs) {
  const int64_t arrived = Clock::now().time_since_epoch().count();
  std::vector<int64_t> all(bs.size());
  bs.all_gather(&arrived, all.data(), sizeof(int64_t));
  const Clock::time_point deadline{Clock::duration(*std::max_element(all.begin(), all.end()))};
  while (Clock::now() < deadline + kStartMargin) {
  }
}

// Owns one CUDA event (default flags: timing enabled).
class Event {
 public:
  Event() { cuda_check(cudaEventCreate(&e_), "cudaEventCreate"); }
  ~Event() { cudaEventDestroy(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace

std::vector<double> time_iterations(Bootstrap& bs, cudaStream_t stream, const TimingPlan& plan,
                                    const std::function<void(int)>& prepare, const std::function<void()>& op) {
  Event start, stop;
  std::vector<double> samples;
  samples.reserve(plan.iters);
  for (int i = 0; i < plan.warmup + plan.iters; ++i) {
    const int timed = i - plan.warmup;
    prepare(timed >= 0 ? timed : -1);
    // Sync before the barrier: when it releases, no rank has queued work left, so the events measure only this
    // iteration, and no rank starts before every rank is ready.
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize before a timed iteration");
    start_together(bs);
    const Clock::time_point queued_from = Clock::now();
    ReleaseLine* line = plan.gate_us > 0 ? plan.release_line : nullptr;
    const uint32_t seq = line ? ++line->seq : 0;
    if (line)
      cuda_check(launch_release_gate(stream, *line, seq, kReleaseGateBoundUs), "release gate kernel");
    else if (plan.gate_us > 0)
      cuda_check(launch_gate(stream, plan.gate_us), "gate kernel");
    const Clock::time_point host_from = Clock::now();
    cuda_check(cudaEventRecord(start.get(), stream), "cudaEventRecord(start)");
    op();
    cuda_check(cudaEventRecord(stop.get(), stream), "cudaEventRecord(stop)");
    if (plan.host_us && timed >= 0)
      plan.host_us->push_back(std::chrono::duration<double, std::micro>(Clock::now() - host_from).count());
    if (plan.gate_us > 0 && plan.gate_overruns && timed >= 0 &&
        Clock::now() - queued_from > std::chrono::microseconds(plan.gate_us / 2))
      ++*plan.gate_overruns;
    if (line && line->leader) {  // every rank left start_together with this one: all have queued by now
      while (Clock::now() < queued_from + std::chrono::microseconds(plan.gate_us)) {
      }
      release(*line, seq);
    }
    cuda_check(cudaEventSynchronize(stop.get()), "cudaEventSynchronize(stop)");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    if (timed >= 0) samples.push_back(double(ms) * 1e3);
  }
  return samples;
}

Stats summarize(std::vector<double> us) {
  Stats s;
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  s.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  s.min_us = us.front();
  s.max_us = us.back();
  return s;
}

}  // namespace epx::bench
