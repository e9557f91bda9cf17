"""Helpers shared by the multi-GPU test modules: bitwise comparison, the per-process context, and loading an
example as a module."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64, torch.float8_e4m3fn: torch.uint8}


def assert_bitwise(name: str, got, want) -> None:
    """Exact equality, bit for bit (so -0.0 != 0.0 and NaN patterns count), with a readable report."""
    assert got is not None, f"{name} is None"
    got = got.detach().cpu()
    want = want.detach().cpu() if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=got.dtype)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g = got.contiguous().view(_BITS.get(got.dtype, got.dtype))
    w = want.contiguous().view(_BITS.get(want.dtype, want.dtype))
    if not torch.equal(g, w):
        bad = torch.nonzero(g != w)
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {bad.shape[0]} of {g.numel()} elements differ; first at {first}: got "
                             f"{got[first].item()!r}, expected {want[first].item()!r}")


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    buffer: object
    extra: dict = field(default_factory=dict)


def profiled_kernels(fn):
    """Runs fn under torch.profiler; -> (fn's result, the names of the CUDA kernels it ran, in order). Collective:
    every rank calls it at the same point. The ranks meet after starting their profilers and again before stopping
    them, so that no rank starts or stops its profiler while a peer's kernel waits for it, which stalls that kernel
    for seconds (python/README.md, "Profiling")."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _barrier()
        result = fn()
        torch.cuda.synchronize()
        _barrier()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def assert_one_kernel(what: str, names, word: str) -> None:
    """Exactly one of the kernel names contains word (case-insensitive): what users' timing scripts select."""
    hits = [n for n in names if word in n.lower()]
    assert len(hits) == 1, f"{what}: {len(hits)} kernels whose name contains {word!r}: {hits} (all: {names})"


def load_example(name: str):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_epx_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
