"""The examples' expert counts, on a CPU machine: 8 experts a rank by default, and a count that does not split over the
ranks refused with a message before any GPU work."""

import pytest

pytest.importorskip("torch")

from _common import load_example  # noqa: E402


def test_moe_layer_experts_default_to_eight_a_rank():
    moe = load_example("moe_layer")
    assert [moe.experts_for(w) for w in (1, 2, 3, 4, 8)] == [8, 16, 24, 32, 64]
    assert moe.experts_for(4, 16) == 16


@pytest.mark.parametrize("world, experts", [(3, 16), (2, 0), (4, -4)])
def test_moe_layer_refuses_experts_that_do_not_split(world, experts):
    moe = load_example("moe_layer")
    with pytest.raises(ValueError, match=f"num_experts \\({experts}\\) must be a positive multiple of the world size "
                                         f"\\({world}\\)"):
        moe.experts_for(world, experts)
    with pytest.raises(ValueError, match="must be a positive multiple"):
        moe.run(0, world, None, num_experts=experts)  # refused before the Buffer is made


def test_decode_loop_refuses_experts_that_do_not_split():
    decode = load_example("decode_loop")
    with pytest.raises(ValueError, match=r"num_experts \(16\) must be a positive multiple of the world size \(3\)"):
        decode.run(0, 3, None, num_experts=16)
