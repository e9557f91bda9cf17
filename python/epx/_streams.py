"""Stream choreography of every operation (deep_ep's semantics).

High-throughput calls run on the Buffer's communication stream, which first waits for previous_event, or
else for the current stream. Outputs are allocated on the current stream, or on the communication stream
with allocate_on_comm_stream. Without async_finish the current stream waits for the communication stream
at the end, so results are ready in stream order. With async_finish the caller gets an EventOverlap
instead, and every tensor the operation touched is recorded on the streams that use it, so the caching
allocator does not hand its memory out before the communication is done with it. The low-latency calls
do the same without previous_event, or run on the current stream when they return a receive hook. A
synchronous low-latency call, get_dispatch_layout, cached dispatch or combine (no previous_event) also runs on
the current stream when comm holds nothing that stream is not already ordered after (Streams.direct): the
result is the same, for four stream/event calls less. When a later call goes through comm from another current
stream, comm also waits for the stream those calls ran on, so the Buffer's operations keep one order, as they
would all on comm.

This runs on every call, so it is kept cheap (docs/bench-notes.md, "Python host overhead"):
- The two waits of a synchronous call use two events per Buffer, recorded again on every call, instead of
  two new events. That is safe: a wait is on the record that precedes it (cudaStreamWaitEvent takes the
  event's state at the time of the call), and every wait here directly follows its record, in or out of
  CUDA-graph capture alike. Only async_finish, whose event the caller keeps, gets a new one.
- The current stream is found by its raw handle, and a torch Stream object is made only when it changed.
- The torch entry points are bound once, below, past their Python wrappers; the CPU tests replace these
  names with fakes (tests/python/_fake_cuda.py).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .event import EventOverlap


def _raw_current_stream_fallback(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_current_stream_fallback)
_current_stream = torch.cuda.current_stream
_new_event = torch.cuda.Event
_stream_context = torch.cuda.stream
_event_base = getattr(torch._C, "_CudaEventBase", None)  # absent from torch builds without CUDA
_event_record = _event_base.record if _event_base is not None and hasattr(_event_base, "record") else \
    (lambda event, stream: event.record(stream))
_event_wait = _event_base.wait if _event_base is not None and hasattr(_event_base, "wait") else \
    (lambda event, stream: event.wait(stream))


def event_of(previous_event) -> torch.cuda.Event:
    if isinstance(previous_event, EventOverlap):
        if previous_event.event is None:
            raise ValueError("previous_event holds no event (it came from a synchronous call)")
        return previous_event.event
    if isinstance(previous_event, torch.cuda.Event):
        return previous_event
    raise TypeError(f"previous_event must be an epx.EventOverlap or torch.cuda.Event, got "
                    f"{type(previous_event).__name__}")


def check_stream_flags(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    # Tensors owned by the communication stream are only safe when the caller orders its own use after
    # the returned event, and the stream has something definite to wait for first.
    if previous_event is not None:
        event_of(previous_event)  # type check only
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True")


class Streams:
    """The communication stream of one Buffer, the events of its synchronous waits, and the last current
    stream seen. One operation: compute = begin(...), launches on .comm, then end_sync / end_async."""

    __slots__ = ("comm", "comm_raw", "device_index", "_ready", "_done", "_ready_settled", "compute_raw", "_compute",
                 "settled_raw", "_settled", "exposed")

    def __init__(self, comm, device_index: int):
        self.comm = comm
        self.comm_raw = comm.cuda_stream
        self.device_index = device_index
        self._ready = _new_event()  # recorded on the current stream, waited for by comm
        self._done = _new_event()   # recorded on comm, waited for by the current stream
        self._ready_settled = _new_event()  # recorded on the settled stream when comm has to wait for it too
        self.compute_raw = None
        self._compute = None
        # A stream already ordered after everything queued on comm (the last operation there ended with this
        # stream waiting for it), or None; and whether the caller was handed comm (get_comm_stream), so that
        # work we did not queue may be on it.
        self.settled_raw = None
        self._settled = None
        self.exposed = False

    def current(self):
        """The current stream of the Buffer's device (a torch Stream)."""
        raw = _raw_current_stream(self.device_index)
        if raw != self.compute_raw:
            self._compute = _current_stream(self.device_index)
            self.compute_raw = raw
        return self._compute

    def begin(self, previous_event=None):
        """comm waits for previous_event, or else for the current stream. -> the current stream."""
        compute = self.current()
        settled, self.settled_raw = self.settled_raw, None  # comm gets work that nothing waits for yet
        if settled is not None and settled != self.compute_raw:
            # Synchronous calls may have run straight on the settled stream since (direct()): the Buffer's
            # operations stay in one order, as if all had run on comm, also when the caller switched streams.
            _event_record(self._ready_settled, self._settled)
            _event_wait(self._ready_settled, self.comm)
        if previous_event is None:
            _event_record(self._ready, compute)
            _event_wait(self._ready, self.comm)
        else:
            _event_wait(event_of(previous_event), self.comm)
        return compute

    def allocating(self):
        """Context in which the outputs of allocate_on_comm_stream are allocated."""
        return _stream_context(self.comm)

    def end_sync(self, compute) -> EventOverlap:
        """The current stream waits for comm."""
        _event_record(self._done, self.comm)
        _event_wait(self._done, compute)
        self.settled_raw = self.compute_raw
        self._settled = compute
        return EventOverlap()

    def direct(self) -> Optional[int]:
        """The current stream's raw handle when a synchronous operation may run on it directly rather than on
        comm with a wait on each side: nothing queued on comm is unordered with the current stream, and
        nobody else can queue work there. The result is then the same as deep_ep's choreography (ready in
        stream order on the current stream), for 4 stream/event calls less. None otherwise."""
        if self.exposed:
            return None
        raw = _raw_current_stream(self.device_index)
        return raw if raw == self.settled_raw else None

    def begin_sync_or_direct(self, previous_event, async_finish: bool):
        """-> (raw stream to launch on, current stream or None). A synchronous call without previous_event runs
        straight on the current stream when direct() allows (None: nothing to wait for at the end, finish with
        end_direct); otherwise it goes through comm after begin()."""
        if not async_finish and previous_event is None:
            raw = self.direct()
            if raw is not None:
                return raw, None
        return self.comm_raw, self.begin(previous_event)

    @staticmethod
    def end_direct() -> EventOverlap:
        """The end of a call that ran on the current stream: its result is ready in stream order there."""
        return EventOverlap()

    def end_async(self, compute, tensors: Iterable[Optional[torch.Tensor]], alloc_on_comm: bool) -> EventOverlap:
        """A new event on comm for the caller; the tensors are recorded on the streams that use them."""
        event = _new_event()
        _event_record(event, self.comm)
        comm = self.comm
        for t in tensors:
            if t is None:
                continue
            t.record_stream(comm)
            if alloc_on_comm:
                t.record_stream(compute)
        return EventOverlap(event)

    def end_async_keep(self, tensors) -> EventOverlap:
        """The low-latency form of end_async: a new event on comm that keeps the tensors alive until the
        caller drops it (record_stream is not allowed in CUDA-graph capture)."""
        event = _new_event()
        _event_record(event, self.comm)
        return EventOverlap(event, tuple(t for t in tensors if t is not None))
