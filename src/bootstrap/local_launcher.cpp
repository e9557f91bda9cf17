// launch_local: fork one child per rank; an anonymous shared mapping carries the all-gather.
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "epx/launcher.hpp"
#include "runtime/errors.hpp"

namespace epx {
namespace {

constexpr size_t kSlotBytes = 1 << 16;  // an all-gather moves at most this much per rank per round

struct ShmHeader {
  std::atomic<int> arrived;
  std::atomic<int> generation;
  std::atomic<int> abort;  // set by the parent when a child failed
};
static_assert(std::atomic<int>::is_always_lock_free, "process-shared atomics must be lock-free");

class ShmBootstrap : public Bootstrap {
 public:
  ShmBootstrap(ShmHeader* header, uint8_t* slots, int rank, int size, double timeout_s)
      : h_(header), slots_(slots), rank_(rank), size_(size), timeout_s_(timeout_s) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);
    const size_t rounds = bytes == 0 ? 1 : (bytes + kSlotBytes - 1) / kSlotBytes;
    for (size_t k = 0; k < rounds; ++k) {
      const size_t off = k * kSlotBytes;
      const size_t n = bytes - off < kSlotBytes ? bytes - off : kSlotBytes;
      std::memcpy(slots_ + size_t(rank_) * kSlotBytes, in + off, n);
      sync();
      for (int r = 0; r < size_; ++r) std::memcpy(out + size_t(r) * bytes + off, slots_ + size_t(r) * kSlotBytes, n);
      sync();
    }
  }

 private:
  void sync() {
    const int gen = h_->generation.load();
    if (h_->arrived.fetch_add(1) + 1 == size_) {
      h_->arrived.store(0);
      h_->generation.fetch_add(1);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t spin = 0; h_->generation.load() == gen; ++spin) {
      if (h_->abort.load()) raise(Status::kBootstrap, "rank ", rank_, ": another rank failed; aborting");
      if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      if ((spin & 255) == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s_)
        raise(Status::kBootstrap, "rank ", rank_, ": bootstrap barrier timed out after ", timeout_s_,
              " s (a rank did not arrive)");
    }
  }

  ShmHeader* h_;
  uint8_t* slots_;
  int rank_;
  int size_;
  double timeout_s_;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int count_local_gpus() {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 250 ? 250 : n);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

LaunchResult launch_local(int num_ranks, const std::function<int(Bootstrap&)>& body, double timeout_s, double grace_s) {
  EPX_REQUIRE(num_ranks >= 1 && num_ranks <= 1024, "launch_local: num_ranks must be in [1, 1024], got ", num_ranks);
  const size_t bytes = sizeof(ShmHeader) + 64 + size_t(num_ranks) * kSlotBytes;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) raise(Status::kBootstrap, "launch_local: mmap of ", bytes, " bytes failed");
  auto* header = new (mem) ShmHeader{};
  auto* slots = static_cast<uint8_t*>(mem) + sizeof(ShmHeader) + 64;

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(num_ranks, -1);
  for (int r = 0; r < num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      header->abort.store(1);
      for (int k = 0; k < r; ++k) kill(pids[k], SIGKILL);
      raise(Status::kBootstrap, "launch_local: fork failed for rank ", r);
    }
    if (pid == 0) {
      int code = 1;
      try {
        ShmBootstrap bs(header, slots, r, num_ranks, timeout_s);
        code = body(bs);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] error: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[r] = pid;
  }

  LaunchResult result;
  result.exit_codes.assign(num_ranks, -1);
  int running = num_ranks;
  const auto start = std::chrono::steady_clock::now();
  auto first_failure = start;
  bool failure_seen = false, terminated = false;
  std::vector<char> killed(num_ranks, 0);
  std::string kill_reason;
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < num_ranks; ++r) {
        if (pids[r] != pid) continue;
        // A rank this launcher killed reports -1 (the documented "killed on timeout"), not 128 + SIGKILL; one that
        // exited by itself just before the kill keeps its own status.
        const bool our_kill = killed[r] && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        const int code = our_kill ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        result.exit_codes[r] = code;
        pids[r] = -1;
        --running;
        if (code != 0 && !failure_seen) {
          failure_seen = true;
          first_failure = std::chrono::steady_clock::now();
          header->abort.store(1);
        }
      }
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const bool too_long = seconds_since(start) > timeout_s;
    const bool grace_over = failure_seen && seconds_since(first_failure) > grace_s;
    if ((too_long || grace_over) && !terminated) {
      terminated = true;
      header->abort.store(1);
      kill_reason = too_long ? cat("killed after the launch timeout of ", timeout_s, " s")
                             : cat("killed ", grace_s, " s after another rank failed");
      for (int r = 0; r < num_ranks; ++r)
        if (pids[r] > 0 && kill(pids[r], SIGKILL) == 0) killed[r] = 1;
    }
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (result.exit_codes[r] == 0) continue;
    ++result.num_failed;
    const int code = result.exit_codes[r];
    result.summary += cat("rank ", r, ": ",
                          code == -1    ? kill_reason
                          : code >= 128 ? cat("killed by signal ", code - 128)
                                        : cat("exit code ", code),
                          "\n");
  }
  munmap(mem, bytes);
  return result;
}

}  // namespace epx
