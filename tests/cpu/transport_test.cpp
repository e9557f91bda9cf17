// The choice of the low-latency transport (runtime/transport.hpp) and what it relies on, without a GPU: the
// environment switches, the NVSHMEM heap size epx asks for, the staging room of the NVSHMEM path, the C ABI.
#include "runtime/transport.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "layout/ll_layout.hpp"

using epx::LowLatencyTransport;
using ::testing::HasSubstr;

namespace {

// Runs f, which must throw epx::Error with `status`; returns the message.
std::string error_of(epx::Status status, const std::function<void()>& f) {
  try {
    f();
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected epx::Error, nothing was thrown";
  return "";
}

epx::LowLatencyTransportChoice choose(bool region, bool built, const char* disable, const char* force) {
  return epx::choose_low_latency_transport(region, built, disable, force);
}

}  // namespace

TEST(Transport, SwitchesAreZeroOrOne) {
  EXPECT_FALSE(epx::parse_env_switch("X", nullptr));
  EXPECT_FALSE(epx::parse_env_switch("X", ""));
  EXPECT_FALSE(epx::parse_env_switch("X", "0"));
  EXPECT_TRUE(epx::parse_env_switch("X", "1"));
  for (const char* bad : {"yes", "true", "2", " 1", "1 ", "01"}) {
    const std::string msg =
        error_of(epx::Status::kInvalidArgument, [&] { epx::parse_env_switch("EPX_SOMETHING", bad); });
    EXPECT_THAT(msg, HasSubstr("EPX_SOMETHING")) << bad;
    EXPECT_THAT(msg, HasSubstr(std::string("'") + bad + "'"));
  }
}

TEST(Transport, WithoutNvshmemInTheBuildTheRegionStaysInTheIpcBuffer) {
  for (const char* disable : {static_cast<const char*>(nullptr), "0", "1"}) {
    const auto c = choose(true, false, disable, nullptr);
    EXPECT_EQ(c.transport, LowLatencyTransport::kCudaIpc);
    EXPECT_FALSE(c.force_nvshmem);
  }
  const std::string msg = error_of(epx::Status::kNotSupported, [] { choose(true, false, nullptr, "1"); });
  EXPECT_THAT(msg, HasSubstr("EPX_LL_FORCE_NVSHMEM"));
  EXPECT_THAT(msg, HasSubstr("without NVSHMEM"));
}

TEST(Transport, WithNvshmemInTheBuild) {
  auto c = choose(true, true, nullptr, nullptr);
  EXPECT_EQ(c.transport, LowLatencyTransport::kNvshmem);
  EXPECT_FALSE(c.force_nvshmem);
  c = choose(true, true, "0", "1");
  EXPECT_EQ(c.transport, LowLatencyTransport::kNvshmem);
  EXPECT_TRUE(c.force_nvshmem);
  c = choose(true, true, "1", "0");
  EXPECT_EQ(c.transport, LowLatencyTransport::kCudaIpc);
  EXPECT_FALSE(c.force_nvshmem);
}

TEST(Transport, ContradictoryOrMistypedSwitchesAreErrorsEvenWithoutARegion) {
  for (bool region : {false, true})
    for (bool built : {false, true}) {
      EXPECT_THAT(error_of(epx::Status::kInvalidArgument, [&] { choose(region, built, "1", "1"); }),
                  HasSubstr("contradict"));
      EXPECT_THAT(error_of(epx::Status::kInvalidArgument, [&] { choose(region, built, "on", nullptr); }),
                  HasSubstr("EPX_DISABLE_NVSHMEM"));
      EXPECT_THAT(error_of(epx::Status::kInvalidArgument, [&] { choose(region, built, nullptr, "yes"); }),
                  HasSubstr("EPX_LL_FORCE_NVSHMEM"));
    }
}

TEST(Transport, NoRegionNoTransport) {
  for (bool built : {false, true}) {
    EXPECT_EQ(choose(false, built, nullptr, nullptr).transport, LowLatencyTransport::kNone);
    EXPECT_EQ(choose(false, built, "1", nullptr).transport, LowLatencyTransport::kNone);
  }
  // Forcing NVSHMEM for a buffer without a low-latency region forces nothing (and is no error).
  EXPECT_EQ(choose(false, false, nullptr, "1").transport, LowLatencyTransport::kNone);
}

TEST(Transport, NvshmemHeapHoldsTheRegionWithRoomToSpare) {
  int64_t previous = 0;
  for (int64_t region :
       {int64_t(0), int64_t(1), int64_t(4096), int64_t(1) << 30, int64_t(2437) << 20, (int64_t(5) << 30) + 12345}) {
    const int64_t heap = epx::nvshmem_heap_bytes(region);
    EXPECT_GE(heap, region + (int64_t(512) << 20)) << region;
    EXPECT_EQ(heap % (int64_t(1) << 20), 0) << region;
    EXPECT_LT(heap, region + (int64_t(513) << 20)) << region;
    EXPECT_GE(heap, previous);
    previous = heap;
  }
  // What the GPU suite's buffer needs (M 128, hidden 8192, 288 experts; both sets) fits.
  const int64_t suite = epx::low_latency_size_hint(128, 8192, 4, 288);
  EXPECT_GE(epx::nvshmem_heap_bytes(suite), suite);
}

// The NVSHMEM path stages M dispatch records in the combine-send area of the set; with NVSHMEM peers there are
// at least two ranks, so at least two experts, and that always fits (Buffer checks it anyway).
TEST(Transport, DispatchStagingFitsTheCombineSendArea) {
  for (int experts : {2, 3, 8, 288, 1024})
    for (int hidden : {8, 128, 2048, 7168, 32768})
      for (int m : {1, 7, 128, 4096}) {
        const int64_t set = epx::LowLatencyLayout::required_set_bytes(m, hidden, experts);
        const auto layout = epx::LowLatencyLayout::make(set, m, hidden, experts);
        ASSERT_TRUE(layout.fits());
        for (bool fp8 : {false, true}) {
          if (fp8 && hidden % 128 != 0) continue;
          EXPECT_TRUE(layout.dispatch_stage_fits(m, epx::LowLatencyRecord::make(hidden, fp8).bytes))
              << experts << " experts, hidden " << hidden << ", M " << m << (fp8 ? " fp8" : " bf16");
        }
      }
  // Since v0.6 a BF16 record is exactly its row (no metadata), so even one expert fits; records of a larger
  // hidden than the layout's do not, and the check says so.
  const auto one = epx::LowLatencyLayout::make(epx::LowLatencyLayout::required_set_bytes(4, 1024, 1), 4, 1024, 1);
  EXPECT_TRUE(one.dispatch_stage_fits(4, epx::LowLatencyRecord::make(1024, false).bytes));
  EXPECT_FALSE(one.dispatch_stage_fits(4, epx::LowLatencyRecord::make(2048, false).bytes));
}

// Every signal array and epoch counter of a low-latency set lies inside the signals area (which clean zeroes and the
// receive area follows), and no two overlap: a flag added later cannot silently share bytes with another.
TEST(Transport, LowLatencySignalsAreDisjointInsideTheSignalsArea) {
  const auto layout =
      epx::LowLatencyLayout::make(epx::LowLatencyLayout::required_set_bytes(128, 7168, 288), 128, 7168, 288);
  for (int set : {0, 1}) {
    uint8_t* const region = reinterpret_cast<uint8_t*>(uintptr_t(1) << 20);  // never dereferenced
    const uint8_t* base = layout.set_base(region, set);
    EXPECT_EQ(base, region + set * layout.set_bytes);
    struct Range {
      const char* name;
      int64_t begin, end;
    };
    const int64_t n = int64_t(epx::kLowLatencyMaxExperts) * 4;
    auto at = [&](const char* name, const void* p) {
      const int64_t begin = static_cast<const uint8_t*>(p) - base;
      return Range{name, begin, begin + n};
    };
    const auto sized = [&](const char* name, const void* p, int64_t bytes) {
      const int64_t begin = static_cast<const uint8_t*>(p) - base;
      return Range{name, begin, begin + bytes};
    };
    const Range ranges[] = {at("dispatch_count", layout.dispatch_count(region, set)),
                            at("combine_arrived", layout.combine_arrived(region, set)),
                            at("combine_sent", layout.combine_sent(region, set)),
                            sized("combine_target", layout.combine_target(region, set), n * 2),
                            at("dispatch_arrived", layout.dispatch_arrived(region, set)),
                            sized("recv_seen", layout.recv_seen(region, set), epx::kMaxNvlRanks * 8),
                            sized("block_ops", layout.block_ops(region, set), epx::kLowLatencyMaxBlocks * 4),
                            sized("block_told", layout.block_told(region, set), epx::kLowLatencyMaxBlocks * 4)};
    for (const Range& a : ranges) {
      EXPECT_GE(a.begin, 0) << a.name;
      EXPECT_LE(a.end, epx::LowLatencyLayout::kSignalsBytes) << a.name;
      for (const Range& b : ranges) {
        if (&a != &b) {
          EXPECT_TRUE(a.end <= b.begin || b.end <= a.begin) << a.name << " overlaps " << b.name;
        }
      }
    }
    EXPECT_EQ(layout.receive(region, set) - base, epx::LowLatencyLayout::kSignalsBytes);
  }
}

TEST(Transport, DescriptionsSayWhichPathRan) {
  EXPECT_THAT(epx::describe_low_latency_transport({EPX_LL_TRANSPORT_NONE, 0, 0}), HasSubstr("none"));
  EXPECT_EQ(epx::describe_low_latency_transport({EPX_LL_TRANSPORT_CUDA_IPC, 4, 0}),
            "cuda-ipc: 4 ranks through peer pointers");
  EXPECT_EQ(epx::describe_low_latency_transport({EPX_LL_TRANSPORT_NVSHMEM, 1, 3}),
            "nvshmem: 1 rank through peer pointers, 3 through NVSHMEM puts");
  EXPECT_THAT(epx::describe_low_latency_transport({7, 0, 0}), HasSubstr("unknown"));
}

TEST(Transport, BuildFlagIsReported) {
  EXPECT_EQ(epx::built_with_nvshmem(), EPX_EXPECT_NVSHMEM != 0);
  EXPECT_EQ(epx_built_with_nvshmem(), EPX_EXPECT_NVSHMEM);
}

TEST(Transport, CApiRejectsNullArguments) {
  epx_ll_transport_info info{};
  EXPECT_EQ(epx_buffer_ll_transport(nullptr, &info), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(epx_last_error()), HasSubstr("buffer"));
}
