"""A trace-level simulator of ``mooncake_tiers.py``'s two store tiers, no engine.

It replays the same sampled, scaled requests (``mooncake_tiers.sample``/``scale``) through
two chunk stores modelled as the PrefixStoreConnector behaves in a chain:

- **keys**: one chunk per 128 tokens, keyed by the whole prefix up to its end (here the
  trace's hash ids of the blocks it covers); a lookup counts the consecutive stored chunks
  inside ``prompt[:-1]`` (``keys.lookup_limit_chunks``);
- **chain policies** (``composite.lookup.Lookup.plan``): ``first`` loads from the first tier with
  a hit, ``longest`` from the tier with the most (ties to the earlier, the fast tier),
  ``stitch`` from the fast tier's prefix and the slow tier from where it ends;
- **saves**: every tier saves every full prompt chunk it does not hold (write-through), its
  admission rule aside; the rule is the store's own ``Admission`` (frequency sketch, counted
  once per request at allocation, the request included), and with ``promote`` chunks
  another tier loaded for the request are saved whatever the rule says;
- **eviction**: least recently written or loaded file first, down to ``max_bytes``; loads
  touch and writes stamp a request's chunks in reverse prefix order (a request's first
  chunks newest). A background store evicts between steps after its writer wrote: in the
  request's next (decode) step when it has one, else (an idle engine takes no steps) in the
  next request's step, after its lookup and its saves' plan (``Config.evict="next"``); a
  synchronous store right after writing (``"write"``);
- **in-flight saves**: a chunk planned in the last ``INFLIGHT_SAVE_STEPS + 1`` steps is not
  planned again (the scheduler half's dedupe), even when evicted since;
- **counting**: the bench's warm-up prompts first, their counts left out; with
  ``as_bench`` the last request's background writes too when no later step reports them
  (as the bench counted them before it waited for the writers: the committed results).

What it leaves out: requests overlapping in the engine (each request here finishes before
the next is looked up), the writer's queue (a chunk is written before the next lookup) and
dropped saves. ``tier_sweep.py`` compares it with the engine's committed per-tier hit
tokens and bytes written, and sweeps admission rules with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from mooncake_tiers import CHUNK_TOKENS, Scaled, chunk_prefixes

from kvcompose.bench.run import warmup_length
from kvcompose.stores.prefix.admission import Admission, AdmissionRule, FrequencySketch
from kvcompose.stores.prefix.keys import lookup_limit_chunks
from kvcompose.stores.prefix.scheduler import INFLIGHT_SAVE_STEPS
from kvcompose.tree.conditions import RequestCondition

#: One chunk's file (the built-in bench model, 128 tokens): the engine run's bytes written
#: over the chunks it saved (415,329,552 / 99,
#: ``mooncake_tiers/history/single-round-results.json``).
CHUNK_FILE_BYTES = 4_195_248
#: How many steps after a save was planned the scheduler half still skips the chunk:
#: planned at step s, skipped at steps up to s + INFLIGHT_SAVE_STEPS + 1 (the dict is
#: pruned after each step's planning).
WINDOW = INFLIGHT_SAVE_STEPS + 1


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
    #: TinyLFU: once the tier is full, admit a chunk only if seen more often than the
    #: least recently used chunk it would displace (a rule the store does not have).
    tinylfu: bool = False

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
        if self.tinylfu:
            parts.append("TinyLFU: seen more than the LRU victim")
        text = " & ".join(parts) or "every save"
        return text + (" + promote" if self.promote else "")


@dataclass
class Tier:
    """One store: its files in LRU order (oldest first) and what it counted."""

    name: str
    max_bytes: int | None
    rule: Rule = field(default_factory=Rule)
    files: OrderedDict[str, None] = field(default_factory=OrderedDict)
    #: Chunk key -> step its save was planned (the scheduler half's ``_inflight_saves``).
    inflight: dict[str, int] = field(default_factory=dict)
    hit_tokens: int = 0
    chunks_written: int = 0
    evictions: int = 0
    evict_due: bool = False
    #: Chunks the last request wrote and no later step reported.
    unreported: int = 0

    def __post_init__(self) -> None:
        self.admission = Admission(self.rule.store_rule())
        self.sketch = FrequencySketch() if self.rule.tinylfu else None

    def displaces(self, key: str, pending: int) -> bool:
        """TinyLFU: whether ``key``, saved after ``pending`` others this request, may
        displace the least recently used chunk it would push out (always, with room)."""
        assert self.sketch is not None and self.max_bytes is not None
        room = self.max_bytes // CHUNK_FILE_BYTES - len(self.files)
        victim_rank = pending - max(room, 0)
        if victim_rank < 0:
            return True
        victims = iter(self.files)
        victim = next((k for i, k in enumerate(victims) if i == victim_rank), None)
        return victim is None or self.sketch.count(key) > self.sketch.count(victim)

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
    #: Background stores (``save_mode: background``) or synchronous ones.
    background: bool = True
    #: When a store evicts after writing: "next" (a background store: at its next step),
    #: "write" (right after writing: a synchronous store, or a background one before
    #: 270378c, whose writer thread evicted).
    evict: str = "next"


def config_of(contender: dict[str, Any]) -> Config | None:
    """The chain a bench contender ran (its ``kv_transfer_config``), or None (recompute)."""
    extra = (contender.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    chain = (extra.get("tree") or {}).get("chain")
    if chain is None:
        return None
    leaves = {c["leaf"]["name"]: c["leaf"].get("extra_config", {}) for c in chain["children"]}
    fast = leaves.get("fast")
    background = leaves["slow"].get("save_mode", "sync") == "background"
    evict = "next" if background else "write"
    if fast is None:
        return Config(chain.get("policy", "first"), None, background, evict)
    rule = Rule(
        min_seen=fast.get("admit_min_seen", 1),
        min_prompt_tokens=fast.get("admit_min_prompt_tokens", 0),
        max_prompt_tokens=(fast.get("admit_when") or {}).get("max_prompt_tokens"),
        promote=fast.get("promote", False),
    )
    return Config(chain.get("policy", "first"), rule, background, evict)


@dataclass
class Prompt:
    """One replayed request as the stores see it."""

    keys: list[str]
    tokens: int
    #: Engine steps it takes alone: its prefill (one step: prompts <= the 2,048-token
    #: batch) and one per further output token.
    steps: int = 1


def prompts(reqs: list[Scaled]) -> list[Prompt]:
    """The chunk keys of each request (the hash ids of the blocks up to each chunk's end)
    after the bench's two warm-up prompts (median length, sharing nothing)."""
    warm = warmup_length([r.prompt_tokens for r in reqs])
    # Both warm-ups arrive at once: two prefill steps, then the rest of their 4 tokens.
    out = [
        Prompt([f"warmup{i}/{c}" for c in range(warm // CHUNK_TOKENS)], warm, 1 + 3 * i)
        for i in range(2)
    ]
    for r in reqs:
        keys = [",".join(map(str, chunk)) for chunk in chunk_prefixes(r)]
        out.append(Prompt(keys, r.prompt_tokens, r.max_tokens))
    return out


def simulate(
    reqs: list[Scaled], config: Config, fast_max_bytes: int, *, as_bench: bool = False
) -> dict[str, Any]:
    """Replay ``reqs`` through ``config``; per tier: hit tokens, chunks written, evictions,
    admits/rejects/promotions (the warm-up prompts' counts left out, as the bench does).
    ``as_bench``: chunks written as the bench counts them (see ``unreported``)."""
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
    step = 0
    for rank, p in enumerate(replayed):
        step += 1  # the request's prefill step: lookup, load, saves planned
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
            t.admission.seen(p.keys)
            if t.sketch is not None:
                t.sketch.add_all(p.keys)
        request = SimpleNamespace(num_prompt_tokens=p.tokens, kv_transfer_params=None)
        for t in tiers:
            saves = []
            selected: bool | None = None
            for idx, key in enumerate(p.keys):
                # A save planned in the last INFLIGHT_SAVE_STEPS steps counts as on its
                # way even when written and evicted since (an idle engine takes no steps).
                planned = t.inflight.get(key)
                if key in t.files or (planned is not None and step - planned <= WINDOW):
                    continue
                rule = t.admission.rule
                extra = t.rule
                if rule.promote and (idx + 1) * c <= loaded:
                    counted[t.name]["promotions"] += 1
                elif (
                    (extra.oracle and last_lookup.get(key, -1) <= rank)
                    or (extra.after_hit and not loaded)
                    or (extra.tinylfu and not t.displaces(key, len(saves)))
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
            # A background store's eviction pass after the previous request's writes runs
            # in this step's ``wait_for_save``: after the scheduler planned this request's
            # saves against the files still there, before the writer writes them.
            if t.evict_due:
                t.evict()
            t.touch(saves)
            t.inflight.update((key, step) for key in saves)
            t.chunks_written += len(saves)
            # A background writer's writes are reported in a later step's output: a last
            # request without a decode step leaves them out of the bench's counts.
            t.unreported = len(saves) if p.steps == 1 and config.background else 0
            if config.evict == "write" or (saves and p.steps > 1):
                t.evict()  # synchronous, or in the request's own next (decode) step
            else:
                t.evict_due = bool(saves) or t.evict_due
        step += p.steps - 1
    for t in tiers:
        if as_bench:
            t.chunks_written -= t.unreported
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
