// The size hints and config helpers check their arguments with the operations' own checks (runtime/validate.hpp,
// runtime/domains.hpp, validate_config / validate_internode_config): whatever an operation or Buffer creation would
// refuse, the hint for it refuses too, with the same kind of message, and what they accept it sizes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <functional>
#include <string>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "layout/ll_layout.hpp"
#include "runtime/config.hpp"
#include "runtime/domains.hpp"
#include "runtime/validate.hpp"
#include "test_helpers.hpp"

using ::testing::HasSubstr;

namespace {

using epx_test::invalid_argument_message;

// Whether the low-latency calls of a buffer of R ranks take this shape: the check validate_shape runs first.
bool ll_ops_take(int R, int M, int H, int E) {
  try {
    epx::validate_low_latency_shape(R, M, H, E, "low_latency_dispatch");
    return true;
  } catch (const epx::Error&) {
    return false;
  }
}

}  // namespace

TEST(SizeHints, LowLatencyHintTakesExactlyWhatTheCallsTake) {
  const epx::Limits l = epx::limits();
  for (int R : {-1, 0, 1, 2, 3, 4, 8, 9, 16})
    for (int M : {0, 1, 128, l.ll_max_tokens, l.ll_max_tokens + 1})
      for (int H : {-8, 0, 4, 7000, 7004, 7168, l.max_hidden, l.max_hidden + 8})
        for (int E : {0, 24, 100, 288, l.ll_max_experts, l.ll_max_experts + 8}) {
          int64_t bytes = -1;
          const epx_status s = epx_ll_size_hint(M, H, R, E, &bytes);
          EXPECT_EQ(s == EPX_OK, ll_ops_take(R, M, H, E))
              << M << " " << H << " " << R << " " << E << ": " << epx_last_error();
          if (s != EPX_OK) {
            EXPECT_THAT(epx_last_error(), HasSubstr("low_latency_size_hint"));
          } else {  // a buffer of that size takes the shape
            EXPECT_TRUE(epx::LowLatencyLayout::make(bytes / 2, M, H, E).fits())
                << M << " " << H << " " << R << " " << E;
          }
        }
}

