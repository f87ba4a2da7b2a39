"""A job secret for ranks that share one host and one user, kept in a file only they can read.

Ranks started without a secret (torchrun, a single-node srun step, a script that sets the
torch variables by hand) all compute the same path from the job's public identity; the first
creates the file with 256 random bits, the others read it. The directory is 0700 and the file
0600, both owned by this user: an outsider (another uid) can neither read the secret nor put a
file, or a symlink to one, in its place. Ranks on other hosts would draw other secrets, so
callers use this only when every rank is known to be on this host.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
import time
from typing import Mapping

from ...errors import ConfigError
from . import auth

DIR_NAME = "jacklring-{uid}"
HOME_DIR = os.path.join(".cache", "jacklring")
UNUSED_FOR_S = 7 * 24 * 3600  # a secret no rank has read for this long is removed


def _private(path: str) -> bool:
    """Whether path is a real directory of this user that no other user can write to: a name
    inside it can be created by this user only."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def secrets_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where the derived secrets live: a place only this user can create.

    $XDG_RUNTIME_DIR/jacklring-UID (a per-user tmpfs on systemd hosts), else ~/.cache/jacklring
    (created when missing), when that base is this user's and closed to others' writes. Only
    without either, $TMPDIR/jacklring-UID: a shared temporary directory where another user can
    create that name first, which then fails closed (ConfigError naming its owner)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and _private(runtime):
        return os.path.join(runtime, DIR_NAME.format(uid=os.getuid()))
    home = environ.get("HOME")
    if home and _private(home):
        cache = os.path.join(home, ".cache")
        try:
            os.mkdir(cache, 0o700)
        except OSError:
            pass  # exists (checked below), or cannot be made: the temporary directory serves
        if _private(cache):
            return os.path.join(home, HOME_DIR)
    base = environ.get("TMPDIR") or tempfile.gettempdir()
    return os.path.join(base, DIR_NAME.format(uid=os.getuid()))


def _checked_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the directory {path!r} for the derived job secret: "
                          f"{exc.strerror or exc}") from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path!r} is not a directory but a {'symlink' if stat.S_ISLNK(info.st_mode) else 'file'} "
                          f"of uid {info.st_uid} ({_owner(info.st_uid)}): refusing to keep a job secret in it; "
                          f"remove it, set XDG_RUNTIME_DIR or HOME to a directory of your own, or set "
                          f"JACKLRING_SECRET")
    _check_owner_and_mode(path, info, "directory")


def _owner(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "no user name"


def _check_owner_and_mode(path: str, info: os.stat_result, what: str) -> None:
    if info.st_uid != os.getuid():
        raise ConfigError(f"the {what} {path!r} belongs to uid {info.st_uid} ({_owner(info.st_uid)}), not this "
                          f"user ({os.getuid()}): someone else created it first; refusing its job secret. Set "
                          f"XDG_RUNTIME_DIR or HOME to a directory of your own, or set JACKLRING_SECRET")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the {what} {path!r} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                          f"refusing its job secret; remove it or set JACKLRING_SECRET")


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path!r} is a symlink: refusing to read a job secret through it; "
                              f"remove it or set JACKLRING_SECRET") from None
        raise ConfigError(f"cannot read the derived job secret {path!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path!r} is not a regular file: refusing its job secret")
        _check_owner_and_mode(path, info, "file")
        text = f.read(4 * auth.SECRET_BYTES).decode(errors="replace").strip()
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != auth.SECRET_BYTES:
        raise ConfigError(f"the derived job secret {path!r} is not {auth.SECRET_BYTES} bytes of hex: remove it")
    return value


def secret_for(job: str, environ: Mapping[str, str] = os.environ) -> tuple[bytes, str]:
    """The secret of the job named `job` (its public identity) and the file holding it."""
    directory = secrets_dir(environ)
    _checked_dir(directory)
    path = os.path.join(directory, hashlib.sha256(job.encode()).hexdigest()[:32] + ".secret")
    value = _read(path)
    if value is not None:
        os.utime(path)  # in use: the clean-up below keeps it
        return value, path
    _remove_unused(directory)
    # Written whole to a private temporary name, then linked into place: a reader never sees
    # a partial file, and of ranks racing to create it the first link wins.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".new-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(auth.generate_secret())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    value = _read(path)
    if value is None:
        raise ConfigError(f"the derived job secret {path!r} vanished while this rank created it")
    return value, path


def _remove_unused(directory: str) -> None:
    """Secrets of jobs long over (every read marks a file as used), so the directory stays small."""
    cutoff = time.time() - UNUSED_FOR_S
    for entry in os.scandir(directory):
        try:
            info = entry.stat(follow_symlinks=False)
            if entry.name.endswith(".secret") and stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:
            pass  # another rank removed it first
