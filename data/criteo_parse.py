"""Parsing Criteo TSV lines: a strict per-line parser (the specification, and the source of every error message) and
a vectorised block parser that agrees with it line for line.

A valid line has exactly 40 tab-separated fields: the label ``0`` or ``1``; 13 counts, each empty or an ASCII
decimal integer of at most 18 digits with an optional leading ``-`` (``+7``, ``1_000``, `` 7``, Arabic-Indic digits
and 400-digit numbers are malformed, not coerced); 26 categorical ids, each empty or 1 to 15 ASCII hex digits (15 hex
digits always fit an int64). Lines are bytes: a byte that is not valid UTF-8 can only sit in one of those fields,
which then fails its check, so undecodable input is a malformed line like any other.

A count ``x`` becomes ``log(1 + |x|)`` with the sign of ``x`` (Criteo has a few negative counts; mirroring keeps them
instead of clipping); an empty count is 0. An id becomes its integer value, -1 when empty.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
NUM_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: list[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: list[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: list[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]
MAX_COUNT_DIGITS = 18  # |x| < 10**18 fits an int64 with room to spare
MAX_HEX_DIGITS = 15  # 16**15 - 1 < 2**63
_FIELD_WIDTH = MAX_COUNT_DIGITS + 1  # widest valid field: '-' and 18 digits
_COUNT = re.compile(rb"-?[0-9]{1,%d}" % MAX_COUNT_DIGITS)
_HEX = re.compile(rb"[0-9a-fA-F]{1,%d}" % MAX_HEX_DIGITS)
_NIBBLE = np.full(256, -1, dtype=np.int64)  # ASCII byte -> hex digit value, -1 for any other byte
_NIBBLE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_NIBBLE[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_NIBBLE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _shown(field: bytes) -> str:
    """A field as it appears in error messages (undecodable bytes as ``\\xff``), cut at 40 characters."""
    text = field.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def signed_log1p(counts: np.ndarray) -> np.ndarray:
    """``log(1 + |x|)`` with the sign of ``x``, as float32 (int64 counts of any shape)."""
    return (np.sign(counts) * np.log1p(np.abs(counts).astype(np.float64))).astype(np.float32)


def parse_criteo_line(line: str | bytes) -> tuple[np.ndarray, np.ndarray, float]:
    """One line (without its newline) -> ``(dense [13] float32, raw_ids [26] int64, label)``; ``raw_ids`` is -1 where
    empty. Raises ``ValueError`` naming the offending column (the reader adds file and line number)."""
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogateescape")
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in (b"0", b"1"):
        raise ValueError(f"column 'label' must be 0 or 1, got {_shown(fields[0])}")
    counts = np.zeros(INT_FEATURE_COUNT, dtype=np.int64)
    for i, text in enumerate(fields[1 : 1 + INT_FEATURE_COUNT]):
        if text:
            if not _COUNT.fullmatch(text):
                raise ValueError(
                    f"column {DEFAULT_INT_NAMES[i]!r} must be an integer (ASCII digits with an optional leading '-', "
                    f"at most {MAX_COUNT_DIGITS} digits), got {_shown(text)}"
                )
            counts[i] = int(text)
    raw_ids = np.full(CAT_FEATURE_COUNT, -1, dtype=np.int64)
    for f, text in enumerate(fields[1 + INT_FEATURE_COUNT :]):
        if text:
            if not _HEX.fullmatch(text):
                raise ValueError(
                    f"column {DEFAULT_CAT_NAMES[f]!r} must be a hex id of at most {MAX_HEX_DIGITS} digits, "
                    f"got {_shown(text)}"
                )
            raw_ids[f] = int(text, 16)
    return signed_log1p(counts), raw_ids, float(fields[0] == b"1")


@dataclass
class ParsedBlock:
    """The valid lines of a block, stacked (``dense [m, 13]`` float32, ``raw_ids [m, 26]`` int64 with -1 for empty,
    ``labels [m]`` float32), and where the malformed ones were: ``bad_rows`` (indices into the block's lines, in
    order) with one ``reasons`` entry each (the per-line parser's message)."""

    dense: np.ndarray
    raw_ids: np.ndarray
    labels: np.ndarray
    bad_rows: np.ndarray
    reasons: list[str]


def parse_criteo_block(lines: list[bytes]) -> ParsedBlock:
    """Parse many lines at once: the same results and the same malformed lines as :func:`parse_criteo_line`.

    Every field is cut to 19 bytes in one fixed-width array; a line whose bytes do not all survive (a longer field,
    or a NUL byte) is malformed, so every check after that sees whole fields.
    """
    n = len(lines)
    tabs = np.fromiter(map(bytes.count, lines, itertools.repeat(b"\t")), dtype=np.int64, count=n)
    shaped = np.flatnonzero(tabs == NUM_FIELDS - 1)
    ok = np.zeros(n, dtype=bool)
    dense = np.zeros((0, INT_FEATURE_COUNT), np.float32)
    raw_ids = np.zeros((0, CAT_FEATURE_COUNT), np.int64)
    labels = np.zeros(0, np.float32)
    if shaped.size:
        kept = lines if shaped.size == n else [lines[i] for i in shaped]
        fields = np.array(b"\t".join(kept).split(b"\t"), dtype=f"S{_FIELD_WIDTH}")
        chars = fields.view(np.uint8).reshape(len(kept), NUM_FIELDS, _FIELD_WIDTH)
        line_lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        whole = np.count_nonzero(chars, axis=(1, 2)) == line_lengths - (NUM_FIELDS - 1)
        label_ok = ((chars[:, 0, 0] == ord("0")) | (chars[:, 0, 0] == ord("1"))) & (chars[:, 0, 1] == 0)
        counts, counts_ok = _parse_counts(chars[:, 1 : 1 + INT_FEATURE_COUNT])
        ids, ids_ok = _parse_hex(chars[:, 1 + INT_FEATURE_COUNT :])
        good = whole & label_ok & counts_ok & ids_ok
        ok[shaped[good]] = True
        dense, raw_ids = signed_log1p(counts[good]), ids[good]
        labels = (chars[good, 0, 0] == ord("1")).astype(np.float32)
    bad_rows = np.flatnonzero(~ok)
    reasons = [_reason(lines[i]) for i in bad_rows]
    return ParsedBlock(dense, raw_ids, labels, bad_rows, reasons)


def _reason(line: bytes) -> str:
    try:
        parse_criteo_line(line)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"the block parser rejected a line the line parser accepts: {line!r}")


