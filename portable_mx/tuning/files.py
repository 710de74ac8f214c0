"""Small file helpers of the tuner: an exclusive lock on a sidecar ``.lock`` file, an
atomic write (temp file + fsync + rename), so that several tuning processes can merge
into one JSON file without losing each other's entries, and setting a file aside under a
name that says why, never replacing an earlier one."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
from pathlib import Path
from typing import Iterator, Optional


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path``'s sidecar ``<name>.lock`` (POSIX
    flock; where there is none, the atomic rename alone keeps the file whole). The
    sidecar is the one of the file ``path`` resolves to: writers reaching one shared file
    through different symbolic links exclude each other (with a sidecar per link, four
    of them once kept 34 of their 60 entries)."""
    path = Path(os.path.realpath(path))
    make_dir(path.parent)
    with open(path.with_name(path.name + ".lock"), "a+") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover  (not POSIX)
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def make_dir(directory: Path) -> None:
    """Create ``directory`` (and its parents) unless it is one; a clear
    NotADirectoryError when it, or a parent, is a file."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        raise NotADirectoryError(f"{directory} cannot be a directory: {blocker} is a file") from None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one rename (readers see the old or the new file).
    The new file keeps the old one's permission bits, or takes a new file's under the
    process's umask (a temporary file is created owner-only: renamed as it is, a cache
    shared through a group-readable directory became unreadable to the others). A
    ``path`` that is a symbolic link stays one: the file it points to is replaced (a
    cache file linked from a shared place is updated there, not copied over the link)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    make_dir(path.parent)
    fd, tmp = _new_temporary(path)
    try:
        with contextlib.suppress(OSError):  # the old file's bits (a file system without modes: none)
            os.fchmod(fd, path.stat().st_mode & 0o7777)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _new_temporary(path: Path) -> tuple[int, str]:
    """(descriptor, name) of a new file next to ``path``, created as ``open`` creates one
    (mode 0o666 under the umask; ``tempfile.mkstemp`` makes it owner-only)."""
    for _ in range(100):
        tmp = str(path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp"))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def aside_path(path: Path, why: str, n: int = 1) -> Path:
    """``<name>.<why>.json`` next to ``path`` (``<name>.<why>.<n>.json`` for n > 1), where
    ``<name>`` is ``path``'s name without ``.json`` and ``why`` is made file-name safe."""
    path = Path(path)
    stem = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", why).strip("-.") or "aside"
    return path.with_name(f"{stem}.{tag}{'' if n == 1 else f'.{n}'}.json")


def set_aside(path: Path, why: str, source: Optional[Path] = None) -> Path:
    """Move ``source`` (default ``path``) to the first free :func:`aside_path` of ``path``
    and ``why`` and return it; an existing file is never replaced (a hard link claims the
    name atomically; where the file system has none, the name is checked first, which is
    safe among writers that hold :func:`locked`)."""
    path = Path(path)
    source = Path(source) if source is not None else path
    for n in itertools.count(1):
        target = aside_path(path, why, n)
        try:
            os.link(source, target)
        except FileExistsError:
            continue
        except OSError:  # no hard links on this file system
            if target.exists():
                continue
            os.rename(source, target)
            return target
        os.unlink(source)
        return target
    raise AssertionError("unreachable")


def write_aside(path: Path, why: str, text: str) -> Path:
    """Write ``text`` to a new file, the first free :func:`aside_path` of ``path`` and
    ``why`` (complete or absent, never replacing a file), and return its path."""
    path = Path(path)
    make_dir(path.parent)
    fd, tmp = _new_temporary(path)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        return set_aside(path, why, source=Path(tmp))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
