"""Criteo click logs in their raw TSV format (Kaggle Display Advertising and Criteo 1TB days).

Each line holds 40 tab-separated fields: the label (0 or 1), 13 integer features and 26 categorical features written
as hex strings (torchrec's column names: ``label``, ``int_0..int_12``, ``cat_0..cat_25``). Any feature may be empty.
What a valid line is, and how it becomes numbers, is :mod:`tritonrec.data.criteo_parse`:

* integer ``x`` -> ``log(1 + x)``; an empty field counts as 0. Criteo has a few negative counts, which map to
  ``-log(1 + |x|)`` (the same curve mirrored) rather than being clipped;
* hex ``h`` -> id ``int(h, 16) % num_embeddings[f]`` (ids are already hashes; the modulo folds them into the table,
  as torchrec's ``hashes`` do); an empty field is an empty bag;
* a malformed line (wrong field count, a label other than 0/1, a count that is not a plain ASCII integer of at most
  18 digits, an id that is not 1-15 hex digits, bytes that are not UTF-8) and a ``.gz`` file that ends early either
  raise :class:`MalformedLineError` naming the file, the line number and the field (``malformed="error"``), or are
  skipped and counted (``malformed="skip"``; see :attr:`CriteoTSVSource.num_skipped`). The count is the reading
  process's: behind a loader with workers (``make_rank_loader(..., num_workers>0)``) each worker counts in its own
  copy of the source, and the main process's stays 0; read with ``num_workers=0`` to count a file's bad lines.

Files are read in order, in 1 MiB blocks parsed with a handful of vectorised numpy passes (``.gz`` through gzip), so
memory stays flat. Across ranks (``rank``, ``world_size``) each plain file is split by bytes and each ``.gz`` file by
line stride (:mod:`tritonrec.data.criteo_files`): every line of an epoch goes to exactly one rank, and a malformed
line is reported by the rank that owns it. ``shuffle_buffer > 1`` permutes each rank's rows within blocks of that
many, differently every epoch. ``iter_from(position)`` re-reads the shard's rows before ``position`` (a line's
validity is only known by parsing it); convert to npy (:func:`tritonrec.data.criteo_npy.criteo_tsv_to_npy`) for
random access.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from tritonrec.data.criteo_files import ShardLines, TruncatedGzipError
from tritonrec.data.criteo_parse import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_COLUMN_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    INT_FEATURE_COUNT,
    ParsedBlock,
    parse_criteo_block,
    parse_criteo_line,
    signed_log1p,
)
from tritonrec.data.element_chunk import ElementChunk
from tritonrec.data.elements import ElementSpec, RecElement, check_position
from tritonrec.data.id_folding import hash_id_matrix
from tritonrec.data.sharding import Shard, block_shuffled, check_seed, check_shuffle_buffer, elements_of
from tritonrec.kernels.checks import check_int

__all__ = [
    "CAT_FEATURE_COUNT",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_COLUMN_NAMES",
    "DEFAULT_INT_NAMES",
    "DEFAULT_LABEL_NAME",
    "INT_FEATURE_COUNT",
    "CriteoTSVSource",
    "MalformedLineError",
    "hash_id_matrix",
    "parse_criteo_line",
    "resolve_num_embeddings",
    "signed_log1p",
]
MALFORMED_POLICIES = ("error", "skip")
_MAX_EXAMPLES = 5


class MalformedLineError(ValueError):
    """One Criteo line that does not parse; the message names the file, the line number and the field."""


def resolve_num_embeddings(num_embeddings: int | Sequence[int], num_features: int = CAT_FEATURE_COUNT) -> list[int]:
    """One hash size per categorical feature, from a single size or a list of ``num_features`` sizes."""
    if not isinstance(num_embeddings, (list, tuple)):
        return [check_int(num_embeddings, "num_embeddings", 1)] * num_features
    sizes = list(num_embeddings)
    if len(sizes) != num_features:
        raise ValueError(
            f"num_embeddings must be one int or {num_features} ints, got num_embeddings={num_embeddings!r}"
        )
    return [check_int(s, f"num_embeddings[{i}]", 1) for i, s in enumerate(sizes)]


class CriteoTSVSource:
    """Streams Criteo TSV files as :class:`RecElement` s or :class:`ElementChunk` s (see module docstring).

    Args:
        paths: one TSV file or a list of them, read in order (``.gz`` allowed).
        num_embeddings: hash size of every categorical feature, or one per feature (26 ints).
        malformed: ``"error"`` raises on the first malformed line; ``"skip"`` drops it and counts it.
        rank, world_size: this process's shard of the lines.
        shuffle_buffer: shuffle each epoch within blocks of this many rows (0 or 1: file order).
        shuffle_seed: seeds the shuffle (with the epoch and the shard).
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        num_embeddings: int | Sequence[int],
        malformed: str = "error",
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        shuffle_seed: int = 0,
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
        self.shuffle_buffer = check_shuffle_buffer(shuffle_buffer)
        self.shuffle_seed = check_seed(shuffle_seed, "shuffle_seed")
        self._set_shard(Shard.of(rank, world_size))
        self.element_spec = ElementSpec(INT_FEATURE_COUNT, tuple(DEFAULT_CAT_NAMES))
        self.num_skipped = 0
        self.skipped_examples: list[str] = []

    def _set_shard(self, shard: Shard) -> None:
        self.shard = shard
        self.rank, self.world_size = shard.rank, shard.world_size

    def sub_shard(self, index: int, count: int) -> CriteoTSVSource:
        """This source's part ``index`` of ``count`` (a loader worker's share of the rank's lines)."""
        part = copy.copy(self)
        part._set_shard(self.shard.split(index, count))
        part.skipped_examples = []
        return part

    @property
    def num_embeddings(self) -> dict[str, int]:
        return dict(zip(DEFAULT_CAT_NAMES, self._num_rows, strict=True))

    def __iter__(self) -> Iterator[RecElement]:
        return self.iter_from(0)

    def iter_from(self, position: int = 0, epoch: int = 0) -> Iterator[RecElement]:
        """Valid rows of this shard from the ``position``-th on (``epoch`` only changes the order when shuffling).

        Each pass resets :attr:`num_skipped` (the malformed lines of this pass, those before ``position`` included).
        """
        return elements_of(self.iter_chunks(position, epoch))

    def iter_chunks(self, position: int = 0, epoch: int = 0) -> Iterator[ElementChunk]:
        """The rows of :meth:`iter_from` as chunks."""
        check_position(position, epoch)
        if self.shuffle_buffer > 1:
            # The shuffle reads from the start of position's block, but the end check (made once the files are
            # read, as only parsing counts the valid rows) is against position itself, as without shuffling.
            return block_shuffled(
                lambda start: self._file_chunks(start, position),
                position,
                self.shuffle_buffer,
                self.shuffle_seed,
                epoch,
                self.shard,
            )
        return self._file_chunks(position, position)

    def _file_chunks(self, start: int, position: int) -> Iterator[ElementChunk]:
        for dense, raw_ids, labels in self._parsed_chunks(start, position):
            yield ElementChunk.from_id_matrix(dense, hash_id_matrix(raw_ids, self._hash_sizes), labels)

    def iter_parsed_chunks(self, position: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(dense [n, 13] float32, raw_ids [n, 26] int64 (-1 = empty), labels [n] float32)`` blocks of this shard's
        valid rows, in file order, from the ``position``-th on."""
        check_position(position, 0)
        return self._parsed_chunks(position, position)

    def _parsed_chunks(self, start: int, position: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Rows from the ``start``-th on; once the files are read, a ``ValueError`` if the shard holds fewer than
        ``position`` (the caller's position: ``start`` is rounded down to a shuffle block)."""
        self.num_skipped, self.skipped_examples = 0, []
        index = 0
        for path in self.paths:
            lines = ShardLines(path, self.shard)
            try:
                for block, first, step in lines:
                    parsed = parse_criteo_block(block)
                    malformed = parsed.bad_rows.size > 0
                    rows = self._handle_malformed(parsed, lines, first, step) if malformed else len(parsed.labels)
                    if index + rows > start:
                        first_row = max(start - index, 0)
                        yield (
                            parsed.dense[first_row:rows],
                            parsed.raw_ids[first_row:rows],
                            parsed.labels[first_row:rows],
                        )
                    index += rows
                    if malformed and self.malformed == "error":  # after the valid rows before the bad line
                        self._raise_first(parsed, lines, first, step)
            except TruncatedGzipError as error:
                self._handle_truncated(error, lines)
        if index < position:
            raise ValueError(f"position={position} is past the end of the data ({index} valid rows in {self.paths})")

    def _handle_malformed(self, parsed: ParsedBlock, lines: ShardLines, first: int, step: int) -> int:
        """Count the bad lines (skip) or say how many valid rows precede the first one (error)."""
        if self.malformed == "error":
            return int(parsed.bad_rows[0])  # every line before the first bad one is valid
        self.num_skipped += int(parsed.bad_rows.size)
        for row, reason in zip(parsed.bad_rows, parsed.reasons, strict=True):
            if len(self.skipped_examples) >= _MAX_EXAMPLES:
                break
            self.skipped_examples.append(f"{lines.path}:{lines.line_number(first + int(row) * step)}: {reason}")
        return len(parsed.labels)

    def _raise_first(self, parsed: ParsedBlock, lines: ShardLines, first: int, step: int) -> None:
        where = f"{lines.path}:{lines.line_number(first + int(parsed.bad_rows[0]) * step)}"
        raise MalformedLineError(f"malformed Criteo line in file {where}: {parsed.reasons[0]}")

    def _handle_truncated(self, error: TruncatedGzipError, lines: ShardLines) -> None:
        where = f"{error.path}:{lines.line_number(error.line_index)}"
        reason = f"the gzip stream ends early or is corrupt ({error.cause})"
        if self.malformed == "error":
            raise MalformedLineError(f"malformed Criteo line in file {where}: {reason}") from None
        offset, step = self.shard.stride()
        if error.line_index % step == offset:  # the cut line belongs to one shard, which counts it
            self.num_skipped += 1
            if len(self.skipped_examples) < _MAX_EXAMPLES:
                self.skipped_examples.append(f"{where}: {reason}")
