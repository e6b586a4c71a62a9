"""Settings of every `kvroute` command, in one table per command.

Each `Setting` names its flag, its `KVROUTE_*` variable and its key in the TOML
file (`kvroute serve --config`); the command-line parsers, the environment and the
file are all read through these tables, so a default or a name lives in one place.
A flag beats the environment, which beats the file, which beats the default.

An unknown key in the file, or a `KVROUTE_*` variable that no command knows, is an
error that names it: a typo must not silently fall back to a default.

Why one module of about 700 lines: it is the one table of every setting. Several
settings are shared by commands (the secret, the block size, the body limit, the
internal token), and one set of rules (precedence, conversion, the unknown-name check)
reads them all; split by command, a setting's name, default and help would live in
more than one place again. Most of its length is the tables themselves.

The file (every key optional):

    secret = "change-me"                 # salts prefix keys; unset: one kept in the cache dir
    memory_fraction = 0.85               # of the GPU's (else physical) memory weights and caches may take

    [redis]
    url = "redis://127.0.0.1:6379/0"     # unset: an embedded redis-server on a free port

    [proxy]
    host = "127.0.0.1"
    port = 8000
    policy = "cache-aware"
    api_keys = ["sk-team-a:team-a", "sk-ops:operator"]   # KEY or KEY:SCOPE; operator: /stats too

    [backends]
    host = "127.0.0.1"
    port_base = 8100                     # replicas take the next free ports from here

    [limits]                             # per scope, API key, or * (each other team)
    requests_per_minute = ["team-a=600"]
    tokens_per_day = ["team-a=5000000", "*=1000000"]

    [[models]]
    path = "mlx-community/Qwen2.5-7B-Instruct-4bit"   # a local path, a repo id, or "demo"
    alias = "qwen-7b"                    # the `model` name clients send
    replicas = 2
    cache_bytes = "8GiB"                 # and any other MODEL_SETTINGS key
    pin = false                          # true: loaded at start, never unloaded
    preload = true                       # false: loaded on its first request
    idle_unload = "30m"                  # unloaded after this long unused ("0": never)

Loading on demand (see the README's "Many models"): `max_loaded_models` and
`memory_budget` at the top level bound what one machine holds at once.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from .core.durations import parse_duration
from .core.images import MAX_IMAGE_BYTES
from .core.prefix import DEFAULT_BLOCK_BYTES
from .core.sizes import parse_bytes

DEMO = "demo"
POLICIES = ("cache-aware", "round-robin", "least-loaded", "random")
LOG_LEVELS = ("debug", "info", "warning", "error")

# KVROUTE_* variables that are not settings; any other unknown one is an error.
OTHER_VARIABLES = {
    "KVROUTE_CACHE_DIR": "where the demo model is built (default ~/.cache/kvroute)",
    "KVROUTE_PARENT_PID": "set by `kvroute serve` for its children, which exit with it",
    "KVROUTE_SOAK": "tests: run the reliability suite at full size",
    "KVROUTE_FUZZ_EXPLORE": "tests: draw fresh fuzzing examples",
    "KVROUTE_SAVE_SCREENSHOT": "tests: keep the dashboard test's screenshot",
}


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says what to change."""


def parse_api_keys(values: list[str]) -> dict[str, str | None]:
    """`KEY` or `KEY:SCOPE`; a scope keeps that key's cache apart from other scopes."""
    keys: dict[str, str | None] = {}
    for value in values:
        key, _, scope = str(value).strip().partition(":")
        if key:
            keys[key] = scope or None
    return keys


def parse_limit(value: Any) -> tuple[str, int]:
    """`TARGET=N` (a usage limit): TARGET a scope, an API key, or `*`."""
    if isinstance(value, tuple):
        return value
    target, sep, number = str(value).strip().rpartition("=")
    if not sep or not target.strip():
        raise ValueError("expected TARGET=N")
    n = int(number)
    if n < 0:
        raise ValueError("a limit is 0 (none) or more")
    return target.strip(), n


def parse_models(value: Any) -> tuple[str, tuple[str, ...]]:
    """`TARGET=MODEL[;MODEL...]`: the only models TARGET may use."""
    if isinstance(value, tuple):
        return value
    target, sep, models = str(value).strip().rpartition("=")
    names = tuple(m.strip() for m in models.split(";") if m.strip())
    if not sep or not target.strip() or not names:
        raise ValueError("expected TARGET=MODEL[;MODEL...]")
    return target.strip(), names


