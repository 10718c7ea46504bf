"""Criteo click logs in their raw TSV format (Kaggle Display Advertising and Criteo 1TB days).

Each line holds 40 tab-separated fields: the label (0 or 1), 13 integer features and 26 categorical features written
as hex strings (torchrec's column names: ``label``, ``int_0..int_12``, ``cat_0..cat_25``). Any feature may be empty.

How a line becomes a :class:`RecElement`:

* integer ``x`` -> ``log(1 + x)``; an empty field counts as 0. Criteo has a few negative counts, which map to
  ``-log(1 + |x|)`` (the same curve mirrored) rather than being clipped;
* hex ``h`` -> id ``int(h, 16) % num_embeddings[f]`` (ids are already hashes; the modulo folds them into the table,
  as torchrec's ``hashes`` do); an empty field is an empty bag;
* a malformed line (wrong field count, a label other than 0/1, a non-integer count, a non-hex id) either raises a
  ``ValueError`` naming the file, the line number and the field (``malformed="error"``), or is skipped and counted
  (``malformed="skip"``; see :attr:`CriteoTSVSource.num_skipped`).

Files are read in order, line by line (``.gz`` files through gzip), so memory stays flat. ``iter_from(position)``
re-reads the lines before ``position`` (a TSV line's validity is only known by parsing it), so resuming mid-file costs
a rescan of the consumed part; convert to npy (:func:`tritonrec.data.criteo_npy.criteo_tsv_to_npy`) for random access.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from tritonrec.data.elements import ElementSpec, RecElement, check_position

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: list[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: list[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: list[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]
MALFORMED_POLICIES = ("error", "skip")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


class MalformedLineError(ValueError):
    """One Criteo line that does not parse; the message names the file, the line number and the field."""


def resolve_num_embeddings(num_embeddings: int | Sequence[int], num_features: int = CAT_FEATURE_COUNT) -> list[int]:
    """One hash size per categorical feature, from a single size or a list of ``num_features`` sizes."""
    sizes = list(num_embeddings) if isinstance(num_embeddings, (list, tuple)) else [num_embeddings] * num_features
    if len(sizes) != num_features:
        raise ValueError(
            f"num_embeddings must be one int or {num_features} ints, got num_embeddings={num_embeddings!r}"
        )
    for size in sizes:
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"num_embeddings entries must be positive ints, got num_embeddings={num_embeddings!r}")
    return [int(s) for s in sizes]


def signed_log1p(x: float) -> float:
    """``log(1 + x)``, mirrored for negative ``x`` so no count is clipped."""
    return math.copysign(math.log1p(abs(x)), x)


def parse_criteo_line(line: str) -> tuple[np.ndarray, np.ndarray, float]:
    """One TSV line (without its newline) -> ``(dense [13] float32, raw_ids [26] int64, label)``.

    ``raw_ids`` holds each hex id's value, -1 for an empty field. Raises ``ValueError`` naming the offending column
    (the caller adds file and line number).
    """
    fields = line.split("\t")
    if len(fields) != len(DEFAULT_COLUMN_NAMES):
        raise ValueError(f"expected {len(DEFAULT_COLUMN_NAMES)} tab-separated fields, got {len(fields)}")
    label_text = fields[0]
    if label_text not in ("0", "1"):
        raise ValueError(f"column 'label' must be 0 or 1, got {label_text!r}")
    dense = np.zeros(INT_FEATURE_COUNT, dtype=np.float32)
    for i in range(INT_FEATURE_COUNT):
        text = fields[1 + i]
        if text:
            try:
                dense[i] = signed_log1p(int(text))
            except ValueError:
                raise ValueError(f"column {DEFAULT_INT_NAMES[i]!r} must be an integer, got {text!r}") from None
    raw_ids = np.full(CAT_FEATURE_COUNT, -1, dtype=np.int64)
    for f in range(CAT_FEATURE_COUNT):
        text = fields[1 + INT_FEATURE_COUNT + f]
        if text:
            if len(text) > 15 or not _HEX_DIGITS.issuperset(text):  # 15 hex digits always fit an int64
                raise ValueError(f"column {DEFAULT_CAT_NAMES[f]!r} must be a hex id of at most 15 digits, got {text!r}")
            raw_ids[f] = int(text, 16)
    return dense, raw_ids, float(label_text)


def hash_ids(raw_ids: np.ndarray, num_embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``raw_ids [..., 26]`` (-1 = missing) -> ``(ids, lengths [..., 26])``: present ids folded into their table by
    modulo, in row-major (sample-major) order; a missing id is an empty bag."""
    present = raw_ids >= 0
    return (raw_ids % num_embeddings)[present], present.astype(np.int64)


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open("r", encoding="utf-8", newline="")


