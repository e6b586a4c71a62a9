"""`kvroute serve`: Redis, backends and the proxy from one command, supervised.

The launcher resolves the models (building the demo model once when none is
given), checks each model's memory (kvroute/capacity.py), starts an embedded
`redis-server` when no Redis URL is given, then the proxy and the replicas of the
pinned and preloaded models as child processes; kvroute/loader.py starts and stops
the other models' replicas on demand. It prefixes each child's log lines with its name,
restarts a crashed child with backoff (a restarted backend is a new instance, so
it never inherits the old one's advertisements), and on Ctrl-C / SIGTERM stops
everything — proxy first, then backends (which withdraw their advertisements),
then Redis — within 10 seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvroute.core import accel, disk_space, redis_client
from . import capacity
from kvroute.devtools import demo_model
from .capacity import weights_bytes
from kvroute.config import (DEMO, ConfigError, ModelSpec, ServeConfig, fetch_variables,
                            limit_variables)
from .loader import Loader, Slot
from .processes import Child
from kvroute.api.lifecycle import health_body, health_pid
from kvroute.core.sizes import format_bytes
from .redis_server import RedisServer
STOP_GRACE = 7.0  # seconds children get to exit before SIGKILL (the whole stop stays < 10 s)
COLORS = ["cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan"]

log = logging.getLogger("kvroute.serve")

# -- models and memory ------------------------------------------------------------


def resolve_path(spec: ModelSpec, console: Console) -> str:
    if spec.path != DEMO:
        if spec.preload:  # one loaded on demand fails its load instead (state load_failed)
            capacity.check_model_path(spec.path)
        return spec.path
    with console.status(f"building the demo model ({spec.demo_variant}) ..."):
        return str(demo_model.ensure_apart(spec.demo_variant))


def replica_cost(spec: ModelSpec, path: str, device_kind: str = "cpu") -> capacity.Cost:
    return capacity.replica_cost(path, spec.cache_bytes, spec.max_batch, spec.max_prompt_tokens,
                                 spec.default_max_tokens, spec.max_running_tokens, device_kind)


def disk_dir(spec: ModelSpec, name: str) -> str:
    """Each backend's own disk-tier folder (a folder serves one process at a time):
    under the model's `disk_cache_dir`, else under the user's cache directory."""
    if spec.disk_cache_bytes <= 0:
        return ""
    base = Path(spec.disk_cache_dir).expanduser() if spec.disk_cache_dir else \
        demo_model.default_cache_dir() / "prompt-cache"
    return str(base / name)


def disk_budgets(backends: list[tuple[ModelSpec, str]]) -> tuple[dict[str, int], list[str]]:
    """Each backend's disk-tier budget by name (`disk_space.bound`: a default one at
    most its share of half its volume's free space), and a line per model saying so."""
    tiers = [(spec, name, disk_dir(spec, name)) for spec, name in backends]
    tiers = [t for t in tiers if t[2]]
    bounded = disk_space.bound([disk_space.Tier(folder, spec.disk_cache_bytes,
                                                spec.disk_budget_set)
                                for spec, _, folder in tiers])
    budgets, lines = {}, {}
    for (spec, name, folder), b in zip(tiers, bounded):
        budgets[name] = b.budget
        lines.setdefault(spec.alias, (
            f"disk tier of {spec.alias}: {format_bytes(b.budget)} per backend on "
            f"{Path(folder).parent} (free {format_bytes(b.free)}"
            + (f"; at most half of it, shared by {b.sharing} backends)" if b.bounded else ")")))
    return budgets, list(lines.values())


# -- child processes ----------------------------------------------------------------


def first_free_port(start: int, taken: set[int]) -> int:
    """The first port from `start` up that is not in `taken` and binds now: a serve's
    backends get consecutive ports from `--backend-port-base` (unlike
    redis_server.free_port, a random one below the ephemeral range)."""
    port = start
    while True:
        if port not in taken:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    pass
        port += 1


def kept_secret() -> str:
    """The prefix-key salt of this machine's deployments when none is configured: made
    once, kept (owner-only) in the cache directory. A disk tier's records carry their
    conversations' prefix keys under the salt they were written with: a new salt at
    each start would make every record unfindable to the proxy after a restart."""
    path = demo_model.default_cache_dir() / "prefix-secret"
    try:
        kept = path.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{32}", kept):
            return kept
    except OSError:
        pass
    secret = secrets.token_hex(16)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("prefix secret not kept (%s): disk-tier records will not be routed to "
                    "after a restart; set `secret` to keep one", exc)
    return secret


