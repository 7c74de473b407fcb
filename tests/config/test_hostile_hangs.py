"""Connector and predicate code that never returns, met by the vLLM checks (``explain``,
``vllm-args`` and ``validate --check-vllm`` import the modules a config names): each ends in
a one-line error within the limit of :mod:`kvcompose.config.deadline`, never in a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from config_helpers import ROOT, needs_vllm
from hostile_helpers import assert_clean_error, cli

from kvcompose.config.deadline import UserCodeTimeout, limit_s, time_limit

MODULES = {
    "kvc_hang_sleeps": "import time\ntime.sleep(10**6)\n",
    "kvc_hang_spins": "while True:\n    pass\n",
    # An except that swallows what it can: the timer's exception is no Exception.
    "kvc_hang_swallows": """
        import threading
        while True:
            try:
                threading.Event().wait()
            except Exception:
                pass
        """,
    # Blocks the timer's signal: only the watchdog can end it.
    "kvc_hang_blocks": """
        import signal, time
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(10**6)
        """,
    # The base class, not ExampleConnector: importing that makes vLLM 0.33 (no vllm._C on
    # CPU) print a warning, which would be a second line on stderr.
    "kvc_hang_later": """
        import time
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        class StuckConnector(KVConnectorBase_V1):
            @classmethod
            def requires_piecewise_for_cudagraph(cls, extra_config):
                time.sleep(10**6)
        """,
    "kvc_hang_predicate": """
        import time

        def pick(request):
            return True

        time.sleep(10**6)
        """,
}
LIMIT = {"KVCOMPOSE_CHECK_TIMEOUT": "2"}
MORE_TIME = "KVCOMPOSE_CHECK_TIMEOUT=SECONDS allows longer"
#: A user module that hangs while it is imported is ended by kvcompose's own limit
#: (``kvcompose.config.deadline``) before any vLLM class is looked at: no vLLM version changes
#: what these tests see, so the second vLLM's phase skips them (scripts/test.sh). The checks
#: that go through vLLM's own code (inside vLLM, ``validate --check-vllm``) run in both.
VERSION_NEUTRAL = pytest.mark.version_neutral


@pytest.fixture
def modules(tmp_path: Path) -> Path:
    for name, text in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


def leaf_file(directory: Path, connector: str, module: str) -> str:
    data = {
        "kv_role": "kv_both",
        "tree": {"leaf": {"connector": connector, "module_path": module,
                          "extra_config": {"shared_storage_path": "/kv"}}},
    }  # fmt: skip
    (directory / f"{module}.json").write_text(json.dumps(data))
    return f"{module}.json"


def run(directory: Path, *args: str, env: dict[str, str] = LIMIT) -> tuple[int, str, str]:
    return cli(*args, cwd=directory, env=env, pythonpath=(str(directory),), timeout=150)


#: The hanging module as a leaf of ``kv_connector_extra_config``, and the error it must give.
HANGING_EXTRA = "{'tree': {'leaf': {'connector': 'C', 'module_path': 'kvc_hang_sleeps'}}}"
HANGING_ERROR = (
    "kv_connector_extra_config: tree.leaf.module_path: importing module 'kvc_hang_sleeps' "
    f"did not finish within 2 s ({MORE_TIME})"
)


def python(directory: Path, code: str, *args: str, **env: str) -> tuple[str, str]:
    """``python -c CODE ARGS`` in a fresh process (where no pytest-timeout owns SIGALRM),
    the modules importable, the limit set as in ``run`` -> (stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPOSE_")}
    environ.update(LIMIT, PYTHONPATH=os.pathsep.join([str(ROOT), str(directory)]), **env)
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=directory, env=environ, capture_output=True,
        timeout=300,
    )  # fmt: skip
    return proc.stdout.decode(), proc.stderr.decode()


@pytest.mark.vllm_process
@VERSION_NEUTRAL
@needs_vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("module", ["kvc_hang_sleeps", "kvc_hang_spins", "kvc_hang_swallows"])
def test_a_module_that_never_finishes_importing(modules: Path, module: str) -> None:
    name = leaf_file(modules, "C", module)
    expected = (
        f"{name}:1: tree.leaf.module_path: importing module '{module}' did not finish "
        f"within 2 s ({MORE_TIME})"
    )
    for verb in ("explain", "vllm-args") if module == "kvc_hang_sleeps" else ("explain",):
        assert_clean_error(run(modules, verb, name), expected)


@pytest.mark.vllm_process
@needs_vllm
@pytest.mark.timeout(300)
def test_inside_vllm_the_same_checks_end_in_a_config_error(modules: Path) -> None:
    # What vLLM's engine does with kv_connector_extra_config.
    out, err = python(
        modules,
        "from kvcompose.config import ConfigError, tree_from_extra_config\n"
        "try:\n"
        f"    tree_from_extra_config({HANGING_EXTRA}, env={{}}, check_vllm=True)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n",
    )
    assert out.strip() == HANGING_ERROR, err[-2000:]


