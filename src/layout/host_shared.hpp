// Host-mapped memory of one rank (cudaHostAlloc, mapped): what the kernels tell the CPU without a copy.
// The CPU polls it with a bounded wait; kernels write it with system-scope release stores.
#pragma once

#include <cstdint>

#include "layout/limits.hpp"

namespace epx {

// Conditions a kernel reports. Input errors are collective and non-fatal (every rank's call throws, the
// buffer stays usable); timeouts and aborts are fatal (the kernel traps, the buffer must be destroyed).
enum DeviceError : int32_t {
  kErrNone = 0,
  kErrTopkOutOfRange = 1,       // a = token, b = slot, c = value
  kErrLayoutMismatch = 2,       // a = destination rank, b = num_tokens_per_rank[a], c = count in is_token_in_rank
  kErrWorstTokensExceeded = 3,  // a = receiving rank, b = rows it would receive, c = num_worst_tokens
  kErrTimeout = 4,              // a = value seen, b = value awaited, c = role-specific (see the role)
  kErrAbortedByPeer = 5,        // a = rank whose wait failed first
  kErrShapeMismatch = 6,        // a = first rank whose operation signature differs, b = its signature, c = ours
  kErrExpertRowsExceeded = 7,   // a = expert, b = rows this rank sends it (at least), c = M (low-latency dispatch)
  kErrRecvRegionExceeded = 8,   // a = receiving rank, b = rows it would receive, c = rows its output region holds
  // Not an error: a rank's rows exceed the outputs it sized by a guess (NotifyMsg::kRowBound < 0). The data kernels of
  // every rank skip, no diagnostic is written, and every rank's host repeats the count exchange without a guess.
  kVerdictResize = 9,
};

enum DeviceRole : int32_t {
  kRoleLayout = 0,
  kRoleNotify = 1,
  kRoleDispatchSender = 2,
  kRoleDispatchReceiver = 3,
  kRoleCombineSender = 4,
  kRoleCombineReceiver = 5,
  kRoleCombineCoordinator = 6,
  kRoleLowLatencySend = 7,
  kRoleLowLatencyRecv = 8,
  kRoleLowLatencyCombineSend = 9,
  kRoleLowLatencyCombineRecv = 10,
  kRoleDispatchCoordinator = 11,
  kRoleCombineSenderCoordinator = 12,
  // Internode mode. The hop a role waits on: network (ring between domains; peer = domain), NVLink (sub-ring
  // inside the domain; peer = local rank), or a notify phase (1: network, peer = domain; 2: NVLink, peer = local
  // rank).
  kRoleNotifyNetwork = 13,
  kRoleNotifyNvl = 14,
  kRoleNetSender = 15,             // dispatch: waits for network ring credit (a = head, b = needed)
  kRoleNetSenderCoordinator = 16,  // dispatch: relays credit until the senders are done
  kRoleForwarder = 17,             // dispatch: waits for a network chunk (a, b: signal) or NVLink room (head)
  kRoleForwarderCoordinator = 18,  // dispatch: waits for the forwarders' progress
  kRoleNvlReceiver = 19,           // dispatch: waits for NVLink sub-ring data (tail)
  kRoleNvlReceiverCoordinator = 20,
  kRoleCombineNvlSender = 21,  // combine: waits for NVLink sub-ring room (head)
  kRoleCombineNvlSenderCoordinator = 22,
  kRoleCombineForwarder = 23,  // combine: waits for NVLink rows (tail) or network credit (head)
  kRoleCombineForwarderCoordinator = 24,
  kRoleCombineNetReceiver = 25,  // combine: waits for a network chunk (signal)
  kRoleCombineNetReceiverCoordinator = 26,
  // A block of an intranode data kernel waiting for its block 0 to finish the epoch barrier (c = the block).
  kRoleDataStart = 27,
};

struct DeviceDiag {
  int32_t code;
  int32_t rank;
  int32_t role;
  int32_t channel;
  int32_t peer;
  int32_t pad;
  int64_t a, b, c;
};

struct HostShared {
  int32_t notify_seq;       // written last by notify (release): the host's sequence number of that call
  int32_t num_recv_tokens;  // counts of that notify
  int32_t op_error;         // collective input error of that notify (DeviceError), 0 if none
  int32_t op_error_rank;
  int32_t fatal_claimed;         // 0 until a fatal diagnostic is written (first writer wins)
  int32_t input_claimed;         // 0 until this rank's first input error since the last report
  int32_t num_rdma_recv_tokens;  // internode notify: records this rank's network rings receive
  int32_t pad;
  DeviceDiag fatal;  // timeout / abort
  DeviceDiag input;  // this rank's input error (layout kernel)
  int32_t num_recv_tokens_per_expert[kMaxLocalExperts];
};

}  // namespace epx
