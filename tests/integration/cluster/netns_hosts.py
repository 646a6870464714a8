"""Hosts for real: one Linux network namespace per role, joined by a bridge in a switch namespace.

Every address lives inside namespaces this module creates (10.250.0.0/24 on veth pairs); the root namespace
gets none, and `Hosts.remove()` deletes every namespace (and with them every link). Processes start with
`ip netns exec <ns> ...`, which execs the command, so a Popen's pid is the role's own process. Roles share only
the home directory on disk, as the Helm pods share their volume.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.250.0"


def netns_available() -> str | None:
    """None when namespaces can be made here, else why not (the tests then skip with that reason)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"slm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One role's namespace, its address and the veth end it owns."""

    name: str
    netns: str
    address: str
    link: str

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def set_link(self, up: bool) -> None:
        """Plug or unplug this host's only network cable (its loopback stays up)."""
        _ip("-n", self.netns, "link", "set", self.link, "up" if up else "down")


@dataclass
class Hosts:
    """A switch namespace with a bridge and one namespace per named host, each on the bridge."""

    prefix: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @classmethod
    def create(cls, names: list[str]) -> "Hosts":
        """Namespaces named `slm<pid>-<host>`; addresses .1, .2, ... in the order of `names`."""
        hosts = cls(prefix=f"slm{os.getpid()}")
        try:
            _ip("netns", "add", hosts.switch)
            _ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", hosts.switch, "link", "set", "br0", "up")
            for number, name in enumerate(names, 1):
                hosts._add(name, number)
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def _add(self, name: str, number: int) -> None:
        netns = f"{self.prefix}-{name}"
        inner, outer = f"eth{number}", f"sw{number}"
        _ip("netns", "add", netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "link", "add", inner, "type", "veth", "peer", "name", outer, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outer, "master", "br0")
        _ip("-n", self.switch, "link", "set", outer, "up")
        address = f"{SUBNET}.{number}"
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", netns, "link", "set", inner, "up")
        self.hosts[name] = Host(name=name, netns=netns, address=address, link=inner)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def remove(self) -> None:
        """Delete every namespace this object made (their veths and the bridge go with them)."""
        for netns in [h.netns for h in self.hosts.values()] + [self.switch]:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self.hosts.clear()


def shared_home(root: Path) -> Path:
    """The directory every role mounts as SCALARLM_HOME."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    return home
