// Building and throwing epx::Error with readable messages.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "epx/epx.hpp"

namespace epx {

template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
[[noreturn]] void raise(Status status, Args&&... args) {
  throw Error(status, cat(std::forward<Args>(args)...));
}

// Argument check: throws kInvalidArgument with the message when cond is false.
#define EPX_REQUIRE(cond, ...)                                               \
  do {                                                                       \
    if (!(cond)) ::epx::raise(::epx::Status::kInvalidArgument, __VA_ARGS__); \
  } while (0)

}  // namespace epx
