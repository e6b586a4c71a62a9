"""Memory accounting of backend processes: what one replica of a model costs, and
whether a set of loaded models fits a budget.

One replica costs its weights, its prompt-cache budget, the KV of the sequences it
runs at once and the process overhead. The running KV is what the engine admits:
sequences join while their prompts and completion caps fit `max_running_tokens`
(one always runs alone, however long), and never more than max_batch x context; at
the model's bytes per token, an upper bound (sliding-window and recurrent layers
need less). Refusals carry the arithmetic, so a user sees which term to lower.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvroute.config import ConfigError
from kvroute.core.accel import physical_memory
from kvroute.core.sizes import format_bytes

PROCESS_OVERHEAD = 512 << 20  # Python, MLX and the allocator of one backend process
# What a backend process holds on a CUDA card beyond MLX's own count (its context,
# the libraries' workspaces): ~1.4 GiB on an H100 with mlx-cuda 0.32 (nvidia-smi's
# figure for the process against MLX's pool). MLX's cap cannot bound it, so it is
# counted in the replica's cost and kept out of its cap.
CUDA_OVERHEAD = 3 << 29
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# A Hugging Face repo id: "name" or "owner/name", no path syntax.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_path(path: str) -> None:
    """A model is a local directory or a repo id: anything else would only fail later,
    inside a backend, as a traceback. ConfigError names it."""
    if os.path.isdir(path):
        return
    if os.path.isabs(path) or path.startswith((".", "~")) or not _REPO_ID.fullmatch(path):
        raise ConfigError(f"model {path!r}: no such directory (and not a repo id)")


def local_dir(path: str) -> Path | None:
    """The model's directory on this disk, or None when it is not here (yet)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:
        return None


def weights_bytes(path: str) -> int | None:
    """Size of a model's weight files, or None when it is not on this disk yet."""
    local = local_dir(path)
    files = list(local.glob("*.safetensors")) if local else []
    return sum(f.stat().st_size for f in files) if files else None


def _model_config(path: str) -> dict[str, Any]:
    local = local_dir(path)
    try:
        cfg = orjson.loads((local / "config.json").read_bytes()) if local else {}
    except (OSError, orjson.JSONDecodeError):
        return {}
    return {**cfg, **(cfg.get("text_config") or {})}


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """Keys and values of every layer for one token (0 when the config does not say)."""
    layers = cfg.get("num_hidden_layers") or 0
    heads = cfg.get("num_attention_heads") or 0
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
    dtype = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), 2)
    return int(layers * 2 * kv_heads * head_dim * dtype)


@dataclass(frozen=True)
class Cost:
    """What one replica of a model takes in memory, term by term."""

    weights: int
    cache: int
    kv: int  # running sequences: running_tokens x kv_per_token
    batch: int
    context: int
    kv_per_token: int
    running_tokens: int = 0  # KV tokens the running sequences may hold at once
    overhead: int = PROCESS_OVERHEAD
    weights_known: bool = True

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.kv + self.overhead

    def explain(self) -> str:
        tokens = (f"{self.batch} x {self.context} tokens"
                  if self.running_tokens == self.batch * self.context
                  else f"{self.running_tokens:,} running tokens")
        return (f"{format_bytes(self.weights)} weights + {format_bytes(self.cache)} cache + "
                f"{format_bytes(self.kv)} KV ({tokens} x {format_bytes(self.kv_per_token)}) + "
                f"{format_bytes(self.overhead)} process")

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "cache": self.cache, "kv": self.kv,
                "overhead": self.overhead, "total": self.total}


def running_tokens(max_batch: int, context: int, max_running_tokens: int) -> int:
    """KV tokens a replica's running sequences may hold at once: within the running
    budget (0: none), but never less than one whole sequence (it runs alone) nor
    more than a full batch of whole sequences."""
    full = max_batch * context
    return full if max_running_tokens <= 0 else min(full, max(max_running_tokens, context))


def replica_cost(path: str, cache_bytes: int, max_batch: int, max_prompt_tokens: int,
                 default_max_tokens: int, max_running_tokens: int = 0, device_kind: str = "cpu") -> Cost:
    weights = weights_bytes(path)
    cfg = _model_config(path)
    per_token = kv_bytes_per_token(cfg)
    window = int(cfg.get("max_position_embeddings") or 0)
    if max_prompt_tokens > 0:
        context = max_prompt_tokens + default_max_tokens
        context = min(context, window) if window else context
    else:
        context = window or default_max_tokens
    tokens = running_tokens(max_batch, context, max_running_tokens)
    return Cost(weights=weights or 0, cache=cache_bytes, kv=tokens * per_token,
                batch=max_batch, context=context, kv_per_token=per_token,
                running_tokens=tokens, weights_known=weights is not None,
                overhead=PROCESS_OVERHEAD + (CUDA_OVERHEAD if device_kind == "cuda" else 0))


