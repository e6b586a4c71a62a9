"""The disk tier: every committed entry also lives in a directory, bounded by bytes.

- Write-behind, when idle: the store's insert events queue the entry for a writer
  thread, so the engine thread never waits on a disk; the writer starts a write
  once the engine has been idle a moment (`idle_wait`) or the entry has waited
  `max_delay`, because a write (copying gigabytes off the device, checksumming)
  slows the batch it runs beside; a write gives way between its block files when
  the engine gets work, the same way. An entry superseded before its turn is not
  written (the entry that superseded it is): a conversation's turns during busy
  periods end as one file, not one per turn. A superseded entry's file is removed
  after its successor's file is in place. A RAM eviction keeps the file. Closing
  writes what is queued at once.
- Entries over the RAM budget: the store hands them whole to `take` (RAM keeps a
  prefix at most, which is not written again). Such an entry is queued while the
  queue is empty or it fits the queue's bytes, never while writes are failing; it
  replaces a queued one it extends, and once its file is in place the records it
  extends are removed (their keys are its own). A refusal's reason goes back to
  the store, which counts the commit as refused when RAM keeps nothing of it.
- Index: file name -> `Record` (tokens, scope, chain) in LRU order; the disk's own
  byte budget evicts least recently used files. A restart re-indexes from the
  files' headers alone (see diskfile.py) and drops, with one log line and a
  metric, whatever is partial, corrupt, foreign or of an older format.
- Restore: the server asks `prefetch` before it hands a request to the engine;
  when the disk holds a deeper usable prefix than RAM, the file is read and
  checked on a reader thread (requests hitting one file share one read) and the
  engine starts the request from it (`Restored`).
- Keys: the chains of the files are advertised as the backend's *disk* tier, so
  the proxy can weigh a restore against a RAM hit or a cold prefill.
- Degrading: an unusable directory (not creatable, held by another process)
  turns the tier off with a warning; a failed write (a full disk) is counted and
  logged, and the request path never sees either. A folder that turns read-only
  (an ext4 remount after I/O errors) or a file that cannot be removed: the file is
  skipped for the rest of the process, the tier serves reads of its whole files and
  writes go to RAM only until one succeeds again (one warning, `stats()["writable"]`
  and the write-failure metric say so).

One module past 400 lines on purpose: the writer, the index and the reader share
one index and its lock; the file format is apart, in diskfile.py.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import itertools
import logging
import os
import queue
import shutil
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from kvroute.core import disk_space
from kvroute.core.accel import device_trouble
from kvroute.core.sizes import format_bytes

from . import diskfile, paged, pinned
from .busy import BusyBoard
from .diskblocks import Blocks
from .diskfile import BadRecord, Record
from .paged import Block, Paged
from .store import Entry, Event, Hit, common_prefix, usable_prefix

log = logging.getLogger("kvroute.backend.disk")

IDLE_WAIT = 0.25  # seconds the engine is idle before a write starts
MAX_DELAY = 30.0  # seconds an entry waits for idleness at most
PACE = 3.0  # past MAX_DELAY under load: wait this many times a block file's time after it
MAX_PACE_WAIT = 0.5  # seconds, at most, of one such wait
POLL = 0.02
RESTORE_THREADS = 2  # restores read at once (their block files share the block readers)
# The writes of entries RAM let go of hold at most 1/ORPHANED_SHARE of the queue's bound
# (the RAM budget's size), which RAM's budget counts. On a 2-core VM, 8 agents right
# after decode runs hit 0.58-0.69 of their tokens at a half (0.72 with no tier), their
# turns 2-4 1.3-3x slower, and 0.70-0.72 at a quarter or an eighth; 12 conversations
# whose RAM holds one or two of them hit 0.747 at a half or a quarter, 0.699 at an
# eighth (evicted conversations' writes dropped: `bench_disk capacity`).
ORPHANED_SHARE = 4
HEADER_ROOM = 1 << 20  # a record's header and padding, at most, beside its tensors
# Read rate a restore is assumed to reach before one is measured (after a restart):
# a page-cache or NVMe read with its checksums (an H100 host measured 3.1 GB/s). With
# 1 GiB/s a restarted GPU backend prefilled an 8k-token conversation (0.30 s) that
# its disk gave back in 0.15 s. A wrong guess costs one request: the first restore
# measures the rate.
RESTORE_PRIOR_BPS = 3 << 30
# Seconds a restore costs beside its bytes (files, sums, a thread hop): a prompt that
# shares a few tokens with a record (a chat template's opening) is prefilled.
RESTORE_OVERHEAD = 0.005


@dataclass
class Restored:
    """A state read from disk for one request; the engine makes its private view."""

    tokens: int  # the prompt's tokens it serves
    state: Paged  # shared by every request that hit the same file: never handed out
    held: int  # tokens the state holds (>= tokens)

    def hit(self) -> Hit:
        return Hit(self.tokens, self.state.assemble(self.tokens), None)

    @property
    def cache(self) -> list[Any]:
        """All it holds, as a private copy (engine thread)."""
        return self.state.assemble()


@dataclass
class Early:
    """A read `read_early` began before its request's tokens were known."""

    key: tuple[str, int]  # (file name, blocks): what `prefetch` would read
    future: Future  # the reader's state, or None
    used: bool = False  # taken over by the request's `prefetch`


# `find`'s answer: ((tokens the best record serves, that record or None), RAM's depth).
Found = tuple[tuple[int, Record | None], int]


@dataclass
class DiskEvent:
    kind: str  # "insert" or "evict"
    model: str
    keys: list[int]  # keys the disk newly holds / no longer holds


