// An LD_PRELOAD probe for aborts through std::terminate ("terminate called without an active exception"): it installs
// a terminate handler that prints the calling thread's name and id and a backtrace (library and offset per frame) to
// stderr, then hands over to the handler it replaced. It names the library whose thread or destructor called
// terminate, where a core file or gdb is not at hand.
//   g++ -O1 -shared -fPIC -o terminate_trace.so tools/probes/terminate_trace.cpp
//   LD_PRELOAD=$PWD/terminate_trace.so python tests/python/overhead.py --nproc 2
#include <execinfo.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

std::terminate_handler g_previous = nullptr;

void on_terminate() {
  char name[32] = "?";
  pthread_getname_np(pthread_self(), name, sizeof name);
  dprintf(2, "terminate_trace: std::terminate in thread '%s' (tid %ld, pid %ld)%s\n", name,
          static_cast<long>(syscall(SYS_gettid)), static_cast<long>(getpid()),
          std::current_exception() ? ", with an active exception" : "");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  if (g_previous != nullptr) g_previous();
  std::abort();
}

__attribute__((constructor)) void install() { g_previous = std::set_terminate(on_terminate); }

}  // namespace
