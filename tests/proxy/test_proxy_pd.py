"""The proxy's core claim against real engines, in the default suite: one P and one D (vLLM
servers on CPU, NIXL over UCX, the kvcompose trees of examples/pd). D's load fails (the
fault-injecting store double on D's disk tier, under vLLM's default ``kv_load_failure_policy:
fail``); the proxy continues the request and the client's token ids equal one engine's
greedy output; afterwards no engine holds a request or a KV block (the servers' own
/metrics). The longer scenarios (two D, concurrency, killed servers) are in
test_proxy_engines.py, run on request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import proxy_engine_bed as bed
import pytest
from proxy_sse import stream

from kvcompose.testing.pd_servers import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(600)]

N = 16
FAULT = "pdfault"  # attempt 1 of this client id fails its load on D


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VLLMServer]]:
    pytest.importorskip("nixl")
    tmp = tmp_path_factory.mktemp("proxy-pd")
    started = bed.start(tiny_model, tmp, ["p"], ["d"], [f"cmpl-{FAULT}-1-d-0"])
    try:
        yield started
    finally:
        bed.stop(started)


@pytest.fixture(scope="module")
def proxy(servers: dict[str, VLLMServer]) -> Iterator[tuple[str, Any]]:
    thread, app = bed.proxy(servers, ["p"], ["d"])
    yield thread.url, app
    thread.stop()


def test_decode_load_failure_is_continued_token_exact(servers, proxy):
    url, app = proxy
    want = bed.greedy(servers["p"], [0], N)[0]
    with httpx.Client(base_url=url, timeout=600) as c:
        # the first hand-off (NIXL's handshake) warms D's disk tier with the prompt ...
        warm = c.post("/v1/completions", json={**bed.body(0, 1), "stream_options": None})
        assert warm.status_code == 200, warm.text
        bed.reset_prefix_cache([servers["d"]])  # ... which then owns D's next load
        bed.calm([servers["d"]])
        out = stream(c, "/v1/completions", bed.body(0, N), headers={"X-Request-Id": FAULT})
    assert out.done and not out.errors, out.events[-3:]
    assert out.token_ids == want
    assert out.usage["completion_tokens"] == N
    assert len({e["id"] for e in out.events}) == 1
    assert bed.injected(servers, ["d"], f"cmpl-{FAULT}") == 1
    assert bed.retries(app, "decode_error") == 1
    snap = bed.idle(servers)
    assert snap["p"].get("vllm:kv_cache_usage_perc", 0) == 0
