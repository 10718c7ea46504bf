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

import re
from dataclasses import dataclass

import numpy as np

from tritonrec.data.criteo_words import WORD_BYTES, parse_narrow_fields

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
_TAB, _NEWLINE = 9, 10
_SUB_BLOCK = 512  # lines parsed as words at a time: their temporaries stay in cache


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
    """Parse many lines (without their newlines) at once: the same results and the same malformed lines as
    :func:`parse_criteo_line`.

    The lines are joined into one buffer; the positions of its tabs and newlines give every field's start and
    length, and lines with 40 fields whose fields all fit 8 bytes (nearly all Criteo lines) are parsed as words
    (:mod:`tritonrec.data.criteo_words`). Lines with a longer field are parsed again byte by byte, 19 bytes wide (a
    field longer than that is malformed).
    """
    n = len(lines)
    dense = np.zeros((0, INT_FEATURE_COUNT), np.float32)
    raw_ids = np.zeros((0, CAT_FEATURE_COUNT), np.int64)
    labels = np.zeros(0, np.float32)
    ok = np.zeros(n, dtype=bool)
    shaped = np.zeros(0, np.int64)
    if n:
        block = b"\n".join(lines) + b"\n" + bytes(WORD_BYTES)  # padded: 8-byte loads at any field start stay inside
        text = np.frombuffer(block, np.uint8)[:-WORD_BYTES]
        delimiters = np.flatnonzero((text == _TAB) | (text == _NEWLINE))
        line_ends = np.flatnonzero(text[delimiters] == _NEWLINE)  # index in delimiters of each line's newline
        if line_ends.size != n:
            raise ValueError("lines must come without newlines (one line per entry)")
        shaped = np.flatnonzero(np.diff(line_ends, prepend=-1) == NUM_FIELDS)
        before = np.concatenate(([-1], delimiters))  # before[k]: the delimiter before field k (-1: block start)
        if shaped.size == n:
            ends, starts = delimiters.reshape(n, NUM_FIELDS), before[:-1].reshape(n, NUM_FIELDS) + 1
        else:
            field_index = (line_ends[shaped] - (NUM_FIELDS - 1))[:, None] + np.arange(NUM_FIELDS)
            ends, starts = delimiters[field_index], before[field_index] + 1
    if shaped.size:
        lengths = ends - starts
        parts = [
            parse_narrow_fields(block, starts[i : i + _SUB_BLOCK], lengths[i : i + _SUB_BLOCK], INT_FEATURE_COUNT)
            for i in range(0, shaped.size, _SUB_BLOCK)
        ]
        good, counts, ids, label = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        long_lines = np.flatnonzero((lengths > WORD_BYTES).any(1))
        if long_lines.size:  # once more, byte by byte, as wide as a valid field can be
            long_fields = [field for i in long_lines.tolist() for field in lines[shaped[i]].split(b"\t")]
            good[long_lines], counts[long_lines], ids[long_lines], label[long_lines] = _parse_wide_fields(
                long_fields, long_lines.size
            )
        ok[shaped[good]] = True
        dense, raw_ids, labels = signed_log1p(counts[good]), ids[good], label[good]
    bad_rows = np.flatnonzero(~ok)
    reasons = [_reason(lines[i]) for i in bad_rows]
    return ParsedBlock(dense, raw_ids, labels, bad_rows, reasons)


def _reason(line: bytes) -> str:
    try:
        parse_criteo_line(line)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"the block parser rejected a line the line parser accepts: {line!r}")


def _parse_wide_fields(fields: list[bytes], m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``40 * m`` fields of ``m`` lines -> ``(valid [m], counts [m, 13] int64, ids [m, 26] int64 (-1 empty), labels
    [m] float32)``, byte by byte in a ``19``-byte-wide array (a longer field, or a NUL byte, which would pass for the
    padding of a shorter field, makes its line invalid)."""
    array = np.array(fields, dtype=f"S{_FIELD_WIDTH}")
    field_lengths = np.fromiter(map(len, fields), dtype=np.int64, count=len(fields)).reshape(m, NUM_FIELDS)
    lengths = np.char.str_len(array).reshape(m, NUM_FIELDS)
    chars = array.view(np.uint8).reshape(m, NUM_FIELDS, _FIELD_WIDTH)
    label_ok = ((chars[:, 0, 0] | 1) == ord("1")) & (lengths[:, 0] == 1)  # '0' | 1 == '1'
    counts_at, ids_at = slice(1, 1 + INT_FEATURE_COUNT), slice(1 + INT_FEATURE_COUNT, NUM_FIELDS)
    counts, counts_ok = _parse_counts(chars[:, counts_at], lengths[:, counts_at])
    ids, ids_ok = _parse_hex(chars[:, ids_at], lengths[:, ids_at])
    labels = (chars[:, 0, 0] == ord("1")).astype(np.float32)
    whole = (lengths == field_lengths).all(1)  # no field cut at the width or at a NUL byte
    return label_ok & counts_ok & ids_ok & whole, counts, ids, labels


def _parse_counts(chars: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 13, W]`` uint8 fields (NUL-padded) of ``lengths [m, 13]`` -> ``(values [m, 13], row_ok [m])``.

    Every position's digit (0 outside the digits) times its power of ten gives the field's number times
    ``10 ** (W - length)``, which one exact division removes."""
    width = chars.shape[-1]
    position = np.arange(width)
    minus = chars[..., 0] == ord("-")
    is_digit = (chars - ord("0")) < 10  # uint8 arithmetic: bytes below '0' wrap around to large values
    outside = position >= lengths[..., None]
    fields_ok = (is_digit | outside | (minus[..., None] & (position == 0))).all(-1)
    fields_ok &= (lengths - minus <= MAX_COUNT_DIGITS) & ~(minus & (lengths == 1))
    digits = np.where(is_digit, chars - ord("0"), 0).astype(np.uint64)
    # uint64: 18 digits scaled by 10 (a 19-byte-wide pass) reach 10**19 > 2**63; only invalid fields overflow it
    scaled = digits @ 10 ** np.arange(width - 1, -1, -1, dtype=np.uint64)
    values = (scaled // 10 ** (width - np.maximum(lengths, 1)).astype(np.uint64)).astype(np.int64)
    return np.where(minus, -values, values), fields_ok.all(-1)


def _parse_hex(chars: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 26, W]`` uint8 fields of ``lengths [m, 26]`` -> ``(ids [m, 26] with -1 for empty, row_ok [m])``:
    the nibbles of the first 15 positions as one number, shifted right past the padding."""
    lower = chars | 0x20
    is_digit = (chars - ord("0")) < 10
    is_letter = (lower - ord("a")) < 6
    outside = np.arange(chars.shape[-1]) >= lengths[..., None]
    fields_ok = (is_digit | is_letter | outside).all(-1) & (lengths <= MAX_HEX_DIGITS)
    places = min(chars.shape[-1], MAX_HEX_DIGITS)
    nibbles = np.where(is_digit, chars - ord("0"), np.where(is_letter, lower - (ord("a") - 10), 0))[..., :places]
    scaled = nibbles.astype(np.int64) @ 16 ** np.arange(places - 1, -1, -1, dtype=np.int64)
    values = scaled >> (4 * (places - np.minimum(lengths, places)))
    values[lengths == 0] = -1
    return values, fields_ok.all(-1)
