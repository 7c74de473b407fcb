"""Configs that name other configs: ``config: FILE`` in an extra config, ``KVCOMPOSE_CONFIG_FILE``
and the trees of nested KVCompose leaves.

The files being loaded form a stack, kept in a context variable so that a load started from
inside another (vLLM's checks call a nested connector class, which loads its own tree) sees
it too. A file already on the stack is refused: a config that includes itself, directly or
through others, would otherwise load without end, in the CLI and in vLLM's engine alike.
A file that cannot be read is reported where it was named.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from kvcompose.config.errors import ConfigError, Path, located
from kvcompose.config.files import Source, parse_bytes, read_bytes
from kvcompose.config.limits import MAX_INCLUDE_DEPTH

_LOADING: ContextVar[tuple[str, ...]] = ContextVar("kvcompose_config_loading", default=())


@dataclass(frozen=True)
class Referrer:
    """Where a file was named: the config's label, the path of the key, its line map."""

    label: str | None
    path: Path = ()
    linemap: Mapping[Path, int] | None = None

    def error(self, message: str) -> ConfigError:
        return ConfigError(located(self.linemap, self.path, message), self.label)


@contextlib.contextmanager
def including(path: str, referrer: Referrer | None = None) -> Iterator[Source]:
    """The parsed file, on the stack of files being loaded while the block runs."""
    real = os.path.realpath(path)
    stack = _LOADING.get()
    if real in stack:
        chain = " -> ".join(_show(p) for p in (*stack[stack.index(real) :], real))
        raise _refuse(referrer, path, f"{path} includes itself ({chain})")
    if len(stack) >= MAX_INCLUDE_DEPTH:
        raise _refuse(
            referrer,
            path,
            f"{path}: configs include each other more than {MAX_INCLUDE_DEPTH} levels deep",
        )
    try:
        raw = read_bytes(path)
    except ConfigError as exc:
        if referrer is None:
            raise
        raise referrer.error(f"{path}: {exc.items[0].message}") from None
    source = parse_bytes(raw, path, path=path)
    token = _LOADING.set((*stack, real))
    try:
        yield source
    finally:
        _LOADING.reset(token)


def _refuse(referrer: Referrer | None, path: str, message: str) -> ConfigError:
    return referrer.error(message) if referrer is not None else ConfigError(message, path)


def _show(path: str) -> str:
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    return path
