// How every number of epx-bench is taken: CUDA events around the operation, warm-up first, all
// ranks started together after a barrier, median over the timed iterations.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "epx/epx.hpp"
#include "gate.hpp"

namespace epx::bench {

struct TimingPlan {
  int warmup = 5;
  int iters = 30;
  // > 0: each iteration first launches a gate kernel of gate_us on the stream, then records the start event
  // and queues op() behind it, so the events time the GPU's work only, not the host's launch latency (a
  // decoding step's launches run ahead of the GPU). An iteration whose host part (gate launch to the stop
  // event's record) took more than half the gate may have let the GPU wait for the host: counted into
  // *gate_overruns when that is set.
  int gate_us = 0;
  int* gate_overruns = nullptr;
  // With gate_us > 0 and a line: the gate waits for the line's release instead of its own clock, and rank 0
  // releases it gate_us after the shared start, so every rank's call starts at the same moment (gate.hpp).
  ReleaseLine* release_line = nullptr;
  // When set: the host's time of every timed iteration (us) from just before the start event's record to just after
  // the stop event's record, op()'s host part with the two records.
  std::vector<double>* host_us = nullptr;
};

// Per-rank statistics of one measurement, in microseconds.
struct Stats {
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
};

// Runs warmup + iters iterations of `op` on `stream`. Each iteration:
//   prepare(timed_index)  -- untimed (e.g. fresh x); timed_index is -1 during warm-up
//   cudaStreamSynchronize; bootstrap barrier   -- every rank idle; then all ranks leave the barrier at one
//                                                 shared deadline (1 ms after the last arrival, host clock)
//   [gate kernel, when plan.gate_us > 0; with a release line rank 0 releases every gate gate_us later];
//   event start; op(); event stop; wait for stop
// Returns the elapsed time of each timed iteration (us). op() may block on the host (notify's count wait):
// that wait is inside the events, as a caller of the API sees it.
std::vector<double> time_iterations(Bootstrap& bs, cudaStream_t stream, const TimingPlan& plan,
                                    const std::function<void(int)>& prepare, const std::function<void()>& op);

Stats summarize(std::vector<double> samples_us);

}  // namespace epx::bench