TEST(SizeHints, LowLatencyHintRefusesWhatItUsedToSize) {
  int64_t bytes = -1;
  // More ranks than one NVLink domain: the calls refuse them, so the hint does (it sized 9 and 16 ranks before).
  for (int R : {9, 16, 128}) {
    EXPECT_EQ(epx_ll_size_hint(128, 7168, R, 288 / 8 * R, &bytes), EPX_ERR_INVALID_ARGUMENT) << R;
    EXPECT_THAT(epx_last_error(), HasSubstr("num_ranks = " + std::to_string(R)));
  }
  // hidden 7000 is a BF16 shape the calls take (whole 16-byte vectors; FP8 calls need hidden % 128, which the call
  // says); 7004 is not.
  EXPECT_EQ(epx_ll_size_hint(128, 7000, 8, 288, &bytes), EPX_OK) << epx_last_error();
  EXPECT_EQ(epx_ll_size_hint(128, 7004, 8, 288, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(epx_last_error(), HasSubstr("hidden must be a multiple of 8"));
  EXPECT_EQ(epx_ll_size_hint(0, 7168, 8, 288, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(epx_last_error(), HasSubstr("num_max_dispatch_tokens_per_rank"));
  EXPECT_EQ(epx_ll_size_hint(128, 7168, 8, 100, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(epx_last_error(), HasSubstr("num_experts (100)"));
}

TEST(SizeHints, RowsAreHiddenSizesTheOperationsTake) {
  const epx::Config c = epx::default_dispatch_config(4);
  const int64_t max_row = 2 * int64_t(epx::limits().max_hidden);
  EXPECT_GT(epx::nvl_size_hint(c, max_row, 4), 0);
  EXPECT_GT(epx::internode_size_hints(c, max_row, 16, 8).rdma_bytes, 0);
  // Beyond the largest hidden (it was sized before, and 2^40 overflowed the combine row), odd, or not 16-byte rows.
  for (int64_t row : {max_row + 16, int64_t(1) << 40, INT64_MAX, int64_t(17), int64_t(24), int64_t(0), int64_t(-16)}) {
    EXPECT_THAT(invalid_argument_message([&] { epx::nvl_size_hint(c, row, 4); }), HasSubstr("hidden_bytes")) << row;
    EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, row, 16, 8); }), HasSubstr("hidden_bytes"))
        << row;
  }
  // The rule is combine's (the strictest of the operations on a BF16 row).
  epx::CombineArgs a{};
  a.hidden = int(max_row / 2) + 8;
  EXPECT_THAT(invalid_argument_message([&] { epx::validate_combine_args(a, {}, 0, 0, "combine"); }),
              HasSubstr("hidden must be a multiple of 8"));
}

TEST(SizeHints, InternodeHintsCheckRanksAsBufferCreationDoes) {
  const epx::Config c = epx::default_dispatch_config(16);
  // num_nvl_ranks < 0 was taken as "the default"; Buffer creation refuses it now, and so does the hint.
  EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, 8192, 16, -1); }),
              HasSubstr("num_nvl_ranks must be >= 0"));
  EXPECT_THAT(invalid_argument_message([&] {
                epx::choose_domains({"a", "a"}, -1, false);
              }),
              HasSubstr("num_nvl_ranks must be >= 0"));
  for (int R : {0, -4, epx::limits().max_ranks + 1}) {
    EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, 8192, R, 0); }), HasSubstr("num_ranks"));
    EXPECT_THAT(invalid_argument_message([&] { epx::default_dispatch_config(R); }), HasSubstr("num_ranks"));
  }
  EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, 8192, 16, 3); }), HasSubstr("divide"));
  EXPECT_THAT(invalid_argument_message([&] {
                epx::choose_domains({"a", "a", "a", "a"}, 3, false);
              }),
              HasSubstr("divide"));
  EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, 8192, 16, 9); }), HasSubstr("at most 8"));
  EXPECT_THAT(invalid_argument_message([&] { epx::internode_size_hints(c, 8192, 12, 0); }), HasSubstr("divide"));

  // Through the C ABI: creation refuses a negative domain size before the all-gather and before any CUDA call.
  epx_bootstrap bs{0, 1, [](void*, const void* s, void* r, size_t n) { return std::memcpy(r, s, n), 0; }, nullptr};
  epx_buffer_options o{};
  o.num_nvl_ranks = -2;
  o.device = -1;
  epx_buffer* out = reinterpret_cast<epx_buffer*>(uintptr_t(0x10));
  EXPECT_EQ(epx_buffer_create(&bs, &o, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(epx_last_error(), HasSubstr("num_nvl_ranks must be >= 0"));
  EXPECT_EQ(out, nullptr);
}

TEST(SizeHints, ConfigChecksDoNotOverflow) {
  // 2 x num_max_rdma_send_tokens overflowed int, and a huge chunk passed as a small ring capacity.
  epx::Config c = epx::default_dispatch_config(16);
  for (int chunk : {1 << 30, INT_MAX, (1 << 30) + 7}) {
    c.num_max_rdma_send_tokens = chunk;
    EXPECT_THAT(invalid_argument_message([&] { epx::validate_internode_config(c, 8, 2); }),
                HasSubstr("num_max_rdma_recv_tokens"))
        << chunk;
    int64_t nvl = -1, rdma = -1;
    EXPECT_EQ(epx_config_internode_size_hints(&c, 8192, 16, 8, &nvl, &rdma), EPX_ERR_INVALID_ARGUMENT) << chunk;
  }
}

TEST(CApiEdges, DestroyNullClearsTheLastErrorAndFailedCreatesResetOut) {
  ASSERT_EQ(epx_get_limits(nullptr), EPX_ERR_INVALID_ARGUMENT);
  ASSERT_STRNE(epx_last_error(), "");
  EXPECT_EQ(epx_buffer_destroy(nullptr), EPX_OK);
  EXPECT_STREQ(epx_last_error(), "") << "a success leaves no message behind";
  // *out is NULL after every failed create, whichever argument was wrong (it kept its old value for NULL bootstrap or
  // options).
  epx_buffer_options o{};
  epx_buffer* out = reinterpret_cast<epx_buffer*>(uintptr_t(0x10));
  EXPECT_EQ(epx_buffer_create(nullptr, &o, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  out = reinterpret_cast<epx_buffer*>(uintptr_t(0x10));
  epx_bootstrap bs{0, 1, nullptr, nullptr};
  EXPECT_EQ(epx_buffer_create(&bs, nullptr, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
}

TEST(CApiEdges, ADtypeOutsideTheEnumIsRefusedWithoutUndefinedBehaviour) {
  // C and Python store any int in epx_dispatch_args.dtype; the check reads it as an int (UBSan: scripts/fuzz.sh).
  epx_dispatch_args a{};
  a.hidden = 4096;
  for (int v : {2, -1, 255, INT_MAX}) {
    std::memcpy(&a.dtype, &v, sizeof v);
    EXPECT_THAT(invalid_argument_message([&] { epx::validate_dispatch_args(a, 4, true, "dispatch"); }),
                HasSubstr("got " + std::to_string(v)));
  }
}
