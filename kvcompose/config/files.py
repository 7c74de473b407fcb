"""Reading config files and standard input into plain data plus the line of each path.

Files and standard input take the same road: bytes (at most ``MAX_FILE_BYTES``), UTF-8 with
or without a BOM (a bad byte or a NUL is reported with its line), then one parse
(``parse``: YAML, or JSON for ``.json`` files and standard input that starts as a JSON
object) and one walk (``walk.check_plain``) that refuses what is not plain JSON and maps
each path to its line.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import gc
import os
import re
import select
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import yaml

from kvcompose.config import limits, parse
from kvcompose.config.errors import ConfigError, ErrorItem, LineMap, Path, located
from kvcompose.config.limits import MAX_FILE_BYTES, size_text
from kvcompose.config.walk import check_plain
from kvcompose.tree import describe

STDIN = "<stdin>"


@dataclass
class Source:
    """A parsed document: the data, where it came from, and the line of each path."""

    data: Any
    label: str | None = None
    linemap: LineMap = field(default_factory=LineMap)
    path: str | None = None  # the file, when there is one

    def mapping(self) -> dict[str, Any]:
        """The document's top level, which must be a mapping (a copy)."""
        if not isinstance(self.data, Mapping):
            message = f"expected a mapping at the top level, got {describe(self.data)}"
            raise ConfigError(message, self.label)
        return dict(self.data)

    def error(self, path: Path, message: str) -> ConfigError:
        """A ``ConfigError`` about ``path`` in this document, with its line."""
        return ConfigError(located(self.linemap, path, message), self.label)


def read_file(path: str | os.PathLike) -> Source:
    """Parse a YAML (``.yaml``/``.yml``/anything else) or JSON (``.json``) file."""
    label = os.fspath(path)
    return parse_bytes(read_bytes(label), label, path=label)


def read_stream(stream: IO[Any], label: str = STDIN) -> Source:
    """Parse standard input (or another stream): JSON when it starts as a JSON object does,
    else YAML (``parse_bytes``)."""
    raw = stream.read(MAX_FILE_BYTES + 1)
    if isinstance(raw, str):  # a text stream without a buffer (tests)
        raw = raw.encode("utf-8", "surrogateescape")
    _check_size(len(raw), label)
    return parse_bytes(raw, label)


def read_bytes(path: str) -> bytes:
    """A file's bytes; ``ConfigError`` (labelled with the path) when it cannot be read, is
    larger than ``MAX_FILE_BYTES``, or is a pipe nothing is written to for ``PIPE_WAIT_S``.

    Opened non-blocking: opening a FIFO that no process writes to would wait forever. Pipes
    are still read (``kvcompose validate <(make-config)``), waiting for each piece of data
    at most ``PIPE_WAIT_S``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                raw = _read_pipe(fd, path)
            else:  # a device reads like a file: /dev/zero is cut by the bound, /dev/tty waits
                os.set_blocking(fd, True)
                if stat.S_ISREG(st.st_mode):
                    _check_size(st.st_size, path)
                raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(_os_error(exc), path) from None
    _check_size(len(raw), path)
    return raw


def _read_pipe(fd: int, label: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    poller = select.poll()  # not select(): no limit on the descriptor's number
    poller.register(fd, select.POLLIN)
    while size <= MAX_FILE_BYTES:
        if not poller.poll(limits.PIPE_WAIT_S * 1000):
            raise ConfigError(
                f"nothing was written to this pipe for {limits.PIPE_WAIT_S:g} s "
                "(a FIFO no process writes to?)",
                label,
            )
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not data:  # the writer closed it
            break
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


def _check_size(size: int, label: str) -> None:
    if size > MAX_FILE_BYTES:
        shown = "larger than" if size == MAX_FILE_BYTES + 1 else f"{size_text(size)}, more than"
        raise ConfigError(
            f"too large for a config file ({shown} {size_text(MAX_FILE_BYTES)})", label
        )


def _os_error(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not a config file"
    if exc.errno == errno.ELOOP:
        return "too many levels of symbolic links (a symlink loop?)"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return f"cannot read: {exc.strerror or exc}"


def parse_bytes(
    raw: bytes, label: str, kind: str | None = None, *, path: str | None = None
) -> Source:
    """The data of a config's bytes and the line of each path. ``kind``: ``json`` or
    ``yaml``; by default the file's suffix says, and text without a file (standard input)
    is JSON when it starts as a JSON object does (``{"`` or ``{}``)."""
    text = decode(raw, label)
    if kind is None and path is not None:
        kind = "json" if path.lower().endswith(".json") else "yaml"
    json = kind == "json" if kind else bool(_JSON_START.match(text))
    with gc_paused():
        try:
            read = parse.read(text, json)
        except yaml.YAMLError as exc:
            raise ConfigError(_syntax_error(exc, text, "JSON" if json else "YAML"), label) from None
        except RecursionError:
            raise ConfigError(parse.TOO_DEEP, label) from None
        if read is None:
            raise ConfigError("empty document", label)
        data, marks = read
        return Source(data, label, check_plain(data, label, marks=marks), path)


_JSON_START = re.compile(r'\s*\{\s*["}]')


def decode(raw: bytes, label: str) -> str:
    """UTF-8 text (a BOM is dropped); bad bytes and NUL bytes are reported with their line."""
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    elif raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ConfigError(ErrorItem((), "UTF-16 text: save the config as UTF-8", 1), label)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8")
        problem = f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at column {{}} cannot be decoded"
        raise _refused_after(before, problem, label) from None
    nul = text.find("\x00")
    if nul >= 0:
        problem = "NUL byte at column {}: a config is text, is this a binary file?"
        raise _refused_after(text[:nul], problem, label)
    return text


def _refused_after(before: str, problem: str, label: str) -> ConfigError:
    """``problem`` (its ``{}`` the column) at the character that follows ``before``."""
    column = len(before) - before.rfind("\n")
    return ConfigError(ErrorItem((), problem.format(column), before.count("\n") + 1), label)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building many objects at once (nodes, data,
    models) otherwise triggers collections that make loading superlinear. Nothing built
    here forms reference cycles, so nothing waits on the collector meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _syntax_error(exc: yaml.YAMLError, text: str, kind: str) -> ErrorItem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    line = mark.line + 1 if mark is not None else None
    if "maximum nesting depth" in problem:  # libyaml's own limit (1000)
        return ErrorItem((), parse.TOO_DEEP, line)
    found = text[mark.index] if mark is not None and mark.index < len(text) else " "
    parsing = not isinstance(exc, yaml.constructor.ConstructorError)
    if parsing and "'" not in problem and not found.isspace():  # libyaml does not say it
        problem += f", found {found!r}"
    message = f"{kind} syntax error: {problem}"
    context = getattr(exc, "context", None)
    if context:
        message += f" ({context})"
    if mark is not None:
        message += f" (column {mark.column + 1})"
    return ErrorItem((), message, line)
