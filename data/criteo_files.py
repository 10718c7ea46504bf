"""Reading one shard's lines of a text file in large blocks, as bytes.

* A plain file is split by bytes: shard ``[lo, hi)`` of the file's size (:meth:`Shard.range_of`) owns the lines that
  *start* in that range, so neighbouring shards never share or drop a line, whatever the line lengths. A shard reads
  only its own bytes (plus the tail of its last line).
* A ``.gz`` file cannot be seeked, so every shard decompresses all of it and keeps the lines whose index ``i``
  satisfies ``i % step == offset`` (:meth:`Shard.stride`).

Lines come without their ``\\n`` (and without a ``\\r`` before it). A gzip stream that ends early or is corrupt raises
:class:`TruncatedGzipError` after the last complete line, naming the index of the line it cut.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from tritonrec.data.sharding import Shard

BLOCK_BYTES = 1 << 20


class TruncatedGzipError(Exception):
    """The gzip stream of ``path`` ended early or is corrupt; ``line_index`` (0-based) is the line it cut."""

    def __init__(self, path: Path, line_index: int, cause: BaseException) -> None:
        super().__init__(f"{path}: gzip stream ends early or is corrupt at line {line_index + 1} ({cause})")
        self.path, self.line_index, self.cause = path, line_index, cause


def _split_lines(block: bytes) -> list[bytes]:
    """Complete lines of ``block`` (which ends with ``\\n``, or is a file's unterminated last line)."""
    if not block:
        return []
    lines = block.split(b"\n")
    if block.endswith(b"\n"):
        lines.pop()
    if b"\r" in block:
        lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
    return lines


class ShardLines:
    """Iterates ``(lines, first_index, step)``: this shard's lines of one file in blocks, line ``k`` of a block having
    index ``first_index + k * step``. :meth:`line_number` turns an index into the 1-based line number of the file."""

    def __init__(self, path: Path, shard: Shard, block_bytes: int | None = None) -> None:
        self.path, self.shard = path, shard
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.compressed = path.suffix == ".gz"
        self._start = 0  # byte offset of the shard's first line (plain files); its indices count from there
        self._lines_before: int | None = 0 if self.compressed else None

    def __iter__(self) -> Iterator[tuple[list[bytes], int, int]]:
        return self._gzip_lines() if self.compressed else self._plain_lines()

    def line_number(self, index: int) -> int:
        """The 1-based line number in the file of the line with ``index``."""
        if self._lines_before is None:  # counted only when a message needs it: it reads the file up to the shard
            count, remaining = 0, self._start
            with self.path.open("rb") as handle:
                while remaining > 0:
                    data = handle.read(min(self.block_bytes, remaining))
                    if not data:
                        break
                    count, remaining = count + data.count(b"\n"), remaining - len(data)
            self._lines_before = count
        return self._lines_before + index + 1

    def _plain_lines(self) -> Iterator[tuple[list[bytes], int, int]]:
        lo, hi = self.shard.range_of(0, self.path.stat().st_size)
        with self.path.open("rb") as handle:
            start = self._first_line_start(handle, lo)
            if start is None or start >= hi:
                return
            self._start = start
            handle.seek(start)
            offset, pending, index = start, b"", 0
            while True:
                data = handle.read(self.block_bytes)
                buffer = pending + data
                if not buffer:
                    return
                # Lines starting before hi are ours: the last one ends at the first newline at or after hi - 1.
                last = buffer.find(b"\n", max(hi - offset - 1, 0))
                final = last >= 0 or not data
                cut = last + 1 if last >= 0 else (len(buffer) if not data else buffer.rfind(b"\n") + 1)
                lines = _split_lines(buffer[:cut])
                if lines:
                    yield lines, index, 1
                if final:
                    return
                index += len(lines)
                offset, pending = offset + cut, buffer[cut:]

    def _first_line_start(self, handle: BinaryIO, lo: int) -> int | None:
        """Byte offset of the first line starting at or after ``lo`` (None when none does)."""
        if lo == 0:
            return 0
        handle.seek(lo - 1)
        if handle.read(1) == b"\n":
            return lo
        position = lo
        while data := handle.read(self.block_bytes):
            newline = data.find(b"\n")
            if newline >= 0:
                return position + newline + 1
            position += len(data)
        return None

    def _gzip_lines(self) -> Iterator[tuple[list[bytes], int, int]]:
        offset, step = self.shard.stride()
        index, pending = 0, b""
        with gzip.open(self.path, "rb") as handle:
            while True:
                data, error = self._read_gzip(handle)
                buffer = pending + data
                end_of_file = not data and error is None
                cut = len(buffer) if end_of_file else buffer.rfind(b"\n") + 1
                lines = _split_lines(buffer[:cut])
                first = (offset - index) % step
                if first < len(lines):
                    yield lines[first::step], index + first, step
                index, pending = index + len(lines), buffer[cut:]
                if error is not None:  # the lines before the cut are delivered; the cut one is the error's
                    raise TruncatedGzipError(self.path, index, error)
                if end_of_file:
                    return

    def _read_gzip(self, handle: gzip.GzipFile) -> tuple[bytes, BaseException | None]:
        """Up to ``block_bytes`` decompressed bytes and the error that stopped the stream (None while it is sound).
        ``read1`` hands over what was decompressed before a truncation; ``read`` would drop it with the error."""
        parts, size = [], 0
        while size < self.block_bytes:
            try:
                data = handle.read1(self.block_bytes - size)
            except (EOFError, OSError, zlib.error) as error:
                return b"".join(parts), error
            if not data:
                break
            parts.append(data)
            size += len(data)
        return b"".join(parts), None
