"""The `kvroute` command line.

Each option can also come from a `KVROUTE_<OPTION>` environment variable (e.g.
`KVROUTE_CACHE_BYTES`); a flag given on the command line beats the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from .config import parse_api_keys
from .sizes import parse_bytes


def _env(name: str, default):
    return os.environ.get(f"KVROUTE_{name.upper().replace('-', '_')}", default)


def run_async(main):
    """asyncio.run, on uvloop where it is installed (it doubles the proxy's peak rate)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def setup_logging(level: str = "info", json_logs: bool = False) -> None:
    if json_logs:
        from .logs import JSONFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(JSONFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    else:
        logging.basicConfig(
            level=level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            force=True,
        )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=_env("log_level", "info"),
                   choices=["debug", "info", "warning", "error"], help="logging level (default info)")
    p.add_argument("--json-logs", action="store_true", default=_env("json_logs", "") not in ("", "0"),
                   help="log one JSON object per line")


def _backend_parser(sub) -> None:
    p = sub.add_parser("backend", help="serve one MLX model (the worker process)",
                       description="Serve one MLX model over an OpenAI-compatible HTTP API, "
                       "committing each prompt's KV cache when its prefill ends.")
    p.add_argument("--model", default=_env("model", None),
                   help="local path or Hugging Face repo id; default: the built-in demo model")
    p.add_argument("--model-id", default=_env("model_id", ""),
                   help="the name clients send as 'model' (default: last part of --model, "
                   "or 'kvroute-demo')")
    p.add_argument("--host", default=_env("host", "127.0.0.1"), help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(_env("port", 8100)), help="port (default 8100)")
    p.add_argument("--id", dest="backend_id", default=_env("id", ""),
                   help="stable backend id, unique in the deployment (default <hostname>-<port>)")
    p.add_argument("--cache-bytes", type=parse_bytes, default=parse_bytes(_env("cache_bytes", "2GiB")),
                   help="byte budget of the prompt-cache store, e.g. 512MiB, 8GiB (default 2GiB)")
    p.add_argument("--prefill-step", type=int, default=int(_env("prefill_step", 512)),
                   help="tokens per prefill chunk; decoding of other requests interleaves "
                   "between chunks (default 512)")
    p.add_argument("--max-batch", type=int, default=int(_env("max_batch", 32)),
                   help="sequences decoded together (default 32)")
    p.add_argument("--max-queue", type=int, default=int(_env("max_queue", 64)),
                   help="requests admitted at once; more get 429 (default 64)")
    p.add_argument("--max-body-bytes", type=parse_bytes,
                   default=parse_bytes(_env("max_body_bytes", "8MiB")),
                   help="largest accepted request body (default 8MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=int(_env("max_prompt_tokens", 0)),
                   help="longest accepted prompt (default: the model's context length)")
    p.add_argument("--default-max-tokens", type=int, default=int(_env("default_max_tokens", 4096)),
                   help="completion cap when a request sets none (default 4096)")
    p.add_argument("--redis-url", default=_env("redis_url", ""),
                   help="registry to advertise the cache in (redis:// or rediss://); "
                   "default: none, serve alone")
    p.add_argument("--secret", default=_env("secret", ""),
                   help="salt of the prefix keys; the same on every proxy and backend")
    p.add_argument("--advertise-url", default=_env("advertise_url", ""),
                   help="URL proxies use to reach this backend (default http://HOST:PORT)")
    p.add_argument("--internal-token", default=_env("internal_token", ""),
                   help="require this token (header x-kvroute-token) on /v1 and /debug")
    p.add_argument("--block-bytes", type=int, default=int(_env("block_bytes", 256)),
                   help="prefix-key block size in bytes; the same everywhere (default 256)")
    p.add_argument("--demo-variant", default=_env("demo_variant", "text"), choices=["text", "tool"],
                   help="which demo model to build when --model is not given (default text)")
    p.add_argument("--enable-faults", action="store_true",
                   default=_env("enable_faults", "") not in ("", "0"),
                   help="testing only: honour the 'kvroute_fault' request field")
    _add_common(p)


def _proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="serve the OpenAI endpoint that routes to backends",
                       description="Route each OpenAI request to the backend holding the KV cache "
                       "of its prompt prefix, as advertised in Redis.")
    p.add_argument("--redis-url", default=_env("redis_url", ""), required=not _env("redis_url", ""),
                   help="the registry backends advertise in (redis:// or rediss://)")
    p.add_argument("--host", default=_env("host", "127.0.0.1"), help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(_env("port", 8000)), help="port (default 8000)")
    p.add_argument("--secret", default=_env("secret", ""),
                   help="salt of the prefix keys; the same on every proxy and backend")
    p.add_argument("--policy", default=_env("policy", "cache-aware"),
                   choices=["cache-aware", "round-robin", "least-loaded", "random"],
                   help="routing policy (default cache-aware)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY[:SCOPE]",
                   help="accept this API key (repeatable; KVROUTE_API_KEYS takes a comma list); "
                   "a SCOPE isolates the key's prompt cache from other scopes")
    p.add_argument("--internal-token", default=_env("internal_token", ""),
                   help="token sent to backends in x-kvroute-token")
    p.add_argument("--max-body-bytes", type=parse_bytes,
                   default=parse_bytes(_env("max_body_bytes", "8MiB")),
                   help="largest accepted request body (default 8MiB)")
    p.add_argument("--request-timeout", type=float, default=float(_env("request_timeout", 600)),
                   help="seconds a backend may stay silent before the request fails (default 600)")
    p.add_argument("--block-bytes", type=int, default=int(_env("block_bytes", 256)),
                   help="prefix-key block size in bytes; the same everywhere (default 256)")
    p.add_argument("--lookup-timeout-ms", type=float, default=float(_env("lookup_timeout_ms", 50)),
                   help="registry lookup deadline; past it, route by load (default 50)")
    p.add_argument("--locality-slack", type=float, default=float(_env("locality_slack", 1.0)),
                   help="seconds of extra estimated TTFT accepted to keep a prefix hit (default 1.0)")
    _add_common(p)


