// How the low-latency kernels are launched.
//
// Default: cooperative. Blocks wait for one another (the dispatch's receivers for counts that other blocks send,
// the combine's reducers for other blocks' rows), so every block must be resident; the cooperative launch
// checks that the grid fits and starts it as one.
// LowLatencyLaunch::early (EPX_LL_EARLY_LAUNCH=1, read when the Buffer is created): programmatic dependent launch
// instead. The kernel may be launched while the kernel before it in the stream is still running, and its blocks take
// each SM as the earlier kernel's block there exits, instead of after the whole grid has ended and the next launch
// has gone through (faster for calls in a row, no change for single calls and graphs; docs/bench-notes.md). It needs
// the cooperative attribute dropped: with it the launch waited for the whole device as before and nothing changed.
// The grid stays one block per SM, so its blocks are resident together as soon as the SMs are free; what the
// attribute no longer guarantees is that they start together: a kernel of another stream that holds SMs delays our
// last blocks until it ends (our first ones wait for them inside their bounded waits), and a kernel that could only
// end after ours (one that waits for our output on the device) would deadlock until those waits time out. Hence
// opt-in. Either way every thread first waits for the earlier grids (wait_prior_grids: complete, their memory
// visible) and then lets the next one launch (allow_next_grid): reads and writes are ordered exactly as without the
// attribute, and a later kernel gets nothing of this one's results before its own wait. A driver that refuses the
// early launch gets the cooperative one (once refused, for the rest of the process).
// Launch graphs (runtime/launch_graphs.hpp): a cooperative launch that repeats an earlier one exactly goes through a
// one-node graph of the same kernel, attribute and parameters. Never while the stream is capturing (the user's
// graph gets the kernel itself) and never for early launches.
#include "runtime/low_latency_launch.hpp"

#include <atomic>

namespace epx {
namespace {

// Set once a driver refused the early launch: both kernels launch cooperatively from then on.
std::atomic<bool> early_launch_refused{false};

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. the legacy stream while another thread captures: treat as capturing
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// A one-node graph of the cooperative launch, instantiated; nullptr if any step fails. Building allocates: this
// thread's capture mode is relaxed meanwhile, so that another thread's capture (global mode) is not invalidated.
cudaGraphExec_t build_graph(const LowLatencyKernel& k, const void* params, const LowLatencyLaunch& launch) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) return nullptr;
  void* args[1] = {const_cast<void*>(params)};
  cudaKernelNodeParams node_params{};
  node_params.func = const_cast<void*>(k.func);
  node_params.gridDim = dim3(launch.grid);
  node_params.blockDim = dim3(k.threads);
  node_params.sharedMemBytes = unsigned(k.smem);
  node_params.kernelParams = args;
  cudaLaunchAttributeValue cooperative{};
  cooperative.cooperative = 1;
  cudaGraph_t graph = nullptr;
  cudaGraphNode_t node = nullptr;
  cudaGraphExec_t exec = nullptr;
  const bool ok = cudaGraphCreate(&graph, 0) == cudaSuccess &&
                  cudaGraphAddKernelNode(&node, graph, nullptr, 0, &node_params) == cudaSuccess &&
                  cudaGraphKernelNodeSetAttribute(node, cudaLaunchAttributeCooperative, &cooperative) == cudaSuccess &&
                  cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (ok) return exec;
  (void)cudaGetLastError();  // a graph that could not be built: not an error of the call
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  return nullptr;
}

// The launch through a graph where graphs has (or now builds) one; false: launch the kernel itself.
bool launch_through_graph(const LowLatencyKernel& k, const void* params, size_t params_bytes,
                          const LowLatencyLaunch& launch, LaunchGraphs& graphs, cudaStream_t stream) {
  if (!graphs.on() || stream_capturing(stream)) return false;
  const LaunchGraphs::Found found =
      graphs.find(LaunchGraphs::Key{k.func, launch.grid, k.threads, k.smem, params, params_bytes});
  if (found.step == LaunchGraphs::Step::kPlain) return false;
  if (found.step == LaunchGraphs::Step::kBuild) {
    graphs.built(found.entry, build_graph(k, params, launch));
    if (!graphs.on()) return false;
  }
  if (cudaGraphLaunch(graphs.exec(found.entry), stream) != cudaSuccess) {
    (void)cudaGetLastError();  // the kernel's own launch follows and reports what is wrong with the stream
    graphs.turn_off();
    return false;
  }
  graphs.launched();
  return true;
}

}  // namespace

void destroy_launch_graph(cudaGraphExec_t exec) { cudaGraphExecDestroy(exec); }

void launch_low_latency(const LowLatencyKernel& k, const void* params, size_t params_bytes,
                        const LowLatencyLaunch& launch, LaunchGraphs& graphs, cudaStream_t stream) {
  void* args[1] = {const_cast<void*>(params)};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(launch.grid);
  config.blockDim = dim3(k.threads);
  config.dynamicSmemBytes = k.smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  config.attrs = attr;
  config.numAttrs = 1;
  if (launch.early && !early_launch_refused.load(std::memory_order_relaxed)) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    if (cudaLaunchKernelExC(&config, k.func, args) == cudaSuccess) return;
    (void)cudaGetLastError();  // a launch that never started: not a sticky error
    early_launch_refused.store(true, std::memory_order_relaxed);
  }
  if (launch_through_graph(k, params, params_bytes, launch, graphs, stream)) return;
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchKernelExC(&config, k.func, args);
}

}  // namespace epx
