"""Criteo readers on small generated files: TSV (empty fields, hex ids, malformed lines under each policy, gzip)
and the preprocessed npy days (hashing, missing ids, random access, TSV round trip), with their bad inputs.
Sharding, shuffling and the malformed inputs that used to escape both policies: tests/data/test_criteo_robustness.py."""

from __future__ import annotations

import gzip
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tritonrec.data.batcher import Batcher
from tritonrec.data.criteo import CriteoTSVSource, MalformedLineError, parse_criteo_line
from tritonrec.data.criteo_npy import CriteoNPYSource, criteo_tsv_to_npy, npy_paths
from tritonrec.data.elements import RecElement

HASH = 1000


def _line(label: str = "1", ints: list[str] | None = None, cats: list[str] | None = None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{0xABC00 + f:08x}" for f in range(26)]
    return "\t".join([label, *ints, *cats])


def _good_lines() -> list[str]:
    sparse_ints = ["", "5", "", "0", "-2", *[""] * 8]  # empty counts and a negative one (Criteo has them)
    sparse_cats = ["", "FFFFFFFF", "", "68fd1e64", *[""] * 22]  # empty ids, upper- and lower-case hex
    return [_line(), _line("0", sparse_ints, sparse_cats), _line("0"), _line("1", cats=[""] * 26)]


def _write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines))
    return path


def _expected(line: str) -> RecElement:
    fields = line.split("\t")
    dense = [math.copysign(math.log1p(abs(int(x))), int(x)) if x else 0.0 for x in fields[1:14]]
    ids = [int(h, 16) % HASH for h in fields[14:] if h]
    return RecElement(np.asarray(dense, np.float32), np.asarray(ids), np.asarray([int(bool(h)) for h in fields[14:]]),
                      float(fields[0]))  # fmt: skip


def _assert_elements(got: list[RecElement], want: list[RecElement]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.dense, b.dense, rtol=1e-6)
        assert a.sparse_ids.tolist() == b.sparse_ids.tolist()
        assert a.sparse_lengths.tolist() == b.sparse_lengths.tolist()
        assert a.label == b.label


def test_tsv_rows_empty_fields_and_hex_ids(tmp_path: Path) -> None:
    lines = _good_lines()
    source = CriteoTSVSource(_write(tmp_path / "day.tsv", lines), num_embeddings=HASH)
    elements = list(source)
    _assert_elements(elements, [_expected(line) for line in lines])
    assert elements[1].sparse_ids.tolist() == [0xFFFFFFFF % HASH, 0x68FD1E64 % HASH]
    assert elements[1].sparse_lengths.tolist()[:4] == [0, 1, 0, 1]
    assert elements[1].dense[4] == pytest.approx(-math.log1p(2))  # negative counts mirrored, not clipped
    assert elements[3].sparse_lengths.sum() == 0  # every id missing: 26 empty bags
    batch = next(Batcher(source.element_spec).process(source, 8))
    assert batch.num_valid() == 4 and batch.sparse_features.lengths().sum().item() == 26 + 2 + 26


def test_tsv_multiple_files_gzip_and_seeking(tmp_path: Path) -> None:
    lines = _good_lines()
    plain = _write(tmp_path / "a.tsv", lines[:2])
    zipped = tmp_path / "b.tsv.gz"
    with gzip.open(zipped, "wt") as handle:
        handle.write("".join(line + "\n" for line in lines[2:]))
    source = CriteoTSVSource([plain, zipped], num_embeddings=[HASH] * 26)
    _assert_elements(list(source), [_expected(line) for line in lines])
    _assert_elements(list(source.iter_from(3)), [_expected(lines[3])])


