"""The package's shape (docs/DESIGN.md "Layout"): one top-level package whose imports
point down its layers, no import circle, a core free of mlx and server code, and a
layout section that names every module."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib

from tests.harness import ROOT

PACKAGE = ROOT / "kvroute"
# Lower layers first: a module may import its own layer and the ones before it.
LAYERS = [["kvroute.core"], ["kvroute.api", "kvroute.config", "kvroute.logs", "kvroute"],
          ["kvroute.devtools"], ["kvroute.proxy", "kvroute.backend", "kvroute.serve"],
          ["kvroute.cli"]]


def modules() -> dict[str, tuple]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def imports(name: str, path, is_init: bool, known: set[str]) -> set[str]:
    """Every kvroute module `name` imports, at any depth of its code (TYPE_CHECKING too)."""
    package = name if is_init else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def layer(name: str) -> int:
    best = max((p for group in LAYERS for p in group if name == p or name.startswith(p + ".")),
               key=len)
    return next(i for i, group in enumerate(LAYERS) if best in group)


def test_one_top_level_package():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in setup["packages"]} == {"kvroute"}
    assert {p.split(".")[0] for p in setup["package-data"]} == {"kvroute"}
    for name in ("proxy", "backend"):
        assert importlib.util.find_spec(name) is None, f"a top-level {name!r} is importable"


def test_every_import_points_down_and_none_goes_round():
    mods = modules()
    graph = {m: imports(m, *mods[m], set(mods)) for m in mods}
    upward = [(m, t) for m, ts in graph.items() for t in ts if layer(t) > layer(m)]
    assert not upward, upward

    def circle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for m in graph if (c := circle_from(m))]
    assert not circles, circles[0]


def test_core_imports_no_mlx_and_no_server_code():
    core = sorted(m for m in modules() if m.startswith("kvroute.core"))
    code = (f"import sys; import {', '.join(core)}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') "
            "or m.startswith('aiohttp.web') or m.startswith(('kvroute.proxy', 'kvroute.backend', "
            "'kvroute.serve', 'kvroute.api'))); print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_design_layout_names_every_module():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S).group(1)
    listed, folder = set(), None
    for line in block.splitlines():
        if m := re.match(r"(kvroute(?:/\w+)*)/\s", line + " "):
            folder = m.group(1)
            continue
        if not line.startswith("  ") or folder is None:
            folder = None if line and not line.startswith(" ") else folder
            continue
        names = re.match(r"\s+([\w.,/ *]+?)(?:\s{2,}|$)", line)
        for name in re.findall(r"[\w]+\.py", names.group(1) if names else ""):
            listed.add(f"{folder}/{name}")
    actual = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert actual - listed == set(), f"modules missing from docs/DESIGN.md's layout: {sorted(actual - listed)}"
    assert listed - actual == set(), f"the layout names modules that do not exist: {sorted(listed - actual)}"


def toml_blocks() -> list[tuple[str, str]]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out += [(doc.name, b) for b in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)]
    return out


def test_every_toml_example_in_the_docs_parses_and_serve_takes_the_readmes(tmp_path):
    for name, block in toml_blocks():
        tomllib.loads(block)  # raises, naming the line, on a block that does not parse
    from kvroute import config

    readme = next(b for n, b in toml_blocks() if n == "README.md" and "[[models]]" in b)
    path = tmp_path / "kvroute.toml"
    path.write_text(readme)
    # What `kvroute serve --config` builds from it: every key known, every value valid.
    serve = config.build({"config": str(path)}, {})
    assert [m.alias for m in serve.models] == ["qwen-7b", "tiny"]
    assert serve.models[0].prefill_step == 2048 and serve.api_keys
