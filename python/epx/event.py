"""EventOverlap: a CUDA event returned by asynchronous operations (deep_ep.EventOverlap's interface)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class EventOverlap:
    """Wraps a torch.cuda.Event recorded on the communication stream after an async_finish operation
    (or None for a synchronous one).

    current_stream_wait() makes the current stream wait for it. As a context manager it lets the caller
    overlap work with the communication: the body runs, then the current stream waits for the event:

        _, _, _, _, handle, event = buffer.dispatch(..., async_finish=True)
        with event:
            other_compute()      # overlaps the dispatch
        use(recv_x)              # the current stream now waits for the dispatch

    extra_tensors keeps tensors alive until the event is dropped (what record_stream would do, but
    compatible with CUDA-graph capture); the low-latency calls use it.
    """

    __slots__ = ("event", "extra_tensors")

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors: Optional[Tuple[Any, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError("this EventOverlap holds no event (the operation was synchronous: "
                               "pass async_finish=True to get one)")
        torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def __repr__(self) -> str:
        return f"epx.EventOverlap(event={'None' if self.event is None else 'set'})"
