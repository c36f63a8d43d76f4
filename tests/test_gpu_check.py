"""``python -m benchmarks gpu``: the scheduled-HLO reading it reports, its
skip on a machine without a GPU, and the projection's use of its numbers."""

import os
import subprocess
import sys
import time

import pytest

from acp_jax_tools import hlo
from benchmarks import gpu
from benchmarks import project
from benchmarks import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shape of XLA:GPU's scheduled output for a two-layer MLP's step on 8
# GPUs: the gradient of the last layer is all-reduced while the backward
# pass of the first layer runs (two fusions between start and done, with a
# bitcast and a get-tuple-element that cost nothing); the first layer's
# gradient, combined with the loss, has nothing left to hide behind.
SCHEDULED = r"""
HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[512,256]{1,0}, f32[256,10]{1,0}, f32[8,512]{1,0}, s32[8]{0})->(f32[512,256]{1,0}, f32[256,10]{1,0}, f32[])}, num_partitions=8

%region_0.1 (Arg_0.2: f32[], Arg_1.3: f32[]) -> f32[] {
  %Arg_0.2 = f32[] parameter(0)
  %Arg_1.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(f32[] %Arg_0.2, f32[] %Arg_1.3)
}

%fused_relu (param_0: f32[8,256]) -> f32[8,256] {
  %param_0 = f32[8,256]{1,0} parameter(0)
  %constant_1 = f32[] constant(0)
  %broadcast.2 = f32[8,256]{1,0} broadcast(f32[] %constant_1), dimensions={}
  ROOT %maximum.3 = f32[8,256]{1,0} maximum(f32[8,256]{1,0} %param_0, f32[8,256]{1,0} %broadcast.2)
}

%fused_relu_grad (param_0.1: f32[8,256], param_1.1: f32[8,256]) -> f32[8,256] {
  %param_0.1 = f32[8,256]{1,0} parameter(0)
  %param_1.1 = f32[8,256]{1,0} parameter(1)
  ROOT %multiply.4 = f32[8,256]{1,0} multiply(f32[8,256]{1,0} %param_0.1, f32[8,256]{1,0} %param_1.1)
}

%fused_sgd (param_0.2: f32[512,256], param_1.2: f32[512,256]) -> f32[512,256] {
  %param_0.2 = f32[512,256]{1,0} parameter(0)
  %param_1.2 = f32[512,256]{1,0} parameter(1)
  ROOT %subtract.5 = f32[512,256]{1,0} subtract(f32[512,256]{1,0} %param_0.2, f32[512,256]{1,0} %param_1.2)
}

ENTRY %main.87_spmd (param: f32[512,256], param.1: f32[256,10], param.2: f32[8,512], param.3: s32[8]) -> (f32[512,256], f32[256,10], f32[]) {
  %param.2 = f32[8,512]{1,0} parameter(2), sharding={devices=[8,1]<=[8]}, metadata={op_name="batch[\'inputs\']"}
  %param = f32[512,256]{1,0} parameter(0), sharding={replicated}
  %custom-call = (f32[8,256]{1,0}, s8[4194304]{0}) custom-call(f32[8,512]{1,0} %param.2, f32[512,256]{1,0} %param), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %get-tuple-element = f32[8,256]{1,0} get-tuple-element((f32[8,256]{1,0}, s8[4194304]{0}) %custom-call), index=0
  %fusion = f32[8,256]{1,0} fusion(f32[8,256]{1,0} %get-tuple-element), kind=kLoop, calls=%fused_relu
  %param.1 = f32[256,10]{1,0} parameter(1), sharding={replicated}
  %fusion.1 = f32[8,10]{1,0} fusion(f32[8,256]{1,0} %fusion, f32[256,10]{1,0} %param.1), kind=kCustom, calls=%fused_relu, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %fusion.2 = f32[256,10]{1,0} fusion(f32[8,256]{1,0} %fusion, f32[8,10]{1,0} %fusion.1), kind=kCustom, calls=%fused_relu, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %all-reduce-start = f32[256,10]{1,0} all-reduce-start(f32[256,10]{1,0} %fusion.2), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_0.1, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false}}
  %bitcast.7 = f32[8,10]{1,0} bitcast(f32[8,10]{1,0} %fusion.1)
  %fusion.3 = f32[8,256]{1,0} fusion(f32[8,10]{1,0} %bitcast.7, f32[256,10]{1,0} %param.1), kind=kCustom, calls=%fused_relu_grad
  %fusion.4 = f32[512,256]{1,0} fusion(f32[8,512]{1,0} %param.2, f32[8,256]{1,0} %fusion.3), kind=kCustom, calls=%fused_relu_grad, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %all-reduce-done = f32[256,10]{1,0} all-reduce-done(f32[256,10]{1,0} %all-reduce-start), metadata={op_name="jit(train_step)/psum"}
  %constant.9 = f32[] constant(0.5)
  %all-reduce.9 = f32[] all-reduce(f32[] %constant.9), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%region_0.1
  %all-reduce-start.1 = (f32[512,256]{1,0}, f32[]) all-reduce-start(f32[512,256]{1,0} %fusion.4, f32[] %all-reduce.9), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_0.1, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false}}
  %all-reduce-done.1 = (f32[512,256]{1,0}, f32[]) all-reduce-done((f32[512,256]{1,0}, f32[]) %all-reduce-start.1)
  %get-tuple-element.1 = f32[512,256]{1,0} get-tuple-element((f32[512,256]{1,0}, f32[]) %all-reduce-done.1), index=0
  %get-tuple-element.2 = f32[] get-tuple-element((f32[512,256]{1,0}, f32[]) %all-reduce-done.1), index=1
  %fusion.5 = f32[512,256]{1,0} fusion(f32[512,256]{1,0} %param, f32[512,256]{1,0} %get-tuple-element.1), kind=kLoop, calls=%fused_sgd
  ROOT %tuple = (f32[512,256]{1,0}, f32[256,10]{1,0}, f32[]) tuple(f32[512,256]{1,0} %fusion.5, f32[256,10]{1,0} %all-reduce-done, f32[] %get-tuple-element.2)
}
"""


