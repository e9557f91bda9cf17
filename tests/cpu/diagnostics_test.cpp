// The messages of the kernels' timeout diagnostics (runtime/diagnostics.cpp): every role that waits on one peer
// names that peer, the intranode combine coordinator names the rank whose data has not arrived, and an abort names
// the rank that failed first.
#include "runtime/diagnostics.hpp"

#include <gtest/gtest.h>

#include <string>

#include "layout/host_shared.hpp"

namespace {

epx::DeviceDiag diag(int role, int peer, int64_t a, int64_t b, int64_t c) {
  epx::DeviceDiag d{};
  d.code = epx::kErrTimeout;
  d.rank = 0;
  d.role = role;
  d.channel = 7;
  d.peer = peer;
  d.a = a;
  d.b = b;
  d.c = c;
  return d;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Diagnostics, EveryTimeoutSaysWhoWaitedWhereAndForHowLong) {
  for (int role = epx::kRoleLayout; role <= epx::kRoleCombineNetReceiverCoordinator; ++role) {
    const std::string m = epx::describe_fatal(diag(role, 3, 14, 15, 269), 2.0);
    SCOPED_TRACE(m);
    EXPECT_TRUE(contains(m, "rank 0 ")) << "the rank that timed out";
    EXPECT_TRUE(contains(m, epx::role_name(role))) << "its role";
    EXPECT_TRUE(contains(m, "timed out after 2 s on channel 7"));
    EXPECT_TRUE(contains(m, " 3")) << "the peer, domain or stream it waited on";
  }
}

TEST(Diagnostics, ADataKernelBlockThatNeverStartedNamesItself) {
  // A block waiting for its own block 0 (kernels/intranode/epoch_barrier.cuh) waits on no peer: it names the block.
  const std::string m = epx::describe_fatal(diag(epx::kRoleDataStart, -1, 0, 1, 5), 2.0);
  EXPECT_TRUE(contains(m, "rank 0 ")) << m;
  EXPECT_TRUE(contains(m, epx::role_name(epx::kRoleDataStart))) << m;
  EXPECT_TRUE(contains(m, "timed out after 2 s on channel 7")) << m;
  EXPECT_TRUE(contains(m, "block 5 waited for block 0")) << m;
}

TEST(Diagnostics, AWaitOfNoChannelNamesNone) {
  // The notify's and the epoch barrier's waits record channel -1: the message leaves the channel out.
  epx::DeviceDiag d = diag(epx::kRoleNotify, 1, 1, 2, 0);
  d.channel = -1;
  const std::string m = epx::describe_fatal(d, 30.0);
  EXPECT_TRUE(contains(m, "timed out after 30 s, waiting for rank 1 to reach the same operation")) << m;
  EXPECT_FALSE(contains(m, "channel")) << m;
  EXPECT_TRUE(contains(m, "later than the timeout")) << "a late rank looks like a missing one: " << m;
}

TEST(Diagnostics, IntranodeWaitsNameThePeerRank) {
  for (int role : {epx::kRoleNotify, epx::kRoleDispatchSender, epx::kRoleDispatchReceiver, epx::kRoleCombineSender,
                   epx::kRoleCombineReceiver, epx::kRoleLowLatencyRecv, epx::kRoleLowLatencyCombineRecv}) {
    const std::string m = epx::describe_fatal(diag(role, 1, 14, 15, 269), 2.0);
    EXPECT_TRUE(contains(m, "rank 1")) << m;
  }
}

TEST(Diagnostics, CombineCoordinatorNamesTheRankWhoseDataIsMissing) {
  // a records of rank 1's stream arrived, the reducers need record b next, the stream has c: data is missing.
  const std::string missing = epx::describe_fatal(diag(epx::kRoleCombineCoordinator, 1, 16, 16, 20), 2.0);
  EXPECT_TRUE(contains(missing, "reducers waiting for data from rank 1: 16 of 20 records arrived, needed > 16"))
      << missing;
  // Every record arrived (a > b): the reducers, not the peer, are behind.
  const std::string behind = epx::describe_fatal(diag(epx::kRoleCombineCoordinator, 0, 20, 15, 20), 2.0);
  EXPECT_TRUE(contains(behind, "reducers did not finish: head of rank 0 at 15 of 20 (20 records arrived)")) << behind;
}

TEST(Diagnostics, AnAbortNamesTheRankThatFailedFirst) {
  epx::DeviceDiag d = diag(epx::kRoleCombineReceiver, 1, 1, 0, 0);
  d.code = epx::kErrAbortedByPeer;
  const std::string m = epx::describe_fatal(d, 2.0);
  EXPECT_TRUE(contains(m, "stopped because rank 1 failed a wait first")) << m;
}

}  // namespace
