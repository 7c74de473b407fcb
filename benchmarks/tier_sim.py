"""A trace-level simulator of ``mooncake_tiers.py``'s two store tiers (issue 14), no engine.

It replays the same sampled, scaled requests (``mooncake_tiers.sample``/``scale``) through
two chunk stores modelled as the PrefixStoreConnector behaves in a chain:

- **keys**: one chunk per 128 tokens, keyed by the whole prefix up to its end (here the
  trace's hash ids of the blocks it covers); a lookup counts the consecutive stored chunks
  inside ``prompt[:-1]`` (``keys.lookup_limit_chunks``);
- **chain policies** (``composite.lookup.decide``): ``first`` loads from the first tier with
  a hit, ``longest`` from the tier with the most (ties to the earlier, the fast tier),
  ``stitch`` from the fast tier's prefix and the slow tier from where it ends;
- **saves**: every tier saves every full prompt chunk it does not hold (write-through), its
  admission rule aside; the rule is the store's own ``Admission`` (frequency sketch, counted
  once per request at allocation, the request included), and with ``promote`` chunks
  another tier loaded for the request are saved whatever the rule says;
- **eviction**: least recently written or loaded file first, down to ``max_bytes``; loads
  touch and writes stamp a request's chunks in reverse prefix order (a request's first
  chunks newest). A background store evicts between steps after its writer wrote, which on
  an idle engine is after the next request's lookup (``--evict next``); a synchronous
  store right after writing (``--evict write``).

What it leaves out: requests overlapping in the engine (each request here finishes before
the next is looked up), the writer's queue (a chunk is written before the next lookup) and
dropped saves. ``--validate`` compares it against the engine's committed per-tier hit
tokens and bytes written.

Run: ``.venv/bin/python benchmarks/tier_sim.py --validate`` (both traces' engine samples),
``... --sweep`` (admission rules on the engine samples, more seeds and larger samples;
writes ``benchmarks/results/tier_sim/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mooncake_tiers import CHUNK_TOKENS, HERE, TRACE, Scaled, read, sample, scale

from kvcompose.stores.prefix.admission import Admission, AdmissionRule
from kvcompose.stores.prefix.keys import lookup_limit_chunks
from kvcompose.tree.conditions import RequestCondition

#: One chunk's file (the built-in bench model, 128 tokens): the engine runs' bytes written
#: divided by the chunks they saved (415,329,552 / 99, ``mooncake_tiers/bench/results.json``).
CHUNK_FILE_BYTES = 4_195_248
SYNTHETIC = TRACE.with_name("synthetic_trace.jsonl")
OUT = HERE / "results" / "tier_sim"
SYNTH_DIR = "mooncake_tiers_synthetic"
PER_CHUNK_BLOCKS = CHUNK_TOKENS // 64


@dataclass(frozen=True)
class Rule:
    """A fast tier's admission settings (the store's config keys)."""

    min_seen: int = 1
    min_prompt_tokens: int = 0
    #: ``admit_when: {max_prompt_tokens: N}``.
    max_prompt_tokens: int | None = None
    promote: bool = False
    #: Admit only requests some tier loaded a chunk for (a conversation's later turns).
    after_hit: bool = False
    #: Not a rule but a bound: admit a chunk only if a later request will look it up.
    oracle: bool = False

    def store_rule(self) -> AdmissionRule:
        when = (
            RequestCondition(max_prompt_tokens=self.max_prompt_tokens)
            if self.max_prompt_tokens is not None
            else None
        )
        return AdmissionRule(self.min_prompt_tokens, self.min_seen, self.promote, when)

    def label(self) -> str:
        parts = []
        if self.min_seen > 1:
            parts.append(f"seen>={self.min_seen}")
        if self.min_prompt_tokens:
            parts.append(f"prompt>={self.min_prompt_tokens}")
        if self.max_prompt_tokens is not None:
            parts.append(f"prompt<={self.max_prompt_tokens}")
        if self.after_hit:
            parts.append("requests with a hit")
        if self.oracle:
            parts.append("oracle: chunks a later request looks up")
        text = " & ".join(parts) or "every save"
        return text + (" + promote" if self.promote else "")


@dataclass
class Tier:
    """One store: its files in LRU order (oldest first) and what it counted."""

    name: str
    max_bytes: int | None
    rule: Rule = field(default_factory=Rule)
    files: OrderedDict[str, None] = field(default_factory=OrderedDict)
    hit_tokens: int = 0
    chunks_written: int = 0
    evictions: int = 0
    evict_due: bool = False

    def __post_init__(self) -> None:
        self.admission = Admission(self.rule.store_rule())

    def prefix(self, keys: list[str], first: int, limit: int) -> int:
        n = 0
        for key in keys[first:limit]:
            if key not in self.files:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[str]) -> None:
        for key in reversed(list(keys)):  # reverse prefix order: first chunks newest
            self.files[key] = None
            self.files.move_to_end(key)

    def evict(self) -> None:
        self.evict_due = False
        if self.max_bytes is None:
            return
        while len(self.files) * CHUNK_FILE_BYTES > self.max_bytes:
            self.files.popitem(last=False)
            self.evictions += 1

    @property
    def bytes_written(self) -> int:
        return self.chunks_written * CHUNK_FILE_BYTES


@dataclass(frozen=True)
class Config:
    """A chain of tiers as ``mooncake_tiers.contenders`` writes it."""

    policy: str = "longest"  # first | longest | stitch
    fast: Rule | None = field(default_factory=Rule)  # None: the slow tier alone
    evict: str = "next"  # next (background) | write (sync)


def config_of(contender: dict[str, Any]) -> Config | None:
    """The chain a bench contender ran (its ``kv_transfer_config``), or None (recompute)."""
    extra = (contender.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    chain = (extra.get("tree") or {}).get("chain")
    if chain is None:
        return None
    leaves = {c["leaf"]["name"]: c["leaf"].get("extra_config", {}) for c in chain["children"]}
    fast = leaves.get("fast")
    evict = "write" if leaves["slow"].get("save_mode", "sync") == "sync" else "next"
    if fast is None:
        return Config(chain.get("policy", "first"), None, evict)
    rule = Rule(
        min_seen=fast.get("admit_min_seen", 1),
        min_prompt_tokens=fast.get("admit_min_prompt_tokens", 0),
        max_prompt_tokens=(fast.get("admit_when") or {}).get("max_prompt_tokens"),
        promote=fast.get("promote", False),
    )
    return Config(chain.get("policy", "first"), rule, evict)


@dataclass
class Prompt:
    """One replayed request as the stores see it."""

    keys: list[str]
    tokens: int


def prompts(reqs: list[Scaled]) -> list[Prompt]:
    """The chunk keys of each request (the hash ids of the blocks up to each chunk's end)
    after the bench's two warm-up prompts (median length, sharing nothing)."""
    lens = sorted(r.prompt_tokens for r in reqs)
    warm = lens[len(lens) // 2] if lens else 256
    out = [Prompt([f"warmup{i}/{c}" for c in range(warm // CHUNK_TOKENS)], warm) for i in range(2)]
    for r in reqs:
        keys = [
            ",".join(map(str, r.blocks[: (c + 1) * PER_CHUNK_BLOCKS]))
            for c in range(r.prompt_tokens // CHUNK_TOKENS)
        ]
        out.append(Prompt(keys, r.prompt_tokens))
    return out


def ceiling(reqs: list[Scaled]) -> int:
    """Hit tokens of an infinite cache that starts empty (as ``mooncake_tiers.build``)."""
    seen: set[int] = set()
    total = 0
    for r in reqs:
        lead = 0
        for h in r.blocks:
            if h not in seen:
                break
            lead += 1
        total += min(lead * 64, r.prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS
        seen.update(r.blocks)
    return total


def working_set_bytes(reqs: list[Scaled]) -> int:
    keys = {k for p in prompts(reqs)[2:] for k in p.keys}
    return len(keys) * CHUNK_TOKENS * 32 * 1024  # as mooncake_tiers.build counts it


def simulate(reqs: list[Scaled], config: Config, fast_max_bytes: int) -> dict[str, Any]:
    """Replay ``reqs`` through ``config``; per tier: hit tokens, chunks written, evictions,
    admits/rejects/promotions (the warm-up prompts' counts left out, as the bench does)."""
    tiers = [Tier("slow", None)]
    if config.fast is not None:
        tiers.insert(0, Tier("fast", fast_max_bytes, config.fast))
    c = CHUNK_TOKENS
    counted = {t.name: {"admits": 0, "rejects": 0, "promotions": 0} for t in tiers}
    replayed = prompts(reqs)
    last_lookup = {
        key: rank
        for rank, p in enumerate(replayed)
        for key in p.keys[: lookup_limit_chunks(p.tokens, c)]
    }
    for rank, p in enumerate(replayed):
        if rank == 2:  # the replay starts: the bench counts deltas from here
            for t in tiers:
                t.hit_tokens = t.chunks_written = t.evictions = 0
                counted[t.name] = {"admits": 0, "rejects": 0, "promotions": 0}
        limit = lookup_limit_chunks(p.tokens, c)
        loads = plan_loads(tiers, config.policy, p.keys, limit)
        for t, first, n in loads:
            t.touch(p.keys[first : first + n])
            t.hit_tokens += n * c
        loaded = sum(n for _, _, n in loads) * c
        for t in tiers:
            if t.evict_due:  # a background store's pass after the previous writes
                t.evict()
            t.admission.seen(p.keys)
        request = SimpleNamespace(num_prompt_tokens=p.tokens, kv_transfer_params=None)
        for t in tiers:
            saves = []
            selected: bool | None = None
            for idx, key in enumerate(p.keys):
                if key in t.files:
                    continue
                rule = t.admission.rule
                extra = t.rule
                if rule.promote and (idx + 1) * c <= loaded:
                    counted[t.name]["promotions"] += 1
                elif (extra.oracle and last_lookup.get(key, -1) <= rank) or (
                    extra.after_hit and not loaded
                ):
                    counted[t.name]["rejects"] += 1
                    continue
                elif not rule.everything:
                    if selected is None:
                        selected = t.admission.selects(request)
                    ok = t.admission.admits(key, p.tokens, selected)
                    counted[t.name]["admits" if ok else "rejects"] += 1
                    if not ok:
                        continue
                saves.append(key)
            t.touch(saves)
            t.chunks_written += len(saves)
            if config.evict == "write":
                t.evict()
            else:
                t.evict_due = True
    return {
        t.name: {
            "hit_tokens": t.hit_tokens,
            "chunks_written": t.chunks_written,
            "bytes_written": t.bytes_written,
            "evictions": t.evictions,
            **counted[t.name],
        }
        for t in tiers
    }


def plan_loads(
    tiers: list[Tier], policy: str, keys: list[str], limit: int
) -> list[tuple[Tier, int, int]]:
    """(tier, first chunk, chunks) each tier loads for a request."""
    if policy == "stitch":
        out, at = [], 0
        for t in tiers:
            n = t.prefix(keys, at, limit)
            if n:
                out.append((t, at, n))
                at += n
        return out
    best: tuple[Tier, int, int] | None = None
    for t in tiers:
        n = t.prefix(keys, 0, limit)
        if n and (best is None or (policy == "longest" and n > best[2])):
            best = (t, 0, n)
            if policy == "first":
                break
    return [best] if best else []


# --------------------------------------------------------------------------- runs


def engine_sample(results_dir: Path) -> tuple[list[Scaled], int]:
    """The requests and fast-tier cap of a ``mooncake_tiers`` sample (``sample.json``)."""
    info = json.loads((results_dir / "sample.json").read_text())
    rows = read(Path(info["trace"]))
    return scale(rows, info["trace_indices"]), info["fast_max_bytes"]


def compare(results_dir: Path, results: Path, evict: str | None = None) -> list[dict[str, Any]]:
    """Per contender of the bench's ``results`` (on the sample in ``results_dir``): measured
    and simulated hit tokens and bytes written per tier. ``evict`` overrides every
    configuration's eviction timing (runs made before background stores evicted between
    steps evicted on the writer thread, right after writing)."""
    reqs, cap = engine_sample(results_dir)
    engine = json.loads(results.read_text())
    out = []
    for c in engine["contenders"]:
        config = config_of(c)
        if config is None:
            continue
        if evict is not None:
            config = replace(config, evict=evict)
        stores = (c.get("hits") or {}).get("stores") or {}
        sim = simulate(reqs, config, cap)
        row: dict[str, Any] = {"label": c["label"]}
        for tier in ("fast", "slow"):
            measured, simulated = stores.get(tier, {}), sim.get(tier, {})
            row[tier] = {
                "hit_tokens": (measured.get("tokens_loaded", 0), simulated.get("hit_tokens", 0)),
                "bytes_written": (
                    measured.get("bytes_written", 0),
                    simulated.get("bytes_written", 0),
                ),
            }
        out.append(row)
    return out


def validate(results_dir: Path, results: Path, evict: str | None = None) -> list[str]:
    """``compare`` as a Markdown table (``*``: simulated differs from measured)."""
    reqs, cap = engine_sample(results_dir)
    lines = [
        f"`{results.relative_to(HERE)}` ({len(reqs)} requests, fast tier "
        f"{cap / 2**20:.0f} MiB = {cap // CHUNK_FILE_BYTES} chunks):",
        "",
        "| configuration | hit tokens fast: engine | sim | slow: engine | sim "
        "| MiB written fast: engine | sim | slow: engine | sim |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in compare(results_dir, results, evict):
        cells = []
        for metric, unit in (("hit_tokens", 1), ("bytes_written", 2**20)):
            for tier in ("fast", "slow"):
                measured, simulated = (v / unit for v in row[tier][metric])
                mark = "" if round(measured) == round(simulated) else " *"
                cells += [f"{measured:,.0f}", f"{simulated:,.0f}{mark}"]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


@dataclass(frozen=True)
class Sample:
    label: str
    trace: Path
    requests: int
    seed: int


def sample_requests(s: Sample, cache: dict[Path, list[dict[str, Any]]]) -> list[Scaled]:
    rows = cache.setdefault(s.trace, read(s.trace))
    return scale(rows, sample(rows, s.requests, s.seed))


def sweep_rules() -> list[tuple[str, Config]]:
    """The baseline (plain ``longest``) first, then admission rules with and without
    promotion, and the same under ``stitch``."""
    rules = [Rule()]
    for seen in (2, 3, 4):
        rules.append(Rule(min_seen=seen))
    for lo in (512, 1024, 1536):
        rules.append(Rule(min_prompt_tokens=lo))
        rules.append(Rule(min_seen=2, min_prompt_tokens=lo))
    for hi in (512, 1024, 1536):
        rules.append(Rule(max_prompt_tokens=hi))
        rules.append(Rule(min_seen=2, max_prompt_tokens=hi))
    rules += [Rule(after_hit=True), Rule(oracle=True)]
    out = []
    for policy in ("longest", "stitch"):
        for r in rules:
            for promote in (False, True):
                if promote and r == Rule():
                    continue  # promotion without admission saves what write-through saves
                rule = replace(r, promote=promote)
                out.append((f"{policy}: {rule.label()}", Config(policy, rule)))
    return out


def frontier(samples: list[Sample]) -> dict[str, Any]:
    """Every rule on every sample: fast MiB written, fast and total hit tokens, each also
    relative to plain ``longest`` on the same sample."""
    cache: dict[Path, list[dict[str, Any]]] = {}
    rules = sweep_rules()
    table: dict[str, dict[str, Any]] = {}
    for s in samples:
        reqs = sample_requests(s, cache)
        cap = working_set_bytes(reqs) // 5
        base = simulate(reqs, rules[0][1], cap)
        base_fast = base["fast"]["hit_tokens"]
        base_total = base_fast + base["slow"]["hit_tokens"]
        base_bytes = base["fast"]["bytes_written"]
        for label, config in rules:
            r = simulate(reqs, config, cap)
            fast, total = r["fast"]["hit_tokens"], r["fast"]["hit_tokens"] + r["slow"]["hit_tokens"]
            row = table.setdefault(label, {})
            row[s.label] = {
                "fast_mib": r["fast"]["bytes_written"] / 2**20,
                "fast_hits": fast,
                "total_hits": total,
                "write_cut": 1 - r["fast"]["bytes_written"] / max(base_bytes, 1),
                "fast_hit_loss": 1 - fast / max(base_fast, 1),
                "total_hit_loss": 1 - total / max(base_total, 1),
                "ceiling": ceiling(reqs),
            }
    return table


def markdown(table: dict[str, Any], groups: dict[str, list[str]]) -> list[str]:
    """One row per rule, per sample group: fast-tier writes, fast-tier hit tokens and total
    hit tokens against plain ``longest`` on the same sample (medians over a group's
    samples); ``**`` marks writes cut by half or more at under 5 % fewer fast-tier hits."""
    head = "| rule | " + " | ".join(f"{g}: fast writes | fast hits | all hits" for g in groups)
    lines = [head + " |", "|---|" + "---:|---:|---:|" * len(groups)]
    for label, by_sample in table.items():
        cells = []
        for names in groups.values():
            rows = [by_sample[n] for n in names]
            cut = statistics.median(r["write_cut"] for r in rows)
            fl = statistics.median(r["fast_hit_loss"] for r in rows)
            tl = statistics.median(r["total_hit_loss"] for r in rows)
            mark = " **" if cut >= 0.5 and fl < 0.05 else ""
            cells += [f"{-100 * cut:+.0f} %{mark}", f"{-100 * fl:+.0f} %", f"{-100 * tl:+.0f} %"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def absolute(table: dict[str, Any], names: list[str]) -> list[str]:
    """Fast MiB written, fast-tier and total hit tokens per rule on single samples."""
    head = "| rule | " + " | ".join(f"{n}: fast MiB | fast hits | all hits" for n in names)
    lines = [head + " |", "|---|" + "---:|---:|---:|" * len(names)]
    for label, by_sample in table.items():
        cells = []
        for n in names:
            r = by_sample[n]
            cells += [f"{r['fast_mib']:,.0f}", f"{r['fast_hits']:,}", f"{r['total_hits']:,}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="against the committed engine runs")
    ap.add_argument("--sweep", action="store_true", help="admission rules' frontier")
    ap.add_argument("--seeds", type=int, default=10, help="25-request samples per trace")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.validate:
        # The synthetic run predates "Background store: evict between steps" (270378c): its
        # writer thread evicted right after writing; shown under both timings.
        conv, synth = HERE / "results" / "mooncake_tiers", HERE / "results" / SYNTH_DIR
        lines = []
        for results in sorted(conv.glob("**/*results.json")):
            if "before-gil-free" not in results.name:  # a writer since replaced
                lines += [*validate(conv, results), ""]
        for evict in ("write", "next"):
            lines += [f"Eviction timing `{evict}` for every configuration:", ""]
            lines += [*validate(synth, synth / "bench" / "results.json", evict), ""]
        text = "\n".join(lines)
        (args.out / "validation.md").write_text(text)
        print(text)
    if args.sweep:
        samples: list[Sample] = []
        groups: dict[str, dict[str, list[str]]] = {}
        for name, trace in (("conversation", TRACE), ("synthetic", SYNTHETIC)):
            for n, seeds in ((25, range(args.seeds)), (200, range(3)), (2000, range(1))):
                group = f"{n}" + (f" x{len(seeds)}" if len(seeds) > 1 else "")
                for seed in seeds:
                    s = Sample(f"{name}/{n}/{seed}", trace, n, seed)
                    samples.append(s)
                    groups.setdefault(name, {}).setdefault(group, []).append(s.label)
        table = frontier(samples)
        (args.out / "frontier.json").write_text(json.dumps(table, indent=1) + "\n")
        lines = []
        for name, by_group in groups.items():
            lines += [f"### {name} trace, against plain `longest`", ""]
            lines += [*markdown(table, by_group), ""]
        lines += ["### The engine's samples (seed 0, 25 requests)", ""]
        lines += absolute(table, ["conversation/25/0", "synthetic/25/0"])
        text = "\n".join(lines)
        (args.out / "frontier.md").write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