def parse_fetch_allow(value: Any) -> str:
    """A host name, an address or a network (CIDR) image fetching may reach."""
    import ipaddress

    text = str(value).strip().lower()
    try:
        return str(ipaddress.ip_network(text.strip("[]"), strict=False))
    except ValueError:
        pass
    if not text or any(c in text for c in "/:@ ?#") or text.startswith("."):
        raise ValueError("expected a host name, an address or a network like 10.0.0.0/8")
    return text.rstrip(".")


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _ON + _OFF:  # KVROUTE_JSON_LOGS=of must not mean "on"
        raise ValueError("a switch: 1/0, true/false, yes/no or on/off")
    return word in _ON


@dataclass(frozen=True)
class Setting:
    name: str  # the attribute of the resolved settings (and of the command's config)
    type: Callable[[Any], Any]  # converts a flag, variable or file value (each item when many)
    default: Any
    help: str
    flag: str | None = None  # e.g. "--cache-bytes"
    env: str | None = None  # e.g. "KVROUTE_CACHE_BYTES"
    toml: str | None = None  # "secret", "proxy.port"; "models.x" is a [[models]] key
    choices: tuple | None = None
    metavar: str | None = None
    many: bool = False  # repeatable flag, comma list in the variable, array in the file
    switch: bool = False  # a flag without a value; the variable is 1/0, true/false, ...

    def convert(self, value: Any, where: str, from_file: bool = False) -> Any:
        if from_file:
            self._check_file_type(value, where)
        try:
            if self.switch:
                return _switch(value)
            if self.many:
                items = value.split(",") if isinstance(value, str) else list(value)
                return [self.type(v) for v in items if str(v).strip()]
            if self.type is int and (isinstance(value, bool) or
                                     isinstance(value, float) and not value.is_integer()):
                raise ValueError("not a whole number")  # int() would quietly cut 80.5 to 80
            out = self.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"{where}: invalid value {value!r} ({exc})") from None
        if self.choices and out not in self.choices:
            raise ConfigError(f"{where}: {out!r} is not one of {', '.join(self.choices)}")
        return out

    def _check_file_type(self, value: Any, where: str) -> None:
        """TOML has types, and a file's value is taken as written: `replicas = "2"` or
        `pin = "yes"` is a mistake to point out, not a string to convert (the
        environment's values are all strings, and those are converted)."""
        items = [value]
        if self.switch or self.type in (bool, _switch):
            want = None if isinstance(value, bool) else "true or false, without quotes"
        elif self.many:
            want = None if isinstance(value, list) else "an array, [...]"
            items = value if isinstance(value, list) else []
        else:
            want = None
        kinds = _FILE_KINDS.get(self.type)
        if want is None and kinds and any(isinstance(v, bool) or not isinstance(v, kinds[0])
                                         for v in items):
            want = kinds[1]
        if want:
            raise ConfigError(f"{where}: invalid value {value!r} (expected {want})")


def _opt(name: str, type_: Callable, default: Any, help_: str, *, env: bool | str = True,
         **kw) -> Setting:
    """A setting with a flag named after it and, unless env=False, KVROUTE_<FLAG>."""
    flag = kw.pop("flag", "--" + name.replace("_", "-"))
    if env is True:
        env = "KVROUTE_" + flag[2:].upper().replace("-", "_")
    return Setting(name, type_, default, help_, flag=flag, env=env or None, **kw)


def parse_cache_bits(value: Any) -> int:
    """`cache_quantization`: 0 (exact), 8 or 4 bits."""
    bits = int(value)
    if bits not in (0, 4, 8):
        raise ValueError("0 (exact), 8 or 4")
    return bits


def _unknown(what: str, name: str, known: set[str]) -> ConfigError:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"did you mean {close[0]}?" if close else "known: " + ", ".join(sorted(known))
    return ConfigError(f"unknown {what} {name} ({hint})")


_LOG_LEVEL = _opt("log_level", str, "info", "logging level", choices=LOG_LEVELS)
_JSON_LOGS = _opt("json_logs", bool, False, "log one JSON object per line", switch=True)
_SECRET = _opt("secret", str, "", "salt of the prefix keys; the same on every proxy and backend")
_BLOCK_BYTES = _opt("block_bytes", int, DEFAULT_BLOCK_BYTES, "prefix-key block size in bytes; the same everywhere")
_MAX_BODY = _opt("max_body_bytes", parse_bytes, 8 << 20, "largest accepted request body")
def positive_seconds(value: Any) -> float:
    """A duration in seconds that must be more than 0 (a wait of 0 would fail at once)."""
    seconds = float(value)
    if not seconds > 0:  # also NaN
        raise ValueError("seconds, more than 0")
    return seconds


# What a file's value must be for a setting of each type: (TOML's types, as said).
_FILE_KINDS: dict[Callable, tuple[tuple[type, ...], str]] = {
    int: ((int,), "a whole number, without quotes"),
    float: ((int, float), "a number, without quotes"),
    positive_seconds: ((int, float), "a number of seconds, without quotes"),
    str: ((str,), "a string")}


