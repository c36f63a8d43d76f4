"""Nodes of several devices on the shaped links: hierarchical, sharded and
flat compression side by side (``python -m benchmarks cluster
--hierarchical``).

Each worker process is a node of ``--devices_per_worker`` CPU devices in
its own network namespace, so only the traffic between nodes crosses the
shaped links; each counts the bytes and packets its link sends.
"""

import statistics
from typing import Any

from benchmarks import launch
from benchmarks import links

# (compressor, layout of ``worker.LAYOUTS``): hierarchical ACP-SGD, the
# same with the model sharded within each node, flat ACP-SGD, whose ring
# over all devices crosses the slow links, and flat S-SGD.
HIERARCHICAL_RUNS = (
    ("acp_sgd", "hierarchical"),
    ("acp_sgd", "sharded"),
    ("acp_sgd", "flat"),
    ("ssgd", "flat"),
)


def run_nodes(
    network: links.Network,
    model: str,
    compressor: str,
    layout: str,
    steps: int,
    devices: int,
    timeout: float,
    params_out=None,
) -> list[dict[str, Any]]:
  """Each worker's ``nodes`` record of one run on ``network``: a node of
  ``devices`` devices per worker, each counting the bytes on its link;
  with ``params_out(i)``, worker ``i`` saves its params there."""
  return launch.on_network(
      network,
      lambda i: launch.jax_cmd(
          "nodes",
          f"--workload={model}",
          f"--compressor={compressor}",
          f"--steps={steps}",
          f"--devices={devices}",
          f"--layout={layout}",
          "--link=eth0",
          *([f"--params_out={params_out(i)}"] if params_out else []),
          *launch.distributed(network, i),
      ),
      timeout,
  )


def _nodes_record(results: list[dict[str, Any]]) -> dict[str, Any]:
  """One run's record from its workers': the slowest worker's examples/s,
  the bytes and packets a node's link sent per step, the accounting per
  device on each mesh axis, and whether the workers ended with the same
  params."""
  first = results[0]
  return {
      "examples_per_sec": min(r["examples_per_sec"] for r in results),
      "slow_link_bytes_per_step": statistics.mean(
          r["link_tx_bytes_per_step"] for r in results
      ),
      # Each packet adds its headers (66 bytes of Ethernet, IP and TCP) to
      # the bytes counted, and each gloo message its own framing.
      "slow_link_packets_per_step": statistics.mean(
          r["link_tx_packets_per_step"] for r in results
      ),
      "node_axis_bytes_per_device": first["node_axis_bytes_per_device"],
      "local_axis_bytes_per_device": first["local_axis_bytes_per_device"],
      "params_identical": len({r["params_sha256"] for r in results}) == 1,
  }


def measure_hierarchical(
    model: str,
    nodes: int,
    devices: int,
    bandwidths: list[str],
    steps: int,
    timeout: float,
) -> tuple[list[dict[str, Any]], list[str]]:
  """Records of ``nodes`` processes of ``devices`` devices each, one node
  per namespace, so that only traffic between nodes crosses the shaped
  links, one per bandwidth and run of ``HIERARCHICAL_RUNS``; and the runs
  that failed (``_nodes_record`` says what a record holds)."""
  runs, failures = [], []
  for bandwidth in bandwidths:
    base = {
        "bandwidth": bandwidth,
        "nodes": nodes,
        "devices_per_node": devices,
        "model": model,
    }
    with links.switched(nodes, launch.BANDWIDTHS[bandwidth]) as network:
      for name, layout in HIERARCHICAL_RUNS:
        results = launch.attempt(
            failures,
            f"{bandwidth} {layout} {name}",
            lambda: run_nodes(
                network, model, name, layout, steps, devices, timeout
            ),
        )
        if results is None:
          continue
        run = {**base, "compressor": name, "mode": layout}
        runs.append({**run, **_nodes_record(results)})
        print(
            f"  {bandwidth} {layout} {name}:"
            f" {runs[-1]['examples_per_sec']:.2f} examples/s,"
            f" {runs[-1]['slow_link_bytes_per_step'] / 1e6:.3f} MB/step on"
            " each node's link",
            flush=True,
        )
  return runs, failures


COLUMNS = {
    "bandwidth": "link",
    "mode": "mode",
    "compressor": "compressor",
    "examples_per_sec": "examples/s",
    "slow_link_bytes_per_step": "bytes/step on a node's link",
    "node_axis_bytes_per_device": "accounted, node axis",
    "local_axis_bytes_per_device": "accounted, local axis",
    "params_identical": "same params",
}
