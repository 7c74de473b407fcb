"""The server commands the docs give start real servers, exactly as written.

A page marks what a reader copies with an HTML comment right above the fence,
``<!-- docs-serve: NAME -->``. A block named after a file (``mooncake.json``,
``shared-tier.yaml``) is what the page tells the reader to save; a block named after a server
(``engine``, ``prefill``, ``decode``, ``proxy``) is a command, run here by ``bash`` as the page
gives it. The only things set from outside are the environment variables the page's own
commands read (``MODEL``, ``PORT``, ``ENGINE``, the P/D ports), and ``PATH``/``PYTHONPATH`` so
that ``python`` and ``kvcompose`` are this checkout's. A page whose command stops working
fails here.

- ``docs/shared-tier.md``: a master and a pool from the test bed (``MooncakeCluster``; the
  page's ``mooncake.json`` gets the bed's two addresses), the page's tree and its ``engine``
  command started twice (``ENGINE`` 1 and 2, as the page says); a completion on engine 1
  saves its blocks to the shared tier, and engine 2 answers the same prompt alike, loading
  its 256 tokens from there.
- ``docs/pd.md``: the page's ``prefill``, ``decode`` and ``proxy`` commands; a completion
  through the proxy (P prefills, D pulls the KV over NIXL and decodes) equals P's own answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.testing.ports import free_port

httpx = pytest.importorskip("httpx")  # the proxy extra's client; not in the lean 0.33 env

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"^<!-- docs-serve: (\S+) -->\n```\w*\n(.*?)^```", re.M | re.S)
#: a prompt of 300 words of the tiny model's vocabulary (two 128-token blocks and a tail)
PROMPT = " ".join(f"w{(7 * i) % 1000}" for i in range(300))


def marked_blocks(page: str) -> dict[str, str]:
    """The page's ``<!-- docs-serve: NAME -->`` blocks by name."""
    found = {m.group(1): m.group(2) for m in MARKED.finditer((ROOT / page).read_text())}
    assert found, f"{page} marks no block for this test"
    return found


def page_env(**page_vars: str) -> dict[str, str]:
    """The test's environment for a page's commands: this checkout's ``python`` and
    ``kvcompose`` first, the variables the page reads, and none of the test bed's
    single-process engine setting (a server runs its engine core in a process of its own)."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(page_vars)
    return env


class PageCommand:
    """One of a page's commands, run by bash in a process group of its own."""

    def __init__(self, name: str, script: str, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_healthy(self, port: int, timeout: float = 480.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise AssertionError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def kill_after(self, deadline: float) -> None:
        """Wait for the process until ``deadline``, then kill its group: a server's graceful
        shutdown is not what these tests check, and NIXL's can take half a minute."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def running(*commands: PageCommand) -> Iterator[None]:
    """The commands stop together: each is asked to end, then killed after 5 s."""
    try:
        yield
    finally:
        for command in commands:
            command.terminate()
        deadline = time.monotonic() + 5
        for command in commands:
            command.kill_after(deadline)


def complete(port: int, **body: Any) -> dict[str, Any]:
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=request, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_tier_page_serves(tmp_path: Path, tiny_model: Path) -> None:
    from kvcompose.testing.mooncake import MooncakeCluster, mooncake_missing

    if missing := mooncake_missing():
        pytest.skip(f"Mooncake Store cannot run here: {missing}")
    blocks = marked_blocks("docs/shared-tier.md")
    work = tmp_path / "served"
    work.mkdir()
    with MooncakeCluster(tmp_path / "mooncake") as cluster:
        store = json.loads(blocks["mooncake.json"])
        assert set(store) == set(cluster.config), "the page's mooncake.json and the bed's differ"
        store |= {k: cluster.config[k] for k in ("metadata_server", "master_server_address")}
        (work / "mooncake.json").write_text(json.dumps(store))
        (work / "shared-tier.yaml").write_text(blocks["shared-tier.yaml"])
        ports = [free_port(), free_port()]
        first = 50 + os.getpid() % 40  # the lookup port of engine 1; engine 2 has the next
        engines = [
            PageCommand(
                f"engine{i + 1}",
                blocks["engine"],
                work,
                page_env(MODEL=str(tiny_model), PORT=str(port), ENGINE=str(first + i)),
                tmp_path / f"engine{i + 1}.log",
            )
            for i, port in enumerate(ports)
        ]
        with running(*engines):
            for engine, port in zip(engines, ports, strict=True):
                engine.wait_healthy(port)
            one = complete(ports[0])["choices"][0]["text"]
            assert one.strip(), one
            deadline = time.monotonic() + 30
            while len(cluster.keys()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)  # saves are put in the background
            assert len(cluster.keys()) >= 2, "the page's tree saved nothing to the shared tier"
            two = complete(ports[1])["choices"][0]["text"]
            hits = external_hits(ports[1], at_least=256)
            print(f"\nshared-tier.md's engines answered {one!r}, {two!r}; engine 2 loaded {hits:g}")
            assert two == one, "engine 2 answered otherwise than engine 1"
            assert hits >= 256, "engine 2 computed the prompt instead of loading it"


def test_pd_page_serves(tmp_path: Path, tiny_model: Path) -> None:
    blocks = marked_blocks("docs/pd.md")
    ports = {
        k: free_port() for k in ("P_PORT", "D_PORT", "PROXY_PORT", "P_NIXL_PORT", "D_NIXL_PORT")
    }
    env = page_env(MODEL=str(tiny_model), **{k: str(v) for k, v in ports.items()})
    # the example trees' disk tiers live at fixed paths: a run before this one would leave D
    # a prefix to load from its own disk instead of over NIXL
    for tier in ("prefill", "decode"):
        text = (ROOT / "examples" / "pd" / f"{tier}.yaml").read_text()
        for path in re.findall(r"^\s*path: (\S+)$", text, re.M):
            shutil.rmtree(path, ignore_errors=True)
    p = PageCommand("prefill", blocks["prefill"], ROOT, env, tmp_path / "prefill.log")
    d = PageCommand("decode", blocks["decode"], ROOT, env, tmp_path / "decode.log")
    with running(p, d):
        p.wait_healthy(ports["P_PORT"])
        d.wait_healthy(ports["D_PORT"])
        proxy = PageCommand("proxy", blocks["proxy"], ROOT, env, tmp_path / "proxy.log")
        with running(proxy):
            proxy.wait_healthy(ports["PROXY_PORT"], timeout=60)
            alone = complete(ports["P_PORT"])["choices"][0]["text"]
            handed = complete(ports["PROXY_PORT"])["choices"][0]["text"]
            assert handed == alone, (handed, alone)
            hits = external_hits(ports["D_PORT"], at_least=1)
            print(f"\npd.md's P/D pair answered {handed!r}; D's external hits {hits:g}")
            # over NIXL D takes every prompt token P computed; its disk tier, whole blocks
            assert hits > 256, "D computed the prompt, or loaded it from disk, not over NIXL"


def external_hits(port: int, at_least: float, wait_s: float = 15.0) -> float:
    """A server's ``vllm:external_prefix_cache_hits_total`` (tokens a connector loaded),
    read again for up to ``wait_s`` until it reaches ``at_least`` (the server's stats
    logger records a step after it)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait_s
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        hits = sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "vllm:external_prefix_cache_hits_total"
        )
        if hits >= at_least or time.monotonic() > deadline:
            return hits
        time.sleep(0.5)
