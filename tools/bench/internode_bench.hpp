// `epx-bench internode`: one process per local GPU, the GPUs split into D NVLink domains of G = N / D (D = 1:
// the internode kernels forced inside one domain). Checks BF16, FP8 and cached dispatch and both combine orders
// against the reference model, then times them per --sms value, and an NCCL all-to-all moving the same rows, and
// prints per-rank bandwidth tables on rank 0, with the bandwidth of the bytes that crossed the network hop.
#pragma once

namespace epx::bench {

// Exit codes: 0 done, 1 a check or a rank failed, or this libepx has no NVSHMEM; 2 bad command line; 3 not
// enough GPUs here to benchmark.
int run_internode(int argc, char** argv);

}  // namespace epx::bench
