"""Checksums written with every checkpoint and verified when it is read, so a flipped or lost byte is an error naming
the file and what it holds, never weights that differ from the saved ones.

* sharded (torch.distributed.checkpoint): every stored item - a tensor's chunk or a pickled object, one byte range
  of a ``__R_N.distcp`` file - has its checksum in its storage record of ``.metadata``
  (``_StorageInfo.checksum``, an attribute plain torch ignores), computed by the rank that wrote it
  (:class:`~lightning_shard.checkpoint.writer.ChecksummedFileSystemWriter`) and verified by every rank for the
  ranges it reads (:class:`~lightning_shard.checkpoint.reader.InPlaceFileSystemReader`). ``.metadata`` itself ends
  with its own checksum after the pickle (``pickle.load`` stops at the pickle's end, so torch reads it unchanged).
* full (one ``torch.save`` zip file): the checksum of the whole file is the zip archive's comment, a standard zip
  field that ``torch.load`` and ``zipfile`` read past; rank 0 verifies it before it reads the file. On a mismatch,
  the zip's own per-record CRC32s (``torch.save`` writes them; torch never checks them) say which record - which
  tensor - is damaged.

The hash is xxHash's XXH3-64 (``xxhash``, ~20 GB/s per core); where that package is missing, zlib's CRC32
(~2.5 GB/s). Each checksum names its algorithm (``"xxh3_64:1f..."``). Checkpoints written before checksums existed
load with one warning.
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import warnings
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

try:
    import xxhash
except ImportError:  # pragma: no cover - a declared dependency; CRC32 keeps checkpoints checked without it
    xxhash = None

# Ends `.metadata`, after its pickle: b"\n#lightning-shard-checksum xxh3_64:0123456789abcdef\n".
METADATA_MARK = b"\n#lightning-shard-checksum "
# The zip comment of a full checkpoint file: this prefix, then the checksum of every byte before the comment.
FULL_FILE_MARK = b"lightning-shard-checksum "
_CHUNK = 16 << 20
_ZIP_END_SIGNATURE = b"PK\x05\x06"
_ZIP_END_LENGTH = 22  # the end-of-central-directory record without its comment
_COMMENT_LENGTH_AT = 20  # its last field: the comment's length (2 bytes, little-endian)
_MAX_COMMENT = 96


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC32 behind the hasher interface of ``xxhash``."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_ALGORITHMS = {"crc32": _Crc32}
if xxhash is not None:
    _ALGORITHMS["xxh3_64"] = xxhash.xxh3_64
ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


def hasher(checksum: str | None = None) -> Hasher:
    """A new hasher: of the algorithm ``checksum`` names (``"xxh3_64:..."``), or the one saves use.

    Example:
        >>> h = hasher("crc32:00000000"); h.update(b"abc"); h.hexdigest()
        '352441c2'
    """
    algorithm = ALGORITHM if checksum is None else checksum.split(":", 1)[0]
    if algorithm not in _ALGORITHMS:
        raise ValueError(
            f"The checkpoint's checksums use {algorithm!r}, which this installation cannot compute: install the "
            "`xxhash` package (a dependency of lightning-shard)."
        )
    return _ALGORITHMS[algorithm]()


def checksum_of(chunks: Iterable[Any], recorded: str | None = None) -> str:
    """``"algorithm:hexdigest"`` of the bytes in ``chunks``, with ``recorded``'s algorithm (default: the saves').

    Example:
        >>> checksum_of([b"a", b"bc"], "crc32:0")
        'crc32:352441c2'
    """
    state = hasher(recorded)
    for chunk in chunks:
        state.update(chunk)
    algorithm = ALGORITHM if recorded is None else recorded.split(":", 1)[0]
    return f"{algorithm}:{state.hexdigest()}"


@contextmanager
def _mapped(stream: Any) -> Iterator[memoryview | None]:
    """A view of the whole file behind ``stream``, mapped into memory (hashing then reads the page cache without
    copying it); ``None`` where it cannot be mapped (an empty file, a stream that is not a file)."""
    try:
        mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        yield None
        return
    with mapped, memoryview(mapped) as whole:
        yield whole


def file_range(stream: Any, offset: int, length: int) -> Iterable[Any]:
    """The bytes ``[offset, offset + length)`` of the open binary ``stream`` (short if the file is): one view of the
    mapped file, or chunks where it cannot be mapped. A view is valid until the next item is asked for.

    Example:
        >>> import io
        >>> b"".join(file_range(io.BytesIO(b"abcdef"), 1, 3))
        b'bcd'
    """
    with _mapped(stream) as whole:
        if whole is None:
            yield from _chunks(stream, offset, length)
            return
        # Released before the mapping closes, even while the caller still names it.
        with whole[offset : offset + length] as part:
            yield part


def range_checksums(stream: Any, ranges: Iterable[tuple[int, int]]) -> list[str]:
    """The checksum of each ``(offset, length)`` range of the open binary ``stream``, the file mapped once for all.

    Example:
        >>> import io
        >>> range_checksums(io.BytesIO(b"abcdef"), [(0, 1), (1, 2)]) == [checksum_of([b"a"]), checksum_of([b"bc"])]
        True
    """
    with _mapped(stream) as whole:
        if whole is None:
            return [checksum_of(_chunks(stream, offset, length)) for offset, length in ranges]
        digests = []
        for offset, length in ranges:
            with whole[offset : offset + length] as part:
                digests.append(checksum_of([part]))
        return digests


def _chunks(stream: Any, offset: int, length: int) -> Iterable[bytes]:
    stream.seek(offset)
    while length > 0:
        chunk = stream.read(min(length, _CHUNK))
        if not chunk:
            return
        length -= len(chunk)
        yield chunk


class HashingWriter:
    """A binary file that hashes what is written through it, except its last two bytes: the checksum that
    :func:`seal_full_file` puts in a ``torch.save`` zip's comment covers every byte before the comment's length field,
    so writing the file computes it without reading the file back.

    Example:
        >>> import io
        >>> writer = HashingWriter(io.BytesIO()); writer.write(b"abc"); writer.write(b"de")
        3
        2
        >>> writer.checksum() == checksum_of([b"abc"])
        True
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._state = hasher()
        self._held = b""  # the last two bytes written so far: hashed once more bytes follow them

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= 2:
            self._state.update(self._held)
            self._state.update(view[:-2])
            self._held = bytes(view[-2:])
        else:
            pending = self._held + bytes(view)
            self._state.update(pending[:-2])
            self._held = pending[-2:]
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()

    def checksum(self) -> str:
        return f"{ALGORITHM}:{self._state.hexdigest()}"


