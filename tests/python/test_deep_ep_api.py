"""epx.Buffer against deep_ep.Buffer's public API (the version the seeds describe), on a CPU: every method deep_ep
has, with its parameter names, order and defaults (so that positional calls mean the same thing), the parameters
that have no effect here (accepted and type-checked), rank masking (enable_shrink and the mask calls' checks), and the
docstrings (every argument of every public method documented).

The table below is deep_ep's API written out by hand; a drift of a name, an order or a default in epx fails here.
"""

import ctypes
import inspect

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
import epx.buffer as epx_buffer  # noqa: E402
from epx.bootstrap import from_mpi_comm  # noqa: E402

_ = inspect.Parameter.empty

# deep_ep.Buffer's public methods: name -> [(parameter, default or _ for none)], self excluded. Static methods are
# listed in STATIC.
DEEP_EP = {
    "__init__": [("group", _), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "destroy": [],
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", _)],
    "capture": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_ranks", _),
                                       ("num_experts", _)],
    "get_comm_stream": [],
    "get_local_buffer_tensor": [("dtype", _), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_dispatch_config": [("num_ranks", _)],
    "get_combine_config": [("num_ranks", _)],
    "get_dispatch_layout": [("topk_idx", _), ("num_experts", _), ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", _), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_experts", _)],
    "low_latency_dispatch": [("x", _), ("topk_idx", _), ("num_max_dispatch_tokens_per_rank", _), ("num_experts", _),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": [("x", _), ("topk_idx", _), ("topk_weights", _), ("handle", _), ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False),
                            ("out", None), ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": [("rank_to_mask", _), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", _)],
    "low_latency_clean_mask_buffer": [],
    "get_next_low_latency_combine_buffer": [("handle", _)],
}
# internode_dispatch / internode_combine: deep_ep's dispatch / combine signatures, with config's default too.
DEEP_EP["internode_dispatch"] = DEEP_EP["dispatch"]
DEEP_EP["internode_combine"] = DEEP_EP["combine"]
STATIC = {"is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_dispatch_config",
          "get_combine_config"}
# Where epx knowingly gives a default that deep_ep does not (a superset: every deep_ep call still works):
# group may be omitted when comm is given.
EPX_EXTRA_DEFAULTS = {("__init__", "group"): None}
# epx's own keyword-only extensions (they cannot shift a positional argument).
EPX_KEYWORD_ONLY = {("combine", "reduction"): None, ("internode_combine", "reduction"): None,
                    ("low_latency_dispatch", "topk_weights"): None, ("low_latency_combine", "reduction"): None,
                    ("__init__", "num_recv_bytes"): 0, ("dispatch", "outputs_in_buffer"): False,
                    ("internode_dispatch", "outputs_in_buffer"): False, ("combine", "inputs_in_buffer"): False,
                    ("internode_combine", "inputs_in_buffer"): False}
# epx's own static methods.
EPX_STATIC = {"get_recv_region_size_hint"}


def _params(name):
    params = list(inspect.signature(getattr(epx.Buffer, name)).parameters.values())
    if name not in STATIC and name not in EPX_STATIC:
        assert params and params[0].name == "self", f"{name} must be an instance method"
        params = params[1:]
    return params


@pytest.mark.parametrize("name", sorted(DEEP_EP))
def test_every_deep_ep_method_with_its_parameters(name):
    assert hasattr(epx.Buffer, name), f"epx.Buffer lacks deep_ep's {name}"
    is_static = isinstance(inspect.getattr_static(epx.Buffer, name), staticmethod)
    assert is_static == (name in STATIC), f"{name}: static in deep_ep" if name in STATIC else f"{name}: not static"
    params = _params(name)
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    others = [p for p in params if p.kind != p.POSITIONAL_OR_KEYWORD]
    got = [(p.name, p.default) for p in positional]
    want = [(n, EPX_EXTRA_DEFAULTS.get((name, n), d)) for n, d in DEEP_EP[name]]
    assert got == want, f"{name}: names, order or defaults differ from deep_ep"
    for p in others:  # extensions: keyword-only, with a default, known
        assert p.kind == p.KEYWORD_ONLY and (name, p.name) in EPX_KEYWORD_ONLY, f"{name}: unexpected {p}"
        assert p.default == EPX_KEYWORD_ONLY[(name, p.name)]


