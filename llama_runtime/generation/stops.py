"""Stop strings: an answer ends where its text first shows one of them.

They are matched on text, not tokens: a stop string can begin in the middle of one token and
end in another, so what streams out is held back for as long as it could still be the start
of one.
"""
from __future__ import annotations


class StopText:
    """Cuts generated text at the first stop string and holds back what could begin one.

    Streamed pieces never show a stop string or any part of it; what `push` and `finish`
    return concatenates to the answer up to (not including) the first stop string.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        start = max(self.sent - self.hold, 0)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.text = self.text[: min(found)]
            end = len(self.text)
        else:
            end = max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
