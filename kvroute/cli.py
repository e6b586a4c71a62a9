"""The `kvroute` command line.

The flags, their `KVROUTE_*` variables and defaults come from the tables in
`config.py`; a flag given on the command line beats the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys

from typing import Any

from . import config


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


def _backend_parser(sub) -> None:
    p = sub.add_parser("backend", help="serve one MLX model (the worker process)",
                       description="Serve one MLX model over an OpenAI-compatible HTTP API, "
                       "committing each prompt's KV cache when its prefill ends.")
    config.add_flags(p, config.BACKEND)


def _proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="serve the OpenAI endpoint that routes to backends",
                       description="Route each OpenAI request to the backend holding the KV cache "
                       "of its prompt prefix, as advertised in Redis.")
    config.add_flags(p, config.PROXY)


def run_proxy(s: dict[str, Any]) -> int:
    from .proxy.app import serve
    from .proxy.state import ProxyConfig

    if not s["redis_url"]:
        raise config.ConfigError("--redis-url (or KVROUTE_REDIS_URL) is required")
    proxy_config = ProxyConfig(
        **_fields_of(ProxyConfig, s),
        api_keys=config.parse_api_keys(s["api_keys"]),
        lookup_timeout=s["lookup_timeout_ms"] / 1000,
    )
    from .api.lifecycle import bind_sockets

    try:
        # Bound before the loop starts: a failed bind once left the app's startup tasks
        # (Redis clients, refresh loops) keeping the process alive, silently.
        socks = bind_sockets(proxy_config.host, proxy_config.port)
        run_async(serve(proxy_config, socks))
    except OSError as exc:  # the port: taken, or not ours to bind
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        print(f"kvroute proxy: cannot listen on {proxy_config.host}:{proxy_config.port}: "
              f"{reason}", file=sys.stderr)
        return 1
    return 0


def _fields_of(cls, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that are plain fields of a config dataclass (same name, same value)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"api_keys"}
    return {k: v for k, v in settings.items() if k in names}


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="run Redis, backends and the proxy from one command",
        description="Start the whole system: an embedded redis-server (unless --redis-url), "
        "the backend replicas of each model and the proxy, supervised. Models with "
        "preload = false (or that do not fit) start on their first request; the least "
        "recently used is unloaded under --max-loaded-models / --memory-budget. With no "
        "model given, serves the built-in demo model with 2 replicas.")
    config.add_flags(p, config.SERVE)


def run_serve(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from .serve import launcher

    console = Console(stderr=True)
    try:
        serve_config = config.build(args, os.environ)
        # After build, so the launcher's own lines follow KVROUTE_LOG_LEVEL and
        # KVROUTE_JSON_LOGS as its children do, not only the flags.
        setup_logging(serve_config.log_level, serve_config.json_logs)
        return run_async(launcher.run(serve_config, console))
    # soft_wrap: the reason stays one line, whatever the terminal's width.
    except config.ConfigError as exc:
        console.print(f"[red]kvroute serve: {escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        return 2
    except RuntimeError as exc:  # e.g. redis-server missing, a child that never got healthy
        console.print(f"[red]kvroute serve: {escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        return 1


def _stats_parser(sub) -> None:
    p = sub.add_parser("stats", help="show a proxy's cache and routing figures in the terminal",
                       description="The dashboard's figures as tables, read from a proxy's /stats.",
                       epilog="A proxy with API keys answers /stats to a key of scope `operator`: "
                              "set it in KVROUTE_API_KEY (no flag: a key on a command line "
                              "shows in `ps`).")
    config.add_flags(p, config.STATS)
    p.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")


def run_stats(s: dict[str, Any]) -> int:
    from .devtools.stats_cli import run

    return run(s["url"], s["watch"])


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo-model", help="build the tiny demo/test model into DIR",
                       description="Build, offline and in seconds, a tiny mlx-lm model with a "
                       "locally trained BPE tokenizer and a tool-calling chat template.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--variant", default="text", choices=["text", "tool"],
                   help="'text' replies with a fixed sentence, 'tool' with a tool call")
    # From the mlx-free names module: arch_models imports mlx, which the proxy's image lacks.
    from .devtools.names import ARCHES, VISION_FAMILIES

    p.add_argument("--arch", choices=ARCHES, default=None,
                   help="instead, a random-weight model of this mlx-lm family (its output is "
                   "gibberish), to try another cache kind: qwen3 full attention, gemma3_text "
                   "and gpt_oss sliding windows, qwen3_next, lfm2 and falcon_h1 hybrids with "
                   "recurrent layers, mamba2 recurrent only")
    p.add_argument("--vision", choices=VISION_FAMILIES, default=None,
                   help="instead, a random-weight vision-language model of this family "
                   "(images up to 64 pixels a side, 16 tokens), to try images")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="the context length the model declares (default 8192); coding "
                   "agents need ~131072 for their default prompts")
    p.add_argument("--tool-call", default=None, metavar="JSON",
                   help='with --variant tool: the call it answers with, as '
                   '{"name": ..., "arguments": {...}} (default get_weather for Paris)')
    p.add_argument("--size", choices=("tiny", "7b"), default="tiny",
                   help="with --arch gemma3_text or qwen3_next: '7b' writes a 7B-class bf16 "
                   "model (~13 GB) for timing on an accelerator")


def run_backend(s: dict[str, Any]) -> int:
    from .backend.boot import serve
    from .core import accel
    from .devtools import demo_model

    s = dict(s)
    if not s["model"]:
        s["model"] = str(demo_model.ensure(s["demo_variant"]))
        # The name `kvroute serve` gives the demo model, from its one home in config.
        s["model_id"] = s["model_id"] or config.ModelSpec(
            path=config.DEMO, demo_variant=s["demo_variant"]).alias
    code = run_async(serve(config.BackendConfig(**_fields_of(config.BackendConfig, s))))
    # The engine thread has stopped and synchronized its streams.
    accel.exit_skipping_teardown(code or 0)


def run_demo_model(args: dict[str, Any]) -> int:
    from .devtools import arch_models, demo_model

    if args.get("vision"):
        if args.get("arch") or args.get("context") or args.get("tool_call"):
            raise config.ConfigError("--vision takes no --arch, --context or --tool-call")
        from .devtools import vision_models

        print(vision_models.build(args["dir"], args["vision"]))
        return 0
    if args.get("arch"):
        if args.get("context") or args.get("tool_call"):
            raise config.ConfigError("--context and --tool-call apply to the demo model, "
                                     "not to --arch models")
        path = arch_models.build(args["dir"], args["arch"], args.get("size") or "tiny")
    else:
        tool_call = None
        if args.get("tool_call"):
            try:
                tool_call = json.loads(args["tool_call"])
            except ValueError as exc:
                raise config.ConfigError(f"--tool-call is not JSON: {exc}") from None
        try:
            path = demo_model.build(args["dir"], variant=args["variant"],
                                    context=args.get("context") or demo_model.MAX_POSITIONS,
                                    tool_call=tool_call)
        except ValueError as exc:
            raise config.ConfigError(str(exc)) from None
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
    try:
        config.check_environment(os.environ)
        if args.command == "serve":  # reads its file too: config.build does it all
            return run_serve(args)
        table = config.TABLES.get(args.command, [])
        settings = {**vars(args), **config.resolve(table, args, os.environ)}
    except config.ConfigError as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.get("log_level") or "info", bool(settings.get("json_logs")))
    handlers = {"backend": run_backend, "proxy": run_proxy, "stats": run_stats,
                "demo-model": run_demo_model}
    try:
        return handlers[args.command](settings)
    except config.ConfigError as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
