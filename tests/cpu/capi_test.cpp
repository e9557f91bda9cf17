// The C ABI on a machine without a GPU: every entry point must turn bad input into a status and a message
// (never a crash), and buffer creation must fail cleanly when there is no device.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <thread>

#include "epx/epx.h"
#include "epx/epx.hpp"
#include "epx/launcher.hpp"

using ::testing::AnyOf;
using ::testing::HasSubstr;

namespace {

std::string last_error() { return epx_last_error(); }

// Single-rank all-gather: copy send to recv.
int copy_allgather(void* ctx, const void* send, void* recv, size_t bytes) {
  ++*static_cast<int*>(ctx);
  std::memcpy(recv, send, bytes);
  return 0;
}

struct SingleRank {
  int calls = 0;
  epx_bootstrap bootstrap{0, 1, copy_allgather, &calls};
  epx_buffer_options options{};
  SingleRank() {
    options.num_nvl_bytes = 1 << 20;
    options.device = -1;
  }
};

// A pointer value that is not NULL, so that a test can see whether a failing create resets *out.
epx_buffer* const kGarbage = reinterpret_cast<epx_buffer*>(0x10);

}  // namespace

TEST(CApi, Version) { EXPECT_EQ(epx_version(), EPX_VERSION_MAJOR * 100 + EPX_VERSION_MINOR); }

TEST(CApi, EveryStatusHasItsOwnString) {
  const epx_status all[] = {EPX_OK,
                            EPX_ERR_INVALID_ARGUMENT,
                            EPX_ERR_BUFFER_TOO_SMALL,
                            EPX_ERR_CUDA,
                            EPX_ERR_TIMEOUT,
                            EPX_ERR_BOOTSTRAP,
                            EPX_ERR_NOT_SUPPORTED,
                            EPX_ERR_FAILED_STATE,
                            EPX_ERR_INTERNAL,
                            EPX_ERR_REMOTE};
  std::set<std::string> seen;
  for (epx_status s : all) {
    const char* text = epx_status_string(s);
    ASSERT_NE(text, nullptr) << s;
    EXPECT_GT(std::strlen(text), 0u) << s;
    seen.insert(text);
  }
  EXPECT_EQ(seen.size(), std::size(all));
  // A value no enumerator has (15 is still inside the enum's range) gets a string too, not a crash.
  const char* unknown = epx_status_string(static_cast<epx_status>(15));
  ASSERT_NE(unknown, nullptr);
  EXPECT_EQ(seen.count(unknown), 0u);
}

