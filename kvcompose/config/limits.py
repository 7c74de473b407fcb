"""The bounds that keep reading any input cheap: every config ends in a result or a short
error within a second or two and bounded memory, whatever a user or an attacker hands in.

Real configs are far inside every limit (the largest example is a few KB, ten levels deep);
the limits are there so that a mistake (``/dev/zero`` as a config, a file that includes
itself) or a hostile input (a YAML alias bomb, ten thousand nesting levels) is refused
quickly instead of hanging vLLM's engine or the CLI.
"""

from __future__ import annotations

#: A config file or standard input larger than this is refused before it is parsed.
MAX_FILE_BYTES = 2 * 1024 * 1024
#: Seconds a config read from a pipe or FIFO may go without data before it is refused.
PIPE_WAIT_S = 10.0
#: Mappings and lists nested deeper than this (a tree of ~30 composite levels).
MAX_DEPTH = 100
#: Nodes that YAML aliases (``*name``) and shared Python objects may add to a document
#: beyond its own: a few shared blocks are fine, a "billion laughs" is not.
MAX_ALIAS_NODES = 100_000
#: Digits of an integer (Python refuses to convert more than 4300; nothing needs 100).
MAX_INT_DIGITS = 100
#: Configs that include configs (``config: FILE`` of nested KVCompose leaves).
MAX_INCLUDE_DEPTH = 16
#: Characters of a file name in a message (a longer one is cut in the middle).
MAX_LABEL = 200
#: Characters of a whole message (of a value echoed in it: ``tree.messages.MAX_SHOWN``).
MAX_MESSAGE = 1000
#: Names listed in a message ("children: a, b, ...").
MAX_LISTED = 12


def size_text(n: int) -> str:
    """``4194304`` -> ``4 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"
