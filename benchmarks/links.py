"""A switched network on one machine: one Linux network namespace per worker.

Each worker namespace has one interface, ``eth0``, at ``10.213.0.(i+1)``: a
veth pair whose other end is a port of a bridge in a namespace of its own
(the switch). With a ``rate``, a token-bucket filter (``tc tbf``) limits
both directions of every link, the worker's egress on ``eth0`` and the
switch's egress on the port, so each worker has a full-duplex link of
``rate`` to the switch, as a host has to a switch port in a real cluster.
A ring all-reduce, where every worker sends to one neighbour and receives
from another at the same time, can use the whole rate on every link.

Nothing is made in the caller's own namespace: the namespaces, and the
``/etc/netns/NAME/hosts`` file that makes the host name resolve to the
worker's own address inside it (gloo binds to the address of the host
name), are removed on exit, after killing whatever still runs inside.
Building links needs root (``CAP_NET_ADMIN``); ``unavailable()`` says why
it cannot be done here, if so.
"""

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
from typing import Iterator

SUBNET = "10.213.0"
_NETNS_ETC = pathlib.Path("/etc/netns")


def _run(*args: str) -> str:
  done = subprocess.run(
      args, capture_output=True, text=True, timeout=30, check=False
  )
  if done.returncode:
    raise RuntimeError(
        f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
    )
  return done.stdout


def unavailable() -> str | None:
  """Why links cannot be built here, or None if they can."""
  if os.geteuid() != 0:
    return "building network namespaces and tc links needs root"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"{tool!r} (iproute2) is not installed"
  return None


def tbf(rate_mbit: float) -> list[str]:
  """``tc`` arguments limiting a link to ``rate_mbit`` megabits per second.

  The bucket holds 4 ms at the rate (at least 64 KiB, a full TSO segment),
  so short bursts pass at line rate as through a switch's buffer, and the
  queue holds 100 ms before dropping.
  """
  if rate_mbit <= 0:
    raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
  burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
  return [
      "tbf",
      "rate",
      f"{rate_mbit}mbit",
      "burst",
      str(burst),
      "latency",
      "100ms",
  ]


class Network:
  """The namespaces of one run, with the commands to run in them."""

  def __init__(self, prefix: str, workers: int):
    self.switch = f"{prefix}-s"
    self.names = [f"{prefix}-w{i}" for i in range(workers)]

  def address(self, worker: int) -> str:
    return f"{SUBNET}.{worker + 1}"

  def exec_prefix(self, worker: int) -> list[str]:
    """The command prefix that runs a command in ``worker``'s namespace."""
    return ["ip", "netns", "exec", self.names[worker]]


def _teardown(network: Network) -> None:
  for name in network.names + [network.switch]:
    pids = subprocess.run(
        ["ip", "netns", "pids", name],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.split()
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(int(pid), signal.SIGKILL)
    subprocess.run(
        ["ip", "netns", "del", name],
        capture_output=True,
        timeout=30,
        check=False,
    )
    shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)


@contextlib.contextmanager
def switched(
    workers: int, rate_mbit: float | None, prefix: str | None = None
) -> Iterator[Network]:
  """``workers`` namespaces on a bridge, each link limited to ``rate_mbit``
  (None: unshaped), torn down on exit however it happens."""
  if not 2 <= workers <= 250:
    raise ValueError(f"workers must be in [2, 250], got {workers}")
  reason = unavailable()
  if reason:
    raise PermissionError(reason)
  network = Network(prefix or f"acp{os.getpid()}", workers)
  shape = None if rate_mbit is None else tbf(rate_mbit)
  try:
    s = network.switch
    _run("ip", "netns", "add", s)
    _run("ip", "-n", s, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", s, "link", "set", "br0", "up")
    for i, w in enumerate(network.names):
      _run("ip", "netns", "add", w)
      port = f"p{i}"
      _run(
          "ip",
          "-n",
          s,
          "link",
          "add",
          port,
          "type",
          "veth",
          "peer",
          "name",
          "eth0",
          "netns",
          w,
      )
      _run("ip", "-n", s, "link", "set", port, "master", "br0", "up")
      _run(
          "ip",
          "-n",
          w,
          "addr",
          "add",
          f"{network.address(i)}/24",
          "dev",
          "eth0",
      )
      _run("ip", "-n", w, "link", "set", "eth0", "up")
      _run("ip", "-n", w, "link", "set", "lo", "up")
      if shape:
        _run("tc", "-n", w, "qdisc", "add", "dev", "eth0", "root", *shape)
        _run("tc", "-n", s, "qdisc", "add", "dev", port, "root", *shape)
      # `ip netns exec` mounts this over /etc/hosts.
      etc = _NETNS_ETC / w
      etc.mkdir(parents=True, exist_ok=True)
      (etc / "hosts").write_text(
          f"127.0.0.1 localhost\n{network.address(i)} {socket.gethostname()}\n"
      )
    yield network
  finally:
    _teardown(network)
