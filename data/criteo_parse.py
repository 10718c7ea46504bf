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
_NARROW_WIDTH = 8  # first-pass field width: every Criteo id (8 hex digits) and nearly every count fits


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

    The fields go into one fixed-width byte array, 8 bytes wide (every Criteo id and nearly every count fits); the
    lines with a longer field are parsed again 19 bytes wide, and a line with a field longer than that is malformed.
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
        fields = b"\t".join(kept).split(b"\t")
        line_lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        good, counts, ids, label, whole = _parse_fields(fields, line_lengths, _NARROW_WIDTH)
        if not whole.all():  # lines with a long field (or a NUL byte): once more, as wide as a valid field can be
            redo = np.flatnonzero(~whole)
            wide = [field for i in redo.tolist() for field in fields[i * NUM_FIELDS : (i + 1) * NUM_FIELDS]]
            redo_good, counts[redo], ids[redo], label[redo], redo_whole = _parse_fields(
                wide, line_lengths[redo], _FIELD_WIDTH
            )
            good[redo] = redo_good & redo_whole
        if b"\x00" in b"".join(kept):  # a NUL byte would pass for the padding of a shorter field
            good &= np.fromiter((b"\x00" not in line for line in kept), dtype=bool, count=len(kept))
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


def _parse_fields(
    fields: list[bytes], line_lengths: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``40 * m`` fields of ``m`` lines, cut to ``width`` bytes -> ``(valid [m], counts [m, 13] int64, ids [m, 26]
    int64 (-1 empty), labels [m] float32, whole [m])``; ``whole`` is False where a field was cut (its line must be
    parsed wider)."""
    m = line_lengths.shape[0]
    array = np.array(fields, dtype=f"S{width}")
    lengths = np.char.str_len(array).reshape(m, NUM_FIELDS)
    chars = array.view(np.uint8).reshape(m, NUM_FIELDS, width)
    whole = lengths.sum(1) == line_lengths - (NUM_FIELDS - 1)
    label_ok = ((chars[:, 0, 0] | 1) == ord("1")) & (lengths[:, 0] == 1)  # '0' | 1 == '1'
    words = array.view("<u8").reshape(m, NUM_FIELDS) if width == 8 else None  # one little-endian word per field
    counts_at, ids_at = slice(1, 1 + INT_FEATURE_COUNT), slice(1 + INT_FEATURE_COUNT, NUM_FIELDS)
    counts, counts_ok = _parse_counts(
        chars[:, counts_at], lengths[:, counts_at], None if words is None else words[:, counts_at]
    )
    ids, ids_ok = _parse_hex(chars[:, ids_at], lengths[:, ids_at], None if words is None else words[:, ids_at])
    labels = (chars[:, 0, 0] == ord("1")).astype(np.float32)
    return label_ok & counts_ok & ids_ok, counts, ids, labels, whole


def _parse_counts(chars: np.ndarray, lengths: np.ndarray, words: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 13, W]`` uint8 fields (NUL-padded) of ``lengths [m, 13]`` -> ``(values [m, 13], row_ok [m])``.

    Every position's digit (0 outside the digits) times its power of ten gives the field's number times
    ``10 ** (W - length)``, which one exact division removes. With ``words`` (8-byte fields as ``[m, 13]`` words)
    the digits are combined inside each word (:func:`_decimal_words`) instead."""
    width = chars.shape[-1]
    position = np.arange(width)
    minus = chars[..., 0] == ord("-")
    is_digit = (chars - ord("0")) < 10  # uint8 arithmetic: bytes below '0' wrap around to large values
    outside = position >= lengths[..., None]
    fields_ok = (is_digit | outside | (minus[..., None] & (position == 0))).all(-1)
    fields_ok &= (lengths - minus <= MAX_COUNT_DIGITS) & ~(minus & (lengths == 1))
    if words is not None:
        values = _decimal_words(words, minus) // 10 ** (width - np.maximum(lengths, 1)).astype(np.uint64)
        values = values.astype(np.int64)
        return np.where(minus, -values, values), fields_ok.all(-1)
    digits = np.where(is_digit, chars - ord("0"), 0).astype(np.uint64)
    # uint64: 18 digits scaled by 10 (a 19-byte-wide pass) reach 10**19 > 2**63; only invalid fields overflow it
    scaled = digits @ 10 ** np.arange(width - 1, -1, -1, dtype=np.uint64)
    values = (scaled // 10 ** (width - np.maximum(lengths, 1)).astype(np.uint64)).astype(np.int64)
    return np.where(minus, -values, values), fields_ok.all(-1)


def _parse_hex(chars: np.ndarray, lengths: np.ndarray, words: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``chars [m, 26, W]`` uint8 fields of ``lengths [m, 26]`` -> ``(ids [m, 26] with -1 for empty, row_ok [m])``:
    the nibbles of the first 15 positions as one number, shifted right past the padding (with ``words``: packed
    inside each 8-byte word, :func:`_hex_words`)."""
    lower = chars | 0x20
    is_digit = (chars - ord("0")) < 10
    is_letter = (lower - ord("a")) < 6
    outside = np.arange(chars.shape[-1]) >= lengths[..., None]
    fields_ok = (is_digit | is_letter | outside).all(-1) & (lengths <= MAX_HEX_DIGITS)
    if words is not None:
        values = (_hex_words(words) >> (4 * (8 - lengths)).astype(np.uint64)).astype(np.int64)
        values[lengths == 0] = -1
        return values, fields_ok.all(-1)
    places = min(chars.shape[-1], MAX_HEX_DIGITS)
    nibbles = np.where(is_digit, chars - ord("0"), np.where(is_letter, lower - (ord("a") - 10), 0))[..., :places]
    scaled = nibbles.astype(np.int64) @ 16 ** np.arange(places - 1, -1, -1, dtype=np.int64)
    values = scaled >> (4 * (places - np.minimum(lengths, places)))
    values[lengths == 0] = -1
    return values, fields_ok.all(-1)


# SWAR ("SIMD within a register") on 8-byte fields read as little-endian uint64 words: byte k is character k. Each
# step merges neighbouring lanes of one word, so a field costs a few word operations instead of eight byte ones.
_BYTES = np.uint64(0x00FF00FF00FF00FF)
_HALVES = np.uint64(0x0000FFFF0000FFFF)
_LOW32 = np.uint64(0xFFFFFFFF)


def _hex_words(words: np.ndarray) -> np.ndarray:
    """Words of up to 8 hex digits (NUL bytes after them) -> the digits as one left-aligned 32-bit number.

    A hex digit's value is its low nibble, plus 9 for letters (bit 6 set: 'A' 0x41, 'a' 0x61); NUL gives 0. Values
    of bytes that are not hex digits are garbage, but their lines are rejected by the byte checks."""
    nibbles = (words & np.uint64(0x0F0F0F0F0F0F0F0F)) + np.uint64(9) * (
        (words >> np.uint64(6)) & np.uint64(0x0101010101010101)
    )
    pairs = ((nibbles & _BYTES) << np.uint64(4)) | ((nibbles >> np.uint64(8)) & _BYTES)
    quads = ((pairs & _HALVES) << np.uint64(8)) | ((pairs >> np.uint64(16)) & _HALVES)
    return ((quads & _LOW32) << np.uint64(16)) | (quads >> np.uint64(32))


def _decimal_words(words: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Words of up to 8 decimal characters (a leading '-' allowed) -> the digits as one left-aligned 8-digit number
    (NUL and '-' count as 0)."""
    digits = words & np.uint64(0x0F0F0F0F0F0F0F0F)
    digits = np.where(minus, digits & ~np.uint64(0xFF), digits)  # '-' is 0x2D: its low nibble is not a digit
    pairs = (digits & _BYTES) * np.uint64(10) + ((digits >> np.uint64(8)) & _BYTES)
    quads = (pairs & _HALVES) * np.uint64(100) + ((pairs >> np.uint64(16)) & _HALVES)
    return (quads & _LOW32) * np.uint64(10_000) + (quads >> np.uint64(32))
