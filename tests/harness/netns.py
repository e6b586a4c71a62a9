"""Several machines on this one: network namespaces joined by a bridge, each running
its own `kvroute serve`, for the tests and benchmarks of a fleet of machines.

Each host is a network namespace (its own addresses, ports, loopback and processes)
with one veth pair into a bridge in the root namespace. The bridge holds the first
address of a private /24 picked per run (where a Redis every host reaches listens),
host i the address .(10 + i). Nothing is routed beyond that /24: the hosts reach
the bridge and each other, nothing else. Names carry a token of this run, so runs
side by side never meet, and `close()` removes everything, whatever state the
processes were left in. Needs root and iproute2 (`unavailable()` says why not).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.harness.http import get_json
from tests.harness.paths import ROOT
from tests.harness.polling import wait_until
from tests.harness.processes import toml_text


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"kvroute-probe-{secrets.token_hex(4)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        ran = subprocess.run(["ip", "netns", "exec", probe, "true"], capture_output=True, text=True)
        if ran.returncode:
            return f"`ip netns exec` failed: {ran.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10/8 that no address or route of this machine overlaps."""
    used = []
    for cmd in (["ip", "-4", "-o", "addr"], ["ip", "-4", "route"]):
        for word in subprocess.run(cmd, capture_output=True, text=True).stdout.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    used = [n for n in used if n.prefixlen > 0]  # the default route overlaps everything
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 254)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free private /24 for the test network")


class Hosts:
    """Hosts named `names`, each a network namespace on one bridge."""

    def __init__(self, names: list[str]):
        self.token = secrets.token_hex(3)
        self.names = list(names)
        self.subnet = _free_subnet()
        self.bridge = f"kvb{self.token}"
        self.namespaces = {n: f"kvroute-{self.token}-{n}" for n in names}
        self.veths = {n: f"kv{self.token}h{i}" for i, n in enumerate(names)}  # root side
        self.made: list[tuple[str, ...]] = []  # `ip` arguments that undo each step, in order

    @property
    def bridge_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def address(self, name: str) -> str:
        return str(self.subnet.network_address + 10 + self.names.index(name))

    def start(self) -> "Hosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns, veth = self.namespaces[name], self.veths[name]
                _ip("netns", "add", ns)
                self.made.append(("netns", "del", ns))
                # The pair's far end goes straight into the namespace, as its eth0.
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.made.append(("link", "del", veth))  # gone with the namespace too
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def popen(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        """`argv` run inside host `name` (`ip netns exec` execs it: the pid is argv's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[name], *argv], **kw)

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[name]], capture_output=True,
                             text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self, name: str) -> int:
        """SIGKILL every process of host `name` at once, as a machine that dies; returns
        how many there were."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def close(self) -> None:
        for name in self.names:
            if ("netns", "del", self.namespaces[name]) in self.made:
                self.kill(name)
        for args in reversed(self.made):
            subprocess.run(["ip", *args], capture_output=True)
        self.made.clear()

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class HostServe:
    """`kvroute serve` on one host from `config` (a dict, written as NAME.toml in
    `workdir`; log in NAME.log), its proxy on the host's address, port 8000, its
    backends from 8100: each host has its own ports, as each machine does."""

    PROXY_PORT, BACKEND_PORT_BASE = 8000, 8100

    def __init__(self, hosts: Hosts, name: str, config: dict, workdir: Path):
        self.hosts, self.name = hosts, name
        self.address = hosts.address(name)
        config = {**config, "machine": name,
                  "proxy": {**config.get("proxy", {}), "host": self.address,
                            "port": self.PROXY_PORT},
                  "backends": {**config.get("backends", {}), "host": self.address,
                               "port_base": self.BACKEND_PORT_BASE}}
        self.config_path = Path(workdir) / f"{name}.toml"
        self.config_path.write_text(toml_text(config))
        self.log_path = Path(workdir) / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = hosts.popen(name, [sys.executable, "-m", "kvroute.cli", "serve", "--config",
                                       str(self.config_path)],
                                cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.PROXY_PORT}"

    def wait_ready(self, ready: Callable[[], Any], timeout: float,
                   what: str = "kvroute serve to be ready") -> Any:
        def check() -> Any:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: kvroute serve exited with "
                                   f"{self.proc.returncode}:\n{self.log_tail()}")
            return ready()

        return wait_until(check, timeout, interval=0.2, what=f"{self.name}: {what}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to serve (it stops its children), SIGKILL to the host past `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.hosts.kill(self.name)
        self.proc.wait(5)
        self._log.close()


@dataclass
class Machines:
    hosts: Hosts
    cluster: Any  # test_cluster.LocalCluster
    serves: dict[str, HostServe]

    def proxy(self, host: str) -> str:
        return self.serves[host].url


@contextlib.contextmanager
def machines(configs: dict[str, dict], workdir: Path, backends: int) -> Iterator[Machines]:
    """A host per key of `configs`, a three-master Redis Cluster on their bridge, and
    on each host `kvroute serve` with its config plus what every machine shares (the
    cluster's URL, the secret, the internal token); yields once every proxy sees
    `backends` backends. Everything is stopped after, whatever fails, the network last."""
    from tests.test_cluster import LocalCluster

    with contextlib.ExitStack() as stack:
        hosts = Hosts(list(configs)).start()
        stack.callback(hosts.close)
        cluster = LocalCluster(host=hosts.bridge_address)
        stack.callback(cluster.close)
        cluster.start()
        shared = {"secret": f"secret-{hosts.token}", "internal_token": f"token-{hosts.token}",
                  "redis": {"url": cluster.url}}
        serves: dict[str, HostServe] = {}
        for name, config in configs.items():
            serves[name] = HostServe(hosts, name, {**config, **shared}, workdir)
            stack.callback(serves[name].stop)
        for serve in serves.values():
            serve.wait_ready(lambda s=serve: len(get_json(s.url + "/health")["backends"]) == backends,
                             120, what=f"its proxy to see {backends} backends")
        yield Machines(hosts, cluster, serves)
