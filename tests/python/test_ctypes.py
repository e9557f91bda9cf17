"""The ctypes binding on a machine without a GPU (and without torch): the library loads, every function of
epx.h is bound, the struct mirrors match the C compiler's layout, and failures come back as the right
exception with the library's message."""

import ctypes
import os
import shutil
import subprocess

import pytest

import epx
from epx import _lib, errors
from epx.bootstrap import AllGather

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER_DIR = os.path.join(REPO, "include")

ALL_STATUSES = range(0, 10)


def test_library_loads_with_the_expected_version():
    lib = epx.lib()
    assert os.path.isfile(lib.path)
    assert lib.version[0] == _lib.ABI_MAJOR and lib.version[1] >= _lib.ABI_MIN_MINOR


def test_every_function_of_the_header_is_bound():
    with open(os.path.join(HEADER_DIR, "epx", "epx.h")) as f:
        header = f.read()
    declared = {word.split("(")[0] for word in header.replace("\n", " ").split() if word.startswith("epx_")
                and "(" in word}
    assert declared == set(_lib.SIGNATURES), declared ^ set(_lib.SIGNATURES)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to read the header's layout")
def test_struct_mirrors_match_the_c_layout(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "epx/epx.h"', "int main(void) {"]
    for cname, cls in _lib.STRUCTS.items():
        lines.append(f'  printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.check_call(["cc", "-std=c11", "-I", HEADER_DIR, str(src), "-o", str(exe)])
    c_layout = {}
    for line in subprocess.check_output([str(exe)], text=True).splitlines():
        cname, field, value = line.split()
        c_layout[(cname, field)] = int(value)
    for cname, cls in _lib.STRUCTS.items():
        assert ctypes.sizeof(cls) == c_layout[(cname, "sizeof")], cname
        for field, _ in cls._fields_:
            assert getattr(cls, field).offset == c_layout[(cname, field)], f"{cname}.{field}"


def test_build_flag_is_zero_or_one():
    assert epx.lib().epx_built_with_nvshmem() in (0, 1)


def test_status_strings_are_distinct():
    lib = epx.lib()
    texts = [lib.status_string(s) for s in ALL_STATUSES]
    assert all(texts) and len(set(texts)) == len(texts)
    assert lib.status_string(15) not in texts


def test_failures_raise_the_status_class_with_the_message():
    with pytest.raises(errors.InvalidArgumentError, match="num_ranks") as info:
        _lib.default_config("dispatch", 0)
    assert info.value.status == 1
    assert isinstance(info.value, ValueError) and isinstance(info.value, epx.EpxError)
    with pytest.raises(epx.InvalidArgumentError, match="num_ranks"):
        _lib.default_config("combine", _lib.limits().max_ranks + 1)
    # success clears the message
    _lib.default_config("dispatch", 2)
    assert epx.lib().last_error() == ""


def test_error_classes_cover_every_status():
    for status in ALL_STATUSES[1:]:
        e = errors.error_for(status, "why")
        assert isinstance(e, errors.EpxError) and e.status == status and str(e) == "why"
        assert type(e) is not errors.EpxError
    unknown = errors.error_for(42, "later status")
    assert type(unknown) is errors.EpxError and unknown.status == 42
    assert issubclass(errors.TimeoutError, TimeoutError)
    assert issubclass(errors.NotSupportedError, NotImplementedError)
    assert issubclass(errors.BufferTooSmallError, ValueError)


def test_default_configs_and_size_hints():
    for r in range(1, 9):
        d = epx.Config.from_c(_lib.default_config("dispatch", r))
        assert d.num_sms >= 2 and d.num_sms % 2 == 0
        assert d.num_max_nvl_chunked_recv_tokens >= d.num_max_nvl_chunked_send_tokens
        # one ring per (channel, source rank); at 2 ranks only the peer's, at 1 rank none (own rows take no ring)
        assert (d.get_nvl_buffer_size_hint(7168 * 2, r) > 0) == (r > 1)
        assert d.get_rdma_buffer_size_hint(7168 * 2, r) == 0
    c = epx.Config(24, 6, 256)
    assert c.get_nvl_buffer_size_hint(4096, 8) > c.get_nvl_buffer_size_hint(2048, 8)
    with pytest.raises(epx.InvalidArgumentError, match="hidden_bytes"):
        c.get_nvl_buffer_size_hint(100, 4)
    with pytest.raises(epx.InvalidArgumentError, match="num_sms"):
        epx.Config(7, 6, 256).get_nvl_buffer_size_hint(4096, 4)
    assert c.get_rdma_buffer_size_hint(4096, 16) == _lib.internode_size_hints(c.to_c(), 4096, 16, 8)[1] > 0
    with pytest.raises(TypeError):
        epx.Config(24.0, 6, 256)
    assert _lib.ll_size_hint(128, 7168, 8, 256) > 0
    with pytest.raises(epx.InvalidArgumentError, match="num_experts"):
        _lib.ll_size_hint(128, 7168, 8, 100)
    with pytest.raises(epx.InvalidArgumentError):
        _lib.ll_size_hint(0, 7168, 8, 256)


def test_config_rdma_fields_reach_the_library_and_come_back():
    c = epx.Config(24, 6, 256, 4, 96)
    raw = c.to_c()
    assert (raw.num_sms, raw.num_max_send_tokens, raw.num_max_recv_tokens, raw.num_max_rdma_send_tokens,
            raw.num_max_rdma_recv_tokens) == (24, 6, 256, 4, 96)
    assert epx.Config.from_c(raw) == c
    assert epx.Config(24, 6, 256) != c  # the RDMA fields count in equality
    with pytest.raises(TypeError, match="num_max_rdma_chunked_recv_tokens"):
        epx.Config(24, 6, 256, 4, 96.0)
    # The library's defaults carry its RDMA fields, which must make a valid internode config.
    for kind in ("dispatch", "combine"):
        for r in (2, 8, 16):
            raw = _lib.default_config(kind, r)
            d = epx.Config.from_c(raw)
            assert d.num_max_rdma_chunked_send_tokens == raw.num_max_rdma_send_tokens >= 1
            assert d.num_max_rdma_chunked_recv_tokens == raw.num_max_rdma_recv_tokens
            assert raw.num_max_rdma_recv_tokens >= 2 * raw.num_max_rdma_send_tokens
            assert d.get_rdma_buffer_size_hint(7168 * 2, r, num_nvl_ranks=1) > 0


def test_internode_size_hints(monkeypatch):
    monkeypatch.delenv("EPX_NUM_NVL_RANKS", raising=False)
    monkeypatch.delenv("EPX_FORCE_INTERNODE", raising=False)
    c = epx.Config.from_c(_lib.default_config("dispatch", 2))
    hidden_bytes = 7168 * 2
    nvl_1, rdma_1 = _lib.internode_size_hints(c.to_c(), hidden_bytes, 2, 1)  # 2 domains of 1 GPU
    nvl_2, rdma_2 = _lib.internode_size_hints(c.to_c(), hidden_bytes, 2, 2)  # 1 domain of 2 (forced)
    assert nvl_1 == 0 and rdma_1 > 0  # one GPU per domain forwards to itself only
    assert nvl_2 > 0 and rdma_2 > 0
    assert _lib.internode_size_hints(c.to_c(), hidden_bytes, 2, 0) == (nvl_2, rdma_2)  # 0: as many as one domain holds
    # 2 ranks without a split: one domain, no RDMA buffer, the NVLink rings of one domain.
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2) == 0
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=2) == 0
    intranode = _lib.nvl_size_hint(c.to_c(), hidden_bytes, 2)
    assert c.get_nvl_buffer_size_hint(hidden_bytes, 2) == intranode  # as before the internode mode
    # 2 domains of 1 GPU: by argument, or by the environment as a Buffer would see it.
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=1) == rdma_1
    assert c.get_nvl_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=1) == intranode
    monkeypatch.setenv("EPX_NUM_NVL_RANKS", "1")
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2) == rdma_1
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=2) == 0  # the argument wins
    monkeypatch.setenv("EPX_NUM_NVL_RANKS", "9")
    with pytest.raises(ValueError, match="EPX_NUM_NVL_RANKS"):
        c.get_rdma_buffer_size_hint(hidden_bytes, 2)
    monkeypatch.setenv("EPX_NUM_NVL_RANKS", "two")
    with pytest.raises(ValueError, match="EPX_NUM_NVL_RANKS"):
        c.get_nvl_buffer_size_hint(hidden_bytes, 2)
    monkeypatch.delenv("EPX_NUM_NVL_RANKS")
    # Forced internode inside one domain needs the network rings too.
    monkeypatch.setenv("EPX_FORCE_INTERNODE", "1")
    assert c.get_rdma_buffer_size_hint(hidden_bytes, 2) == rdma_2
    assert c.get_nvl_buffer_size_hint(hidden_bytes, 2) == max(intranode, nvl_2)
    monkeypatch.setenv("EPX_FORCE_INTERNODE", "yes")
    with pytest.raises(ValueError, match="EPX_FORCE_INTERNODE"):
        c.get_rdma_buffer_size_hint(hidden_bytes, 2)
    monkeypatch.delenv("EPX_FORCE_INTERNODE")
    # More ranks than one domain holds: the default domain is 8 ranks.
    big = epx.Config.from_c(_lib.default_config("dispatch", 16))
    want = _lib.internode_size_hints(big.to_c(), hidden_bytes, 16, 8)[1]
    assert big.get_rdma_buffer_size_hint(hidden_bytes, 16) == want
    # The library's checks come through.
    with pytest.raises(epx.InvalidArgumentError, match="divide"):
        c.get_rdma_buffer_size_hint(hidden_bytes, 12)
    with pytest.raises(epx.InvalidArgumentError, match="divide"):
        c.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=4)
    odd = epx.Config(24, 6, 256, 8, 8)  # one network chunk: fine inside one domain, refused for the internode mode
    assert odd.get_nvl_buffer_size_hint(hidden_bytes, 2) == _lib.nvl_size_hint(odd.to_c(), hidden_bytes, 2)
    with pytest.raises(epx.InvalidArgumentError, match="num_max_rdma_recv_tokens"):
        odd.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=1)
    with pytest.raises(epx.InvalidArgumentError, match="num_max_rdma_recv_tokens"):
        odd.get_nvl_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=1)
    with pytest.raises(TypeError, match="num_nvl_ranks"):
        c.get_rdma_buffer_size_hint(hidden_bytes, 2, num_nvl_ranks=1.0)