def test_scheduled_overlap_counts_compute_between_start_and_done():
  first, second = hlo.scheduled_overlap(SCHEDULED)
  assert first == hlo.ScheduledCollective(
      name="%all-reduce-start",
      kind="all-reduce",
      bytes=256 * 10 * 4,
      done="%all-reduce-done",
      compute_between=2,  # %fusion.3 and %fusion.4
  )
  assert second == hlo.ScheduledCollective(
      name="%all-reduce-start.1",
      kind="all-reduce",
      bytes=512 * 256 * 4 + 4,
      done="%all-reduce-done.1",
      compute_between=0,
  )


def test_scheduled_overlap_counts_custom_calls_and_other_async_kinds():
  # A cuBLAS gemm scheduled under the first all-reduce counts as compute;
  # an async all-gather is read like an all-reduce (its start returns the
  # operand and the result: the result's bytes count).
  text = SCHEDULED.replace(
      "  %all-reduce-done = ",
      '  %custom-call.2 = (f32[8,8]{1,0}, s8[1024]{0}) custom-call(f32[8,512]{1,0} %param.2, f32[8,512]{1,0} %param.2), custom_call_target="__cublas$gemm"\n'
      "  %all-gather-start = (f32[8,10]{1,0}, f32[64,10]{1,0}) all-gather-start(f32[8,10]{1,0} %fusion.1), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}\n"
      "  %all-gather-done = f32[64,10]{1,0} all-gather-done((f32[8,10]{1,0}, f32[64,10]{1,0}) %all-gather-start)\n"
      "  %all-reduce-done = ",
  )
  first, gather, _ = hlo.scheduled_overlap(text)
  assert first.compute_between == 3
  assert (gather.kind, gather.bytes, gather.compute_between) == (
      "all-gather",
      64 * 10 * 4,
      0,
  )


def test_scheduled_overlap_refuses_a_start_without_done():
  text = SCHEDULED.replace(
      "all-reduce-done((f32[512,256]{1,0}, f32[]) %all-reduce-start.1)",
      "copy((f32[512,256]{1,0}, f32[]) %all-reduce-start.1)",
  )
  with pytest.raises(ValueError, match="all-reduce-start.1"):
    hlo.scheduled_overlap(text)


def test_synchronous_collectives_are_not_listed():
  synchronous = SCHEDULED.replace("-start", "").replace("-done", "")
  assert hlo.scheduled_overlap(synchronous) == []


