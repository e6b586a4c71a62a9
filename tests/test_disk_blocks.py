"""The disk tier by blocks: real caches, real files, the real paged store.

Conversations that share a prefix share its blocks on disk too: a block already
there is not written again, a restart reads a shared prefix once however many
conversations restore it, and a record whose blocks are damaged, missing or not
its own is never used."""

import asyncio
import logging
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

import pytest

import orjson
from tests.harness import wait_until
from tests.test_disk import make_tier, metric, read_path, restore  # noqa: F401 (read_path: a fixture)
from tests.test_paged import SYSTEM, kv_of, same_cache

from kvroute.backend import disk as disk_mod, diskblocks, diskfile
from kvroute.backend.paged import BLOCK_TOKENS, block_keys, root_key
from kvroute.backend.store import Store

HEAD = SYSTEM[: 8 * BLOCK_TOKENS]  # eight shared blocks


def conversation(i: int) -> list[int]:
    return HEAD + [4000 + 100 * i + j for j in range(2 * BLOCK_TOKENS + 5)]  # two blocks + 5


def block_files(folder: Path) -> list[Path]:
    return sorted((folder / diskblocks.FOLDER).glob("*" + diskblocks.SUFFIX))


def records(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + diskfile.SUFFIX))


def write_three(folder: Path):
    tier, metrics = make_tier(folder)
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    for i in range(3):
        store.insert("m", conversation(i), kv_of(conversation(i)), "finish", chain=[i])
        wait_until(lambda: len(tier.index) == i + 1 and tier.stats()["write_queue"] == 0, 30,
                   what=f"conversation {i} on disk")
    return tier, store


def damage_first_block(folder: Path, bits: int) -> None:
    """Flip `bits` in a tensor byte of the shared head's first block file."""
    first_key = block_keys(root_key("m", None), np.asarray(HEAD, dtype=np.int32), 1)[0]
    (head_block,) = [p for p in block_files(folder) if p.name.startswith(f"{first_key:016x}.")]
    data = bytearray(head_block.read_bytes())
    data[-3] ^= bits
    head_block.write_bytes(bytes(data))


def two_damaged_blocks_fail_a_restore(folder: Path, bits: int):
    """Damage the head's first two block files (`bits` of the first, a bit of the
    second): a restore of a conversation listing them fails, its record is dropped as
    corrupt, and both files go, though the other two conversations still list them
    (the dropped record's own two blocks go with it). Returns the tier, open."""
    before = {p.name for p in block_files(folder)}
    first, second = block_keys(root_key("m", None), np.asarray(HEAD, dtype=np.int32), 2)
    damaged = [p for key in (first, second) for p in block_files(folder) if p.name.startswith(f"{key:016x}.")]
    for path, at, flip in zip(damaged, (-3, -5), (bits, 0x01)):
        data = bytearray(path.read_bytes())
        data[at] ^= flip
        path.write_bytes(bytes(data))
    tier, metrics = make_tier(folder)
    assert restore(tier, conversation(1) + [1]) is None  # never served from damaged bytes
    assert metrics.disk_dropped.labels(model="m", backend="b", reason="corrupt")._value.get() == 1
    gone = before - {p.name for p in block_files(folder)}
    assert {p.name for p in damaged} <= gone and len(gone) == 2 + 2
    return tier  # still open: the caller closes it


def test_a_block_already_on_disk_is_not_written_again(tmp_path):
    tier, _ = write_three(tmp_path)
    # The head's 8 blocks once, each conversation's 2 own (its last 5 tokens stay in
    # its record, with one block's worth kept in the record only when it ends on one).
    assert len(block_files(tmp_path)) == 8 + 3 * 2 == tier.stats()["blocks"]
    assert tier.stats()["bytes"] == tier.nbytes + tier.blocks.nbytes
    unshared = 3 * sum(c.nbytes for c in kv_of(conversation(0)))  # three whole copies
    assert tier.stats()["bytes"] < 0.6 * unshared
    for path in records(tmp_path):
        meta = orjson.loads(orjson.loads(path.read_bytes()[8:8 + int.from_bytes(
            path.read_bytes()[:8], "little")])["__metadata__"]["0.kvroute"])
        assert len(meta["blocks"]) == 10
    tier.close()


def test_a_restart_restores_a_shared_prefix_once(tmp_path, read_path):
    write_three(tmp_path)[0].close()
    again, _ = make_tier(tmp_path)
    assert len(again.index) == 3 and again.stats()["blocks"] == 14
    held = [restore(again, conversation(i) + [1]) for i in range(3)]
    for i, found in enumerate(held):
        assert found.tokens == len(conversation(i))
        assert same_cache(found.cache, kv_of(conversation(i)))
    # 14 block files read for three conversations of 10 blocks each: the head once.
    assert again.stats()["block_reads"] == 14
    again.close()


def test_evicting_a_record_keeps_the_blocks_others_list(tmp_path):
    tier, _ = write_three(tmp_path)
    first = next(iter(tier.index))
    tier._remove(first)
    assert len(block_files(tmp_path)) == 8 + 2 * 2  # its own two went with it
    for i in (1, 2):
        assert restore(tier, conversation(i) + [1]).tokens == len(conversation(i))
    tier.close()


def test_a_missing_or_damaged_block_drops_the_records_that_list_it(tmp_path, read_path):
    write_three(tmp_path)[0].close()

    damage_first_block(tmp_path, 0xFF)
    again, metrics = make_tier(tmp_path)
    assert restore(again, conversation(0) + [1]) is None  # never served from damaged bytes
    assert len(again.index) == 2  # that record is dropped; the others fail when read
    assert restore(again, conversation(1) + [1]) is None
    again.close()
    # A record whose blocks are gone at start is dropped as partial; unlisted blocks go too.
    for path in block_files(tmp_path):
        path.unlink()
    third, metrics = make_tier(tmp_path)
    assert len(third.index) == 0 and not records(tmp_path)
    assert metrics.disk_dropped.labels(model="m", backend="b", reason="partial")._value.get() >= 1
    third.close()


def test_a_record_that_lists_blocks_of_other_tokens_is_never_used(tmp_path):
    """A header whose block list is not the chain of its own tokens (as if edited to
    point at another conversation's blocks, checksums made to match) is corrupt."""
    write_three(tmp_path)[0].close()
    paths = records(tmp_path)
    metas = []
    for path in paths:
        blob = path.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        metas.append((path, blob, n, orjson.loads(blob[8:8 + n])))
    (path, blob, n, header), other = metas[0], metas[1][3]
    meta = orjson.loads(header["__metadata__"]["0.kvroute"])
    meta["blocks"] = orjson.loads(other["__metadata__"]["0.kvroute"])["blocks"]
    header["__metadata__"]["0.kvroute"] = orjson.dumps(meta).decode()
    raw = orjson.dumps(header)
    new = len(raw).to_bytes(8, "little") + raw + blob[8 + n:]
    stem = path.name.split(".")[0]
    digest = diskfile._digest
    path.unlink()
    (tmp_path / f"{stem}.{digest(new[:8 + len(raw)])}.{digest(new)}{diskfile.SUFFIX}").write_bytes(new)
    again, metrics = make_tier(tmp_path)
    assert len(again.index) == 3
    tokens = orjson.loads(header["__metadata__"]["0.kvroute"])["tokens"]
    assert restore(again, tokens + [1]) is None
    assert metrics.disk_dropped.labels(model="m", backend="b", reason="corrupt")._value.get() == 1
    again.close()


