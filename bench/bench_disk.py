"""The disk tier: restore time vs cold prefill, and the capacity-bound hit ratio.

`restore` (in process, no HTTP): builds a random-weight model of a given shape,
then for each prompt length times a cold prefill (plus the step that samples the
first token) against restoring the same state from a disk record (plus that same
step): from the page cache, and cold (the file's pages dropped with
posix_fadvise). Three readers: MLX's own (`mx.load` of the path, no checksum);
kvroute's (`mx.load`, then the checksum over MLX's buffers), what the backend runs;
and its fallback, the copy path (4 parallel preads, checksum, one copy into MLX).

    python -m bench.bench_disk restore --shape 100m --tokens 1024,8192,32768
    python -m bench.bench_disk restore --shape 7b --tokens 1024,8192,32768   # accelerator

`tier` (in process, no HTTP): the backend's own path. A prompt's state is committed
to a real store with a real disk tier (32-token block files and the entry's own
file), the tier is closed and opened again (a restart), and the request's state is
restored through `DiskTier.prefetch`, its private copy assembled from the blocks, and
the first token sampled, against a cold prefill of the same prompt. Each reader count
(`--parallel`) is timed from the page cache, the last also with the files' pages
dropped; "files read" is the bare read of the same files at that parallelism.

    python -m bench.bench_disk tier --shape 7b --tokens 8192 --parallel 1,4,8,16

`paths` (in process): ways to bring a restore's 32-token block files (7B shape) from
the page cache into arrays the device uses, and what assembling blocks costs there:
bare reads at 1-16 threads; arrays made from the read bytes (MLX's managed memory on
CUDA) then concatenated; MLX's own reader per file then concatenated, alone, after
a host read and xxh3 (a CUDA restore of a file without a device checksum) and
followed by the device checksum (one with: devsum.py), file by file or all the
files together; on CUDA, through pinned memory and a copy kernel (pinned.py), alone
and each file checked by its xxh3 where it lands (what the backend does); one host-side
assembly then one array; the concatenation of blocks already on the device (250, and
980: a 31k-token conversation), against one copy of the assembled state.

    python -m bench.bench_disk paths --blocks 250
    python -m bench.bench_disk paths --blocks 250 --pinned-only   # the backend's path alone

Its pinned rows run at the backend's GIL switch interval on a GPU, the backend's
restore also beside a thread rendering a prompt's chat template (a backend renders
the request's prompt while its restore is read: both need the GIL).

`written` (in process): what a write leaves for the GPU's next read of the arrays it
wrote (a hit on a conversation just written): 32-token blocks made on the device,
then written as the tier wrote them before (MLX's writer reading the store's own
arrays: on CUDA the host's read moves each buffer into managed memory for good),
from device copies (the tier until pinned writes), through the page-locked buffer
and copy kernel (pinned_write.py: the tier now, on CUDA), or not written; then the
first and the second concatenation of those blocks (what a hit assembles), and new
arrays of a block's size made on the device afterwards (whether freed copies, now
managed memory in MLX's buffer cache, slow the allocations that reuse them).

    python -m bench.bench_disk written --blocks 250

`beside` (in process, and a second one for its last rows): what the disk writer's
work costs a decode running beside it.
One stream decodes a random-weight 7B model (mlx-lm's `generate_step`, on the main
thread, the backend's GIL switch interval) while a second thread does one part of a
write at a time, looping until the decode ends: nothing; the tier's block writes
(diskblocks.py: pinned copies, files, fsyncs, renames) unpaced and paced as the tier
paces them; the copies and sums alone (files to /dev/null); the files alone (host
bytes, no device work); the Python work alone (headers, views; no kernel, no file);
then the tier's writes and the copies in another process on the same device, as a
sibling replica's writer runs (a GPU time-slices between processes). Each row's
decode rate beside the first's (nothing), and what the writer wrote.

    python -m bench.bench_disk beside --tokens 256

`capacity` (real processes): Redis, 3 backends with small RAM budgets, a proxy;
12 agent conversations of 4 turns (a long shared system prompt each, new user
text every turn), turns interleaved across conversations. Hit ratio = cached
prompt tokens / prompt tokens over all turns, without and with the disk tier.

    python -m bench.bench_disk capacity --cache-bytes 1MiB
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

SHAPES = {
    # ~110M parameters (vocab 32k untied): prefill is slow enough here to matter.
    "100m": dict(model_type="llama", hidden_size=768, num_hidden_layers=12, intermediate_size=2048,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    # Qwen2.5-7B's shape (vocab cut to 32k: the projection is not what prefill costs).
    "7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=32000),
}


def build(shape: str, dtype: str):
    import mlx.core as mx
    from mlx_lm.models import llama, qwen2

    cfg = dict(SHAPES[shape], rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
               max_position_embeddings=65536)
    mod = llama if cfg["model_type"] == "llama" else qwen2
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs(**cfg))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def prefill(model, tokens, cache, step: int):
    import mlx.core as mx

    for a in range(0, len(tokens), step):
        logits = model(tokens[None, a:a + step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return logits


def first_token(model, tokens, cache, step: int) -> float:
    """Prefill all but the last token into `cache` (may already hold them), then
    the step that samples: what a request's TTFT is made of."""
    import mlx.core as mx

    t0 = time.perf_counter()
    held = cache[0].offset
    if held < len(tokens) - 1:
        prefill(model, tokens[held:-1], cache, step)
    logits = model(tokens[None, -1:], cache=cache)
    mx.eval(mx.argmax(logits[0, -1]))
    return time.perf_counter() - t0


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def restore_bench(args) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvroute.backend import diskfile

    if args.memory_limit:
        mx.set_memory_limit(args.memory_limit << 30)
        mx.set_cache_limit(args.memory_limit << 29)
    dtype = args.dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    model = build(args.shape, dtype)
    params = sum(v.size for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvr-disk-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    console = Console(width=200)
    console.print(f"model {args.shape}: {params / 1e6:.0f}M parameters, {dtype}; {platform.platform()}; "
                  f"mlx {mx.__version__}, device {mx.default_device()}; files in {directory}")
    warm = mx.random.randint(0, 32000, (min(2048, args.prefill_up_to or max(args.tokens)),)).astype(mx.int32)
    first_token(model, warm, make_prompt_cache(model), args.step)  # compile kernels
    table = Table(title="restore vs cold prefill")
    for col in ("tokens", "KV MB", "cold TTFT s", "write s", "read s: mx.load", "kvroute",
                "copy path", "kvroute, cold", "GB/s", "GB/s cold", "restored TTFT s",
                "cold ÷ restored"):
        table.add_column(col, justify="right")
    for n in args.tokens:
        tokens = mx.random.randint(0, 32000, (n,)).astype(mx.int32)
        mx.eval(tokens)
        synthetic = args.prefill_up_to and n > args.prefill_up_to
        if synthetic:
            # Too slow to prefill here: a state of the true shape and size, random values.
            cold, state = float("nan"), _random_state(model, n - 1)
        else:
            # Best of --cold-repeat: the first run at a length compiles its kernels.
            cold = min(first_token(model, tokens, make_prompt_cache(model), args.step)
                       for _ in range(args.cold_repeat))
            state = make_prompt_cache(model)
            prefill(model, tokens[:-1], state, args.step)
        t0 = time.perf_counter()
        name, size = diskfile.write(directory, f"bench-{n}", state, {"tokens": n})
        write_s = time.perf_counter() - t0
        del state
        path = directory / name
        record = diskfile.Record(name, None, None, [], True, "", size, 0, name.split(".")[-3])
        with open(path, "rb") as f:
            record.data_offset = 8 + int.from_bytes(f.read(8), "little")
        reads = {}
        for label in ("mx.load", "kvroute", "copy"):
            reads[label] = min(_read(path, record, label) for _ in range(args.repeat))
        drop_page_cache(path)
        cold_read = _read(path, record, "kvroute")
        restored = diskfile.load(path, record, 4)
        step = first_token(model, tokens, restored, args.step)  # the state is whole: one step
        del restored
        path.unlink()
        ttft = reads["kvroute"] + step
        table.add_row(str(n), f"{size / 1e6:.0f}", f"{cold:.3f}", f"{write_s:.3f}",
                      f"{reads['mx.load']:.3f}", f"{reads['kvroute']:.3f}", f"{reads['copy']:.3f}",
                      f"{cold_read:.3f}", f"{size / 1e9 / reads['kvroute']:.2f}",
                      f"{size / 1e9 / cold_read:.2f}", f"{ttft:.3f}", f"{cold / ttft:.1f}×")
    console.print(table)


def _random_state(model, n: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    layer = model.layers[0].self_attn
    shape = (1, layer.n_kv_heads, n, model.args.hidden_size // model.args.num_attention_heads)
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    for c in cache:
        c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    mx.eval([c.state for c in cache])
    return cache


def _read(path: Path, record, how: str) -> float:
    """Seconds to have the record's state evaluated in MLX memory."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvroute.backend import diskfile

    t0 = time.perf_counter()
    if how == "mx.load":
        restored = load_prompt_cache(str(path))  # MLX's reader, no checksum
        mx.eval([c.state for c in restored])
    elif how == "kvroute":
        restored = diskfile.load(path, record)  # what the backend runs
    else:
        restored = diskfile.load_copy(path, record, 4)  # 4 preads, checksum, one copy
    return time.perf_counter() - t0


def tier_bench(args) -> None:
    import asyncio

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvroute.backend import diskfile
    from kvroute.backend.disk import DiskTier
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.store import Store

    if args.memory_limit:
        mx.set_memory_limit(args.memory_limit << 30)
    dtype = args.dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    model = build(args.shape, dtype)
    console = Console(width=200)
    console.print(f"model {args.shape}, {dtype}; {platform.platform()}; mlx {mx.__version__}, "
                  f"device {mx.default_device()}; {os.cpu_count()} cores")
    warm = mx.random.randint(0, 32000, (2048,)).astype(mx.int32)
    first_token(model, warm, make_prompt_cache(model), args.step)
    table = Table(title="disk tier restore (blocks) vs cold prefill")
    for col in ("tokens", "MB read", "readers", "pages", "cold TTFT s", "restore s", "assemble + step s",
                "restored TTFT s", "GB/s restore", "files read s", "GB/s files", "cold ÷ restored"):
        table.add_column(col, justify="right")
    for n in args.tokens:
        tokens = mx.random.randint(0, 32000, (n,)).astype(mx.int32)
        mx.eval(tokens)
        cold = min(first_token(model, tokens, make_prompt_cache(model), args.step)
                   for _ in range(args.cold_repeat))
        state = make_prompt_cache(model)
        prefill(model, tokens[:-1], state, args.step)
        directory = Path(tempfile.mkdtemp(prefix="kvr-tier-bench-", dir=args.dir))
        metrics = BackendMetrics("m", "bench")
        tier = DiskTier(directory, 1 << 34, "f" * 32, metrics, queue_bytes=1 << 40)
        assert tier.open()
        store = Store(budget_bytes=1 << 36)
        store.listeners.append(tier.on_store_event)
        prompt = tokens.tolist()
        store.insert("m", prompt[:-1], state, "finish")
        deadline = time.monotonic() + 300
        while not tier.index and time.monotonic() < deadline:
            time.sleep(0.05)
        tier.close()
        del store, state
        files = [p for p in directory.rglob("*.safetensors") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        runs = [(p, "cached") for p in args.parallel] + [(args.parallel[-1], "dropped")]
        for parallel, pages in runs:
            if pages == "dropped":
                for p in files:
                    drop_page_cache(p)
            again = DiskTier(directory, 1 << 34, "f" * 32, BackendMetrics("m", "bench"),
                             queue_bytes=1 << 40, read_parallel=parallel)
            assert again.open()
            t0 = time.perf_counter()
            restored = asyncio.run(again.prefetch("m", prompt, None, lambda: 0))
            t1 = time.perf_counter()
            cache = restored.hit().cache
            logits = model(tokens[None, -1:], cache=cache)
            mx.eval(mx.argmax(logits[0, -1]))
            t2 = time.perf_counter()
            again.close()
            del restored, cache
            if pages == "dropped":
                for p in files:
                    drop_page_cache(p)
            r0 = time.perf_counter()
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(parallel) as pool:
                list(pool.map(lambda p: diskfile.read_bytes(p, p.stat().st_size, 1), files))
            files_s = time.perf_counter() - r0
            table.add_row(str(n), f"{size / 1e6:.0f}", str(parallel), pages, f"{cold:.3f}",
                          f"{t1 - t0:.3f}", f"{t2 - t1:.3f}", f"{t2 - t0:.3f}",
                          f"{size / 1e9 / (t1 - t0):.2f}", f"{files_s:.3f}",
                          f"{size / 1e9 / files_s:.2f}", f"{cold / (t2 - t0):.2f}x")
        if not args.dir:
            import shutil
            shutil.rmtree(directory, ignore_errors=True)
    console.print(table)


def concat(parts: list) -> None:
    """What a hit assembles from blocks: each block's keys and values concatenated."""
    import mlx.core as mx

    mx.eval(mx.concatenate([x["k0"] for x in parts], axis=2),
            mx.concatenate([x["v0"] for x in parts], axis=2))


# A ChatML template, as a Qwen-style model renders its prompt: Python work a request's
# handler thread does while its restore is read (the restore begins before the tokens).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}<|im_start|>assistant\n")


class Rendering:
    """A thread rendering an ~8k-token conversation's template in a loop while the
    `with` block runs: the GIL's other holder during a restore."""

    def __init__(self):
        import threading

        import jinja2

        self.template = jinja2.Template(CHATML)
        self.messages = [{"role": "user" if i % 2 == 0 else "assistant",
                          "content": " ".join(f"w{j}" for j in range(i * 200, i * 200 + 200))}
                         for i in range(40)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.template.render(messages=self.messages)

    def __enter__(self) -> "Rendering":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def pinned_rows(files: list[Path], timed) -> None:
    """`paths`' rows through pinned memory (pinned.py; CUDA only), also beside a thread
    rendering a prompt's template: a restore's reads and launches need the GIL between
    their waits, and a backend renders the request's prompt while its restore runs."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from kvroute.backend import pinned

    staging = pinned.Staging()
    staging.warm()  # where CUDA cannot pin memory (a CPU, a Mac): these rows are left out
    plans = [pinned.File(p, p.stat().st_size) for p in files]

    def checked_fill(f: pinned.File, view: memoryview) -> tuple[dict, int]:
        header, offset = pinned.plain_fill(f, view)
        xxhash.xxh3_64(view).hexdigest()  # as the backend checks a block file
        return header, offset

    def pinned_load(pool: ThreadPoolExecutor, fill=pinned.plain_fill) -> None:
        parts = staging.load(plans, pool, fill)
        assert all(p is not None for p in parts), "a block file the pinned path cannot take"
        concat(parts)

    for threads in ((4, 8, 16) if not staging.failed else ()):
        with ThreadPoolExecutor(threads) as pool:
            timed("pinned memory + copy kernel (pinned.py) + concatenate", threads,
                  lambda: pinned_load(pool))
            timed("pinned memory + xxh3 where it lands (the backend's restore) + concatenate",
                  threads, lambda: pinned_load(pool, checked_fill))
            slots, pinned.SLOTS = pinned.SLOTS, 2  # the buffer in two halves (until 2026-12-07)
            try:
                timed("the same, the buffer in two halves (the restore before)", threads,
                      lambda: pinned_load(pool, checked_fill))
            finally:
                pinned.SLOTS = slots
            with Rendering():
                timed("the backend's restore, a prompt's template rendered beside it", threads,
                      lambda: pinned_load(pool, checked_fill))


def paths_bench(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx
    import numpy as np
    import orjson
    import xxhash

    from kvroute.backend import devsum

    layers, heads, dim, b = 28, 4, 128, 32  # Qwen2.5-7B's KV shape, one block
    n = args.blocks
    folder = Path(tempfile.mkdtemp(prefix="kvr-paths-"))
    files = [folder / f"{i}.safetensors" for i in range(n)]
    for path in files:
        k = mx.random.normal((layers, heads, b, dim)).astype(mx.bfloat16)
        mx.save_safetensors(str(path), {"k0": k, "v0": k * 2})
    size = sum(p.stat().st_size for p in files)
    console = Console(width=200)
    console.print(f"{n} blocks, {size / 1e6:.0f} MB; {platform.platform()}; {os.cpu_count()} cores; "
                  f"mlx {mx.__version__}, device {mx.default_device()}")
    table = Table(title="block files into device arrays (best of 3)")
    for col in ("path", "threads", "ms", "GB/s"):
        table.add_column(col, justify="right")
    if mx.cuda.is_available():  # as a backend on a GPU sets it (boot.py)
        import sys

        from kvroute.backend.boot import GPU_GIL_SWITCH_S
        sys.setswitchinterval(GPU_GIL_SWITCH_S)

    def timed(label: str, threads: int | str, fn) -> None:
        best = float("inf")
        for _ in range(3):
            mx.synchronize()
            t0 = time.perf_counter()
            fn()
            mx.synchronize()
            best = min(best, time.perf_counter() - t0)
        table.add_row(label, str(threads), f"{best * 1e3:.1f}", f"{size / 1e9 / best:.2f}")

    def raw(path: Path) -> dict:
        blob = path.read_bytes()
        end = 8 + int.from_bytes(blob[:8], "little")
        header = orjson.loads(blob[8:end])
        header.pop("__metadata__", None)
        return {name: np.frombuffer(blob, np.uint16, (t["data_offsets"][1] - t["data_offsets"][0]) // 2,
                                    end + t["data_offsets"][0]).reshape(t["shape"])
                for name, t in header.items()}

    def from_bytes(path: Path) -> dict:
        x = {k: mx.array(v).view(mx.bfloat16) for k, v in raw(path).items()}
        mx.eval(list(x.values()))
        return x

    def host_assembly(pool: ThreadPoolExecutor) -> None:
        hk = np.empty((layers, heads, b * n, dim), np.uint16)
        hv = np.empty_like(hk)

        def one(item):
            i, path = item
            x = raw(path)
            hk[:, :, i * b:(i + 1) * b], hv[:, :, i * b:(i + 1) * b] = x["k0"], x["v0"]
        list(pool.map(one, enumerate(files)))
        k, v = mx.array(hk).view(mx.bfloat16), mx.array(hv).view(mx.bfloat16)
        mx.eval(k * 1, v * 1)  # the device reads every byte

    for threads in (1, 4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed("bytes read", threads, lambda: list(pool.map(Path.read_bytes, files)))
    if args.pinned_only:
        pinned_rows(files, timed)
        console.print(table)
        shutil.rmtree(folder, ignore_errors=True)
        return
    for threads in (1, 4, 8):
        with ThreadPoolExecutor(threads) as pool:
            timed("arrays from the bytes + concatenate", threads,
                  lambda: concat(list(pool.map(from_bytes, files))))
    def mlx_read(path: Path) -> dict:
        x = mx.load(str(path))
        mx.eval(list(x.values()))  # on the reading thread, as the backend's readers do
        return x

    for threads in (1, 4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed("MLX's reader (mx.load) + concatenate", threads,
                  lambda: concat(list(pool.map(mlx_read, files))))

    def host_checked_read(path: Path) -> dict:  # a CUDA restore of a file without a dsum
        xxhash.xxh3_64(path.read_bytes()).hexdigest()
        return mlx_read(path)

    def device_checked_read(path: Path) -> dict:  # a CUDA restore of a file with one
        x = mlx_read(path)
        devsum.checksum(x)
        return x

    for threads in (4, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed("host read + xxh3, then MLX's reader + concatenate", threads,
                  lambda: concat(list(pool.map(host_checked_read, files))))
    for threads in (1, 4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed("MLX's reader + device checksum + concatenate", threads,
                  lambda: concat(list(pool.map(device_checked_read, files))))

    def checked_together(pool: ThreadPoolExecutor) -> None:  # a CUDA restore before pinned.py
        parts = list(pool.map(mlx_read, files))
        devsum.checksums(parts)
        concat(parts)

    for threads in (4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed("MLX's reader, then device checksums together + concatenate", threads,
                  lambda: checked_together(pool))

    pinned_rows(files, timed)

    # A layout with one K and one V array per layer (the tier stacks a block's layers
    # into one of each, as above): what the count of arrays costs MLX's reader.
    per_layer = [folder / f"{i}.layers.safetensors" for i in range(n)]
    for path in per_layer:
        k = mx.random.normal((heads, b, dim)).astype(mx.bfloat16)
        mx.save_safetensors(str(path), {f"{kv}{i}": k for i in range(layers) for kv in "kv"})
    for threads in (1, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            timed(f"MLX's reader, {2 * layers} arrays a block (one K, one V a layer)", threads,
                  lambda: list(pool.map(mlx_read, per_layer)))
    for threads in (4, 8):
        with ThreadPoolExecutor(threads) as pool:
            timed("host assembly, one array + device read", threads, lambda: host_assembly(pool))
    on_device = [from_bytes(p) for p in files]
    timed("concatenate blocks on the device", "-", lambda: concat(on_device))
    timed("device checksum of blocks on the device, one by one", "-",
          lambda: [devsum.checksum(x) for x in on_device])
    timed("device checksum of blocks on the device, together", "-", lambda: devsum.checksums(on_device))
    console.print(table)
    many = [{k: mx.random.normal((layers, heads, b, dim)).astype(mx.bfloat16) for k in ("k0", "v0")}
            for _ in range(980)]
    mx.eval(many)
    t0 = time.perf_counter()
    for _ in range(3):
        concat(many)
    each = (time.perf_counter() - t0) / 3
    whole = mx.concatenate([x["k0"] for x in many], axis=2)
    mx.eval(whole)
    t0 = time.perf_counter()
    for _ in range(3):
        mx.eval(mx.array(whole) + 0)
    copy = (time.perf_counter() - t0) / 3
    from kvroute.backend import join

    join.warm()
    mx.eval(join.join([x["k0"] for x in many]), join.join([x["v0"] for x in many]))
    t0 = time.perf_counter()
    for _ in range(3):
        mx.eval(join.join([x["k0"] for x in many]), join.join([x["v0"] for x in many]))
    joined = (time.perf_counter() - t0) / 3
    same = mx.array_equal(join.join([x["k0"] for x in many]), whole).item()
    console.print(f"980 blocks (31,360 tokens) concatenated on the device: {each * 1e3:.1f} ms; "
                  f"joined as a hit does (join.py, by kernel: {join.works()}): {joined * 1e3:.1f} ms, "
                  f"the same bytes: {same}; one copy of one of the two assembled arrays: "
                  f"{copy * 1e3:.1f} ms")
    shutil.rmtree(folder, ignore_errors=True)


def written_bench(args) -> None:
    import mlx.core as mx

    from kvroute.backend import diskfile, pinned_write

    layers, heads, dim, b = 28, 4, 128, 32  # Qwen2.5-7B's KV shape, one block
    n = args.blocks
    folder = Path(tempfile.mkdtemp(prefix="kvr-written-"))
    console = Console(width=200)
    console.print(f"{n} blocks; {platform.platform()}; {os.cpu_count()} cores; mlx {mx.__version__}, "
                  f"device {mx.default_device()}, CUDA path {diskfile.on_cuda()}")

    def make() -> list[dict]:
        parts = [{k: mx.random.normal((layers, heads, b, dim)).astype(mx.bfloat16) for k in ("k0", "v0")}
                 for _ in range(n)]
        mx.eval(parts)
        return parts

    def timed(fn) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        return time.perf_counter() - t0

    writer = pinned_write.Writer()
    writer.warm()  # where CUDA cannot pin memory (a CPU, a Mac) its row is left out

    def write(parts: list, mode: str) -> None:
        for i, x in enumerate(parts):
            path = folder / f"{i}.safetensors"
            if mode == "pinned":
                assert writer.save(path, x, {})
            elif mode == "copies":
                diskfile.save(path, x, {})
            else:
                mx.save_safetensors(str(path), x)

    concat(make())  # the kernels' first run, apart
    table = Table(title="a write, then the GPU's next reads of what it wrote")
    for col in ("written", "write ms", "1st concat ms", "2nd concat ms", "new blocks ms"):
        table.add_column(col, justify="right")
    rows = [("not written", None), ("as they are (the tier at first)", "as is"),
            ("from device copies (the tier before pinned writes)", "copies")]
    if writer.works():
        rows.append(("through pinned memory (the tier now)", "pinned"))
    for label, mode in rows + [("not written, again", None)]:
        mx.clear_cache()  # no row starts from buffers an earlier row left (managed memory)
        parts = make()
        wrote = timed(lambda: write(parts, mode)) if mode is not None else 0.0
        first, second = timed(lambda: concat(parts)), timed(lambda: concat(parts))
        parts = None  # freed: what follows allocates after them
        fresh = timed(lambda: mx.eval([mx.zeros((layers, heads, b, dim), mx.bfloat16) + i
                                       for i in range(2 * n)]))
        table.add_row(label, f"{wrote * 1e3:.1f}", f"{first * 1e3:.1f}", f"{second * 1e3:.1f}",
                      f"{fresh * 1e3:.1f}")
    console.print(table)
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


# -- beside ----------------------------------------------------------------------

class _WriterWork:
    """One part of the disk writer's work on `n` 32-token blocks of a model's shape
    (its full-attention KV, as the tier's pool stacks it), made on this process's
    device: each method does it once and returns the bytes it wrote."""

    def __init__(self, shape: str, n: int, folder: Path):
        import mlx.core as mx

        from kvroute.backend import diskblocks, diskfile
        from kvroute.backend.paged import Block

        cfg = SHAPES[shape]
        layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        self.Block, self.folder = Block, folder
        self.keys = iter(range(1, 1 << 62))
        self.blocks = [Block(next(self.keys), [(mx.random.normal((layers, heads, 32, dim)).astype(dtype),
                                                mx.random.normal((layers, heads, 32, dim)).astype(dtype))], 0)
                       for _ in range(n)]
        mx.eval([b.kv for b in self.blocks])
        self.block_bytes = sum(a.nbytes for pair in self.blocks[0].kv for a in pair)
        self.cuda = diskfile.on_cuda()
        folder.mkdir(parents=True, exist_ok=True)
        self.store = diskblocks.Blocks(folder, "beside", fsync=True)
        self.store.open()
        if self.cuda:  # as the tier opens: restores' buffer made, so no device sums
            self.store.staging.warm()
            self.store.writer.warm()
        self.host = os.urandom(self.block_bytes)

    def tier(self, paced: bool) -> int:
        from kvroute.backend.disk import MAX_PACE_WAIT, PACE

        store, last = self.store, [time.monotonic()]

        def between() -> None:  # the tier's pace under load (disk.py `_give_way`)
            spent = time.monotonic() - last[0]
            time.sleep(min(PACE * spent, MAX_PACE_WAIT))
            last[0] = time.monotonic()

        fresh = [self.Block(next(self.keys), b.kv, 0) for b in self.blocks]
        written = store.write(fresh, between if paced else None)
        store.release([b.key for b in fresh])  # deleted: the disk does not fill
        return written

    def copies(self) -> int:  # the kernel, the sums, the Python; the bytes to /dev/null
        from kvroute.backend import diskblocks

        writer = self.store.writer
        if not (self.cuda and writer.works()):
            raise RuntimeError("the pinned writer does not work here")
        done = 0
        for b in self.blocks:
            done += writer.save(Path(os.devnull), diskblocks.block_arrays(b),
                                {"kvroute_block": "{}"}).size
        return done

    def files(self) -> int:  # what the tier does to the drive, without the device
        from kvroute.backend import diskblocks, diskfile, pinned_write

        sub = self.folder / "files"
        sub.mkdir(exist_ok=True)
        paths = []
        for i in range(len(self.blocks)):
            p = sub / f"{i}.tmp"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pinned_write._write_all(fd, self.host)
            finally:
                os.close(fd)
            paths.append(p)
        diskblocks.fsync_files(paths)  # as `Blocks.write` fsyncs
        for i, p in enumerate(paths):
            os.replace(p, sub / f"{i}.done")
        diskfile._fsync_dir(sub)
        return len(paths) * self.block_bytes

    def python_only(self) -> int:  # the writer's Python work per file, nothing run
        import mlx.core as mx

        from kvroute.backend import diskblocks, pinned_write

        for b in self.blocks:
            arrays = diskblocks.block_arrays(b)
            pinned_write.header(arrays, {"kvroute_block": "{}"})
            [a.reshape(-1).view(mx.uint8) for a in arrays.values()]
        return 0

    def run(self, what: str) -> int:
        return {"tier": lambda: self.tier(False), "paced": lambda: self.tier(True),
                "copies": self.copies, "files": self.files, "python": self.python_only}[what]()


def _sibling(what: str, shape: str, n: int, folder: str, ready, stop, wrote, passes) -> None:
    """A second process on the same device doing `what` until `stop`: another
    backend's writer, as replicas sharing a card have."""
    import sys

    from kvroute.backend.boot import GPU_GIL_SWITCH_S

    sys.setswitchinterval(GPU_GIL_SWITCH_S)
    work = _WriterWork(shape, n, Path(folder))
    ready.set()
    while not stop.is_set():
        got = work.run(what)
        with wrote.get_lock():
            wrote.value += got
        passes.value += 1


def beside_bench(args) -> None:
    import multiprocessing
    import sys
    import threading

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kvroute.backend import diskfile
    from kvroute.backend.boot import GPU_GIL_SWITCH_S

    console = Console(width=200)
    dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    model = build(args.shape, dtype)
    if mx.default_device() == mx.gpu:
        sys.setswitchinterval(GPU_GIL_SWITCH_S)  # as a backend on a GPU runs
    console.print(f"{args.shape} ({dtype}), {args.tokens} tokens a decode, {args.blocks} blocks a write; "
                  f"{platform.platform()}; {os.cpu_count()} cores; mlx {mx.__version__}, device "
                  f"{mx.default_device()}, CUDA path {diskfile.on_cuda()}, switch interval "
                  f"{sys.getswitchinterval() * 1e3:.1f} ms")
    folder = Path(tempfile.mkdtemp(prefix="kvr-beside-"))
    work = _WriterWork(args.shape, args.blocks, folder / "here")
    prompt = mx.array(list(range(100, 100 + args.prompt)))

    def decode() -> float:
        t0, n = None, 0
        for _ in generate_step(prompt, model, max_tokens=args.tokens):
            n += 1
            if t0 is None:
                t0 = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t0)

    here = [("the tier's block writes, unpaced", "tier"), ("the tier's block writes, paced", "paced"),
            ("pinned copies and sums only (files to /dev/null)", "copies"),
            ("files only (host bytes: write, fsync, rename)", "files"),
            ("the writer's Python only", "python")]
    rows = [("nothing", None, False)] + [(label, what, False) for label, what in here
                                         if what != "copies" or work.cuda]
    # A sibling backend's writer: another process on the device (a GPU time-slices
    # between processes; kernels of one process's streams may run together).
    rows += [("another process: the tier's block writes, unpaced", "tier", True),
             ("another process: the tier's block writes, paced", "paced", True)]
    if work.cuda:
        rows.append(("another process: pinned copies and sums only", "copies", True))
    rows.append(("nothing, again", None, False))
    decode()  # kernels compiled, apart
    table = Table(title=f"a {args.tokens}-token decode beside the writer's work")
    for col in ("beside it", "tok/s", "vs nothing", "writer MB/s", "writes"):
        table.add_column(col, justify="right")
    base = None
    spawn = multiprocessing.get_context("spawn")
    for label, what, elsewhere in rows:
        stop = spawn.Event() if elsewhere else threading.Event()
        if elsewhere:  # a sibling's writer, started and ready before the decode
            ready, wrote, passes = spawn.Event(), spawn.Value("q", 0), spawn.Value("q", 0)
            worker = spawn.Process(target=_sibling, args=(what, args.shape, args.blocks,
                                                          str(folder / "sibling"), ready, stop,
                                                          wrote, passes))
            worker.start()
            if not ready.wait(300):
                raise RuntimeError("the sibling process did not start")
        elif what:
            wrote, passes, failed = [0], [0], []

            def loop() -> None:
                try:
                    while not stop.is_set():
                        wrote[0] += work.run(what)
                        passes[0] += 1
                except Exception as exc:  # the row fails, not silently at 0 writes
                    failed.append(exc)

            worker = threading.Thread(target=loop, daemon=True)
            worker.start()
        t0 = time.perf_counter()
        rate = decode()
        spent = time.perf_counter() - t0
        stop.set()
        if what:
            worker.join(120)
            if elsewhere and worker.exitcode != 0:
                raise RuntimeError(f"the sibling process exited {worker.exitcode}")
            if not elsewhere and failed:
                raise failed[0]
            got, count = (wrote.value, passes.value) if elsewhere else (wrote[0], passes[0])
        base = base or rate
        table.add_row(label, f"{rate:.1f}", f"{rate / base:.2f}x",
                      f"{got / spent / 1e6:.0f}" if what else "", str(count) if what else "")
        console.print(f"  {label}: {rate:.1f} tok/s", highlight=False)  # as it goes
    console.print(table)
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


# -- capacity --------------------------------------------------------------------


def capacity_bench(args) -> None:
    from kvroute.devtools import demo_model
    from kvroute.serve.redis_server import RedisServer
    from tests.harness import BackendProcess, post_json
    from tests.test_proxy import KEY, SECRET, TOKEN, ProxyProcess

    console = Console(width=200)
    model = args.model or str(demo_model.ensure("text"))
    table = Table(title=f"capacity-bound: {args.conversations} conversations × {args.turns} turns, "
                        f"3 backends, --cache-bytes {args.cache_bytes}")
    for col in ("disk tier", "prompt tokens", "cached tokens", "hit ratio", "turns 2+ hit ratio",
                "disk hits", "wall s"):
        table.add_column(col, justify="right")
    for disk in (False, True):
        with tempfile.TemporaryDirectory(prefix="kvr-cap-") as tmp:
            row = _capacity_run(Path(tmp), model, disk, args, BackendProcess, ProxyProcess,
                                RedisServer, post_json, KEY, SECRET, TOKEN)
        table.add_row("on" if disk else "off", *row)
    console.print(table)


def _capacity_run(tmp: Path, model: str, disk: bool, args, BackendProcess, ProxyProcess,
                  RedisServer, post_json, KEY, SECRET, TOKEN) -> list[str]:
    redis = RedisServer().start()
    backends = []
    proxy = None
    try:
        for i in range(3):
            extra = ["--cache-bytes", args.cache_bytes, "--redis-url", redis.url,
                     "--prefill-step", "256", "--secret", SECRET, "--internal-token", TOKEN]
            if disk:
                extra += ["--disk-cache-dir", str(tmp / f"disk-{i}")]
            b = BackendProcess(model, model_id="demo", log_dir=tmp, extra=extra, backend_id=f"cap-{i}")
            b.start()
            backends.append(b)
        proxy = ProxyProcess(redis.url, tmp)
        proxy.start(expect_backends=3)
        t0 = time.perf_counter()
        prompt = cached = later_prompt = later_cached = 0
        convs = [[{"role": "system", "content": f"{uuid.uuid4().hex} " + _system(i)}]
                 for i in range(args.conversations)]
        for turn in range(args.turns):
            for i, messages in enumerate(convs):
                messages.append({"role": "user", "content": f"Turn {turn}: step {i} of the plan?"})
                status, body = post_json(proxy.url + "/v1/chat/completions",
                                         {"model": "demo", "messages": messages, "max_tokens": 16,
                                          "temperature": 0},
                                         headers={"Authorization": f"Bearer {KEY}"})
                assert status == 200, body
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                p = body["usage"]["prompt_tokens"]
                c = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt, cached = prompt + p, cached + c
                if turn:
                    later_prompt, later_cached = later_prompt + p, later_cached + c
        wall = time.perf_counter() - t0
        disk_hits = sum(_metric(b, 'kvroute_backend_cache_hits_total{', 'tier="disk"') for b in backends)
        return [str(prompt), str(cached), f"{cached / prompt:.3f}",
                f"{later_cached / max(later_prompt, 1):.3f}", str(int(disk_hits)), f"{wall:.0f}"]
    finally:
        if proxy is not None:
            proxy.stop()
        for b in backends:
            b.stop()
        redis.stop()


def _system(i: int) -> str:
    return (f"You are agent {i} of a build team. Follow the plan, cite files by path, keep "
            "answers short, and never invent an API. The repository uses Python 3.11, "
            "aiohttp and MLX; tests run with pytest and real processes. ") * 6


def _metric(backend, prefix: str, label: str) -> float:
    from tests.harness import request

    text = request(backend.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and label in line)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_disk", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restore")
    r.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    r.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768])
    r.add_argument("--step", type=int, default=2048, help="prefill chunk")
    r.add_argument("--repeat", type=int, default=2)
    r.add_argument("--cold-repeat", type=int, default=1)
    r.add_argument("--dir", help="where the records go (default: a temporary folder)")
    r.add_argument("--prefill-up-to", type=int, default=0,
                   help="longer prompts get a random state of the true size, no cold prefill")
    r.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on a CPU")
    r.add_argument("--memory-limit", type=int, default=0, help="GiB MLX may use (0: its default)")
    t = sub.add_parser("tier")
    t.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    t.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[8192])
    t.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    t.add_argument("--step", type=int, default=2048, help="prefill chunk")
    t.add_argument("--cold-repeat", type=int, default=2)
    t.add_argument("--dir", help="where the tier's folders go (default: a temporary folder)")
    t.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on a CPU")
    t.add_argument("--memory-limit", type=int, default=0, help="GiB MLX may use (0: its default)")
    ps = sub.add_parser("paths")
    ps.add_argument("--blocks", type=int, default=250, help="32-token block files (250: 8k tokens)")
    ps.add_argument("--pinned-only", action="store_true",
                    help="only the bare reads and the rows through pinned memory (CUDA)")
    w = sub.add_parser("written")
    w.add_argument("--blocks", type=int, default=250, help="32-token blocks (250: 8k tokens)")
    b = sub.add_parser("beside")
    b.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    b.add_argument("--tokens", type=int, default=256, help="tokens a decode")
    b.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    b.add_argument("--blocks", type=int, default=100, help="32-token blocks a write")
    c = sub.add_parser("capacity")
    c.add_argument("--model", help="default: the demo model")
    c.add_argument("--cache-bytes", default="1MiB", help="RAM budget of each backend")
    c.add_argument("--conversations", type=int, default=12)
    c.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    {"restore": restore_bench, "tier": tier_bench, "paths": paths_bench,
     "written": written_bench, "beside": beside_bench,
     "capacity": capacity_bench}[args.cmd](args)


if __name__ == "__main__":
    main()
