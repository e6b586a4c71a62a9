"""The settings table: flag beats environment beats file beats default; unknown names
are errors; the README's configuration reference matches the table."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute import config
from kvroute.config import ConfigError
from kvroute.core.sizes import parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def parse(table, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_flags(p, table)
    return p.parse_args(argv)


def test_flag_beats_environment_beats_file_beats_default(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[proxy]\nport = 7001\nhost = "0.0.0.0"\npolicy = "random"\n'
                    '[backends]\nport_base = 9100\n')
    env = {"KVROUTE_PORT": "7002", "KVROUTE_HOST": "10.0.0.1"}
    c = config.build(parse(config.SERVE, ["--config", str(path), "--port", "7003"]), env)
    assert (c.port, c.host, c.policy, c.backend_port_base) == (7003, "10.0.0.1", "random", 9100)
    c = config.build(parse(config.SERVE, ["--config", str(path)]), env)
    assert c.port == 7002
    c = config.build(parse(config.SERVE, ["--config", str(path)]), {})
    assert (c.port, c.host) == (7001, "0.0.0.0")
    c = config.build(parse(config.SERVE, []), {})
    assert (c.port, c.host, c.policy) == (8000, "127.0.0.1", "cache-aware")
    assert [(m.alias, m.replicas) for m in c.models] == [("kvroute-demo", 2)]


def test_models_take_backend_defaults_and_flags_override_them(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[[models]]\npath = "demo"\nalias = "a"\nmax_batch = 4\n'
                    '[[models]]\nrepo = "org/some-model"\ncache_bytes = "1GiB"\n')
    c = config.build(parse(config.SERVE, ["--config", str(path)]), {})
    a, b = c.models
    backend = {s.name: s.default for s in config.BACKEND}
    assert (a.alias, a.replicas, a.max_batch, a.cache_bytes) == ("a", 1, 4, backend["cache_bytes"])
    assert (b.alias, b.path, b.cache_bytes) == ("some-model", "org/some-model", 1 << 30)
    assert b.backend_flags()[:2] == ["--cache-bytes", str(1 << 30)]
    c = config.build(parse(config.SERVE, ["--config", str(path), "--replicas", "3",
                                          "--cache-bytes", "64MiB"]), {})
    assert {(m.replicas, m.cache_bytes) for m in c.models} == {(3, 64 << 20)}


def test_disk_fsync_is_a_model_setting_with_two_policies(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[[models]]\npath = "demo"\ndisk_fsync = "never"\n')
    (model,) = config.build(parse(config.SERVE, ["--config", str(path)]), {}).models
    flags = model.backend_flags()
    assert flags[flags.index("--disk-fsync") + 1] == "never"  # what its backends are given
    backend = config.resolve(config.BACKEND, parse(config.BACKEND, []), {"KVROUTE_DISK_FSYNC": "never"})
    assert backend["disk_fsync"] == "never"
    assert config.resolve(config.BACKEND, parse(config.BACKEND, []), {})["disk_fsync"] == "always"
    path.write_text('[[models]]\npath = "demo"\ndisk_fsync = "sometimes"\n')
    with pytest.raises(ConfigError, match="disk_fsync: 'sometimes' is not one of always, never"):
        config.build(parse(config.SERVE, ["--config", str(path)]), {})


def test_cache_quantization_is_a_model_setting_exact_by_default(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[[models]]\npath = "demo"\ncache_quantization = 8\n')
    (model,) = config.build(parse(config.SERVE, ["--config", str(path)]), {}).models
    flags = model.backend_flags()
    assert flags[flags.index("--cache-quantization") + 1] == "8"
    assert config.resolve(config.BACKEND, parse(config.BACKEND, []), {})["cache_quantization"] == 0
    env = {"KVROUTE_CACHE_QUANTIZATION": "4"}
    assert config.resolve(config.BACKEND, parse(config.BACKEND, []), env)["cache_quantization"] == 4
    path.write_text('[[models]]\npath = "demo"\ncache_quantization = 5\n')
    with pytest.raises(ConfigError, match="cache_quantization: invalid value 5 .0 .exact., 8 or 4"):
        config.build(parse(config.SERVE, ["--config", str(path)]), {})


def test_api_keys_from_flag_environment_and_file(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[proxy]\napi_keys = ["sk-file:team"]\n')
    args = ["--config", str(path)]
    assert config.build(parse(config.SERVE, args), {}).api_keys == {"sk-file": "team"}
    env = {"KVROUTE_API_KEYS": "sk-a:x, sk-b"}
    assert config.build(parse(config.SERVE, args), env).api_keys == {"sk-a": "x", "sk-b": None}
    got = config.build(parse(config.SERVE, args + ["--api-key", "sk-c"]), env).api_keys
    assert got == {"sk-c": None}
    proxy = config.resolve(config.PROXY, parse(config.PROXY, []), env)
    assert config.parse_api_keys(proxy["api_keys"]) == {"sk-a": "x", "sk-b": None}


def test_environment_values_are_typed_and_switches_read_zero_as_off():
    s = config.resolve(config.BACKEND, parse(config.BACKEND, []),
                       {"KVROUTE_CACHE_BYTES": "512MiB", "KVROUTE_PORT": "9", "KVROUTE_JSON_LOGS": "0",
                        "KVROUTE_ENABLE_FAULTS": "1"})
    assert (s["cache_bytes"], s["port"], s["json_logs"], s["enable_faults"]) == (512 << 20, 9, False, True)
    for word, on in [("off", False), ("No", False), ("on", True), ("true", True)]:
        assert config.resolve(config.BACKEND, parse(config.BACKEND, []),
                              {"KVROUTE_JSON_LOGS": word})["json_logs"] is on
    with pytest.raises(ConfigError, match="KVROUTE_JSON_LOGS: invalid value 'of' \\(a switch"):
        config.resolve(config.BACKEND, parse(config.BACKEND, []), {"KVROUTE_JSON_LOGS": "of"})
    with pytest.raises(ConfigError, match="KVROUTE_PORT: invalid value 'x'"):
        config.resolve(config.BACKEND, parse(config.BACKEND, []), {"KVROUTE_PORT": "x"})
    with pytest.raises(ConfigError, match="KVROUTE_POLICY: 'fastest' is not one of"):
        config.resolve(config.PROXY, parse(config.PROXY, []), {"KVROUTE_POLICY": "fastest"})


def test_unknown_file_keys_are_named(tmp_path):
    path = tmp_path / "k.toml"
    for text, named in [("[proxy]\nprot = 1\n", "unknown key proxy.prot (did you mean proxy.port?)"),
                        ("secrte = 'x'\n", "unknown key secrte (did you mean secret?)"),
                        ("[redis]\nurl = 'r'\npassword = 'p'\n", "unknown key redis.password"),
                        ("[[models]]\nrelicas = 2\n",
                         "unknown keys relicas (did you mean replicas?)"),
                        ("models = [1, 2]\n", "[[models]] #1: each model is a table"),
                        ("[proxy]\nport = 80.5\n", "proxy.port in the config file: invalid value 80.5"),
                        ("[[models]]\nmax_batch = true\n", "max_batch: invalid value True"),
                        ("[proxy]\nload_timeout = 0\n", "proxy.load_timeout in the config file: "
                                                       "invalid value 0 (seconds, more than 0)"),
                        # TOML values are typed: a quoted number or a word for a switch is a
                        # mistake (the environment's strings are converted, not the file's).
                        ("[[models]]\nreplicas = \"2\"\n",
                         "replicas: invalid value '2' (expected a whole number"),
                        ("[[models]]\npin = \"yes\"\n", "pin: invalid value 'yes' (expected true or false"),
                        ("[proxy]\nload_timeout = \"30\"\n", "invalid value '30' (expected a number of seconds"),
                        ("[proxy]\napi_keys = \"k\"\n", "invalid value 'k' (expected an array"),
                        ("[proxy]\nhost = 1\n", "proxy.host in the config file: invalid value 1 "
                                                 "(expected a string")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(named)):
            config.build(parse(config.SERVE, ["--config", str(path)]), {})


def test_backend_variables_reach_the_backends_serve_starts(tmp_path):
    # serve hands each backend its model's settings as flags; a KVROUTE_* variable of
    # a backend setting must still win over the file (and lose to serve's own flags).
    path = tmp_path / "k.toml"
    path.write_text('[[models]]\npath = "demo"\ncache_bytes = "1GiB"\nmax_queue = 7\n'
                    '[[models]]\npath = "demo"\nalias = "b"\ndemo_variant = "tool"\n')
    env = {"KVROUTE_CACHE_BYTES": "8GiB", "KVROUTE_MAX_QUEUE": "5", "KVROUTE_DISK_FSYNC": "never",
           "KVROUTE_DISK_CACHE_BYTES": "3GiB", "KVROUTE_DEFAULT_MAX_TOKENS": "100"}
    models = config.build(parse(config.SERVE, ["--config", str(path)]), env).models
    for m in models:
        flags = m.backend_flags()
        got = {f: flags[flags.index(f) + 1] for f in ("--cache-bytes", "--max-queue", "--disk-fsync",
                                                       "--default-max-tokens")}
        assert got == {"--cache-bytes": str(8 << 30), "--max-queue": "5", "--disk-fsync": "never",
                       "--default-max-tokens": "100"}
        assert (m.disk_cache_bytes, m.disk_budget_set) == (3 << 30, True)
    assert models[1].demo_variant == "tool"  # a file value no variable names stays
    flagged = config.build(parse(config.SERVE, ["--config", str(path), "--cache-bytes", "64MiB"]), env)
    assert {m.cache_bytes for m in flagged.models} == {64 << 20}
    (demo,) = config.build(parse(config.SERVE, []), {"KVROUTE_DEMO_VARIANT": "tool"}).models
    assert (demo.demo_variant, demo.alias) == ("tool", "kvroute-demo-tool")
    with pytest.raises(ConfigError, match="KVROUTE_MAX_QUEUE: invalid value 'many'"):
        config.build(parse(config.SERVE, []), {"KVROUTE_MAX_QUEUE": "many"})


def test_serve_prints_config_errors_and_child_lines_as_text_not_markup(tmp_path, capsys):
    path = tmp_path / "k.toml"
    path.write_text("models = 3\n")
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "an array of tables ([[models]])" in out.stderr
    from kvroute.serve.launcher import Launcher
    from kvroute.serve.processes import Child
    # A child's log line with what Rich would read as a closing tag: printed as it is,
    # where it raised before (and the pump that reads the child's output would stop).
    Launcher(config.ServeConfig()).log(Child("m-1", [], "", "cyan"), "bad [/x] and [bold]")
    assert "bad [/x] and [bold]" in capsys.readouterr().err


def test_unknown_environment_variable_is_an_error_that_names_it():
    config.check_environment({"KVROUTE_PORT": "1", "KVROUTE_CACHE_DIR": "/tmp", "HOME": "/root"})
    with pytest.raises(ConfigError, match="KVROUTE_PROT .did you mean KVROUTE_PORT"):
        config.check_environment({"KVROUTE_PROT": "1"})
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve"], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "KVROUTE_SECERT": "x"})
    assert out.returncode == 2 and "unknown environment variable KVROUTE_SECERT" in out.stderr


def _readme_rows(heading: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    section = section[: section.index("\n\n", section.index("|---"))]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `--")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def _check_default(setting: config.Setting, cell: str) -> None:
    if setting.type is parse_bytes and setting.default is not None:
        assert parse_bytes(cell) == setting.default, (setting.name, cell)
    elif isinstance(setting.default, (int, float)) and not isinstance(setting.default, bool):
        assert float(cell) == setting.default, (setting.name, cell)
    elif isinstance(setting.default, str) and setting.default:
        assert cell == setting.default, (setting.name, cell)


@pytest.mark.parametrize("heading,table,columns", [
    ("### `kvroute serve` flags and variables", config.SERVE, (0, 1, 2)),
    ("## The proxy (`kvroute proxy`)", config.PROXY, (0, 1, 2)),
    ("### Backend flags", config.BACKEND, (0, None, 1)),
])
def test_readme_configuration_reference_matches_the_table(heading, table, columns):
    by_flag = {s.flag: s for s in table if s.flag}
    rows = _readme_rows(heading)
    assert rows
    flag_col, env_col, default_col = columns
    for row in rows:
        flags = [f.split()[0] for f in _ticked(row[flag_col])]
        envs = _ticked(row[env_col]) if env_col is not None else []
        defaults = _ticked(row[default_col])
        for i, flag in enumerate(flags):
            assert flag in by_flag, f"README lists {flag}, which `{heading}` does not have"
            s = by_flag[flag]
            if env_col is not None:
                assert (envs[i] if i < len(envs) else None) == s.env, (flag, row)
            else:  # the backend section says every flag has KVROUTE_<FLAG>
                assert s.env == "KVROUTE_" + flag[2:].upper().replace("-", "_")
            if len(defaults) == len(flags):
                _check_default(s, defaults[i])


def test_usage_limits_from_the_file_the_environment_and_flags(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('[limits]\nrequests_per_minute = ["team-a=60"]\n'
                    'allowed_models = ["team-a=demo;tiny"]\n')
    serve = config.build({"config": str(path)}, {"KVROUTE_TOKENS_PER_DAY": "*=1000,sk-x=5"})
    assert serve.limits == {"requests_per_minute": [("team-a", 60)],
                            "tokens_per_day": [("*", 1000), ("sk-x", 5)],
                            "allowed_models": [("team-a", ("demo", "tiny"))]}
    # What the proxy `kvroute serve` starts reads back the same.
    env = config.limit_variables(serve.limits)
    assert env["KVROUTE_ALLOWED_MODELS"] == "team-a=demo;tiny"
    assert config.resolve(config.PROXY, {}, env)["allowed_models"] == [("team-a", ("demo", "tiny"))]
    parser = argparse.ArgumentParser()
    config.add_flags(parser, config.PROXY)
    flags = parser.parse_args(["--concurrent-requests", "team-b=2", "--concurrent-requests",
                               "sk-key==1"])
    assert config.resolve(config.PROXY, flags, {})["concurrent_requests"] == \
        [("team-b", 2), ("sk-key=", 1)]  # a key may end in '=' (base64)
    for bad in ("team-a", "=5", "team-a=-1", "team-a=many"):
        with pytest.raises(config.ConfigError):
            config.resolve(config.PROXY, {}, {"KVROUTE_REQUESTS_PER_MINUTE": bad})