def test_foreign_blocks_are_never_read(tmp_path):
    write_three(tmp_path)[0].close()
    other, _ = make_tier(tmp_path, fingerprint="e" * 32)  # other weights: records foreign
    assert len(other.index) == 0 and other.stats()["blocks"] == 0  # its blocks unlisted: gone
    other.close()


def test_a_hit_on_the_head_of_a_record_reads_only_the_blocks_that_hold_it(tmp_path, read_path):
    """After a restart, a new conversation that shares a system prompt with a long one
    on disk reads the blocks of what it shares, not the whole record; a later hit on
    the whole record reads the rest."""
    write_three(tmp_path)[0].close()
    again, _ = make_tier(tmp_path)
    shared = 5 * BLOCK_TOKENS + 7  # into the sixth block
    prompt = HEAD[:shared] + [9000 + j for j in range(20)]
    found = restore(again, prompt)
    assert found.tokens == shared
    assert again.stats()["block_reads"] == 6
    assert same_cache(found.hit().cache, kv_of(HEAD[:shared]))
    whole = restore(again, conversation(0) + [1])
    assert same_cache(whole.cache, kv_of(conversation(0)))
    assert again.stats()["block_reads"] == 10  # the other four the first time, as it held six
    again.close()


def test_committing_a_restored_conversation_keeps_the_blocks_it_read(tmp_path):
    """The next turn of a conversation restored from disk is committed with the
    blocks the restore read, not copies of them out of the working cache."""
    write_three(tmp_path)[0].close()
    again, _ = make_tier(tmp_path)
    store = Store(budget_bytes=1 << 30)
    again.blocks.in_ram = store.pool.blocks.get  # as open_disk_tier wires them
    store.pool.restored = again.blocks.restored
    found = restore(again, conversation(1) + [1])
    longer = conversation(1) + [5000 + j for j in range(40)]
    entry = store.insert("m", longer, kv_of(longer), "finish")
    read = {b.key: b.kv for b in found.state.blocks}
    kept = entry.state.blocks
    assert len(read) == 10 and len(kept) == 11
    assert all(kept[i].kv[0][0] is read[kept[i].key][0][0] for i in range(10))
    assert kept[10].key not in read  # the new turn's own block: from the working cache
    assert same_cache(store.lookup("m", longer + [1]).cache, kv_of(longer))
    again.close()


def test_queued_conversations_on_one_prompt_count_its_blocks_once(tmp_path):
    """While the engine is busy, writes wait; the queue's bound counts what the waiting
    entries pin, and entries on one system prompt pin its blocks once: ten of them fit
    a bound of three whole entries, where counting each whole dropped seven commits."""
    from kvroute.backend.disk import DiskTier
    from kvroute.backend.metrics import BackendMetrics

    whole = sum(c.nbytes for c in kv_of(conversation(0)))
    metrics = BackendMetrics("m", "b")
    tier = DiskTier(tmp_path, 1 << 30, "f" * 32, metrics, queue_bytes=3 * whole)
    assert tier.open()
    tier.busy = lambda: True  # writes wait for an idle engine (up to max_delay)
    tier.max_delay = 3600.0
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    for i in range(10):
        store.insert("m", conversation(i), kv_of(conversation(i)), "finish", chain=[i])
    assert metric(metrics, metrics.disk_writes, result="dropped") == 0
    assert tier._pending_bytes < 3 * whole
    for i in range(10, 40):  # the bound still holds: the own parts of 30 more do not fit
        store.insert("m", conversation(i), kv_of(conversation(i)), "finish", chain=[i])
    assert metric(metrics, metrics.disk_writes, result="dropped") > 0
    assert tier._pending_bytes <= 3 * whole
    tier.busy = lambda: False
    tier.close()  # writes what waits
    assert len(tier.index) == 40 - metric(metrics, metrics.disk_writes, result="dropped")


def test_a_restored_prefix_the_ram_store_holds_is_not_read_again(tmp_path):
    write_three(tmp_path)[0].close()
    again, _ = make_tier(tmp_path)
    store = Store(budget_bytes=1 << 30)
    again.blocks.in_ram = store.pool.blocks.get  # as open_disk_tier wires them
    store.insert("m", HEAD + [7], kv_of(HEAD + [7]), "finish")  # the head, already in RAM
    found = restore(again, conversation(1) + [1])
    assert same_cache(found.cache, kv_of(conversation(1)))
    assert again.stats()["block_reads"] == 2  # its own two blocks only
    again.close()


def test_after_a_restart_the_next_turn_replaces_its_record_and_evicts_no_more_than_needed(tmp_path):
    # Three conversations on disk; a restart; the newest one's next turn (its record's
    # tokens and one block more) is committed in the new process. Its record replaces
    # the one it grew from (they piled up, one per restart), and the budget, just
    # above what the tier holds, makes room for what the write adds alone: a block and
    # a record, not the whole conversation (two others were evicted for it).
    tier, _ = write_three(tmp_path)
    tier.close()
    again, metrics = make_tier(tmp_path)  # a restart
    block = again.blocks.nbytes // len(block_files(tmp_path))
    again.budget_bytes = again.stats()["bytes"] + 2 * block
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(again.on_store_event)
    turn = conversation(2) + [9000 + j for j in range(BLOCK_TOKENS)]
    store.insert("m", turn, kv_of(turn), "finish", chain=[2, 22])
    wait_until(lambda: sorted(len(r.tokens) for r in again.index.values())
               == [len(conversation(0)), len(conversation(1)), len(turn)], 30,
               what="the next turn's record in place of the one it grew from")
    assert len(records(tmp_path)) == 3
    assert metrics.disk_evictions.labels(model="m", backend="b")._value.get() == 0
    (newest,) = [r for r in again.index.values() if len(r.tokens) == len(turn)]
    assert newest.chain == [2, 22]  # the replaced record's keys are its own
    assert again.stats()["bytes"] <= again.budget_bytes
    again.close()


def test_a_write_gives_way_between_block_files_while_the_engine_has_work(tmp_path):
    """A long conversation is many block files (a 32k one ~1,000): a request arriving
    mid-write gets the engine alone; the write goes on once it has been idle
    `idle_wait` again."""
    tier, _ = make_tier(tmp_path)
    tier.idle_wait = 1.0
    started = [False]  # the engine turns busy once the write has begun

    def busy() -> bool:
        started[0] = started[0] or any((tmp_path / diskblocks.FOLDER).iterdir())
        return started[0] and hold[0]
    hold = [True]
    tier.busy = busy
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    store.insert("m", conversation(0), kv_of(conversation(0)), "finish", chain=[0])
    folder = tmp_path / diskblocks.FOLDER
    wait_until(lambda: any(folder.iterdir()), 30, what="the write to begin")
    with pytest.raises(TimeoutError):  # one file begun, no more while busy
        wait_until(lambda: len(list(folder.iterdir())) > 1 or tier.index, 1.0,
                   what="a second block file while the engine is busy")
    hold[0] = False
    with pytest.raises(TimeoutError):  # idle, but not for idle_wait yet
        wait_until(lambda: len(list(folder.iterdir())) > 1 or tier.index, 0.5,
                   what="a second block file the moment the engine is idle")
    wait_until(lambda: tier.index, 30, what="the write once idle again")
    assert len(block_files(tmp_path)) == 10
    assert restore(tier, conversation(0) + [1]).tokens == len(conversation(0))
    tier.close()


