"""Hosts as network namespaces on a bridge, and the faults of their links.

Each host is a network namespace (`plexrl-<bed>-<host>`) with one interface, `eth0`, the
end of a veth pair whose other end is on the bed's bridge (`pxb<bed>`) in the root
namespace; every host gets its own address in a /24 of 10.0.0.0/8 nothing on this
machine uses yet, and the bridge the last one (.254), so the processes of the root
namespace (a test, a load balancer) reach every host. Processes run on a host under
`ip netns exec`, and bind its address.

Faults are iptables rules inside the host's namespace, never outside it:

- `partition`: every packet in or out of `eth0` dropped (loopback still works), as if
  its cable were cut: connections hang until their timeouts, nothing is refused;
- `degrade`: a share of the packets in and out dropped, and those leaving held back a
  while (`plexrl_tools.netem`: the kernel here has no `netem` qdisc);
- `heal` removes them all.

Everything is undone by `destroy`: processes still in a namespace are killed, the
interfaces, the bridge and the namespaces removed; `sweep` removes what any bed of
this machine left behind after a crash (by its names). Root runs this; a test only ever
sends traffic to the addresses of a bed it made.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NS_PREFIX = "plexrl-"
BRIDGE_PREFIX = "pxb"
VETH_PREFIX = "pxv"
NETEM_QUEUE = 7


class HostNetError(RuntimeError):
    """A command that builds or breaks the bed failed; says which and what it printed."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise HostNetError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def can_build() -> str | None:
    """Why namespaces cannot be built here (None: they can): root, `ip`, `iptables`."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("ip", "iptables", "haproxy"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"`{tool}` is missing (scripts/hosts.sh installs it)"
    return None


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    netns: str
    veth: str
    """The root namespace's end of its veth pair (on the bridge)."""

    def prefix(self) -> tuple[str, ...]:
        """The command that runs a program on this host."""
        return ("ip", "netns", "exec", self.netns)


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine touches."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout + _run("ip", "-4", "route").stdout
    taken = [
        ipaddress.ip_network(m, strict=False)
        for m in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", used)
        if not m.startswith("127.")
    ]
    for i in range(256):
        n = (seed + i * 7919) % (200 * 250)
        net = ipaddress.IPv4Network(f"10.{50 + n // 250}.{n % 250}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostNetError("no free /24 in 10.50.0.0-10.249.255.0 for the bed")


class HostNetwork:
    """The hosts of one bed (`bed`: a few hex digits naming it) and their faults."""

    def __init__(self, bed: str, names: list[str], subnet: ipaddress.IPv4Network) -> None:
        if not re.fullmatch(r"[0-9a-f]{4,6}", bed):
            raise ValueError(f"bed id {bed!r} must be 4-6 hex digits (interface names are short)")
        self.bed = bed
        self.subnet = subnet
        self.bridge = f"{BRIDGE_PREFIX}{bed}"
        self.gateway = str(subnet.network_address + 254)
        self.hosts = {
            name: Host(
                name,
                str(subnet.network_address + i + 1),
                f"{NS_PREFIX}{bed}-{name}",
                f"{VETH_PREFIX}{bed}{i}",
            )
            for i, name in enumerate(names)
        }
        self._netem: dict[str, subprocess.Popen[bytes]] = {}

    def create(self) -> None:
        """Build the bridge and every host; a failure half way undoes what was made."""
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts.values():
                self._create_host(host)
        except BaseException:
            self.destroy()
            raise

    def _create_host(self, host: Host) -> None:
        peer = f"{host.veth}p"
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", host.netns)
        _run("ip", "link", "set", host.veth, "master", self.bridge)
        _run("ip", "link", "set", host.veth, "up")
        inside = ("ip", "netns", "exec", host.netns)
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "link", "set", peer, "name", "eth0")
        _run(*inside, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")

    def pids(self, name: str) -> list[int]:
        """Every process running on a host (not those dead and waiting to be reaped)."""
        done = _run("ip", "netns", "pids", self.hosts[name].netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit() and not _zombie(int(p))]

    def kill_all(self, name: str, timeout_s: float = 30.0) -> int:
        """SIGKILL every process on a host (a host lost at once); returns how many."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + timeout_s
        while self.pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._netem.pop(name, None)
        return len(pids)

    def _iptables(self, name: str, *rule: str) -> None:
        _run(*self.hosts[name].prefix(), "iptables", *rule)

    def partition(self, name: str) -> None:
        """Cut a host off: every packet in or out of its interface is dropped."""
        self.heal(name)
        self._iptables(name, "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        self._iptables(name, "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")

    def degrade(self, name: str, loss: float = 0.1, delay_ms: float = 50.0) -> None:
        """Drop `loss` of a host's packets each way and hold those it sends `delay_ms`."""
        self.heal(name)
        if loss > 0:
            self._iptables(
                name,
                *("-A", "INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random"),
                *("--probability", f"{loss:.4f}", "-j", "DROP"),
            )
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"plexrl-netem-{self.bed}-{name}.log"
        with log.open("ab") as out:
            self._netem[name] = subprocess.Popen(
                [
                    *self.hosts[name].prefix(),
                    sys.executable,
                    "-m",
                    "plexrl_tools.netem",
                    *("--queue", str(NETEM_QUEUE), "--delay-ms", str(delay_ms)),
                    *("--loss", str(loss)),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        time.sleep(0.3)  # bound to its queue before packets are sent there
        self._iptables(
            name,
            *("-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE"),
            *("--queue-num", str(NETEM_QUEUE), "--queue-bypass"),
        )

    def heal(self, name: str) -> None:
        """Remove every fault of a host's link."""
        self._iptables(name, "-F", "INPUT")
        self._iptables(name, "-F", "OUTPUT")
        netem = self._netem.pop(name, None)
        if netem is not None and netem.poll() is None:
            netem.terminate()
            try:
                netem.wait(timeout=10)
            except subprocess.TimeoutExpired:
                netem.kill()
                netem.wait()

    def destroy(self) -> None:
        """Kill what runs on the hosts and remove them, their interfaces and the bridge."""
        for name in self.hosts:
            self.kill_all(name, timeout_s=10.0)
        remove(self.bed)


def _zombie(pid: int) -> bool:
    """A process that died and whose parent has not reaped it yet (a killed service is a
    child of the test that started it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def remove(bed: str) -> None:
    """Remove every namespace, veth and the bridge of bed `bed` (whatever is left)."""
    for netns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
        name = netns.split(" ")[0]
        if name.startswith(f"{NS_PREFIX}{bed}-"):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    continue
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(r"\d+: ([^:@]+)", line)
        if match and match.group(1).startswith((f"{VETH_PREFIX}{bed}", f"{BRIDGE_PREFIX}{bed}")):
            _run("ip", "link", "del", match.group(1), check=False)


def beds() -> list[str]:
    """The ids of every bed whose namespaces are on this machine."""
    found = set()
    for netns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
        match = re.match(rf"{NS_PREFIX}([0-9a-f]{{4,6}})-", netns)
        if match:
            found.add(match.group(1))
    return sorted(found)
