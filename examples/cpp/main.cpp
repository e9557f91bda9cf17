// epx from C++: one process per local GPU (the built-in launcher), a Buffer over all of them (one NVLink domain),
// then the layout, dispatch and combine of random tokens. The "experts" return their input rows unchanged, so
// combine gives every token back multiplied by the number of ranks it went to, and the top-k weights unchanged;
// each rank checks both (bit for bit) and prints a line.
//   epx_example [NUM_GPUS]    (default: every local GPU)
// Exit status: 0 when every rank passed, or when this machine has no GPU (it says so); 1 on a failure; 2 on bad use.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "epx/launcher.hpp"

namespace {

constexpr int kTokens = 512;  // per rank
constexpr int kHidden = 4096;
constexpr int kTopk = 8;
constexpr int kExpertsPerRank = 8;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory for n elements of T, freed with the object.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) { cuda_check(cudaMalloc(&ptr_, (n > 0 ? n : 1) * sizeof(T)), "cudaMalloc"); }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    cuda_check(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  std::vector<T> download(size_t n) const {
    std::vector<T> host(n);
    cuda_check(cudaMemcpy(host.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  T* ptr_ = nullptr;
};

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int run_rank(epx::Bootstrap& bs) {
  const int rank = bs.rank(), R = bs.size();
  const int T = kTokens, H = kHidden, K = kTopk, E = kExpertsPerRank * R;
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  // Combine must run with the dispatch's num_sms: the two default configs agree on it.
  const epx::Config dispatch_config = epx::default_dispatch_config(R);
  const epx::Config combine_config = epx::default_combine_config(R);
  epx::BufferOptions options = epx::default_buffer_options();
  options.num_nvl_bytes = epx::nvl_size_hint(dispatch_config, int64_t(H) * 2, R);
  epx::Buffer buffer(bs, options);

  // Random inputs: every token picks K distinct experts of E, with weights in (0, 1); rows of bf16 in [-1, 1).
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  std::vector<int64_t> topk_idx(size_t(T) * K);
  std::vector<float> topk_weights(size_t(T) * K);
  std::vector<int64_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      std::swap(experts[k], experts[k + rng() % (E - k)]);
      topk_idx[size_t(t) * K + k] = experts[k];
      topk_weights[size_t(t) * K + k] = uniform(rng);
    }
  }
  std::vector<uint16_t> x(size_t(T) * H);
  for (uint16_t& v : x) v = float_to_bf16(2.f * uniform(rng) - 1.f);
  DeviceArray<int64_t> d_topk_idx(topk_idx);
  DeviceArray<float> d_topk_weights(topk_weights);
  DeviceArray<uint16_t> d_x(x);

  // Layout: tokens per rank and per expert, and which ranks each token goes to.
  DeviceArray<int> num_tokens_per_rank(R), num_tokens_per_expert(E);
  DeviceArray<uint8_t> is_token_in_rank(size_t(T) * R);
  buffer.get_dispatch_layout({d_topk_idx.get(), T, K, E},
                             {num_tokens_per_rank.get(), nullptr, num_tokens_per_expert.get(), is_token_in_rank.get()},
                             stream);

  // Dispatch step 1 (notify): the caller allocates the handle's arrays; the call returns the received count.
  const int C = epx::num_channels(dispatch_config);
  DeviceArray<int> rank_prefix(size_t(R) * R), channel_prefix(size_t(R) * C), recv_channel_prefix(size_t(R) * C);
  DeviceArray<int> send_head(size_t(T) * R);
  epx::DispatchHandle handle{};
  handle.rank_prefix_matrix = rank_prefix.get();
  handle.channel_prefix_matrix = channel_prefix.get();
  handle.recv_channel_prefix_matrix = recv_channel_prefix.get();
  handle.send_head = send_head.get();
  epx::DispatchArgs args{};
  args.x = d_x.get();
  args.dtype = EPX_BF16;
  args.num_tokens = T;
  args.hidden = H;
  args.topk_idx = d_topk_idx.get();
  args.topk_weights = d_topk_weights.get();
  args.num_topk = K;
  args.num_experts = E;
  args.num_tokens_per_rank = num_tokens_per_rank.get();
  args.num_tokens_per_expert = num_tokens_per_expert.get();
  args.is_token_in_rank = is_token_in_rank.get();
  const epx::DispatchCounts counts = buffer.notify_dispatch(args, dispatch_config, handle, stream);
  const int N = counts.num_recv_tokens;

  // Dispatch step 2 (data) into outputs of N rows.
  DeviceArray<int> recv_src_idx(N);
  DeviceArray<uint16_t> recv_x(size_t(N) * H);
  DeviceArray<int64_t> recv_topk_idx(size_t(N) * K);
  DeviceArray<float> recv_topk_weights(size_t(N) * K);
  handle.recv_src_idx = recv_src_idx.get();
  epx::DispatchOutputs outputs{};
  outputs.recv_x = recv_x.get();
  outputs.recv_topk_idx = recv_topk_idx.get();
  outputs.recv_topk_weights = recv_topk_weights.get();
  outputs.num_rows = N;
  buffer.dispatch(args, dispatch_config, handle, outputs, stream);

  // Combine the received rows as they are (identity experts), with the received weights.
  epx::CombineArgs combine_args{};
  combine_args.x = recv_x.get();
  combine_args.num_rows = N;
  combine_args.hidden = H;
  combine_args.topk_weights = recv_topk_weights.get();
  combine_args.num_topk = K;
  DeviceArray<uint16_t> combined_x(size_t(T) * H);
  DeviceArray<float> combined_weights(size_t(T) * K);
  buffer.combine(combine_args, combine_config, handle, {combined_x.get(), combined_weights.get()}, stream);
  buffer.check(stream);  // waits for the stream; throws what a kernel reported

  // Rows received: what every rank's layout says it sends here (exchanged through the bootstrap).
  const std::vector<int> per_rank = num_tokens_per_rank.download(R);
  std::vector<int> all_per_rank(size_t(R) * R);
  bs.all_gather(per_rank.data(), all_per_rank.data(), R * sizeof(int));
  int expected_rows = 0;
  for (int s = 0; s < R; ++s) expected_rows += all_per_rank[size_t(s) * R + rank];

  // combined_x[t] = x[t] summed once per destination rank, in float32 (exact here), rounded once to bf16;
  // the weights come back as sent (each slot's weight arrives at one rank, zeros elsewhere).
  const std::vector<uint8_t> in_rank = is_token_in_rank.download(size_t(T) * R);
  const std::vector<uint16_t> got_x = combined_x.download(size_t(T) * H);
  const std::vector<float> got_weights = combined_weights.download(size_t(T) * K);
  int bad_tokens = 0;
  for (int t = 0; t < T; ++t) {
    int copies = 0;
    for (int r = 0; r < R; ++r) copies += in_rank[size_t(t) * R + r] != 0;
    bool ok = std::memcmp(&got_weights[size_t(t) * K], &topk_weights[size_t(t) * K], K * sizeof(float)) == 0;
    for (int h = 0; h < H && ok; ++h)
      ok = got_x[size_t(t) * H + h] == float_to_bf16(bf16_to_float(x[size_t(t) * H + h]) * float(copies));
    bad_tokens += ok ? 0 : 1;
  }
  const bool pass = N == expected_rows && bad_tokens == 0;
  std::printf(
      "rank %d of %d: sent %d tokens (top-%d of %d experts), received %d rows (expected %d), combine: %d of %d "
      "tokens exact: %s\n",
      rank, R, T, K, E, N, expected_rows, T - bad_tokens, T, pass ? "PASS" : "FAIL");
  std::fflush(stdout);
  cudaStreamDestroy(stream);
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Counted in a child process: this process must not touch CUDA before the launcher forks the ranks.
  const int gpus = epx::count_local_gpus();
  if (gpus <= 0) {
    std::printf("epx_example: no CUDA GPU is visible on this machine (no GPU, or no driver); nothing to run\n");
    return 0;
  }
  const int num_ranks = argc > 1 ? std::atoi(argv[1]) : gpus;
  if (argc > 2 || num_ranks < 1 || num_ranks > gpus) {
    std::fprintf(stderr, "usage: %s [NUM_GPUS]  (1..%d on this machine)\n", argv[0], gpus);
    return 2;
  }
  const epx::LaunchResult result = epx::launch_local(num_ranks, run_rank, /*timeout_s=*/300);
  if (result.num_failed > 0) {
    std::fprintf(stderr, "epx_example: %d of %d ranks failed\n%s", result.num_failed, num_ranks,
                 result.summary.c_str());
    return 1;
  }
  std::printf("epx_example: all %d ranks passed\n", num_ranks);
  return 0;
}
