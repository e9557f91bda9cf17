"""Output tensors of the low-latency calls, handed out again once nothing but the pool references them.

A fresh CUDA tensor costs about 1.6 us of host time (docs/bench-notes.md, the host-path session's call 2); a
low-latency dispatch makes five or six, the combine one. An OutputPool keeps the output sets of one key (what fixes
the sets' shapes and dtypes) allocated on one stream, and hands a set out again only when nothing outside the pool
can reach its memory:
- no Python object references a tensor of the set or its storage object but the pool (sys.getrefcount), and
  nothing holds a weak reference to the tensor (weak-keyed caches must not see it come back);
- no C++ owner shares the tensor (Tensor._use_count: autograd, DLPack capsules, a collective's work object),
  and no other tensor shares its storage (the storage's use count: views, also inference-mode views, which hold
  no reference to their base);
each equal to its value when the set was made and held by the pool alone. That is when the caching allocator
could have handed the same memory out again on the same stream, and this call's kernels are queued on that
stream, or on the communication stream after it waited for that stream, as they would be into fresh memory.
record_stream is the one difference: the allocator delays the reuse of a freed block until the streams recorded
on it are done, the pool cannot see such records (python/README.md says what callers do about it).

A set whose tensor changed in place (data pointer, shape, strides, dtype, requires_grad or Python attributes:
resize_, set_, as_strided_, squeeze_, .data = ..., requires_grad_, an attribute set on it) is dropped, never
repaired. No set is handed out or kept while the current stream is capturing a CUDA graph (memory from a graph's
private pool is rewritten by every replay), or while deterministic algorithms fill new memory (a reused set would
carry old bytes where a fresh one carries the fill). The capture query asks about the current device's current
stream: the Buffer's device in a process that owns one GPU, as every Buffer needs. The key includes the current
stream and whether inference mode is on (tensors made in inference mode are inference tensors); a call with another
key drops the sets of the old one, and its own first call's outputs are not kept (a key that changes every call,
as the combine's token count may, costs a comparison only). At most MAX_SETS sets are kept: a new set evicts the
oldest (not free, or it would have been handed out).
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional, Tuple

import torch

MAX_SETS = 3  # per pool: a decoding loop holds the previous outputs while it makes the next (two sets alternate)

_refs = sys.getrefcount
_weak_refs = weakref.getweakrefcount
_tensor_uses = getattr(torch.Tensor, "_use_count", None)
_storage_uses = getattr(torch._C, "_storage_Use_Count", None)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or \
    getattr(torch.cuda, "is_current_stream_capturing", None)
_deterministic = getattr(torch._C, "_get_deterministic_algorithms", None)
_fills_new_memory = getattr(torch._C, "_get_deterministic_fill_uninitialized_memory", None)
_inference = getattr(torch, "is_inference_mode_enabled", None)

# Without any of these queries nothing could be shown to be free or allowed: no reuse.
AVAILABLE = None not in (_tensor_uses, _storage_uses, _is_capturing, _deterministic, _fills_new_memory, _inference)


_FREE, _IN_USE, _CHANGED = 0, 1, 2


class _Set:
    """One set of outputs, what its checks compare against, and `native`: what the owner derives from the set alone
    (the C struct naming its tensors), kept with it (None until the owner sets it; it must hold no tensor)."""

    __slots__ = ("outputs", "counted", "laid_out", "counts", "native")

    def __init__(self, outputs: tuple):
        # outputs as the call unpacks them (None for an output the key does not have). The call allocates straight
        # into that tuple, so each tensor is referenced by it and by the two tuples of rows below, nothing else.
        self.outputs = outputs
        counted, laid_out = [], []
        for t in outputs:
            if t is not None:
                # The storage object is held, so that it stays the one torch hands out for that storage (the same
                # Python object while it is alive): a caller holding it shows in its reference count.
                st = t.untyped_storage()
                counted.append((t, st, st._cdata))
                laid_out.append((t, t.data_ptr(), t.shape, t.stride(), t.dtype))
        self.counted, self.laid_out = tuple(counted), tuple(laid_out)
        self.counts = None
        self.native = None
        counted = laid_out = t = st = None  # no reference of this frame may count in the baseline
        _check(self)  # measures the baseline: the counts with only the pool referencing the tensors


def _check(entry: _Set) -> int:
    """-> _FREE, _IN_USE (some count differs from its baseline) or _CHANGED (free, but a tensor's metadata changed in
    place). The first call (counts None) records the baseline: one function measures it and checks it, so that the
    interpreter's own references (the loop variables, the calls' arguments) are the same in both."""
    counts = entry.counts
    record = counts is None
    if record:
        counts = entry.counts = []
    i = 0
    for t, st, cdata in entry.counted:
        now = (_refs(t), _weak_refs(t), _tensor_uses(t), _refs(st), _storage_uses(cdata))
        if record:
            counts.append(now)
        elif now != counts[i]:
            return _IN_USE
        i += 1
    for t, ptr, shape, stride, dtype in entry.laid_out:
        if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride or t.dtype is not dtype or t.requires_grad \
                or t.__dict__:
            return _CHANGED
    return _FREE


class OutputPool:
    """The output sets of one kind of call (low-latency dispatch, or combine) for one key. One call of the owner:
    take(key, stream) -> a kept set (its .outputs, .native) or None; after allocating outputs, add(outputs) -> the
    set kept for them or None. reused / allocated count the sets handed out again and the sets allocated while the
    pool was on."""

    __slots__ = ("_key", "_stream", "_inference", "_sets", "_keeping", "reused", "allocated")

    def __init__(self):
        self._key = self._stream = self._inference = None
        self._sets = []  # oldest first; a set handed out again moves to the end
        self._keeping = False
        self.reused = 0
        self.allocated = 0

    def clear(self) -> None:
        self._key = self._stream = self._inference = None
        self._sets = []

    def take(self, key, stream: int) -> Optional[_Set]:
        """-> a free set of key (compared with ==; it fixes the shapes and dtypes), allocated on stream (the raw
        current stream), or None. Its data pointers are those it was made with (_check)."""
        self._keeping = False
        if _is_capturing() or (_deterministic() and _fills_new_memory()):
            return None
        self._keeping = True
        inference = _inference()
        if key != self._key or stream != self._stream or inference is not self._inference:
            # A new key is kept from its second call in a row on: a key that changes every call (the combine's
            # token count in a loop of varying batches) costs this comparison, not a set's bookkeeping.
            self._key, self._stream, self._inference = key, stream, inference
            self._sets = []
            self._keeping = False
            return None
        sets = self._sets
        i = 0
        while i < len(sets):
            entry = sets[i]
            state = _check(entry)
            if state == _IN_USE:
                i += 1
                continue
            del sets[i]
            if state == _FREE:
                sets.append(entry)
                self.reused += 1
                return entry
            # _CHANGED: dropped (the caching allocator frees its memory with the tensor)
        return None

    def add(self, outputs: tuple) -> Optional[_Set]:
        """Keeps outputs just allocated for the key of the last take() unless that take() ran during capture or
        found another key. -> the set kept, or None."""
        self.allocated += 1
        if not self._keeping:
            return None
        sets = self._sets
        if len(sets) >= MAX_SETS:
            del sets[0]  # the oldest; not free, or take() would have handed it out
        entry = _Set(outputs)
        sets.append(entry)
        return entry

    def counts(self) -> Tuple[int, int, int]:
        """-> (sets handed out again, sets allocated, sets kept now)."""
        return self.reused, self.allocated, len(self._sets)
