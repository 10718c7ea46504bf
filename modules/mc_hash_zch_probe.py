"""Probing of ``HashZchManagedCollisionModule`` (``modules/mc_hash_zch.py``): fbgemm's ``murmur_hash3_2x64`` and its
``zero_collision_hash`` kernels (``eviction_policy`` 0: threshold / TTL eviction, 1: LRU eviction), with races
settled one probe round at a time (see the module docstring of ``mc_hash_zch``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ZchProbes", "murmur_hash3_2x64", "unsigned_mod", "zch_in_chain", "zch_probe"]

# murmur3's uint64 constants as the int64s with the same bits (torch has no uint64 arithmetic)
_C1, _C2 = 0x87C37B91114253D5 - 2**64, 0x4CF5AD432745937F
_F1, _F2 = 0xFF51AFD7ED558CCD - 2**64, 0xC4CEB9FE1A85EC53 - 2**64
_NO_CANDIDATE = torch.iinfo(torch.int64).max  # LRU score of a row that may not be evicted


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: mask the sign copies off)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x << n) | _shr(x, 64 - n)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = (h ^ _shr(h, 33)) * _F1
    h = (h ^ _shr(h, 33)) * _F2
    return h ^ _shr(h, 33)


def murmur_hash3_2x64(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 ids -> ``[N]`` int64 holding the bits of fbgemm's ``murmur_hash3_2x64(x, 0, 0)`` (uint64).

    int64 products wrap modulo 2**64 like uint64's, so the bits are exact; ``y = seed = 0`` makes the second
    block vanish (``k2 = 0``), folding ``h2`` to ``5 * h1 + 0x38495ab5`` before finalisation."""
    k1 = _rotl(x.to(torch.int64) * _C1, 31) * _C2
    h1 = _rotl(k1, 27) * 5 + 0x52DCE729
    h2 = h1 * 5 + 0x38495AB5
    h1 = (h1 ^ 16) + (h2 ^ 16)
    h2 = (h2 ^ 16) + h1
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = h1 + h2
    return h1 ^ (h2 + h1)


