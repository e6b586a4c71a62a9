"""A backend's life: load the model and build what serves it (`State`), wire the store
to the registry (the publishers and the record they publish), serve until stopped, then
withdraw from the registry before the last requests finish."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from kvroute.api.lifecycle import bind_sockets, start_site, wait_for_stop
from kvroute.config import BackendConfig
from kvroute.core import accel, prefix
from kvroute.core.registry import BackendRecord, Registry, new_instance_id

from .app import State, create_app
from .disk import open_disk_tier
from .engine import EXIT_DEVICE_LOST, Engine
from .grammar import Grammars
from .metrics import BackendMetrics
from .misses import Misses, template_opening
from .prompt import Template
from .publisher import Publisher
from .store import Store
from .vision import VisionModel, load_vision

log = logging.getLogger("kvroute.backend")

# The engine thread (MLX) and the event loop share the GIL, and when both want it
# Python hands it over only every switch interval (5 ms by default): a decode step
# that ended while the loop was writing tokens out waited up to that long to queue
# the next one. On an H200 (7B, through the proxy) one stream decoded at 112 tok/s
# with 5 ms and 180 tok/s with 0.5 ms; 8 streams 529 and 569 (BENCHMARKS.md). On a
# CPU, where MLX's own work competes for the cores, 0.5 ms cost a tiny model's single
# stream a quarter of its rate, so there the default stays.
GPU_GIL_SWITCH_S = 0.0005


# The longest prompt warm-up prefills on CUDA (Engine._warm_long): up to it, no full
# prefill chunk of a later prompt waits for an attention plan. A 64k-token prefill of a
# 7B model takes a few seconds on an H200, paid once at start instead of by the first
# users of each prompt length.
WARM_PREFILL_TOKENS = 65536
WARM_PREFILL_MEMORY = 0.1  # of the device's memory (or this process's limit), at most


def _warm_long_tokens(state: State) -> int:
    """Tokens of the long warm-up prompt (engine thread: measuring KV runs the model):
    the longest prompt this backend takes, within WARM_PREFILL_TOKENS and the memory
    its KV may use. 0 off CUDA, where attention builds no per-shape plans."""
    if not state.engine.on_cuda:
        return 0
    limit = min(state.config.max_prompt_tokens or state.context_length, state.context_length,
                WARM_PREFILL_TOKENS)
    memory = state.device.get("memory_limit") or state.device.get("memory") or 0
    try:
        per_token = state.engine.kv_bytes_per_token()[0]
    except Exception:
        log.warning("could not measure KV bytes per token; no long warm-up", exc_info=True)
        return 0
    if per_token > 0 and memory:
        limit = min(limit, int(memory * WARM_PREFILL_MEMORY / per_token))
    return limit


def load_state(config: BackendConfig) -> State:
    from mlx_lm import load

    t0 = time.perf_counter()
    device = accel.detect()
    limits = accel.apply_limits(config.memory_limit, config.cache_limit)
    config.prefill_step = config.prefill_step or (512 if device.kind == "cpu" else 2048)
    model, tokenizer, model_config = load(config.model, return_config=True)
    _evaluate_private_arrays(model)
    vision = load_vision(config.model, model_config, model, tokenizer)
    if vision is not None:  # the engine's model embeds the images of a prompt
        model = VisionModel(model, vision)
    config.model_id = config.model_id or Path(config.model.rstrip("/")).name
    # Hostname and port: unique across the Macs or containers of one deployment.
    config.backend_id = config.backend_id or f"{socket.gethostname().split('.')[0]}-{config.port}"
    context = int(model_config.get("max_position_embeddings") or 0) or 32768
    metrics_ = BackendMetrics(config.model_id, config.backend_id)
    store = Store(config.cache_bytes, quantization=config.cache_quantization)
    metrics_.l(metrics_.cache_budget).set(config.cache_bytes)

    def count_evictions(event) -> None:
        if event.kind == "evict" and event.reason == "evicted":
            metrics_.l(metrics_.evictions).inc()

    store.listeners.append(count_evictions)
    engine = Engine(
        model,
        tokenizer,
        config.model_id,
        store,
        metrics_,
        prefill_step=config.prefill_step,
        serial_prefill=config.long_prefill == "serial"
        or (config.long_prefill == "auto" and device.kind != "cpu"),
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        max_running_tokens=config.max_running_tokens,
        keep_buffers=device.kind != "cpu" and "cache_limit" in limits,
    )
    log.info("loaded %s in %.1fs (context %d)", config.model, time.perf_counter() - t0, context)
    disk = open_disk_tier(config.model, config.disk_cache_dir, config.disk_cache_bytes,
                          config.cache_bytes, store, metrics_, fsync=config.disk_fsync == "always")
    if disk is not None:
        def working() -> bool:
            return engine.queue_depth > 0

        disk.busy = working
        disk.prefilling = lambda: engine.answering
        if disk.board is not None:
            board = disk.board
            engine.load_listeners.append(lambda: board.set(working(), engine.prefilling))
    engine.misses = Misses(store, metrics_, disk, template_opening(tokenizer))
    template = Template(tokenizer, secret=config.secret, block_bytes=config.block_bytes,
                        checkpointing=engine.checkpointing,
                        images=vision.prompt if vision is not None else None)
    vocab_size = _vocab_size(model_config, tokenizer)
    grammars, missing = _grammars(tokenizer, vocab_size)
    return State(config, engine, template, metrics_, store, context, time.time(), new_instance_id(),
                 vocab_size=vocab_size, disk=disk, grammars=grammars, grammars_missing=missing,
                 vision=vision,
                 device={"kind": device.kind, "name": device.name, "memory": device.memory,
                         "prefill_step": config.prefill_step,
                         "serial_prefill": engine.serial_prefill, **limits})


def _grammars(tokenizer, vocab_size: int) -> tuple[Grammars | None, str]:
    """Constrained decoding's tokenizer view, built once; a model it cannot serve
    still serves every unconstrained request."""
    try:
        return Grammars(tokenizer, vocab_size), ""
    except Exception as e:
        log.warning("constrained decoding is off for this model: %s", e)
        return None, str(e)


def _evaluate_private_arrays(model) -> None:
    """Evaluate arrays that `load` leaves lazy: private attributes (e.g. YaRN's
    `_freqs` in gpt-oss and DeepSeek) are not parameters. Built on this loading
    thread, they would be evaluated on the engine thread, where MLX finds no
    stream of the thread that made them and every request fails."""
    import mlx.core as mx

    arrays = [v for _, module in model.named_modules()
              for k, v in [*module.items(), *vars(module).items()]
              if k.startswith("_") and isinstance(v, mx.array)]
    mx.eval(arrays)


def _vocab_size(model_config: dict, tokenizer) -> int:
    for cfg in (model_config, model_config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int) and cfg["vocab_size"] > 0:
            return cfg["vocab_size"]
    return int(tokenizer.vocab_size)  # the base vocabulary: never more rows than the logits


def start_publisher(state: State) -> Publisher:
    registry = Registry(state.config.redis_url)
    publisher = Publisher(registry, lambda: _record(state), state.store.snapshot)

    state.store.listeners.append(publisher.on_store_event)
    state.engine.load_listeners.append(publisher.beat_soon)
    m = state.metrics
    m.l(m.registry_failures).set_function(lambda: publisher.failures)
    m.l(m.registry_connected).set_function(lambda: float(publisher.connected))
    if state.disk is not None:
        state.disk_publisher = Publisher(registry, lambda: _record(state), state.disk.snapshot,
                                         tier="disk")
        state.disk.listeners.append(state.disk_publisher.on_store_event)
    m.l(m.registry_pending).set_function(
        lambda: publisher.pending + (state.disk_publisher.pending if state.disk_publisher else 0))
    return publisher


def _record(state: State) -> BackendRecord:
    c = state.config
    stats = state.store.stats()
    return BackendRecord(
        backend_id=c.backend_id,
        instance_id=state.instance_id,
        url=c.advertise_url or f"http://{c.host}:{c.port}",
        models=[c.model_id],
        cache_bytes=stats["bytes"],
        cache_budget=stats["budget_bytes"],
        cache_bytes_unshared=stats["bytes_unshared"],
        cache_blocks=stats["blocks"],
        waiting=state.engine.waiting,
        running=state.engine.queue_depth - state.engine.waiting,
        **_disk_record(state),
        prefill_tps=state.engine.prefill_tps,
        bytes_per_token=round(state.template.bytes_per_token, 3),
        decode_steps_per_s=round(state.engine.decode_steps_per_s, 2),
        reply_tokens=round(state.engine.reply_tokens, 1),
        decoding=state.engine.decoding,
        max_batch=state.engine.max_batch,
        **prefix.fingerprint(c.secret, c.block_bytes),
        tools_at=state.template.layout.tools_at,
        system_at=state.template.layout.system_at,
        tools_mark=state.template.layout.tools_mark,
        images=state.vision is not None,
        started_at=state.started,
        updated_at=time.time(),
    )


def _disk_record(state: State) -> dict:
    disk, m = state.disk, state.metrics
    hits = {f"{tier}_hits": int(m.l(m.hits, tier=tier)._value.get()) for tier in ("ram", "disk")}
    if disk is None:
        return hits
    return {**hits, "disk_bytes": disk.held_bytes, "disk_budget": disk.budget_bytes,
            "restore_tps": disk.restore_tps}


async def _first_sync(publishers: list[Publisher], timeout: float = 5.0) -> None:
    """Advertise what the store and the disk hold before serving, so a restarted
    backend is found by what it kept; past `timeout` (Redis down) serve anyway."""
    deadline = time.monotonic() + timeout
    while any(p.resyncs == 0 for p in publishers) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def _stop(state: State) -> int:
    """Stop the engine, then the disk tier (finishing the writes already queued, none
    on a lost GPU); the process's exit status (EXIT_DEVICE_LOST: restart it)."""
    await asyncio.to_thread(state.engine.stop)
    if state.disk is not None:
        await asyncio.to_thread(state.disk.close, write=not state.engine.lost)
    return EXIT_DEVICE_LOST if state.engine.lost else 0