def test_operations_reject_a_null_buffer():
    lib = epx.lib()
    config = epx.Config(24, 6, 256).to_c()
    null = None
    calls = {
        "check": lambda: lib.epx_buffer_check(null, None),
        "set_timeout": lambda: lib.epx_buffer_set_timeout(null, 5.0),
        "layout": lambda: lib.epx_get_dispatch_layout(null, _lib.LayoutArgs(), _lib.LayoutOutputs(), None),
        "notify": lambda: lib.epx_notify_dispatch(null, _lib.DispatchArgs(), config, _lib.DispatchHandle(),
                                                  _lib.DispatchCounts(), None),
        "dispatch": lambda: lib.epx_dispatch(null, _lib.DispatchArgs(), config, _lib.DispatchHandle(),
                                             _lib.DispatchOutputs(), None),
        "combine": lambda: lib.epx_combine(null, _lib.CombineArgs(), config, _lib.DispatchHandle(),
                                           _lib.CombineOutputs(), None),
        "ll_clean": lambda: lib.epx_ll_clean(null, None),
        "ll_dispatch": lambda: lib.epx_ll_dispatch(null, _lib.LLDispatchArgs(), _lib.LLDispatchOutputs(), 3,
                                                   _lib.LLHandle(), None),
        "region": lambda: lib.epx_buffer_region(null, _lib.EPX_REGION_NVL, ctypes.byref(ctypes.c_void_p()),
                                                ctypes.byref(ctypes.c_int64())),
        "ll_transport": lambda: lib.epx_buffer_ll_transport(null, _lib.LLTransportInfo()),
        "is_internode": lambda: lib.epx_buffer_is_internode(null, ctypes.byref(ctypes.c_int())),
    }
    for name, call in calls.items():
        status = call()
        assert status == 1, name
        with pytest.raises(epx.InvalidArgumentError, match="buffer"):
            lib.check(status)
    assert lib.epx_buffer_destroy(None) == 0


