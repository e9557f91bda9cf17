// Turning the kernels' diagnostics (host_shared.hpp) into messages a user can act on.
#pragma once

#include <string>

#include "layout/host_shared.hpp"

namespace epx {

DeviceDiag read_diag(const volatile DeviceDiag* d);
const char* error_name(int code);
const char* role_name(int role);
std::string describe_fatal(const DeviceDiag& d, double timeout_s);
std::string describe_input(int code, const DeviceDiag& d, int reporting_rank);

}  // namespace epx