class Launcher:
    def __init__(self, config: ServeConfig, console: Console | None = None):
        self.config = config
        self.console = console or Console(stderr=True)
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url
        self.secret = config.secret or kept_secret()
        self.token = config.internal_token or secrets.token_hex(16)  # only this deployment's proxies reach its backends
        self.stopping = asyncio.Event()
        self.paths: dict[str, str] = {}
        self.proxy: Child | None = None
        self.loader: Loader | None = None
        self.initial: list[Slot] = []
        self.disk_notes: list[str] = []

    # -- start ------------------------------------------------------------------

    def prepare(self) -> list[str]:
        if self.redis_url:
            try:
                redis_client.check_url(self.redis_url)
            except ValueError as exc:
                raise ConfigError(f"--redis-url: {exc}") from None
        for spec in self.config.models:
            self.paths[spec.alias] = resolve_path(spec, self.console)
        aliases = [s.alias for s in self.config.models]
        if len(set(aliases)) != len(aliases):
            raise ConfigError(f"model aliases must be unique, got {aliases}")
        notes = [f"{spec.alias}: weights not on disk yet, not counted in the memory check"
                 for spec in self.config.models if weights_bytes(self.paths[spec.alias]) is None]
        self._plan(accel.probe())
        self.initial, more = self.loader.initial()
        return notes + [self._memory_note()] + self.disk_notes + more

    def _memory_note(self) -> str:
        """What the memory check counted, term by term: the figure to change is in it."""
        loader = self.loader
        lines = [capacity.line(s.alias, s.spec.replicas, s.cost) for s in loader.slots.values()]
        return (f"memory budget {format_bytes(loader.budget)} ({loader.budget_source}); "
                "each model:\n" + "\n".join(lines))

    def _common(self) -> list[str]:
        c = self.config
        out = ["--log-level", c.log_level]
        return out + (["--json-logs"] if c.json_logs else [])

    def _plan(self, device: accel.Accelerator) -> None:
        c = self.config
        costs = [replica_cost(spec, self.paths[spec.alias], device.kind) for spec in c.models]
        budget = capacity.budget(c.memory_budget, c.memory_fraction, device)
        if device.kind != "cpu":  # replicas share the card: each gets a cap (--memory-limit)
            needs = [cost.total for spec, cost in zip(c.models, costs) for _ in range(spec.replicas)]
            caps = iter(capacity.replica_limits(needs, budget[0]))
            for spec in c.models:
                mine = [next(caps) for _ in range(spec.replicas)]
                spec.memory_limit = spec.memory_limit or capacity.mlx_cap(min(mine), device.kind)
        taken: set[int] = {c.port}
        slots, i = [], 0
        names = {spec.alias: [f"{c.machine + '-' if c.machine else ''}{spec.alias}-{r + 1}"
                              for r in range(spec.replicas)] for spec in c.models}
        disk, self.disk_notes = disk_budgets(
            [(spec, name) for spec in c.models for name in names[spec.alias]])
        for spec, cost in zip(c.models, costs):
            children = []
            for name in names[spec.alias]:
                port = first_free_port(c.backend_port_base, taken)
                taken.add(port)
                args = [
                    "backend", "--model", self.paths[spec.alias], "--model-id", spec.alias,
                    "--host", c.backend_host, "--port", str(port), "--id", name,
                    "--advertise-url", f"http://{c.backend_host}:{port}",
                    *spec.backend_flags(), *self._common(),
                    "--disk-cache-dir", disk_dir(spec, name),
                    "--disk-cache-bytes", str(disk.get(name, 0)),
                ]
                children.append(Child(name, args, f"http://{c.backend_host}:{port}",
                                      COLORS[i % len(COLORS)], wanted=False))
                i += 1
            self.children += children
            slots.append(Slot(spec, children, cost))
        self.loader = Loader(self, slots, budget)
        args = ["proxy", "--host", c.host, "--port", str(c.port), "--policy", c.policy,
                "--load-timeout", str(c.load_timeout), "--limit-timeout-ms",
                str(c.limit_timeout_ms), *self._common()]
        keys = ",".join(f"{key}:{scope}" if scope else key for key, scope in c.api_keys.items())
        host = "127.0.0.1" if c.host in ("0.0.0.0", "::") else c.host
        self.proxy = Child("proxy", args, f"http://{host}:{c.port}", "bold white",
                           env={"KVROUTE_API_KEYS": keys, **limit_variables(c.limits),
                                **fetch_variables(c)})
        self.children.append(self.proxy)

    def repick_port(self, child: Child) -> None:
        """Before a backend starts on demand, long after the plan: another process may
        have taken its port since. Then it moves to the next free one."""
        host, _, port = child.url.rpartition(":")
        if first_free_port(int(port), set()) == int(port):
            return
        taken = {int(c.url.rpartition(":")[2]) for c in self.children} | {self.config.port}
        new = str(first_free_port(int(port) + 1, taken))
        i = child.args.index("--port")
        child.args[i + 1] = new
        j = child.args.index("--advertise-url")
        child.args[j + 1] = child.url = f"{host}:{new}"

    async def spawn(self, child: Child) -> None:
        # Secrets travel in the environment, not argv, which `ps` shows to every user: the
        # salt, the internal token, the Redis URL (it may hold a password), the API keys.
        env = {**os.environ, "KVROUTE_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
               "KVROUTE_SECRET": self.secret, "KVROUTE_INTERNAL_TOKEN": self.token,
               "KVROUTE_REDIS_URL": self.redis_url}
        env.pop("KVROUTE_API_KEYS", None)  # only the proxy gets them, from its own env below
        env.update({k: v for k, v in child.env.items() if v})
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which
        # then stops children in order; children watch the launcher's pid instead.
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", *child.args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        child.started = time.monotonic()
        child.pumps = [asyncio.create_task(self._pump(child, child.proc))]

    async def _pump(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            child.tail.append(text)
            self.log(child, text)

    def log(self, child: Child, line: str) -> None:
        if self.config.json_logs:
            try:
                record = orjson.loads(line)
                record["proc"] = child.name
                sys.stdout.write(orjson.dumps(record).decode() + "\n")
            except orjson.JSONDecodeError:
                sys.stdout.write(orjson.dumps({"proc": child.name, "msg": line}).decode() + "\n")
            sys.stdout.flush()
            return
        # A child's line is text, not markup: "[/x]" in a log line would raise here.
        self.console.print(f"[{child.color}]{child.name:>14}[/] │ {escape(line)}", markup=True,
                           highlight=False, soft_wrap=True)

    async def wait_healthy(self, children: list[Child], timeout: float,
                           enough: int | None = None) -> None:
        """Until every child (or `enough` of them) answers /health; RuntimeError, with
        the child's last log lines, when one exits or the timeout passes (or the
        deployment stops) before that."""
        deadline = time.monotonic() + timeout
        pending = list(children)
        need = len(children) if enough is None else min(enough, len(children))
        while True:
            for child in list(pending):
                if child.proc.returncode is not None:
                    await asyncio.gather(*child.pumps, return_exceptions=True)
                    # The last line: a traceback's exception, or the process's last word.
                    last = next((l.strip() for l in reversed(child.tail) if l.strip()), "")[-600:]
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode} while "
                                       f"starting" + (f": {last}" if last else ""))
                if await asyncio.to_thread(_healthy, child):
                    pending.remove(child)
            if len(children) - len(pending) >= need:
                return
            if self.stopping.is_set():
                raise RuntimeError("stopping")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout:.0f}s: "
                                   + ", ".join(c.name for c in pending))
            await asyncio.sleep(0.1)

    async def start(self) -> None:
        if not self.redis_url:
            self.redis = RedisServer()
            await asyncio.to_thread(self.redis.start)
            self.redis_url = self.redis.url
        await self.loader.start(self.redis_url)
        first = [c for slot in self.initial for c in slot.children]
        with self.console.status(f"starting {len(first)} backend(s) and the proxy ..."):
            t0 = time.monotonic()
            for child in [*first, self.proxy]:
                child.wanted = True
                await self.spawn(child)
            ups = [asyncio.create_task(self._first_up(slot, t0)) for slot in self.initial]
            try:
                await self.wait_healthy([*first, self.proxy], self.config.ready_timeout)
                await asyncio.gather(*ups)
            finally:
                for up in ups:
                    up.cancel()
        await self.loader.publish()
        self.print_ready()

    async def _first_up(self, slot: Slot, t0: float) -> None:
        """A model serves once one replica answers /health (its record is in Redis by
        then): published `loaded` at that moment, not when its slowest replica is."""
        await self.wait_healthy(slot.children, self.config.ready_timeout, enough=1)
        await self.loader.started(slot, time.monotonic() - t0)

    def print_ready(self) -> None:
        c = self.config
        proxy = self.proxy
        table = Table(title="kvroute is serving")
        for col in ("process", "model", "url", "pid"):
            table.add_column(col)
        for child in self.children:
            model = child.args[child.args.index("--model-id") + 1] if "--model-id" in child.args else "*"
            pid = str(child.proc.pid) if child.proc and child.wanted else "on demand"
            table.add_row(child.name, model, child.url, pid)
        table.add_row("redis", "", self.redis_url if self.redis else "(external)", "")
        self.console.print(table)
        model = c.models[0].alias
        key = next(iter(c.api_keys), "unused")
        self.console.print(
            f"\nOpenAI endpoint: [bold]{proxy.url}/v1[/]   models: {', '.join(m.alias for m in c.models)}\n"
            f"Try it:\n"
            f"  curl -s {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-H 'Authorization: Bearer {key}' \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
            f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{proxy.url}/v1', "
            f"api_key='{key}'); print(c.chat.completions.create(model='{model}', "
            f"messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)\"\n",
            highlight=False, soft_wrap=True,
        )

    # -- supervise ------------------------------------------------------------------

    async def supervise(self) -> None:
        await self.watch(self.proxy)  # backends are watched from their model's load

    async def watch(self, child: Child) -> None:
        """Restart `child` when it crashes, with backoff, until it is no longer wanted."""
        backoff = 1.0
        while not self.stopping.is_set() and child.wanted:
            code = await child.proc.wait()
            await asyncio.gather(*child.pumps, return_exceptions=True)
            if self.stopping.is_set() or not child.wanted:
                return
            if time.monotonic() - child.started > 60:
                backoff = 1.0  # it had been healthy a while: this is a fresh failure
            self.console.print(f"[red]{child.name} exited with {code}; restarting in {backoff:.0f}s[/]")
            try:
                await asyncio.wait_for(self.stopping.wait(), backoff)
                return
            except asyncio.TimeoutError:
                pass
            if not child.wanted:
                return
            backoff = min(backoff * 2, 30.0)
            child.restarts += 1
            await self.spawn(child)

    async def stop_children(self, children: list[Child]) -> None:
        """SIGTERM, then SIGKILL after the grace period: backends withdraw and drain."""
        deadline = time.monotonic() + STOP_GRACE
        for child in children:
            _signal(child, signal.SIGTERM)
        for child in children:
            await _wait_or_kill(child, max(0.5, deadline - time.monotonic()))

    # -- stop -------------------------------------------------------------------------

    async def stop(self) -> None:
        self.stopping.set()
        if self.loader is not None:
            await self.loader.stop()
        backends = [c for c in self.children if c is not self.proxy]
        deadline = time.monotonic() + STOP_GRACE
        for group in ([self.proxy], backends):  # no new requests first, then drain backends
            for child in group:
                _signal(child, signal.SIGTERM)
            for child in group:
                await _wait_or_kill(child, max(0.5, deadline - time.monotonic()))
        if self.redis is not None:
            await asyncio.to_thread(self.redis.stop)