def test_a_write_gives_way_while_a_restore_is_read(tmp_path):
    """A restore is read before its request reaches the engine, which is idle then: the
    writer still gives way to it (they would share the page cache, the bus and the
    GIL), and writes once the restore is done and `idle_wait` has passed."""
    tier, _ = make_tier(tmp_path)
    tier.idle_wait = 0.2
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    store.insert("m", conversation(0), kv_of(conversation(0)), "finish", chain=[0])
    wait_until(lambda: tier.index, 30, what="the first conversation written")
    written = set(block_files(tmp_path))
    reading, release = threading.Event(), threading.Event()
    real_load = tier._load

    def slow_load(*args):
        reading.set()
        assert release.wait(30)
        return real_load(*args)

    tier._load = slow_load
    got: list = []
    reader = threading.Thread(target=lambda: got.append(restore(tier, conversation(0) + [1])))
    reader.start()
    assert reading.wait(30)
    try:
        store.insert("m", conversation(1), kv_of(conversation(1)), "finish", chain=[1])
        with pytest.raises(TimeoutError):  # the engine is idle, but a restore is being read
            wait_until(lambda: set(block_files(tmp_path)) - written, 1.0,
                       what="a block file while a restore is read")
    finally:
        release.set()
        reader.join(30)
    assert got and got[0].tokens == len(conversation(0))
    wait_until(lambda: len(tier.index) == 2, 30, what="the write once the restore is done")
    tier.close()


def test_a_write_gives_way_no_longer_than_max_delay_then_goes_at_a_pace(tmp_path):
    """Under load that never pauses, an entry is written once its max_delay is over,
    pausing between its block files (PACE times each file's time): the batch beside
    it shares the device with a quarter of a writer, not a whole one."""
    tier, metrics = make_tier(tmp_path)
    tier.max_delay = 1.0
    tier.busy = lambda: any((tmp_path / diskblocks.FOLDER).iterdir())  # busy from the first file on
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    store.insert("m", conversation(0), kv_of(conversation(0)), "finish", chain=[0])
    wait_until(lambda: tier.index, 30, what="the write, max_delay after its commit")
    assert len(block_files(tmp_path)) == 10
    assert metric(metrics, metrics.disk_paced) > 0
    tier.close()


def _address(a) -> int:
    """Where an MLX array's bytes start (this CPU: NumPy views MLX's buffer)."""
    import mlx.core as mx

    flat = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.asarray(flat).__array_interface__["data"][0]


def test_on_cuda_the_writer_never_reads_the_stores_arrays_on_the_host(tmp_path, monkeypatch):
    """On CUDA a host read moves an array's buffer into managed memory for good, and a
    hit on it then waits for the GPU to pull it back page by page: the writer hands
    MLX's writer copies, never a buffer the store keeps (blocks, tails), and the files
    hold the same bytes. (This CPU cannot show the move itself; it shows which
    buffers the host read, by address.)"""
    import mlx.core as mx

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    store = Store(budget_bytes=1 << 30)
    shared = []  # buffers the host read while the store kept them
    real_save = mx.save_safetensors

    def kept() -> set[int]:
        held = {_address(x) for b in store.pool.blocks.values() for pair in b.kv for x in pair}
        return held | {_address(x) for e in store.entries.values() for pair in e.state.tail for x in pair}

    def save(path, arrays, metadata=None):
        shared.extend({_address(a) for a in arrays.values() if a.size} & kept())
        return real_save(path, arrays, metadata)

    monkeypatch.setattr(mx, "save_safetensors", save)
    tier, _ = make_tier(tmp_path)
    store.listeners.append(tier.on_store_event)
    for i in range(3):
        store.insert("m", conversation(i), kv_of(conversation(i)), "finish", chain=[i])
        wait_until(lambda: len(tier.index) == i + 1 and tier.stats()["write_queue"] == 0, 30,
                   what=f"conversation {i} on disk")
    layers = len(kv_of(conversation(0)))
    assert len(block_files(tmp_path)) == 14 and len(kept()) == 14 * 2 + 3 * layers * 2
    assert shared == []
    tier.close()

    again, _ = make_tier(tmp_path)
    for i in range(3):
        assert same_cache(restore(again, conversation(i) + [1]).cache, kv_of(conversation(i)))
    again.close()


def test_on_cuda_a_write_saves_device_copies_and_hands_large_ones_back(tmp_path, monkeypatch):
    """On CUDA MLX's writer reads copies (a host read would move the store's own
    buffers into managed memory for good), bit for bit the arrays; copies of
    `STAGED_CLEAR` bytes or more (a whole entry's record) leave MLX's buffer cache
    emptied after the write, small ones (a block's) do not. (This CPU cannot show
    managed memory; it shows what the writer reads and when the cache is emptied.)"""
    import mlx.core as mx

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(diskfile, "STAGED_CLEAR", 4096)
    cleared, seen = [], []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
    real_save = mx.save_safetensors
    monkeypatch.setattr(mx, "save_safetensors",
                        lambda path, arrays, metadata=None: seen.append(dict(arrays)) or real_save(path, arrays, metadata))
    small = {"k0": mx.arange(64, dtype=mx.float32).reshape(4, 16), "v0": mx.array([-0.0, 1.5])}
    large = {"k0": mx.arange(2048, dtype=mx.float32).astype(mx.bfloat16).reshape(2, 1024)}
    for name, arrays, clears in (("small", small, 0), ("large", large, 1)):
        diskfile.save(tmp_path / f"{name}.safetensors", arrays, {"m": "x"})
        assert len(cleared) == clears, name
        assert not {_address(x) for x in seen[-1].values()} & {_address(a) for a in arrays.values()}
        loaded = mx.load(str(tmp_path / f"{name}.safetensors"))
        for k, a in arrays.items():
            assert loaded[k].dtype == a.dtype and loaded[k].shape == a.shape
            assert np.array(loaded[k].view(mx.uint16) if a.dtype == mx.bfloat16 else loaded[k]).tobytes() \
                == np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def test_on_cuda_without_room_for_copies_a_write_saves_the_arrays(tmp_path, monkeypatch, caplog):
    """Where the GPU has no memory for the copies, the arrays themselves are written
    (they move to managed memory, as before copies): the write is not lost. Warned once."""
    import mlx.core as mx

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(diskfile, "_copy_failed", False)
    caplog.set_level(logging.WARNING, "kvroute.backend.disk")
    arrays = {"k0": mx.arange(512, dtype=mx.float32).reshape(8, 64)}
    for i in range(2):
        with monkeypatch.context() as m:
            def no_room(*args, **kwargs):
                raise RuntimeError("[malloc] Unable to allocate 2048 bytes.")

            m.setattr(mx, "array", no_room)
            diskfile.save(tmp_path / f"{i}.safetensors", arrays, {})
        assert np.array_equal(np.array(mx.load(str(tmp_path / f"{i}.safetensors"))["k0"]), np.array(arrays["k0"]))
    assert len([r for r in caplog.records if "no device memory to copy" in r.getMessage()]) == 1