TEST(CApi, LastErrorIsSetOnFailureClearedOnSuccessAndPerThread) {
  epx_config c{};
  ASSERT_EQ(epx_default_dispatch_config(4, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("out"));
  ASSERT_EQ(epx_default_dispatch_config(4, &c), EPX_OK);
  EXPECT_EQ(last_error(), "");
  ASSERT_EQ(epx_default_dispatch_config(4, nullptr), EPX_ERR_INVALID_ARGUMENT);
  std::string other_thread = "unset";
  std::thread([&] { other_thread = epx_last_error(); }).join();
  EXPECT_EQ(other_thread, "");  // this thread's error is not another thread's
  EXPECT_THAT(last_error(), HasSubstr("out"));
}

TEST(CApi, CreateRejectsNullArguments) {
  SingleRank s;
  epx_buffer* out = kGarbage;
  EXPECT_EQ(epx_buffer_create(nullptr, &s.options, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("bootstrap"));
  EXPECT_EQ(epx_buffer_create(&s.bootstrap, nullptr, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("options"));
  EXPECT_EQ(epx_buffer_create(&s.bootstrap, &s.options, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("out"));
  s.bootstrap.allgather = nullptr;
  EXPECT_EQ(epx_buffer_create(&s.bootstrap, &s.options, &out), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("allgather"));
  EXPECT_EQ(out, nullptr);
}

// These are rejected before any CUDA call, so they give the same answer with or without a GPU.
TEST(CApi, CreateRejectsBadBootstrapAndOptions) {
  struct Case {
    const char* what;
    void (*defect)(SingleRank&);
    epx_status status;
  };
  const Case cases[] = {
      {"rank", [](SingleRank& s) { s.bootstrap.rank = 1; }, EPX_ERR_INVALID_ARGUMENT},
      {"rank", [](SingleRank& s) { s.bootstrap.rank = -1; }, EPX_ERR_INVALID_ARGUMENT},
      {"size", [](SingleRank& s) { s.bootstrap.size = 0; }, EPX_ERR_INVALID_ARGUMENT},
      {"num_nvl_ranks", [](SingleRank& s) { s.options.num_nvl_ranks = 3; }, EPX_ERR_INVALID_ARGUMENT},
      {"buffer sizes", [](SingleRank& s) { s.options.num_nvl_bytes = -1; }, EPX_ERR_INVALID_ARGUMENT},
  };
  for (const Case& c : cases) {
    SingleRank s;
    c.defect(s);
    epx_buffer* out = kGarbage;
    EXPECT_EQ(epx_buffer_create(&s.bootstrap, &s.options, &out), c.status) << c.what;
    EXPECT_THAT(last_error(), HasSubstr(c.what));
    EXPECT_EQ(out, nullptr) << c.what;
  }
}

TEST(CApi, CreateWithoutAGpuFailsCleanly) {
  // count_local_gpus() asks in a child process, so this process stays free of CUDA until the create below.
  if (epx::count_local_gpus() > 0) GTEST_SKIP() << "a GPU is visible; the GPU suite covers creation";
  SingleRank s;
  epx_buffer* out = kGarbage;
  const epx_status status = epx_buffer_create(&s.bootstrap, &s.options, &out);
  EXPECT_NE(status, EPX_OK);
  EXPECT_EQ(status, EPX_ERR_CUDA) << epx_status_string(status) << ": " << last_error();
  // Said in words (no GPU, no driver, or a driver too old), with the CUDA error's name kept for searching.
  EXPECT_THAT(last_error(), HasSubstr("NVIDIA"));
  EXPECT_THAT(last_error(), AnyOf(HasSubstr("cudaErrorInsufficientDriver"), HasSubstr("cudaErrorNoDevice")));
  EXPECT_EQ(out, nullptr);
}

TEST(CApi, NoDriverIsSaidInWords) {
  if (epx::count_local_gpus() > 0) GTEST_SKIP() << "a GPU is visible";
  int driver = -1;
  cudaDriverGetVersion(&driver);
  if (driver != 0) GTEST_SKIP() << "an NVIDIA driver is installed here (CUDA " << driver << ")";
  // The C++ API says the same as the C ABI: no driver, what epx needs, what works without it.
  SingleRank s;
  epx::CallbackBootstrap bootstrap(s.bootstrap);
  try {
    epx::Buffer buffer(bootstrap, s.options);
    ADD_FAILURE() << "a Buffer was created without a driver";
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.status(), epx::Status::kCuda);
    EXPECT_THAT(e.what(), HasSubstr("no NVIDIA GPU driver was found"));
    EXPECT_THAT(e.what(), HasSubstr("epx needs an NVIDIA GPU"));
    EXPECT_THAT(e.what(), HasSubstr("host-side API works"));
    EXPECT_THAT(e.what(), HasSubstr("cudaGetDeviceCount failed: cudaErrorInsufficientDriver"));
  }
  // The launcher's ranks report it the same way (the body's exception fails the rank).
  const epx::LaunchResult r = epx::launch_local(
      1,
      [](epx::Bootstrap& bs) {
        epx::Buffer buffer(bs, epx::default_buffer_options());
        return 0;
      },
      60, 5);
  EXPECT_EQ(r.num_failed, 1);
}

TEST(CApi, DestroyNullIsOk) { EXPECT_EQ(epx_buffer_destroy(nullptr), EPX_OK); }

TEST(CApi, EveryOperationRejectsANullBuffer) {
  // Well-formed argument structs, so that the NULL buffer is the only defect.
  epx_layout_args layout{};
  epx_layout_outputs layout_out{};
  epx_dispatch_args dargs{};
  epx_config config{24, 6, 256, 8, 128};
  epx_dispatch_handle handle{};
  epx_dispatch_counts counts{};
  epx_dispatch_outputs dout{};
  epx_combine_args cargs{};
  epx_combine_outputs combine_out{};
  int i = 0;
  const std::pair<const char*, epx_status> calls[] = {
      {"info", epx_buffer_info(nullptr, &i, &i, &i, &i)},
      {"set_timeout", epx_buffer_set_timeout(nullptr, 5.0)},
      {"check", epx_buffer_check(nullptr, nullptr)},
      {"layout", epx_get_dispatch_layout(nullptr, &layout, &layout_out, nullptr)},
      {"notify", epx_notify_dispatch(nullptr, &dargs, &config, &handle, &counts, nullptr)},
      {"dispatch_sized", epx_dispatch_sized(nullptr, &dargs, &config, &handle, &dout, &counts, nullptr)},
      {"dispatch", epx_dispatch(nullptr, &dargs, &config, &handle, &dout, nullptr)},
      {"dispatch_cached", epx_dispatch_cached(nullptr, &dargs, &config, &handle, &dout, nullptr)},
      {"combine", epx_combine(nullptr, &cargs, &config, &handle, &combine_out, nullptr)},
      {"region",
       [] {
         void* p = nullptr;
         int64_t n = 0;
         return epx_buffer_region(nullptr, EPX_REGION_NVL, &p, &n);
       }()},
  };
  for (const auto& [name, status] : calls) EXPECT_EQ(status, EPX_ERR_INVALID_ARGUMENT) << name;
  // Each call overwrote the message; the last one must name the culprit.
  EXPECT_THAT(last_error(), HasSubstr("buffer"));
  EXPECT_EQ(epx_combine(nullptr, nullptr, &config, &handle, &combine_out, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("args"));
}

TEST(CApi, BufferRegionRejectsBadArgumentsBeforeTheBuffer) {
  // The region and output checks come first: they answer the same with or without a buffer.
  void* p = reinterpret_cast<void*>(0x10);
  int64_t n = 42;
  EXPECT_EQ(epx_buffer_region(nullptr, EPX_REGION_RDMA, nullptr, &n), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("ptr"));
  EXPECT_EQ(epx_buffer_region(nullptr, EPX_REGION_RDMA, &p, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("bytes"));
  for (int which : {-1, 2, 7}) {
    p = reinterpret_cast<void*>(0x10);
    n = 42;
    EXPECT_EQ(epx_buffer_region(nullptr, which, &p, &n), EPX_ERR_INVALID_ARGUMENT) << which;
    EXPECT_THAT(last_error(), HasSubstr("EPX_REGION_NVL")) << which;
    EXPECT_THAT(last_error(), HasSubstr("got " + std::to_string(which))) << which;
    EXPECT_EQ(p, nullptr) << "a failed call must not leave a pointer behind";
    EXPECT_EQ(n, 0);
  }
  EXPECT_EQ(epx_buffer_region(nullptr, EPX_REGION_NVL, &p, &n), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("buffer"));
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(n, 0);
}

TEST(CApi, DefaultConfigs) {
  for (int r = 1; r <= 8; ++r) {
    epx_config d{}, c{};
    ASSERT_EQ(epx_default_dispatch_config(r, &d), EPX_OK) << last_error();
    ASSERT_EQ(epx_default_combine_config(r, &c), EPX_OK) << last_error();
    const epx::Config want_d = epx::default_dispatch_config(r), want_c = epx::default_combine_config(r);
    EXPECT_EQ(std::memcmp(&d, &want_d, sizeof d), 0) << r;
    EXPECT_EQ(std::memcmp(&c, &want_c, sizeof c), 0) << r;
    EXPECT_NO_THROW(epx::validate_config(d, r));
  }
  epx_config c{};
  EXPECT_EQ(epx_default_combine_config(2, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("out"));
  for (int r : {0, epx::limits().max_ranks + 1}) {
    EXPECT_EQ(epx_default_dispatch_config(r, &c), EPX_ERR_INVALID_ARGUMENT) << r;
    EXPECT_THAT(last_error(), HasSubstr("num_ranks"));
    EXPECT_EQ(epx_default_combine_config(r, &c), EPX_ERR_INVALID_ARGUMENT) << r;
    EXPECT_THAT(last_error(), HasSubstr("num_ranks"));
  }
}

TEST(CApi, NvlSizeHint) {
  epx_config c{};
  ASSERT_EQ(epx_default_dispatch_config(4, &c), EPX_OK);
  int64_t bytes = -1;
  ASSERT_EQ(epx_config_nvl_size_hint(&c, 7168 * 2, 4, &bytes), EPX_OK) << last_error();
  EXPECT_EQ(bytes, epx::nvl_size_hint(c, 7168 * 2, 4));
  EXPECT_GT(bytes, 0);

  EXPECT_EQ(epx_config_nvl_size_hint(nullptr, 7168 * 2, 4, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("config"));
  EXPECT_EQ(epx_config_nvl_size_hint(&c, 7168 * 2, 4, nullptr), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("bytes"));
  EXPECT_EQ(epx_config_nvl_size_hint(&c, 100, 4, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("hidden_bytes"));
  EXPECT_EQ(epx_config_nvl_size_hint(&c, 7168 * 2, 9, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("ranks"));
  epx_config bad = c;
  bad.num_sms = 7;
  EXPECT_EQ(epx_config_nvl_size_hint(&bad, 7168 * 2, 4, &bytes), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(last_error(), HasSubstr("num_sms"));
}
