"""The docs stay true to the code: the label values README.md and docs/dashboard.md
list for a metric are the ones it exports, every metric they name exists, every flag
of a flag table is in its command's --help, every relative link resolves, and
`kvroute serve` logs at the level its table says (KVROUTE_LOG_LEVEL, the flag first).

tests/test_config.py checks the flag tables' variables and defaults against the
settings table; this file checks what that one does not."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.harness import ROOT, free_port, get_json, wait_until

from kvroute.backend import metrics as backend_metrics
from kvroute.core.misses import REASONS
from kvroute.proxy.limits import LIMITS
from kvroute.proxy.observe.apis import APIS
from kvroute.proxy.observe.metrics import ProxyMetrics
from kvroute.proxy.policy.interface import ROUTE_REASONS

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = ROOT / "kvroute"


def text_of(path: Path) -> str:
    return path.read_text()


# -- metric label values ---------------------------------------------------------


def exported_series(render: bytes) -> dict[str, dict[str, set[str]]]:
    """metric name -> label -> the values its samples carry (model and backend aside)."""
    out: dict[str, dict[str, set[str]]] = {}
    for line in render.decode().splitlines():
        m = re.match(r"(\w+)\{(.*)\} ", line)
        if not m or line.startswith("#"):
            continue
        name = re.sub(r"_(bucket|count|sum|created|total)$", "", m.group(1))
        for label, value in re.findall(r'(\w+)="([^"]*)"', m.group(2)):
            if label not in ("model", "backend", "le"):
                out.setdefault(name, {}).setdefault(label, set()).add(value)
    return out


def literals(pattern: str, *files: str) -> set[str]:
    found: set[str] = set()
    for f in files:
        for m in re.finditer(pattern, (SOURCES / f).read_text()):
            found |= {g for g in m.groups() if g}
    return found


def code_label_values() -> dict[str, dict[str, set[str]]]:
    """What the code can put in each labelled series: the values a backend creates at
    start (a scrape before any request shows them all) and those its call sites pass."""
    got = exported_series(backend_metrics.BackendMetrics("m", "b").render())
    # Exits, commit paths and refusals created lazily would escape the scrape above: the
    # call sites' literals must be among the values created at start.
    lazy = {
        ("kvroute_backend_finished", "exit"):
            literals(r'_finish\(job, "(\w+)"|exit="(\w+)"|exit_path = "(\w+)"(?: if .* else "(\w+)")?',
                     "backend/engine.py"),
        ("kvroute_backend_commits", "path"):
            literals(r'_commit\([^)]*, "(\w+)"\)|_keep_partial\(job, "(\w+)"\)', "backend/engine.py"),
        ("kvroute_backend_commits_refused", "reason"):
            literals(r'return "(\w+)"', "backend/disk.py") | {"no_disk_tier"},
        ("kvroute_backend_cache_hits", "tier"): literals(r'return hit, "(\w+)"', "backend/engine.py"),
    }
    for (name, label), values in lazy.items():
        assert values, f"no call site of {name} found: the pattern is out of date"
        assert values <= got[name][label], (name, values - got[name][label])
    for name in ("kvroute_backend_ttft_seconds", "kvroute_backend_request_seconds"):
        got[name] = {"cached": literals(r'cached = "(\w+)" if .* else "(\w+)"', "backend/engine.py")}
    proxy = ProxyMetrics()
    proxy.set_models([{"model": "m", "state": "loaded", "memory_bytes": 0, "loads": 0,
                       "unloads": 0, "load_seconds": 0}])
    # What a proxy creates for its teams and for a backend it sees: every series at 0.
    proxy.know_teams(["t"], LIMITS)
    proxy.know_backend("b", ["m"], ROUTE_REASONS)
    got.update(exported_series(proxy.render()))
    got["kvroute_proxy_api_requests"] = {"api": set(APIS.values())}
    got["kvroute_proxy_route_decisions"] = {"reason": route_reasons()}
    return got


def route_reasons() -> set[str]:
    return literals(r'decide\(ctx, [^\n]*?, "([\w-]+)"|reason = "([\w-]+)"(?: if [^\n]* else "([\w-]+)")?'
                    r'|Decision\(c, "([\w-]+)"', "proxy/policy/policies.py", "proxy/routing.py")


_VALUE = re.compile(r"`?([\w-]+)`?$")


def documented_label_values(text: str) -> list[tuple[list[str], str | None, set[str]]]:
    """Each "`metric` (by exit path: a, b, c)", "(`metric{label}`: a, b)", "(label `x`:
    a/b)" or "(api: a, b; ...)" of a doc: (metrics, label if named, values)."""
    claims = []
    for paren in re.finditer(r"\(([^()]*)\)", text):
        head = re.match(r"\s*(?:by [\w ]+?|label `(\w+)`|`(kvroute_\w+?)(?:_total)?(?:\{(\w+)\})?`"
                        r"|`?(\w+)`?)\s*:\s*", paren.group(1))
        if not head:
            continue
        items = re.split(r",\s*|/", re.split(r"[;:]", paren.group(1)[head.end():])[0])
        values = [_VALUE.match(i.strip()) for i in items]
        if len(values) < 2 or not all(values):
            continue  # prose after a colon, not a list of values
        label = head.group(1) or head.group(3) or head.group(4)
        if head.group(2):
            metrics = [head.group(2)]
        else:  # the metric names just before the parenthesis ("`a` and `b` (...)")
            before = re.search(r"((?:`kvroute_\w+(?:\{[\w,]*\})?`(?:\s|and)*)+)$",
                               text[: paren.start()])
            if not before:
                continue
            metrics = re.findall(r"`(kvroute_\w+?)(?:_total)?(?:\{[\w,]*\})?`", before.group(1))
        claims.append((metrics, label, {v.group(1) for v in values}))
    return claims