def test_runtime_queries():
    """What deep_ep users read from deep_ep's runtime object, on the Buffer (R = 4 as 2 domains of 2)."""
    for rank, (domain, local) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        buf = epx.Buffer._unlaunched(4, rank=rank, num_nvl_ranks=2, internode=True, low_latency_mode=False)
        assert buf.get_num_rdma_ranks() == 2
        assert buf.get_rdma_rank() == domain
        assert buf.get_root_rdma_rank(True) == local and buf.get_root_rdma_rank(False) == 0
        assert buf.is_internode_available()
        assert not buf.is_available()  # no native buffer behind it
    one = epx.Buffer._unlaunched(2, rank=1)
    assert (one.get_num_rdma_ranks(), one.get_rdma_rank(), one.is_internode_available()) == (1, 0, False)
    assert one.enable_shrink is False and one.explicitly_destroy is True
    assert epx.Buffer.is_sm90_compiled() is True


# ---- construction: positional meaning, no-effect parameters, enable_shrink, comm -------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    """The constructor stops with "needs a CUDA device" once every argument check has passed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_positional_arguments_mean_what_they_mean_in_deep_ep(no_cuda):
    base = (object(), 0, 0, False, 24, True, False)  # group .. allow_mnnvl
    with pytest.raises(TypeError, match="use_fabric"):
        epx.Buffer(*base, "8th")
    with pytest.raises(TypeError, match="explicitly_destroy"):
        epx.Buffer(*base, False, "9th")
    with pytest.raises(TypeError, match="enable_shrink"):
        epx.Buffer(*base, False, False, "10th")
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        epx.Buffer(None, *base[1:], False, False, False, object())
    with pytest.raises(RuntimeError, match="CUDA device"):  # every deep_ep argument given positionally, all valid
        epx.Buffer(*base, True, True, False, None)


@pytest.mark.parametrize("name, bad, error", [
    ("num_qps_per_rank", 0, ValueError), ("num_qps_per_rank", 1.0, TypeError),
    ("allow_nvlink_for_low_latency_mode", "no", TypeError), ("allow_mnnvl", None, TypeError),
    ("use_fabric", "yes", TypeError), ("explicitly_destroy", 1.5, TypeError), ("enable_shrink", "no", TypeError),
    ("low_latency_mode", [], TypeError),
])
def test_parameters_without_effect_are_still_type_checked(no_cuda, name, bad, error):
    with pytest.raises(error, match=name):
        epx.Buffer(object(), **{name: bad})


def test_parameters_without_effect_are_accepted(no_cuda):
    with pytest.raises(RuntimeError, match="CUDA device"):
        epx.Buffer(object(), num_qps_per_rank=8, allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True,
                   use_fabric=True, enable_shrink=False)


def test_enable_shrink_is_accepted(no_cuda):
    for value in (True, 1, False):
        with pytest.raises(RuntimeError, match="CUDA device"):
            epx.Buffer(object(), num_rdma_bytes=1 << 20, low_latency_mode=True, enable_shrink=value)


def test_rank_masking_methods_need_enable_shrink():
    buf = epx.Buffer._unlaunched(4)
    for call in (lambda: buf.low_latency_update_mask_buffer(1, True), lambda: buf.low_latency_update_mask_buffer(1),
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(4, dtype=torch.int32)),
                 buf.low_latency_clean_mask_buffer):
        with pytest.raises(ValueError, match="enable_shrink"):
            call()


def test_rank_masking_methods_check_their_arguments():
    buf = epx.Buffer._unlaunched(4)
    buf.enable_shrink = True  # what Buffer(enable_shrink=True) sets
    for bad, error in ((-1, ValueError), (4, ValueError), (1.0, TypeError), (None, TypeError)):
        with pytest.raises(error, match="rank_to_mask"):
            buf.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(TypeError, match="mask"):
        buf.low_latency_update_mask_buffer(1, "yes")
    for bad in (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                torch.zeros(8, dtype=torch.int32)[::2], [0, 0, 0, 0]):
        with pytest.raises((TypeError, ValueError), match="mask_status"):
            buf.low_latency_query_mask_buffer(bad)
    # Valid arguments reach the library, which this unlaunched Buffer does not have.
    for call in (lambda: buf.low_latency_update_mask_buffer(3, True),
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(4, dtype=torch.int32)),
                 buf.low_latency_clean_mask_buffer):
        with pytest.raises(epx.FailedStateError):
            call()


