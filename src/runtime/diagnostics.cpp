#include "runtime/diagnostics.hpp"

#include "runtime/errors.hpp"

namespace epx {

DeviceDiag read_diag(const volatile DeviceDiag* d) {
  DeviceDiag r{};
  r.code = d->code;
  r.rank = d->rank;
  r.role = d->role;
  r.channel = d->channel;
  r.peer = d->peer;
  r.a = d->a;
  r.b = d->b;
  r.c = d->c;
  return r;
}

const char* error_name(int code) {
  switch (code) {
    case kErrNone:
      return "no error";
    case kErrTopkOutOfRange:
      return "topk_idx out of range";
    case kErrLayoutMismatch:
      return "num_tokens_per_rank does not match is_token_in_rank";
    case kErrWorstTokensExceeded:
      return "num_worst_tokens too small";
    case kErrRecvRegionExceeded:
      return "output region too small";
    case kVerdictResize:
      return "outputs sized by a guess too small (every rank repeats the count exchange)";
    case kErrTimeout:
      return "timeout";
    case kErrAbortedByPeer:
      return "aborted by a peer";
    case kErrShapeMismatch:
      return "ranks disagree on the operation";
    case kErrExpertRowsExceeded:
      return "more rows for one expert than num_max_dispatch_tokens_per_rank";
  }
  return "unknown error";
}

const char* role_name(int role) {
  switch (role) {
    case kRoleLayout:
      return "layout";
    case kRoleNotify:
      return "notify (count exchange / barrier)";
    case kRoleDispatchSender:
      return "dispatch sender";
    case kRoleDispatchReceiver:
      return "dispatch receiver";
    case kRoleCombineSender:
      return "combine sender";
    case kRoleCombineReceiver:
      return "combine receiver";
    case kRoleCombineCoordinator:
      return "combine coordinator";
    case kRoleDispatchCoordinator:
      return "dispatch sender coordinator";
    case kRoleCombineSenderCoordinator:
      return "combine sender coordinator";
    case kRoleLowLatencySend:
      return "low-latency dispatch send";
    case kRoleLowLatencyRecv:
      return "low-latency dispatch receive";
    case kRoleLowLatencyCombineSend:
      return "low-latency combine send";
    case kRoleLowLatencyCombineRecv:
      return "low-latency combine receive";
    case kRoleNotifyNetwork:
      return "internode notify, phase 1 (network, between domains)";
    case kRoleNotifyNvl:
      return "internode notify, phase 2 (NVLink, inside the domain)";
    case kRoleNetSender:
      return "internode dispatch network sender";
    case kRoleNetSenderCoordinator:
      return "internode dispatch sender coordinator";
    case kRoleForwarder:
      return "internode dispatch forwarder (network ring to NVLink ring)";
    case kRoleForwarderCoordinator:
      return "internode dispatch forwarder coordinator";
    case kRoleNvlReceiver:
      return "internode dispatch NVLink receiver";
    case kRoleNvlReceiverCoordinator:
      return "internode dispatch NVLink receiver coordinator";
    case kRoleCombineNvlSender:
      return "internode combine NVLink sender";
    case kRoleCombineNvlSenderCoordinator:
      return "internode combine NVLink sender coordinator";
    case kRoleCombineForwarder:
      return "internode combine forwarder (NVLink ring to network ring)";
    case kRoleCombineForwarderCoordinator:
      return "internode combine forwarder coordinator";
    case kRoleCombineNetReceiver:
      return "internode combine network receiver";
    case kRoleCombineNetReceiverCoordinator:
      return "internode combine network receiver coordinator";
    case kRoleDataStart:
      return "intranode data kernel start (waiting for its block 0's epoch barrier)";
  }
  return "unknown role";
}

std::string describe_fatal(const DeviceDiag& d, double timeout_s) {
  if (d.code == kErrAbortedByPeer)
    return cat("rank ", d.rank, " ", role_name(d.role), " (channel ", d.channel, ", peer ", d.peer,
               ") stopped because rank ", d.a, " failed a wait first; see that rank's error");
  std::string what;
  switch (d.role) {
    case kRoleNotify:
      what = cat("waiting for rank ", d.peer, " to reach the same operation (epoch flag ", d.a, ", awaited ", d.b,
                 "): did every rank call it? (one that calls it later than the timeout looks the same)");
      break;
    case kRoleDispatchSender:
    case kRoleCombineSender:
      what = cat("waiting for ring space at rank ", d.peer, ": head ", d.a, ", needed >= ", d.b, " (at ",
                 d.role == kRoleDispatchSender ? "token " : "row ", d.c, ")");
      break;
    case kRoleDispatchReceiver:
      what = cat("waiting for data from rank ", d.peer, ": tail ", d.a, ", needed >= ", d.b, " (row ", d.c, ")");
      break;
    case kRoleCombineReceiver:
      what = cat("waiting for data from rank ", d.peer, ": tail ", d.a, ", needed >= ", d.b, " (token ", d.c, ")");
      break;
    case kRoleDispatchCoordinator:
    case kRoleCombineSenderCoordinator:
      what = cat("sender warps did not finish: tail published to rank ", d.peer, " at ", d.a, " records");
      break;
    case kRoleCombineCoordinator:
      // a: records of rank peer's stream in this channel that arrived, b: the head (the record the reducers need
      // next), c: the stream's records.
      what = d.a <= d.b && d.b < d.c ? cat("reducers waiting for data from rank ", d.peer, ": ", d.a, " of ", d.c,
                                           " records arrived, needed > ", d.b)
                                     : cat("reducers did not finish: head of rank ", d.peer, " at ", d.b, " of ", d.c,
                                           " (", d.a, " records arrived)");
      break;
    case kRoleNotifyNetwork:
      what = cat("network hop: waiting for the peer in domain ", d.peer, " (epoch flag ", d.a, ", awaited ", d.b,
                 "): did every rank call it? (one that calls it later than the timeout looks the same)");
      break;
    case kRoleNotifyNvl:
      what = cat("NVLink hop: waiting for local rank ", d.peer, " of this domain (epoch flag ", d.a, ", awaited ", d.b,
                 "): did every rank call it? (one that calls it later than the timeout looks the same)");
      break;
    case kRoleNetSender:
    case kRoleCombineForwarder:
      what = cat(d.c >= 0 ? cat("network ring to domain ", d.peer, ": credit (head) ", d.a, ", needed >= ", d.b,
                                " (position ", d.c, ")")
                          : cat("NVLink ring from local rank ", d.peer, ": tail ", d.a, ", needed > ", d.b));
      break;
    case kRoleForwarder:
      what = cat(d.c >= 0 ? cat("network ring from domain ", d.peer, ": chunk signal ", d.a, ", awaited ", d.b,
                                " (position ", d.c, ")")
                          : cat("NVLink ring to local rank ", d.peer, ": head ", d.a, ", needed >= ", d.b));
      break;
    case kRoleNvlReceiver:
      what = cat("NVLink ring from local rank ", d.peer, ": tail ", d.a, ", needed > ", d.b, " (domain ", d.c, ")");
      break;
    case kRoleCombineNvlSender:
      what = cat("NVLink ring to local rank ", d.peer, ": head ", d.a, ", needed >= ", d.b, " (domain ", d.c, ")");
      break;
    case kRoleCombineNetReceiver:
      what = cat("network ring from domain ", d.peer, ": chunk signal ", d.a, ", awaited ", d.b, " (token ", d.c, ")");
      break;
    case kRoleNetSenderCoordinator:
    case kRoleForwarderCoordinator:
    case kRoleNvlReceiverCoordinator:
    case kRoleCombineNvlSenderCoordinator:
    case kRoleCombineForwarderCoordinator:
    case kRoleCombineNetReceiverCoordinator:
      what = cat("its warps did not finish (stream ", d.peer, " at ", d.a, " of ", d.b, ")");
      break;
    case kRoleDataStart:
      // Block 0's wait for a rank that does not call has half this wait's budget and names that rank; this one
      // reports only when block 0 did not get to run.
      what = cat("block ", d.c, " waited for block 0 to finish the epoch barrier (start word ", d.a,
                 "): were the kernel's blocks not all resident at once (another kernel on the GPU)?");
      break;
    default:
      what = cat("waiting on rank ", d.peer, ": seen ", d.a, ", awaited ", d.b, " (", d.c, ")");
  }
  // Channel -1: the wait belongs to no channel (notify, a whole-kernel wait).
  return cat("rank ", d.rank, " ", role_name(d.role), " timed out after ", timeout_s, " s",
             d.channel >= 0 ? cat(" on channel ", d.channel) : std::string(), ", ", what);
}

std::string describe_input(int code, const DeviceDiag& d, int reporting_rank) {
  switch (code) {
    case kErrTopkOutOfRange:
      return cat("topk_idx[", d.a, "][", d.b, "] = ", d.c, " on rank ", reporting_rank,
                 " is outside [-1, num_experts) (found by get_dispatch_layout; the slot was not counted)");
    case kErrLayoutMismatch:
      return cat("on rank ", reporting_rank, ", num_tokens_per_rank[", d.a, "] = ", d.b, " but is_token_in_rank has ",
                 d.c, " tokens for rank ", d.a, ": pass the layout of the same topk_idx");
    case kErrWorstTokensExceeded:
      return cat("num_worst_tokens = ", d.c, " is too small: rank ", d.a, " would receive ", d.b, " rows");
    case kErrRecvRegionExceeded:
      return cat("rank ", d.a, " would receive ", d.b,
                 " rows but the output region of a dispatch into the buffer holds ", d.c,
                 " of this shape: create the Buffer with a larger num_recv_bytes (recv_region_size_hint)");
    case kErrShapeMismatch:
      return cat("ranks disagree on this operation: rank ", d.a, " called it with a different shape than rank ", d.rank,
                 " (operation, hidden size, dtype, number of scales, num_topk, num_sms or ring size;"
                 " signatures ",
                 d.b, " vs ", d.c, "); every rank must pass the same");
    case kErrExpertRowsExceeded:
      return cat("rank ", reporting_rank, " sends at least ", d.b, " rows to expert ", d.a,
                 " but a low-latency dispatch holds num_max_dispatch_tokens_per_rank = ", d.c,
                 " per expert and source (an expert listed twice in a token's topk_idx counts twice); the rows"
                 " beyond were dropped");
  }
  return cat(error_name(code), " (rank ", reporting_rank, ")");
}

}  // namespace epx
