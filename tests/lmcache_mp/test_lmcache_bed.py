"""The LMCache test bed's own parts that need no server: the dispatcher workaround and the
removal of shared-memory segments left behind (``kvcompose.testing.lmcache_*``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvcompose.testing import lmcache_dispatcher
from kvcompose.testing.lmcache_server import SHM, LMCacheServer, kvcompose_root


class _LibFnWrapper:
    """Like numba's ``llvmlite.binding.ffi._lib_fn_wrapper``: attribute reads are forwarded,
    so ``vars()`` of it is no dict (here: a string)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> str:
        return f"forwarded {name}"


def kernel() -> None: ...


def wrapper() -> None: ...


class _Owner:
    """A JIT warmup owner: holds the kernel as an instance attribute."""

    def __init__(self) -> None:
        self.kernel = kernel
        self._kernel_arg_names = ("x",)


@pytest.fixture
def module() -> types.ModuleType:
    mod = types.ModuleType("kvcompose_test_kernels")
    mod.copied = kernel
    mod.owner = _Owner()
    mod.odd = _LibFnWrapper()
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_rebind_kernels_skips_values_whose_vars_is_no_dict(module) -> None:
    lmcache_dispatcher.rebind_kernels([(kernel, wrapper)])
    assert module.copied is wrapper
    assert module.owner.kernel is wrapper
    assert "_kernel_arg_names" not in vars(module.owner)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_s_own_rebind_kernels_fails_on_them(module) -> None:
    """The workaround is needed: vLLM's function dies on such a value."""
    from vllm.triton_utils import dispatcher

    with pytest.raises(AttributeError, match="has no attribute 'get'"):
        dispatcher._rebind_kernels([(kernel, wrapper)])


def test_sitecustomize_patches_the_dispatcher_when_vllm_imports_it(tmp_path: Path) -> None:
    """A process started with the bed's site folder first on ``PYTHONPATH`` imports the
    dispatcher with ``_rebind_kernels`` replaced (a stand-in module, so no vLLM is needed)."""
    fake = tmp_path / "fake" / "vllm" / "triton_utils"
    fake.mkdir(parents=True)
    for init in (fake.parent / "__init__.py", fake / "__init__.py"):
        init.write_text("")
    (fake / "dispatcher.py").write_text("def _rebind_kernels(overrides):\n    raise ValueError\n")
    site = lmcache_dispatcher.site_dir(tmp_path / "site")
    code = (
        "from vllm.triton_utils import dispatcher\n"
        "from kvcompose.testing.lmcache_dispatcher import rebind_kernels\n"
        "assert dispatcher._rebind_kernels is rebind_kernels\n"
    )
    paths = [str(site), kvcompose_root(), str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_stop_removes_segments_left_behind_and_only_those(tmp_path: Path) -> None:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    bed = LMCacheServer(tmp_path)  # never started: only its segment bookkeeping
    before = SHM / f"lmcache_kv_test_{os.getpid()}_before"
    left = SHM / f"lmcache_kv_test_{os.getpid()}_left"
    held = SHM / f"lmcache_kv_test_{os.getpid()}_held"
    before.write_bytes(b"x")
    try:
        bed._shm_before = {before.name}
        left.write_bytes(b"x")
        held.write_bytes(b"x")
        with open(held, "r+b") as fh:
            import mmap

            with mmap.mmap(fh.fileno(), 1):  # a live mapping: not left behind
                bed.stop()
                assert held.exists()
        assert not left.exists()
        assert before.exists()
    finally:
        for path in (before, left, held):
            path.unlink(missing_ok=True)
