"""Whether a file or directory in the user's cache may be trusted: owned by this user, writable by nobody else.

The kernel library is loaded into every stage process and the embedded models are loaded as weights: anything
another user could have written there could run as, or speak for, this service. What is not trusted is rebuilt
when it is ours to replace, and refused with the reason otherwise.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedCacheError(RuntimeError):
    """A cached file or directory that this process must not use, with the reason."""


def distrust(path: Path) -> str | None:
    """Why `path` must not be used (None: it may be). Checks the path itself, not what a directory holds."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or by others (mode {stat.filemode(info.st_mode)})"
    return None


def ours_to_replace(path: Path) -> bool:
    """The untrusted `path` can be rebuilt in place: this user owns it and the directory holding it."""
    try:
        return path.lstat().st_uid == os.getuid() and path.parent.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return True
