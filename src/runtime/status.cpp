#include "epx/epx.hpp"

namespace epx {

const char* status_string(Status status) {
  switch (status) {
    case Status::kOk:
      return "ok";
    case Status::kInvalidArgument:
      return "invalid argument";
    case Status::kBufferTooSmall:
      return "buffer too small";
    case Status::kCuda:
      return "CUDA error";
    case Status::kTimeout:
      return "timeout";
    case Status::kBootstrap:
      return "bootstrap error";
    case Status::kNotSupported:
      return "not supported";
    case Status::kFailedState:
      return "buffer unusable after an earlier failure";
    case Status::kInternal:
      return "internal error";
    case Status::kRemote:
      return "another rank reported an error";
  }
  return "unknown status";
}

}  // namespace epx