def test_on_cuda_a_restore_reads_each_file_once(tmp_path, monkeypatch):
    """Written on CUDA, a record and its blocks carry a device checksum: a restore
    there loads each file once, through MLX's reader, and checks the arrays where they
    landed; no file is read on the host, and a damaged tensor byte is still found.
    (Run on this CPU with the CUDA path forced; which device MLX's reader fills is
    MLX's business.)"""
    import mlx.core as mx

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    write_three(tmp_path)[0].close()
    for path in block_files(tmp_path) + records(tmp_path):
        header = orjson.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
        meta = header["__metadata__"]
        assert orjson.loads(meta.get("kvroute_block") or meta["0.kvroute"])["dsum"]

    def no_host_read(*args, **kwargs):
        raise AssertionError("a file read on the host")

    loads = []
    real_load = mx.load
    monkeypatch.setattr(diskfile, "read_bytes", no_host_read)
    monkeypatch.setattr(mx, "load", lambda path, *a, **kw: loads.append(path) or real_load(path, *a, **kw))
    again, metrics = make_tier(tmp_path)
    found = restore(again, conversation(0) + [1])
    assert same_cache(found.cache, kv_of(conversation(0)))
    assert len(loads) == len(set(loads)) == 10 + 1  # its ten blocks and its record, once each
    again.close()

    two_damaged_blocks_fail_a_restore(tmp_path, 0x10).close()


def test_on_cuda_a_restores_blocks_are_checked_together(tmp_path, monkeypatch):
    """On CUDA a write sums its new block files in one call, and a restore checks its
    block files' device checksums in one call (a pass per ~32 MB, not a dozen MLX
    operations per file); should that call fail (an op this
    MLX lacks), the blocks are checked on the host instead and the restore still
    serves them."""
    from kvroute.backend import devsum

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    calls = []
    real = devsum.checksums
    monkeypatch.setattr(devsum, "checksums", lambda files: calls.append(len(files)) or real(files))
    write_three(tmp_path)[0].close()
    assert sorted(calls) == [1, 1, 1, 2, 2, 10]  # each record; each write's new blocks together
    calls.clear()
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    assert sorted(calls) == [1, 10]  # its record, then its ten blocks together
    again.close()

    def broken(files):
        raise RuntimeError("no uint64 sums here")

    monkeypatch.setattr(devsum, "checksums", broken)
    monkeypatch.setattr(diskfile, "_sum_failed", False)
    host_reads = []
    real_read = diskfile.read_bytes
    monkeypatch.setattr(diskfile, "read_bytes",
                        lambda path, *a, **kw: host_reads.append(path) or real_read(path, *a, **kw))
    third, _ = make_tier(tmp_path)
    assert same_cache(restore(third, conversation(1) + [1]).cache, kv_of(conversation(1)))
    assert len(host_reads) == 10 + 1 and len(third.index) == 3  # nothing dropped
    third.close()


def test_on_cuda_blocks_with_and_without_a_device_checksum_restore_together(tmp_path, monkeypatch):
    """A prefix written before device checksums (or on a CPU) and a conversation's own
    blocks written with them: a CUDA restore checks the first on the host and the
    others on the device, together, and serves the whole."""
    from kvroute.backend import devsum

    write_three(tmp_path)[0].close()  # on this CPU: no device checksums (a head of 8 blocks)
    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    tier, metrics = make_tier(tmp_path)
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    fourth = HEAD + [9000 + j for j in range(2 * BLOCK_TOKENS + 5)]
    store.insert("m", fourth, kv_of(fourth), "finish", chain=[4])
    wait_until(lambda: len(tier.index) == 4 and tier.stats()["write_queue"] == 0, 30, what="on disk")
    tier.close()
    summed, host_reads = [], []
    real_sums, real_read = devsum.checksums, diskfile.read_bytes
    monkeypatch.setattr(devsum, "checksums", lambda files: summed.append(len(files)) or real_sums(files))
    monkeypatch.setattr(diskfile, "read_bytes",
                        lambda path, *a, **kw: host_reads.append(path) or real_read(path, *a, **kw))
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, fourth + [1]).cache, kv_of(fourth))
    assert sorted(summed) == [1, 2]  # its record; its own two blocks, together
    assert len(host_reads) == 8  # the head's blocks, written without a device checksum
    again.close()


def three_on_cuda(folder: Path, monkeypatch, staging: type) -> list:
    """Three conversations written on "CUDA" (forced on this CPU), restores staged by
    `staging` (a stand-in for pinned.Staging); the files MLX's reader loads from now."""
    import mlx.core as mx
    from kvroute.backend import pinned

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(pinned, "Staging", staging)
    write_three(folder)[0].close()
    loads: list = []
    real_load = mx.load
    monkeypatch.setattr(mx, "load", lambda path, *a, **kw: loads.append(path) or real_load(path, *a, **kw))
    return loads


