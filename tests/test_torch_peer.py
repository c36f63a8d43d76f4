"""Two PyTorch DDP workers of `benchmarks.torch_peer` on localhost."""

import json
import math
import os
import subprocess
import sys

import jax
from flax import nnx
import pytest

from tests import helpers
from train import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120
TINY = [
    "--layers=1",
    "--hidden=64",
    "--heads=4",
    "--ffn=128",
    "--vocab_size=512",
    "--seq_len=16",
    "--batch_size=4",
    "--steps=6",
    "--warmup=3",
]


@pytest.mark.slow
def test_power_sgd_workers_end_with_identical_params():
  pytest.importorskip("torch")
  port = helpers.free_port()
  procs = [
      subprocess.Popen(
          [
              sys.executable,
              "-m",
              "benchmarks.torch_peer",
              "--compressor=power_sgd",
              *TINY,
              "--master_addr=127.0.0.1",
              f"--master_port={port}",
              "--world_size=2",
              f"--process_id={i}",
              "--threads=1",
          ],
          cwd=ROOT,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  results = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=TIMEOUT_S)
      assert proc.returncode == 0, err[-3000:]
      (line,) = [l for l in out.splitlines() if l.startswith("RESULT ")]
      results.append(json.loads(line.removeprefix("RESULT ")))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  assert results[0]["params_sha256"] == results[1]["params_sha256"]
  jax_bert = models.Bert(
      rngs=nnx.Rngs(0),
      size={"num_layers": 1, "hidden": 64, "heads": 4, "ffn": 128},
      vocab_size=512,
  )
  jax_params = sum(x.size for x in jax.tree.leaves(nnx.state(jax_bert)))
  for r in results:
    assert r["compressor"] == "power_sgd" and r["rank"] == 4
    assert r["params"] == jax_params
    assert len(r["step_seconds"]) == 3
    assert math.isfinite(r["examples_per_sec"]) and r["examples_per_sec"] > 0
