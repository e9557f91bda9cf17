// LaunchGraphs (runtime/launch_graphs.hpp): which launches get a graph, and when graphs are freed. No GPU: the
// graphs are stand-in handles and "destroying" one records it.
#include "runtime/launch_graphs.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace epx {
namespace {

std::vector<uintptr_t> g_destroyed;
void record_destroy(LaunchGraphs::Exec exec) { g_destroyed.push_back(reinterpret_cast<uintptr_t>(exec)); }
LaunchGraphs::Exec handle(uintptr_t n) { return reinterpret_cast<LaunchGraphs::Exec>(n); }

struct Params {
  int set;
  int num_tokens;
  const void* x;
};

int g_kernel_a, g_kernel_b;  // addresses stand for kernels

LaunchGraphs::Key key_of(const Params& p, const void* func = &g_kernel_a, size_t smem = 0) {
  return LaunchGraphs::Key{func, 132, 1024, smem, &p, sizeof(p)};
}

class LaunchGraphsTest : public ::testing::Test {
 protected:
  void SetUp() override { g_destroyed.clear(); }
};

TEST_F(LaunchGraphsTest, SecondSightingBuildsThirdLaunches) {
  LaunchGraphs g(record_destroy);
  const Params p{0, 128, &g_kernel_b};
  EXPECT_EQ(g.find(key_of(p)).step, LaunchGraphs::Step::kPlain);
  const LaunchGraphs::Found second = g.find(key_of(p));
  ASSERT_EQ(second.step, LaunchGraphs::Step::kBuild);
  g.built(second.entry, handle(7));
  const LaunchGraphs::Found third = g.find(key_of(p));
  ASSERT_EQ(third.step, LaunchGraphs::Step::kLaunch);
  EXPECT_EQ(g.exec(third.entry), handle(7));
  EXPECT_EQ(g.builds(), 1);
  EXPECT_TRUE(g_destroyed.empty());
}

TEST_F(LaunchGraphsTest, AnyDifferenceIsAnotherLaunch) {
  LaunchGraphs g(record_destroy);
  const Params p{0, 128, &g_kernel_b};
  g.find(key_of(p));
  Params other_set = p;
  other_set.set = 1;
  EXPECT_EQ(g.find(key_of(other_set)).step, LaunchGraphs::Step::kPlain);
  EXPECT_EQ(g.find(key_of(p, &g_kernel_b)).step, LaunchGraphs::Step::kPlain);      // another kernel
  EXPECT_EQ(g.find(key_of(p, &g_kernel_a, 64)).step, LaunchGraphs::Step::kPlain);  // other shared memory
  LaunchGraphs::Key grid = key_of(p);
  grid.grid = 66;
  EXPECT_EQ(g.find(grid).step, LaunchGraphs::Step::kPlain);
  // The alternating sets of a decoding loop: both get their graph.
  EXPECT_EQ(g.find(key_of(p)).step, LaunchGraphs::Step::kBuild);
  EXPECT_EQ(g.find(key_of(other_set)).step, LaunchGraphs::Step::kBuild);
}

TEST_F(LaunchGraphsTest, LeastRecentlyUsedIsReplacedAndItsGraphFreed) {
  LaunchGraphs g(record_destroy);
  std::vector<Params> ps;
  for (int i = 0; i <= LaunchGraphs::kEntries; ++i) ps.push_back(Params{0, i, nullptr});
  // Entry of ps[0] gets a graph, then is the least recently used when the kEntries + 1-th launch comes.
  g.find(key_of(ps[0]));
  g.built(g.find(key_of(ps[0])).entry, handle(11));
  for (int i = 1; i < LaunchGraphs::kEntries; ++i) g.find(key_of(ps[i]));
  EXPECT_TRUE(g_destroyed.empty());
  g.find(key_of(ps[LaunchGraphs::kEntries]));
  ASSERT_EQ(g_destroyed.size(), 1u);
  EXPECT_EQ(g_destroyed[0], 11u);
  EXPECT_EQ(g.find(key_of(ps[0])).step, LaunchGraphs::Step::kPlain);  // forgotten
  EXPECT_EQ(g.find(key_of(ps[2])).step, LaunchGraphs::Step::kBuild);  // still remembered
}

TEST_F(LaunchGraphsTest, FailedBuildTurnsGraphsOffAndFreesThem) {
  LaunchGraphs g(record_destroy);
  const Params a{0, 1, nullptr}, b{1, 1, nullptr};
  g.find(key_of(a));
  g.built(g.find(key_of(a)).entry, handle(3));
  g.find(key_of(b));
  g.built(g.find(key_of(b)).entry, nullptr);
  EXPECT_FALSE(g.on());
  EXPECT_EQ(g_destroyed, std::vector<uintptr_t>{3});
  EXPECT_EQ(g.find(key_of(a)).step, LaunchGraphs::Step::kPlain);
}

TEST_F(LaunchGraphsTest, BuildsAreBounded) {
  LaunchGraphs g(record_destroy);
  for (int i = 0; i < LaunchGraphs::kMaxBuilds; ++i) {
    const Params p{0, i, nullptr};
    g.find(key_of(p));
    const LaunchGraphs::Found f = g.find(key_of(p));
    ASSERT_EQ(f.step, LaunchGraphs::Step::kBuild) << i;
    g.built(f.entry, handle(100 + i));
  }
  const Params late{0, -1, nullptr};
  g.find(key_of(late));
  EXPECT_EQ(g.find(key_of(late)).step, LaunchGraphs::Step::kPlain);
  EXPECT_TRUE(g.on());
  // Graphs built before the bound still launch.
  const Params last{0, LaunchGraphs::kMaxBuilds - 1, nullptr};
  EXPECT_EQ(g.find(key_of(last)).step, LaunchGraphs::Step::kLaunch);
}

TEST_F(LaunchGraphsTest, ClearAndDestructorFreeEveryGraph) {
  {
    LaunchGraphs g(record_destroy);
    const Params a{0, 1, nullptr}, b{1, 1, nullptr};
    for (const Params* p : {&a, &b}) {
      g.find(key_of(*p));
      g.built(g.find(key_of(*p)).entry, handle(p == &a ? 1 : 2));
    }
    g.clear();
    EXPECT_EQ(g_destroyed.size(), 2u);
    EXPECT_EQ(g.find(key_of(a)).step, LaunchGraphs::Step::kPlain);  // cleared: seen anew
    g.built(g.find(key_of(a)).entry, handle(5));
  }
  EXPECT_EQ(g_destroyed.size(), 3u);
  EXPECT_EQ(g_destroyed[2], 5u);
}

}  // namespace
}  // namespace epx