class CriteoTSVSource:
    """Streams Criteo TSV files as :class:`RecElement` s (see module docstring).

    Args:
        paths: one TSV file or a list of them, read in order (``.gz`` allowed).
        num_embeddings: hash size of every categorical feature, or one per feature (26 ints).
        malformed: ``"error"`` raises on the first malformed line; ``"skip"`` drops it and counts it.
    """

    def __init__(
        self, paths: str | Path | Sequence[str | Path], num_embeddings: int | Sequence[int], malformed: str = "error"
    ) -> None:
        path_list = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not path_list:
            raise ValueError(f"paths must name at least one TSV file, got paths={paths!r}")
        self.paths = []
        for path in path_list:
            if not isinstance(path, (str, Path)):
                raise TypeError(f"paths must hold str or Path, got {path!r}")
            if not Path(path).is_file():
                raise ValueError(f"paths: no such file {str(path)!r}")
            self.paths.append(Path(path))
        self._num_rows = resolve_num_embeddings(num_embeddings)
        self._hash_sizes = np.asarray(self._num_rows, dtype=np.int64)
        if malformed not in MALFORMED_POLICIES:
            raise ValueError(f"malformed must be one of {MALFORMED_POLICIES}, got malformed={malformed!r}")
        self.malformed = malformed
        self.element_spec = ElementSpec(INT_FEATURE_COUNT, tuple(DEFAULT_CAT_NAMES))
        self.num_skipped = 0
        self.skipped_examples: list[str] = []

    @property
    def num_embeddings(self) -> dict[str, int]:
        return dict(zip(DEFAULT_CAT_NAMES, self._num_rows, strict=True))

    def __iter__(self) -> Iterator[RecElement]:
        return self.iter_from(0)

    def iter_from(self, position: int = 0, epoch: int = 0) -> Iterator[RecElement]:
        """Valid rows from the ``position``-th on (the files are read in the same order every ``epoch``).

        Resets :attr:`num_skipped` (the malformed lines of this pass, those before ``position`` included).
        """
        check_position(position, epoch)
        return self._elements(position)

    def _elements(self, position: int) -> Iterator[RecElement]:
        for dense, raw_ids, label in self.iter_parsed(position):
            ids, lengths = hash_ids(raw_ids, self._hash_sizes)
            yield RecElement(dense, ids, lengths, label)

    def iter_parsed(self, position: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
        """``(dense [13], raw_ids [26], label)`` of each valid row from the ``position``-th on (raw_ids -1 = empty)."""
        self.num_skipped, self.skipped_examples = 0, []
        index = 0
        for path in self.paths:
            with _open_text(path) as handle:
                for line_number, raw in enumerate(handle, start=1):
                    try:
                        parsed = parse_criteo_line(raw.rstrip("\r\n"))
                    except ValueError as error:
                        where = f"{path}:{line_number}"
                        if self.malformed == "error":
                            raise MalformedLineError(f"malformed Criteo line in file {where}: {error}") from None
                        self.num_skipped += 1
                        if len(self.skipped_examples) < 5:
                            self.skipped_examples.append(f"{where}: {error}")
                        continue
                    if index >= position:
                        yield parsed
                    index += 1
        if index < position:
            raise ValueError(f"position={position} is past the end of the data ({index} valid rows in {self.paths})")
