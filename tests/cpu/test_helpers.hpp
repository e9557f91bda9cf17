// Small helpers the CPU tests share.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

#include "epx/epx.hpp"

namespace epx_test {

// Runs f, which must throw epx::Error with kInvalidArgument; returns the message ("" when it did not throw).
inline std::string invalid_argument_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.status(), epx::Status::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected epx::Error(kInvalidArgument), nothing was thrown";
  return "";
}

// The float whose bits are u.
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace epx_test