class DiskTier:
    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: str,
                 metrics: Any, queue_bytes: int, read_parallel: int = 4, fsync: bool = True):
        self.directory = Path(directory).expanduser()
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.queue_bytes = queue_bytes  # bytes of entries waiting to be written, at most
        # Of them, what the writes of entries RAM let go of may hold before an evicted
        # entry's write is dropped instead (`_behind`).
        self.max_orphaned = queue_bytes // ORPHANED_SHARE
        self.read_parallel = read_parallel
        self.fsync = fsync  # each write's file and folder (docs/SSD_TIER.md, Durability)
        self.busy: Callable[[], bool] = lambda: False  # the engine has work (set at boot)
        # A request waits for its first token (set at boot): paced writes hold off.
        self.prefilling: Callable[[], bool] = lambda: False
        self._restoring = 0  # restores being read (under the lock; the writer reads it)
        # Sibling backends (their tiers share this one's parent folder): a write also
        # gives way while one of their engines works (busy.py). Set by open_disk_tier.
        self.board: BusyBoard | None = None
        self.idle_wait = IDLE_WAIT
        self.max_delay = MAX_DELAY
        self._closing = False
        self._abandon = False  # closing without writing what waits (close(write=False))
        self._deferred: deque = deque()  # "write" and "drop" items waiting for an idle engine
        self._idle_from: float | None = None  # when the engine was last seen going idle
        self._file_from = 0.0  # when the block file being written began (its pace)
        self._hold_left = 0.0  # seconds the write being written may still hold off for prompts
        self._writing = 0  # 1 while the writer handles an item (stats: nothing pending at 0)
        self.enabled = False
        self.listeners: list[Callable[[DiskEvent], None]] = []
        self.index: OrderedDict[str, Record] = OrderedDict()  # LRU order, oldest first
        self.nbytes = 0  # the records' files (their shared blocks: `blocks.nbytes`)
        self.lock = threading.RLock()
        self.blocks = Blocks(self.directory, fingerprint, fsync, self.lock)
        self.restore_bps = 0.0  # measured restore bandwidth, bytes/s (moving average)
        self.restore_tps = 0.0  # the same in tokens/s, for the proxy's TTFT estimate
        self._by_entry: dict[int, str] = {}  # store entry id -> file name
        self._seen: set[int] = set()  # store entry ids queued or written
        self._wholes: list[list] = []  # queued ["whole", entry] items, not yet written
        self._queued: dict[int, list] = {}  # entry id -> its queued ["write", entry] item
        self._superseded: set[int] = set()
        # model -> prefix key -> the records advertised by it: what the disk advertises
        # (a key's first record adds it, its last one's removal releases it).
        self._by_key: dict[str, dict[int, set[str]]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0  # bytes queued entries pin (_enqueue)
        # Of those, what RAM has let go (evicted while its write waited): memory the
        # store's budget must still count (`pinned_bytes`), or the process holds more
        # than its cache budget says.
        self._orphaned_bytes = 0
        self._queued_keys: Counter = Counter()  # blocks of queued entries, by key
        self._reads: dict[str, asyncio.Future] = {}
        self._readers = ThreadPoolExecutor(RESTORE_THREADS, thread_name_prefix="kvroute-disk-read")
        # A restore's block files, several in flight: one reader at a time left a fast
        # drive's queue (and a many-core host's memory bandwidth) mostly idle. Threads
        # that live as long as the tier: each evaluates the arrays it reads (CUDA
        # streams belong to the thread that made them).
        self._block_readers = ThreadPoolExecutor(max(1, read_parallel),
                                                 thread_name_prefix="kvroute-disk-blocks")
        self._own_staging = pinned.Staging(pinned.OWN_BYTES, "records' own files")  # (CUDA)
        self._writer = threading.Thread(target=self._write_loop, name="kvroute-disk-write", daemon=True)
        self._lock_fd: int | None = None
        self._names = itertools.count()
        self._failing = False
        self.writable = True
        self._stuck: set[str] = set()  # damaged files that could not be removed: never read

    # -- start and stop --------------------------------------------------------

    def open(self) -> bool:
        """Claim and index the directory; False (tier off, warned) when unusable."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_fd = self._lock()
            try:
                os.chmod(self.directory, 0o700)  # entries are prompts' states: owner only
                probe = self.directory / ".probe"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:  # read-only: its whole files can still be served
                self._read_only(exc)
        except OSError as exc:
            log.warning("disk cache off: %s is unusable (%s); serving from RAM only",
                        self.directory, exc.strerror or exc)
            self.metrics.l(self.metrics.disk_enabled).set(0)
            return False
        try:
            self.blocks.open()
        except OSError as exc:  # a read-only folder without blocks/: records whole only
            log.debug("disk cache: no block folder (%s)", exc)
        if diskfile.on_cuda():
            self.blocks.staging.warm()
            self._own_staging.warm()
            if self.writable:
                self.blocks.writer.warm()
        # Each reader thread's first MLX work makes its stream (a thread's own, on a
        # GPU): done now, not in the first restore's time (an 8k-token 7B restore on an
        # H100: its own file 21 ms and its blocks 66 ms in a new process, 10 and 45-49
        # after).
        warm_threads(self._readers, RESTORE_THREADS)
        warm_threads(self._block_readers, self.read_parallel)
        self._index_directory()
        orphans = self.blocks.drop_unlisted()
        if orphans:
            log.info("disk cache: removed %d blocks no record lists (of records dropped or "
                     "removed, or an interrupted write)", orphans)
        self.enabled = True
        self.metrics.l(self.metrics.disk_enabled).set(1)
        self.metrics.l(self.metrics.disk_budget).set(self.budget_bytes)
        self._writer.start()
        self._enforce_budget(0)
        self._update_gauges()
        line, over = disk_space.describe(self.directory, self.budget_bytes, self.held_bytes)
        log.info("%s; %d entries, %d blocks", line, len(self.index), len(self.blocks.files))
        if over:
            log.warning("the disk tier's budget (%s) is more than %s can give (its free space "
                        "and what the tier holds): writes will fail once the drive is full; "
                        "lower --disk-cache-bytes", format_bytes(self.budget_bytes),
                        self.directory)
        return True

    def _lock(self) -> int:
        """The folder's lock: one backend per folder (read-only folders included)."""
        path = self.directory / ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not path.exists():
                raise
            fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OSError(errno.EBUSY, "another backend uses this directory")
        return fd

    def _read_only(self, exc: OSError) -> None:
        """The folder takes no writes (said once): reads go on, writes go to RAM only
        until one succeeds again (`_write` retries; `take` refuses meanwhile)."""
        reason = errno.errorcode.get(exc.errno or 0, "EIO")
        self.metrics.l(self.metrics.disk_write_failures, reason=reason).inc()
        self._failing = True
        if self.writable:
            self.writable = False
            log.warning("disk cache: %s is not writable (%s: %s); serving its files, "
                        "writes go to RAM only", self.directory, reason, exc.strerror or exc)

    def close(self, timeout: float = 10.0, write: bool = True) -> None:
        """Finish the writes already queued (up to `timeout`), then stop; with `write`
        False (the GPU is lost: every write would fail, after evicting records to make
        room for it) drop them instead."""
        if self.enabled:
            self._closing = True
            self._abandon = not write
            self._queue.put(None)
            self._writer.join(timeout)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._block_readers.shutdown(wait=False, cancel_futures=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.board is not None:
            self.board.close()

    def _index_directory(self) -> None:
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(diskfile.TMP_SUFFIX):
                self._drop(path, "partial", "an unfinished write")
            elif path.name.endswith(diskfile.SUFFIX):
                try:
                    record = diskfile.read_header(path, self.fingerprint)
                    mtime = path.stat().st_mtime
                except BadRecord as exc:
                    self._drop(path, exc.reason, str(exc))
                    continue
                except OSError as exc:  # gone or unreadable meanwhile
                    self._drop(path, "unreadable", str(exc))
                    continue
                found.append((mtime, record))
        for _, record in sorted(found, key=lambda f: f[0]):
            missing = self.blocks.missing(record.blocks)
            if missing:
                self._drop(self.directory / record.name, "partial",
                           f"{len(missing)} of its blocks are missing")
                continue
            self._add(record)

    def _drop(self, path: Path, reason: str, detail: str) -> None:
        """Forget a damaged file and remove it; one that cannot be removed is skipped
        for the rest of the process (never indexed, never read again)."""
        if path.name in self._stuck:
            return
        log.warning("disk cache: dropping %s (%s)", path.name, detail)
        self.metrics.l(self.metrics.disk_dropped, reason=reason).inc()
        self._unlink(path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._stuck.add(path.name)
            log.warning("disk cache: cannot remove %s (%s); skipping it", path.name,
                        exc.strerror or exc)
            if not self._folder_writable():
                self._read_only(exc)

    # -- the store's events (engine thread: only enqueue) ----------------------

    def on_store_event(self, event: Event) -> None:
        entry = event.entry
        if not self.enabled or entry is None:
            return
        if event.kind == "insert" and entry.part_of is not None:
            return  # a RAM prefix of an entry `take` queued whole
        if event.kind == "insert" and entry.id not in self._seen:
            self._seen.add(entry.id)
            # Its blocks and the rest of its state as they are now (eviction may cut the
            # entry before the writer's turn), evaluated: the writer thread evaluates
            # no graph of the engine's (on CUDA it records its own: the device checksum
            # and the copies it writes, diskfile.save).
            for_disk = entry.for_disk()
            with self.lock:
                item = self._enqueue("write", for_disk)
                if item is not None:
                    self._queued[entry.id] = item
            if item is None:
                # The disk cannot keep up: queued entries pin their arrays in memory.
                self.metrics.l(self.metrics.disk_writes, result="dropped").inc()
                return
            self._queue.put(item)
        elif event.kind == "evict" and event.reason == "trimmed":  # a cut entry's file stays whole
            with self.lock:  # its write still holds what RAM cut off
                self._orphan(self._queued.get(entry.id), event.nbytes)
        elif event.kind == "evict":
            # Gone from RAM: no more events for it (its file stays, unless superseded).
            self._seen.discard(entry.id)
            if event.reason == "superseded":
                self._superseded.add(entry.id)
                with self.lock:  # not written yet: let its arrays go now
                    item = self._queued.pop(entry.id, None)
                    if item is not None and item[1] is not None:
                        self._dequeue(item)
                self._queue.put(("drop", entry.id))
            else:
                self._by_entry.pop(entry.id, None)
                with self.lock:  # its write still holds its arrays
                    item = self._queued.get(entry.id)
                    dropped = item is not None and item[1] is not None and self._behind()
                    if dropped:
                        self._queued.pop(entry.id)
                        self._dequeue(item)
                    else:
                        self._orphan(item)
                if dropped:
                    self.metrics.l(self.metrics.disk_writes, result="dropped").inc()
        self._update_queue_gauge()

    def _behind(self) -> bool:
        """Whether the writes of entries RAM let go of hold `max_orphaned` (a quarter
        of the queue's bound, the RAM budget's size) already: RAM's budget counts them, so
        past that an evicted entry's write is dropped, as with no tier. Kept, they made
        RAM hold ever less while the writer was behind: on a CPU, agent turns on a
        small budget hit 0.24-0.58 of their tokens with the tier on, 0.70 with it off
        (tier lock held)."""
        return self._orphaned_bytes >= self.max_orphaned

    def _orphan(self, item: list | None, nbytes: int | None = None) -> None:
        """RAM let go of `nbytes` (all) of what queued `item` holds: counted in the
        RAM budget until written (tier lock held)."""
        if item is None or item[1] is None:
            return
        more = item[2] - item[4] if nbytes is None else min(nbytes, item[2] - item[4])
        item[4] += more
        self._orphaned_bytes += more

    def pinned_bytes(self) -> int:
        """Bytes queued writes keep in memory for entries RAM has evicted or cut back
        (the store counts them in its budget until they are written)."""
        return self._orphaned_bytes

    def take(self, entry: Entry) -> str:
        """Queue an entry the RAM budget cannot hold (engine thread: only enqueue).
        Returns "" when queued, else why not (a label of the refused-commit metric)."""
        if not self.enabled:
            return "no_disk_tier"
        if entry.nbytes > self.budget_bytes:
            return "over_disk_budget"
        if self._failing:
            return "disk_failing"
        with self.lock:
            if self._covered(entry):
                return ""  # e.g. a repeat restored from disk: its file is there already
            # Queued entries this one extends need no file of their own: dropping them
            # frees their arrays now, before the writer reaches them.
            for item in self._wholes:
                if item[1] is not None and _extends(entry, item[1]):
                    self._dequeue(item)
            item = self._enqueue("whole", entry, always=not self._pending_bytes)
            if item is None:
                self.metrics.l(self.metrics.disk_writes, result="dropped").inc()
                return "disk_queue_full"
            self._wholes.append(item)
        self._queue.put(item)
        self._update_queue_gauge()
        return ""

    def _enqueue(self, kind: str, entry: Entry, always: bool = False) -> list | None:
        """A queue item for `entry`, charged with the bytes queuing it pins beyond what
        is queued or on disk already: its own state, and the blocks that no queued
        entry or file holds yet; None when that would pass `queue_bytes` (tier lock
        held). Conversations on one system prompt share its blocks: each counted whole,
        a busy GPU's agent turns filled the queue and new commits were dropped."""
        keys = [b.key for b in entry.shared]
        new = sum(b.nbytes for b in entry.shared
                  if not self._queued_keys[b.key] and b.key not in self.blocks.files)
        charge = entry.nbytes - sum(b.nbytes for b in entry.shared) + new
        if not always and self._pending_bytes + charge > self.queue_bytes:
            return None
        self._queued_keys.update(keys)
        self._pending_bytes += charge
        return [kind, entry, charge, keys, 0]  # 0: of its bytes, none only it holds (_orphan)

    def _dequeue(self, item: list) -> None:
        """`item` leaves the queue: written, superseded or replaced (tier lock held)."""
        self._pending_bytes -= item[2]
        self._orphaned_bytes -= item[4]
        item[4] = 0
        self._queued_keys.subtract(item[3])
        for key in item[3]:
            if self._queued_keys[key] <= 0:
                del self._queued_keys[key]
        item[1] = None

    def _covered(self, entry: Entry) -> bool:
        """Whether a file or a queued entry holds all of `entry` and serves what it
        serves."""
        return self._covered_on_disk(entry) or any(
            item[1] is not None and _holds(item[1], entry) for item in self._wholes)

    def _covered_on_disk(self, entry: Entry) -> bool:
        """Whether a file holds all of `entry` (refreshed in LRU order if so)."""
        for name, record in self.index.items():
            if _holds(record, entry):
                self.index.move_to_end(name)
                return True
        return False

    # -- the writer thread -----------------------------------------------------

    def _write_loop(self) -> None:
        # Entries to write and files to drop wait in `_deferred`, in order, for an idle
        # engine; an entry over the RAM budget ("whole") is written at once: RAM does not
        # hold it, and its bytes would otherwise fill the queue and refuse later ones.
        while True:
            try:
                item = self._queue.get(timeout=POLL if self._deferred else None)
            except queue.Empty:
                item = ()
            if item is None:  # closing: what waits is written now (or dropped: _write)
                while self._deferred:
                    self._handle(self._deferred.popleft())
                return
            if item and item[0] == "whole":
                self._handle(item)
            elif item:
                self._deferred.append(item)
            self._note_idle()
            while self._deferred and self._due(self._deferred[0]):
                self._handle(self._deferred.popleft())
            # A write whose entry RAM let go holds memory RAM's budget counts: it does
            # not wait behind writes that wait for an idle engine (under load that never
            # pauses, for `max_delay`), which made RAM keep ever less meanwhile.
            for item in self._orphans():
                self._deferred.remove(item)
                self._handle(item)
            self._update_queue_gauge()

    def _waiting(self) -> int:
        """Items not on disk yet: queued, deferred for an idle engine, being written."""
        return self._queue.qsize() + len(self._deferred) + self._writing

    def _update_queue_gauge(self) -> None:
        self.metrics.l(self.metrics.disk_queue).set(self._waiting())

    def _handle(self, item: Any) -> None:
        kind, payload = item[0], item[1]
        self._writing = 1
        try:
            if kind == "write":
                self._write_queued(item)
            elif kind == "whole":
                self._write_whole(item)
            else:
                self._superseded.discard(payload)
                name = self._by_entry.pop(payload, None)
                if name is not None:
                    self._remove(name)
        except Exception:  # a bug here must not stop later writes
            log.exception("disk cache: write-behind error")
        finally:
            self._writing = 0

    def _working(self) -> bool:
        """This backend's engine or a sibling's has work, or a restore is being read."""
        return (self.busy() or self._restoring > 0
                or (self.board is not None and self.board.others_busy()))

    def _restored(self, _: Any) -> None:
        with self.lock:  # reads begun by `read_early` end on a reader thread
            self._restoring -= 1

    def _note_idle(self) -> None:
        if self._working():
            self._idle_from = None
        elif self._idle_from is None:
            self._idle_from = time.monotonic()

    def _due(self, item: Any) -> bool:
        """Whether the oldest waiting item goes now: the engine has been idle
        `idle_wait` seconds, its entry waited `max_delay` since its commit, was
        superseded meanwhile (nothing to write) or evicted or cut back in RAM (its
        write is all that holds that memory, which the RAM budget counts until then),
        or the tier is closing."""
        if item[0] != "write" or item[1] is None or item[4] or self._closing:
            return True
        if time.time() - item[1].created >= self.max_delay:
            return True
        return self._rested()

    def _orphans(self) -> list:
        """The waiting writes that hold an entry RAM let go of."""
        return [it for it in list(self._deferred) if it[0] == "write" and it[4]]

    def _rested(self) -> bool:
        """The engines were idle `idle_wait` seconds when `_note_idle` last looked."""
        return self._idle_from is not None and time.monotonic() - self._idle_from >= self.idle_wait

    def _write_queued(self, item: list) -> None:
        with self.lock:
            entry = item[1]
            if entry is None:  # superseded while it waited
                return
            self._queued.pop(entry.id, None)
            if self._covered_on_disk(entry):  # a later turn, written out of order, holds it
                self._dequeue(item)
                return
            evicted, item[4] = item[4], 0  # its bytes stay counted until written
            self._dequeue(item)
        try:
            self._write(entry, urgent=bool(evicted))
        finally:
            if evicted:
                with self.lock:
                    self._orphaned_bytes -= evicted

    def _write_whole(self, item: list) -> None:
        with self.lock:
            entry = item[1]
            self._wholes.remove(item)
            if entry is None:  # a later entry that extends it was queued
                return
            self._dequeue(item)
        self._write(entry)

    def _write(self, entry: Entry, urgent: bool = False) -> bool:
        """Write `entry` as a record (its new blocks first); the records it extends are
        removed once it is in place: a restored conversation's next turn, or a whole
        entry, replaces the file it grew from (their chain keys become its own). An
        `urgent` write (RAM evicted its entry) does not wait for the engine to rest
        between its files, only keeps its pace."""
        if entry.nbytes > self.budget_bytes or self._abandon:
            return False
        with self.lock:
            extended = [r for r in self.index.values() if _extends(entry, r)]
            # What the write adds: its own bytes and blocks not on disk yet, less the
            # records it replaces (the budget counts each block once).
            new = {b.key: b.nbytes for b in entry.shared if b.key not in self.blocks.files}
        incoming = (entry.nbytes - sum(b.nbytes for b in entry.shared) + sum(new.values())
                    - sum(r.size for r in extended))
        chain = list(dict.fromkeys([*entry.chain, *(k for r in extended for k in r.chain)]))
        self._enforce_budget(max(0, incoming))
        meta = {
            "version": diskfile.FORMAT_VERSION, "fingerprint": self.fingerprint,
            "model": entry.model, "tokens": entry.tokens.tolist(), "scope": entry.scope,
            "chain": chain, "trimmable": entry.trimmable,
            "exit_path": entry.exit_path, "created": entry.created,
            "blocks": [f"{b.key:016x}" for b in entry.shared],
        }
        stem = f"{time.time_ns():x}-{os.getpid()}-{next(self._names)}"
        keys = [b.key for b in entry.shared]
        held = False
        try:
            if shutil.disk_usage(self.directory).free < entry.nbytes:
                raise OSError(errno.ENOSPC, "no space left on the device")
            self._hold_left = self.max_delay
            held = self._write_blocks(entry.shared, 0.0 if urgent else entry.created + self.max_delay)
            name, size = diskfile.write(self.directory, stem, entry.cache, meta, self.fsync,
                                        self.blocks.writer, self._needs_device_sum)
        except (OSError, RuntimeError) as exc:  # MLX reports a failed write as RuntimeError
            if held:
                with self.lock:
                    self.blocks.release(keys)
            code = exc.errno if isinstance(exc, OSError) else _probe_errno(self.directory)
            reason = errno.errorcode.get(code or 0, "EIO")
            if not self._failing:
                log.warning("disk cache: writing failed (%s: %s); serving from RAM until writes "
                            "succeed again", reason, getattr(exc, "strerror", None) or exc)
            self._failing = True
            if code in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
            self.metrics.l(self.metrics.disk_writes, result="failed").inc()
            self.metrics.l(self.metrics.disk_write_failures, reason=reason).inc()
            return False
        if self._failing:
            log.info("disk cache: writes succeed again")
            self._failing = False
            self.writable = True
        record = Record(name, entry.tokens, entry.scope, chain, entry.trimmable,
                        entry.exit_path, size, 0, "", entry.created, entry.model, blocks=keys)
        with self.lock:
            self._add(record, blocks_held=True)
            # Still in RAM, or superseded while it was being written (its "drop" is
            # queued behind this write): the supersede removes the file.
            if entry.id in self._seen or entry.id in self._superseded:
                self._by_entry[entry.id] = name
        self.metrics.l(self.metrics.disk_writes, result="ok").inc()
        for old in extended:  # after the file that holds their tokens is in place
            self._remove(old.name)
        self._enforce_budget(0)
        self._update_gauges()
        return True

    def _give_way(self, deadline: float) -> None:
        """Between two files of a write: while the engine has work, wait until it has
        been idle `idle_wait` again (or the entry's `max_delay` is over, or the tier
        closes). A 32k-token conversation is ~1,000 block files, seconds of writing:
        a request arriving meanwhile would share the device, the memory bus and the
        GIL with all of it (measured on an H200: the next cold prompt 1.23x slower,
        8-stream decode 0.77x). Past `max_delay` under load that never pauses, the
        write goes on at a pace: after each file, a wait `PACE` times as long as the
        file took, so the writer holds at most 1 / (1 + PACE) of the time."""
        now = time.monotonic()
        spent, self._file_from = now - self._file_from, now
        self._note_idle()
        if self._idle_from is None:  # work arrived while the file was written
            self._wait_rested(deadline, spent)
        self._file_from = time.monotonic()

    def _wait_rested(self, deadline: float, spent: float) -> None:
        while not self._closing:
            # A write RAM let go of waits behind this one: its memory waits on it too.
            if time.time() >= deadline or self._orphans():
                if self._idle_from is None:  # still working: a paced write
                    wait = min(PACE * spent, MAX_PACE_WAIT)
                    time.sleep(wait)
                    self.metrics.l(self.metrics.disk_paced).inc(wait + self._hold_off())
                return
            time.sleep(POLL)
            self._note_idle()
            if self._rested():
                return

    def _hold_off(self) -> float:
        """Wait while the engine or a sibling backend's (busy.py) has a prompt to
        prefill or a restore is read (its prompt's first step), `max_delay` in all at
        most over the whole write (then it only keeps its pace: a load that always
        has a prompt waiting would otherwise hold it for good; a bound from the
        write's start instead let a long paced write, a 31k-token conversation's
        ~1,000 files, run beside every prompt after its first 30 s); the seconds waited.
        A paced write's files took the device, the bus and the GIL from the prompt
        beside them (a sibling's share the device and the bus): on an H100 a cached
        31k-token second turn, the first after the commit whose evictions made such
        writes, took 1.29x as long as with the tier off. The memory they hold stays
        bounded meanwhile: the store fits RAM to what waits (`Store._enforce_budget`)."""
        t0 = time.monotonic()
        while (self._prompt_waits() and not self._closing
               and time.monotonic() - t0 < self._hold_left):
            time.sleep(POLL)
        waited = time.monotonic() - t0
        self._hold_left -= waited
        return waited

    def _prompt_waits(self) -> bool:
        return (self.prefilling() or self._restoring > 0
                or (self.board is not None and self.board.others_prefilling()))

    def _write_blocks(self, blocks: list[Block], deadline: float) -> bool:
        """Write the blocks not on disk yet (a block already there is not written again)
        and count the record's use of all of them before its file exists, so no
        eviction meanwhile removes one it lists. True when counted."""
        new = list({b.key: b for b in blocks if b.key not in self.blocks.files}.values())
        if new:
            if time.time() >= deadline:  # paced from its first file
                self.metrics.l(self.metrics.disk_paced).inc(self._hold_off())
            self._file_from = time.monotonic()
            self.blocks.write(new, lambda: self._give_way(deadline))
        with self.lock:
            if not self.blocks.hold([b.key for b in blocks]):
                raise OSError(errno.ENOENT, "a block went missing while its record was written")
        return True

    def _add(self, record: Record, blocks_held: bool = False) -> None:
        with self.lock:
            if not blocks_held:
                self.blocks.hold(record.blocks)
            self.index[record.name] = record
            self.nbytes += record.size
            by_key = self._by_key.setdefault(record.model, {})
            added = [k for k in dict.fromkeys(record.chain) if k not in by_key]
            for k in record.chain:
                by_key.setdefault(k, set()).add(record.name)
            self._emit(DiskEvent("insert", record.model, added))

    def _remove(self, name: str, unlink: bool = True) -> None:
        with self.lock:
            record = self.index.pop(name, None)
            if record is None:
                return
            self.nbytes -= record.size
            self.blocks.release(record.blocks)
            by_key = self._by_key.get(record.model, {})
            released = []
            for k in dict.fromkeys(record.chain):
                names = by_key.get(k, set())
                names.discard(name)
                if not names and by_key.pop(k, None) is not None:
                    released.append(k)
            self._emit(DiskEvent("evict", record.model, released))
        if unlink:
            self._unlink(self.directory / name)
        self._update_gauges()

    @property
    def held_bytes(self) -> int:
        """Its records' files and their shared blocks, each block once."""
        return self.nbytes + self.blocks.nbytes

    def _enforce_budget(self, incoming: int) -> None:
        while self.index and self.held_bytes + incoming > self.budget_bytes:
            self._remove(next(iter(self.index)))
            self.metrics.l(self.metrics.disk_evictions).inc()

    def _emit(self, event: DiskEvent) -> None:
        if event.keys:
            for listener in self.listeners:
                listener(event)

    # -- lookup and restore (event loop) ---------------------------------------

    def best(self, model: str, prompt: np.ndarray, scope: str | None,
             above: int = 0) -> tuple[int, Record | None]:
        """The record serving the longest usable prefix (as `Store.lookup` rules), of
        those that could serve more than `above` tokens (what RAM serves already): the
        others are not compared, which on a cached turn is nearly every record."""
        found: tuple[int, Record | None] = (0, None)
        with self.lock:
            for record in self.index.values():
                if len(record.tokens) <= max(above, found[0]):
                    continue
                n = usable_prefix(record, model, scope, prompt)
                if n > found[0]:
                    found = (n, record)
        return found

    def read_early(self, model: str, chain: list[int], ram_holds: Callable[[list[int]], bool],
                   prefill_tps: float = 0.0) -> Early | None:
        """Begin reading the record a request's prefix keys find, before its tokens are
        known (the handler's thread, while the chat template renders and tokenizes:
        on an H100 ~11 ms of a restored 8k-token turn went there before its read
        began). Only a record that holds nothing the request does not share (each of
        its keys is one of the request's), the deepest, read whole; not where RAM is
        advertised by a key as deep, so a cached turn never reads the disk. `prefetch`
        takes it over when the tokens choose the same read; else it goes unused."""
        if not self.enabled or not chain:
            return None
        with self.lock:
            found = self._deepest(model, chain)
        if found is None:
            return None
        depth, record = found
        blocks = len(record.blocks)
        if ram_holds(chain[depth:]) or not self._worth_reading(record, blocks,
                                                              len(record.tokens), prefill_tps):
            return None
        with self.lock:
            self._restoring += 1
        future = self._readers.submit(self._load, record, blocks)
        future.add_done_callback(self._restored)
        return Early((record.name, blocks), future)

    def _deepest(self, model: str, chain: list[int]) -> tuple[int, Record] | None:
        """(depth in `chain`, record) of the record found by the deepest of `chain`'s
        keys whose own keys are all in `chain` (the longest, of several)."""
        keys, by_key = set(chain), self._by_key.get(model, {})
        for depth in range(len(chain) - 1, -1, -1):
            records = [self.index[name] for name in by_key.get(chain[depth], ())]
            fits = [r for r in records if keys.issuperset(r.chain)]
            if fits:
                return depth, max(fits, key=lambda r: len(r.tokens))
        return None

    def _worth_reading(self, record: Record, blocks: int, tokens: int, prefill_tps: float) -> bool:
        """Whether reading `record`'s first `blocks` beats prefilling `tokens` at the
        measured prefill rate (unknown: it does)."""
        return not prefill_tps or tokens / prefill_tps >= RESTORE_OVERHEAD + (
            self._read_bytes(record, blocks) / (self.restore_bps or RESTORE_PRIOR_BPS))

    async def prefetch(self, model: str, prompt: list[int], scope: str | None,
                       ram_depth: Callable[[], int], prefill_tps: float = 0.0,
                       early: Early | None = None, found: Found | None = None) -> Restored | None:
        """A state from disk for `prompt` when the disk serves more of it than RAM and
        reading it is faster than prefilling the difference (both rates measured: on a
        fast accelerator a prefill can beat the disk); from `early`'s read where it is
        the same; `found`, `find`'s answer where the caller's thread asked it already.
        Never raises: a file that fails to load is dropped and the request goes on."""
        try:
            return await self._prefetch(model, prompt, scope, ram_depth, prefill_tps, early, found)
        finally:
            if early is not None:
                self.let_go(early)

    def find(self, model: str, prompt: list[int], scope: str | None,
             ram_depth: Callable[[], int]) -> Found:
        """The record serving more of `prompt` than RAM does, if any (`best`), and RAM's
        depth: off the event loop (converting a long prompt takes 0.5 ms at 31k tokens,
        and comparing it with the records a while). A request's handler asks it in the
        thread that made its tokens: a second hop to a worker thread cost a cached turn
        ~1 ms more before its engine, and up to 4 on two busy cores."""
        if not self.enabled:
            return (0, None), 0
        ram = ram_depth()
        return self.best(model, np.asarray(prompt, dtype=np.int32), scope, above=ram), ram

    def let_go(self, early: Early) -> None:
        """Its request is done with `early`: counted, and stopped where it went unused
        and has not begun."""
        if not early.used:
            early.future.cancel()
        self.metrics.l(self.metrics.disk_early_reads, used="yes" if early.used else "no").inc()

    async def _prefetch(self, model: str, prompt: list[int], scope: str | None,
                        ram_depth: Callable[[], int], prefill_tps: float,
                        early: Early | None, found: Found | None) -> Restored | None:
        if not self.enabled:
            return None
        if found is None:
            found = await asyncio.to_thread(self.find, model, prompt, scope, ram_depth)
        (n, record), ram = found
        if record is None or n <= ram:
            return None
        blocks = _blocks_for(record, n)
        if not self._worth_reading(record, blocks, n - ram, prefill_tps):
            self.metrics.l(self.metrics.disk_skipped).inc()
            return None
        key = (record.name, blocks)
        fut = self._reads.get(key)
        if fut is None:
            if early is not None and early.key == key:
                early.used = True  # counted as restoring when it began
                fut = asyncio.wrap_future(early.future)
            else:
                fut = asyncio.get_running_loop().run_in_executor(self._readers, self._load,
                                                                 record, blocks)
                # A restore is the engine's work before it reaches the engine: the
                # writer gives way to it as to a running request (the two shared the
                # page cache, the bus and the GIL).
                with self.lock:
                    self._restoring += 1
                fut.add_done_callback(self._restored)
            self._reads[key] = fut
            fut.add_done_callback(lambda _: self._reads.pop(key, None))
        state = await asyncio.shield(fut)  # one client leaving never cancels a shared read
        if state is None or state.tokens < n:
            return None
        return Restored(n, state, state.tokens)

    def _read_bytes(self, record: Record, blocks: int) -> int:
        """Bytes a restore of `record`'s first `blocks` blocks reads: its own file, and
        those blocks but for any RAM or a restored state holds already."""
        return self._file_bytes(record, [k for k in record.blocks[:blocks]
                                         if k not in self.blocks.loaded and self.blocks.in_ram(k) is None])

    def _file_bytes(self, record: Record, keys: list[int]) -> int:
        """The sizes of `record`'s own file and of the block files of `keys`."""
        with self.lock:
            files = [self.blocks.files.get(k) for k in keys]
        return record.size + sum(f.size for f in files if f is not None)

    def _load(self, record: Record, blocks: int | None = None) -> Paged | None:
        path = self.directory / record.name
        t0, blocks_read = time.perf_counter(), self.blocks.read_bytes
        try:
            header = 0.0
            if record.data_offset == 0:  # written by this process: read its header now
                record, header = _timed(self._with_header, record, path)
            state, phases = self._state(record, path, len(record.blocks) if blocks is None else blocks)
            if header:
                phases["header"] = header
        except BadRecord as exc:
            self._remove(record.name, unlink=False)
            self._drop(path, exc.reason, str(exc))
            return None
        except Exception as exc:  # e.g. a cache class this mlx-lm does not know
            if self._closing:  # its readers are shut down: nothing is wrong with the file
                return None
            if device_trouble(exc):  # no memory for it now, a lost GPU: the file is fine
                log.warning("disk cache: could not restore %s now (%s); prefilling instead",
                            record.name, exc)
                return None
            self._remove(record.name, unlink=False)
            self._drop(path, "unloadable", repr(exc))
            return None
        seconds = time.perf_counter() - t0
        read = record.size + self.blocks.read_bytes - blocks_read  # blocks held already: not read
        rate = read / max(seconds, 1e-6)
        log.info("disk cache: restored %d tokens of %s: %.0f MB in %.1f ms (%.1f GB/s; %s)",
                 state.tokens, record.name, read / 1e6, seconds * 1e3, rate / 1e9,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
        self.restore_bps = rate if not self.restore_bps else 0.7 * self.restore_bps + 0.3 * rate
        # Tokens' worth of what was read (the proxies weigh a restore by its tokens).
        files = self._file_bytes(record, [b.key for b in state.blocks])
        tps = state.tokens * read / max(files, 1) / max(seconds, 1e-6)
        self.restore_tps = tps if not self.restore_tps else 0.7 * self.restore_tps + 0.3 * tps
        m = self.metrics
        m.l(m.disk_restore_seconds).observe(seconds)
        m.l(m.disk_restore_bytes).inc(read)
        m.l(m.disk_restore_bps).set(self.restore_bps)
        with self.lock:
            if record.name in self.index:
                self.index.move_to_end(record.name)
                self.index[record.name].hits += 1
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        return state

    def _state(self, record: Record, path: Path, blocks: int) -> tuple[Paged, dict[str, float]]:
        """A record's layers (its own file) and its first `blocks` shared blocks as one
        state (reader thread): all of them, or, for a hit that shares less of it, those
        that hold its tokens. Its block list must be the chain of its own tokens: a
        header that lists other blocks is as damaged as a flipped token id. Read whole,
        its own file loads on a block reader beside its blocks (an 8k-token 7B record:
        ~8 ms on an H100 that the blocks' load now hides)."""
        # Where a restore's time went (its log line): an operator's first question
        # when a restore is slower than the read rate says it should be.
        phases: dict[str, float] = {}
        t = time.perf_counter()
        root = paged.root_key(record.model, record.scope)
        if record.blocks != paged.block_keys(root, record.tokens, len(record.blocks)):
            raise BadRecord("corrupt", "its blocks are not the chain of its tokens")
        phases["chain"] = time.perf_counter() - t
        t = time.perf_counter()
        if blocks >= len(record.blocks) and record.blocks:
            own = self._block_readers.submit(_timed, self._own, path, record)
            try:
                loaded = self._load_blocks(record.blocks)
            except BaseException:
                # A block's failure first: a damaged block is already deleted, and the
                # record listing it must go too, whatever its own file met.
                wait([own])
                raise
            phases["blocks"] = time.perf_counter() - t
            t = time.perf_counter()
            cache, phases["own file"] = own.result()
            phases["own file waited"] = time.perf_counter() - t
            head = False
        else:
            cache, phases["own file"] = _timed(self._own, path, record)
            head = blocks < len(record.blocks) and not paged.keeps_whole(cache)
            loaded, phases["blocks"] = _timed(self._load_blocks,
                                              record.blocks[:blocks] if head else record.blocks)
        t = time.perf_counter()
        try:
            state = paged.from_disk(cache, loaded, len(record.tokens), head=head)
        except ValueError as exc:
            raise BadRecord("corrupt", str(exc))
        # Its tail is sliced here: evaluated on this thread, whose streams (on CUDA) the
        # engine thread cannot run.
        mx.eval([x for pair in state.tail for x in pair])
        phases["assembly"] = time.perf_counter() - t
        phases |= self.blocks.staging.timing()
        return state, phases

    def _needs_device_sum(self, nbytes: int) -> bool:
        """Whether a record of `nbytes` of tensors needs a device checksum: not where
        its restore goes through pinned memory (its xxh3 checked where it lands), as
        block files do not; a file larger than that buffer's half goes by MLX's reader."""
        return not (self._own_staging.works() and self._own_staging.fits(nbytes + HEADER_ROOM))

    def _own(self, path: Path, record: Record) -> list[Any]:
        """A record's own file (its layers but the blocks), checked: through pinned
        memory where it can go, else by `diskfile.load`."""
        cache = self._own_pinned(path, record)
        return cache if cache is not None else diskfile.load(path, record, self.read_parallel)

    def _own_pinned(self, path: Path, record: Record) -> list[Any] | None:
        """A record's own file on CUDA through a pinned buffer of its own, beside the
        blocks' (one restore's blocks hold theirs): read once on this thread, checked
        where it lands, copied by the staging kernel. Through MLX's reader and a device
        checksum, an 8k-token 7B conversation's own file (its last part-block: 56
        arrays of 1 KB) took 34 ms on an H100. None where this path does not work here
        or cannot take the file: the caller loads it another way."""
        staging = self._own_staging
        if not (diskfile.on_cuda() and staging.works() and staging.fits(record.size)
                and diskfile.has_sums(path.name)):
            return None
        metadata: dict = {}

        def fill(f: pinned.File, view: memoryview) -> tuple[dict, int]:
            header, meta, offset = diskfile.read_checked_into(f.path, view)
            metadata.update(meta)
            return header, offset

        (arrays,) = staging.load_or_none([pinned.File(path, record.size)], None, fill) or [None]
        return None if arrays is None else diskfile.from_arrays(arrays, metadata)

    def _load_blocks(self, keys: list[int]) -> list[Block]:
        return self.blocks.load_all(keys, lambda key, kv, size: Block(key, kv, size),
                                    self._block_readers)

    def _folder_writable(self) -> bool:
        probe = self.directory / ".probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError:
            return False

    def _with_header(self, record: Record, path: Path) -> Record:
        fresh = diskfile.read_header(path, self.fingerprint)
        with self.lock:
            if record.name in self.index:
                self.index[record.name] = fresh
        return fresh

    # -- views -----------------------------------------------------------------

    def snapshot(self) -> dict[str, list[list[int]]]:
        """model -> chains of every record: what the publisher advertises as disk."""
        out: dict[str, list[list[int]]] = {}
        with self.lock:
            for record in self.index.values():
                if record.chain:
                    out.setdefault(record.model, []).append(list(record.chain))
        return out

    def stats(self) -> dict:
        return {
            "enabled": self.enabled,
            "writable": self.writable,
            "skipped_files": len(self._stuck),
            "directory": str(self.directory),
            "entries": len(self.index),
            "bytes": self.held_bytes,
            **self.blocks.stats(),
            "budget_bytes": self.budget_bytes,
            "write_queue": self._waiting(),
            "write_queue_bytes": self._pending_bytes,  # what queued writes keep in memory
            "write_queue_evicted_bytes": self._orphaned_bytes,  # of it, what RAM let go
            "fsync": "always" if self.fsync else "never",
            "restore_bytes_per_s": round(self.restore_bps),
            "restore_tokens_per_s": round(self.restore_tps),
        }

    def _update_gauges(self) -> None:
        m = self.metrics
        m.l(m.disk_bytes).set(self.held_bytes)
        m.l(m.cache_blocks, tier="disk").set(len(self.blocks.files))
        m.l(m.disk_entries).set(len(self.index))


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def _blocks_for(record: Record, n: int) -> int:
    """The record's blocks a hit on its first `n` tokens needs: those that hold them
    where the record can be cut there (all of them where `n` reaches its tail)."""
    if n < len(record.tokens) and record.trimmable:
        need = -(-n // paged.BLOCK_TOKENS)
        if need <= len(record.blocks):
            return need
    return len(record.blocks)


def _holds(old: Any, entry: Entry) -> bool:
    """Whether `old` (a record or an entry) holds all of `entry` and serves what it serves."""
    if old.model != entry.model or old.scope != entry.scope:
        return False
    if len(old.tokens) > len(entry.tokens) and not old.trimmable:
        return False
    return common_prefix(entry.tokens, old.tokens) == len(entry.tokens)


def _extends(entry: Entry, old: Any) -> bool:
    """Whether `entry` serves every prompt `old` (an entry or a record) serves."""
    return (entry.trimmable and old.model == entry.model and old.scope == entry.scope
            and len(old.tokens) <= len(entry.tokens)
            and common_prefix(old.tokens, entry.tokens) == len(old.tokens))


def _probe_errno(directory: Path) -> int:
    """Why writing into `directory` fails now (MLX's errors carry no errno)."""
    try:
        with open(directory / ".probe", "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        return errno.EIO
    except OSError as exc:
        return exc.errno or errno.EIO
    finally:
        try:
            (directory / ".probe").unlink(missing_ok=True)
        except OSError:
            pass


def _first_eval() -> None:
    mx.eval(mx.zeros((1,), dtype=mx.uint32) + 1)


def warm_threads(pool: ThreadPoolExecutor, n: int, timeout: float = 30.0) -> int:
    """A first MLX evaluation (`_first_eval`) once on each of the pool's `n` threads,
    started now; the number of threads it ran on. Each waits for the others before it returns,
    so no thread takes two (the pool starts a thread per task while none is idle). A
    failure is logged: the restore that finds a cold thread pays its start, no more."""
    barrier = threading.Barrier(n)

    def one() -> int:
        try:
            _first_eval()
        except Exception as exc:
            log.debug("disk cache: a reader's warm-up failed (%r)", exc)
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            pass
        return threading.get_ident()

    try:
        futures = [pool.submit(one) for _ in range(n)]
    except RuntimeError:  # shut down already
        barrier.abort()
        return 0
    done, _ = wait(futures, timeout)
    return len({f.result() for f in done})


def restore_readers() -> int:
    """Block files in flight on a restore: one per core up to 16 (page-cache reads of a
    7B 8k-token restore on a 16-core H200 host: 2.8 GB/s with one, 8.8 with 16). On
    CUDA, 8: the files go into pinned memory (pinned.py), which 8 readers fill at
    ~20 GB/s on an H100 host, 4 at ~15 (16 no faster); a file that goes through MLX's
    reader instead gains nothing past 4 (0.100 s with 4, 0.107-0.109 with 8 or 16). A
    record read whole loads its own file on one of them, beside its blocks."""
    return 8 if diskfile.on_cuda() else min(16, max(4, os.cpu_count() or 4))


def open_disk_tier(model: str, directory: str, budget_bytes: int, ram_budget: int,
                   store: Any, metrics: Any, fsync: bool = True) -> DiskTier | None:
    """The disk tier of a backend, listening to its store; None when not configured
    or unusable (then the backend serves from RAM only)."""
    if not directory or budget_bytes <= 0:
        metrics.l(metrics.disk_enabled).set(0)
        return None
    from mlx_lm.utils import _download  # the local folder `load` read (a repo id's snapshot)

    fp = diskfile.fingerprint(_download(model))
    # Entries waiting for the writer pin their arrays: at most a RAM budget's worth.
    tier = DiskTier(directory, budget_bytes, fp, metrics, queue_bytes=max(ram_budget, 1 << 20),
                    read_parallel=restore_readers(), fsync=fsync)
    if not tier.open():
        return None
    tier.board = BusyBoard.beside(tier.directory)
    store.listeners.append(tier.on_store_event)
    store.overflow = tier.take
    store.pinned = tier.pinned_bytes
    tier.blocks.in_ram = store.pool.blocks.get
    store.pool.restored = tier.blocks.restored
    return tier
