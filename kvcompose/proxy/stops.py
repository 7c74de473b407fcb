"""Stop strings over the whole generated text, across attempts.

A backend only sees its own attempt's text, so a stop string that straddles two attempts
(``"ab"`` delivered by the first, ``"c"`` by the second, stop ``"abc"``) is found here. The
proxy asks backends for ``include_stop_str_in_output`` so that they hold nothing back (vLLM's
detokenizer withholds ``max(len(stop)) - 1`` characters otherwise, ``v1/engine/detokenizer.py``
85-90, which would leave text behind the token ids when a stream breaks), and applies the
client's choice itself: without ``include_stop_str_in_output`` it withholds the same number
of characters from the client until they cannot start a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    stop: str
    text: str  # what the client gets from this piece on, the stop string cut as asked


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_in_output
        self.hold = 0 if (self.include or not self.stops) else max(map(len, self.stops)) - 1
        self.text = ""  # everything generated so far
        self.emitted = 0  # characters of self.text given to the client

    def feed(self, piece: str) -> tuple[str, StopMatch | None]:
        """Add ``piece``; return the text the client may get now and the match, if any."""
        start = max(0, len(self.text) - max(map(len, self.stops), default=0) + 1)
        self.text += piece
        if self.stops:
            found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if found:
                i, stop = min(found)
                end = i + len(stop) if self.include else i
                out = self.text[self.emitted : end]
                self.emitted = max(self.emitted, end)
                return out, StopMatch(stop, out)
        end = len(self.text) - self.hold
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, None

    def flush(self) -> str:
        """The withheld tail, once generation ended for another reason."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
