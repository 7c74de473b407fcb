"""Reading the proxy's answers in tests: SSE events, the text and token ids they carry."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Streamed:
    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: Any = None

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("choices")]

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            ch = c["choices"][0]
            out.append(ch["delta"].get("content") or "" if "delta" in ch else ch["text"])
        return "".join(out)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["choices"][0].get("token_ids") or ()]

    @property
    def finish(self) -> dict[str, Any]:
        (last,) = [c["choices"][0] for c in self.chunks if c["choices"][0]["finish_reason"]]
        return last

    @property
    def usage(self) -> dict[str, int] | None:
        found = [e["usage"] for e in self.events if e.get("usage")]
        return found[-1] if found else None

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if "error" in e]


def stream(client: httpx.Client, path: str, body: dict[str, Any], **kw: Any) -> Streamed:
    with client.stream("POST", path, json={**body, "stream": True}, **kw) as resp:
        if resp.status_code != 200:
            resp.read()
            return Streamed(resp.status_code, body=resp.json())
        out = Streamed(200)
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            out.events.append(json.loads(line[6:]))
        return out
