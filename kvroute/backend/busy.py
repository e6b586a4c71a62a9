"""Backends that share a machine tell each other when their engines work.

A backend's disk writer gives way while its own engine has work (disk.py), but the
replicas `kvroute serve` starts share one GPU, memory bus and disk: measured on an
H200 with two replicas, the idle one writing its conversations to disk made the
other's cold 31k-token prompt 1.22x and its cache hits 1.21x slower. So each backend
also gives way while a sibling works.

Siblings are the backends whose disk tiers lie in one folder (serve puts replica
NAME's tier in DIR/NAME). A backend whose engine works holds a file named by its pid
in a board folder under the system's temporary directory, named by a hash of that
folder; a file whose process is gone (killed, crashed) is ignored and removed.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

import xxhash

log = logging.getLogger("kvroute.backend.busy")


class BusyBoard:
    def __init__(self, folder: Path, pid: int | None = None):
        self.folder = folder
        self.pid = os.getpid() if pid is None else pid
        self._mine = folder / str(self.pid)
        self._busy = False
        self._warned = False
        try:
            self._mine.unlink(missing_ok=True)  # left by an earlier process with this pid
        except OSError:
            pass

    @classmethod
    def beside(cls, tier_dir: Path) -> "BusyBoard":
        """The board of the backends whose disk tiers share `tier_dir`'s parent."""
        parent = str(Path(tier_dir).resolve().parent)
        key = xxhash.xxh64_hexdigest(parent.encode())
        return cls(Path(tempfile.gettempdir()) / "kvroute-busy" / key)

    def set(self, busy: bool) -> None:
        """Say whether this backend's engine works (called on every load change: only
        a change touches the file system)."""
        if busy == self._busy:
            return
        self._busy = busy
        try:
            if busy:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._mine.touch()
            else:
                self._mine.unlink(missing_ok=True)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("busy board %s: %s (sibling backends' disk writes may not give "
                            "way to this one)", self.folder, exc)

    def others_busy(self) -> bool:
        """Whether a live sibling's engine works."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return False
        for name in names:
            if not name.isdigit() or int(name) == self.pid:
                continue
            if _alive(int(name)):
                return True
            try:
                (self.folder / name).unlink(missing_ok=True)
            except OSError:
                pass
        return False

    def close(self) -> None:
        self.set(False)
        try:
            self.folder.rmdir()  # the last one out: no empty folder left behind
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM  # another user's process: alive
    return True
