"""Configuration of `kvroute serve`: one TOML file, `KVROUTE_*` variables, flags.

A flag beats the environment, which beats the file. The file:

    secret = "change-me"                 # salts prefix keys; random per launch if unset

    [redis]
    url = "redis://127.0.0.1:6379/0"     # unset: an embedded redis-server on a free port

    [proxy]
    host = "127.0.0.1"
    port = 8000
    policy = "cache-aware"
    api_keys = ["sk-team-a:team-a", "sk-ops"]   # KEY or KEY:SCOPE

    [backends]
    host = "127.0.0.1"
    port_base = 8100                     # replicas take the next free ports from here

    [[models]]
    path = "mlx-community/Qwen2.5-7B-Instruct-4bit"   # a local path, a repo id, or "demo"
    alias = "qwen-7b"                    # the `model` name clients send
    replicas = 2
    cache_bytes = "8GiB"                 # prompt-cache budget of each replica
    prefill_step = 512
    max_batch = 32
    max_queue = 64
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .sizes import parse_bytes

DEMO = "demo"


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says what to change."""


@dataclass
class ModelSpec:
    path: str = DEMO
    alias: str = ""
    replicas: int = 1
    cache_bytes: int = 2 << 30
    prefill_step: int = 512
    max_batch: int = 32
    max_queue: int = 64
    max_prompt_tokens: int = 0
    default_max_tokens: int = 4096
    demo_variant: str = "text"
    kv_bits: int | None = None

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


@dataclass
class ServeConfig:
    models: list[ModelSpec] = field(default_factory=lambda: [ModelSpec()])
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache-aware"
    api_keys: dict[str, str | None] = field(default_factory=dict)
    redis_url: str = ""
    secret: str = ""
    backend_host: str = "127.0.0.1"
    backend_port_base: int = 8100
    log_level: str = "info"
    json_logs: bool = False
    memory_fraction: float = 0.85  # of physical memory that weights and caches may take
    ready_timeout: float = 600.0


_MODEL_FIELDS = {f.name for f in fields(ModelSpec)}


def _model(raw: dict, i: int) -> ModelSpec:
    unknown = set(raw) - _MODEL_FIELDS - {"repo"}
    if unknown:
        raise ConfigError(f"[[models]] #{i + 1}: unknown keys {sorted(unknown)}")
    raw = dict(raw)
    if "repo" in raw:
        raw["path"] = raw.pop("repo")
    if "cache_bytes" in raw:
        raw["cache_bytes"] = parse_bytes(raw["cache_bytes"])
    return ModelSpec(**raw)


def parse_api_keys(values: list[str]) -> dict[str, str | None]:
    """`KEY` or `KEY:SCOPE`; a scope keeps that key's cache apart from other scopes."""
    keys: dict[str, str | None] = {}
    for value in values:
        key, _, scope = value.strip().partition(":")
        if key:
            keys[key] = scope or None
    return keys


def load_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def from_file(data: dict[str, Any]) -> dict[str, Any]:
    """The file's settings as ServeConfig keyword arguments."""
    out: dict[str, Any] = {}
    if "secret" in data:
        out["secret"] = str(data["secret"])
    redis = data.get("redis", {})
    if "url" in redis:
        out["redis_url"] = redis["url"]
    proxy = data.get("proxy", {})
    for key in ("host", "port", "policy"):
        if key in proxy:
            out[key] = proxy[key]
    if "api_keys" in proxy:
        out["api_keys"] = parse_api_keys(list(proxy["api_keys"]))
    backends = data.get("backends", {})
    if "host" in backends:
        out["backend_host"] = backends["host"]
    if "port_base" in backends:
        out["backend_port_base"] = int(backends["port_base"])
    if "memory_fraction" in data:
        out["memory_fraction"] = float(data["memory_fraction"])
    if "models" in data:
        out["models"] = [_model(m, i) for i, m in enumerate(data["models"])]
    return out


def from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    pairs = {"KVROUTE_HOST": "host", "KVROUTE_PORT": "port", "KVROUTE_POLICY": "policy",
             "KVROUTE_REDIS_URL": "redis_url", "KVROUTE_SECRET": "secret",
             "KVROUTE_LOG_LEVEL": "log_level"}
    for var, key in pairs.items():
        if env.get(var):
            out[key] = int(env[var]) if key == "port" else env[var]
    if env.get("KVROUTE_API_KEYS"):
        out["api_keys"] = parse_api_keys(env["KVROUTE_API_KEYS"].split(","))
    if env.get("KVROUTE_JSON_LOGS") not in (None, "", "0"):
        out["json_logs"] = True
    return out


def build(file: str | None, flags: dict[str, Any], env: dict[str, str] | None = None) -> ServeConfig:
    """Merge file < environment < flags (flags: only the ones given, i.e. not None)."""
    settings: dict[str, Any] = {}
    if file:
        settings.update(from_file(load_file(file)))
    settings.update(from_env(env))
    settings.update({k: v for k, v in flags.items() if v is not None})
    return ServeConfig(**settings)
