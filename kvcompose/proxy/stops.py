"""Stop strings over the whole generated text, across attempts, by vLLM's rules.

A backend only sees its own attempt's text, so a stop string that straddles two attempts
(``"ab"`` delivered by the first, ``"c"`` by the second, stop ``"abc"``) is found here. The
rules are those of vLLM's detokenizer (``vllm/v1/engine/detokenizer.py``):

- ``BaseIncrementalDetokenizer.update``: stop strings are looked for only once more than
  ``min_tokens`` tokens were generated, and a match must end in the text of a token after
  the ``min_tokens``-th;
- ``check_stop_strings``: of the stop strings completed by the new text, the one that
  *ends* first wins, ties going to the earlier one in the request's list; the text is cut
  at the match's start, or after its end with ``include_stop_str_in_output``.

The proxy asks backends for ``include_stop_str_in_output`` so that they hold nothing back
(``BaseIncrementalDetokenizer.get_next_output_text`` withholds ``max(len(stop)) - 1``
characters otherwise, which would leave text behind the token ids when a stream breaks),
and applies the client's choice itself: without ``include_stop_str_in_output`` it withholds
the same number of characters from the client until they cannot start a stop string.

The text arrives in D's chunks: one engine step each, unless D runs speculative decoding or
a ``--stream-interval`` above 1, or its API server merged the steps a busy client had not
read yet (``RequestOutputCollector``). A chunk holding the ``min_tokens``-th token *and*
later ones is not split here (its per-token text is unknown): no stop string is taken to
end inside it, and D's own verdict, exact within its attempt, cuts it instead (``d_stop``:
with ``include_stop_str_in_output`` D's text ends where its match ends).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    stop: str
    text: str  # what the client gets from this piece on, the stop string cut as asked


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool, min_tokens: int = 0) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_in_output
        self.min_tokens = min_tokens
        self.hold = 0 if (self.include or not self.stops) else max(map(len, self.stops)) - 1
        self.text = ""  # everything generated so far
        self.tokens = 0  # token ids generated so far
        self.emitted = 0  # characters of self.text given to the client

    def feed(
        self, piece: str, n_tokens: int, d_stop: str | None = None
    ) -> tuple[str, StopMatch | None]:
        """Add ``piece``, the text of ``n_tokens`` new tokens, with ``d_stop`` the stop
        string D ended its attempt on with this piece (if it did); return the text the
        client may get now and the match, if any."""
        before_text, before_tokens = len(self.text), self.tokens
        self.text += piece
        self.tokens += n_tokens
        if self.stops and self.tokens > self.min_tokens and before_tokens >= self.min_tokens:
            match = self._first_ending(checked_from=before_text)
            if match is not None:
                return self._cut(*match)
        if d_stop is not None and self.text.endswith(d_stop):
            # a piece across min_tokens, not checked here: cut before any of it is emitted
            return self._cut(len(self.text) - len(d_stop), d_stop)
        end = len(self.text) - self.hold
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, None

    def _first_ending(self, checked_from: int) -> tuple[int, str] | None:
        """vLLM's ``check_stop_strings``: the match ending first after ``checked_from``."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = self.text.find(stop, max(0, checked_from - len(stop) + 1))
            if i >= 0 and (best is None or i + len(stop) < best[0] + len(best[1])):
                best = (i, stop)
        return best

    def _cut(self, start: int, stop: str) -> tuple[str, StopMatch]:
        end = start + len(stop) if self.include else start
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out, StopMatch(stop, out)

    def flush(self) -> str:
        """The withheld tail, once generation ended for another reason."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
