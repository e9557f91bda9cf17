"""The bootstrap's all-gather of bytes over a torch.distributed group (epx.bootstrap.all_gather_bytes), on the CPU:
three gloo processes, payloads of different lengths (empty ones included), every rank's bytes back in rank order,
and the collectives' tensors referenced from Python only once the call returns (the gloo worker threads have let
go of them, so that no worker thread frees a Python object after the call)."""

import os
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = r"""
import os, sys
import torch.distributed as dist
from epx import bootstrap

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)

def payload(step, r):
    if step == 0:
        return b""  # every rank empty
    if step == 1:
        return bytes([r]) * (3 * r)  # rank 0 empty, the others not
    return bytes((r * 7 + i) % 256 for i in range(300 + 41 * r))

for step in range(3):
    parts = bootstrap.all_gather_bytes(None, None, payload(step, rank))
    assert parts == [payload(step, r) for r in range(world)], (step, [len(p) for p in parts])
    held = bootstrap._HELD[-1]
    if hasattr(held[0], "_use_count"):
        counts = [t._use_count() for t in held]
        assert counts == [1] * len(held), (step, counts)
    print(f"rank {rank} step {step} ok", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_all_gather_bytes_over_gloo_returns_every_rank_in_order_and_lets_go_of_its_tensors():
    world = 3
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), str(world), store], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("a rank did not finish within 120 s")
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {err}"
        assert out.split("\n")[:3] == [f"rank {r} step {s} ok" for s in range(3)], out
