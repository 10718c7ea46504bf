"""Criteo fields of at most 8 bytes, parsed as little-endian ``uint64`` words straight from a block's bytes.

Every Criteo id (8 hex digits) and nearly every count fits 8 bytes. :func:`field_words` loads each field's first 8
bytes as one word (an unaligned load from the block buffer, whose bytes past the field are then zeroed), so a block
of ``m`` lines costs one gather of ``40 * m`` words and no Python object per field. The checks and the conversions
then work on whole words, SWAR-style ("SIMD within a register": byte ``k`` of a word is character ``k`` of the
field, and each step treats the 8 byte lanes at once):

* a lane holds a character in ``[lo, hi]`` iff adding ``0x80 - lo`` sets its high bit and adding ``0x7F - hi`` does
  not. The sums stay inside the lane for ASCII bytes; a word with a non-ASCII byte is rejected as a whole first, so
  what its carries do to neighbouring lanes does not matter;
* a field is moved to the high bytes of its word (leading zeros) and its digit values merged by three multiplies:
  pairs, quads, halves (:func:`_combine_digits`).

:func:`parse_narrow_fields` gives the same values and the same verdicts as the per-line parser
(:func:`tritonrec.data.criteo_parse.parse_criteo_line`) for lines whose fields all fit 8 bytes; the caller parses the
other lines byte by byte.
"""

from __future__ import annotations

import numpy as np

WORD_BYTES = 8
_ONES = 0x0101010101010101
_HIGH = np.uint64(0x8080808080808080)
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_BYTES = np.uint64(0x00FF00FF00FF00FF)
_HALVES = np.uint64(0x0000FFFF0000FFFF)
_LOWER_CASE = np.uint64(0x20 * _ONES)
# _FIELD_MASKS[k]: the low k bytes of a word (k = 8: all of it)
_FIELD_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(WORD_BYTES + 1)], dtype=np.uint64)


def field_words(block: bytes, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(words, masks)``: the first 8 bytes of every field as a word with the bytes past the field zeroed, and the
    mask of the field's bytes (``lengths`` at most 8); contiguous arrays shaped like ``starts``.

    ``block`` must hold at least 8 bytes after the last field start (the caller pads it)."""
    unaligned = np.ndarray((len(block) - WORD_BYTES + 1,), dtype="<u8", buffer=block, strides=(1,))
    masks = _FIELD_MASKS[lengths]
    return unaligned[starts] & masks, masks


def _lanes_between(words: np.ndarray, low: int, high: int) -> np.ndarray:
    """The high bit of every lane holding a byte in ``[low, high]`` (ASCII lanes; see module docstring)."""
    at_least_low = words + np.uint64((0x80 - low) * _ONES)
    above_high = words + np.uint64((0x7F - high) * _ONES)
    return at_least_low & ~above_high & _HIGH


def _all_lanes(lanes: np.ndarray, words: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Per row: every field's every byte was accepted (``lanes``: high bits of accepted lanes) and is ASCII."""
    inside = masks & _HIGH
    return ((lanes & ~words & inside) == inside).all(1)


def _combine_digits(digits: np.ndarray, base: int) -> np.ndarray:
    """Words of 8 digit values (byte 0 the most significant) -> their number in ``base`` (10 or 16): neighbouring
    lanes merge by one multiply each, pairs, then quads, then the two halves (every partial number fits its lane)."""
    pairs = ((digits * np.uint64(base << 8 | 1)) >> np.uint64(8)) & _BYTES
    quads = ((pairs * np.uint64(base**2 << 16 | 1)) >> np.uint64(16)) & _HALVES
    return (quads * np.uint64(base**4 << 32 | 1)) >> np.uint64(32)


def _right_aligned(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Words whose field fills the low ``lengths`` bytes -> the same field in the high bytes (leading zero digits
    instead of trailing NULs, so the combined number needs no division)."""
    return values << (np.uint64(8) * (WORD_BYTES - lengths).astype(np.uint64))


def parse_narrow_fields(
    block: bytes, starts: np.ndarray, lengths: np.ndarray, num_counts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fields at ``starts [m, 1 + C + F]`` of ``lengths`` in ``block`` (label, ``C = num_counts`` counts, ``F`` hex
    ids) -> ``(valid [m], counts [m, C] int64, ids [m, F] int64 with -1 for empty, labels [m] float32)``. Rows with
    a field longer than 8 bytes get garbage (the caller parses them again)."""
    lengths = np.minimum(lengths, WORD_BYTES)
    label_word = field_words(block, starts[:, 0], lengths[:, 0])[0]
    valid = (lengths[:, 0] == 1) & ((label_word | np.uint64(1)) == ord("1"))  # '0' | 1 == '1'
    labels = (label_word == ord("1")).astype(np.float32)

    count_lengths = lengths[:, 1 : 1 + num_counts]
    words, masks = field_words(block, starts[:, 1 : 1 + num_counts], count_lengths)
    minus = (words & np.uint64(0xFF)) == ord("-")
    minus_lane = minus.astype(np.uint64)
    valid &= _all_lanes(_lanes_between(words, ord("0"), ord("9")) | (minus_lane << np.uint64(7)), words, masks)
    valid &= ~(minus & (count_lengths == 1)).any(1)
    digits = (words & _NIBBLES) - minus_lane * np.uint64(ord("-") & 0x0F)  # a leading '-' counts as a 0 digit
    magnitudes = _combine_digits(_right_aligned(digits, count_lengths), 10).astype(np.int64)
    counts = np.where(minus, -magnitudes, magnitudes)

    id_lengths = lengths[:, 1 + num_counts :]
    words, masks = field_words(block, starts[:, 1 + num_counts :], id_lengths)
    hex_lanes = _lanes_between(words, ord("0"), ord("9")) | _lanes_between(words | _LOWER_CASE, ord("a"), ord("f"))
    valid &= _all_lanes(hex_lanes, words, masks)
    # a hex digit's value is its low nibble, plus 9 for letters (bit 6 set: 'A' 0x41, 'a' 0x61)
    nibbles = (words & _NIBBLES) + np.uint64(9) * ((words >> np.uint64(6)) & np.uint64(_ONES))
    ids = _combine_digits(_right_aligned(nibbles, id_lengths), 16).astype(np.int64)
    ids[id_lengths == 0] = -1
    return valid, counts, ids, labels
