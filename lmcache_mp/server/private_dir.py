"""A directory only the server's user controls, and files in it opened without trusting the path.

What the server keeps outside its own memory (the warm-restart segment and snapshot) sits
in such a directory: created 0700, or refused unless it is a real directory of this
user that nobody else can write to. Every file in it is opened through the directory's
descriptor (no path component can be swapped for a link between the check and the use),
with O_NOFOLLOW (a link is refused) and O_NONBLOCK (a FIFO cannot stall the start-up),
then checked with fstat before a byte of it is read: a regular file of this user that
no one else may read or write, of a bounded size. Refusals name the path and its owner,
never what the file holds.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from ..errors import SetupError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What open() says when the name is not a regular file: a link (O_NOFOLLOW), a directory,
# a FIFO or socket without a reader (O_NONBLOCK), a device without its driver.
_NOT_A_FILE = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ENOTDIR,
               errno.EOPNOTSUPP)


class UnsafePath(SetupError):
    """A path the server will not use; the message says why, and who owns it."""


def owner_name(uid: int) -> str:
    """`uid 65534 (nobody)`, or `uid N` where the user database has no name for it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


class PrivateDir:
    """An open private directory; the files in it are named relative to its descriptor."""

    def __init__(self, path: Path):
        """Create `path` (mode 0700, its parent must exist) or check the one there; raises
        UnsafePath."""
        self.path = path
        euid = os.geteuid()
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafePath(f"cannot create {path}: {exc.strerror}") from None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as exc:
            info = _lstat(path)
            what = f"a {_kind(info.st_mode)} of {owner_name(info.st_uid)}" if info else \
                exc.strerror
            raise UnsafePath(f"{path} is not a directory this server can use ({what}); "
                             f"remove it, or choose another place") from None
        info = os.fstat(self.fd)
        problem = None
        if info.st_uid != euid:
            problem = (f"belongs to {owner_name(info.st_uid)}, not to this server's "
                       f"{owner_name(euid)}: someone else made it")
        elif info.st_mode & 0o077:
            problem = (f"has mode {info.st_mode & 0o777:o}: others may reach what is in it "
                       f"(it must be 0700)")
        if problem is not None:
            os.close(self.fd)
            raise UnsafePath(f"{path} {problem}; remove it (as its owner or root), or "
                             f"choose another place")

    def open(self, name: str, flags: int, max_bytes: int | None = None) -> int:
        """A descriptor of file `name`, checked: a regular file of this user, mode 0600 or
        stricter, of at most `max_bytes` (None: any size). Raises FileNotFoundError when
        there is none, UnsafePath for anything else there, and OSError for what the
        filesystem refuses (EROFS, EACCES, EINVAL for flags it does not take)."""
        try:
            fd = os.open(name, flags | _OPEN_FLAGS, 0o600, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno not in _NOT_A_FILE:
                raise
            info = _lstat(self.path / name)
            what = (f"owned by {owner_name(info.st_uid)}, is a {_kind(info.st_mode)}" if info
                    else f"cannot be opened: {exc.strerror}")
            raise UnsafePath(f"{self.path / name}, {what}") from None
        try:
            self.check(fd, name, max_bytes)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def check(self, fd: int, name: str, max_bytes: int | None = None) -> os.stat_result:
        """fstat() of an open file, or UnsafePath naming what is wrong with it and whose it is."""
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = f"is a {_kind(info.st_mode)}, not a regular file"
        elif info.st_uid != os.geteuid():
            problem = "does not belong to this server's user"
        elif info.st_mode & 0o077:
            problem = f"has mode {info.st_mode & 0o777:o}, not 0600"
        elif max_bytes is not None and info.st_size > max_bytes:
            problem = f"holds {info.st_size} bytes, more than the {max_bytes} it can hold"
        if problem is not None:
            raise UnsafePath(f"{self.path / name}, owned by {owner_name(info.st_uid)}, {problem}")
        return info

    def create(self, name: str) -> int:
        """A new file `name`, mode 0600, open for reading and writing; FileExistsError if
        there is one."""
        return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600,
                       dir_fd=self.fd)

    def unlink(self, name: str) -> bool:
        """Remove `name` (a link itself, never what it points to; an empty directory too);
        False if there was none; UnsafePath for what cannot be removed."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            try:
                os.rmdir(name, dir_fd=self.fd)
            except OSError as exc:
                raise UnsafePath(f"{self.path / name} is a directory that cannot be removed "
                                 f"({exc.strerror}): remove it by hand") from None
        return True

    def replace(self, source: str, target: str) -> None:
        """Rename `source` over `target`, atomically: readers see one or the other, whole."""
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def sync(self) -> None:
        """Make the directory's entries (a rename) durable."""
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None
