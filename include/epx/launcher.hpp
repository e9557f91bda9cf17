// Built-in local launcher: one child process per GPU, joined by a shared-memory bootstrap. Used by epx-bench
// and the GPU tests; usable by any single-host program. Call it before the parent process touches CUDA.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx {

struct LaunchResult {
  int num_failed = 0;
  std::vector<int> exit_codes;  // per rank: the body's return value, 128 + signal, or -1 if the launcher killed it
                                // (timeout_s, or grace_s after another rank failed)
  std::string summary;          // one line per failed rank
};

// Forks num_ranks children; child r runs body(bootstrap) with bootstrap.rank() == r and exits with its return
// value (an exception prints its message and exits 1). When a child fails the others are told to abort (their
// bootstrap calls throw) and are killed after grace_s; all are killed after timeout_s.
// Number of CUDA GPUs visible, counted in a child process so that this process stays free of CUDA (which
// launch_local needs: a process that initialised CUDA must not fork workers that use it). 0 if none.
int count_local_gpus();

LaunchResult launch_local(int num_ranks, const std::function<int(Bootstrap&)>& body, double timeout_s = 1800,
                          double grace_s = 30);

}  // namespace epx