_LOAD_TIMEOUT = _opt("load_timeout", positive_seconds, 300.0, "seconds a request waits while its model "
                     "loads on demand", toml="proxy.load_timeout")
_TOKEN = _opt("internal_token", str, "", "token shared by proxies and backends (x-kvroute-token)")

# Images by URL (kvroute/proxy/image_fetch.py): the proxy fetches them only when told to.
_FETCH = [
    _opt("fetch_images", bool, False, "fetch http(s) image URLs of requests and send them on "
         "inline (off: only data: URLs are taken)", switch=True, toml="proxy.fetch_images"),
    _opt("fetch_images_allow", parse_fetch_allow, [], "a host name or network (CIDR) image "
         "fetching may reach although it is loopback, private, link-local or reserved "
         "(repeatable; the variable takes a comma list)", many=True, metavar="HOST_OR_CIDR",
         toml="proxy.fetch_images_allow"),
    _opt("fetch_images_timeout", float, 10.0, "seconds one image fetch may take, redirects "
         "included", toml="proxy.fetch_images_timeout"),
    _opt("fetch_images_max_bytes", parse_bytes, MAX_IMAGE_BYTES, "largest fetched image",
         toml="proxy.fetch_images_max_bytes"),
]
FETCH_NAMES = tuple(s.name for s in _FETCH)

# Usage limits (kvroute/proxy/limits.py), shared by every proxy through Redis. TARGET is
# a scope, an API key, or `*`: every team without a rule of its own, each apart.
_TARGET = "; TARGET: a scope, an API key, or * (each team without a rule of its own)"
_LIMITS = [
    _opt("requests_per_minute", parse_limit, [], "requests a minute TARGET may begin" + _TARGET,
         many=True, metavar="TARGET=N", toml="limits.requests_per_minute"),
    _opt("tokens_per_minute", parse_limit, [], "prompt and generated tokens a minute TARGET "
         "may use" + _TARGET, many=True, metavar="TARGET=N", toml="limits.tokens_per_minute"),
    _opt("tokens_per_day", parse_limit, [], "prompt and generated tokens a UTC day TARGET may "
         "use" + _TARGET, many=True, metavar="TARGET=N", toml="limits.tokens_per_day"),
    _opt("concurrent_requests", parse_limit, [], "requests TARGET may have in flight at once"
         + _TARGET, many=True, metavar="TARGET=N", toml="limits.concurrent_requests"),
    _opt("allowed_models", parse_models, [], "the only models TARGET may use" + _TARGET,
         many=True, metavar="TARGET=MODEL[;MODEL...]", toml="limits.allowed_models"),
]
LIMIT_NAMES = tuple(s.name for s in _LIMITS)
_LIMIT_TIMEOUT = _opt("limit_timeout_ms", float, 250.0, "how long a usage-limit check waits for "
                      "Redis; past it this proxy decides alone from its own counts",
                      toml="limits.timeout_ms")

