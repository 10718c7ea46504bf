"""Criteo TSV robustness: every malformed input is handled by the chosen policy and every error names file and line
(400-digit counts, invalid UTF-8, truncated .gz, ``+7``, ``1_000``, Arabic-Indic digits, ...); the vectorised block
parser agrees with the per-line parser on random lines; block boundaries and ``\\r\\n`` endings change nothing."""

from __future__ import annotations

import gzip
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonrec.data.criteo_files as criteo_files
from tritonrec.data.criteo import CriteoTSVSource, MalformedLineError
from tritonrec.data.criteo_parse import parse_criteo_block, parse_criteo_line

HASH = 1000
COUNT_RULE = "must be an integer (ASCII digits with an optional leading '-', at most 18 digits)"


def _line(label: bytes = b"1", ints: list[bytes] | None = None, cats: list[bytes] | None = None) -> bytes:
    ints = ints if ints is not None else [str(i).encode() for i in range(13)]
    cats = cats if cats is not None else [b"%08x" % (0xABC00 + f) for f in range(26)]
    return b"\t".join([label, *ints, *cats])


def _count(text: bytes) -> bytes:
    return _line(ints=[text, *[b""] * 12])


def _write(path: Path, lines: list[bytes], ending: bytes = b"\n") -> Path:
    path.write_bytes(b"".join(line + ending for line in lines))
    return path


MALFORMED = [
    (_count(b"9" * 400), f"column 'int_0' {COUNT_RULE}, got '{'9' * 40}...'"),
    (_count(b"9" * 19), f"column 'int_0' {COUNT_RULE}, got '{'9' * 19}'"),
    (_count(b"+7"), f"column 'int_0' {COUNT_RULE}, got '+7'"),
    (_count(b"1_000"), f"column 'int_0' {COUNT_RULE}, got '1_000'"),
    (_count("٣٤".encode()), f"column 'int_0' {COUNT_RULE}, got '٣٤'"),  # Arabic-Indic digits
    (_count(b" 7"), f"column 'int_0' {COUNT_RULE}, got ' 7'"),
    (_count(b"-"), f"column 'int_0' {COUNT_RULE}, got '-'"),
    (_count(b"1\x002"), f"column 'int_0' {COUNT_RULE}, got '1\\x002'"),
    (_count(b"\xff"), f"column 'int_0' {COUNT_RULE}, got '\\\\xff'"),  # invalid UTF-8
    (_line(cats=[b"ab\xfe", *[b""] * 25]), "column 'cat_0' must be a hex id of at most 15 digits, got 'ab\\\\xfe'"),
    (_line(label=b"\xc3"), "column 'label' must be 0 or 1, got '\\\\xc3'"),
    (_line(cats=[b"1" * 16, *[b""] * 25]), f"column 'cat_0' must be a hex id of at most 15 digits, got '{'1' * 16}'"),
    (_line(cats=[b"0x1f", *[b""] * 25]), "column 'cat_0' must be a hex id of at most 15 digits, got '0x1f'"),
    (_line(label=b"01"), "column 'label' must be 0 or 1, got '01'"),
    (_line() + b"\t", "expected 40 tab-separated fields, got 41"),
    (b"", "expected 40 tab-separated fields, got 1"),
]


@pytest.mark.parametrize(("bad", "reason"), MALFORMED)
def test_malformed_error_mode_names_file_line_and_field(tmp_path: Path, bad: bytes, reason: str) -> None:
    path = _write(tmp_path / "day.tsv", [_line(), _line(b"0"), bad, _line()])
    source = CriteoTSVSource(path, HASH, malformed="error")
    stream = source.iter_from(0)
    assert len([next(stream), next(stream)]) == 2  # the valid lines before the bad one still arrive
    with pytest.raises(MalformedLineError, match=re.escape(f"malformed Criteo line in file {path}:3: {reason}")):
        next(stream)


