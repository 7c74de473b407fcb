"""One-line config errors that name the path in the file (and the line, when known)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcompose.config.limits import MAX_LABEL, MAX_LISTED, MAX_MESSAGE
from kvcompose.tree.error_messages import MAX_SHOWN, at, shown

Path = tuple[str | int, ...]


class LineMap(dict[Path, int]):
    """The line of each document path, and a hint at the unquoted YAML scalars that YAML 1.1
    read as something else than they look (``no`` -> false, ``0123`` -> 83)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hints: dict[Path, str] = {}


def shown_list(names: Iterable[Any], limit: int = MAX_LISTED) -> str:
    """``a, b, c`` (at most ``limit`` of them, then how many more)."""
    names = list(names)
    head = ", ".join(str(n) if len(str(n)) <= MAX_SHOWN else shown(str(n)) for n in names[:limit])
    return head + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


@dataclass(frozen=True)
class ErrorItem:
    """One problem: where (``path`` inside the document) and what (``message``)."""

    path: Path
    message: str
    line: int | None = None

    def render(self, label: str | None = None) -> str:
        head = ""
        if label is not None:
            label = _short_label(label)
            head = f"{label}:{self.line}: " if self.line else f"{label}: "
        elif self.line:
            head = f"line {self.line}: "
        return head + at(self.path, self.message)


class ConfigError(ValueError):
    """A config problem, rendered as one line: ``file:line: path: message``.

    ``items`` holds every problem found (the message shows the first and counts the rest);
    ``label`` is the file name or another description of where the config came from.
    """

    def __init__(self, items: ErrorItem | Sequence[ErrorItem] | str, label: str | None = None):
        if isinstance(items, str):
            items = [ErrorItem((), items)]
        elif isinstance(items, ErrorItem):
            items = [items]
        self.items: tuple[ErrorItem, ...] = tuple(items)
        self.label = label
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.items:
            return f"{self.label}: invalid config" if self.label else "invalid config"
        first = _one_line(self.items[0].render(self.label))
        more = len(self.items) - 1
        if more:
            first += f" (and {more} more problem{'s' if more > 1 else ''})"
        return first

    @property
    def lines(self) -> list[str]:
        """Every problem, one line each."""
        return [_one_line(item.render(self.label)) for item in self.items]


def _short_label(label: str) -> str:
    """A file name as messages show it: ``''`` for an empty one, a very long one cut in the
    middle (its end names the file), so that the message after it is never cut off."""
    if not label:
        return "''"
    if len(label) <= MAX_LABEL:
        return label
    half = (MAX_LABEL - 3) // 2
    return f"{label[:half]}...{label[-half:]}"


def _one_line(text: str) -> str:
    text = " ".join(text.split("\n"))
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 20] + " ... (shortened)"
    return text


def located(linemap: Mapping[Path, int] | None, path: Path, message: str) -> ErrorItem:
    """A problem at ``path`` with its line, and a hint to quote the value when YAML read an
    unquoted scalar there as a boolean or a number that looks like something else."""
    hint = getattr(linemap, "hints", {}).get(tuple(path))
    if hint is not None:
        message += f" ({hint})"
    return ErrorItem(tuple(path), message, line_for(linemap, path))


def line_for(linemap: Mapping[Path, int] | None, path: Path) -> int | None:
    """The line of ``path``, or of its nearest ancestor that the map knows."""
    if not linemap:
        return None
    path = tuple(path)
    while True:
        if path in linemap:
            return linemap[path]
        if not path:
            return None
        path = path[:-1]
