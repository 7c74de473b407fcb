"""examples/pd: the two configs load and render for vLLM, and the proxy as the example
configures it (proxy.yaml, what serve.sh starts) does the P/D hand-off, checked against
scripted vLLM servers (kvcompose.testing.scripted_vllm); real engines behind the proxy (two
P and two D with these trees) are tests/proxy/test_proxy_engines.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvcompose.config import load_config, vllm_available
from kvcompose.config.render import vllm_args
from kvcompose.tree import leaves

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd"


@pytest.mark.parametrize(
    ("name", "role", "order"),
    [
        ("prefill.yaml", "kv_producer", ["nixl", "disk"]),
        ("decode.yaml", "kv_consumer", ["disk", "nixl"]),
    ],
)
def test_example_configs(name: str, role: str, order: list[str]) -> None:
    config = load_config(str(EXAMPLE / name), env={}, check_vllm=vllm_available())
    assert not config.warnings
    assert config.tree.kind == "chain" and config.tree.policy == "first"
    assert [leaf.name for leaf in leaves(config.tree)] == order
    data = vllm_args(config)
    # NIXL and the prefix store both support vLLM's hybrid KV cache manager: hma auto
    assert data["kv_connector"] == "KVComposeHMA" and data["kv_role"] == role
    assert data["kv_buffer_device"] == "cpu"
    if vllm_available():
        from vllm.config import KVTransferConfig

        KVTransferConfig(**data)


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")),
    reason="the proxy's web stack (kvcompose[proxy]) is not installed",
)
def test_the_example_proxy_hands_p_params_to_d_and_streams() -> None:
    import httpx

    from kvcompose.proxy import create_app, load_proxy_config
    from kvcompose.testing.scripted_vllm import (
        MODEL,
        Fabric,
        Fault,
        ScriptedVLLM,
        ServerThread,
        detok,
        reference,
        tokenize,
    )

    fabric = Fabric()
    p, d = ScriptedVLLM("p", fabric), ScriptedVLLM("d", fabric)
    backends = [ServerThread(s.app).start() for s in (p, d)]
    # serve.sh: kvcompose proxy --config proxy.yaml --prefill P --decode D
    config = load_proxy_config(
        EXAMPLE / "proxy.yaml", prefill=[backends[0].url], decode=[backends[1].url]
    )
    proxy = ServerThread(create_app(config)).start()
    try:
        d.fail_next(Fault("drop", after=2))  # the example's single D drops a stream once
        with httpx.Client(base_url=proxy.url, timeout=30) as c:
            resp = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0},
            )
    finally:
        for t in (proxy, *backends):
            t.stop()
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == detok(reference(tokenize("w5 w6 w7"), 6))
    p_req = p.requests[0]
    assert p_req["max_tokens"] == 1 and p_req["stream"] is False
    assert p_req["kv_transfer_params"] == {"do_remote_decode": True}
    d_req = d.requests[0]
    assert d_req["kv_transfer_params"]["remote_request_id"] == p_req["request_id"]
    assert d_req["stream"] is True and d_req["prompt"] == p_req["prompt"] == tokenize("w5 w6 w7")
    assert len([r for r in d.requests if not r.get("use_beam_search")]) == 2  # one retry
    assert not fabric.held