async def serve(config: BackendConfig) -> int:
    """Serve until stopped; the process's exit status (EXIT_DEVICE_LOST: restart it)."""
    socks = bind_sockets(config.host, config.port)  # the port is ours from now on
    state = await asyncio.to_thread(load_state, config)
    if state.device["kind"] != "cpu":
        sys.setswitchinterval(GPU_GIL_SWITCH_S)
    if config.redis_url and not config.advertise_url and config.host in ("0.0.0.0", "::"):
        log.warning("listening on %s without --advertise-url: proxies will be told "
                    "http://%s:%d, which they cannot reach", config.host, config.host, config.port)
    if not config.secret and config.redis_url:
        log.warning("no --secret set: prefix keys in Redis are salted with a public default")
    # A lost GPU context (engine.device_lost): shut down as on SIGTERM, then exit with
    # EXIT_DEVICE_LOST so that `kvroute serve` (or systemd) starts a fresh process.
    state.engine.on_lost = lambda: os.kill(os.getpid(), signal.SIGTERM)
    state.engine.start()
    if not config.no_warmup:
        # Before the registry or a proxy hears of this backend: healthy means warm.
        try:
            seconds = await state.engine.call(lambda: state.engine.warm_up(_warm_long_tokens(state)))
        except Exception as exc:
            if not accel.device_lost(exc):
                raise
            # Lost before it served anything: it exits as one lost while serving does.
            log.critical("the GPU failed for good during warm-up (%s): exiting with status "
                         "%d so that it is restarted", exc, EXIT_DEVICE_LOST)
            state.engine.lost = str(exc)
            for sock in socks:
                sock.close()
            return await _stop(state)
        state.device["warmup_s"] = round(seconds, 2)
        log.info("warmed up in %.1fs (prefill step %d)", seconds, config.prefill_step)
    # How long a prompt one entry may hold under the budgets, said once at start.
    await state.engine.call(lambda: state.engine.describe_budgets(
        state.disk.budget_bytes if state.disk else 0, state.context_length))
    if config.redis_url:
        state.publisher = start_publisher(state)
        await state.publisher.start()
        if state.disk_publisher is not None:
            await state.disk_publisher.start()
        await _first_sync([p for p in (state.publisher, state.disk_publisher) if p])
    runner = await start_site(create_app(state), config.host, config.port, socks)
    log.info("backend %s serving %s on http://%s:%d", config.backend_id, config.model_id,
             config.host, config.port)
    await wait_for_stop()
    log.info("shutting down")
    if state.publisher is not None:
        # Withdraw this instance's advertisements first: no proxy should route here now.
        if state.disk_publisher is not None:
            await state.disk_publisher.stop(withdraw=True)
        await state.publisher.stop(withdraw=True)
        await state.publisher.registry.close()
    await runner.cleanup()  # lets in-flight requests finish, up to shutdown_timeout
    return await _stop(state)
