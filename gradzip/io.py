"""Small file helpers shared by every part: atomic writes and JSON-lines reading.

Atomic: the text goes to a temporary file in the same directory, then ``os.replace`` renames it
over the target, so a reader (or a crash) never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from gradzip.errors import GradzipError

TEMP_SUFFIX = ".gztmp"  # the ending of atomic_write's temporary files


def _create_temp(p: Path) -> tuple[int, Path]:
    """A new temporary file next to ``p``, created exclusively and without following symlinks
    (``O_EXCL | O_NOFOLLOW``, random name): a link planted in a shared directory cannot redirect
    the write. The mode is the usual 0o666 less the umask, like a file opened with ``open``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None], durable: bool = False) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it over ``path``.
    ``durable=True`` also fsyncs the file and its directory (checkpoints)."""
    p = Path(path)
    fd, tmp = _create_temp(p)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:  # make the rename itself durable
        try:
            dfd = os.open(p.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass


def stale_temps(directory: str | os.PathLike[str], stem: str = "") -> list[Path]:
    """Temporary files that :func:`atomic_write` left in ``directory`` (a process killed mid-write),
    for targets whose name starts with ``stem``."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(q for q in d.iterdir() if q.name.startswith(f".{stem}") and q.name.endswith(TEMP_SUFFIX)
                  and q.is_file() and not q.is_symlink())


def atomic_write_text(path: str | os.PathLike[str], text: str, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), durable)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] if it does not exist). A torn line (a crash while it
    was written) is skipped: the records before it are still good."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GradzipError(f"{p} is not a JSON-lines text file (byte {e.start} is not UTF-8): it was not written "
                           "by gradzip, or is damaged; move it away") from None
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive inter-process lock on the lock file ``path`` (created with its directory).
    Without POSIX ``fcntl`` it does nothing: callers' writes stay atomic, work may be duplicated."""
    try:  # POSIX only
        import fcntl
    except ImportError:
        yield
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
