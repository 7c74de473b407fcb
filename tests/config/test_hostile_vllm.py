"""Hostile connector modules, checked against the installed vLLM: a module that exits or
prints on import, a class that is no connector, and a config that includes itself given to
vLLM's real scheduler. Each ends in a one-line ``ConfigError`` (exit 1 from the CLI) and
never in a silent exit, polluted JSON or endless recursion."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from config_helpers import needs_vllm
from hostile_helpers import assert_clean_error, cli

from kvcompose.config import ConfigError, tree_from_extra_config

pytestmark = needs_vllm

MODULES = {
    "kvc_hostile_exits": "import sys\nsys.exit(0)\n",
    "kvc_hostile_prints": """
        print("hello from an import")
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        class LoudConnector(ExampleConnector):
            pass
        """,
    "kvc_hostile_namespace": "from argparse import Namespace\n",
    "kvc_hostile_exits_later": """
        import sys
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        class ExitingConnector(ExampleConnector):
            @classmethod
            def requires_piecewise_for_cudagraph(cls, extra_config):
                sys.exit(3)
        """,
}


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of hostile connector modules, importable here and in child processes."""
    for name, text in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def leaf_config(connector: str, module: str, **extra: object) -> dict[str, object]:
    return {
        "kv_role": "kv_both",
        "tree": {
            "leaf": {"connector": connector, "module_path": module, "extra_config": dict(extra)}
        },
    }


def write(path: Path, data: dict[str, object]) -> str:
    path.write_text(json.dumps(data))
    return path.name


@pytest.mark.vllm_process
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("connector", "module", "problem"),
    [
        (
            "C",
            "kvc_hostile_exits",
            "tree.leaf.module_path: cannot import module 'kvc_hostile_exits': it calls "
            "sys.exit(0) on import",
        ),
        (
            "Namespace",
            "kvc_hostile_namespace",
            "tree.leaf.connector: kvc_hostile_namespace.Namespace is not a vLLM KV connector "
            "(not a subclass of KVConnectorBase_V1)",
        ),
    ],
    ids=["a-module-that-exits-on-import", "a-class-that-is-no-connector"],
)
def test_a_connector_vllm_cannot_build(
    modules: Path, connector: str, module: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config(leaf_config(connector, module), env={}, check_vllm=True)
    assert str(info.value) == f"kv_connector_extra_config: {problem}"
    name = write(modules / f"{module}.json", leaf_config(connector, module))
    assert_clean_error(
        cli("validate", "--check-vllm", name, cwd=modules, pythonpath=(str(modules),)),
        f"{name}:1: {problem}",
    )


@pytest.mark.vllm_process
@pytest.mark.timeout(300)
def test_a_module_that_prints_on_import_leaves_stdout_clean(modules: Path) -> None:
    name = write(
        modules / "prints.json",
        leaf_config("LoudConnector", "kvc_hostile_prints", shared_storage_path="/kv"),
    )
    code, out, err = cli("vllm-args", "--json", name, cwd=modules, pythonpath=(str(modules),))
    assert code == 0, err[-2000:]
    assert (
        json.loads(out)["kv_connector_extra_config"]["tree"]["leaf"]["connector"] == "LoudConnector"
    )
    assert "hello from an import" in err


def test_a_connector_that_exits_while_checked(modules: Path) -> None:
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config(
            leaf_config("ExitingConnector", "kvc_hostile_exits_later", shared_storage_path="/kv"),
            env={},
            check_vllm=True,
        )
    assert str(info.value) == (
        "kv_connector_extra_config: tree.leaf: connector "
        "'ExitingConnector': its code called sys.exit(3) while being "
        "checked"
    )


def test_a_route_predicate_module_that_exits(modules: Path) -> None:
    extra = {
        "tree": {
            "route": {
                "default": "a",
                "rules": [{"predicate": "kvc_hostile_exits:pick", "child": "a"}],
                "children": [
                    {
                        "leaf": {
                            "name": "a",
                            "connector": "ExampleConnector",
                            "extra_config": {"shared_storage_path": "/kv"},
                        }
                    }
                ],
            }
        }
    }
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config(extra, env={}, check_vllm=True)
    assert str(info.value) == (
        "kv_connector_extra_config: tree.route.rules[0].predicate: "
        "cannot import module 'kvc_hostile_exits': it calls sys.exit(0) "
        "on import"
    )


@pytest.mark.timeout(300)
def test_a_config_that_includes_itself_in_vllms_scheduler(
    harness_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM builds the KVCompose connector from ``{"config": FILE}``: a file whose nested
    KVCompose leaf names the same file ends in a ConfigError, not endless recursion."""
    path = tmp_path / "self.yaml"
    path.write_text(
        "tree:\n  chain:\n    children:\n"
        "      - leaf: {connector: ExampleConnector, extra_config: "
        "{shared_storage_path: /tmp/kvcompose-hostile}}\n"
        f"      - leaf: {{connector: KVCompose, extra_config: {{config: {path}}}}}\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as info:  # the ConfigError is somewhere in the chain
        harness_factory(
            {
                "kv_connector": "KVCompose",
                "kv_connector_module_path": "kvcompose",
                "kv_connector_extra_config": {"config": str(path)},
            }
        )
    chain = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert not any(isinstance(e, RecursionError) for e in chain)
    errors = [e for e in chain if isinstance(e, ConfigError)]
    assert errors, chain
    assert str(errors[0]) == (
        f"{path}:5: tree.chain.children[1].leaf.extra_config.config: "
        f"{path} includes itself ({path.name} -> {path.name})"
    )