def run_proxy(args: argparse.Namespace) -> int:
    from proxy.server import ProxyConfig, serve

    keys = args.api_key if args.api_key is not None else _env("api_keys", "").split(",")
    config = ProxyConfig(
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        secret=args.secret,
        policy=args.policy,
        api_keys=parse_api_keys(keys),
        internal_token=args.internal_token,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        block_bytes=args.block_bytes,
        lookup_timeout=args.lookup_timeout_ms / 1000,
        locality_slack=args.locality_slack,
    )
    run_async(serve(config))
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="run Redis, backends and the proxy from one command",
        description="Start the whole system: an embedded redis-server (unless --redis-url), "
        "the backend replicas of each model and the proxy, supervised. With no model "
        "given, serves the built-in demo model with 2 replicas.")
    # Defaults are None so that a flag given beats KVROUTE_* beats the --config file.
    p.add_argument("--config", default=_env("config", None), help="TOML file (see README)")
    p.add_argument("--model", action="append", default=None, metavar="PATH_OR_REPO",
                   help="serve this model (repeatable); replaces the file's [[models]]")
    p.add_argument("--replicas", type=int, default=None,
                   help="backend processes per model (default 2 for the demo model, else 1)")
    p.add_argument("--cache-bytes", type=parse_bytes, default=None,
                   help="prompt-cache budget of each backend (default 2GiB)")
    p.add_argument("--host", default=None, help="proxy bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="proxy port (default 8000)")
    p.add_argument("--backend-port-base", type=int, default=None,
                   help="first port tried for backends (default 8100)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--secret", default=None, help="prefix-key salt (default: random per launch)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY[:SCOPE]",
                   help="require API keys on the proxy (repeatable)")
    p.add_argument("--policy", default=None,
                   choices=["cache-aware", "round-robin", "least-loaded", "random"])
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p.add_argument("--json-logs", action="store_true", default=None,
                   help="one JSON object per log line, with the process name")


def run_serve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import launcher
    from .config import ConfigError, ModelSpec, build

    flags = {
        "host": args.host, "port": args.port, "redis_url": args.redis_url, "secret": args.secret,
        "policy": args.policy, "backend_port_base": args.backend_port_base,
        "log_level": args.log_level, "json_logs": args.json_logs,
        "api_keys": parse_api_keys(args.api_key) if args.api_key else None,
    }
    console = Console(stderr=True)
    try:
        config = build(args.config, flags)
        if args.model:
            config.models = [ModelSpec(path=m) for m in args.model]
        for spec in config.models:
            if args.replicas is not None:
                spec.replicas = args.replicas
            elif not args.config and not args.model and spec.path == "demo":
                spec.replicas = 2  # the zero-argument demo shows routing between two
            if args.cache_bytes is not None:
                spec.cache_bytes = args.cache_bytes
            if spec.replicas < 1:
                raise ConfigError("--replicas must be at least 1")
        return run_async(launcher.run(config, console))
    except ConfigError as exc:
        console.print(f"[red]kvroute serve: {exc}[/]")
        return 2
    except RuntimeError as exc:  # e.g. redis-server missing, a child that never got healthy
        console.print(f"[red]kvroute serve: {exc}[/]")
        return 1


def _stats_parser(sub) -> None:
    p = sub.add_parser("stats", help="show a proxy's cache and routing figures in the terminal",
                       description="The dashboard's figures as tables, read from a proxy's /stats.")
    p.add_argument("--url", default=_env("url", "http://127.0.0.1:8000"),
                   help="the proxy (default http://127.0.0.1:8000)")
    p.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")


def run_stats(args: argparse.Namespace) -> int:
    from .stats_cli import run

    return run(args.url, args.watch)


# kvroute.arch_models.ARCHES, which a test keeps in step: importing it would
# import mlx, which the proxy's image does not have.
DEMO_ARCHES = ("qwen3", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "mamba2", "falcon_h1")


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo-model", help="build the tiny demo/test model into DIR",
                       description="Build, offline and in seconds, a tiny mlx-lm model with a "
                       "locally trained BPE tokenizer and a tool-calling chat template.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--variant", default="text", choices=["text", "tool"],
                   help="'text' replies with a fixed sentence, 'tool' with a tool call")
    p.add_argument("--arch", choices=DEMO_ARCHES, default=None,
                   help="instead, a random-weight model of this mlx-lm family (its output is "
                   "gibberish), to try another cache kind: qwen3 full attention, gemma3_text "
                   "and gpt_oss sliding windows, qwen3_next, lfm2 and falcon_h1 hybrids with "
                   "recurrent layers, mamba2 recurrent only")