# `kvroute backend`. Settings with a `models.` key are also per-model keys of the file.
BACKEND = [
    _opt("model", str, "", "local path or Hugging Face repo id; default: the built-in demo model"),
    _opt("model_id", str, "", "the name clients send as 'model' (default: last part of --model, "
         "or 'kvroute-demo')"),
    _opt("host", str, "127.0.0.1", "bind address"),
    _opt("port", int, 8100, "port"),
    _opt("backend_id", str, "", "stable backend id, unique in the deployment (default "
         "<hostname>-<port>)", flag="--id"),
    _opt("cache_bytes", parse_bytes, 2 << 30, "byte budget of the prompt-cache store, e.g. 512MiB, "
         "8GiB", toml="models.cache_bytes"),
    _opt("cache_quantization", parse_cache_bits, 0, "store the prompt cache's full-attention "
         "blocks quantized to 8 or 4 bits (0: exact); more conversations per byte, but a hit "
         "then answers slightly differently from a cold prefill (docs/CACHING.md)",
         toml="models.cache_quantization"),
    # The disk tier (docs/SSD_TIER.md). Not `cache_dir`: KVROUTE_CACHE_DIR already names
    # where the demo model is built.
    _opt("disk_cache_dir", str, "", "directory of the disk tier: committed caches also go there "
         "and survive evictions and restarts; one per backend process (empty: RAM only; "
         "`kvroute serve` defaults to a folder under the user's cache directory)",
         toml="models.disk_cache_dir"),
    _opt("disk_cache_bytes", parse_bytes, 32 << 30, "byte budget of the disk tier (0: off)",
         toml="models.disk_cache_bytes"),
    _opt("disk_fsync", str, "always", "when the disk tier's records reach the drive: 'always' "
         "(each file and its folder fsynced as it is written: a power loss keeps every record "
         "written) or 'never' (the kernel writes back in its own time: a power loss may lose "
         "the newest records; the checksums drop any it damaged)", choices=("always", "never"),
         toml="models.disk_fsync"),
    _opt("prefill_step", int, 0, "tokens per prefill chunk; decoding of other requests "
         "interleaves between chunks (0: 2048 on a GPU, 512 on the CPU)", toml="models.prefill_step"),
    _opt("long_prefill", str, "auto", "prompts with more than one chunk to prefill: 'serial' "
         "(one at a time, unpadded on the fused attention kernel), 'batched' (together, "
         "padded), 'auto' (serial on a GPU, batched on the CPU)",
         choices=("auto", "serial", "batched"), toml="models.long_prefill"),
    _opt("memory_limit", parse_bytes, 0, "cap on this backend's MLX memory, e.g. 40GiB (0: MLX's "
         "default; `serve` gives each replica its share of the accelerator)",
         toml="models.memory_limit"),
    _opt("cache_limit", parse_bytes, 0, "MLX buffer cache kept for reuse (0: a tenth of "
         "--memory-limit)", toml="models.cache_limit"),
    _opt("no_warmup", bool, False, "report healthy without first compiling kernels of typical "
         "shapes", switch=True),
    _opt("max_batch", int, 32, "sequences decoded together", toml="models.max_batch"),
    _opt("max_running_tokens", int, 262144, "KV tokens the running sequences may hold at "
         "once (each counts its prompt and completion cap): a request beyond it waits for "
         "room, and one always runs alone; the memory check counts it (0: no limit but "
         "max_batch)", toml="models.max_running_tokens"),
    _opt("max_queue", int, 64, "requests admitted at once; more get 429", toml="models.max_queue"),
    _MAX_BODY,
    _opt("max_prompt_tokens", int, 0, "longest accepted prompt (0: the model's context length)",
         toml="models.max_prompt_tokens"),
    _opt("default_max_tokens", int, 4096, "completion cap when a request sets none",
         toml="models.default_max_tokens"),
    _opt("redis_url", str, "", "registry to advertise the cache in (redis://, rediss://, "
         "redis+cluster://, redis+sentinel://); empty: serve alone"),
    _SECRET,
    _opt("advertise_url", str, "", "URL proxies use to reach this backend (default http://HOST:PORT)"),
    _TOKEN,
    _BLOCK_BYTES,
    _opt("demo_variant", str, "text", "which demo model to build when --model is not given",
         choices=("text", "tool"), toml="models.demo_variant"),
    _opt("enable_faults", bool, False, "testing only: honour the 'kvroute_fault' request field",
         switch=True),
    _LOG_LEVEL,
    _JSON_LOGS,
]

PROXY = [
    _opt("redis_url", str, "", "the registry backends advertise in (redis://, rediss://, "
         "redis+cluster://, redis+sentinel://); required"),
    _opt("host", str, "127.0.0.1", "bind address"),
    _opt("port", int, 8000, "port"),
    _SECRET,
    _opt("policy", str, "cache-aware", "routing policy", choices=POLICIES),
    _opt("api_keys", str, [], "accept this API key (repeatable; the variable takes a comma list); "
         "a SCOPE isolates the key's prompt cache from other scopes; the SCOPE `operator` may "
         "also read /stats (the dashboard's data)", flag="--api-key",
         env="KVROUTE_API_KEYS", many=True, metavar="KEY[:SCOPE]"),
    _TOKEN,
    _MAX_BODY,
    _opt("request_timeout", float, 600.0, "seconds a backend may stay silent before the request fails"),
    _BLOCK_BYTES,
    _opt("lookup_timeout_ms", float, 50.0, "registry lookup deadline; past it, route by load"),
    _opt("locality_slack", float, 1.0, "seconds of extra estimated TTFT accepted to keep a prefix hit"),
    _opt("response_ttl", float, 86400.0, "seconds a stored /v1/responses answer can be continued "
         "from with previous_response_id"),
    _LOAD_TIMEOUT,
    *_FETCH,
    *_LIMITS,
    _LIMIT_TIMEOUT,
    _LOG_LEVEL,
    _JSON_LOGS,
]