# ------------------------------------------------------------------ `.metadata` of a sharded checkpoint


def seal_metadata(path: str | os.PathLike) -> None:
    """Append the checksum of the ``.metadata`` file at ``path`` to it (written, not yet published)."""
    with open(path, "r+b") as stream:
        digest = checksum_of([stream.read()])
        stream.write(METADATA_MARK + digest.encode() + b"\n")
        stream.flush()
        os.fsync(stream.fileno())


def metadata_problem(data: bytes) -> str | None:
    """Why the bytes of a ``.metadata`` file do not match the checksum they end with; None if they do, or if they
    end with none (see :func:`is_sealed`)."""
    at = data.rfind(METADATA_MARK)
    if at < 0:
        return None
    recorded = data[at + len(METADATA_MARK) :].strip().decode(errors="replace")
    try:
        actual = checksum_of([data[:at]], recorded)
    except ValueError as error:
        return str(error)
    return None if actual == recorded else f"checksum {actual} read, {recorded} written at save"


def is_sealed_metadata(data: bytes) -> bool:
    return data.rfind(METADATA_MARK) >= 0


def item_checksum(info: Any) -> str | None:
    """The checksum a storage record (``_StorageInfo``) of a sharded checkpoint carries; None if written without."""
    return getattr(info, "checksum", None)


# ------------------------------------------------------------------ full checkpoint files


def seal_full_file(path: str | os.PathLike, digest: str | None = None) -> None:
    """Set the zip comment of the ``torch.save`` file at ``path`` (just written, not yet published) to the checksum
    of the file's bytes before it: ``digest`` when the write computed it (:class:`HashingWriter`), else read back.

    Example:
        >>> torch.save(checkpoint, staging); seal_full_file(staging)  # doctest: +SKIP
    """
    with open(path, "r+b") as stream:
        size = stream.seek(0, os.SEEK_END)
        stream.seek(size - _ZIP_END_LENGTH)
        end = stream.read(_ZIP_END_LENGTH)
        if not end.startswith(_ZIP_END_SIGNATURE) or end[_COMMENT_LENGTH_AT:] != b"\0\0":
            raise ValueError(f"{path} does not end with a zip archive without comment, as torch.save writes it.")
        if digest is None:
            digest = checksum_of(file_range(stream, 0, size - 2))  # up to the comment's length field
        comment = FULL_FILE_MARK + digest.encode()
        stream.seek(size - 2)
        stream.write(len(comment).to_bytes(2, "little") + comment)
        stream.flush()
        os.fsync(stream.fileno())


def full_file_checksums(path: str | os.PathLike) -> tuple[str, str] | None:
    """``(recorded, actual)`` checksums of a full checkpoint file; None if it was written without one."""
    with open(path, "rb") as stream:
        size = stream.seek(0, os.SEEK_END)
        tail_at = max(0, size - _ZIP_END_LENGTH - _MAX_COMMENT)
        stream.seek(tail_at)
        tail = stream.read()
        end = tail.rfind(_ZIP_END_SIGNATURE)
        comment_at = end + _ZIP_END_LENGTH
        if end < 0 or not tail[comment_at:].startswith(FULL_FILE_MARK):
            return None
        recorded = tail[comment_at + len(FULL_FILE_MARK) :].decode(errors="replace")
        return recorded, checksum_of(file_range(stream, 0, tail_at + comment_at - 2), recorded)


@functools.cache
def warn_unchecked(path: str) -> None:
    """One warning per path and process: the checkpoint at ``path`` predates checksums, so damage to it cannot be
    detected."""
    warnings.warn(
        f"The checkpoint {path} was written without checksums (by an earlier lightning-shard, or another program): "
        "it is loaded unverified, and a damaged byte in it would go unnoticed. Save it again to add them.",
        stacklevel=3,
    )


def damaged_records(path: str | os.PathLike) -> list[str]:
    """The records of a full checkpoint file's zip whose CRC32 (written by ``torch.save``) does not match, each as
    ``"<record> (<what it holds>)"``; a problem with the archive itself as its message."""
    import zipfile

    from lightning_shard.checkpoint.record_names import record_contents

    try:
        with zipfile.ZipFile(path) as archive:
            bad = []
            for info in archive.infolist():
                try:
                    with archive.open(info) as member:
                        while member.read(_CHUNK):
                            pass
                except Exception as error:  # BadZipFile, or what a damaged header makes of the record
                    bad.append((info.filename, str(error)))
            contents = record_contents(archive) if bad else {}
    except Exception as error:  # a damaged directory: zipfile raises anything from BadZipFile to NotImplemented
        return [f"the zip archive's structure ({type(error).__name__}: {error})"]
    if not bad:
        return ["the zip archive's headers or padding (no record's data)"]
    format_record = "not a tensor: the archive's format"
    return [f"record {name} ({contents.get(name.split('/', 1)[-1], format_record)})" for name, _ in bad]
