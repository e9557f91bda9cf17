"""Argument checks that run before anything is launched: wrong types and dtypes raise TypeError; wrong
shapes, devices, contiguity, alignment or ranges raise ValueError. They touch no CUDA state, so they can
be tested on a CPU (with a Buffer whose device is the CPU)."""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple

import torch

_Tensor = torch.Tensor
_FP32, _INT32 = torch.float32, torch.int32

def tensor(name: str, t, dtype, shape: Sequence[Optional[int]], device: torch.device,
           aligned16: bool = False) -> torch.Tensor:
    """Checks a tensor argument. shape: one entry per dimension, None for any size. dtype: one dtype or a
    tuple of accepted ones."""
    # Fast path first (this runs several times per call, on the hot path of every operation): each property
    # read once, no formatting, no zip (indexing the torch.Size is cheaper).
    if isinstance(t, _Tensor) and (t.dtype is dtype or (type(dtype) is tuple and t.dtype in dtype)) \
            and t.device == device and t.is_contiguous():
        got = t.shape
        if len(got) == len(shape):
            i = 0
            for want in shape:
                if want is not None and want != got[i]:
                    break
                i += 1
            else:
                if not aligned16 or not t.data_ptr() & 15 or not t.numel():
                    return t
    _explain(name, t, dtype, shape, device, aligned16)
    return t


def strided_scales(name: str, t, num_tokens: int, device: torch.device) -> Tuple[int, int]:
    """Checks FP8 scales [num_tokens, S >= 1], float32 or int32 words, at any strides (the kernels read them in
    place). Returns the element strides for epx_dispatch_args: (0, 0) when row-major contiguous; a stride of a
    dimension of size 1 (never used) is given as S or 1. A zero stride over several elements (an expanded view)
    is refused, as the library refuses it."""
    if isinstance(t, _Tensor) and (t.dtype is _FP32 or t.dtype is _INT32) and t.device == device:
        got = t.shape
        if len(got) == 2 and got[0] == num_tokens and got[1] >= 1:
            if t.is_contiguous():
                return 0, 0
            st, sg = t.stride()
            T, S = got
            if T <= 1:
                st = S
            if S <= 1:
                sg = 1
            if st >= 1 and sg >= 1:
                return st, sg
            raise ValueError(f"{name} has a zero stride, strides {t.stride()} for shape {tuple(got)} (an expanded "
                             f"view?): every token and scale needs its own element; call .contiguous()")
    _explain(name, t, (_FP32, _INT32), (num_tokens, None), device, False, contiguous=False)
    raise ValueError(f"{name} must have at least one column, got shape {tuple(t.shape)}")


def _explain(name, t, dtype, shape, device, aligned16, contiguous=True) -> None:
    """Raises the error that says what is wrong with t."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if t.dim() != len(shape):
        raise ValueError(f"{name} must have {len(shape)} dimensions {_fmt(shape)}, got shape {tuple(t.shape)}")
    for i, (want, got) in enumerate(zip(shape, t.shape)):
        if want is not None and want != got:
            raise ValueError(f"{name} must have shape {_fmt(shape)}, got {tuple(t.shape)} (dimension {i})")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the Buffer's device), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    if aligned16 and t.numel() > 0 and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start on a 16-byte boundary (a view at an odd offset? copy it)")


def optional_tensor(name: str, t, dtype, shape, device, aligned16: bool = False) -> Optional[torch.Tensor]:
    return None if t is None else tensor(name, t, dtype, shape, device, aligned16)


def integer(name: str, value, low: int, high: Optional[int] = None) -> int:
    if type(value) is int and low <= value and (high is None or value <= high):
        return value  # the common case, without the ABC check below (a third of a microsecond)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)  # numpy and other integral types
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {'in ' if high is not None else ''}{bound}, got {value}")
    return value


def flag(name: str, value) -> bool:
    if value is True or value is False:
        return value
    # ints are accepted too (0/1 flags are common in code written for deep_ep)
    if not isinstance(value, (bool, int)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
