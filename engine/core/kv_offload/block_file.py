"""One KV block in one file: a fixed header (magic, format version, the tier's fingerprint,
the block's key, the payload's length and CRC-32) and the block's bytes.

A file is written under a name no one else uses, flushed to disk, then renamed into place,
so a reader sees either the whole file or none; a file that is still torn or corrupt
(a disk error, a hand edit) fails `read_block_file`'s checks and is never served.
"""

import os
import struct
import uuid
import zlib
from pathlib import Path

MAGIC = b"KVSTIER\0"
FORMAT_VERSION = 1
# magic, version, fingerprint, key, payload bytes, payload CRC-32
HEADER = struct.Struct("<8sI16s16sQI")
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class CorruptBlockFile(Exception):
    """The file is not a whole, intact block of this fingerprint and key."""


def block_file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def tmp_file_name(key: bytes) -> str:
    """Unique per writer and write: two processes writing the same block never share a
    temporary file; the pid lets a later start tell a dead writer's leftover."""
    return f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"


def tmp_file_pid(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else None


def write_block_file(folder: Path, fingerprint: bytes, key: bytes, payload) -> int:
    """Write atomically (temporary file, fsync, rename); returns the file's size. An OSError
    (a full disk among them) leaves no file behind, only the error."""
    view = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, fingerprint, key, len(view), zlib.crc32(view))
    tmp = folder / tmp_file_name(key)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, view)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / block_file_name(key))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER.size + len(view)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_block_file(path: Path, fingerprint: bytes, key: bytes) -> memoryview:
    """The block's payload, or CorruptBlockFile if anything about the file is off.
    FileNotFoundError if it is gone (another process evicted it)."""
    with open(path, "rb") as file:
        data = bytearray(os.fstat(file.fileno()).st_size)
        read = file.readinto(data)
    if read != len(data) or len(data) < HEADER.size:
        raise CorruptBlockFile(f"{path.name}: {len(data)} bytes, shorter than a header")
    magic, version, file_fingerprint, file_key, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlockFile(f"{path.name}: not a version-{FORMAT_VERSION} block file")
    if file_fingerprint != fingerprint or file_key != key:
        raise CorruptBlockFile(f"{path.name}: written for another fingerprint or key")
    if len(data) != HEADER.size + length:
        raise CorruptBlockFile(f"{path.name}: {len(data) - HEADER.size} payload bytes, the "
                               f"header says {length} (torn)")
    payload = memoryview(data)[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise CorruptBlockFile(f"{path.name}: checksum mismatch")
    return payload