def test_on_cuda_a_restore_loads_its_blocks_through_pinned_memory(tmp_path, monkeypatch):
    """On CUDA a restore's block files and its record's own file go onto the device
    through the pinned buffer (pinned.py; its CUDA parts stood in for by
    test_pinned.HostStaging: no GPU here), MLX's reader loading none of them, and
    answer as the conversation's own KV."""
    from kvroute.backend import pinned
    from tests.test_pinned import HostStaging

    loads = three_on_cuda(tmp_path, monkeypatch, HostStaging)
    HostStaging.launches = 0
    again, _ = make_tier(tmp_path)
    found = restore(again, conversation(0) + [1])
    assert same_cache(found.cache, kv_of(conversation(0)))
    assert loads == [] and not again.blocks.staging.failed
    # The warm-ups (the blocks' buffer, the own files'); the record's tail (its layers'
    # keys and values: those in 16-byte words copied, 16 a launch, the others made on
    # the host); ten blocks' 20 arrays.
    name = next(n for n, r in again.index.items() if r.tokens.tolist() == conversation(0))
    blob = (tmp_path / name).read_bytes()
    offset = 8 + int.from_bytes(blob[:8], "little")
    header = orjson.loads(blob[8:offset])
    header.pop("__metadata__")
    copied = [t for t in pinned.tensors(header, 0, len(blob) - offset) if not t.host]
    assert HostStaging.launches == 2 + -(-len(copied) // pinned.BATCH) + 2
    again.close()


def test_on_cuda_a_restores_log_line_says_where_its_time_went(tmp_path, monkeypatch, caplog):
    """The restore's INFO line names its phases, the blocks' own on CUDA among them
    (reading into pinned memory, launching the copies, waiting for them, making the
    blocks of the arrays), and the whole restore's phases add up to no more than its
    time: an operator reads from it where a slow restore went."""
    import re

    from tests.test_pinned import HostStaging

    three_on_cuda(tmp_path, monkeypatch, HostStaging)
    again, _ = make_tier(tmp_path)
    caplog.set_level(logging.INFO, "kvroute.backend.disk")
    assert restore(again, conversation(0) + [1]) is not None
    (line,) = [r.getMessage() for r in caplog.records if "disk cache: restored" in r.getMessage()]
    total = float(re.search(r" in ([0-9.]+) ms", line).group(1))
    phases = {k: float(v) for k, v in re.findall(r"([a-z][a-z ]*?) ([0-9.]+) ms", line.split("(", 1)[1])}
    for name in ("chain", "blocks", "assembly", "pinned reads", "launches", "copies waited",
                 "blocks made"):
        assert name in phases, (name, line)
    top = sum(phases[k] for k in ("chain", "blocks", "own file waited", "assembly", "header")
              if k in phases)
    assert top <= total + 0.5  # each rounded to 0.1 ms
    inside = sum(phases[k] for k in ("pinned reads", "launches", "copies waited", "blocks made"))
    assert inside <= phases["blocks"] + 0.5
    again.close()


def test_on_cuda_a_record_too_large_for_the_own_files_buffer_carries_a_device_checksum(tmp_path, monkeypatch):
    """A record whose own file does not fit the pinned buffer for own files (a sliding
    window's whole layers, say) is restored through MLX's reader: it is written with a
    device checksum, checked once there, and answers as the conversation's KV."""
    from kvroute.backend import pinned
    from tests.test_pinned import HostStaging

    monkeypatch.setattr(pinned, "OWN_BYTES", 512)  # halves of 256 bytes: no record fits
    monkeypatch.setattr(disk_mod, "HEADER_ROOM", 256)
    loads = three_on_cuda(tmp_path, monkeypatch, HostStaging)
    for path in records(tmp_path):
        meta = orjson.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])["__metadata__"]
        assert orjson.loads(meta["0.kvroute"])["dsum"]
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    assert len(loads) == 1 and not again._own_staging.failed  # the record, by MLX's reader
    again.close()


def test_on_cuda_a_damaged_record_read_through_pinned_memory_is_dropped(tmp_path, monkeypatch):
    """A record's own file read through the pinned buffer is checked against its
    name's xxh3 where it lands: a flipped byte drops the record (its blocks stay for
    the others), and the next conversation still restores."""
    from tests.test_pinned import HostStaging

    three_on_cuda(tmp_path, monkeypatch, HostStaging)
    again, _ = make_tier(tmp_path)
    name = next(n for n, r in again.index.items() if r.tokens.tolist() == conversation(0))
    again.close()
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    third, _ = make_tier(tmp_path)
    assert restore(third, conversation(0) + [1]) is None or name not in third.index
    assert name not in third.index and not path.exists()
    assert same_cache(restore(third, conversation(1) + [1]).cache, kv_of(conversation(1)))
    assert not third.blocks.staging.failed and not third._own_staging.failed  # the file's fault
    third.close()


def test_on_cuda_with_pinned_memory_a_block_file_is_read_once_and_checked_as_it_lands(tmp_path, monkeypatch):
    """Through pinned memory a block file, and a record's own file, is read whole,
    once, and checked on the host against its name's xxh3 where the copy kernel takes
    it from: no header read before, no device checksum after; so files are written
    without one. Damaged bytes are found, and every damaged file goes."""
    from kvroute.backend import devsum
    from tests.test_pinned import HostStaging

    three_on_cuda(tmp_path, monkeypatch, HostStaging)
    for path in block_files(tmp_path) + records(tmp_path):
        meta = orjson.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])["__metadata__"]
        dsum = orjson.loads(meta.get("kvroute_block") or meta["0.kvroute"]).get("dsum")
        assert not dsum
    heads, summed = [], []
    real_head, real_sums = diskfile.read_head, devsum.checksums
    monkeypatch.setattr(diskfile, "read_head", lambda path, *a: heads.append(path) or real_head(path, *a))
    monkeypatch.setattr(devsum, "checksums", lambda files: summed.append(len(files)) or real_sums(files))
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    assert heads == [] and summed == [] and again.stats()["block_reads"] == 10
    again.close()

    third = two_damaged_blocks_fail_a_restore(tmp_path, 0x01)
    assert not third.blocks.staging.failed  # damaged files are theirs, not the path's
    third.close()


def test_on_cuda_a_restore_cut_by_shutdown_leaves_the_pinned_path_on(tmp_path, monkeypatch, caplog):
    """Readers shut down under a restore (the tier closing) are not the pinned path
    failing: it stays on, nothing is said about it, and the record stays."""
    from concurrent.futures import ThreadPoolExecutor

    from kvroute.backend import pinned
    from tests.test_pinned import HostStaging

    three_on_cuda(tmp_path, monkeypatch, HostStaging)
    again, _ = make_tier(tmp_path)
    (record,) = [r for r in again.index.values() if r.tokens.tolist() == conversation(0)]
    closed = ThreadPoolExecutor(2)
    closed.shutdown()
    with pytest.raises(pinned.ReadersClosed):
        again.blocks.load_all(record.blocks, lambda key, kv, size: kv, closed)
    assert again.blocks.staging.works()
    assert not [r for r in caplog.records if "restores through pinned memory failed" in r.getMessage()]
    again._closing = True  # as close() marks it before shutting its readers down
    again._block_readers.shutdown()
    assert again._load(record) is None and record.name in again.index
    again._closing = False
    again.close()


def test_on_cuda_when_pinned_memory_fails_restores_use_mlxs_reader(tmp_path, monkeypatch, caplog):
    """Should the pinned path fail in a restore (a kernel MLX cannot build here, say),
    that restore and every later one load through MLX's reader, said once for the
    block files and once for the records' own files (each has its buffer)."""
    from tests.test_pinned import HostStaging

    class Broken(HostStaging):
        def _start_part(self, *args):
            raise RuntimeError("no kernel here")

    loads = three_on_cuda(tmp_path, monkeypatch, Broken)
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    assert len(loads) == 1 + 10 and again.blocks.staging.failed
    assert same_cache(restore(again, conversation(1) + [1]).cache, kv_of(conversation(1)))
    said = [r.getMessage() for r in caplog.records if "restores through pinned memory failed" in r.getMessage()]
    assert len(said) == 2 and "loads block files instead" in said[0] + said[1]
    assert "loads records' own files instead" in said[0] + said[1]
    again.close()


def test_on_cuda_block_files_mlxs_reader_fails_on_are_read_on_the_host(tmp_path, monkeypatch):
    """Neither the pinned path (no CUDA here) nor MLX's reader takes the block files:
    they are read and checked on the host, and the restore still serves them."""
    import mlx.core as mx

    from kvroute.backend import pinned

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(diskfile, "_reader_failed", False)
    monkeypatch.setattr(pinned, "cuda_runtime", lambda: None)
    write_three(tmp_path)[0].close()
    real_load = mx.load

    def no_blocks(path, *a, **kw):
        if str(path).endswith(diskblocks.SUFFIX):
            raise RuntimeError("this reader cannot")
        return real_load(path, *a, **kw)

    monkeypatch.setattr(mx, "load", no_blocks)
    again, _ = make_tier(tmp_path)
    assert again.blocks.staging.failed  # no CUDA runtime to ask for pinned memory
    assert same_cache(restore(again, conversation(2) + [1]).cache, kv_of(conversation(2)))
    assert len(again.index) == 3  # nothing dropped
    again.close()


