"""examples/pd: the two configs load and render for vLLM, and the router does the P/D hand-off
(checked against stand-in HTTP servers; the example itself was run by hand, docs/pd.md)."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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
    assert data["kv_connector"] == "KVCompose" and data["kv_role"] == role
    assert data["kv_buffer_device"] == "cpu"
    if vllm_available():
        from vllm.config import KVTransferConfig

        KVTransferConfig(**data)


def _router() -> Any:
    spec = importlib.util.spec_from_file_location("pd_example_router", EXAMPLE / "router.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HANDOFF = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-1",
    "remote_host": "localhost",
    "remote_port": 5601,
}


@pytest.fixture
def servers() -> Iterator[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """Stand-ins for P (answers with kv_transfer_params) and D (streams three pieces)."""
    seen_p: list[dict[str, Any]] = []
    seen_d: list[dict[str, Any]] = []

    def handler(seen: list[dict[str, Any]], stream: bool) -> type[BaseHTTPRequestHandler]:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: bytes, ctype: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(json.dumps({"data": [{"id": "tiny"}]}).encode(), "application/json")

            def do_POST(self) -> None:
                seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if not stream:
                    self._send(
                        json.dumps(
                            {"choices": [{"text": " w1"}], "kv_transfer_params": HANDOFF}
                        ).encode(),
                        "application/json",
                    )
                    return
                chunks = [{"choices": [{"text": t}]} for t in (" w1", " w2", " w3")]
                body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
                self._send((body + "data: [DONE]\n\n").encode(), "text/event-stream")

        return Handler

    p = ThreadingHTTPServer(("127.0.0.1", 0), handler(seen_p, stream=False))
    d = ThreadingHTTPServer(("127.0.0.1", 0), handler(seen_d, stream=True))
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (p, d)]
    for t in threads:
        t.start()
    yield (f"http://127.0.0.1:{p.server_port}", f"http://127.0.0.1:{d.server_port}", seen_p, seen_d)
    for s in (p, d):
        s.shutdown()
        s.server_close()


def test_router_hands_p_params_to_d_and_streams(servers, capsys) -> None:
    p_url, d_url, seen_p, seen_d = servers
    text = _router().route("w5 w6 w7", prefill_url=p_url, decode_url=d_url, max_tokens=3)
    assert text == " w1 w2 w3"
    assert capsys.readouterr().out.startswith(" w1 w2 w3")
    (p_req,) = seen_p
    assert p_req["max_tokens"] == 1 and p_req["stream"] is False
    assert p_req["kv_transfer_params"] == {"do_remote_decode": True}
    (d_req,) = seen_d
    assert d_req["kv_transfer_params"] == HANDOFF and d_req["stream"] is True
    assert d_req["prompt"] == p_req["prompt"] == "w5 w6 w7" and d_req["model"] == "tiny"