def _parse_counts(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 13, W]`` (NUL-padded fields) -> ``(values [m, 13] int64, row_ok [m])`` by Horner's rule."""
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    minus = chars[..., 0] == ord("-")
    length = np.count_nonzero(chars, axis=-1)
    num_digits = length - minus
    fields_ok = (digit[..., 1:] | (chars[..., 1:] == 0)).all(-1) & (digit[..., 0] | minus | (length == 0))
    fields_ok &= (num_digits <= MAX_COUNT_DIGITS) & ~(minus & (num_digits == 0))
    values = np.zeros(chars.shape[:2], dtype=np.int64)
    for j in range(min(int(length.max(initial=0)), chars.shape[-1])):
        values = np.where(digit[..., j], values * 10 + (chars[..., j].astype(np.int64) - ord("0")), values)
    values = np.where(minus, -values, values)
    return values, fields_ok.all(-1)


def _parse_hex(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 26, W]`` -> ``(ids [m, 26] int64 with -1 for empty, row_ok [m])``."""
    nibbles = _NIBBLE[chars]
    length = np.count_nonzero(chars, axis=-1)
    fields_ok = ((nibbles >= 0) | (chars == 0)).all(-1) & (length <= MAX_HEX_DIGITS)
    values = np.zeros(chars.shape[:2], dtype=np.int64)
    for j in range(min(int(length.max(initial=0)), MAX_HEX_DIGITS)):
        values = np.where(nibbles[..., j] >= 0, values * 16 + nibbles[..., j], values)
    values[length == 0] = -1
    return values, fields_ok.all(-1)
