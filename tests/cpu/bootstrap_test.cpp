// The local launcher and its shared-memory bootstrap. Children are forked copies of this test process: they
// must not use gtest assertions (their output is lost and their failures would not count), so a child reports
// through its exit code and the parent asserts on LaunchResult. Nothing here touches CUDA.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/launcher.hpp"
#include "gen.hpp"

using ::testing::HasSubstr;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Byte i of what `rank` sends in gather number `salt`: a hash, so that a byte from the wrong rank, offset or
// round (slots are reused every 64 KiB) is caught.
uint8_t pattern(int rank, size_t i, int salt) { return uint8_t(epx::harness::mix(uint64_t(salt), uint64_t(rank), i)); }

// Child side: gathers `bytes` from every rank and checks what arrived.
bool gather_is_right(epx::Bootstrap& bs, size_t bytes, int salt) {
  std::vector<uint8_t> send(bytes + 1), recv(bytes * size_t(bs.size()) + 1, 0xa5);
  for (size_t i = 0; i < bytes; ++i) send[i] = pattern(bs.rank(), i, salt);
  bs.all_gather(send.data(), recv.data(), bytes);
  for (int r = 0; r < bs.size(); ++r)
    for (size_t i = 0; i < bytes; ++i)
      if (recv[size_t(r) * bytes + i] != pattern(r, i, salt)) return false;
  return recv.back() == 0xa5;  // nothing written past size * bytes (the whole buffer for a 0-byte gather)
}

// A page of memory shared by the parent and every child (inherited across fork).
template <typename T>
T* shared_object() {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("mmap failed");
  return new (mem) T{};
}

class Launch : public ::testing::TestWithParam<int> {};
class LaunchSeveral : public ::testing::TestWithParam<int> {};  // needs a rank left to wait for another

std::string rank_count_name(const ::testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; }

}  // namespace

TEST(LaunchLocal, RejectsBadRankCount) {
  EXPECT_THROW(epx::launch_local(0, [](epx::Bootstrap&) { return 0; }), epx::Error);
}

TEST_P(Launch, RanksAndSizeAreDistinctAndRight) {
  const int R = GetParam();
  const epx::LaunchResult res = epx::launch_local(
      R,
      [R](epx::Bootstrap& bs) {
        if (bs.size() != R) return 2;
        std::vector<int> ranks(size_t(R), -1);
        const int mine = bs.rank();
        bs.all_gather(&mine, ranks.data(), sizeof mine);
        for (int r = 0; r < R; ++r)
          if (ranks[r] != r) return 3;
        return 0;
      },
      60, 10);
  EXPECT_EQ(res.num_failed, 0) << res.summary;
  EXPECT_EQ(res.exit_codes, std::vector<int>(size_t(R), 0));
}

TEST_P(Launch, AllGatherMovesEveryRanksBytes) {
  const int R = GetParam();
  // 0 bytes; small; exactly one 64 KiB slot; one byte more (two rounds); several rounds with a partial last.
  static const size_t kSizes[] = {0, 1, 13, 4096, 65536, 65537, 150000};
  const epx::LaunchResult res = epx::launch_local(
      R,
      [](epx::Bootstrap& bs) {
        int salt = 0;
        for (size_t bytes : kSizes) {
          if (!gather_is_right(bs, bytes, salt)) return 10 + salt;  // the exit code says which size failed
          ++salt;
        }
        return 0;
      },
      60, 10);
  EXPECT_EQ(res.num_failed, 0) << res.summary << "(exit code 10 + i: size index i was wrong)";
}

TEST_P(Launch, BarrierHoldsEveryRankUntilAllArrive) {
  const int R = GetParam();
  auto* arrived = shared_object<std::atomic<int>>();
  const epx::LaunchResult res = epx::launch_local(
      R,
      [R, arrived](epx::Bootstrap& bs) {
        for (int round = 0; round < 8; ++round) {
          // One rank per round is late: a barrier that lets anyone through early sees a short count.
          if (bs.rank() == round % R) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          arrived->fetch_add(1);
          bs.barrier();
          if (arrived->load() != (round + 1) * R) return 20 + round;
          bs.barrier();  // nobody starts the next round before everyone checked this one
        }
        return 0;
      },
      60, 10);
  EXPECT_EQ(res.num_failed, 0) << res.summary;
  EXPECT_EQ(arrived->load(), 8 * R);
  munmap(arrived, 4096);
}

TEST_P(Launch, ExitCodesArePerRank) {
  const int R = GetParam();
  const epx::LaunchResult res = epx::launch_local(
      R, [R](epx::Bootstrap& bs) { return bs.size() == R ? bs.rank() : 99; }, 60, 10);
  std::vector<int> want(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) want[r] = r;
  EXPECT_EQ(res.exit_codes, want);
  EXPECT_EQ(res.num_failed, R - 1);  // rank 0 returned 0
  for (int r = 1; r < R; ++r) EXPECT_THAT(res.summary, HasSubstr("rank " + std::to_string(r) + ": exit code "));
}

