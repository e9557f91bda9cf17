// Launch graphs of the low-latency kernels. A call whose launch repeats an earlier one exactly (the same kernel,
// grid, block, shared memory and parameter bytes: a decoding loop's calls on the same tensors, the buffer sets
// alternating) is launched as a one-node CUDA graph instantiated for that launch. On an idle GPU such a launch
// reaches the kernel several microseconds sooner than the kernel's own launch (docs/bench-notes.md, "Where a
// single call's time goes"). This class is the bookkeeping only (which launches were seen, which have a graph); the
// CUDA calls that build and launch the graphs are in runtime/low_latency_launch.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace epx {

class LaunchGraphs {
 public:
  static constexpr int kEntries = 8;     // launches remembered, the least recently used replaced first
  static constexpr int kMaxBuilds = 64;  // graphs a Buffer instantiates at most; later new launches stay plain
  using Exec = cudaGraphExec_t;
  using Destroy = void (*)(Exec);

  // One launch: everything that makes two launches the same.
  struct Key {
    const void* func;
    int grid, threads;
    size_t smem;
    const void* params;
    size_t params_bytes;
  };
  enum class Step {
    kPlain,   // launch the kernel itself (a launch not seen before, or no graphs)
    kBuild,   // seen once before: build its graph (then built()), launch that
    kLaunch,  // its graph exists: exec(entry)
  };
  struct Found {
    Step step;
    int entry;
  };

  // destroy: how a graph is freed (cudaGraphExecDestroy; tests pass their own).
  explicit LaunchGraphs(Destroy destroy);
  ~LaunchGraphs();
  LaunchGraphs(const LaunchGraphs&) = delete;
  LaunchGraphs& operator=(const LaunchGraphs&) = delete;

  // What to do for this launch; remembers it (replacing the least recently used entry) when it is new.
  Found find(const Key& k);
  // The graph of entry `entry` after kBuild; nullptr when building failed, which turns graphs off.
  void built(int entry, Exec exec);
  Exec exec(int entry) const { return entries_[entry].exec; }
  void launched() { ++graph_launches_; }
  // No more graphs (a build or graph launch failed, or EPX_LL_GRAPH_LAUNCH=0): every launch is plain from now on.
  void turn_off();
  bool on() const { return on_; }
  // Frees every graph (Buffer::destroy, while the context is alive).
  void clear();
  uint64_t graph_launches() const { return graph_launches_; }
  int builds() const { return builds_; }

 private:
  struct Entry {
    const void* func = nullptr;
    int grid = 0, threads = 0;
    size_t smem = 0;
    std::vector<uint8_t> params;
    Exec exec = nullptr;
    uint64_t last_use = 0;  // 0: empty
  };
  bool matches(const Entry& e, const Key& k) const;
  void free_graph(Entry& e);

  Destroy destroy_;
  Entry entries_[kEntries];
  uint64_t clock_ = 0;
  uint64_t graph_launches_ = 0;
  int builds_ = 0;
  bool on_ = true;
};

}  // namespace epx