def test_gpu_check_skips_without_a_gpu(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks", f"--results_dir={tmp_path}", "gpu"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout == "gpu: skipped, no GPU (jax backend: cpu)\n"
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_compute_timings_run_on_any_backend():
  # What the GPU check times, on this CPU and a small model: every call
  # runs, in float32 and bfloat16; past the deadline nothing is timed.
  rows = gpu.time_compute(
      ["small_cnn"], gpu.DTYPES, 1, deadline=time.monotonic() + 600
  )
  assert [(r["dtype"], r["kind"], r.get("compressor")) for r in rows] == [
      (dtype, kind, c)
      for dtype in gpu.DTYPES
      for kind, c in [("forward_backward", None)]
      + [("update", c) for c in gpu.workloads.COMPRESSORS]
  ]
  assert all(r["status"] == "ok" and r["seconds"] > 0 for r in rows), rows
  acp = rows[-1]
  assert acp["seconds"] == pytest.approx(
      (acp["seconds_p"] + acp["seconds_q"]) / 2
  )
  late = gpu.time_compute(["small_cnn"], ["float32"], 1, time.monotonic())
  assert {r["status"] for r in late} == {"skipped: time limit"}


def _gpu_records(model, batch, forward_backward_s, update_s):
  """What a ``gpu`` run writes for ``model``, with the records the
  projection must leave alone: bfloat16, a failure, the schedule."""
  rows = []
  for dtype, scale in (("float32", 1.0), ("bfloat16", 0.5)):
    rows.append(
        {
            "kind": "forward_backward",
            "model": model,
            "dtype": dtype,
            "batch_per_device": batch,
            "seconds": forward_backward_s * scale,
            "status": "ok",
        }
    )
    for compressor, seconds in update_s.items():
      rows.append(
          {
              "kind": "update",
              "model": model,
              "dtype": dtype,
              "compressor": compressor,
              "seconds": seconds * scale,
              "status": "ok",
          }
      )
  rows.append(
      {
          "kind": "update",
          "model": "resnet50",
          "dtype": "float32",
          "compressor": "ssgd",
          "status": "failed: XlaRuntimeError: out of memory",
      }
  )
  rows.append(
      {
          "kind": "schedule",
          "model": model,
          "compressor": "acp_sgd",
          "phase": "P",
          "collective": "%all-reduce-start",
          "bytes": 1024,
          "compute_between": 12,
          "status": "ok",
      }
  )
  return rows


def test_projection_takes_compute_times_from_gpu_json(tmp_path, monkeypatch):
  updates = {
      "ssgd": 1e-4,
      "sign_sgd": 2e-3,
      "topk_sgd": 9e-3,
      "power_sgd": 4e-3,
      "acp_sgd": 2e-3,
  }
  records.write("gpu", _gpu_records("small_cnn", 8, 0.02, updates), tmp_path)

  def not_here(*args):
    raise AssertionError(f"timed on this CPU: {args}")

  monkeypatch.setattr(project, "forward_backward", not_here)
  monkeypatch.setattr(project, "update_seconds", not_here)
  rows = project.measure(
      ["small_cnn"], 500e-6, (2, 4), 1, [], records.read("gpu", tmp_path)
  )
  # Measured compute is projected once, not scaled.
  assert len(rows) == len(project.SIZES) * len(project.RATES) * 5
  batch = 128 // 8  # small_cnn's per-device batch on the paper's clusters
  for row in rows:
    assert (row["compute_source"], row["compute_scale"]) == ("gpu", 1)
    assert row["forward_backward_s"] == pytest.approx(0.02 / 8 * batch)
    assert row["fixed_s"] == 0.0
    assert row["update_s"] == updates[row["compressor"]]
    assert row["update_source"] == "gpu.json"
  (average,) = project.averages(rows)
  assert (average["compute_source"], average["compute_scale"]) == ("gpu", 1)


def test_projection_without_every_gpu_time_measures_here(monkeypatch):
  incomplete = [
      r
      for r in _gpu_records("small_cnn", 8, 0.02, {"ssgd": 1e-4})
      if r["kind"] != "update"
  ]
  monkeypatch.setattr(project, "forward_backward", lambda *_: (1e-3, 2e-3))
  monkeypatch.setattr(
      project,
      "update_seconds",
      lambda *_: dict.fromkeys(project.workloads.COMPRESSORS, 1e-3),
  )
  rows = project.measure(["small_cnn"], 500e-6, (2, 4), 1, [], incomplete)
  assert {(r["compute_source"], r["compute_scale"]) for r in rows} == {
      ("cpu", s) for s in project.SCALES
  }
  assert {r["update_source"] for r in rows} == {"measured"}


@pytest.mark.slow
def test_a_failed_schedule_is_a_record_beside_the_timings():
  # Here the mock topology has no GPU to mock: the compiling process fails
  # and says why, the timings stand.
  rows = gpu.measure(["small_cnn"], quick=True, time_limit=300)
  timed = [r for r in rows if r["kind"] != "schedule"]
  assert len(timed) == 1 + len(gpu.workloads.COMPRESSORS)
  assert all(r["status"] == "ok" for r in timed), timed
  (failed,) = [r for r in rows if r["kind"] == "schedule"]
  assert failed["status"].startswith("failed (1): RuntimeError: the mock")
  assert "1x1x8" in failed["status"]
