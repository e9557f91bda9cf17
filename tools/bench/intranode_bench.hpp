// `epx-bench intranode`: one process per local GPU. Checks BF16 and FP8 dispatch + combine against the reference
// model, then times dispatch (BF16, FP8), cached dispatch and combine over a sweep of configs, and an NCCL
// all-to-all moving the same rows, and prints per-rank bandwidth tables on rank 0.
#pragma once

namespace epx::bench {

// Exit codes: 0 done, 1 a check or a rank failed, 2 bad command line, 3 not enough GPUs here to benchmark.
int run_intranode(int argc, char** argv);
int run_low_latency(int argc, char** argv);

}  // namespace epx::bench