def unsigned_mod(bits: torch.Tensor, modulo: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 bits read as uint64, modulo ``[N]`` positive int64: ``u = bits + 2**64`` when negative, and
    ``2**64 mod m`` is built from ``(2**63 - 1) mod m`` so nothing leaves int64."""
    r63 = ((2**63 - 1) % modulo + 1) % modulo
    r64 = (2 * r63) % modulo
    return torch.where(bits >= 0, bits % modulo, (bits % modulo + r64) % modulo)


def _first_winner(rows: torch.Tensor) -> torch.Tensor:
    """``[M]`` claimed rows in batch order -> ``[M]`` bool, True for the first claimant of each row."""
    sorted_rows, order = torch.sort(rows, stable=True)  # stable: keeps batch order inside each row
    first = torch.ones_like(sorted_rows, dtype=torch.bool)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    return torch.empty_like(first).scatter_(0, order, first)


class ZchProbes(NamedTuple):
    """Per id ``[N]``: the identity stored, its first probe, the rows probing wraps in (its bucket's size, less
    the reserved slots with ``opt_in_prob``) and its bucket's row offset."""

    ids: torch.Tensor
    first: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor

    def rows(self, which: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
        """``[M]`` row of probe ``k`` of ids ``which`` (``k [P]``: ``[M, P]`` rows); probing wraps inside the
        bucket."""
        if isinstance(k, torch.Tensor):
            return self.offsets[which, None] + (self.first[which, None] + k) % self.sizes[which, None]
        return self.offsets[which] + (self.first[which] + k) % self.sizes[which]


def zch_in_chain(probes: ZchProbes, identities: torch.Tensor, max_probe: int) -> torch.Tensor:
    """``[N]`` bool: the id is in its probes before the first free row (fbgemm's ``get_identity_slot``: such an
    id neither evicts another nor opts out)."""
    present = torch.zeros_like(probes.ids, dtype=torch.bool)
    open_chain = torch.arange(probes.ids.numel(), device=probes.ids.device)
    for k in range(max_probe):
        if open_chain.numel() == 0:
            break
        held = identities[probes.rows(open_chain, k)]
        present[open_chain[held == probes.ids[open_chain]]] = True
        open_chain = open_chain[(held != probes.ids[open_chain]) & (held != -1)]
    return present


def _claim(identities: torch.Tensor, metadata: torch.Tensor | None, rows: torch.Tensor, ids: torch.Tensor,
           expiry: torch.Tensor | None) -> None:  # fmt: skip
    """Write claimed ``rows [M]`` (distinct): the identity, and the expiry as fbgemm's ``atomicMax``."""
    identities[rows] = ids
    if metadata is not None and expiry is not None:
        metadata[rows] = torch.maximum(metadata[rows], expiry)


def _evict_lru(
    probes: ZchProbes, identities: torch.Tensor, max_probe: int, metadata: torch.Tensor, expiry: torch.Tensor,
    now: int, pending: torch.Tensor, found: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """LRU (``eviction_policy`` 1) after all probes missed: each id of ``pending [M]`` (race order) takes, among its
    probes expired before ``now`` and before its own expiry, the one expiring first (the earliest probe on ties).
    fbgemm locks the candidate while scanning, so a row goes to one id and the others fall back on their next
    candidate: settled here in rounds, each contested row to the id first in the batch. Returns the evicted rows."""
    probe_index = torch.arange(max_probe, device=pending.device)
    evicted = []
    while pending.numel():
        rows = probes.rows(pending, probe_index)  # [M, P]
        meta = metadata[rows]
        eligible = (now > meta) & (meta < expiry[pending, None])
        score = torch.where(eligible, meta.to(torch.int64), _NO_CANDIDATE)
        best = score.argmin(dim=1)  # the first minimum: fbgemm's strict ``min_hours > last_seen``
        has = score.gather(1, best[:, None]).squeeze(1) < _NO_CANDIDATE
        pending, rows = pending[has], rows[has].gather(1, best[has, None]).squeeze(1)
        if pending.numel() == 0:
            break
        won = _first_winner(rows)  # a loser's candidate is now fresh, so its next round skips it
        _claim(identities, metadata, rows[won], probes.ids[pending[won]], expiry[pending[won]])
        found[pending[won]] = rows[won]
        evicted.append(rows[won])
        pending = pending[~won]
    return torch.cat(evicted) if evicted else pending.new_empty(0)


def zch_probe(
    probes: ZchProbes, identities: torch.Tensor, max_probe: int, insert: bool,
    metadata: torch.Tensor | None = None, expiry: torch.Tensor | None = None, now: int = -1, lru: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Probe ``[U]`` ids in ``identities [Z]`` -> ``([U] rows, -1 when not found / placed; [E] evicted rows)``.
    ``insert=False``: read-only search of all ``max_probe`` probes (a free row does not end it, as in fbgemm's
    lookup). ``insert=True``: the ids must be distinct and in race order (see the module docstring); free rows
    are claimed in place. With ``metadata [Z]`` int32 and ``expiry [U]`` int32, hits and claims raise a row's
    expiry to the id's; rows that expired (``now > metadata`` and ``metadata < expiry`` of the id claiming it) are
    evicted: by an id not in its chain at the first such probe (``lru=False``, threshold eviction), or, ``lru=True``,
    the one expiring first after all probes missed."""
    ids, found, evicted = probes.ids, torch.full_like(probes.ids, -1), []
    evicting = insert and metadata is not None and expiry is not None
    may_evict = ~zch_in_chain(probes, identities, max_probe) if evicting and not lru else None
    pending = torch.arange(ids.numel(), device=ids.device)
    for k in range(max_probe):  # loop over probe rounds, each vectorised over the ids still looking
        if pending.numel() == 0:
            break
        rows = probes.rows(pending, k)
        held = identities[rows]
        hit = held == ids[pending]
        claim = (held == -1) & insert
        if evicting:
            assert metadata is not None and expiry is not None
            metadata.scatter_reduce_(0, rows[hit], expiry[pending[hit]], "amax")  # hits renew before expiry checks
        if may_evict is not None:
            meta = metadata[rows]  # type: ignore[index]
            claim |= ~hit & may_evict[pending] & (now > meta) & (meta < expiry[pending])  # type: ignore[index]
        won = torch.zeros_like(claim)
        won[claim] = _first_winner(rows[claim])
        _claim(identities, metadata if evicting else None, rows[won], ids[pending[won]],
               expiry[pending[won]] if evicting else None)  # type: ignore[index]  # fmt: skip
        if evicting:
            evicted.append(rows[won & (held != -1)])
        done = hit | won
        found[pending[done]] = rows[done]
        pending = pending[~done]
    if evicting and lru and pending.numel():
        assert metadata is not None and expiry is not None
        evicted.append(_evict_lru(probes, identities, max_probe, metadata, expiry, now, pending, found))
    return found, (torch.cat(evicted) if evicted else ids.new_empty(0))
