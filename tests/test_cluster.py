"""The shaped-link cluster: links built and torn down, a 2-worker smoke run."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import __main__ as cli
from benchmarks import cluster
from benchmarks import cluster_nodes
from benchmarks import launch
from benchmarks import links
from benchmarks import plots
from benchmarks import records
from benchmarks import report_cluster
from benchmarks import targets
from benchmarks import worker
from tests import helpers

needs_root = pytest.mark.skipif(
    links.unavailable() is not None,
    reason=f"cannot build links here: {links.unavailable()}",
)


def _namespaces() -> set[str]:
  out = subprocess.run(
      ["ip", "netns", "list"], capture_output=True, text=True, check=True
  ).stdout
  return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_tbf_arguments():
  assert links.tbf(1000) == [
      "tbf",
      "rate",
      "1000mbit",
      "burst",
      "500000",
      "latency",
      "100ms",
  ]
  # Slow links still take a full TSO segment in one burst.
  assert links.tbf(10)[4] == str(64 * 1024)
  with pytest.raises(ValueError, match="rate_mbit must be positive, got 0"):
    links.tbf(0)


def test_cluster_without_root_says_so_and_exits_cleanly(monkeypatch, capsys):
  monkeypatch.setattr(links, "unavailable", lambda: "needs root")
  cli.main(["cluster"])
  assert "cluster: skipped, needs root" in capsys.readouterr().out


@needs_root
def test_links_are_shaped_and_torn_down_on_error():
  before = _namespaces()
  with pytest.raises(KeyError):
    with links.switched(2, 1000, prefix="acptest") as network:
      assert set(network.names) | {network.switch} <= _namespaces()
      qdisc = subprocess.run(
          ["tc", "-n", network.names[1], "qdisc", "show", "dev", "eth0"],
          capture_output=True,
          text=True,
          check=True,
      ).stdout
      assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
      hosts = pathlib.Path(f"/etc/netns/{network.names[1]}/hosts")
      assert network.address(1) in hosts.read_text()
      raise KeyError("fail inside")
  assert _namespaces() == before
  assert not pathlib.Path("/etc/netns/acptest-w0").exists()


@needs_root
def test_a_terminated_run_stops_its_workers_and_deletes_its_links(tmp_path):
  """SIGTERM, as a job scheduler or ``timeout`` sends it, ends a cluster
  run as Ctrl-C does: no worker and no namespace outlives it."""
  before = _namespaces()
  run = subprocess.Popen(
      [
          sys.executable,
          "-m",
          "benchmarks",
          f"--results_dir={tmp_path}",
          "overlap_step",
          "--quick",
          "--bandwidths=unshaped",
          "--compressors=acp_sgd",
          "--steps=1000",
      ],
      cwd=helpers.ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.monotonic() + 120
    while _namespaces() == before and time.monotonic() < deadline:
      time.sleep(0.2)
    ours = _namespaces() - before
    assert ours, "the run built no namespaces within 120 s"
    deadline = time.monotonic() + 120
    while not _workers(ours) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert _workers(ours), "the run started no workers within 120 s"
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
  finally:
    run.kill()
  assert _namespaces() == before
  assert not _workers(ours)


def _workers(namespaces: set[str]) -> list[str]:
  """The processes running in ``namespaces``."""
  return [
      pid
      for name in namespaces
      for pid in subprocess.run(
          ["ip", "netns", "pids", name], capture_output=True, text=True
      ).stdout.split()
  ]


@needs_root
@pytest.mark.slow
def test_two_workers_train_on_a_shaped_link(tmp_path):
  before = _namespaces()
  done = helpers.run_module(
      "benchmarks",
      f"--results_dir={tmp_path}",
      "cluster",
      "--quick",
      "--model=tiny",
      "--workers=2",
      "--bandwidths=100mbit,1gbit",
      "--compressors=ssgd,acp_sgd",
      "--repeats=2",
      "--no_torch",
      "--timeout=240",
      timeout=1200,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert _namespaces() == before
  runs = json.loads((tmp_path / "cluster.json").read_text())
  assert [(r["bandwidth"], r["compressor"]) for r in runs] == [
      ("100mbit", "ssgd"),
      ("100mbit", "acp_sgd"),
      ("1gbit", "ssgd"),
      ("1gbit", "acp_sgd"),
  ]
  for run in runs:
    assert run["system"] == "acp_jax" and run["workers"] == 2
    assert run["params_identical"] is True
    assert run["repeats"] == 2
    each = [run["examples_per_sec_run1"], run["examples_per_sec_run2"]]
    assert run["examples_per_sec_min"] == min(each)
    assert run["examples_per_sec_max"] == max(each)
    assert run["examples_per_sec"] == pytest.approx(sum(each) / 2)
    # The model cannot be faster than compute alone.
    assert (
        0
        < run["predicted_examples_per_sec"]
        < run["compute_only_examples_per_sec"]
    )
    phases = 2 if run["compressor"] == "acp_sgd" else 1
    assert all(run[f"phase{k}_step_s"] > 0 for k in range(phases))
    # The step is taken apart on the breakdown link only (1 Gb/s).
    for part in worker.BREAKDOWN:
      assert (f"{part}_s" in run) == (run["bandwidth"] == "1gbit"), part
  # S-SGD on the slow link times fewer steps.
  assert runs[0]["timed_steps"] == cluster.DENSE_SLOW_STEPS
  assert runs[1]["timed_steps"] == 4  # --quick
  calibration = json.loads((tmp_path / "cluster_links.json").read_text())
  assert len(calibration) == len(cluster.psum_sizes(100)) + len(
      cluster.PSUM_SIZES
  )
  for r in calibration:
    # Neither link moves more than its rate, busy or not.
    rate = launch.BANDWIDTHS[r["bandwidth"]] * 1e6 / 8
    for key in ("beta_s_per_byte", "busy_beta_s_per_byte"):
      assert 1 / r[key] < rate * 1.05, (r["bandwidth"], key)


# What a TCP packet on the veth links adds to the bytes counted: Ethernet
# (14), IPv4 (20) and TCP with timestamps (32).
HEADER_BYTES = 66
# gloo's framing of its messages, at most, per packet sent (measured: about
# 35 for hierarchical ACP-SGD's few large messages, about 42 when the
# sharded mode sent one message per leaf).
FRAMING_BYTES = 64


@needs_root
@pytest.mark.slow
def test_sharded_nodes_train_as_hierarchical_ones_sending_the_accounting(
    tmp_path,
):
  runs = {}
  with links.switched(2, None, prefix="acptest") as network:
    for layout in ("hierarchical", "sharded"):
      runs[layout] = cluster_nodes.run_nodes(
          network,
          "tiny",
          "acp_sgd",
          layout,
          steps=4,
          devices=2,
          timeout=400,
          params_out=lambda i, layout=layout: tmp_path / f"{layout}{i}.npz",
      )
  for layout, results in runs.items():
    assert len({r["params_sha256"] for r in results}) == 1, layout
    # Each of a node's 2 devices sends its share to its peer on the other
    # node: all that crosses the link, besides each packet's headers and
    # gloo's framing.
    sent = 2 * results[0]["node_axis_bytes_per_device"]
    for r in results:
      packets = r["link_tx_packets_per_step"]
      payload = r["link_tx_bytes_per_step"] - HEADER_BYTES * packets
      assert sent <= payload <= sent + FRAMING_BYTES * packets, (layout, r)
  assert (
      runs["sharded"][0]["node_axis_bytes_per_device"]
      == runs["hierarchical"][0]["node_axis_bytes_per_device"]
  )
  # Both pack a round's buffers: a message per leaf would multiply the
  # packets (15 times, when the sharded mode sent its blocks as a tuple).
  packets = {
      layout: max(r["link_tx_packets_per_step"] for r in results)
      for layout, results in runs.items()
  }
  assert packets["sharded"] <= 2 * packets["hierarchical"], packets
  want, got = (np.load(tmp_path / f"{layout}0.npz") for layout in runs)
  assert sorted(got.files) == sorted(want.files)
  finals = [k for k in want.files if k.startswith("final/")]
  updates = {"want": [], "got": []}
  for key in finals:
    initial = "initial/" + key.removeprefix("final/")
    np.testing.assert_array_equal(got[initial], want[initial])
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    updates["want"].append((want[key] - want[initial]).ravel())
    updates["got"].append((got[key] - got[initial]).ravel())
  # The updates themselves, small under the learning rate's warm-up, agree
  # as far as float32 params resolve them.
  want, got = (np.concatenate(u) for u in updates.values())
  assert np.linalg.norm(want) > 0
  assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)


def test_report_tables_the_hierarchical_cluster():
  from benchmarks import report_cluster

  base = {
      "bandwidth": "1gbit",
      "nodes": 2,
      "devices_per_node": 2,
      "model": "bert_base_2l",
      "params_identical": True,
      "machine": "m",
      "date": "d",
      "command": "c",
  }
  rows = [
      {
          **base,
          "compressor": "acp_sgd",
          "mode": "hierarchical",
          "examples_per_sec": 4.5,
          "slow_link_bytes_per_step": 475204.8,
          "node_axis_bytes_per_device": 224768,
          "local_axis_bytes_per_device": 86304768,
      },
      {
          **base,
          "compressor": "ssgd",
          "mode": "flat",
          "examples_per_sec": 3.5,
          "slow_link_bytes_per_step": 129150692.8,
          "node_axis_bytes_per_device": 85855232,
          "local_axis_bytes_per_device": 0,
      },
  ]
  lines = "\n".join(report_cluster.hierarchical_section(rows)).splitlines()
  assert lines[0] == "## 6. Hierarchical compression across nodes"
  cells = [
      [cell.strip() for cell in line.strip("|").split("|")]
      for line in "\n".join(lines).splitlines()
      if line.startswith("| 1gbit")
  ]
  assert cells == [
      [
          "1gbit",
          "ACP-SGD, hierarchical",
          "4.5",
          "475,205",
          "224,768",
          "86,304,768",
          "yes",
      ],
      ["1gbit", "S-SGD, flat", "3.5", "129,150,693", "85,855,232", "0", "yes"],
  ]


def test_report_sets_the_sharded_mode_beside_the_hierarchical_one():
  from benchmarks import report_cluster
  from benchmarks import targets

  base = {
      "bandwidth": "1gbit",
      "nodes": 2,
      "devices_per_node": 2,
      "model": "bert_base_2l",
      "compressor": "acp_sgd",
      "slow_link_bytes_per_step": 475204.8,
      "node_axis_bytes_per_device": 224768,
      "params_identical": True,
      "machine": "m",
      "date": "d",
      "command": "c",
  }
  hierarchical = {
      **base,
      "mode": "hierarchical",
      "examples_per_sec": 5.0,
      "local_axis_bytes_per_device": 86304768,
  }
  sharded = {
      **base,
      "mode": "sharded",
      "examples_per_sec": 4.4,
      "local_axis_bytes_per_device": 172000000,
  }
  text = "\n".join(report_cluster.hierarchical_section([hierarchical, sharded]))
  assert "| ACP-SGD, sharded" in text
  assert (
      "examples/s over hierarchical ACP-SGD's: on 1 Gb/s, 0.88x; of medians"
      " 0.88x." in text
  )
  (row,) = targets.check({"cluster_hierarchical": [hierarchical, sharded]})
  assert row == (
      "2 nodes x 2 devices, 1 Gb/s: sharded ACP-SGD >= 0.9 x hierarchical"
      " ACP-SGD examples/s",
      "0.88x; of medians 0.88x",
      False,
  )
  # Without a sharded run, neither the paragraph nor the target.
  assert "*Sharded*" not in "\n".join(
      report_cluster.hierarchical_section([hierarchical])
  )
  assert targets.check({"cluster_hierarchical": [hierarchical]}) == []


def test_the_slow_links_are_named_and_shaped():
  assert plots.link_label("10mbit") == "10 Mb/s"
  assert plots.link_label("100mbit") == "100 Mb/s"
  assert plots.link_label("1gbit") == "1 Gb/s"
  assert plots.link_label("unshaped") == "unshaped"
  assert links.tbf(launch.BANDWIDTHS["10mbit"])[2] == "10.0mbit"


def test_the_calibration_sizes_fit_the_link():
  # At most about a second each: 1 MiB at 10 Mb/s, 4 MiB at 100 Mb/s.
  assert cluster.psum_sizes(10.0) == (2**12, 2**16, 2**20)
  assert cluster.psum_sizes(100.0) == (2**12, 2**16, 2**20, 2**22)
  assert cluster.psum_sizes(1000.0) == cluster.PSUM_SIZES
  assert cluster.psum_sizes(None) == cluster.PSUM_SIZES


def test_dense_methods_take_fewer_steps_on_slow_links_and_none_below():
  steps = lambda system, name, link: cluster.run_steps(
      system, name, link, 20, 8
  )
  assert steps("acp_jax", "acp_sgd", "10mbit") == (20, 8)
  assert steps("acp_jax", "ssgd", "1gbit") == (20, 8)
  assert steps("acp_jax", "ssgd", "100mbit") == (cluster.DENSE_SLOW_STEPS, 0)
  # The PyTorch peer needs three untimed steps at least.
  assert steps("torch", "ssgd", "100mbit") == (cluster.DENSE_SLOW_STEPS, 3)
  methods = cluster._methods(
      ["ssgd", "acp_sgd"], ("ssgd", "power_sgd"), "10mbit", True, ()
  )
  # PowerSGD's hook all-reduces the whole model in its first steps.
  assert methods == [("acp_jax", "acp_sgd")]
  methods = cluster._methods(["ssgd"], ("power_sgd",), "100mbit", True, ())
  assert methods == [("acp_jax", "ssgd"), ("torch", "power_sgd")]


def test_a_repeated_figure_keeps_each_run_and_its_spread():
  fields = records.repeated("examples_per_sec", [3.0, 1.0, 2.0])
  assert fields["examples_per_sec"] == 2.0
  assert (fields["examples_per_sec_min"], fields["examples_per_sec_max"]) == (
      1.0,
      3.0,
  )
  assert records.runs(fields, "examples_per_sec") == [3.0, 1.0, 2.0]
  assert records.runs({}, "examples_per_sec") == []


def test_ratios_pair_runs_by_round_and_give_their_range():
  def row(system, compressor, speeds):
    return {
        "bandwidth": "10mbit",
        "system": system,
        "compressor": compressor,
        **records.repeated("examples_per_sec", speeds),
        **records.repeated("step_s", [1 / v for v in speeds]),
        "step_local_s": 0.04,
        "predicted_step_s": 0.05,
    }

  rows = [
      row("acp_jax", "acp_sgd", [20.0, 10.0, 30.0]),
      row("acp_jax", "power_sgd", [10.0, 10.0, 20.0]),
  ]
  acp, power = ("acp_jax", "acp_sgd"), ("acp_jax", "power_sgd")
  r = targets.ratio(rows, acp, power, "10mbit")
  # Rounds 2.0, 1.0 and 1.5: not the 1.5 of the medians' ratio by chance.
  assert (r.median, r.low, r.high, r.of_medians) == (1.5, 1.0, 2.0, 2.0)
  assert str(r) == "1.50x (1.00-2.00); of medians 2.00x"
  assert targets.ratio(rows, acp, ("torch", "ssgd"), "10mbit") is None
  # A goal is met only where every round clears it: the median's 1.5 and
  # the medians' 2.0 clear 1.3, the second round's 1.0 does not.
  checked = {t: (m, ok) for t, m, ok in targets._cluster_at(2, rows)}
  measured, met = checked[
      "2 workers, 10 Mb/s: ACP-SGD >= 1.3 x Power-SGD examples/s, every round"
  ]
  assert measured == "1.50x (1.00-2.00); of medians 2.00x" and met is False
  (fastest,) = [t for t in checked if "(b) ACP-SGD is the fastest" in t]
  assert checked[fastest] == ("fastest on 10mbit of 10mbit", True)
  # Its step (0.05 s) against the no-overlap limit of the model (0.05 s).
  (limit,) = [t for t in checked if "no-overlap limit" in t]
  assert checked[limit] == ("50 ms (33-100) against 50 ms: +0.0%", True)
  # A limit holds both ways: a step 20 % under the model's is a miss too.
  for r in rows:
    r["predicted_step_s"] = 0.0625
  checked = {t: (m, ok) for t, m, ok in targets._cluster_at(2, rows)}
  assert checked[limit] == ("50 ms (33-100) against 62 ms: -20.0%", False)


def test_a_step_part_that_cannot_be_taken_apart_is_not_printed_negative():
  record = {
      "workers": 2,
      "bandwidth": "1gbit",
      "compressor": "acp_sgd",
      "error_pct": 1.0,
      **{
          f"{k}_s": 0.1
          for k in (
              "step",
              "step_local",
              "forward_backward",
              "optimizer",
              "dispatch",
              "predicted_step",
              "predicted_busy_step",
          )
      },
      "compress_s": 0.060,
      "compress_local_s": 0.064,
  }
  assert report_cluster._step_parts(record)["collectives"] == (
      report_cluster.NOT_APART
  )
  record["compress_s"] = 0.070
  assert report_cluster._step_parts(record)["collectives"] == pytest.approx(6)


def test_a_method_that_did_not_run_on_a_link_has_no_bar(monkeypatch, tmp_path):
  """S-SGD ran at 100 Mb/s only: one bar for it, none of height zero."""
  axes = pytest.importorskip("matplotlib.axes")
  drawn = []

  def bar(self, xs, ys, *args, **kwargs):
    drawn.append((kwargs.get("label"), list(ys)))

  monkeypatch.setattr(axes.Axes, "bar", bar)
  row = lambda compressor, bandwidth, speed: {
      "workers": 2,
      "bandwidth": bandwidth,
      "system": "acp_jax",
      "compressor": compressor,
      "examples_per_sec": speed,
  }
  rows = [
      row("acp_sgd", "10mbit", 6.0),
      row("acp_sgd", "100mbit", 13.0),
      row("ssgd", "100mbit", 0.5),
  ]
  plots.cluster(rows, tmp_path / "cluster.png")
  assert drawn == [("ACP-SGD", [6.0, 13.0]), ("S-SGD", [0.5])]


def _overlap_record(compressor, bandwidth, fused, overlapped, local):
  """An ``overlap_step`` record of three rounds: per-round seconds."""
  base = {
      "model": "bert_base_2l",
      "workers": 2,
      "bandwidth": bandwidth,
      "compressor": compressor,
      "timed_steps": 6,
      "machine": "m",
      "date": "d",
      "command": "c",
  }
  return {
      **base,
      **records.repeated("fused_s", fused),
      **records.repeated("overlapped_s", overlapped),
      **records.repeated("local_s", local),
      **records.repeated(
          "speedup", [f / o for f, o in zip(fused, overlapped)]
      ),
  }


def test_report_prices_each_overlap_limit_from_the_cluster_run():
  """The limit is the larger of the compute-only step and the collectives
  the cluster run priced for the same point; a point it did not price says
  so; ACP-SGD against Power-SGD pairs each round with its own round."""
  rows = [
      _overlap_record("acp_sgd", "10mbit", [1.0, 1.1, 1.2], [0.5, 0.6, 0.5],
                      [0.2, 0.2, 0.2]),
      _overlap_record("power_sgd", "10mbit", [1.5, 1.5, 1.5], [1.0, 0.9, 1.5],
                      [0.2, 0.2, 0.2]),
      _overlap_record("ssgd", "10mbit", [9.0] * 3, [8.0] * 3, [0.2] * 3),
  ]
  priced = {
      "model": "bert_base_2l",
      "workers": 2,
      "bandwidth": "10mbit",
      "system": "acp_jax",
      "step_local_s": 0.3,
  }
  cluster_rows = [
      {**priced, "compressor": "acp_sgd", "predicted_step_s": 0.7},
      {**priced, "compressor": "power_sgd", "predicted_step_s": 0.2},
  ]
  shown = report_cluster.overlap_rows(rows, cluster_rows)
  acp, power, dense = shown
  assert acp["collectives"] == "400" and acp["limit"] == "400"
  assert acp["over_limit"] == "+25%" and acp["fused"] == "1100 (1000–1200)"
  # Its priced collectives (-100 ms) are below its compute-only step.
  assert power["limit"] == "200" and power["over_limit"] == "+400%"
  assert dense["collectives"] == "not priced" and dense["limit"] == ""
  assert acp["speedup"].startswith("2.00×")
  text = "\n".join(report_cluster.overlap_step_section(rows, cluster_rows))
  assert "Power-SGD / ACP-SGD overlapped 2.00× (rounds 2.00, 1.50, 3.00)" in text