def test_a_restore_that_finds_no_device_memory_keeps_its_files(tmp_path, monkeypatch):
    """Out of device memory mid-restore (or a lost GPU) is the device's trouble, not the
    files': the request prefills instead, the record and its blocks stay, the pinned
    path stays on, and a later restore serves them."""
    from kvroute.backend import pinned
    from tests.test_pinned import HostStaging

    class Full(HostStaging):
        full = True

        def _start_part(self, *args):
            if Full.full:
                raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
            return super()._start_part(*args)

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(pinned, "Staging", Full)
    write_three(tmp_path)[0].close()
    before = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    again, metrics = make_tier(tmp_path)
    assert restore(again, conversation(0) + [1]) is None
    assert sorted(p.name for p in tmp_path.rglob("*.safetensors")) == before
    assert len(again.index) == 3 and not again.blocks.staging.failed
    Full.full = False
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    again.close()


def test_closing_without_writing_drops_what_waits_and_evicts_nothing(tmp_path):
    """A backend whose GPU is lost closes its tier with write=False: writes would fail
    (after evicting records to make room for them), so what waits is dropped and the
    records on disk stay."""
    tier, store = write_three(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    tier.busy = lambda: True  # an engine at work: new writes wait
    fourth = HEAD + [7000 + j for j in range(3 * BLOCK_TOKENS)]
    store.insert("m", fourth, kv_of(fourth), "finish", chain=[9])
    wait_until(lambda: tier.stats()["write_queue"] == 1, 10, what="the write queued")
    tier.close(write=False)
    assert sorted(p.name for p in tmp_path.rglob("*.safetensors")) == before
    assert len(tier.index) == 3


@pytest.mark.skipif(not diskfile.on_cuda(), reason="needs a CUDA GPU (pinned memory and the real copy kernel)")
def test_on_a_gpu_a_restore_through_pinned_memory_answers_as_the_conversations_kv(tmp_path, monkeypatch):
    """The whole path on a real GPU: blocks written there, a restart, each
    conversation restored through the page-locked buffer and the CUDA kernel (in
    parts: a buffer of a few blocks), the same keys and values; a damaged block found."""
    from kvroute.backend import pinned
    from kvroute.core import accel

    monkeypatch.setattr(pinned, "cuda_runtime", accel.cuda_runtime)
    write_three(tmp_path)[0].close()
    size = max(p.stat().st_size for p in block_files(tmp_path))
    real = pinned.Staging
    # The blocks' buffer a few blocks large (in parts); the own files' as it is.
    monkeypatch.setattr(pinned, "Staging", lambda nbytes=0, what="block files": real(
        2 * 3 * (size + 2 * pinned.ALIGN) if what == "block files" else nbytes, what))
    again, _ = make_tier(tmp_path)
    assert again.blocks.staging.works()
    for i in range(3):
        assert same_cache(restore(again, conversation(i) + [1]).cache, kv_of(conversation(i)))
    assert again.blocks.staging.works()  # not served by MLX's reader after a failure
    again.close()
    damage_first_block(tmp_path, 0x01)
    third, _ = make_tier(tmp_path)
    assert restore(third, conversation(0) + [1]) is None
    assert third.blocks.staging.works()
    third.close()


def talks_of(n: int) -> list[list[int]]:
    """`n` conversations of four blocks and three tokens, sharing nothing."""
    return [[9000 + 1000 * i + j for j in range(4 * BLOCK_TOKENS + 3)] for i in range(n)]


def store_fitting(tier, entries: float, talk: list[int]) -> Store:
    """A store whose budget holds `entries` entries of `talk`'s size, tied to `tier` as
    the backend ties them (its events, its overflow, what its queued writes hold)."""
    one = Store(budget_bytes=1 << 30)
    one.insert("m", talk, kv_of(talk), "finish", chain=[0])
    store = Store(budget_bytes=int(entries * one.nbytes))
    store.listeners.append(tier.on_store_event)
    store.overflow, store.pinned = tier.take, tier.pinned_bytes
    return store


def test_writes_waiting_for_evicted_entries_count_in_the_ram_budget(tmp_path):
    """An entry evicted while its write waits for an idle engine stays in memory (the
    write holds its arrays): such a write goes at once, busy engine or not, since it
    is all that holds them, and the store counts those bytes in its budget until it is
    done. So once the writes of what RAM let go are done, the cache holds no more than
    its budget says, however far the disk writers were behind."""
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: True  # an engine at work: writes of entries RAM holds wait
    talks = talks_of(5)
    store = store_fitting(tier, 2.5, talks[0])  # two entries fit
    for i, talk in enumerate(talks):
        store.insert("m", talk, kv_of(talk), "finish", chain=[i])
        wait_until(lambda: tier.pinned_bytes() == 0, 30, what="the evicted entries' writes")
        assert store.nbytes + store.hot_bytes <= store.budget_bytes
        assert len(store.entries) >= min(i + 1, 2)  # RAM holds what it fits
    # What RAM let go of (whole or in part) is on disk; what RAM holds whole waits.
    def kept(talk: list[int]) -> tuple[bool, bool]:
        prompt = np.asarray(talk + [1], dtype=np.int32)
        return (store.depth("m", prompt) == len(talk),
                tier.best("m", prompt, None)[0] == len(talk))
    wait_until(lambda: all(ram != disk for ram, disk in map(kept, talks)), 30,
               what="the evicted entries written")
    whole_in_ram = sum(ram for ram, _ in map(kept, talks))
    assert tier.stats()["write_queue"] == whole_in_ram >= 1
    assert tier.stats()["write_queue_evicted_bytes"] == 0
    tier.busy = lambda: False
    wait_until(lambda: tier.stats()["write_queue"] == 0 and len(tier.index) == 5, 60,
               what="the rest once the engine rests")
    store.insert("m", talks[0], kv_of(talks[0]), "finish", chain=[0])
    # Nothing pinned now: the budget is RAM's again (two whole entries and part of one).
    assert store.nbytes + store.hot_bytes <= store.budget_bytes
    assert sum(ram for ram, _ in map(kept, talks)) == 2
    tier.close()


def test_a_write_ram_let_go_does_not_wait_behind_writes_that_wait_for_an_idle_engine(tmp_path):
    """Writes wait in order for an idle engine, but one whose entry RAM let go holds
    memory the RAM budget counts: it goes at once, ahead of the writes before it that
    still wait (under load that never pauses they wait `max_delay`, and RAM kept ever
    less meanwhile: agent turns on a small budget hit far less with the tier on)."""
    tier, _ = make_tier(tmp_path)
    tier.max_delay = 60.0
    tier.busy = lambda: True  # an engine at work: writes of entries RAM holds wait
    a, b, c = talks_of(3)
    store = store_fitting(tier, 2.5, a)  # two entries fit
    store.insert("m", a, kv_of(a), "finish", chain=[0])
    store.insert("m", b, kv_of(b), "finish", chain=[1])  # its write waits behind a's
    assert store.lookup("m", a + [1]).tokens == len(a)  # a used again: b is the oldest
    store.insert("m", c, kv_of(c), "finish", chain=[2])  # RAM lets b go

    def on_disk(talk: list[int]) -> bool:
        return tier.best("m", np.asarray(talk + [1], dtype=np.int32), None)[0] == len(talk)

    wait_until(lambda: on_disk(b) and tier.pinned_bytes() == 0, 30,
               what="b's write, ahead of a's that waits")
    assert not on_disk(a) and store.depth("m", a + [1]) == len(a)  # a waits, RAM holds it
    tier.busy = lambda: False
    wait_until(lambda: on_disk(a) and on_disk(c), 30, what="the rest once the engine rests")
    tier.close()


def test_a_commit_over_the_budget_evicts_what_it_needs_while_writes_wait(tmp_path):
    """Evicting an entry whose write still waits frees nothing until that write is
    done. A commit over the budget while the writers are behind therefore evicts what
    it needs, not every entry RAM holds (it did: each eviction moved bytes from RAM's
    count to the writers', so the budget never looked met): the conversations RAM
    still fits stay hits. What waited for the writers before the commit still counts
    in the budget; the commit's own excess lasts until its writes are done."""
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: True  # an engine at work: writes of entries RAM holds wait
    go = threading.Event()
    write = tier._write
    tier._write = lambda *a, **k: (go.wait(30), write(*a, **k))[-1]  # the writers are behind
    talks = talks_of(4)
    store = store_fitting(tier, 3.5, talks[0])  # three entries fit
    for i, talk in enumerate(talks):
        waited = tier.pinned_bytes()
        store.insert("m", talk, kv_of(talk), "finish", chain=[i])
        assert store.nbytes + store.hot_bytes + waited <= store.budget_bytes
    assert tier.pinned_bytes() > 0  # the fourth commit's excess, held by its writes
    assert len(store.entries) >= 3
    for talk in talks[1:]:  # whole hits, as before the fourth commit
        assert store.depth("m", talk + [1]) == len(talk)
    go.set()
    wait_until(lambda: tier.pinned_bytes() == 0, 30, what="the evicted part's write")
    assert store.nbytes + store.hot_bytes <= store.budget_bytes
    tier.close()


def test_a_write_ram_let_go_starts_no_file_while_a_prompt_is_prefilled(tmp_path):
    """A write RAM let go of goes on under load, paced, but starts no block file while
    its backend has a prompt to prefill or a restore to read (what a user waits on):
    the files took the device, the bus and the GIL from the cached second turn beside
    them. Once the prompt's first token is out, the write goes on, and the memory it
    held is freed; a load that always has a prompt waiting holds it `max_delay` at
    most."""
    tier, metrics = make_tier(tmp_path)
    tier.max_delay = 60.0  # how long a write holds off for prompts, at most
    tier.busy = lambda: True  # an engine at work: writes of entries RAM holds wait
    asked = []
    prompt = threading.Event()
    prompt.set()
    tier.prefilling = lambda: asked.append(1) or prompt.is_set()
    written = []
    write = tier.blocks.write
    tier.blocks.write = lambda blocks, *a: (written.append(len(blocks)), write(blocks, *a))[-1]
    talks = talks_of(2)
    store = store_fitting(tier, 1.5, talks[0])  # one entry fits
    for i, talk in enumerate(talks):
        store.insert("m", talk, kv_of(talk), "finish", chain=[i])
    assert tier.pinned_bytes() > 0  # RAM let the first go: its write is all that holds it
    wait_until(lambda: len(asked) >= 5, 30, what="the writer asking about the prompt")
    assert not written and not tier.index  # held off, not one file
    tier._restoring += 1  # a restore is read: its prompt's first step comes next
    prompt.clear()  # the first token is out
    seen = len(asked)
    wait_until(lambda: len(asked) >= seen + 5, 30, what="the writer asking again")
    assert not written and not tier.index
    tier._restoring -= 1
    wait_until(lambda: tier.pinned_bytes() == 0 and len(tier.index) == 1, 30,
               what="the write once the prompt is done")
    assert written and metric(metrics, metrics.disk_paced) > 0
    tier.close()


def test_such_a_write_also_holds_off_while_a_sibling_backend_has_a_prompt_waiting(tmp_path):
    """Replicas on one machine share its device and bus: a write RAM let go of starts
    no block file while a sibling backend (a live process on the same busy board) has
    a prompt waiting for its first token, and goes on once that prompt is decoding."""
    from kvroute.backend.busy import BusyBoard

    tier, _ = make_tier(tmp_path / "m-1")
    tier.max_delay = 60.0
    tier.busy = lambda: True
    tier.board = BusyBoard(tmp_path / "board")
    sibling_proc = subprocess.Popen(["sleep", "120"])
    try:
        sibling = BusyBoard(tmp_path / "board", pid=sibling_proc.pid)
        sibling.set(True, prefilling=True)
        assert tier.board.others_prefilling() and tier.board.others_busy()
        talks = talks_of(2)
        store = store_fitting(tier, 1.5, talks[0])  # one entry fits
        for i, talk in enumerate(talks):
            store.insert("m", talk, kv_of(talk), "finish", chain=[i])
        assert tier.pinned_bytes() > 0
        with pytest.raises(TimeoutError):
            wait_until(lambda: tier.index, 1.0, what="a file while the sibling prefills")
        sibling.set(True, prefilling=False)  # its first token is out: decoding
        assert tier.board.others_busy() and not tier.board.others_prefilling()
        wait_until(lambda: tier.pinned_bytes() == 0 and tier.index, 30,
                   what="the write once the sibling's prompt is done")
        sibling.set(True, prefilling=True)
    finally:
        sibling_proc.kill()
        sibling_proc.wait()
    assert not tier.board.others_prefilling()  # its process is gone: its file too
    assert not list((tmp_path / "board").iterdir())
    tier.close()


def test_a_long_paced_write_still_holds_off_for_a_prompt_after_max_delay(tmp_path):
    """The hold-off's bound is `max_delay` of holding off in all, not `max_delay` from
    the write's start: a paced write of a long conversation (a 31k-token one is ~1,000
    block files) that has not held off yet still starts no file while a prompt waits,
    however long it has been writing."""
    tier, _ = make_tier(tmp_path)
    tier.max_delay = 0.5
    tier.busy = lambda: True
    asked, prompt = [], threading.Event()
    tier.prefilling = lambda: asked.append(1) or prompt.is_set()
    files, give_way = [], tier._give_way
    tier._give_way = lambda deadline: (files.append(1), time.sleep(0.05), give_way(deadline))
    talks = [[5000 + 1000 * i + j for j in range(20 * BLOCK_TOKENS + 3)] for i in range(2)]
    store = store_fitting(tier, 1.5, talks[0])  # one entry fits
    for i, talk in enumerate(talks):
        store.insert("m", talk, kv_of(talk), "finish", chain=[i])
    wait_until(lambda: len(files) >= 8, 60, what="a write past max_delay since its start")
    prompt.set()
    seen, written = len(asked), len(files)
    wait_until(lambda: len(asked) >= seen + 10, 30, what="the writer asking about the prompt")
    assert len(files) <= written + 1  # the file it was writing, at most
    prompt.clear()
    wait_until(lambda: tier.pinned_bytes() == 0 and tier.index, 60, what="the rest of the write")
    tier.close()


def test_a_load_that_always_has_a_prompt_waiting_holds_such_a_write_max_delay_at_most(tmp_path):
    """The hold-off is bounded: under a load that never lets the last prompt reach its
    first token, a write RAM let go of still goes, paced, once `max_delay` is over,
    and frees what it held."""
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: True
    tier.prefilling = lambda: True
    tier.max_delay = 0.3
    talks = talks_of(2)
    store = store_fitting(tier, 1.5, talks[0])  # one entry fits
    for i, talk in enumerate(talks):
        store.insert("m", talk, kv_of(talk), "finish", chain=[i])
    wait_until(lambda: tier.pinned_bytes() == 0 and tier.index, 30,
               what="the write, held off max_delay at most")
    tier.close()


def held_writer(tier) -> tuple[threading.Event, threading.Event]:
    """A busy engine (writes of entries RAM holds wait) and a writer that holds each
    write until `go` is set; `writing` is set when one starts."""
    tier.busy = lambda: True
    writing, go = threading.Event(), threading.Event()
    write = tier._write
    tier._write = lambda *a, **k: (writing.set(), go.wait(30), write(*a, **k))[-1]
    return writing, go


def test_once_writes_ram_let_go_hold_their_share_an_evicted_entry_s_write_is_dropped(tmp_path):
    """RAM's budget counts what the writes of entries it let go of hold, so a writer
    far behind made RAM hold ever less (agent turns on a small budget hit 0.24-0.58 of
    their tokens with the tier on, 0.70 with it off). Once such writes hold
    `max_orphaned`, an evicted entry's write is dropped, as with no tier, and counted;
    the one already held is written."""
    tier, metrics = make_tier(tmp_path)
    writing, go = held_writer(tier)
    a, b, c = talks_of(3)
    store = store_fitting(tier, 1.5, a)  # one entry fits
    store.insert("m", a, kv_of(a), "finish", chain=[0])
    store.insert("m", b, kv_of(b), "finish", chain=[1])  # RAM lets a go: its write goes
    assert writing.wait(30)
    held = tier.pinned_bytes()
    assert held > 0 and metric(metrics, metrics.disk_writes, result="dropped") == 0
    tier.max_orphaned = held  # what a's write holds is the share
    store.insert("m", c, kv_of(c), "finish", chain=[2])  # RAM lets b go: dropped
    assert metric(metrics, metrics.disk_writes, result="dropped") == 1
    assert tier.pinned_bytes() == held  # b's arrays went with RAM's entry
    go.set()
    tier.busy = lambda: False
    wait_until(lambda: tier.pinned_bytes() == 0 and len(tier.index) == 2, 30,
               what="a's write, then c's once the engine rests")
    on_disk = {len(r.tokens) and r.tokens[0] for r in tier.index.values()}
    assert on_disk == {a[0], c[0]}  # b is not on disk: its write was dropped
    tier.close()


def test_a_waiting_write_of_an_entry_ram_cut_back_counts_what_was_cut(tmp_path):
    """RAM cut an entry back (its tail blocks freed) while its write waited: the write
    still holds the whole entry, so what was cut stays counted in the RAM budget until
    the write is done (cutting it further frees nothing either: RAM lets it go), and
    the file holds the whole entry."""
    tier, _ = make_tier(tmp_path)
    writing, go = held_writer(tier)
    long_ = [7000 + j for j in range(8 * BLOCK_TOKENS + 5)]
    short = [3000 + j for j in range(3 * BLOCK_TOKENS + 5)]
    sizes = Store(budget_bytes=1 << 30)
    sizes.insert("m", long_, kv_of(long_), "finish", chain=[0])
    sizes.insert("m", short, kv_of(short), "finish", chain=[1])
    both = sizes.nbytes
    store = Store(budget_bytes=both - 2 * (sizes.pool.nbytes // 11))  # a cut of ~2 blocks
    store.listeners.append(tier.on_store_event)
    store.overflow, store.pinned = tier.take, tier.pinned_bytes
    reasons = []
    store.listeners.append(lambda e: e.kind == "evict" and reasons.append(e.reason))
    store.insert("m", long_, kv_of(long_), "finish", chain=[0])
    store.insert("m", short, kv_of(short), "finish", chain=[1])
    assert reasons[0] == "trimmed", reasons  # RAM first cut the long entry back
    assert writing.wait(30)  # its write started at once, busy engine or not
    # While it is written the long entry is all in memory: the budget counts it.
    assert store.nbytes + store.hot_bytes + tier.pinned_bytes() >= both
    go.set()
    wait_until(lambda: tier.pinned_bytes() == 0 and len(tier.index) == 1, 30,
               what="the cut entry's write")
    (record,) = tier.index.values()
    assert len(record.tokens) == len(long_)
    tier.close()


def test_a_lookup_compares_only_records_that_could_serve_more_than_ram(tmp_path, monkeypatch):
    """Each request's disk lookup compared its prompt with every record: on an H100 a
    cached 31k-token turn 2 spent 6.1 ms before its engine with the tier on, 3.2 ms off.
    A record no longer than what RAM serves cannot beat RAM, so it is not compared; the
    answer is the same (the best record, or none beyond RAM)."""
    tier, _ = make_tier(tmp_path)
    tier.busy = lambda: False
    short, long_ = talks_of(2)
    long_ = long_ + [5000 + j for j in range(2 * BLOCK_TOKENS)]  # six blocks and three tokens
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    store.overflow, store.pinned = tier.take, tier.pinned_bytes
    store.insert("m", short, kv_of(short), "finish", chain=[0])
    store.insert("m", long_, kv_of(long_), "finish", chain=[1])
    wait_until(lambda: len(tier.index) == 2, 30, what="both written")
    compared = []
    real = disk_mod.usable_prefix
    monkeypatch.setattr(disk_mod, "usable_prefix",
                        lambda record, *a: compared.append(len(record.tokens)) or real(record, *a))
    prompt = long_ + [1]
    ram = len(short) + 1  # RAM serves more than the short record holds
    state = asyncio.run(tier.prefetch("m", prompt, None, lambda: ram))
    assert state is not None and state.tokens == len(long_)  # the long record, read back
    assert compared == [len(long_)]  # the short one was never compared
    compared.clear()
    assert asyncio.run(tier.prefetch("m", prompt, None, lambda: len(long_))) is None
    assert compared == []  # RAM serves all of it: nothing on disk can do better
    compared.clear()
    other = np.asarray(short + [1], dtype=np.int32)
    assert tier.best("m", other, None) == tier.best("m", other, None, above=0)
    assert tier.best("m", other, None)[0] == len(short)
    tier.close()