@needs_vllm
@pytest.mark.engine
@pytest.mark.timeout(400)
def test_a_real_engine_fails_to_start_instead_of_hanging(modules: Path, tiny_model: Path) -> None:
    # vLLM's own engine process (multiprocessing on): its EngineCore runs the checks.
    out, err = python(
        modules,
        "import sys\n"
        "from kvcompose.engine.llm import make_llm\n"
        "cfg = {'kv_connector': 'KVCompose', 'kv_connector_module_path': 'kvcompose',\n"
        f"       'kv_connector_extra_config': {HANGING_EXTRA}}}\n"
        "try:\n"
        "    with make_llm(sys.argv[1], cfg):\n"
        "        print('started')\n"
        "except RuntimeError as exc:\n"
        "    print('failed:', exc)\n",
        str(tiny_model),
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
    )
    assert "failed: Engine core initialization failed" in out, (out[-3000:], err[-3000:])
    assert f"ConfigError: {HANGING_ERROR}" in err, err[-3000:]


@pytest.mark.vllm_process
@needs_vllm
@pytest.mark.timeout(300)
def test_validate_check_vllm_and_a_class_method_that_never_returns(modules: Path) -> None:
    name = leaf_file(modules, "StuckConnector", "kvc_hang_later")
    assert_clean_error(
        run(modules, "validate", "--check-vllm", name),
        f"{name}:1: tree.leaf: connector 'StuckConnector': its checks did not finish within "
        f"2 s ({MORE_TIME})",
    )
    # --offline imports nothing: the file alone is fine.
    code, _, err = run(modules, "explain", "--offline", name)
    assert code == 0, err[-2000:]


@pytest.mark.vllm_process
@VERSION_NEUTRAL
@needs_vllm
@pytest.mark.timeout(300)
def test_a_route_predicate_module_that_never_finishes_importing(modules: Path) -> None:
    leaf = {"connector": "ExampleConnector", "extra_config": {"shared_storage_path": "/kv"}}
    data = {
        "kv_role": "kv_both",
        "tree": {"route": {
            "name": "r", "default": "a",
            "rules": [{"predicate": "kvc_hang_predicate:pick", "child": "a"}],
            "children": [{"leaf": {"name": "a", **leaf}}, {"leaf": {"name": "b", **leaf}}],
        }},
    }  # fmt: skip
    (modules / "route.json").write_text(json.dumps(data))
    assert_clean_error(
        run(modules, "explain", "route.json"),
        "route.json:1: tree.route.rules[0].predicate: importing module 'kvc_hang_predicate' "
        f"did not finish within 2 s ({MORE_TIME})",
    )


@pytest.mark.vllm_process
@VERSION_NEUTRAL
@needs_vllm
@pytest.mark.timeout(300)
def test_code_that_cannot_be_interrupted_ends_the_process_with_a_message(modules: Path) -> None:
    name = leaf_file(modules, "C", "kvc_hang_blocks")
    started = time.monotonic()
    assert_clean_error(
        run(modules, "explain", name),
        "kvcompose: checking connector 'C' did not return within 7 s and cannot be "
        "interrupted (set KVCOMPOSE_CHECK_TIMEOUT to allow longer)",
    )
    assert time.monotonic() - started < 140


@pytest.mark.vllm_process
@VERSION_NEUTRAL
@needs_vllm
@pytest.mark.timeout(300)
def test_a_bad_limit_is_a_clean_error(modules: Path) -> None:
    name = leaf_file(modules, "C", "kvc_hang_sleeps")
    assert_clean_error(
        run(modules, "explain", name, env={"KVCOMPOSE_CHECK_TIMEOUT": "abc"}),
        f"{name}:1: KVCOMPOSE_CHECK_TIMEOUT='abc': must be a number of seconds (0: no limit)",
    )


def test_the_limit_raises_in_the_body_and_puts_the_signal_back() -> None:
    previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's, if any
    try:
        started = time.monotonic()
        with pytest.raises(UserCodeTimeout), time_limit(0.2, "a test"):
            time.sleep(30)
        assert time.monotonic() - started < 10
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with time_limit(5, "a test"):
            pass  # finishing in time leaves nothing running
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_the_limit_leaves_another_handler_of_the_signal_alone() -> None:
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        with time_limit(0.1, "a test"):
            time.sleep(0.4)
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
        assert fired == []
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCOMPOSE_CHECK_TIMEOUT", raising=False)
    assert limit_s() == 120
    monkeypatch.setenv("KVCOMPOSE_CHECK_TIMEOUT", "0")
    assert limit_s() == 0
    monkeypatch.setenv("KVCOMPOSE_CHECK_TIMEOUT", " 2.5 ")
    assert limit_s() == 2.5
    for bad in ("-1", "nan", "inf", "1e999", "2 s"):
        monkeypatch.setenv("KVCOMPOSE_CHECK_TIMEOUT", bad)
        with pytest.raises(ValueError, match="must be a number of seconds"):
            limit_s()