# `kvroute serve`: the deployment. Not every flag has a variable (see the README).
SERVE = [
    _opt("config", str, "", "TOML file (see the README)"),
    _opt("models", str, [], "serve this model (repeatable); replaces the file's [[models]]",
         flag="--model", env=False, many=True, metavar="PATH_OR_REPO"),
    _opt("replicas", int, None, "backend processes per model (default 2 for the bare demo model, "
         "else the file's, else 1)", env=False),
    _opt("cache_bytes", parse_bytes, None, "prompt-cache budget of each backend (default: the "
         "file's, else 2GiB)", env=False),
    _opt("host", str, "127.0.0.1", "proxy bind address", toml="proxy.host"),
    _opt("port", int, 8000, "proxy port", toml="proxy.port"),
    _opt("policy", str, "cache-aware", "routing policy", choices=POLICIES, toml="proxy.policy"),
    _opt("api_keys", str, [], "require API keys on the proxy (repeatable; the variable takes a "
         "comma list); a key of SCOPE `operator` may also read /stats", flag="--api-key",
         env="KVROUTE_API_KEYS", many=True, metavar="KEY[:SCOPE]",
         toml="proxy.api_keys"),
    _opt("redis_url", str, "", "use this Redis instead of an embedded one", toml="redis.url"),
    _opt("secret", str, "", "prefix-key salt (default: made once, kept in the cache "
         "directory, so disk-tier records stay routable across restarts)", toml="secret"),
    _opt("prefill_step", int, None, "tokens per prefill chunk of every backend (default: the "
         "file's, else 2048 on a GPU and 512 on the CPU)", env=False),
    # Per-model settings a newcomer needs on the command line: each one, when given,
    # replaces every model's (file) value; KVROUTE_<FLAG> also reaches `kvroute backend`.
    _opt("max_batch", int, None, "sequences each backend decodes together (default: the "
         "file's, else 32)"),
    _opt("max_prompt_tokens", int, None, "longest prompt each backend accepts (default: the "
         "file's, else 0: the model's context)"),
    _opt("max_running_tokens", int, None, "KV tokens each backend's running sequences may hold "
         "at once; what the memory check counts (default: the file's, else 262144; 0: "
         "max_batch x context)"),
    Setting("backend_host", str, "127.0.0.1", "backends' bind address", toml="backends.host"),
    _opt("backend_port_base", int, 8100, "first port tried for backends", env=False,
         toml="backends.port_base"),
    Setting("memory_fraction", float, 0.85, "of the accelerator's memory (a GPU's own, else "
            "physical memory) that weights and caches may take; each replica's MLX memory "
            "is capped at its share", toml="memory_fraction"),
    # Loading on demand.
    _opt("max_loaded_models", int, 0, "models loaded at once; loading another unloads the least "
         "recently used unpinned one (0: no limit)", toml="max_loaded_models"),
    _opt("memory_budget", parse_bytes, 0, "bytes loaded models may take, by the accounting of "
         "weights, caches, running KV and process (0: memory_fraction of the accelerator's "
         "memory: physical memory on a CPU)",
         toml="memory_budget"),
    _opt("machine", str, "", "this machine's name when several share one Redis: prefixes its "
         "backend ids and names it in model states", toml="machine"),
    _opt("internal_token", str, "", "token between proxies and backends; the same on every "
         "machine sharing one Redis (default: random per launch)", toml="internal_token"),
    _opt("idle_unload", parse_duration, None, "unload every model unused this long, e.g. 30m "
         "(default: the file's per model, else never)", env=False),
    _LOAD_TIMEOUT,
    *_FETCH,
    *_LIMITS,
    _LIMIT_TIMEOUT,
    _opt("log_level", str, "info", "logging level", choices=LOG_LEVELS),
    _opt("json_logs", bool, False, "one JSON object per log line, with the process name",
         switch=True),
]

STATS = [
    _opt("url", str, "http://127.0.0.1:8000", "the proxy"),
    # No flag: a key on a command line shows in `ps`.
    Setting("api_key", str, "", "the key sent to a proxy with API keys: one of scope "
            "`operator`", env="KVROUTE_API_KEY"),
]

# Keys of one [[models]] table: these, and the backend settings with a `models.` key.
MODEL_SETTINGS = [
    Setting("path", str, DEMO, "a local path, a Hugging Face repo id, or \"demo\"", toml="models.path"),
    Setting("alias", str, "", "the `model` name clients send (default: last part of path)",
            toml="models.alias"),
    Setting("replicas", int, 1, "backend processes of this model", toml="models.replicas"),
    Setting("kv_bits", int, None, "refused: mlx-lm cannot batch quantized KV caches",
            toml="models.kv_bits"),
    Setting("pin", _switch, False, "loaded at start and never unloaded", toml="models.pin"),
    Setting("preload", _switch, True, "loaded at start when it fits; false: on its first "
            "request", toml="models.preload"),
    Setting("idle_unload", parse_duration, 0.0, "unloaded after this long without a request, "
            "e.g. \"30m\" (0: never)", toml="models.idle_unload"),
] + [s for s in BACKEND if s.toml and s.toml.startswith("models.")]

TABLES = {"backend": BACKEND, "proxy": PROXY, "serve": SERVE, "stats": STATS}