TEST_P(Launch, OneRankReturnsThree) {
  const int R = GetParam();
  const epx::LaunchResult res = epx::launch_local(
      R,
      [R](epx::Bootstrap& bs) {
        bs.barrier();  // everyone is past its last bootstrap call before the failure
        return bs.rank() == R - 1 ? 3 : 0;
      },
      60, 10);
  EXPECT_EQ(res.num_failed, 1) << res.summary;
  EXPECT_EQ(res.exit_codes[R - 1], 3);
  EXPECT_THAT(res.summary, HasSubstr("rank " + std::to_string(R - 1) + ": exit code 3"));
}

TEST_P(Launch, AThrowingRankExitsWithOne) {
  const int R = GetParam();
  const epx::LaunchResult res = epx::launch_local(
      R,
      [R](epx::Bootstrap& bs) -> int {
        bs.barrier();
        if (bs.rank() == R - 1) throw std::runtime_error("deliberate failure of the last rank");
        if (R > 1 && bs.rank() == 0) throw epx::Error(epx::Status::kInternal, "deliberate epx::Error");
        return 0;
      },
      60, 10);
  EXPECT_EQ(res.exit_codes[R - 1], 1);
  EXPECT_EQ(res.exit_codes[0], 1);
  EXPECT_EQ(res.num_failed, R > 1 ? 2 : 1) << res.summary;
}

TEST_P(LaunchSeveral, AnEarlyFailureAbortsTheOthersBootstrapCalls) {
  const int R = GetParam();
  const auto start = Clock::now();
  // Rank 0 fails before its first all-gather; the others would wait for it forever. A generous grace and
  // timeout show that they leave because their bootstrap calls throw, not because they are killed.
  const epx::LaunchResult res = epx::launch_local(
      R,
      [](epx::Bootstrap& bs) -> int {
        if (bs.rank() == 0) return 5;
        try {
          for (;;) bs.barrier();
        } catch (const epx::Error& e) {
          return e.status() == epx::Status::kBootstrap ? 42 : 43;
        }
      },
      20, 10);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_EQ(res.exit_codes[0], 5);
  for (int r = 1; r < R; ++r) EXPECT_EQ(res.exit_codes[r], 42) << "rank " << r << "\n" << res.summary;
  EXPECT_EQ(res.num_failed, R);
}

TEST_P(Launch, AHangingRankIsKilledAfterTheTimeout) {
  const int R = GetParam();
  const auto start = Clock::now();
  const epx::LaunchResult res = epx::launch_local(
      R,
      [R](epx::Bootstrap& bs) {
        if (bs.rank() == R - 1) std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      },
      2, 1);
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 2.0);
  EXPECT_LT(elapsed, 5.0);
  EXPECT_EQ(res.exit_codes[R - 1], -1);  // killed by the launcher
  for (int r = 0; r < R - 1; ++r) EXPECT_EQ(res.exit_codes[r], 0) << r;
  EXPECT_EQ(res.num_failed, 1) << res.summary;
  EXPECT_THAT(res.summary, HasSubstr("rank " + std::to_string(R - 1) + ": killed after the launch timeout"));
}

INSTANTIATE_TEST_SUITE_P(Ranks, Launch, ::testing::Values(1, 2, 4, 8), rank_count_name);
INSTANTIATE_TEST_SUITE_P(Ranks, LaunchSeveral, ::testing::Values(2, 4, 8), rank_count_name);

// Rank 0 fails, rank 1 ignores the abort (it makes no bootstrap call): it is killed grace_s later, long
// before the launch timeout.
TEST(LaunchLocal, ARankIgnoringTheAbortIsKilledAfterGrace) {
  const auto start = Clock::now();
  const epx::LaunchResult res = epx::launch_local(
      2,
      [](epx::Bootstrap& bs) {
        if (bs.rank() == 0) return 7;
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      },
      30, 1);
  EXPECT_LT(seconds_since(start), 4.0);
  EXPECT_EQ(res.exit_codes, (std::vector<int>{7, -1}));
  EXPECT_THAT(res.summary, HasSubstr("rank 1: killed 1 s after another rank failed"));
}

// Ranks blocked in a barrier on a rank that hangs: nobody is left running past the timeout.
TEST(LaunchLocal, WaitersOfAHangingRankDoNotOutliveTheTimeout) {
  const auto start = Clock::now();
  const epx::LaunchResult res = epx::launch_local(
      4,
      [](epx::Bootstrap& bs) {
        if (bs.rank() == 2) std::this_thread::sleep_for(std::chrono::seconds(60));
        bs.barrier();
        return 0;
      },
      2, 1);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_EQ(res.num_failed, 4) << res.summary;
  for (int code : res.exit_codes) EXPECT_NE(code, 0);
}

TEST(LaunchLocal, ASignalIsReportedAs128PlusSignal) {
  const epx::LaunchResult res = epx::launch_local(
      2,
      [](epx::Bootstrap& bs) {
        bs.barrier();
        if (bs.rank() == 1) kill(getpid(), SIGTERM);
        return 0;
      },
      30, 5);
  EXPECT_EQ(res.exit_codes, (std::vector<int>{0, 128 + SIGTERM}));
  EXPECT_THAT(res.summary, HasSubstr("rank 1: killed by signal 15"));
}
