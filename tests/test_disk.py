"""The disk tier in process: real mlx-lm caches, real files, the real store."""

import asyncio
import logging
import os
import stat
import subprocess
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from tests.harness import small_tmpfs, wait_until
from mlx_lm.models.cache import RotatingKVCache

from kvroute.backend import diskfile
from kvroute.backend.disk import DiskTier
from kvroute.backend.metrics import BackendMetrics
from kvroute.backend.store import Store, held_tokens
from tests.test_store import make_cache as lazy_cache
from tests.test_store import tokens

FP = "f" * 32


def make_cache(n: int, **kw) -> list:
    cache = lazy_cache(n, **kw)
    mx.eval([c.state for c in cache])  # as the engine commits them
    return cache


def make_tier(path: Path, budget: int = 1 << 30, fingerprint: str = FP) -> tuple[DiskTier, BackendMetrics]:
    metrics = BackendMetrics("m", "b")
    tier = DiskTier(path, budget, fingerprint, metrics, queue_bytes=1 << 30)
    assert tier.open()
    return tier, metrics


def attach(tier: DiskTier) -> Store:
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    return store


def metric(metrics: BackendMetrics, counter, **labels) -> float:
    return counter.labels(model="m", backend="b", **labels)._value.get()


def restore(tier: DiskTier, prompt: list[int], scope=None):
    return asyncio.run(tier.prefetch("m", prompt, scope, lambda: 0))


def same_state(a: list, b: list) -> bool:
    for x, y in zip(a, b):
        for u, v in zip(x.state, y.state):
            if isinstance(u, mx.array) and not mx.array_equal(u, v).item():
                return False
    return len(a) == len(b)


@pytest.fixture(params=["host", "cuda", "pinned"])
def read_path(request, monkeypatch):
    """As on a CPU or a Mac, as on CUDA (the checked file loaded again by MLX's
    reader, into device memory there), and as on CUDA with pinned memory (block files
    through pinned.py, its CUDA parts stood in for by test_pinned.HostStaging), the
    latter two run on this CPU."""
    if request.param != "host":
        monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    if request.param == "pinned":
        from kvroute.backend import pinned
        from tests.test_pinned import HostStaging

        monkeypatch.setattr(pinned, "Staging", HostStaging)
    return request.param


def test_write_behind_restart_and_restore(tmp_path, read_path):
    tier, _ = make_tier(tmp_path)
    store = attach(tier)
    cache = make_cache(10)
    store.insert("m", tokens(10), cache, "checkpoint", chain=[1, 2, 3], scope="team-a")
    wait_until(lambda: len(tier.index) == 1, 30, what="the write-behind")
    tier.close()
    files = list(tmp_path.glob("*" + diskfile.SUFFIX))
    assert len(files) == 1
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700

    again, _ = make_tier(tmp_path)  # a restart: indexed from headers
    (record,) = again.index.values()
    assert record.tokens.tolist() == tokens(10)
    assert (record.scope, record.chain) == ("team-a", [1, 2, 3])
    assert again.snapshot() == {"m": [[1, 2, 3]]}
    assert restore(again, tokens(12)) is None  # another scope's entry never serves
    found = restore(again, tokens(12), "team-a")
    assert found.tokens == 10 and same_state(found.cache, cache)
    hit = restore(again, tokens(6) + [99], "team-a").hit()  # trimmed to the shared prefix
    assert hit.tokens == 6 and held_tokens(hit.cache) == 6


def test_untrimmable_state_round_trips(tmp_path):
    tier, _ = make_tier(tmp_path)
    store = attach(tier)
    mx.random.seed(1)
    cache = [RotatingKVCache(max_size=4) for _ in range(2)]
    for c in cache:
        k = mx.random.normal((1, 2, 7, 8))
        c.update_and_fetch(k, -k)
    mx.eval([c.state for c in cache])
    store.insert("m", tokens(7), cache, "checkpoint", chain=[5])
    wait_until(lambda: len(tier.index) == 1, 30, what="the write-behind")
    (record,) = tier.index.values()
    assert not record.trimmable
    assert restore(tier, tokens(5) + [99]) is None  # a rotated window serves extensions only
    found = restore(tier, tokens(9))
    assert found.tokens == 7 and same_state(found.cache, cache)
    assert [c.offset for c in found.cache] == [7, 7]


