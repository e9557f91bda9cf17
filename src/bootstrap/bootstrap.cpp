// Bootstrap helpers shared by every implementation.
#include "epx/epx.hpp"
#include "runtime/errors.hpp"

namespace epx {

void Bootstrap::barrier() {
  const char mine = 1;
  std::string all(size_t(size()), '\0');
  all_gather(&mine, all.data(), 1);
}

void CallbackBootstrap::all_gather(const void* send, void* recv, size_t bytes) {
  if (c_.allgather == nullptr) raise(Status::kBootstrap, "bootstrap has no all-gather callback");
  const int rc = c_.allgather(c_.ctx, send, recv, bytes);
  if (rc != 0) raise(Status::kBootstrap, "bootstrap all-gather callback failed with code ", rc, " (", bytes, " bytes)");
}

}  // namespace epx