@pytest.mark.parametrize("doc", ["README.md", "docs/dashboard.md"])
def test_documented_label_values_are_the_exported_ones(doc):
    code = code_label_values()
    claims = documented_label_values(text_of(ROOT / doc))
    assert len(claims) >= {"README.md": 6, "docs/dashboard.md": 2}[doc], claims
    for metrics, label, values in claims:
        for name in metrics:
            assert name in code, f"{doc} lists values of {name}, which has no such labels"
            labels = code[name]
            if label is None:
                (label,) = labels  # "by exit path": the metric's one label
            assert values == labels[label], (
                f"{doc}: {name} by {label} lists {sorted(values)}; "
                f"the code has {sorted(labels[label])}")


def test_dashboard_lists_every_routing_reason():
    row = next(line for line in text_of(ROOT / "docs/dashboard.md").splitlines()
               if line.startswith("| reason |"))
    documented = set(re.findall(r"`([a-z]+(?:-[a-z]+)*)`", row))
    assert documented == route_reasons()


def test_dashboard_guides_through_every_cache_reason():
    text = text_of(ROOT / "docs/dashboard.md")
    table = text[text.index("| cache reason |"):]
    table = table[: table.index("\n\n")]
    documented = [re.match(r"\| `(\w+)` \|", line) for line in table.splitlines()[2:]]
    assert [m.group(1) for m in documented if m] == list(REASONS)


def test_every_metric_the_docs_name_exists():
    names = set()
    for render in (backend_metrics.BackendMetrics("m", "b").render(), ProxyMetrics().render()):
        names |= set(re.findall(r"^# TYPE (\w+) ", render.decode(), re.M))
    counters = {n + "_total" for n in names}
    buckets = {n + "_bucket" for n in names}
    for doc in DOCS:
        for name in re.findall(r"`(kvroute_[a-z_]+?)(?:\{[^}]*\})?`", text_of(doc)):
            if name.endswith("_") or name == "kvroute_fault":  # a prefix; a request field
                continue
            assert name in names | counters | buckets, f"{doc.name} names {name}, which no process exports"


# -- flags -------------------------------------------------------------------------


def help_flags(command: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", command, "--help"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z][a-z-]*)", out.stdout))


def table_flags(heading: str) -> set[str]:
    text = text_of(ROOT / "README.md")
    section = text[text.index(heading):]
    section = section[: section.index("\n\n", section.index("|---"))]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    return {f.split()[0] for cell in rows for f in re.findall(r"`(--[^`]*)`", cell)}


@pytest.mark.parametrize("heading,command", [
    ("### `kvroute serve` flags and variables", "serve"),
    ("## The proxy (`kvroute proxy`)", "proxy"),
    ("### Backend flags", "backend"),
])
def test_every_flag_of_a_readme_table_is_in_its_commands_help(heading, command):
    flags = table_flags(heading)
    assert len(flags) > 8
    missing = flags - help_flags(command)
    assert not missing, f"README's {heading} lists {sorted(missing)}, not in `kvroute {command} --help`"


