"""Stop strings: an answer ends where its text first shows one of them.

They are matched on text, not tokens: a stop string can begin in the middle of one token and
end in another, so what streams out is held back for as long as it could still be the start
of one.
"""
from __future__ import annotations

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string in `text[start:]` begins, and which one it is."""
    found = [(i, s) for i, s in ((text.find(s, start), s) for s in stops if s) if i >= 0]
    return min(found, key=lambda f: f[0]) if found else None


class StopText:
    """Cuts generated text at the first stop string and holds back what could begin one.

    Streamed pieces never show a stop string or any part of it; what `push` and `finish`
    return concatenates to the answer up to (not including) the first stop string, which
    `matched` then names.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched: str | None = None

    @property
    def hit(self) -> bool:
        return self.matched is not None

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        found = first_stop(self.text, self.stops, max(self.sent - self.hold, 0))
        if found:
            self.text, self.matched = self.text[: found[0]], found[1]
            end = len(self.text)
        else:
            end = max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
