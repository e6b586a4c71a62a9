"""Cache-aware placement: which candidate gets a request, given each one's cost.

    1. The cheapest estimate (cost.py) wins.
    2. Locality: the candidate holding the deepest prefix is kept while its estimate
       stays within `slack` seconds of the cheapest: keeping a conversation (or a
       burst sharing a new system prompt) on one backend pays off on every later
       turn, until its queue costs more than re-prefilling elsewhere.
    3. Spreading: candidates whose estimates are within `tie` of the cheapest
       (max(tie_seconds, tie_share x best)) count as equal. Among equals the one with
       the most free cache wins, in steps of `free_step` of its budget (records are up
       to a heartbeat old, so small differences say nothing), then the least loaded,
       then a rotation in backend order that advances only when it decides. So new
       conversations started one after another go to the backend with the most room,
       and alternate among backends with as much room, not to whichever measured
       itself fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Cost


@dataclass(frozen=True)
class Option:
    cost: Cost
    matched_tokens: float
    free_share: float  # share of its cache budget that is free; 0 when unknown
    load: int  # requests open or queued there
    key: str = ""  # the backend id: the rotation's order


class Placer:
    def __init__(self, slack: float, tie_seconds: float = 0.05, tie_share: float = 0.1,
                 free_step: float = 0.05):
        self.slack = slack
        self.tie_seconds = tie_seconds
        self.tie_share = tie_share
        self.free_step = free_step
        self._rotation = 0

    def place(self, options: list[Option]) -> int:
        """The index of the option that gets the request."""
        if not options:
            raise ValueError("no options to place on")
        if len(options) == 1:  # nothing to weigh (one backend serves the model)
            return 0
        best = min(o.cost.ttft for o in options)
        deepest = max(range(len(options)),
                      key=lambda i: (options[i].matched_tokens, -options[i].cost.ttft))
        d = options[deepest]
        if d.matched_tokens > 0 and d.cost.ttft <= best + self.slack:
            # Another candidate holding just as much is as good: pick among them by rule 3.
            peers = [i for i, o in enumerate(options) if o.matched_tokens == d.matched_tokens]
            return self._among(options, peers, min(options[i].cost.ttft for i in peers))
        return self._among(options, range(len(options)), best)

    def _among(self, options: list[Option], indexes, best: float) -> int:
        window = max(self.tie_seconds, self.tie_share * best)
        equal = [i for i in indexes if options[i].cost.ttft <= best + window]
        if len(equal) == 1:
            return equal[0]
        rank = {i: (int(options[i].free_share / self.free_step), -options[i].load) for i in equal}
        top = max(rank.values())
        equal = sorted((i for i in equal if rank[i] == top), key=lambda i: options[i].key)
        if len(equal) == 1:
            return equal[0]
        self._rotation += 1
        return equal[self._rotation % len(equal)]