def test_buffer_region_checks_its_arguments_before_the_buffer():
    for which in (-1, 2):
        with pytest.raises(epx.InvalidArgumentError, match=f"EPX_REGION_NVL .*got {which}"):
            _lib.buffer_region(None, which)
    with pytest.raises(epx.InvalidArgumentError, match="buffer"):
        _lib.buffer_region(None, _lib.EPX_REGION_RDMA)


def test_create_rejects_a_bad_bootstrap_before_touching_cuda():
    boot = AllGather(1, 1, lambda mine: [mine])  # rank 1 of 1
    options = _lib.BufferOptions(1 << 20, 0, 0, 0, 0.0, -1)
    out = ctypes.c_void_p(0x10)
    lib = epx.lib()
    status = lib.epx_buffer_create(ctypes.byref(boot.struct), ctypes.byref(options), ctypes.byref(out))
    with pytest.raises(epx.InvalidArgumentError, match="rank"):
        lib.check(status)
    assert not out.value


def test_create_without_a_gpu_fails_cleanly_or_succeeds_with_one():
    calls = []
    boot = AllGather(0, 1, lambda mine: calls.append(len(mine)) or [mine])
    options = _lib.BufferOptions(1 << 20, 0, 0, 0, 0.0, -1)
    out = ctypes.c_void_p()
    lib = epx.lib()
    status = lib.epx_buffer_create(ctypes.byref(boot.struct), ctypes.byref(options), ctypes.byref(out))
    if status == 0:  # a GPU is visible: creation used the callback; destruction must too
        assert calls and out.value
        lib.check(lib.epx_buffer_destroy(out.value))
        return
    with pytest.raises(epx.CudaError) as info:
        lib.check(status)
    assert str(info.value)
    assert not out.value


