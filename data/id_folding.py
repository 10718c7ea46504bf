"""Folding raw categorical ids into their tables by modulo (torchrec's ``hashes``), vectorised.

:func:`fold_ids` folds ids known to be non-negative (a batch's present ids); :func:`hash_id_matrix` folds an id
matrix whose negative entries mark missing values, keeping them -1. With one table size for every id the division is
unsigned by a scalar, which numpy does with a multiply and a shift (``%`` and signed ``//`` take slower loops), and
ids below ``2**32`` (Criteo's 32-bit hashes) are divided as uint32, half the bytes; several sizes take numpy's
per-element division.
"""

from __future__ import annotations

import numpy as np

_NARROW = 2**32  # ids and table sizes below this fold as uint32


def fold_ids(ids: np.ndarray, num_embeddings: np.ndarray, highest: int | None = None) -> np.ndarray:
    """Non-negative ``ids`` -> a new int64 array ``ids % num_embeddings`` (broadcast; one size or one per id).

    ``highest``: ``ids.max()`` when the caller already has it. A negative id gives an unspecified value (callers
    mask them)."""
    values = np.asarray(ids).astype(np.int64, copy=False)
    sizes = np.asarray(num_embeddings, dtype=np.int64)
    if values.size == 0:
        return values.copy()
    if sizes.size > 1 and not (sizes == sizes.flat[0]).all():
        folded = values // sizes
        folded *= sizes
        np.subtract(values, folded, out=folded)
        return folded
    size = int(sizes.flat[0])
    top = int(values.max()) if highest is None else highest
    if top < _NARROW and size < _NARROW:
        return fold_narrow(values, size).astype(np.int64)
    wide = values.view(np.uint64)
    quotient = wide // np.uint64(size)
    quotient *= np.uint64(size)
    np.subtract(wide, quotient, out=quotient)
    return quotient.view(np.int64)


def folds_narrow(num_embeddings: np.ndarray, highest: int) -> bool:
    """Whether ids up to ``highest`` fold by :func:`fold_narrow`: one table size for every id, ids and size below
    ``2**32``."""
    sizes = np.asarray(num_embeddings, dtype=np.int64)
    return bool(sizes.size) and bool((sizes == sizes.flat[0]).all()) and max(highest, int(sizes.flat[0])) < _NARROW


def fold_narrow(ids: np.ndarray, size: int) -> np.ndarray:
    """Non-negative ``ids`` below ``2**32`` (any shape) -> a new uint32 array ``ids % size`` (``size < 2**32``): the
    division by a scalar that numpy does with a multiply and a shift, on half the bytes of int64."""
    narrow = np.asarray(ids).astype(np.uint32)
    quotient = narrow // np.uint32(size)
    quotient *= np.uint32(size)
    np.subtract(narrow, quotient, out=quotient)
    return quotient


def hash_id_matrix(raw_ids: np.ndarray, num_embeddings: np.ndarray, highest: int | None = None) -> np.ndarray:
    """``raw_ids [n, F]`` (negative = missing) -> int64 ids folded into their tables (``num_embeddings [F]``) by
    modulo, -1 where missing. ``highest``: ``raw_ids.max()`` when the caller already has it."""
    raw = np.asarray(raw_ids).astype(np.int64, copy=False)
    hashed = fold_ids(raw, num_embeddings, highest)
    hashed |= raw >> 63  # all bits set (-1) where the raw id is negative
    return hashed


__all__ = ["fold_ids", "fold_narrow", "folds_narrow", "hash_id_matrix"]
