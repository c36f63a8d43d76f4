"""Worker processes on a network of namespaces: started together, bounded
in time, killed together; each one's ``RESULT`` record read back.

``benchmarks.cluster`` and ``benchmarks.cluster_nodes`` run their workers
(``benchmarks.worker``, ``benchmarks.torch_peer``) through these.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

from benchmarks import links

# The link rates of a run, in Mbit/s (None: unshaped).
BANDWIDTHS = {
    "10mbit": 10.0,
    "100mbit": 100.0,
    "1gbit": 1000.0,
    "10gbit": 10000.0,
    "unshaped": None,
}
COORDINATOR_PORT = 8476
TORCH_PORT = 29500


def launch(commands: list[list[str]], timeout: float) -> list[dict[str, Any]]:
  """Runs the commands at once and returns each one's ``RESULT`` record;
  all are killed if one fails or ``timeout`` seconds pass."""
  env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
  with contextlib.ExitStack() as stack:
    # Files, not pipes: a chatty worker cannot block on a full pipe.
    logs = [
        [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe"]
        for _ in commands
    ]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
        for cmd, (out, err) in zip(commands, logs)
    ]
    deadline = time.monotonic() + timeout
    try:
      for proc in procs:
        try:
          proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
          raise TimeoutError(
              f"{' '.join(proc.args)} ran past {timeout:.0f} s"
          ) from None
    finally:
      for proc in procs:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
    outputs = []
    for proc, (out, err) in zip(procs, logs):
      out.seek(0)
      err.seek(0)
      if proc.returncode:
        raise RuntimeError(
            f"{' '.join(proc.args)} exited with {proc.returncode}:\n"
            + "\n".join(err.read().strip().splitlines()[-15:])
        )
      lines = [l for l in out.read().splitlines() if l.startswith("RESULT ")]
      if not lines:
        raise RuntimeError(f"{' '.join(proc.args)} printed no RESULT line")
      outputs.append(json.loads(lines[-1][len("RESULT ") :]))
    return outputs


def jax_cmd(mode: str, *args: str) -> list[str]:
  return [sys.executable, "-m", "benchmarks.worker", mode, *args]


def distributed(network: links.Network, worker: int) -> list[str]:
  return [
      f"--coordinator_address={network.address(0)}:{COORDINATOR_PORT}",
      f"--num_processes={len(network.names)}",
      f"--process_id={worker}",
  ]


def torch_distributed(network: links.Network, worker: int) -> list[str]:
  """The flags of a PyTorch peer (``torch_peer``, ``torch_quality``): its
  gloo group's address and its place in it, and one thread per process
  where the cores are shared, as torchrun sets (torch's spinning threads
  oversubscribe)."""
  workers = len(network.names)
  return [
      f"--master_addr={network.address(0)}",
      f"--master_port={TORCH_PORT}",
      f"--world_size={workers}",
      f"--process_id={worker}",
      f"--threads={max(1, os.cpu_count() // workers)}",
  ]


def on_network(network, make_cmd, timeout):
  return launch(
      [network.exec_prefix(i) + make_cmd(i) for i in range(len(network.names))],
      timeout,
  )


def attempt(failures: list[str], what: str, run):
  """``run()``'s result, or None with the failure noted: one run that
  fails or times out costs its own record, not the others'."""
  try:
    return run()
  except (RuntimeError, TimeoutError) as e:
    failures.append(f"{what}: {e}")
    print(f"  FAILED {what}: {str(e).splitlines()[0]}", flush=True)
    return None


@contextlib.contextmanager
def compilation_cache(path: str):
  """JAX's persistent compilation cache in ``path`` for the workers this
  process starts, every program cached however fast it compiled."""
  keys = {
      "JAX_COMPILATION_CACHE_DIR": path,
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }
  saved = {k: os.environ.get(k) for k in keys}
  os.environ.update(keys)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def each_link(
    workers: list[int], bandwidths: list[str]
) -> Iterator[tuple[int, str, links.Network]]:
  """Each (worker count, link name, network) of a sweep in turn, the link
  up only while its turn runs. The workers of all turns share one
  persistent compilation cache, made here and removed after: each program
  compiles once per worker count, not once per link."""
  with tempfile.TemporaryDirectory() as cache, compilation_cache(cache):
    for p in workers:
      for bandwidth in bandwidths:
        with links.switched(p, BANDWIDTHS[bandwidth]) as network:
          yield p, bandwidth, network