@pytest.mark.parametrize(("bad", "reason"), MALFORMED)
def test_malformed_skip_mode_counts_and_names_it(tmp_path: Path, bad: bytes, reason: str) -> None:
    path = _write(tmp_path / "day.tsv", [_line(), bad, _line(b"0"), bad])
    source = CriteoTSVSource(path, HASH, malformed="skip")
    assert [e.label for e in source] == [1.0, 0.0]
    assert source.num_skipped == 2
    assert source.skipped_examples == [f"{path}:2: {reason}", f"{path}:4: {reason}"]


def _truncated_gzip(path: Path, lines: list[bytes]) -> Path:
    data = gzip.compress(b"".join(line + b"\n" for line in lines))
    path.write_bytes(data[: len(data) * 2 // 3])  # cut mid-stream: no end-of-stream marker, no CRC
    return path


def test_truncated_gzip_in_both_modes(tmp_path: Path) -> None:
    lines = [_line(ints=[str(i).encode(), *[b""] * 12]) for i in range(300)]
    path = _truncated_gzip(tmp_path / "day.tsv.gz", lines)
    good = tmp_path / "next.tsv"
    _write(good, [_line(b"0")])
    with pytest.raises(MalformedLineError, match=rf"malformed Criteo line in file {re.escape(str(path))}:(\d+): "
                       r"the gzip stream ends early or is corrupt") as caught:  # fmt: skip
        list(CriteoTSVSource([path, good], HASH, malformed="error"))
    cut_line = int(re.search(r":(\d+): ", str(caught.value)).group(1))
    assert 1 < cut_line <= 300
    skipping = CriteoTSVSource([path, good], HASH, malformed="skip")
    rows = list(skipping)
    assert len(rows) == cut_line - 1 + 1  # every complete line before the cut, then the next file
    assert [round(math.expm1(e.dense[0])) for e in rows[:-1]] == list(range(cut_line - 1))
    assert skipping.num_skipped == 1 and skipping.skipped_examples[0].startswith(f"{path}:{cut_line}: the gzip")


def test_a_file_that_is_not_gzip_is_named(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(b"this is not gzip data\n")
    with pytest.raises(MalformedLineError, match=re.escape(f"{path}:1: the gzip stream ends early or is corrupt")):
        list(CriteoTSVSource(path, HASH))


_FIELD = st.one_of(
    st.sampled_from([b"", b"0", b"1", b"-3", b"17", b"+7", b"1_0", b"ff", b"FF", b"-", b"\xff", b" 1", b"9" * 18,
                     b"9" * 19, b"a" * 15, b"a" * 16, "٣".encode(), b"--1", b"1-", b"\x00"]),
    st.binary(max_size=4),
)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(_FIELD, min_size=38, max_size=42), min_size=1, max_size=12))
def test_block_parser_agrees_with_the_line_parser(rows: list[list[bytes]]) -> None:
    """Random lines near the valid format (mostly right field counts, some bad values): same rows, same rejects."""
    lines = [b"\t".join(fields).replace(b"\n", b"").replace(b"\t\t\t", b"\t") for fields in rows]
    lines = [line for line in lines if b"\r" not in line]  # the file reader strips \r before the parser
    block = parse_criteo_block(lines)
    expected_good, expected_bad, reasons = [], [], []
    for i, line in enumerate(lines):
        try:
            expected_good.append(parse_criteo_line(line))
        except ValueError as error:
            expected_bad.append(i)
            reasons.append(str(error))
    assert block.bad_rows.tolist() == expected_bad and block.reasons == reasons
    assert len(block.labels) == len(expected_good)
    for k, (dense, raw_ids, label) in enumerate(expected_good):
        assert np.array_equal(block.dense[k], dense) and np.array_equal(block.raw_ids[k], raw_ids)
        assert block.labels[k] == label


def test_block_parser_values_on_valid_lines() -> None:
    big = b"9" * 18
    lines = [_line(b"0", [b"", b"-5", big, *[b"1"] * 10], [b"", b"FFFFFFFFFFFFFFF", b"0", *[b"a"] * 23])]
    block = parse_criteo_block(lines)
    assert block.bad_rows.size == 0 and block.labels.tolist() == [0.0]
    assert block.raw_ids[0, :3].tolist() == [-1, 16**15 - 1, 0]
    assert block.dense[0, 0] == 0.0 and block.dense[0, 1] == np.float32(-math.log1p(5))
    assert block.dense[0, 2] == np.float32(math.log1p(10**18 - 1))


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
@pytest.mark.parametrize("block_bytes", [64, 997, 1 << 20])
def test_block_size_and_line_endings_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: bytes, block_bytes: int
) -> None:
    lines = [_line(ints=[str(i).encode(), *[b""] * 12]) for i in range(40)]
    lines[11] = b"broken"
    path = _write(tmp_path / "day.tsv", lines, ending)
    monkeypatch.setattr(criteo_files, "BLOCK_BYTES", block_bytes)
    source = CriteoTSVSource(path, HASH, malformed="skip")
    assert [round(math.expm1(e.dense[0])) for e in source] == [i for i in range(40) if i != 11]
    assert source.skipped_examples == [f"{path}:12: expected 40 tab-separated fields, got 1"]
    path.write_bytes(path.read_bytes().rstrip(b"\r\n"))  # no newline after the last line
    assert len(list(source)) == 39