def test_every_kvroute_flag_the_readme_names_exists():
    """A `--flag` anywhere in the README's prose is some kvroute command's (bench
    scripts' and pytest's aside)."""
    known = set().union(*(help_flags(c) for c in ("serve", "proxy", "backend", "stats", "demo-model")))
    # bench.reliability, bench.bench_shapes, bench.bench_layers, bench.bench_hw
    others = {"--quick", "--soak", "--decode", "--restore", "--parts", "--profile"}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*[a-z])", text_of(ROOT / "README.md")))
    assert not named - known - others, sorted(named - known - others)


# -- links -------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file without its code blocks (a shell comment is no heading, a URL in a
    snippet no link)."""
    return re.sub(r"```.*?```", "", text_of(path), flags=re.S)


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", prose(path), re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    links = re.findall(r"\]\(([^)\s]+)\)", prose(doc))
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name} links {link}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name} links {link}: no such heading"


# -- KVROUTE_LOG_LEVEL -------------------------------------------------------------


def serve_until_ready(tmp_path: Path, model_cache: Path, args: list[str], env: dict) -> str:
    """`kvroute serve` of one demo replica with `args`, stopped once ready; its log."""
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--replicas", "1", "--cache-bytes",
           "64MiB", "--port", str(port), "--backend-port-base", str(free_port()), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVROUTE_CACHE_DIR": str(model_cache), **env},
                                start_new_session=True)
    try:
        def ready():
            assert proc.poll() is None, log.read_text()
            return len(get_json(f"http://127.0.0.1:{port}/health")["backends"]) == 1
        wait_until(ready, 120, interval=0.2, what="kvroute serve to be ready")
        # Its table comes after the launcher's start-up log lines.
        wait_until(lambda: "kvroute is serving" in log.read_text(), 30,
                   what="the launcher's start-up lines")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
    return log.read_text()


def test_serve_logs_at_kvroute_log_level_and_the_flag_beats_it(tmp_path, model_cache):
    quiet = serve_until_ready(tmp_path, model_cache, [], {"KVROUTE_LOG_LEVEL": "warning"})
    assert "kvroute is serving" in quiet
    assert " INFO " not in quiet, quiet
    loud = serve_until_ready(tmp_path, model_cache, ["--log-level", "info"],
                             {"KVROUTE_LOG_LEVEL": "warning", "KVROUTE_JSON_LOGS": "1"})
    launcher_lines = [line for line in loud.splitlines() if '"logger":"kvroute.loader"' in line]
    assert launcher_lines and '"level":"info"' in launcher_lines[0], loud


# -- files and modules -------------------------------------------------------------


USER_FILES = {"docker/.env"}  # what a user writes (compose's variables), not ours


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is no package
        return False


def test_every_source_path_and_module_the_docs_name_exists():
    """`kvroute/proxy/policy/cost.py`, `tests/test_x.py`, `kvroute.devtools.arch_models.ensure`:
    after a move, a doc naming the old place is wrong."""
    for doc in DOCS:
        text = text_of(doc)
        # A file (with its extension) or a folder (with its slash): "kvroute/qwen-coder"
        # in a client's config is a model name.
        for path in re.findall(r"(?<![\w/.-])((?:kvroute|tests|bench|scripts|docker)/"
                               r"(?:[\w./-]*\.\w+|[\w./-]*/)(?![\w/-]))", text):
            if path in USER_FILES:
                continue
            assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
        for dotted in re.findall(r"`(kvroute(?:\.\w+)+)", text):
            if re.fullmatch(r"kvroute\.(toml|json|yaml|log)", dotted):  # a file's name
                continue
            parts = dotted.split(".")
            found = [i for i in range(len(parts), 1, -1) if is_module(".".join(parts[:i]))]
            assert found, f"{doc.name} names {dotted}, which is no module"
            module = importlib.import_module(".".join(parts[: found[0]]))
            for attr in parts[found[0]:]:
                module = getattr(module, attr, None)
                assert module is not None, f"{doc.name} names {dotted}: no {attr}"


BENCH_DOCS = [ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md", *DOCS,
              *sorted((ROOT / "docs").glob("*/*.md"))]


def test_every_documented_benchmark_command_runs_a_module_that_exists():
    """Benchmarks run as modules from the repository root (`python -m bench.bench_ttft`):
    the old `python bench/x.py` form would not find the tests' harness."""
    commands = 0
    for doc in BENCH_DOCS:
        text = text_of(doc)
        assert not re.findall(r"python3? bench/", text), f"{doc.name}: run benchmarks as `python -m bench.X`"
        for module in re.findall(r"python3? -m (bench(?:\.\w+)+)", text):
            commands += 1
            assert is_module(module), f"{doc.name} runs `python -m {module}`, which is no module"
    assert commands > 10

