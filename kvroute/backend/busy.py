"""Backends that share a machine tell each other when their engines work.

A backend's disk writer gives way while its own engine has work (disk.py), but the
replicas `kvroute serve` starts share one GPU, memory bus and disk: measured on an
H200 with two replicas, the idle one writing its conversations to disk made the
other's cold 31k-token prompt 1.22x and its cache hits 1.21x slower. So each backend
also gives way while a sibling works, and a write that goes on under load anyway (disk.py's
hold-off) waits while a sibling has a prompt to prefill, as it does for its own.

Siblings are the backends whose disk tiers lie in one folder (serve puts replica
NAME's tier in DIR/NAME). A backend whose engine works holds a file named by its pid
in a board folder under the system's temporary directory, named by a hash of that
folder, and renames it PID.p while a prompt of its waits for its first token; a file
whose process is gone (killed, crashed) is ignored and removed.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

import xxhash

log = logging.getLogger("kvroute.backend.busy")

PREFILLING = ".p"  # the suffix of a board file while its backend has a prompt waiting


class BusyBoard:
    def __init__(self, folder: Path, pid: int | None = None):
        self.folder = folder
        self.pid = os.getpid() if pid is None else pid
        self._names = {"working": folder / str(self.pid),
                       "prefilling": folder / f"{self.pid}{PREFILLING}"}
        self._state = "idle"
        self._warned = False
        for left in self._names.values():  # left by an earlier process with this pid
            try:
                left.unlink(missing_ok=True)
            except OSError:
                pass

    @classmethod
    def beside(cls, tier_dir: Path) -> "BusyBoard":
        """The board of the backends whose disk tiers share `tier_dir`'s parent."""
        parent = str(Path(tier_dir).resolve().parent)
        key = xxhash.xxh64_hexdigest(parent.encode())
        return cls(Path(tempfile.gettempdir()) / "kvroute-busy" / key)

    def set(self, busy: bool, prefilling: bool = False) -> None:
        """Say whether this backend's engine works and whether a prompt of its waits for
        its first token (called on every load change: only a change touches the file
        system)."""
        state = "prefilling" if busy and prefilling else "working" if busy else "idle"
        if state == self._state:
            return
        was, self._state = self._state, state
        try:
            if state == "idle":
                self._names[was].unlink(missing_ok=True)
            elif was == "idle":
                self.folder.mkdir(parents=True, exist_ok=True)
                self._names[state].touch()
            else:
                os.replace(self._names[was], self._names[state])
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("busy board %s: %s (sibling backends' disk writes may not give "
                            "way to this one)", self.folder, exc)

    def others_busy(self) -> bool:
        """Whether a live sibling's engine works."""
        return bool(self._others())

    def others_prefilling(self) -> bool:
        """Whether a live sibling has a prompt waiting for its first token."""
        return "prefilling" in self._others()

    def _others(self) -> set[str]:
        """The states of the live siblings; the files of dead ones removed."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return set()
        states = set()
        for name in names:
            pid = name.removesuffix(PREFILLING)
            if not pid.isdigit() or int(pid) == self.pid:
                continue
            if _alive(int(pid)):
                states.add("working" if pid == name else "prefilling")
                continue
            try:
                (self.folder / name).unlink(missing_ok=True)
            except OSError:
                pass
        return states

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