class FakeComm:
    """An mpi4py communicator look-alike: rank `rank` of `size`, whose allgather returns every rank's object
    (the others' made by `others`)."""

    def __init__(self, rank=0, size=2, others=lambda r, mine: mine):
        self.rank, self.size, self.others, self.calls = rank, size, others, 0

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def allgather(self, obj):
        self.calls += 1
        return [obj if r == self.rank else self.others(r, obj) for r in range(self.size)]


class Chosen(Exception):
    pass


def test_group_wins_over_comm_as_in_deep_ep(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def torch_group(group, device):
        raise Chosen("group")

    def mpi(comm):
        raise Chosen("comm")

    monkeypatch.setattr(epx_buffer, "from_torch_group", torch_group)
    monkeypatch.setattr(epx_buffer, "from_mpi_comm", mpi)
    with pytest.raises(Chosen, match="group"):
        epx.Buffer(object(), comm=FakeComm())
    with pytest.raises(Chosen, match="comm"):
        epx.Buffer(None, comm=FakeComm())
    with pytest.raises(Chosen, match="comm"):
        epx.Buffer(comm=FakeComm())  # epx allows leaving group out when comm is given
    with pytest.raises(ValueError, match="group"):
        epx.Buffer(None)


def test_an_mpi_communicator_carries_the_bootstrap():
    """comm is used for the bootstrap's all-gather of bytes (bootstrap.from_mpi_comm), as the C library calls it."""
    comm = FakeComm(rank=1, size=3, others=lambda r, mine: bytes([r]) * len(mine))
    boot = from_mpi_comm(comm)
    assert (boot.rank, boot.size) == (1, 3)
    send = ctypes.create_string_buffer(b"\x07\x07\x07\x07", 4)
    recv = ctypes.create_string_buffer(12)
    assert boot._call(None, ctypes.addressof(send), ctypes.addressof(recv), 4) == 0
    assert recv.raw == b"\x00" * 4 + b"\x07" * 4 + b"\x02" * 4 and comm.calls == 1
    bad = from_mpi_comm(FakeComm(size=2, others=lambda r, mine: b"short"))
    assert bad._call(None, ctypes.addressof(send), ctypes.addressof(recv), 4) != 0 and bad.error is not None


# ---- internode entry points ------------------------------------------------------------------------------------
def test_internode_entry_points_pass_every_argument_through(monkeypatch):
    buf = epx.Buffer._unlaunched(4, num_nvl_ranks=2, internode=True, low_latency_mode=False)
    seen = {}
    monkeypatch.setattr(buf, "dispatch", lambda *a, **k: seen.setdefault("dispatch", (a, k)))
    monkeypatch.setattr(buf, "combine", lambda *a, **k: seen.setdefault("combine", (a, k)))
    dispatch_args = tuple(f"a{i}" for i in range(14))
    buf.internode_dispatch(*dispatch_args, outputs_in_buffer="o")
    assert seen["dispatch"] == (dispatch_args, {"outputs_in_buffer": "o"})
    combine_args = tuple(f"c{i}" for i in range(8))
    buf.internode_combine(*combine_args, reduction="flat", inputs_in_buffer="i")
    assert seen["combine"] == (combine_args, {"reduction": "flat", "inputs_in_buffer": "i"})


def test_internode_entry_points_check_like_dispatch_and_combine():
    buf = epx.Buffer._unlaunched(4, num_nvl_ranks=2, internode=True, low_latency_mode=False)
    with pytest.raises(TypeError, match="x must have dtype"):
        buf.internode_dispatch(torch.zeros(3, 64))
    with pytest.raises(TypeError, match="10-tuple"):
        buf.internode_combine(torch.zeros(3, 64, dtype=torch.bfloat16), (None,) * 6)


def test_internode_entry_points_refuse_a_single_domain_buffer():
    buf = epx.Buffer._unlaunched(4)
    with pytest.raises(epx.NotSupportedError, match="call dispatch"):
        buf.internode_dispatch(torch.zeros(3, 64, dtype=torch.bfloat16))
    with pytest.raises(epx.NotSupportedError, match="call combine"):
        buf.internode_combine(torch.zeros(3, 64, dtype=torch.bfloat16), None)


# ---- docstrings --------------------------------------------------------------------------------------------------
def _public_methods():
    names = ["__init__"]
    for name, value in vars(epx.Buffer).items():
        if not name.startswith("_") and callable(getattr(epx.Buffer, name)):
            names.append(name)
    for base in epx.Buffer.__mro__[1:]:
        for name in vars(base):
            if not name.startswith("_") and name not in names and callable(getattr(epx.Buffer, name)):
                names.append(name)
    return sorted(names)


# Methods documented as "those of <other>": their arguments are the other's, which documents them.
DELEGATES = {"internode_dispatch": "dispatch", "internode_combine": "combine"}
# Return values each method's docstring must name.
RETURNS = {
    "get_dispatch_layout": ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                            "is_token_in_rank", "event"],
    "dispatch": ["recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list", "handle",
                 "event"],
    "combine": ["combined_x", "combined_topk_weights", "event"],
    "low_latency_dispatch": ["recv_x", "recv_count", "handle", "event", "hook"],
    "low_latency_combine": ["combined_x", "event", "hook"],
    "get_next_low_latency_combine_buffer": ["buffer"],
    "get_local_buffer_tensor": ["tensor"],
}


