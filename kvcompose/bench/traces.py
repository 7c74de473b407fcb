"""Traces as workloads: JSONL request lists and Mooncake traces (``load_trace``), and the
token-id JSONL form a run's workload is written in (``write_trace``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcompose.bench.flags import opt
from kvcompose.bench.trace_rows import MooncakeRow, TokenRow, parse_row
from kvcompose.bench.workloads import BenchRequest, Workload, WorkloadError, token_block


def load_trace(
    path: str | os.PathLike[str],
    *,
    vocab_size: int,
    seed: int = 0,
    limit: int | None = None,
    max_tokens: int | None = None,
    mooncake: MooncakeParams | None = None,
) -> Workload:
    """A JSONL trace: one request per line.

    Token-id form (a user's own requests)::

        {"id": "r1", "arrival_s": 0.0, "prompt_token_ids": [1, 2, ...], "max_tokens": 16}
        {"prefill": "disk", "prompt_token_ids": [...]}

    ``id`` (default: line number), ``arrival_s`` (default 0) and ``max_tokens`` (default 16)
    are optional. A line with ``"prefill": "<store>"`` is not replayed: its prompt is put in
    that store before the run. Lines in the Mooncake format (``hash_ids``, ``input_length``,
    ``timestamp`` in ms) switch to ``mooncake_workload``.
    """
    lines = list(_read_jsonl(path))
    if not lines:
        raise WorkloadError(f"{path}: empty trace")
    if "hash_ids" in lines[0][1]:
        return mooncake_workload(
            [parse_row(MooncakeRow, row, f"{path}:{n}") for n, row in lines],
            mooncake or MooncakeParams(),
            vocab_size=vocab_size,
            seed=seed,
            limit=limit,
            label=os.fspath(path),
            max_tokens=max_tokens,
        )
    requests: list[BenchRequest] = []
    prefill: dict[str, list[list[int]]] = {}
    for n, raw in lines:
        row = parse_row(TokenRow, raw, f"{path}:{n}")
        ids = row.prompt_token_ids
        if max(ids) >= vocab_size:
            raise WorkloadError(
                f"{path}:{n}: token id outside the model's vocabulary (0..{vocab_size - 1})"
            )
        if row.prefill is not None:
            prefill.setdefault(row.prefill, []).append(list(ids))
            continue
        if limit is not None and len(requests) >= limit:
            continue
        requests.append(
            BenchRequest(
                id=f"line{n}" if row.id is None else str(row.id),
                prompt=list(ids),
                arrival_s=row.arrival_s,
                max_tokens=max_tokens or row.max_tokens,
                tags=row.tags,
            )
        )
    if len({r.id for r in requests}) != len(requests):
        raise WorkloadError(f"{path}: request ids are not unique")
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        name=os.path.basename(os.fspath(path)),
        requests=requests,
        prefill=prefill,
        params={"trace": os.fspath(path), "limit": limit, "seed": seed},
        description=f"trace {os.fspath(path)} ({len(requests)} requests)",
    )


@dataclass
class MooncakeParams:
    block_tokens: int = opt(
        128, "token ids per trace block (the trace's blocks are 512 tokens)", minimum=1
    )
    max_prompt_len: int = opt(
        2048, "longer prompts are cut (their prefix, hence sharing, kept)", minimum=1
    )
    output_scale: float = opt(0.05, "output_length multiplier (then clamped to 1..max tokens)")
    max_tokens: int = 16
    warm: int = opt(
        0,
        "put the first N trace requests into the stores (fast: their first "
        "blocks, disk: whole) instead of replaying them",
    )
    fast_blocks: int = opt(4, "trace blocks of each warm request the fast store gets")
    time_scale: float = opt(1.0, "multiplier on the trace's timestamps")


def mooncake_workload(
    rows: Sequence[dict[str, Any] | MooncakeRow],
    p: MooncakeParams,
    *,
    vocab_size: int,
    seed: int = 0,
    limit: int | None = None,
    label: str = "mooncake",
    max_tokens: int | None = None,
) -> Workload:
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
    chosen = [
        parse_row(MooncakeRow, row, f"{label}: row {i + 1}")
        for i, row in enumerate(rows[:want] if want is not None else rows)
    ]
    if not chosen:
        raise WorkloadError(f"{label}: no requests")
    t0 = chosen[p.warm].timestamp if len(chosen) > p.warm else 0.0
    requests: list[BenchRequest] = []
    prefill: dict[str, list[list[int]]] = {}
    for i, row in enumerate(chosen):
        hash_ids = row.hash_ids
        n = max(1, round(row.input_length * p.block_tokens / 512))
        n = min(n, p.max_prompt_len, len(hash_ids) * p.block_tokens)
        prompt = [t for h in hash_ids for t in block(h)][:n]
        if i < p.warm:
            prefill.setdefault("disk", []).append(prompt)
            fast = prompt[: p.fast_blocks * p.block_tokens]
            if fast:
                prefill.setdefault("fast", []).append(fast)
            continue
        out = round(row.output_length * p.output_scale)
        requests.append(
            BenchRequest(
                id=f"mc{i}",
                prompt=prompt,
                arrival_s=round(max(0.0, (row.timestamp - t0) / 1000.0 * p.time_scale), 4),
                max_tokens=max(1, min(out, cap_tokens)),
                tags={"hash_blocks": len(hash_ids), "input_length": row.input_length},
            )
        )
    return Workload(
        name="mooncake",
        requests=requests,
        prefill=prefill,
        params={**asdict(p), "trace": label, "limit": limit, "seed": seed},
        description=(
            f"Mooncake trace {os.path.basename(label)}: {len(requests)} "
            f"requests, 512-token blocks mapped to {p.block_tokens} "
            f"seeded token ids (sharing kept), {p.warm} warm requests "
            "put in the stores"
        ),
    )


def _read_jsonl(path: str | os.PathLike[str]) -> Iterable[tuple[int, dict[str, Any]]]:
    """The trace's objects with their line numbers (blank lines skipped)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - bytes: a decoding error is told by its line
    except OSError as exc:
        raise WorkloadError(f"{path}: {exc.strerror or exc}") from None
    with fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise WorkloadError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:  # RecursionError: deep nesting
                raise WorkloadError(f"{path}:{n}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{path}:{n}: expected a JSON object per line")
            yield n, row


def write_trace(workload: Workload, path: str | os.PathLike[str]) -> None:
    """Write a workload in the token-id JSONL form ``load_trace`` reads."""
    with open(path, "w", encoding="utf-8") as fh:
        for store, prompts in workload.prefill.items():
            for prompt in prompts:
                fh.write(json.dumps({"prefill": store, "prompt_token_ids": prompt}) + "\n")
        for r in workload.requests:
            fh.write(
                json.dumps(
                    {
                        "id": r.id,
                        "arrival_s": r.arrival_s,
                        "prompt_token_ids": r.prompt,
                        "max_tokens": r.max_tokens,
                        **r.tags,
                    }
                )
                + "\n"
            )
