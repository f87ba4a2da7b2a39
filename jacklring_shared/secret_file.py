"""Reading a JACKLRING_SECRET_FILE: the one check the launcher and every rank apply, so a file
the launcher accepts is never one a rank refuses (docs/security.md)."""
from __future__ import annotations

import os
import stat

ENV_SECRET_FILE = "JACKLRING_SECRET_FILE"
MAX_SECRET_FILE_BYTES = 4096


class SecretFileError(Exception):
    """The file cannot hold the job secret; the text names the path and what to do."""


def read_secret_file(path: str) -> str:
    """The file's text (stripped). Refuses a symlink, a file group- or world-accessible (it must
    be 0600 or stricter), one larger than MAX_SECRET_FILE_BYTES, and one that cannot be opened."""
    where = f"{ENV_SECRET_FILE}={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise SecretFileError(f"{where} cannot be opened: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretFileError(f"{where} is readable by other users "
                                  f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        data = f.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretFileError(f"{where} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    return data.decode(errors="replace").strip()