BAD_LINES = [
    (_line()[:-9], "expected 40 tab-separated fields, got 39"),
    (_line("2"), "column 'label' must be 0 or 1, got '2'"),
    (
        _line(ints=["x1", *[""] * 12]),
        "column 'int_0' must be an integer (ASCII digits with an optional leading '-', at most 18 digits), got 'x1'",
    ),
    (_line(cats=["zz", *[""] * 25]), "column 'cat_0' must be a hex id of at most 15 digits, got 'zz'"),
    ("", "expected 40 tab-separated fields, got 1"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_malformed_line_error_names_file_line_and_field(tmp_path: Path, bad: str, reason: str) -> None:
    path = _write(tmp_path / "day.tsv", [_line(), _line("0"), bad, _line()])
    source = CriteoTSVSource(path, num_embeddings=HASH, malformed="error")
    with pytest.raises(MalformedLineError, match=re.escape(f"malformed Criteo line in file {path}:3: {reason}")):
        list(source)
    assert issubclass(MalformedLineError, ValueError)


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_malformed_line_skip_counts_it(tmp_path: Path, bad: str, reason: str) -> None:
    good = _good_lines()
    path = _write(tmp_path / "day.tsv", [good[0], bad, good[1], bad, good[2]])
    source = CriteoTSVSource(path, num_embeddings=HASH, malformed="skip")
    _assert_elements(list(source), [_expected(line) for line in good[:3]])
    assert source.num_skipped == 2
    assert source.skipped_examples == [f"{path}:2: {reason}", f"{path}:4: {reason}"]


def test_npy_days_hash_missing_ids_and_seek(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    days = []
    for day, rows in enumerate((5, 3)):
        dense = rng.random((rows, 13), dtype=np.float32)
        sparse = rng.integers(-1, 10**9, (rows, 26))  # -1 marks a missing id
        sparse[0, :3] = -1
        labels = rng.integers(0, 2, (rows, 1)).astype(np.int32)  # torchrec writes [N, 1]
        for array, path in zip((dense, sparse, labels), npy_paths(tmp_path / f"day_{day}"), strict=True):
            np.save(path, array)
        days.append((dense, sparse, labels.reshape(-1)))
    source = CriteoNPYSource([tmp_path / "day_0", tmp_path / "day_1"], num_embeddings=HASH)
    want = [
        RecElement(dense[i], sparse[i][sparse[i] >= 0] % HASH, (sparse[i] >= 0).astype(int), float(labels[i]))
        for dense, sparse, labels in days
        for i in range(labels.shape[0])
    ]
    assert len(source) == 8
    _assert_elements(list(source), want)
    assert next(iter(source)).sparse_lengths[:3].tolist() == [0, 0, 0]
    for position in (4, 5, 7, 8):
        _assert_elements(list(source.iter_from(position)), want[position:])


def test_tsv_to_npy_round_trip(tmp_path: Path) -> None:
    lines = _good_lines()
    tsv = _write(tmp_path / "day.tsv", lines)
    assert criteo_tsv_to_npy(tsv, tmp_path / "npy" / "day_0") == 4
    from_npy = list(CriteoNPYSource(tmp_path / "npy" / "day_0", num_embeddings=HASH))
    _assert_elements(from_npy, list(CriteoTSVSource(tsv, num_embeddings=HASH)))


def test_parse_line_keeps_raw_ids() -> None:
    dense, raw_ids, label = parse_criteo_line(_line("0", cats=["", "a", *[""] * 24]))
    assert raw_ids[:3].tolist() == [-1, 10, -1] and label == 0.0 and dense[1] == pytest.approx(math.log1p(1))


def test_tsv_bad_arguments(tmp_path: Path) -> None:
    path = _write(tmp_path / "day.tsv", [_line()])
    with pytest.raises(ValueError, match=re.escape(f"paths: no such file '{tmp_path / 'missing.tsv'}'")):
        CriteoTSVSource(tmp_path / "missing.tsv", HASH)
    with pytest.raises(ValueError, match=r"paths must name at least one TSV file, got paths=\[\]"):
        CriteoTSVSource([], HASH)
    with pytest.raises(TypeError, match="paths must hold str or Path, got 3"):
        CriteoTSVSource([3], HASH)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="malformed must be one of .* got malformed='ignore'"):
        CriteoTSVSource(path, HASH, malformed="ignore")
    with pytest.raises(ValueError, match=r"num_embeddings must be one int or 26 ints, got num_embeddings=\[10, 10\]"):
        CriteoTSVSource(path, [10, 10])
    with pytest.raises(ValueError, match="num_embeddings must be a positive int, got num_embeddings=0"):
        CriteoTSVSource(path, 0)
    with pytest.raises(ValueError, match=r"position=3 is past the end of the data \(1 valid rows"):
        list(CriteoTSVSource(path, HASH).iter_from(3))


def test_npy_bad_files(tmp_path: Path) -> None:
    dense_path, sparse_path, labels_path = npy_paths(tmp_path / "day")
    np.save(dense_path, np.zeros((3, 13), np.float32))
    with pytest.raises(
        ValueError, match=re.escape(f"prefixes: prefix '{tmp_path / 'day'}' has no file '{sparse_path}'")
    ):
        CriteoNPYSource(tmp_path / "day", HASH)
    np.save(sparse_path, np.zeros((2, 26), np.int64))
    np.save(labels_path, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="has 3 dense rows, 2 sparse rows and 3 labels; they must match"):
        CriteoNPYSource(tmp_path / "day", HASH)
    np.save(sparse_path, np.zeros((3, 26), np.float32))
    with pytest.raises(ValueError, match=r"must hold a 2-D integer array \[N, F\], got shape \(3, 26\) float32"):
        CriteoNPYSource(tmp_path / "day", HASH)
    np.save(sparse_path, np.zeros((3, 26), np.int64))
    np.save(labels_path, np.array([0, 3, 1], np.int32))
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'day'}_labels.npy row 1: labels must be 0 or 1, got 3.0")
    ):
        list(CriteoNPYSource(tmp_path / "day", HASH))
    with pytest.raises(ValueError, match=r"position=9 is past the end of the data \(3 rows\)"):
        CriteoNPYSource(tmp_path / "day", HASH).iter_from(9)
