"""Workloads for ``kvcompose bench``: what is replayed, and what the stores hold beforehand.

A ``Workload`` is a list of timed requests (token-id prompts, arrival offsets in seconds,
output lengths) plus ``prefill``: for each store name, the prompts whose KV that store holds
before the run starts (see ``kvcompose.bench.contenders`` for how contenders name their
stores). The bench builds each store once from these prompts and gives every contender an
identical copy.

Built in:

- ``chat``: multi-round chat. A few shared system prompts; every user has a history of
  ``prior_rounds`` earlier rounds from an earlier session. Before the run the ``fast`` store
  holds only the system prompts and the ``disk`` store each returning user's whole history;
  ``new_users`` users have no history. The measured requests are the next ``rounds`` rounds of
  every user (histories grow from round to round).
- ``docqa``: long-document QA. Many short questions over a few long documents; ``fast`` holds
  each document's first ``head_len`` tokens, ``disk`` the whole documents.
- ``noreuse``: unique prompts that share nothing; stores start empty. Shows what each contender
  costs when it cannot help (lookups that miss, saves of every chunk).
- JSONL traces (``kvcompose.bench.traces``): one request per line, token ids given, or
  Mooncake traces (``timestamp``/``input_length``/``output_length``/``hash_ids``), mapped to
  token ids by ``mooncake_workload``.

Every prompt is made of token ids drawn from seeded generators, so the same parameters always
give the same workload.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcompose.bench.flags import opt

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
        return {
            "name": self.name,
            "description": self.description,
            "params": self.params,
            "requests": [r.to_dict() for r in self.requests],
            "prefill": {k: [list(p) for p in v] for k, v in self.prefill.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(
            name=data["name"],
            description=data.get("description", ""),
            params=dict(data.get("params", {})),
            requests=[BenchRequest(**r) for r in data["requests"]],
            prefill={k: [list(p) for p in v] for k, v in data.get("prefill", {}).items()},
        )

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
            "prefill": {
                k: {"prompts": len(v), "tokens": sum(len(p) for p in v)}
                for k, v in self.prefill.items()
            },
            "params": self.params,
        }

    def scaled(self, time_scale: float) -> Workload:
        """The same workload with every arrival offset multiplied by ``time_scale``."""
        reqs = [
            BenchRequest(r.id, r.prompt, r.arrival_s * time_scale, r.max_tokens, r.tags)
            for r in self.requests
        ]
        return Workload(
            self.name,
            reqs,
            self.prefill,
            {**self.params, "time_scale": time_scale},
            self.description,
        )


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
    users: int = opt(5, "chat: users", minimum=1)
    new_users: int = opt(1, "chat: users with no history before the run")
    rounds: int = opt(2, "chat: measured rounds per user", minimum=1)
    prior_rounds: int = opt(8, "chat: rounds each returning user had before the run")
    system_prompts: int = opt(2, "chat: shared system prompts")
    system_len: int = opt(512, "chat: tokens of a system prompt")
    user_len: int = opt(64, "chat: tokens a user adds per round", minimum=1)
    answer_len: int = opt(64, "chat: tokens of the recorded answer per round")
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
            requests.append(
                BenchRequest(
                    id=f"chat-u{u}-r{r}",
                    prompt=prompt,
                    arrival_s=round(arrival, 4),
                    max_tokens=p.max_tokens,
                    tags={
                        "user": u,
                        "round": r,
                        "returning": bool(prior),
                        "system": u % len(systems),
                    },
                )
            )
            histories[u] = prompt + tb(f"u{u}a{r}", p.answer_len)
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(
        name="chat",
        requests=requests,
        prefill={
            k: v for k, v in (("fast", [list(s) for s in systems]), ("disk", prefill_disk)) if v
        },
        params={**asdict(p), "seed": seed},
        description=(
            f"multi-round chat: {p.users} users ({n_new} new), {p.rounds} "
            f"measured rounds after {p.prior_rounds} earlier ones, "
            f"{len(systems)} shared system prompts of {p.system_len} tokens; "
            "fast store: system prompts, disk store: returning users' histories"
        ),
    )


@dataclass
class DocQAParams:
    docs: int = opt(3, "docqa: documents", minimum=1)
    doc_len: int = opt(1536, "docqa: tokens of a document", minimum=1)
    head_len: int = opt(512, "docqa: tokens of each document in the fast store")
    questions: int = opt(8, "docqa: questions per document", minimum=1)
    question_len: int = opt(64, "docqa: tokens of a question", minimum=1)
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
        requests.append(
            BenchRequest(
                id=f"doc{d}-q{q}",
                prompt=docs[d] + tb(f"d{d}q{q}", p.question_len),
                arrival_s=round(max(0.0, i * p.interval_s + jitter), 4),
                max_tokens=p.max_tokens,
                tags={"doc": d, "question": q},
            )
        )
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(
        name="docqa",
        requests=requests,
        prefill={"fast": [doc[: p.head_len] for doc in docs], "disk": [list(d) for d in docs]},
        params={**asdict(p), "seed": seed},
        description=(
            f"long-document QA: {p.questions} questions on each of {p.docs} documents "
            f"of {p.doc_len} tokens; fast store: first {p.head_len} tokens of each "
            "document, disk store: whole documents"
        ),
    )


@dataclass
class NoReuseParams:
    requests: int = opt(16, "noreuse: requests", minimum=1)
    prompt_len: int = opt(1024, "noreuse: tokens of a prompt", minimum=1)
    max_tokens: int = 16
    interval_s: float = 1.0


def noreuse_workload(p: NoReuseParams, *, vocab_size: int, seed: int = 0) -> Workload:
    """Unique prompts, nothing shared, empty stores: the pure overhead of each contender."""
    rng = random.Random(seed + 2)
    requests = []
    for i in range(p.requests):
        jitter = rng.uniform(-0.25, 0.25) * p.interval_s
        requests.append(
            BenchRequest(
                id=f"unique-{i}",
                arrival_s=round(max(0.0, i * p.interval_s + jitter), 4),
                prompt=token_block(f"unique{i}", p.prompt_len, vocab_size=vocab_size, seed=seed),
                max_tokens=p.max_tokens,
            )
        )
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(
        name="noreuse",
        requests=requests,
        prefill={},
        params={**asdict(p), "seed": seed},
        description=(
            f"no reuse: {p.requests} unique prompts of {p.prompt_len} "
            "tokens, empty stores (the overhead of each contender)"
        ),
    )


BUILTIN = ("chat", "docqa", "noreuse")