def test_allgather_callback_fills_recv_and_reports_exceptions():
    boot = AllGather(1, 3, lambda mine: [b"a" * len(mine), mine, b"c" * len(mine)])
    send = ctypes.create_string_buffer(b"xyzw", 4)
    recv = ctypes.create_string_buffer(12)
    assert boot.callback(None, ctypes.addressof(send), ctypes.addressof(recv), 4) == 0
    assert recv.raw == b"aaaaxyzwcccc"

    def broken(mine):
        raise ConnectionError("peer went away")

    bad = AllGather(0, 2, broken)
    assert bad.callback(None, ctypes.addressof(send), ctypes.addressof(recv), 4) != 0
    assert isinstance(bad.error, ConnectionError) and "peer went away" in bad.error_text

    short = AllGather(0, 2, lambda mine: [mine])  # wrong number of parts
    assert short.callback(None, ctypes.addressof(send), ctypes.addressof(recv), 4) != 0
    assert "parts" in str(short.error)


def test_library_search_order(monkeypatch, tmp_path):
    monkeypatch.setenv("EPX_LIBRARY", str(tmp_path / "custom.so"))
    paths = _lib.candidate_paths()
    assert paths[0] == str(tmp_path / "custom.so")
    assert paths[1].endswith(os.path.join("epx", "lib", "libepx.so"))
