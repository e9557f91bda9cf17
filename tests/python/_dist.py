"""Multi-GPU test runner: one spawned process per GPU runs every case of a test module in order, each rank
writing its per-case outcome to a file; the pytest side turns the outcomes into one test per case.

One spawn per (module, world size) keeps the suite fast (process start, torch import and CUDA context are
paid once). A case that fails on one rank does not stop the others: every rank moves on to the next case
after a barrier. A hang (a collective that one rank never joined) is cut by the run's deadline, and
the cases that did not finish are reported as such.

A test module provides setup(rank, world_size) -> ctx, teardown(ctx), and its cases as functions
case_*(ctx), listed in CASES (in run order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Dict, List

import pytest

# Multicast (NVLS) objects are not available on the test machines.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(n: int) -> None:
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, {have} visible")


def _load(module_file: str):
    name = "_epx_case_module_" + os.path.splitext(os.path.basename(module_file))[0]
    spec = importlib.util.spec_from_file_location(name, module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: str, results: Dict[str, str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, path)


def _library_diagnosis(ctx) -> str:
    """After a failed case: what epx recorded about it, if the case's context has a Buffer. A kernel that trapped
    (a wait that ran out, or an abort from a peer) leaves a diagnostic that only epx's own calls report; when the
    failure surfaced first in a torch call (a synchronize), this is where the role, rank and wait come from."""
    buffer = getattr(ctx, "buffer", None)
    if buffer is None or not hasattr(buffer, "check"):
        return ""
    try:
        buffer.check()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the case has failed already
        return f"\nepx after the failure: {type(e).__name__}: {e}\n"
    return ""


def _worker(rank: int, world_size: int, module_file: str, cases: List[str], workdir: str, backend: str) -> None:
    os.environ.update(ENV)
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    out = os.path.join(workdir, f"rank{rank}.json")
    results: Dict[str, str] = {}
    module = _load(module_file)
    try:
        ctx = module.setup(rank, world_size)
    except Exception:  # noqa: BLE001 - reported as every case's failure
        text = "setup failed:\n" + traceback.format_exc()
        _write(out, {name: text for name in cases})
        raise
    times = os.environ.get("EPX_CASE_TIMES") == "1"
    for name in cases:
        start = time.monotonic()
        try:
            getattr(module, name)(ctx)
            results[name] = ""
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - pytest's failures are BaseExceptions; the run goes on
            results[name] = traceback.format_exc() + _library_diagnosis(ctx)
        if times:
            print(f"[rank {rank}] {name}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        _write(out, results)
        dist.barrier()
    module.teardown(ctx)
    dist.barrier()
    dist.destroy_process_group()


def selected(cases: List[str]) -> List[str]:
    """The cases to run: those whose name contains one of the comma-separated substrings of $EPX_CASE_FILTER, or
    every case when it is unset (all cases of a module run in one spawn, so pytest's -k cannot shorten a run)."""
    wanted = [w for w in os.environ.get("EPX_CASE_FILTER", "").split(",") if w]
    return [c for c in cases if not wanted or any(w in c for w in wanted)]


class Results:
    def __init__(self, world_size: int, per_rank: List[Dict[str, str]], note: str, run: List[str]):
        self.world_size = world_size
        self.per_rank = per_rank
        self.note = note
        self.run = set(run)

    def check(self, case: str) -> None:
        if case not in self.run:
            pytest.skip(f"not selected by EPX_CASE_FILTER={os.environ.get('EPX_CASE_FILTER', '')}")
        problems = []
        for rank, results in enumerate(self.per_rank):
            if case not in results:
                problems.append(f"rank {rank}: did not finish ({self.note or 'the run stopped before it'})")
            elif results[case]:
                problems.append(f"rank {rank}:\n{results[case]}")
        if problems:
            pytest.fail(f"{case} on {self.world_size} GPUs failed:\n" + "\n".join(problems), pytrace=False)


def run_cases(module_file: str, cases: List[str], world_size: int, timeout_s: float = 240.0,
              backend: str = "gloo") -> Results:
    import torch.multiprocessing as mp

    cases = selected(cases)
    with tempfile.TemporaryDirectory(prefix="epx-pytest-") as workdir:
        context = mp.start_processes(_worker, args=(world_size, module_file, cases, workdir, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        note = ""
        try:
            while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    note = f"the run exceeded {timeout_s:.0f} s and was stopped"
                    break
        except Exception as e:  # noqa: BLE001 - a process died: report what the ranks wrote
            note = f"a process failed: {e}"
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else {})
        return Results(world_size, per_rank, note, cases)
