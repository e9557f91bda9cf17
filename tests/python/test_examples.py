"""The examples end to end on 2, 3 and 4 GPUs: the MoE layer's output and gradients, and the CUDA-graph
decoding loop's outputs, against single-GPU references (bf16 tolerance); plus one torchrun launch of
each example as a user would run it."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import _dist  # noqa: E402
from _common import EXAMPLES, Ctx, load_example  # noqa: E402


def setup(rank, world):
    return Ctx(rank, world, torch.device("cuda", rank), None)


def teardown(ctx):
    pass


def case_moe_layer_matches_reference(ctx):
    moe = load_example("moe_layer")
    errors = moe.run(ctx.rank, ctx.world, dist.group.WORLD, steps=2, check=True, verbose=False)
    assert set(errors) == {"output", "grad_x", "grad_router", "grad_experts"}
    assert max(errors.values()) <= moe.TOLERANCE, errors


def case_decode_loop_fp8_matches_reference(ctx):
    decode = load_example("decode_loop")
    worst = decode.run(ctx.rank, ctx.world, dist.group.WORLD, steps=3, check=True, use_fp8=True, verbose=False)
    assert worst <= decode.TOLERANCE, worst


def case_decode_loop_bf16_matches_reference(ctx):
    decode = load_example("decode_loop")
    worst = decode.run(ctx.rank, ctx.world, dist.group.WORLD, steps=3, check=True, use_fp8=False, verbose=False)
    assert worst <= decode.TOLERANCE, worst


CASES = [name for name in list(globals()) if name.startswith("case_")]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}gpus")
def results(request):
    _dist.require_gpus(request.param)
    return _dist.run_cases(os.path.abspath(__file__), CASES, request.param, timeout_s=180)


@pytest.mark.parametrize("case", CASES)
def test_example(results, case):
    results.check(case)


@pytest.mark.parametrize("example, args", [("moe_layer.py", ["--steps", "2"]), ("decode_loop.py", ["--steps", "2"])])
def test_torchrun(example, args):
    """As a user runs it: torchrun, NCCL process group, the package found like the tests find it."""
    _dist.require_gpus(2)
    env = dict(os.environ, **_dist.ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the epx this test imports
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(EXAMPLES, example)] + args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