def _random_field(rng: np.random.Generator, hex_digits: bool) -> bytes:
    """Mostly valid fields of 0 to 8 bytes (one 8-byte word), a few up to 20 bytes, sometimes one bad byte."""
    length = int(rng.integers(0, 9)) if rng.random() > 0.005 else int(rng.integers(9, 21))
    alphabet = b"0123456789abcdefABCDEF" if hex_digits else b"0123456789"
    field = bytes(rng.choice(list(alphabet), length).tolist())
    if not hex_digits and length > 1 and rng.random() < 0.2:
        field = b"-" + field[1:]
    if length and rng.random() < 0.003:
        field = field[:-1] + bytes([int(rng.choice([0, 0x2D, 0x47, 0x67, 0x80, 0xFF, 0x20, 0x3A, 0x60]))])
    return field


def test_block_parser_agrees_on_a_large_mixed_block() -> None:
    """Thousands of lines: several 512-line sub-blocks of the word parser, lines with a field over 8 bytes (parsed
    byte by byte), malformed values and wrong field counts interleaved; every line as the line parser says."""
    rng = np.random.default_rng(5)
    lines = []
    for i in range(1500):
        fields = [b"01"[i % 2 : i % 2 + 1]]
        fields += [_random_field(rng, hex_digits=False) for _ in range(13)]
        fields += [_random_field(rng, hex_digits=True) for _ in range(26)]
        if i % 97 == 0:
            fields = fields[:-1]  # 39 fields
        if i % 89 == 0:
            fields[0] = b"2"
        lines.append(b"\t".join(fields))
    block = parse_criteo_block(lines)
    good, bad, reasons = [], [], []
    for i, line in enumerate(lines):
        try:
            good.append(parse_criteo_line(line))
        except ValueError as error:
            bad.append(i)
            reasons.append(str(error))
    narrow = [max(map(len, line.split(b"\t"))) <= 8 for line in lines]
    assert sum(narrow) > 1000 and len(lines) - sum(narrow) > 100 and 100 < len(bad) < 700
    assert block.bad_rows.tolist() == bad and block.reasons == reasons
    assert np.array_equal(block.dense, np.stack([d for d, _, _ in good]))
    assert np.array_equal(block.raw_ids, np.stack([r for _, r, _ in good]))
    assert np.array_equal(block.labels, np.array([label for _, _, label in good], np.float32))