def test_public_method_list_covers_deep_ep():
    assert set(DEEP_EP) <= set(_public_methods())


@pytest.mark.parametrize("name", _public_methods())
def test_every_public_method_documents_its_arguments(name):
    doc = inspect.getdoc(getattr(epx.Buffer, name)) or ""
    assert len(doc) > 40, f"{name} has no docstring"
    source = DELEGATES.get(name, name)
    if source != name:
        assert f"those of {source}" in doc
        doc = inspect.getdoc(getattr(epx.Buffer, source))
        assert [p.name for p in _params(name)] == [p.name for p in _params(source)]
    for p in _params(name):
        assert f"{p.name}:" in doc, f"{name}: argument {p.name} is not documented"
    for value in RETURNS.get(source, []):
        assert f"{value}:" in doc.split("Returns", 1)[-1], f"{name}: return value {value} is not documented"
    if source in RETURNS:
        assert "Returns" in doc


def test_outputs_in_buffer_needs_a_region_and_one_domain(monkeypatch):
    """dispatch(..., outputs_in_buffer=True) is checked before anything runs: a flag, a Buffer with num_recv_bytes,
    one NVLink domain."""
    buf = epx.Buffer._unlaunched(4)
    monkeypatch.setattr(buf, "_check_x", lambda x: (x, None, 0, (0, 0)))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="outputs_in_buffer"):
        buf.dispatch(x, outputs_in_buffer="yes")
    with pytest.raises(ValueError, match="num_recv_bytes"):
        buf.dispatch(x, outputs_in_buffer=True)
    net = epx.Buffer._unlaunched(4, num_nvl_ranks=2, internode=True, low_latency_mode=False)
    monkeypatch.setattr(net, "_check_x", lambda x: (x, None, 0, (0, 0)))
    net.num_recv_bytes = 1 << 20
    with pytest.raises(epx.NotSupportedError, match="one NVLink domain"):
        net.dispatch(x, outputs_in_buffer=True)


def test_recv_region_size_hint_checks_its_arguments():
    for kwargs, error, says in (({"num_rows": -1}, ValueError, "num_rows"), ({"hidden": 0}, ValueError, "hidden"),
                                ({"num_topk": 33}, ValueError, "num_topk"), ({"use_fp8": "no"}, TypeError, "use_fp8"),
                                ({"num_scales": 1.0}, TypeError, "num_scales")):
        args = {"num_rows": 16, "hidden": 1024, **kwargs}
        with pytest.raises(error, match=says):
            epx.Buffer.get_recv_region_size_hint(**args)
