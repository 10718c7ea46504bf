"""An independent, dict-based managed-collision remapper for the MC tests, written from the documented policy (not
from the module's tensors): plain Python dicts and lists, one id at a time.

Policy (torchrec's MCH): ``zch_size - 1`` rows hold ids, the last row takes every id not held. Training batches
append their ids to a window (capacity ``int(1.25 * first batch * interval)``, later ids dropped); every
``interval``-th batch, before that batch is remapped, the window is merged:

1. window counts and last access per id; a threshold filter may drop ids;
2. held ids gain their window count / last access;
3. candidates, in order: held ids (ascending raw id), free rows (ascending), the window's new ids (count
   descending, then raw id); scores as in the policy (a free row scores as an unseen id: count 0, last access 0);
4. a stable sort by score, descending; the best ``zch_size - 1`` hold rows. Held ids / free rows outside them give
   their rows, in rank order, to the new ids inside them, in rank order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


def lfu(count: int, last: int, now: int) -> float:
    return count


def lru(decay: float = 1.0) -> Callable[[int, int, int], float]:
    return lambda count, last, now: -((now - last + 1) ** decay)


def distance_lfu(decay: float = 1.0) -> Callable[[int, int, int], float]:
    return lambda count, last, now: count / (now - last + 1) ** decay


def above_average(counts: dict[int, int]) -> set[int]:
    """``average_threshold_filter``: ids seen strictly more often than the mean window count."""
    mean = sum(counts.values()) / len(counts)
    return {i for i, c in counts.items() if c > mean}


class ReferenceZCH:
    """``zch_size`` rows from ``offset``; ``score(count, last_access_iter, now)`` ranks ids (higher stays)."""

    def __init__(
        self,
        zch_size: int,
        interval: int,
        score: Callable[[int, int, int], float],
        offset: int = 0,
        keep: Callable[[dict[int, int]], set[int]] | None = None,
    ) -> None:
        self.zch_size, self.interval, self.score, self.offset, self.keep = zch_size, interval, score, offset, keep
        self.rows: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.free_rows = list(range(zch_size - 1))
        self.window: list[tuple[int, int]] = []
        self.capacity: int | None = None
        self.now = 0

    def __call__(self, ids: list[int], training: bool = True) -> list[int]:
        if training:
            self.now += 1
            if not self.capacity:
                self.capacity = int(len(ids) * self.interval * 1.25)
            room = self.capacity - len(self.window)
            self.window += [(i, self.now) for i in ids[:room]]
            if self.now % self.interval == 0:
                self._merge()
        return [self.offset + self.rows.get(i, self.zch_size - 1) for i in ids]

    def table(self) -> dict[int, int]:
        """Held raw id -> output row."""
        return {i: self.offset + r for i, r in self.rows.items()}

    def _merge(self) -> None:
        counts = Counter(i for i, _ in self.window)
        last: dict[int, int] = {}
        for i, it in self.window:
            last[i] = max(last.get(i, 0), it)
        self.window = []
        if not counts:
            return
        if self.keep is not None:
            kept = self.keep(dict(counts))
            counts = Counter({i: c for i, c in counts.items() if i in kept})
        for i in counts:
            if i in self.rows:
                self.count[i] += counts[i]
                self.last[i] = last[i]
        new_ids = sorted((i for i in counts if i not in self.rows), key=lambda i: (-counts[i], i))
        candidates = [("held", i, self.score(self.count[i], self.last[i], self.now)) for i in sorted(self.rows)]
        candidates += [("free", r, self.score(0, 0, self.now)) for r in self.free_rows]
        slots = len(candidates)
        candidates += [("new", i, self.score(counts[i], last[i], self.now)) for i in new_ids]
        ranked = sorted(range(len(candidates)), key=lambda k: -candidates[k][2])  # stable
        cut = self.zch_size - 1
        given = [k for k in ranked[cut:] if k < slots]
        taking = [k for k in ranked[:cut] if k >= slots]
        assert len(given) == len(taking)
        for g, t in zip(given, taking, strict=True):
            kind, key, _ = candidates[g]
            if kind == "held":
                row = self.rows.pop(key)
                del self.count[key], self.last[key]
            else:
                row = key
                self.free_rows.remove(key)
            new_id = candidates[t][1]
            self.rows[new_id], self.count[new_id], self.last[new_id] = row, counts[new_id], last[new_id]