def mlx_cap(share: int, device_kind: str) -> int:
    """The MLX memory cap of a replica given `share` of the card: on CUDA less what
    its process holds there that MLX does not count (`CUDA_OVERHEAD`)."""
    return share - CUDA_OVERHEAD if device_kind == "cuda" else share


def budget(memory_budget: int, memory_fraction: float, device: Any = None) -> tuple[int, str]:
    """The bytes models may take, and where that figure comes from. On a GPU that is
    the accelerator's memory (`kvroute.core.accel.Accelerator`), which the replicas share;
    on a CPU, or with no device given, physical memory."""
    if memory_budget > 0:
        return memory_budget, "memory_budget"
    on_gpu = device is not None and device.kind != "cpu"
    total = device.memory if on_gpu else physical_memory()
    where = f"{device.kind} memory" if on_gpu else "physical memory"
    return int(total * memory_fraction), f"{memory_fraction:.0%} of {format_bytes(total)} {where}"


def replica_limits(needs: list[int], budget_bytes: int) -> list[int]:
    """MLX memory caps for replicas that share one accelerator, one per replica cost
    in `needs`: when all of them fit the budget together, what is left over is shared
    in proportion to need; otherwise each gets its own need (the loader keeps what is
    loaded at once within the budget). Either way the caps of what runs together sum
    to at most the budget, so replicas never oversubscribe the card."""
    total = sum(needs)
    if not total:
        return [0 for _ in needs]
    return [max(need, budget_bytes * need // total) if total <= budget_bytes else need
            for need in needs]


def line(alias: str, replicas: int, cost: Cost) -> str:
    return f"  {alias}: {replicas} x ({cost.explain()}) = {format_bytes(replicas * cost.total)}"


# -- making room for a load ---------------------------------------------------------


@dataclass(frozen=True)
class Resident:
    """A model that holds (or is about to hold) memory on this machine."""

    alias: str
    bytes: int
    pinned: bool = False
    last_used: float = 0.0
    movable: bool = True  # False while it loads: it cannot be unloaded yet


@dataclass(frozen=True)
class Refusal:
    limit: str  # "max_loaded_models" or "memory_budget"
    message: str


def plan_room(residents: list[Resident], new: Resident, max_models: int, budget_bytes: int,
              budget_source: str = "memory_budget", evict: bool = True) -> list[str] | Refusal:
    """The models to unload, least recently used first, so that `new` fits under both
    limits; or a Refusal that names the limit and shows the arithmetic."""
    if new.bytes > budget_bytes:
        return Refusal("memory_budget", f"{new.alias} needs {format_bytes(new.bytes)} alone, more "
                       f"than the memory budget {format_bytes(budget_bytes)} ({budget_source})")
    kept = sorted(residents, key=lambda r: r.last_used)
    victims: list[str] = []

    def over() -> str | None:
        if max_models and len(kept) + 1 > max_models:
            return "max_loaded_models"
        if sum(r.bytes for r in kept) + new.bytes > budget_bytes:
            return "memory_budget"
        return None

    while (limit := over()) is not None:
        victim = next((r for r in kept if evict and r.movable and not r.pinned), None)
        if victim is None:
            return Refusal(limit, _refusal(limit, kept, new, max_models, budget_bytes, budget_source))
        kept.remove(victim)
        victims.append(victim.alias)
    return victims


def _refusal(limit: str, kept: list[Resident], new: Resident, max_models: int, budget_bytes: int,
             budget_source: str) -> str:
    why = ", ".join(f"{r.alias} ({'pinned' if r.pinned else 'loading'})" for r in kept) or "none"
    if limit == "max_loaded_models":
        return (f"cannot load {new.alias}: max_loaded_models ({max_models}) models are loaded "
                f"and none can be unloaded now: {why}")
    used = sum(r.bytes for r in kept)
    terms = " + ".join(f"{format_bytes(r.bytes)} {r.alias}" for r in kept) or "0 B"
    return (f"cannot load {new.alias}: memory_budget exceeded: {terms} + "
            f"{format_bytes(new.bytes)} {new.alias} = {format_bytes(used + new.bytes)} > "
            f"{format_bytes(budget_bytes)} ({budget_source}); none can be unloaded now: {why}")
