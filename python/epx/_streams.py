"""Stream choreography of the high-throughput calls (deep_ep's semantics).

Every operation runs on the Buffer's communication stream, which first waits for previous_event, or else
for the current stream. Outputs are allocated on the current stream, or on the communication stream
with allocate_on_comm_stream. Without async_finish the current stream waits for the communication
stream at the end, so results are ready in stream order. With async_finish the caller gets an
EventOverlap instead, and every tensor the operation touched is recorded on the streams that use it, so
the caching allocator does not hand its memory out before the communication is done with it.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from .event import EventOverlap


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


class StreamScope:
    """One operation's streams: call finish() after the last launch."""

    __slots__ = ("compute", "comm", "async_finish", "alloc_on_comm")

    def __init__(self, comm: torch.cuda.Stream, device: torch.device, previous_event, async_finish: bool,
                 allocate_on_comm_stream: bool):
        self.compute = torch.cuda.current_stream(device)
        self.comm = comm
        self.async_finish = async_finish
        self.alloc_on_comm = allocate_on_comm_stream
        if previous_event is not None:
            comm.wait_event(event_of(previous_event))
        else:
            comm.wait_stream(self.compute)

    def allocating(self):
        """Context in which outputs are allocated (on the stream that owns them)."""
        return torch.cuda.stream(self.comm) if self.alloc_on_comm else contextlib.nullcontext()

    def finish(self, tensors: Iterable[Optional[torch.Tensor]]) -> EventOverlap:
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(self.comm)
        for t in tensors:
            if t is None:
                continue
            t.record_stream(self.comm)
            if self.alloc_on_comm:
                t.record_stream(self.compute)
        return EventOverlap(event)