def test_eviction_keeps_the_file_supersede_replaces_it(tmp_path):
    tier, _ = make_tier(tmp_path)
    store = Store(budget_bytes=sum(c.nbytes for c in make_cache(12)) + 1)  # one entry
    store.listeners.append(tier.on_store_event)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    store.insert("m", tokens(10, 100), make_cache(10), "finish", chain=[2])  # evicts the first
    assert len(store) == 1
    wait_until(lambda: len(tier.index) == 2, 30, what="both written")
    assert restore(tier, tokens(11)).tokens == 10
    store.insert("m", tokens(12, 100), make_cache(12), "finish", chain=[2, 3])  # supersedes
    wait_until(lambda: sorted(len(r.tokens) for r in tier.index.values()) == [10, 12], 30,
               what="the superseded file replaced")
    assert len(list(tmp_path.glob("*" + diskfile.SUFFIX))) == 2


def test_writes_wait_for_an_idle_engine_and_skip_superseded_turns(tmp_path):
    """While the engine is busy nothing is written (a write beside a batch slows it);
    a conversation's turns committed meanwhile end as one file, its last."""
    tier, metrics = make_tier(tmp_path)
    busy = [True]
    tier.busy = lambda: busy[0]
    store = attach(tier)
    for n in (10, 12, 14):  # three turns of one conversation, each extending the last
        store.insert("m", tokens(n), make_cache(n), "finish", chain=[1])
    with pytest.raises(TimeoutError):
        wait_until(lambda: tier.index, 1.0, what="a write while busy")
    assert tier._pending_bytes == make_cache(14)[0].nbytes * len(make_cache(14))
    busy[0] = False
    wait_until(lambda: tier.index, 30, what="the write once idle")
    (record,) = tier.index.values()
    assert len(record.tokens) == 14
    assert metric(metrics, metrics.disk_writes, result="ok") == 1
    assert tier._pending_bytes == 0


def test_a_busy_engine_delays_a_write_by_max_delay_at_most(tmp_path):
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: True
    tier.max_delay = 0.5
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: tier.index, 30, what="the write after max_delay")


def test_closing_writes_what_waits_at_once(tmp_path):
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: True
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    tier.close()
    assert len(list(tmp_path.glob("*" + diskfile.SUFFIX))) == 1


def test_disk_budget_is_lru_by_bytes(tmp_path):
    tier, metrics = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="first written")
    size = tier.nbytes
    tier.budget_bytes = int(size * 2.5)
    store.insert("m", tokens(10, 100), make_cache(10), "finish", chain=[2])
    wait_until(lambda: len(tier.index) == 2, 30, what="second written")
    assert restore(tier, tokens(11)).tokens == 10  # the first is now the most recent
    store.insert("m", tokens(10, 200), make_cache(10), "finish", chain=[3])
    wait_until(lambda: metric(metrics, metrics.disk_evictions) == 1, 30, what="an eviction")
    assert sorted(r.chain[0] for r in tier.index.values()) == [1, 3]
    assert tier.nbytes <= tier.budget_bytes


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "foreign", "partial", "garbage"])
def test_bad_files_are_dropped_never_loaded(tmp_path, damage, caplog, read_path):
    tier, _ = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")
    tier.close()
    (path,) = tmp_path.glob("*" + diskfile.SUFFIX)
    data = bytearray(path.read_bytes())
    fingerprint = FP
    if damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "corrupt":
        data[-50] ^= 0xFF  # a tensor byte: found by the checksum when loading
        path.write_bytes(data)
    elif damage == "foreign":
        fingerprint = "0" * 32  # the same file read by a backend of other weights
    elif damage == "partial":
        path.rename(tmp_path / ("x" + diskfile.TMP_SUFFIX))
    else:
        path.write_bytes(os.urandom(300))
    caplog.set_level(logging.WARNING, "kvroute.backend.disk")
    again, metrics = make_tier(tmp_path, fingerprint=fingerprint)
    assert restore(again, tokens(12)) is None
    assert not list(tmp_path.glob("*.safetensors"))
    (line,) = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
    reason = {"truncate": "truncated", "corrupt": "corrupt", "foreign": "foreign",
              "partial": "partial", "garbage": "corrupt"}[damage]
    assert metric(metrics, metrics.disk_dropped, reason=reason) == 1, line