# -- the command line ------------------------------------------------------------------


def _default_text(s: Setting) -> str:
    if s.switch or s.default in (None, "", []):
        return ""
    if s.type is parse_bytes:
        from .core.sizes import format_bytes

        return f"default {format_bytes(s.default).replace(' ', '').replace('.0', '')}"
    return f"default {s.default}"


def add_flags(parser: argparse.ArgumentParser, table: list[Setting]) -> None:
    """One flag per setting that has one. Every default is None, so that resolve()
    can tell a flag that was given from one that was not."""
    for s in table:
        if not s.flag:
            continue
        notes = [n for n in (_default_text(s), s.env and f"env {s.env}") if n]
        help_ = s.help + (f" ({'; '.join(notes)})" if notes else "")
        kw: dict[str, Any] = {"dest": s.name, "default": None, "help": help_}
        if s.switch:
            kw["action"] = "store_true"
        else:
            kw.update(type=s.type, metavar=s.metavar, choices=s.choices)
            if s.many:
                kw["action"] = "append"
        parser.add_argument(s.flag, **kw)


def resolve(table: list[Setting], flags: argparse.Namespace | Mapping[str, Any],
            env: Mapping[str, str], file: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each setting's value: the flag, else the variable, else the file, else the default."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else flags
    out: dict[str, Any] = {}
    for s in table:
        value = given.get(s.name)
        if value is not None and s.many:
            value = s.convert(value, s.flag or s.name)
        if value is None and s.env and env.get(s.env, "") != "":
            value = s.convert(env[s.env], s.env)
        if value is None and file is not None and s.toml and not s.toml.startswith("models."):
            section, _, key = s.toml.rpartition(".")
            table_ = file.get(section, {}) if section else file
            if key in table_:
                value = s.convert(table_[key], f"{s.toml} in the config file", from_file=True)
        out[s.name] = s.default if value is None else value
    return out


def check_environment(env: Mapping[str, str]) -> None:
    known = {s.env for table in TABLES.values() for s in table if s.env} | set(OTHER_VARIABLES)
    for name in sorted(env):
        if name.startswith("KVROUTE_") and name not in known:
            raise _unknown("environment variable", name, known)


# -- kvroute backend ----------------------------------------------------------------------


_BACKEND = {s.name: s.default for s in BACKEND}


@dataclass(kw_only=True)
class BackendConfig:
    """`kvroute backend`'s settings, from the BACKEND table; the backend fills in those
    left empty or 0 that it derives (model_id, backend_id, prefill_step) as it loads."""

    model: str = _BACKEND["model"]
    host: str = _BACKEND["host"]
    port: int = _BACKEND["port"]
    backend_id: str = _BACKEND["backend_id"]  # empty: <hostname>-<port>
    model_id: str = _BACKEND["model_id"]  # the name clients use; empty: the model path's last part
    cache_bytes: int = _BACKEND["cache_bytes"]
    cache_quantization: int = _BACKEND["cache_quantization"]  # 0: exact; 8, 4: bits a block
    disk_cache_dir: str = _BACKEND["disk_cache_dir"]  # the disk tier's folder; empty: RAM only
    disk_cache_bytes: int = _BACKEND["disk_cache_bytes"]
    disk_fsync: str = _BACKEND["disk_fsync"]  # always or never (docs/SSD_TIER.md, Durability)
    prefill_step: int = _BACKEND["prefill_step"]  # 0: by platform (GPU 2048, CPU 512)
    long_prefill: str = _BACKEND["long_prefill"]  # auto, serial, batched
    memory_limit: int = _BACKEND["memory_limit"]  # 0: MLX's default
    cache_limit: int = _BACKEND["cache_limit"]  # 0: a tenth of memory_limit
    no_warmup: bool = _BACKEND["no_warmup"]
    max_batch: int = _BACKEND["max_batch"]
    max_running_tokens: int = _BACKEND["max_running_tokens"]  # 0: only max_batch bounds the KV
    max_queue: int = _BACKEND["max_queue"]
    max_body_bytes: int = _BACKEND["max_body_bytes"]
    max_prompt_tokens: int = _BACKEND["max_prompt_tokens"]  # 0: the model's context length
    default_max_tokens: int = _BACKEND["default_max_tokens"]
    redis_url: str = _BACKEND["redis_url"]  # empty: no registry, the backend serves on its own
    secret: str = _BACKEND["secret"]  # salts the prefix keys; the same on every proxy and backend
    advertise_url: str = _BACKEND["advertise_url"]  # empty: http://host:port
    internal_token: str = _BACKEND["internal_token"]  # set: /v1 and /debug require it
    block_bytes: int = _BACKEND["block_bytes"]
    enable_faults: bool = _BACKEND["enable_faults"]


# -- kvroute serve ------------------------------------------------------------------------


_MODEL = {s.name: s.default for s in MODEL_SETTINGS}
_SERVE = {s.name: s.default for s in SERVE}


@dataclass
class ModelSpec:
    path: str = _MODEL["path"]
    alias: str = _MODEL["alias"]
    replicas: int = _MODEL["replicas"]
    # Per-replica backend settings: defaults from the BACKEND table.
    cache_bytes: int = _MODEL["cache_bytes"]
    cache_quantization: int = _MODEL["cache_quantization"]
    disk_cache_dir: str = _MODEL["disk_cache_dir"]
    disk_cache_bytes: int = _MODEL["disk_cache_bytes"]
    disk_fsync: str = _MODEL["disk_fsync"]
    prefill_step: int = _MODEL["prefill_step"]
    memory_limit: int = _MODEL["memory_limit"]
    long_prefill: str = _MODEL["long_prefill"]
    cache_limit: int = _MODEL["cache_limit"]
    max_batch: int = _MODEL["max_batch"]
    max_running_tokens: int = _MODEL["max_running_tokens"]
    max_queue: int = _MODEL["max_queue"]
    max_prompt_tokens: int = _MODEL["max_prompt_tokens"]
    default_max_tokens: int = _MODEL["default_max_tokens"]
    demo_variant: str = _MODEL["demo_variant"]
    kv_bits: int | None = _MODEL["kv_bits"]
    pin: bool = _MODEL["pin"]
    preload: bool = _MODEL["preload"]
    idle_unload: float = _MODEL["idle_unload"]  # seconds; 0: never
    # disk_cache_bytes set in the file: kept, not bounded by the volume's free space
    disk_budget_set: bool = field(default=False, repr=False)

    @classmethod
    def make(cls, raw: Mapping[str, Any], where: str = "[[models]]",
             env: Mapping[str, Any] | None = None) -> "ModelSpec":
        """A model from its [[models]] table; `env` (already typed, by setting name)
        replaces the table's values: the environment beats the file."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: each model is a table ([[models]] with keys), "
                              f"not {raw!r}")
        by_key = {s.toml.split(".", 1)[1]: s for s in MODEL_SETTINGS}
        raw = dict(raw)
        if "repo" in raw:  # an alias of path, for Hugging Face repo ids
            raw["path"] = raw.pop("repo")
        unknown = set(raw) - set(by_key)
        if unknown:
            hints = [_unknown("key", k, set(by_key)).args[0].removeprefix("unknown key ")
                     for k in sorted(unknown)]
            raise ConfigError(f"{where}: unknown keys {', '.join(hints)}")
        values = {by_key[k].name: by_key[k].convert(v, f"{where} {k}", from_file=True)
                  for k, v in raw.items()}
        spec = cls(**{**values, **(env or {})})
        spec.disk_budget_set = "disk_cache_bytes" in raw or "disk_cache_bytes" in (env or {})
        return spec

    def __post_init__(self) -> None:
        if not self.alias:
            if self.path == DEMO:
                self.alias = "kvroute-demo" if self.demo_variant == "text" else "kvroute-demo-tool"
            else:
                self.alias = Path(self.path.rstrip("/")).name
        if self.replicas < 1:
            raise ConfigError(f"model {self.alias!r}: replicas must be at least 1")
        if self.kv_bits is not None:
            # mlx-lm's BatchGenerator cannot merge quantized KV caches into a batch.
            raise ConfigError(
                f"model {self.alias!r}: kv_bits is not supported with continuous batching "
                "(mlx-lm 0.32 cannot batch quantized KV caches); remove it"
            )

    def backend_flags(self) -> list[str]:
        """The per-model settings as `kvroute backend` flags, from the same table."""
        out: list[str] = []
        for s in MODEL_SETTINGS:
            if s in BACKEND and s.name != "demo_variant":
                out += [s.flag, str(getattr(self, s.name))]
        return out


@dataclass
class ServeConfig:
    models: list[ModelSpec] = field(default_factory=lambda: [ModelSpec()])
    host: str = _SERVE["host"]
    port: int = _SERVE["port"]
    policy: str = _SERVE["policy"]
    api_keys: dict[str, str | None] = field(default_factory=dict)  # key -> cache scope
    redis_url: str = _SERVE["redis_url"]
    secret: str = _SERVE["secret"]
    backend_host: str = _SERVE["backend_host"]
    backend_port_base: int = _SERVE["backend_port_base"]
    log_level: str = _SERVE["log_level"]
    json_logs: bool = _SERVE["json_logs"]
    memory_fraction: float = _SERVE["memory_fraction"]
    max_loaded_models: int = _SERVE["max_loaded_models"]
    memory_budget: int = _SERVE["memory_budget"]
    load_timeout: float = _SERVE["load_timeout"]
    machine: str = _SERVE["machine"]
    internal_token: str = _SERVE["internal_token"]
    # Usage limits, for the proxy: (target, value) pairs of each LIMIT_NAMES setting.
    limits: dict[str, list] = field(default_factory=dict)
    limit_timeout_ms: float = _SERVE["limit_timeout_ms"]
    fetch_images: bool = _SERVE["fetch_images"]
    fetch_images_allow: list[str] = field(default_factory=list)
    fetch_images_timeout: float = _SERVE["fetch_images_timeout"]
    fetch_images_max_bytes: int = _SERVE["fetch_images_max_bytes"]
    ready_timeout: float = 600.0


def load_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    check_file_keys(data, str(path))
    return data


def check_file_keys(data: Mapping[str, Any], where: str) -> None:
    known = {s.toml for s in SERVE if s.toml} | {"models"}
    for key, value in data.items():
        if key == "models":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: 'models' must be an array of tables ([[models]])")
            continue
        names = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) else [key]
        for name in names:
            if name not in known:
                raise ConfigError(f"{where}: {_unknown('key', name, known).args[0]}")


def build(flags: argparse.Namespace | Mapping[str, Any], env: Mapping[str, str]) -> ServeConfig:
    """The deployment `kvroute serve` starts: file < environment < flags."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
    path = given.get("config") or env.get("KVROUTE_CONFIG") or ""
    file = load_file(path) if path else {}
    values = resolve(SERVE, given, env, file)
    per_model = model_environment(env)
    if values["models"]:
        models = [ModelSpec.make({"path": m}, env=per_model) for m in values["models"]]
    else:
        models = [ModelSpec.make(m, f"[[models]] #{i + 1}", per_model)
                  for i, m in enumerate(file.get("models", []))]
        models = models or [ModelSpec.make({}, env=per_model)]
    for spec in models:
        if values["replicas"] is not None:
            spec.replicas = values["replicas"]
        elif not file.get("models") and not values["models"] and spec.path == DEMO:
            spec.replicas = 2  # the zero-argument demo shows routing between two
        if values["cache_bytes"] is not None:
            spec.cache_bytes = values["cache_bytes"]
        if values["idle_unload"] is not None:
            spec.idle_unload = values["idle_unload"]
        for name in ("prefill_step", "max_batch", "max_prompt_tokens", "max_running_tokens"):
            if values[name] is not None:
                setattr(spec, name, values[name])
        if spec.replicas < 1:
            raise ConfigError("--replicas must be at least 1")
    names = {f.name for f in fields(ServeConfig)}
    if values["max_loaded_models"] < 0:
        raise ConfigError("max_loaded_models must be 0 (no limit) or more")
    pinned = sum(s.pin for s in models)
    if values["max_loaded_models"] and pinned > values["max_loaded_models"]:
        raise ConfigError(f"{pinned} models are pinned but max_loaded_models is "
                          f"{values['max_loaded_models']}")
    kw = {k: v for k, v in values.items() if k in names and k != "models"}
    kw["api_keys"] = parse_api_keys(kw["api_keys"])
    kw["limits"] = {name: values[name] for name in LIMIT_NAMES if values[name]}
    return ServeConfig(models=models, **kw)


def model_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """The per-model backend settings set by KVROUTE_* variables, typed: under `serve`
    they apply to every model, above its [[models]] values (serve hands each backend
    its model's values as flags, which would otherwise hide the variables)."""
    return {s.name: s.convert(env[s.env], s.env) for s in MODEL_SETTINGS
            if s in BACKEND and s.env and env.get(s.env, "") != ""}


def fetch_variables(c: ServeConfig) -> dict[str, str]:
    """Image fetching's settings as the KVROUTE_* variables of the proxy `kvroute serve`
    starts (empty values are not set)."""
    by_name = {s.name: s for s in _FETCH}
    return {by_name["fetch_images"].env: "1" if c.fetch_images else "",
            by_name["fetch_images_allow"].env: ",".join(c.fetch_images_allow),
            by_name["fetch_images_timeout"].env: str(c.fetch_images_timeout),
            by_name["fetch_images_max_bytes"].env: str(c.fetch_images_max_bytes)}


def limit_variables(limits: dict[str, list]) -> dict[str, str]:
    """Usage limits as the KVROUTE_* variables of the proxy `kvroute serve` starts."""
    by_name = {s.name: s for s in _LIMITS}
    out = {}
    for name, pairs in limits.items():
        out[by_name[name].env] = ",".join(
            f"{target}={';'.join(v) if isinstance(v, tuple) else v}" for target, v in pairs)
    return out