def _signal(child: Child, sig: int) -> None:
    if child.proc is not None and child.proc.returncode is None:
        try:
            child.proc.send_signal(sig)
        except ProcessLookupError:
            pass


async def _wait_or_kill(child: Child, timeout: float) -> None:
    if child.proc is None:
        return
    try:
        await asyncio.wait_for(child.proc.wait(), timeout)
    except asyncio.TimeoutError:
        _signal(child, signal.SIGKILL)
        await child.proc.wait()
    await asyncio.gather(*child.pumps, return_exceptions=True)


def _healthy(child: Child) -> bool:
    # Its own answer: another server already on the port (this child then fails to
    # bind and exits) must not pass for it.
    return health_pid(health_body(child.url, timeout=1)) == child.proc.pid


async def run(config: ServeConfig, console: Console | None = None) -> int:
    launcher = Launcher(config, console)
    notes = await asyncio.to_thread(launcher.prepare)
    for note in notes:
        launcher.console.print(f"[yellow]note:[/] {escape(note)}")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, launcher.stopping.set)
    supervisor = None
    try:
        try:
            await launcher.start()
        except RuntimeError:
            if launcher.stopping.is_set():
                return 0  # stopped while starting: the finally below leaves no process
            raise
        supervisor = asyncio.create_task(launcher.supervise())
        await launcher.stopping.wait()
        launcher.console.print("stopping ...")
    finally:
        await launcher.stop()
    if supervisor is not None:
        await asyncio.gather(supervisor, return_exceptions=True)
    return 0
