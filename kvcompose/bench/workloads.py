"""Workloads for ``kvcompose bench``: what is replayed, and what the stores hold beforehand.

A ``Workload`` is a list of timed requests (token-id prompts, arrival offsets in seconds,
output lengths) plus ``prefill``: for each store name, the prompts whose KV that store holds
before the run starts (see ``kvcompose.bench.chains`` for how chains name their stores). The
bench builds each store once from these prompts and gives every chain an identical copy.

Built in:

- ``chat``: multi-round chat. A few shared system prompts; every user has a history of
  ``prior_rounds`` earlier rounds from an earlier session. Before the run the ``fast`` store
  holds only the system prompts and the ``disk`` store each returning user's whole history;
  ``new_users`` users have no history. The measured requests are the next ``rounds`` rounds of
  every user (histories grow from round to round).
- ``docqa``: long-document QA. Many short questions over a few long documents; ``fast`` holds
  each document's first ``head_len`` tokens, ``disk`` the whole documents.
- ``noreuse``: unique prompts that share nothing; stores start empty. Shows what each chain
  costs when it cannot help (lookups that miss, saves of every chunk).
- JSONL traces (``load_trace``): one request per line, token ids given (see ``load_trace``),
  or Mooncake traces (``timestamp``/``input_length``/``output_length``/``hash_ids``), mapped to
  token ids by ``mooncake_workload``.

Every prompt is made of token ids drawn from seeded generators, so the same parameters always
give the same workload.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Token ids below this are never generated (the tiny models' special tokens are 0..3).
MIN_TOKEN_ID = 4


@dataclass
class BenchRequest:
    """One replayed request."""

    id: str
    prompt: list[int]
    arrival_s: float = 0.0
    max_tokens: int = 16
    tags: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """Timed requests, and what each named store holds before the run."""

    name: str
    requests: list[BenchRequest]
    prefill: dict[str, list[list[int]]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "params": self.params,
                "requests": [r.to_dict() for r in self.requests],
                "prefill": {k: [list(p) for p in v] for k, v in self.prefill.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(name=data["name"], description=data.get("description", ""),
                   params=dict(data.get("params", {})),
                   requests=[BenchRequest(**r) for r in data["requests"]],
                   prefill={k: [list(p) for p in v] for k, v in data.get("prefill", {}).items()})

    def summary(self) -> dict[str, Any]:
        """Sizes, for reports."""
        lens = sorted(len(r.prompt) for r in self.requests)
        return {
            "name": self.name,
            "requests": len(self.requests),
            "prompt_tokens": sum(lens),
            "prompt_len_min": lens[0] if lens else 0,
            "prompt_len_median": lens[len(lens) // 2] if lens else 0,
            "prompt_len_max": lens[-1] if lens else 0,
            "output_tokens": sum(r.max_tokens for r in self.requests),
            "duration_s": max((r.arrival_s for r in self.requests), default=0.0),
            "prefill": {k: {"prompts": len(v), "tokens": sum(len(p) for p in v)}
                        for k, v in self.prefill.items()},
            "params": self.params,
        }

    def scaled(self, time_scale: float) -> Workload:
        """The same workload with every arrival offset multiplied by ``time_scale``."""
        reqs = [BenchRequest(r.id, r.prompt, r.arrival_s * time_scale, r.max_tokens, r.tags)
                for r in self.requests]
        return Workload(self.name, reqs, self.prefill, {**self.params, "time_scale": time_scale},
                        self.description)


class WorkloadError(ValueError):
    """A workload cannot be built or read (bad file, bad parameters)."""


# --------------------------------------------------------------------------- token ids


def token_block(key: str | int, n: int, *, vocab_size: int, seed: int = 0) -> list[int]:
    """``n`` token ids determined by ``key`` and ``seed`` (different keys share nothing)."""
    rng = random.Random(zlib.crc32(f"{seed}:{key}".encode()) * 1_000_003 + n)
    hi = vocab_size - 1
    lo = MIN_TOKEN_ID if vocab_size <= 4096 else min(1000, vocab_size // 10)
    if hi <= lo:
        raise WorkloadError(f"vocab_size {vocab_size} too small")
    return [rng.randint(lo, hi) for _ in range(n)]


# --------------------------------------------------------------------------- built-ins


@dataclass
class ChatParams:
    users: int = 12
    new_users: int = 3  # of ``users``: no history before the run
    rounds: int = 2  # measured rounds per user
    prior_rounds: int = 8  # rounds each returning user had before the run
    system_prompts: int = 2
    system_len: int = 512
    user_len: int = 64  # tokens a user adds per round
    answer_len: int = 64  # tokens of the (recorded) assistant answer per round
    max_tokens: int = 16
    interval_s: float = 1.5  # mean gap between request arrivals


def chat_workload(p: ChatParams, *, vocab_size: int, seed: int = 0) -> Workload:
    """Multi-round chat (see the module docstring)."""
    if p.users < 1 or p.rounds < 1 or p.new_users < 0:
        raise WorkloadError("chat: need users >= 1, rounds >= 1, new_users >= 0")
    n_new = min(p.new_users, p.users)  # the last n_new users have no history
    tb = lambda key, n: token_block(key, n, vocab_size=vocab_size, seed=seed)  # noqa: E731
    systems = [tb(f"sys{s}", p.system_len) for s in range(max(p.system_prompts, 1))]
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    prefill_disk: list[list[int]] = []
    histories: dict[int, list[int]] = {}
    for u in range(p.users):
        hist = list(systems[u % len(systems)])
        prior = 0 if u >= p.users - n_new else p.prior_rounds
        for r in range(prior):
            hist += tb(f"u{u}m{r}", p.user_len) + tb(f"u{u}a{r}", p.answer_len)
        if prior:
            prefill_disk.append(list(hist))
        histories[u] = hist
    # Arrivals: users start staggered; round k+1 of a user comes one "cycle" after round k,
    # so requests of different users interleave evenly, ``interval_s`` apart on average.
    cycle = p.users * p.interval_s
    for k in range(p.rounds):
        for u in range(p.users):
            prior = 0 if u >= p.users - n_new else p.prior_rounds
            r = prior + k
            prompt = histories[u] + tb(f"u{u}m{r}", p.user_len)
            jitter = rng.uniform(-0.25, 0.25) * p.interval_s
            arrival = max(0.0, k * cycle + u * p.interval_s + jitter)
            requests.append(BenchRequest(
                id=f"chat-u{u}-r{r}", prompt=prompt, arrival_s=round(arrival, 4),
                max_tokens=p.max_tokens,
                tags={"user": u, "round": r, "returning": bool(prior),
                      "system": u % len(systems)}))
            histories[u] = prompt + tb(f"u{u}a{r}", p.answer_len)
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(
        name="chat", requests=requests,
        prefill={k: v for k, v in (("fast", [list(s) for s in systems]),
                                   ("disk", prefill_disk)) if v},
        params={**asdict(p), "seed": seed},
        description=(f"multi-round chat: {p.users} users ({n_new} new), {p.rounds} "
                     f"measured rounds after {p.prior_rounds} earlier ones, "
                     f"{len(systems)} shared system prompts of {p.system_len} tokens; "
                     "fast store: system prompts, disk store: returning users' histories"))


@dataclass
class DocQAParams:
    docs: int = 3
    doc_len: int = 1536
    head_len: int = 512  # tokens of each document the fast store holds
    questions: int = 8  # per document
    question_len: int = 64
    max_tokens: int = 16
    interval_s: float = 1.5


def docqa_workload(p: DocQAParams, *, vocab_size: int, seed: int = 0) -> Workload:
    """Many questions over a few long documents (see the module docstring)."""
    if p.docs < 1 or p.questions < 1:
        raise WorkloadError("docqa: need docs >= 1 and questions >= 1")
    tb = lambda key, n: token_block(key, n, vocab_size=vocab_size, seed=seed)  # noqa: E731
    docs = [tb(f"doc{d}", p.doc_len) for d in range(p.docs)]
    rng = random.Random(seed + 1)
    order = [(d, q) for q in range(p.questions) for d in range(p.docs)]
    rng.shuffle(order)
    requests = []
    for i, (d, q) in enumerate(order):
        jitter = rng.uniform(-0.25, 0.25) * p.interval_s
        requests.append(BenchRequest(
            id=f"doc{d}-q{q}", prompt=docs[d] + tb(f"d{d}q{q}", p.question_len),
            arrival_s=round(max(0.0, i * p.interval_s + jitter), 4), max_tokens=p.max_tokens,
            tags={"doc": d, "question": q}))
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(
        name="docqa", requests=requests,
        prefill={"fast": [doc[: p.head_len] for doc in docs], "disk": [list(d) for d in docs]},
        params={**asdict(p), "seed": seed},
        description=(f"long-document QA: {p.questions} questions on each of {p.docs} documents "
                     f"of {p.doc_len} tokens; fast store: first {p.head_len} tokens of each "
                     "document, disk store: whole documents"))


@dataclass
class NoReuseParams:
    requests: int = 16
    prompt_len: int = 1024
    max_tokens: int = 16
    interval_s: float = 1.0


def noreuse_workload(p: NoReuseParams, *, vocab_size: int, seed: int = 0) -> Workload:
    """Unique prompts, nothing shared, empty stores: the pure overhead of each chain."""
    rng = random.Random(seed + 2)
    requests = []
    for i in range(p.requests):
        jitter = rng.uniform(-0.25, 0.25) * p.interval_s
        requests.append(BenchRequest(
            id=f"unique-{i}", arrival_s=round(max(0.0, i * p.interval_s + jitter), 4),
            prompt=token_block(f"unique{i}", p.prompt_len, vocab_size=vocab_size, seed=seed),
            max_tokens=p.max_tokens))
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(name="noreuse", requests=requests, prefill={},
                    params={**asdict(p), "seed": seed},
                    description=(f"no reuse: {p.requests} unique prompts of {p.prompt_len} "
                                 "tokens, empty stores (the overhead of each chain)"))


BUILTIN = ("chat", "docqa", "noreuse")


# --------------------------------------------------------------------------- traces


def load_trace(path: str | os.PathLike[str], *, vocab_size: int, seed: int = 0,
               limit: int | None = None, max_tokens: int | None = None,
               mooncake: MooncakeParams | None = None) -> Workload:
    """A JSONL trace: one request per line.

    Token-id form (a user's own requests)::

        {"id": "r1", "arrival_s": 0.0, "prompt_token_ids": [1, 2, ...], "max_tokens": 16}
        {"prefill": "disk", "prompt_token_ids": [...]}

    ``id`` (default: line number), ``arrival_s`` (default 0) and ``max_tokens`` (default 16)
    are optional. A line with ``"prefill": "<store>"`` is not replayed: its prompt is put in
    that store before the run. Lines in the Mooncake format (``hash_ids``, ``input_length``,
    ``timestamp`` in ms) switch to ``mooncake_workload``.
    """
    rows = list(_read_jsonl(path))
    if not rows:
        raise WorkloadError(f"{path}: empty trace")
    if "hash_ids" in rows[0]:
        return mooncake_workload(rows, mooncake or MooncakeParams(), vocab_size=vocab_size,
                                 seed=seed, limit=limit, label=os.fspath(path),
                                 max_tokens=max_tokens)
    requests: list[BenchRequest] = []
    prefill: dict[str, list[list[int]]] = {}
    for i, row in enumerate(rows):
        ids = row.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise WorkloadError(f"{path}:{i + 1}: prompt_token_ids must be a non-empty list "
                                "of token ids")
        if any(t < 0 or t >= vocab_size for t in ids):
            raise WorkloadError(f"{path}:{i + 1}: token id outside the model's vocabulary "
                                f"(0..{vocab_size - 1})")
        store = row.get("prefill")
        if store:
            prefill.setdefault(str(store), []).append(list(ids))
            continue
        if limit is not None and len(requests) >= limit:
            continue
        requests.append(BenchRequest(
            id=str(row.get("id", f"line{i + 1}")), prompt=list(ids),
            arrival_s=float(row.get("arrival_s", 0.0)),
            max_tokens=int(max_tokens or row.get("max_tokens", 16)),
            tags={k: v for k, v in row.items()
                  if k not in ("id", "arrival_s", "prompt_token_ids", "max_tokens")}))
    if len({r.id for r in requests}) != len(requests):
        raise WorkloadError(f"{path}: request ids are not unique")
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(name=os.path.basename(os.fspath(path)), requests=requests, prefill=prefill,
                    params={"trace": os.fspath(path), "limit": limit, "seed": seed},
                    description=f"trace {os.fspath(path)} ({len(requests)} requests)")


@dataclass
class MooncakeParams:
    block_tokens: int = 128  # tokens per trace block (the trace's blocks are 512 tokens)
    max_prompt_len: int = 2048  # longer prompts are cut (their prefix, hence sharing, kept)
    output_scale: float = 0.05  # output_length multiplier (then clamped to 1..max_tokens)
    max_tokens: int = 16
    warm: int = 0  # the first ``warm`` requests go into the stores instead of being replayed
    fast_blocks: int = 4  # trace blocks of each warm request the ``fast`` store gets
    time_scale: float = 1.0  # multiplier on the trace's timestamps


def mooncake_workload(rows: Sequence[dict[str, Any]], p: MooncakeParams, *, vocab_size: int,
                      seed: int = 0, limit: int | None = None, label: str = "mooncake",
                      max_tokens: int | None = None) -> Workload:
    """Mooncake FAST'25 trace rows as a workload.

    Each hash id becomes a fixed block of ``block_tokens`` token ids seeded from the id, so two
    requests that share their first k hash ids share their first k blocks of tokens (the
    sharing structure is kept; lengths scale by ``block_tokens / 512``).
    """
    if p.block_tokens < 1:
        raise WorkloadError("mooncake: block_tokens must be >= 1")
    cap_tokens = max_tokens or p.max_tokens
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            blocks[h] = token_block(f"mc{h}", p.block_tokens, vocab_size=vocab_size, seed=seed)
        return blocks[h]

    want = None if limit is None else limit + p.warm
    chosen = list(rows[:want]) if want is not None else list(rows)
    if not chosen:
        raise WorkloadError(f"{label}: no requests")
    t0 = float(chosen[p.warm]["timestamp"]) if len(chosen) > p.warm else 0.0
    requests: list[BenchRequest] = []
    prefill: dict[str, list[list[int]]] = {}
    for i, row in enumerate(chosen):
        hash_ids = [int(h) for h in row["hash_ids"]]
        n = max(1, round(int(row["input_length"]) * p.block_tokens / 512))
        n = min(n, p.max_prompt_len, len(hash_ids) * p.block_tokens)
        prompt = [t for h in hash_ids for t in block(h)][:n]
        if i < p.warm:
            prefill.setdefault("disk", []).append(prompt)
            fast = prompt[: p.fast_blocks * p.block_tokens]
            if fast:
                prefill.setdefault("fast", []).append(fast)
            continue
        out = round(int(row.get("output_length", 1)) * p.output_scale)
        requests.append(BenchRequest(
            id=f"mc{i}", prompt=prompt,
            arrival_s=round(max(0.0, (float(row["timestamp"]) - t0) / 1000.0 * p.time_scale), 4),
            max_tokens=max(1, min(out, cap_tokens)),
            tags={"hash_blocks": len(hash_ids), "input_length": int(row["input_length"])}))
    return Workload(name="mooncake", requests=requests, prefill=prefill,
                    params={**asdict(p), "trace": label, "limit": limit, "seed": seed},
                    description=(f"Mooncake trace {os.path.basename(label)}: {len(requests)} "
                                 f"requests, 512-token blocks mapped to {p.block_tokens} "
                                 f"seeded token ids (sharing kept), {p.warm} warm requests "
                                 "put in the stores"))


def _read_jsonl(path: str | os.PathLike[str]) -> Iterable[dict[str, Any]]:
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise WorkloadError(f"{path}: {exc.strerror or exc}") from None
    with fh:
        for i, line in enumerate(fh):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{path}:{i + 1}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{path}:{i + 1}: expected a JSON object per line")
            yield row


def write_trace(workload: Workload, path: str | os.PathLike[str]) -> None:
    """Write a workload in the token-id JSONL form ``load_trace`` reads."""
    with open(path, "w", encoding="utf-8") as fh:
        for store, prompts in workload.prefill.items():
            for prompt in prompts:
                fh.write(json.dumps({"prefill": store, "prompt_token_ids": prompt}) + "\n")
        for r in workload.requests:
            fh.write(json.dumps({"id": r.id, "arrival_s": r.arrival_s,
                                 "prompt_token_ids": r.prompt, "max_tokens": r.max_tokens,
                                 **r.tags}) + "\n")