def run_backend(args: argparse.Namespace) -> int:
    from backend.server import BackendConfig, serve

    from . import demo_model

    model = args.model
    model_id = args.model_id
    if not model:
        model = str(demo_model.ensure(args.demo_variant))
        model_id = model_id or ("kvroute-demo" if args.demo_variant == "text" else "kvroute-demo-tool")
    config = BackendConfig(
        model=model,
        host=args.host,
        port=args.port,
        backend_id=args.backend_id,
        model_id=model_id,
        cache_bytes=args.cache_bytes,
        prefill_step=args.prefill_step,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        default_max_tokens=args.default_max_tokens,
        enable_faults=args.enable_faults,
        redis_url=args.redis_url,
        secret=args.secret,
        advertise_url=args.advertise_url,
        internal_token=args.internal_token,
        block_bytes=args.block_bytes,
    )
    run_async(serve(config))
    return 0


def run_demo_model(args: argparse.Namespace) -> int:
    from . import arch_models, demo_model

    if args.arch:
        path = arch_models.build(args.dir, args.arch)
    else:
        path = demo_model.build(args.dir, variant=args.variant)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _backend_parser(sub)
    _proxy_parser(sub)
    _serve_parser(sub)
    _stats_parser(sub)
    _demo_parser(sub)
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_level", None) or "info", bool(getattr(args, "json_logs", False)))
    handlers = {"backend": run_backend, "proxy": run_proxy, "serve": run_serve,
                "stats": run_stats, "demo-model": run_demo_model}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
