// Kernels that hold a stream, so that the host can queue the timed operation behind them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::bench {

// Launches one thread that spins on %globaltimer for `us` microseconds (bounded: it ends by the clock).
cudaError_t launch_gate(cudaStream_t stream, int us);

// Launches an empty kernel the way the Buffer launches its low-latency kernels by default: cooperative, one block of
// 1024 threads per SM. Timed as a single call it is the floor of every single-call row: the host's launch and an
// idle GPU's start, with no work.
cudaError_t launch_empty_like_low_latency(cudaStream_t stream);

// A start line that every rank's GPU leaves at the same moment: one word in a host page shared by the ranks'
// processes (mapped before the launcher forks them) and mapped into each rank's GPU. Each rank holds its stream
// with a release gate that polls the word; rank 0's host writes it once every rank has had the time to queue
// its call. A gate that only ran for a fixed time started with its own host's launch, so the ranks' gates ended
// up to several us apart and the slowest start landed in every other rank's events.
struct ReleaseLine {
  uint32_t* word = nullptr;            // in the shared page (host address)
  const uint32_t* word_dev = nullptr;  // the same word, for this rank's GPU
  uint32_t* expired = nullptr;         // this rank's gates that ran out of time before a release (host-mapped)
  uint32_t* expired_dev = nullptr;
  bool leader = false;  // rank 0: the one that writes `word`
  uint32_t seq = 0;     // the last value this rank waited for; the same on every rank
};

// In the parent, before the ranks fork: one page every child shares (nullptr if mmap fails).
void* create_release_page();
void free_release_page(void* page);  // in the parent, after the ranks are done (nullptr: nothing)
// In each rank, after cudaSetDevice: maps the page for this GPU. False (and *line unusable) if CUDA refuses.
bool attach_release_line(void* page, bool leader, ReleaseLine* line);
void detach_release_line(ReleaseLine* line);

// One thread that spins until the shared word reaches `seq` (wrapping compare), at most max_us; a gate that runs
// out of time adds one to line.expired and lets the stream go.
cudaError_t launch_release_gate(cudaStream_t stream, const ReleaseLine& line, uint32_t seq, int max_us);
// The leader's host: lets every gate waiting for `seq` go. Only timing depends on it: the word publishes no data.
void release(ReleaseLine& line, uint32_t seq);

}  // namespace epx::bench
