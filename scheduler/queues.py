"""Wait queues: a worker's waiting requests, handed out in its policy's order.

A worker's step asks its queue ``take(now, accept)``: the queue offers requests
in policy order, ``accept`` answers TAKE (it runs this step; removed from the
queue), SKIP (it cannot run now, e.g. no decode memory; it stays and does not
block the rest) or STOP (the step is full). Only the requests offered are
touched, so a step costs O(offered x log n), not a sort of the whole queue.
A caller that wants to know who was passed over records a :class:`Pick`
(``recording`` wraps ``accept``). The queues:

- :class:`HeapQueue`: a static key per request (FCFS, priority, prefix match),
  optionally a second key used while the queue is longer than a threshold.
- :class:`SlackQueue`: the ``slack`` ordering (see :mod:`scheduler.ordering`):
  per tier, a heap of feasible requests by latest start time and a heap of
  hopeless ones by arrival; starving and fair-share-deficit tiers go first.
- :class:`SortedQueue`: any ordering policy, by sorting on every take (for
  policies whose order depends on ``now``; fine for short queues).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from scheduler.ordering import OrderingPolicy, SlackPolicy, hopeless_key
from scheduler.request import Request


class Verdict(enum.Enum):
    TAKE = "take"
    SKIP = "skip"
    STOP = "stop"


Accept = Callable[[Request], Verdict]
MAX_SKIPS = 16  # offered-but-skipped requests per take before giving up the step


class PickSite(enum.Enum):
    """Where a selection of work happens."""

    DISPATCH = "dispatch"  # the global queue: which requests get a worker and decode blocks
    PREFILL = "prefill"  # a worker's step: which prefills get a chunk
    DECODE = "decode"  # a worker's step: which running requests decode
    GROW = "grow"  # a worker's step under KV pressure: which growing decodes get a block
    SWAP_IN = "swap_in"  # a worker's step: which swapped-out requests come back


@dataclass(frozen=True, slots=True)
class Pick:
    """One selection over one set of candidates, for whoever asks who was passed over
    (traces, the model checker's tier-order invariant).

    ``offers``: the candidates in the order the selection considered them, each with its
    answer (TAKE; SKIP: no room for it now; STOP: the step was full). ``rest``: the
    candidates it never considered. The requests are live objects: read them when the
    pick is reported, before the plan is applied."""

    site: PickSite
    worker_id: str  # "" for the global dispatch
    now: float
    offers: tuple[tuple[Request, Verdict], ...]
    rest: tuple[Request, ...] = ()


OnPick = Callable[[Pick], None]


def recording(accept: Accept, offers: list[tuple[Request, Verdict]]) -> Accept:
    """``accept``, appending each offer and its answer to ``offers``."""

    def rec(req: Request) -> Verdict:
        v = accept(req)
        offers.append((req, v))
        return v

    return rec


def unconsidered(candidates: list[Request], offers: list[tuple[Request, Verdict]]
                 ) -> tuple[Request, ...]:
    seen = {r.req_id for r, _ in offers}
    return tuple(r for r in candidates if r.req_id not in seen)


class WaitQueue:
    """Base: a live set of requests by id; subclasses define the order."""

    def __init__(self) -> None:
        self.live: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.live

    def requests(self) -> list[Request]:
        return list(self.live.values())

    def push(self, req: Request, now: float) -> None:
        self.live[req.req_id] = req
        self._push(req, now)

    def remove(self, req_id: str) -> Request | None:
        """Drop a request (aborted, re-placed); heaps forget it lazily."""
        return self.live.pop(req_id, None)

    def take(self, now: float, accept: Accept) -> list[Request]:
        taken: list[Request] = []
        skipped: list[Request] = []
        for req in self._offer(now):
            v = accept(req)
            if v is Verdict.TAKE:
                taken.append(req)
                del self.live[req.req_id]
            elif v is Verdict.SKIP:
                skipped.append(req)
                if len(skipped) >= MAX_SKIPS:
                    break
            else:
                skipped.append(req)
                break
        for req in skipped:
            self._push(req, now)
        for req in taken:
            self._forget(req)
        return taken

    def _push(self, req: Request, now: float) -> None:
        raise TypeError(f"{type(self).__name__} must implement _push")

    def _offer(self, now: float) -> Iterator[Request]:
        """Yield live requests in order; each yielded one is off the structure."""
        raise TypeError(f"{type(self).__name__} must implement _offer")

    def _forget(self, req: Request) -> None:
        """A taken request: drop any bookkeeping left for it."""


class HeapQueue(WaitQueue):
    def __init__(self, key: Callable[[Request], tuple], long_key: Callable[[Request], tuple] | None = None,
                 long_threshold: int = 0) -> None:
        super().__init__()
        self.key = key
        self.long_key = long_key
        self.long_threshold = long_threshold
        self._heaps: list[list[tuple[tuple, int, Request]]] = [[], []]
        self._seq = itertools.count()

    def _push(self, req: Request, now: float) -> None:
        heapq.heappush(self._heaps[0], (self.key(req), next(self._seq), req))
        if self.long_key is not None:
            heapq.heappush(self._heaps[1], (self.long_key(req), next(self._seq), req))

    def _offer(self, now: float) -> Iterator[Request]:
        use_long = self.long_key is not None and len(self.live) > self.long_threshold
        heap = self._heaps[1 if use_long else 0]
        other = self._heaps[0 if use_long else 1]
        seen: set[str] = set()
        while heap:
            _, _, req = heapq.heappop(heap)
            if req.req_id not in self.live or req.req_id in seen:
                continue  # stale entry: removed, or pushed again since
            seen.add(req.req_id)
            yield req
        del other  # the other heap keeps its entries; stale ones are skipped later

    def _forget(self, req: Request) -> None:
        if len(self._heaps[1]) > 4 * max(len(self.live), 64):
            self._heaps[1] = [e for e in self._heaps[1] if e[2].req_id in self.live]
            heapq.heapify(self._heaps[1])
        if len(self._heaps[0]) > 4 * max(len(self.live), 64):
            self._heaps[0] = [e for e in self._heaps[0] if e[2].req_id in self.live]
            heapq.heapify(self._heaps[0])


class SortedQueue(WaitQueue):
    def __init__(self, policy: OrderingPolicy) -> None:
        super().__init__()
        self.policy = policy

    def _push(self, req: Request, now: float) -> None:
        pass

    def _offer(self, now: float) -> Iterator[Request]:
        yield from self.policy.order(list(self.live.values()), now)


class SlackQueue(WaitQueue):
    """The ``slack`` order kept incrementally (same order as SlackPolicy.order)."""

    def __init__(self, policy: SlackPolicy) -> None:
        super().__init__()
        self.policy = policy
        n = policy.tiers.num_tiers
        # Per tier: (key, work, arrival, seq, request) by the policy's order key.
        self._feasible: list[list[tuple[float, float, float, int, Request]]] = [
            [] for _ in range(n)]
        # Per tier: (hopeless_key, seq, request); the head waited longest.
        self._hopeless: list[list[tuple[tuple[bool, float], int, Request]]] = [
            [] for _ in range(n)]
        self._key: dict[str, float] = {}
        self._lst: dict[str, float] = {}
        self._seq = itertools.count()
        # Starving requests by arrival: (arrival, seq, request). A waiting request's
        # last progress does not move, so once starving it stays starving until it
        # is taken; it lives here across steps and is only popped when offered
        # (re-keying every starving request each step made a step O(#starving)).
        self._starving: list[tuple[float, int, Request]] = []
        self._starving_seq: dict[str, int] = {}

    def _push(self, req: Request, now: float) -> None:
        if req.req_id in self._starving_seq:
            if self.policy.is_starving(req, now):
                self._push_starving(req)
                return
            del self._starving_seq[req.req_id]  # re-queued after progress
        key, work, lst = self.policy.order_key(req)
        self._key[req.req_id] = key
        self._lst[req.req_id] = lst
        if lst >= now:
            heapq.heappush(self._feasible[req.tier],
                           (key, work, req.arrival_time, next(self._seq), req))
        else:
            self._demote(req.tier, req)

    def _push_starving(self, req: Request) -> None:
        seq = next(self._seq)
        self._starving_seq[req.req_id] = seq
        heapq.heappush(self._starving, (req.arrival_time, seq, req))

    def _valid(self, req: Request, key: float) -> bool:
        return req.req_id in self.live and self._key.get(req.req_id) == key

    def _demote(self, t: int, req: Request) -> None:
        heapq.heappush(self._hopeless[t], (hopeless_key(req), next(self._seq), req))

    def _clean(self, now: float) -> None:
        for t, heap in enumerate(self._feasible):
            while heap and (not self._valid(heap[0][4], heap[0][0])
                            or self._lst[heap[0][4].req_id] < now):
                entry = heapq.heappop(heap)
                if self._valid(entry[4], entry[0]):
                    self._demote(t, entry[4])
        for heap in self._hopeless:
            while heap and heap[0][2].req_id not in self.live:
                heapq.heappop(heap)

    def _peek_feasible(self, tiers: list[int], now: float) -> Request | None:
        """The best feasible request of ``tiers`` (left on its heap); heads that became
        hopeless meanwhile are demoted on the way."""
        while True:
            best_t = -1
            best = None
            for t in tiers:
                heap = self._feasible[t]
                while heap and not self._valid(heap[0][4], heap[0][0]):
                    heapq.heappop(heap)
                if heap:
                    key = (heap[0][0] - self.policy.credit(t), heap[0][1], heap[0][2])
                    if best is None or key < best:
                        best, best_t = key, t
            if best_t < 0:
                return None
            req = self._feasible[best_t][0][4]
            if self._lst[req.req_id] >= now:
                return req
            heapq.heappop(self._feasible[best_t])
            self._demote(best_t, req)  # became hopeless while below the top

    def _pop_feasible(self, tiers: list[int], now: float) -> Request | None:
        req = self._peek_feasible(tiers, now)
        if req is not None:
            heapq.heappop(self._feasible[req.tier])
        return req

    def _pop_hopeless(self, tiers: list[int], now: float) -> Request | None:
        for t in tiers:
            heap = self._hopeless[t]
            while heap:
                req = heapq.heappop(heap)[2]
                if req.req_id in self.live:
                    return req
        return None

    def _offer(self, now: float) -> Iterator[Request]:
        self._clean(now)
        pol = self.policy
        offered: set[str] = set()
        # 1. Newly starving requests (offered after step 2) move to the starving
        # heap: only hopeless ones can have waited that long; started prefills sit
        # first in each hopeless heap.
        for heap in self._hopeless:
            # Started prefills sit first in the heap; scan past them to the waiting ones.
            stash = []
            while heap:
                req = heap[0][2]
                if req.req_id not in self.live:
                    heapq.heappop(heap)
                elif pol.is_starving(req, now):
                    self._push_starving(heapq.heappop(heap)[2])
                elif heap[0][0][0]:
                    break  # not started and not starving: none behind it starves either
                else:
                    stash.append(heapq.heappop(heap))
            for entry in stash:
                heapq.heappush(heap, entry)
        # 2. Feasible requests of the tiers the guard yields to.
        top = list(range(min(pol.GUARD_YIELDS_TO_TIERS, pol.tiers.num_tiers)))
        while top:
            req = self._pop_feasible(top, now)
            if req is None:
                break
            offered.add(req.req_id)
            yield req
        # 3. Starving requests, longest waiting first (popped only when offered;
        # a skipped one is pushed back here by ``take``).
        while self._starving:
            _, seq, req = heapq.heappop(self._starving)
            if req.req_id not in self.live or self._starving_seq.get(req.req_id) != seq:
                continue  # stale: taken, removed, or pushed again since
            if req.req_id in offered:
                continue
            offered.add(req.req_id)
            yield req
        n = pol.tiers.num_tiers
        everyone = list(range(n))
        deficit = [t for t in everyone if t in pol.deficit_tiers]
        rest = [t for t in everyone if t not in pol.deficit_tiers]
        owed = deficit if pol.DEFICIT_FEASIBLE_FIRST else []
        # 4. Feasible requests by key, but never ahead of a hopeless request of a more
        # urgent tier (no tier inversion): before a feasible request of tier u, every
        # hopeless request of the tiers before u.
        for group in (owed, everyone):
            while True:
                req = self._peek_feasible(group, now)
                if req is None:
                    break
                for t in range(req.tier):
                    while (h := self._pop_hopeless([t], now)) is not None:
                        if h.req_id not in offered:
                            offered.add(h.req_id)
                            yield h
                if self._peek_feasible(group, now) is not req:
                    continue  # a consumer's push changed the heads: look again
                heapq.heappop(self._feasible[req.tier])
                if req.req_id in offered:
                    continue
                offered.add(req.req_id)
                yield req
        # 5. The remaining hopeless: deficit tiers first, then by tier.
        for group in (deficit, rest):
            while True:
                req = self._pop_hopeless(group, now)
                if req is None:
                    break
                if req.req_id in offered:
                    continue
                offered.add(req.req_id)
                yield req

    def _forget(self, req: Request) -> None:
        self._lst.pop(req.req_id, None)
        self._key.pop(req.req_id, None)
        self._starving_seq.pop(req.req_id, None)