def test_unusable_directory_means_ram_only(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    caplog.set_level(logging.WARNING, "kvroute.backend.disk")
    tier = DiskTier(blocker / "sub", 1 << 30, FP, BackendMetrics("m", "b"), 1 << 30)
    assert not tier.open()
    assert "RAM only" in caplog.text
    first, _ = make_tier(tmp_path / "d")
    second = DiskTier(tmp_path / "d", 1 << 30, FP, BackendMetrics("m", "b"), 1 << 30)
    assert not second.open()  # one process per directory


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_counts_failures_and_keeps_going(tmp_path):
    with small_tmpfs(tmp_path / "small", "256k") as mount:
        tier = None
        try:
            tier, metrics = make_tier(mount / "cache")
            store = attach(tier)
            store.insert("m", tokens(2000), make_cache(2000), "finish", chain=[1])  # 512 kB
            wait_until(lambda: metric(metrics, metrics.disk_writes, result="failed") == 1, 30,
                       what="a failed write")
            assert metric(metrics, metrics.disk_write_failures, reason="ENOSPC") == 1
            assert not list((mount / "cache").glob("*.safetensors"))  # no partial file left
            store.insert("m", tokens(10, 500), make_cache(10), "finish", chain=[2])
            wait_until(lambda: len(tier.index) == 1, 30, what="a small write after the failure")
        finally:
            if tier is not None:
                tier.close()


def test_a_prefill_faster_than_the_disk_skips_the_restore(tmp_path):
    tier, metrics = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")
    (record,) = tier.index.values()
    tier.restore_bps = record.size / 0.1  # measured: its 10 tokens take 0.1 s to read
    fast = asyncio.run(tier.prefetch("m", tokens(12), None, lambda: 0, prefill_tps=1000.0))
    assert fast is None and metric(metrics, metrics.disk_skipped) == 1
    slow = asyncio.run(tier.prefetch("m", tokens(12), None, lambda: 0, prefill_tps=10.0))
    assert slow.tokens == 10


def test_a_lookup_made_in_the_handlers_thread_restores_as_prefetchs_own(tmp_path):
    """The server looks the record up in the thread that made the prompt's tokens
    (`find`) and hands the answer to `prefetch`: the same restore as prefetch's own
    lookup, and none where RAM serves as much as the disk."""
    tier, _ = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")
    prompt = tokens(12)
    found = tier.find("m", prompt, None, lambda: 0)
    assert found[0][0] == 10 and found[1] == 0

    def no_second_lookup() -> int:
        raise AssertionError("prefetch looked again")
    given = asyncio.run(tier.prefetch("m", prompt, None, no_second_lookup, found=found))
    own = restore(tier, prompt)
    assert given.tokens == own.tokens == 10 and same_state(given.cache, own.cache)
    ram_serves_it = tier.find("m", prompt, None, lambda: 10)
    assert ram_serves_it == ((0, None), 10)
    assert asyncio.run(tier.prefetch("m", prompt, None, no_second_lookup, found=ram_serves_it)) is None


def test_before_any_restore_is_measured_a_few_shared_tokens_are_prefilled(tmp_path):
    """After a restart no read rate is known yet: a prompt that shares only a chat
    template's opening with a record must not read the record (a cold prompt on a
    restarted GPU backend read a whole 8k-token state for 5 tokens)."""
    tier, metrics = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(2000), make_cache(2000), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")
    assert not tier.restore_bps
    prompt = tokens(5) + [90000 + i for i in range(100)]
    assert asyncio.run(tier.prefetch("m", prompt, None, lambda: 0, prefill_tps=20000.0)) is None
    assert metric(metrics, metrics.disk_skipped) == 1 and tier.blocks.reads == 0
    # A slow prefill (a CPU) is still worth the read.
    assert asyncio.run(tier.prefetch("m", prompt, None, lambda: 0, prefill_tps=5.0)).tokens == 5


def test_concurrent_hits_on_one_file_share_one_read(tmp_path):
    tier, metrics = make_tier(tmp_path)
    store = attach(tier)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")

    async def both():
        return await asyncio.gather(*(tier.prefetch("m", tokens(12) + [i], None, lambda: 0)
                                      for i in range(3)))

    found = asyncio.run(both())
    assert [f.tokens for f in found] == [10, 10, 10]
    (record,) = tier.index.values()
    assert metric(metrics, metrics.disk_restore_bytes) == record.size  # read once
    views = [f.hit().cache for f in found]  # each request still gets its own arrays
    assert views[0][0].keys is not views[1][0].keys


def test_a_restore_begins_from_the_prefix_keys_before_the_tokens(tmp_path, read_path):
    """After a restart a conversation's next turn finds its record by the keys of its
    messages, and the read begins while the template still renders and tokenizes;
    the request's tokens then take that read over: one read, the same state."""
    cache = write_one(tmp_path)  # its record is advertised by key 1
    tier, metrics = make_tier(tmp_path)
    try:
        early = tier.read_early("m", [1, 2], lambda keys: False)
        assert early is not None
        found = asyncio.run(tier.prefetch("m", tokens(12), None, lambda: 0, early=early))
        assert found.tokens == 10 and same_state(found.cache, cache)
        assert early.used and metric(metrics, metrics.disk_early_reads, used="yes") == 1
        (record,) = tier.index.values()
        assert metric(metrics, metrics.disk_restore_bytes) == record.size  # read once
        assert tier._restoring == 0
    finally:
        tier.close()


def test_no_early_read_where_ram_is_as_deep_or_the_record_holds_more(tmp_path):
    tier, metrics = make_tier(tmp_path)
    store = attach(tier)
    try:
        store.insert("m", tokens(10), make_cache(10), "finish", chain=[1, 2])
        wait_until(lambda: len(tier.index) == 1, 30, what="written")
        ram = lambda keys: store.advertises("m", keys)  # noqa: E731
        assert tier.read_early("m", [1, 2, 3], ram) is None  # a cached turn: RAM holds key 2
        store.clear()
        assert tier.read_early("m", [1, 2, 3], ram) is not None  # after RAM let it go
        # Another conversation sharing its first message: the record holds a message
        # this request does not have, so its keys do not choose it (its tokens may).
        assert tier.read_early("m", [1, 5], ram) is None
        assert tier.read_early("other-model", [1, 2, 3], ram) is None
        # Read, then not taken: RAM turned out to serve as much by the tokens.
        early = tier.read_early("m", [1, 2, 3], ram)
        assert asyncio.run(tier.prefetch("m", tokens(12), None, lambda: 11, early=early)) is None
        assert not early.used and metric(metrics, metrics.disk_early_reads, used="no") == 1
        wait_until(lambda: early.future.done() and tier._restoring == 0, 30,
                   what="the unused read to end")
    finally:
        tier.close()


def test_every_reader_thread_has_done_its_first_work_when_the_tier_opens(tmp_path, monkeypatch):
    """A thread's first MLX work makes its stream (its own, on a GPU): a restore in a
    new process found each of its reader threads cold and paid for it."""
    from concurrent.futures import ThreadPoolExecutor
    from kvroute.backend import disk

    ran: list[str] = []
    monkeypatch.setattr(disk, "_first_eval", lambda: ran.append(threading.current_thread().name))
    tier, _ = make_tier(tmp_path)
    try:
        blocks = [n for n in ran if n.startswith("kvroute-disk-blocks")]
        assert len(set(blocks)) == len(blocks) == tier.read_parallel
        assert len({n for n in ran if n.startswith("kvroute-disk-read")}) == 2
    finally:
        tier.close()
    # Each thread once, whatever the pool's size; a pool shut down is left alone.
    ran.clear()
    with ThreadPoolExecutor(3, thread_name_prefix="pool") as pool:
        assert disk.warm_threads(pool, 3) == 3
        assert len(set(ran)) == len(ran) == 3
    assert disk.warm_threads(pool, 3) == 0


def write_one(folder: Path) -> list:
    """A ten-token entry written to a tier in `folder`, which is then closed."""
    tier, _ = make_tier(folder)
    store = attach(tier)
    cache = make_cache(10)
    store.insert("m", tokens(10), cache, "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 1, 30, what="written")
    tier.close()
    return cache


@pytest.mark.parametrize("written_on", ["cpu", "cuda"])
def test_a_failing_mlx_reader_costs_no_file(tmp_path, monkeypatch, caplog, written_on):
    """On CUDA a file is loaded by MLX's reader (after a host check, or checked by its
    device checksum after); should that reader fail (not the file), the restore is
    made from bytes read and checked on the host, and the file stays."""
    if written_on == "cuda":
        monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    cache = write_one(tmp_path)
    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    look, _ = make_tier(tmp_path)
    (record,) = look.index.values()
    assert bool(record.dsum) == (written_on == "cuda")
    look.close()

    def broken(*args, **kwargs):
        raise RuntimeError("no reader here")

    monkeypatch.setattr(mx, "load", broken)
    monkeypatch.setattr(diskfile, "_reader_failed", False)  # warned once per process
    caplog.set_level(logging.WARNING, "kvroute.backend.disk")
    again, _ = make_tier(tmp_path)
    found = restore(again, tokens(12))
    assert found is not None and same_state(found.cache, cache)
    assert len(list(tmp_path.glob("*" + diskfile.SUFFIX))) == 1 and len(again.index) == 1
    assert any("MLX's reader failed" in r.getMessage() for r in caplog.records)


def test_writes_wait_while_a_sibling_backend_works(tmp_path):
    """Replicas that share a machine share its GPU and disk: a write also waits while
    a sibling's engine works (its tier lies beside this one's), and goes once none
    does. A sibling whose process is gone counts for nothing."""
    from kvroute.backend.busy import BusyBoard

    assert BusyBoard.beside(tmp_path / "m-1").folder == BusyBoard.beside(tmp_path / "m-2").folder
    assert BusyBoard.beside(tmp_path / "m-1").folder != BusyBoard.beside(tmp_path / "x" / "m-1").folder
    tier, metrics = make_tier(tmp_path / "m-1")
    tier.board = BusyBoard(tmp_path / "board")
    sibling_proc = subprocess.Popen(["sleep", "120"])
    try:
        sibling = BusyBoard(tmp_path / "board", pid=sibling_proc.pid)
        sibling.set(True)
        store = attach(tier)
        store.insert("m", tokens(10), make_cache(10), "finish", chain=[1])
        with pytest.raises(TimeoutError):
            wait_until(lambda: tier.index, 1.0, what="a write while a sibling works")
        sibling.set(False)
        wait_until(lambda: tier.index, 30, what="the write once the sibling is idle")
        assert metric(metrics, metrics.disk_writes, result="ok") == 1
        sibling.set(True)
    finally:
        sibling_proc.kill()
        sibling_proc.wait()
    assert tier.board.others_busy() is False  # its process is gone: its file too
    assert not (tmp_path / "board" / str(sibling_proc.pid)).exists()
    tier.close()


def test_without_a_device_checksum_a_cuda_restore_checks_on_the_host(tmp_path, monkeypatch, caplog):
    """Should MLX fail to compute the device checksum (an op a backend lacks), files are
    written without one and restores check them on the host: warned once, nothing lost."""
    from kvroute.backend import devsum

    def broken(files):
        raise RuntimeError("no uint32 sums here")

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(devsum, "checksums", broken)
    monkeypatch.setattr(diskfile, "_sum_failed", False)  # warned once per process
    caplog.set_level(logging.WARNING, "kvroute.backend.disk")
    cache = write_one(tmp_path)
    again, _ = make_tier(tmp_path)
    (record,) = again.index.values()
    assert record.dsum == ""
    found = restore(again, tokens(12))
    assert found is not None and same_state(found.cache, cache)
    warned = [r for r in caplog.records if "no device checksum" in r.getMessage()]
    assert len(warned) == 1
