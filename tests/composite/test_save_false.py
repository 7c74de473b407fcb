"""``save: false`` on connectors that plan saves on their scheduler side
(``kvcompose.tree.saves_off``), on vLLM's real scheduler.

vLLM's ``OffloadingConnector`` plans store jobs in ``build_connector_meta`` and runs them in
its worker's ``wait_for_save``, which a composite calls only on saving children. Left alone,
a non-saving one keeps jobs that never complete: its next lookup of the prompt answers
"still looking" until the node's lookup deadline (30 s). The leaf gets an unreachable
``store_threshold`` instead and plans nothing. NIXL's sends are not saves and cannot be
turned off: ``save: false`` is refused there. kvcompose's prefix store becomes a consumer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcompose.composite.children import ChildConfigError
from kvcompose.testing.offloading import offloading_leaf
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt
from kvcompose.tree.saves_off import (
    UNREACHABLE_STORE_THRESHOLD,
    SaveFalseRefused,
    without_saves,
)

pytestmark = pytest.mark.v033

BLOCK = 16


def _store_jobs(step: Any) -> int:
    """The store jobs the OffloadingConnector (the root's first child) planned in a step."""
    meta = step.scheduler_output.kv_connector_metadata.children[0]
    return len(meta.store_jobs)


def _offloading_tree(save: bool) -> dict[str, Any]:
    script("b", Behaviour())
    return kvcompose_config(chain("root", offloading_leaf("off", save=save), leaf("b")))


@pytest.mark.parametrize("save", [True, False], ids=["saves", "save-false"])
def test_a_non_saving_offloading_leaf_plans_no_store_and_answers_at_once(
    harness_factory: Callable[..., Any], save: bool
) -> None:
    """Without a worker no store job ever completes: a saving leaf's jobs stay pending and
    its lookup of the same prompt answers "still looking" (the request waits). A
    non-saving leaf plans no job, so the second request is scheduled in its first step."""
    h = harness_factory(
        _offloading_tree(save), block_size=BLOCK, with_worker=False, enable_prefix_caching=False
    )
    p = prompt(100)
    first = h.add_request(p, max_tokens=2)
    steps = [h.step() for _ in range(3)]
    assert first.request_id in h.finished
    off = h.connector.children.connectors[0]
    planned = sum(_store_jobs(s) for s in steps)
    second = h.add_request(p, max_tokens=2)
    scheduled = h.step().scheduler_output.num_scheduled_tokens
    if save:  # the control: the same tree with save: true plans stores and defers
        assert planned > 0 and off.has_pending_push_work()
        assert second.request_id not in scheduled
        return
    assert planned == 0
    assert not off.has_pending_push_work()
    assert scheduled == {second.request_id: 100}
    assert off.connector_scheduler.manager.store_threshold == UNREACHABLE_STORE_THRESHOLD


def test_save_false_on_a_composite_reaches_its_nested_leaves(
    harness_factory: Callable[..., Any],
) -> None:
    """A parent's ``save: false`` holds for every leaf below it, nested composites too:
    the nested node is handed its subtree with ``save: false``."""
    script("b", Behaviour())
    tree = chain("root", chain("inner", offloading_leaf("off"), leaf("b")), save=False)
    h = harness_factory(kvcompose_config(tree), block_size=BLOCK, with_worker=False)
    inner = h.connector.children[0]
    assert not inner.saves and not inner.connector.spec.save
    off = inner.connector.children[0]
    assert not off.saves
    assert off.connector.connector_scheduler.manager.store_threshold == (
        UNREACHABLE_STORE_THRESHOLD
    )


def test_an_offloading_spec_that_ignores_the_threshold_is_refused(
    harness_factory: Callable[..., Any],
) -> None:
    """Only ``CPUOffloadingSpec`` (and specs built on it) read ``store_threshold``."""
    tiering = offloading_leaf(
        "off",
        save=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
        },
    )
    with pytest.raises(ChildConfigError, match="does not build its manager"):
        harness_factory(kvcompose_config(chain("root", tiering)), block_size=BLOCK)


def test_a_non_saving_prefix_store_plans_no_save_and_still_loads(
    harness_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """As a consumer (``kv_role``), the store plans no saves (none is left unwritten for a
    lookup to claim) and keeps loading."""
    ro = prefix_store_leaf("ro", tmp_path / "ro", fields={"save": False})
    h = harness_factory(kvcompose_config(chain("root", ro)), block_size=BLOCK, with_worker=True)
    store = h.connector.children.connectors[0].connector_scheduler
    assert not store.saves_enabled and store.loads_enabled
    h.add_request(prompt(70), max_tokens=2)
    steps = h.run_until_idle()
    assert all(not s.scheduler_output.kv_connector_metadata.children[0].saves for s in steps)
    h.assert_clean()


# ------------------------------------------------------------------ the rules, as dicts


def _fields(connector: str, module_path: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module_path,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@pytest.mark.parametrize("connector", ["NixlConnector", "NixlPullConnector", "NixlPushConnector"])
def test_nixl_refuses_save_false(connector: str) -> None:
    with pytest.raises(SaveFalseRefused, match="do_remote_decode"):
        without_saves(_fields(connector))


def test_the_rules_change_only_what_they_name() -> None:
    off = without_saves(_fields("OffloadingConnector", cpu_bytes_to_use=1))
    assert off["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 1,
        "store_threshold": UNREACHABLE_STORE_THRESHOLD,
        "max_tracker_size": 0,
    }
    with pytest.raises(SaveFalseRefused, match="TieringOffloadingSpec"):
        without_saves(_fields("OffloadingConnector", spec_name="TieringOffloadingSpec"))
    store = _fields("PrefixStoreConnector", "kvcompose.stores", path="/x")
    assert without_saves(store)["kv_role"] == "kv_consumer"
    assert without_saves({**store, "kv_role": "kv_producer"})["kv_role"] == "kv_producer"
    example = _fields("ExampleConnector", shared_storage_path="/x")
    assert without_saves(example) == example
    # a class of the same name from another module is not vLLM's
    assert without_saves(_fields("NixlConnector", "my.module")) == _fields(
        "NixlConnector", "my.module"
    )


def test_the_config_check_names_a_refused_leaf() -> None:
    pytest.importorskip("vllm")
    from kvcompose.config import ConfigError, load_config

    document = {
        "kv_role": "kv_both",
        "tree": {
            "chain": {
                "save": False,
                "children": [{"leaf": {"name": "pd", "connector": "NixlConnector"}}],
            }
        },
    }
    with pytest.raises(ConfigError, match=r"leaf\.save: save: false does not apply"):
        load_config(document, env={}, check_vllm=True)
