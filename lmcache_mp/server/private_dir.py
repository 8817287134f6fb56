"""A directory only the server's user controls, and files in it opened without trusting the path.

What the server keeps outside its own memory (the warm-restart segment and snapshot, the
disk tier) sits in such a directory. Its path is walked from / one component at a time,
each opened with O_PATH|O_NOFOLLOW|O_DIRECTORY through its parent's descriptor: a
component that is a link is refused, and so is one that a user other than root and the
server's own could change (ssh's StrictModes: owned by root or the server's user, and
writable by no one else, but for a root-owned directory with the sticky bit, such as /tmp
and /dev/shm, where others may add names but not replace or remove those of the server).
The directory itself is created 0700, or refused unless it is a real directory of this
user that nobody else can write to. A server holds it with lock(), which names the
process that holds it already. Every file in it is opened through the directory's
descriptor (no path component can be swapped for a link between the check and the use),
with O_NOFOLLOW (a link is refused) and O_NONBLOCK (a FIFO cannot stall the start-up),
then checked with fstat before a byte of it is read: a regular file of this user that
no one else may read or write, of a bounded size. Refusals name the path and its owner,
never what the file holds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
from pathlib import Path

from ..errors import SetupError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WALK_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
# What open() says when the name is not a regular file: a link (O_NOFOLLOW), a directory,
# a FIFO or socket without a reader (O_NONBLOCK), a device without its driver.
_NOT_A_FILE = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ENOTDIR,
               errno.EOPNOTSUPP)
_LOCKS = Path("/proc/locks")


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
                       (stat.S_ISREG, "regular file"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def lock_holder(fd: int) -> str:
    """Who holds the flock on `fd`'s file: `pid N`, as /proc/locks tells it, or `a process
    this one cannot see` (another pid namespace, or /proc unreadable)."""
    info = os.fstat(fd)
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        lines = _LOCKS.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()  # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device \
                and fields[4].isdigit() and fields[4] != "0":
            return f"pid {fields[4]}"
    return "a process this one cannot see"


def _check_component(fd: int, path: Path) -> None:
    """A directory on the way to a private one: only root and this server's user may
    change it (a sticky directory of root's, such as /tmp, is let through: others may add
    names there, but not replace or remove the next component, which is checked in turn)."""
    info = os.fstat(fd)
    euid = os.geteuid()
    problem = None
    if info.st_uid not in (0, euid):
        problem = f"belongs to {owner_name(info.st_uid)}"
    elif info.st_mode & 0o022 and not (info.st_uid == 0 and info.st_mode & stat.S_ISVTX):
        problem = f"has mode {info.st_mode & 0o7777:o}"
    if problem is not None:
        os.close(fd)
        raise UnsafePath(f"{path} {problem}: a user other than root and this server's "
                         f"{owner_name(euid)} could replace what is below it; choose a "
                         f"place that only they control")


def _walk(path: Path) -> tuple[int, Path]:
    """An O_PATH descriptor of the parent of `path` (absolute, as the process sees it),
    reached from / without following a link, every component checked; raises UnsafePath."""
    absolute = Path(os.path.abspath(path))
    if absolute.parent == absolute:
        raise UnsafePath(f"{path} cannot be a private directory")
    fd = os.open("/", _WALK_FLAGS)
    walked = Path("/")
    _check_component(fd, walked)
    for name in absolute.parent.parts[1:]:
        walked = walked / name
        try:
            component = os.open(name, _WALK_FLAGS, dir_fd=fd)
        except OSError as exc:
            info = _lstat(name, fd)
            os.close(fd)
            if info is not None and not stat.S_ISDIR(info.st_mode):
                link = stat.S_ISLNK(info.st_mode)
                raise UnsafePath(f"{walked} is a {_kind(info.st_mode)} of "
                                 f"{owner_name(info.st_uid)}, not a directory" + (
                                     f": no link is followed on the way to {path}; give "
                                     f"the path it stands for" if link else "")) from None
            raise UnsafePath(f"cannot reach {path}: {walked}: {exc.strerror}") from None
        os.close(fd)
        fd = component
        _check_component(fd, walked)
    return fd, absolute


class PrivateDir:
    """An open private directory; the files in it are named relative to its descriptor."""

    def __init__(self, path: Path):
        """Create `path` (mode 0700, its parent must exist) or check the one there, every
        component of the way checked (_walk); raises UnsafePath."""
        self.path = path
        parent, self._absolute = _walk(path)
        absolute = self._absolute
        try:
            self.created = _make(parent, absolute.name, path)
            self.fd = _open_directory(parent, absolute.name, path)
        finally:
            os.close(parent)
        info = os.fstat(self.fd)
        euid = os.geteuid()
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

    def lock(self) -> None:
        """Hold the directory for this process (until close(), or the process's end); raises
        UnsafePath naming the process that holds it already."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(self.fd)
            os.close(self.fd)
            self.fd = -1
            raise UnsafePath(f"{self.path} is in use by another server ({holder}); stop it, "
                             f"or choose another place") from None

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
            info = _lstat(name, self.fd)
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

    def discard(self) -> None:
        """close(), and remove the directory if this server made it and put nothing in it
        (a start refused after it was made leaves nothing behind)."""
        self.close()
        if self.created:
            try:
                os.rmdir(self._absolute)
            except OSError:
                pass  # something is in it after all: it stays


def _make(parent: int, name: str, path: Path) -> bool:
    """mkdir `name` in `parent`, mode 0700; False if there is something of that name."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        return False
    except OSError as exc:
        raise UnsafePath(f"cannot create {path}: {exc.strerror}") from None
    return True


def _open_directory(parent: int, name: str, path: Path) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS, dir_fd=parent)
    except OSError as exc:
        info = _lstat(name, parent)
        what = f"a {_kind(info.st_mode)} of {owner_name(info.st_uid)}" if info else \
            exc.strerror
        raise UnsafePath(f"{path} is not a directory ({what}); remove it, or choose "
                         f"another place") from None


def _lstat(name: str | Path, dir_fd: int | None = None) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
