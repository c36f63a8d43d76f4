"""How far each low-rank compressor turns the update away from S-SGD's.

On the char LM (``configs/tinyshakespeare.py`` at batch 32 x 64, 8
simulated devices, AdamW's moments b1 = 0.9, b2 = 0.99), the params follow
S-SGD's AdamW trajectory: dense warm-up steps, then measured steps. Every
variant sees the same per-device gradients at every step and keeps its own
compressor state (residuals, factors) and its own Adam moments, fed with its
own compressed means; its compressor runs through the warm-up too, in its
dense phase, so that its factors start warm. Per measured step it reports

- ``grad``: the cosine between the compressed mean and the true mean
  gradient, over all leaves;
- ``adam``: the cosine between Adam's preconditioned update (``m / (sqrt(v)
  + eps)``, weight decay and learning rate left out, as they are the same
  for every variant) from the variant's moments and S-SGD's;
- ``adam_shared``: the same from S-SGD's own moments, updated with the
  variant's mean for this one step (the effect of one step's error alone).

Variants: Power-SGD and ACP-SGD at each rank, with the factors sent in each
of ``--comm_dtypes`` (float32, or e.g. bfloat16: ``_bf16``), as they are, and
compressed in
Adam's geometry: each compressed n x m leaf M is scaled elementwise to
``M * W`` before compression and its mean divided by W after, W being the
inverse square root of a running second moment (decay b2) of the
*decompressed mean*, identical on every replica, so no byte is added:

- ``factored``: Adafactor's factored moment (n + m floats), so W = D_r 1 1^T
  D_c and the mean D_r^-1 P Q^T D_c^-1 is still rank r; the residual is
  kept in the gradient's space (re-expressed when W changes);
- ``factored_scaled``: the same, the residual kept in the scaled space;
- ``full``: the full moment (n x m floats, Adam's own v), the mean no
  longer of rank r.

The devices are simulated by ``jax.vmap`` over the mapped axis
(``acp_jax_tools.simulated``), on the default device.

  python -m benchmarks.direction --char_lm_path PATH [--measure_steps 30]
"""

import argparse
import json
import re
import statistics
import sys
import time
from typing import Any

from flax import nnx
import jax
import optax

from acp_jax_tools import simulated
from benchmarks import adam_geometry
from benchmarks import workloads
from benchmarks.adam_geometry import B1
from benchmarks.adam_geometry import B2
from benchmarks.adam_geometry import EPS
from train import data as data_lib
from train import experiment as experiment_lib

RANKS = (4, 8)
METHODS = ("power_sgd", "acp_sgd")
# None: the compressor as it is; else a key of GEOMETRY_KINDS.
GEOMETRIES = (None, *adam_geometry.GEOMETRY_KINDS)
METRICS = ("grad", "adam", "adam_shared")


def is_measured(variant: str) -> bool:
  """Whether ``variant``, a name in this benchmark's records, is one it
  measures today (``adam_geometry.Variant``'s names); a closed experiment's
  is not."""
  methods = "|".join(METHODS)
  dtypes = "|".join(adam_geometry.COMM_DTYPE_NAMES.values())
  geometries = "|".join(adam_geometry.GEOMETRY_KINDS)
  return bool(
      re.fullmatch(
          rf"({methods})_r\d+(_({geometries}))?(_({dtypes}))?", variant
      )
  )


class _Run:
  """A variant's update on devices simulated by ``jax.vmap``
  (``acp_jax_tools.simulated``), its compressor state and Adam moments."""

  def __init__(self, variant: adam_geometry.Variant, params, num_devices):
    self.variant = variant
    state = variant.init(params)
    self.devices = simulated.Devices(
        variant.update,
        state,
        variant.device_axes(state),
        variant.tx.axis_name,
        num_devices,
    )
    self.adam = None

  @property
  def state(self):
    return self.devices.state

  def step(self, grads, step: int):
    """The compressed mean of the stacked ``grads`` at step ``step``."""
    self.devices.state = self.variant.at_step(self.state, step)
    return self.devices(grads)

  def cosines(self, steps, grads, step, warmup_steps, mean, ref_adam, ref_dir):
    """This run's step; after the warm-up, its ``METRICS`` against S-SGD's
    ``mean`` gradient, Adam state ``ref_adam`` and update ``ref_dir``
    (``steps``, a ``_Reference``, computes them), else None."""
    approx = self.step(grads, step)
    if step < warmup_steps:
      return None
    if step == warmup_steps:
      self.adam = ref_adam
    cosines, self.adam = steps.cosines(
        approx, mean, self.adam, ref_adam, ref_dir
    )
    return cosines


class _Reference:
  """S-SGD's AdamW trajectory on ``exp``'s model, and the cosines of a
  variant's mean and update with it, compiled.

  Attributes:
    grads: (params, batch stacked by device) -> each device's gradient.
    mean: stacked gradients -> their mean.
    adam: Adam's scaling (``scale_by_adam``), and ``adam_update`` its update.
    descent: weight decay and the schedule's learning rate, after Adam.
  """

  def __init__(self, exp):
    graphdef = exp.graphdef

    def loss_fn(params, batch):
      model = nnx.merge(graphdef, params, {})
      logits = model(batch["inputs"], train=True)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["targets"]
      ).mean()

    # Each device's gradient of the loss of its shard.
    self.grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))
    self.adam = optax.scale_by_adam(B1, B2, EPS)
    self.descent = optax.chain(
        optax.add_decayed_weights(exp.config.optimizer.weight_decay),
        optax.scale_by_learning_rate(exp.schedule),
    )
    self.mean = jax.jit(lambda g: jax.tree.map(lambda x: x.mean(0), g))
    self.adam_update = jax.jit(self.adam.update)
    self.cosines = jax.jit(self._cosines)
    self.apply = jax.jit(self._apply)

  def _cosines(self, approx, mean, own_adam, ref_adam, ref_dir):
    direction, own_adam = self.adam.update(approx, own_adam)
    shared, _ = self.adam.update(approx, ref_adam)
    cosines = [
        simulated.cosine(approx, mean),
        simulated.cosine(direction, ref_dir),
        simulated.cosine(shared, ref_dir),
    ]
    return cosines, own_adam

  def _apply(self, direction, descent_state, params):
    updates, descent_state = self.descent.update(
        direction, descent_state, params
    )
    return optax.apply_updates(params, updates), descent_state


def config(char_lm_path: str, tiny: bool):
  """The char LM's config as measured (a tiny model with ``tiny``)."""
  overrides = [
      ("batch_size", 32),
      ("data.seq_len", 64),
      ("model.max_len", 64),
      ("data.path", char_lm_path),
  ]
  if tiny:
    overrides += [("model.dim", 16), ("model.num_layers", 1)]
    overrides += [("model.num_heads", 2), ("batch_size", 8)]
    overrides += [("data.seq_len", 16), ("model.max_len", 16)]
  return workloads.load_config("tinyshakespeare", tuple(overrides))


def measure(
    char_lm_path: str,
    *,
    warmup_steps: int,
    measure_steps: int,
    ranks=RANKS,
    methods=METHODS,
    geometries=GEOMETRIES,
    comm_dtypes=(None,),
    num_devices: int = 8,
    seed: int = 0,
    tiny: bool = False,
) -> list[dict[str, Any]]:
  """Per variant, the mean of each metric over the measured steps."""
  cfg = config(char_lm_path, tiny)
  cfg.seed = seed
  cfg.num_train_steps = warmup_steps + measure_steps
  exp = experiment_lib.build(cfg)
  # On the default device alone: the simulated devices are a vmapped axis.
  params = jax.jit(
      lambda: nnx.to_pure_dict(
          nnx.split(exp.create_model(), nnx.Param, nnx.BatchStat)[1]
      )
  )()
  ref = _Reference(exp)
  descent_state = ref.descent.init(params)
  runs = [
      _Run(adam_geometry.Variant(m, r, g, warmup_steps, d), params, num_devices)
      for m in methods
      for r in ranks
      for g in geometries
      for d in comm_dtypes
  ]
  ref_adam = ref.adam.init(params)
  loader = data_lib.Loader(
      exp.dataset.train, global_batch=exp.global_batch, seed=seed
  )
  values = {run.variant.name: {k: [] for k in METRICS} for run in runs}
  for step in range(warmup_steps + measure_steps):
    batch = {
        k: v.reshape((num_devices, -1) + v.shape[1:])
        for k, v in loader.batch(step).items()
    }
    grads = ref.grads(params, batch)
    mean = ref.mean(grads)
    ref_dir, ref_adam_next = ref.adam_update(mean, ref_adam)
    for run in runs:
      cosines = run.cosines(
          ref, grads, step, warmup_steps, mean, ref_adam, ref_dir
      )
      for key, value in zip(METRICS, cosines or ()):
        if value is not None:
          values[run.variant.name][key].append(float(value))
    ref_adam = ref_adam_next
    params, descent_state = ref.apply(ref_dir, descent_state, params)
    if (step + 1) % 10 == 0:
      print(f"step {step + 1}", file=sys.stderr, flush=True)
  return _rows(values)


def _rows(values) -> list[dict[str, Any]]:
  """Per variant, the mean of each metric's values, and their count."""
  return [
      {
          "variant": name,
          **{
              k: statistics.fmean(xs) if xs else None
              for k, xs in metrics.items()
          },
          "steps": len(metrics["adam"]),
      }
      for name, metrics in values.items()
  ]


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.direction")
  parser.add_argument(
      "--char_lm_path", required=True, help="plain-text file for the char LM"
  )
  parser.add_argument("--warmup_steps", type=int, default=60)
  parser.add_argument("--measure_steps", type=int, default=30)
  parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument(
      "--geometries",
      default=",".join(g or "none" for g in GEOMETRIES),
      help="comma-separated: none (the compressor as it is), "
      + ", ".join(adam_geometry.GEOMETRY_KINDS),
  )
  parser.add_argument(
      "--comm_dtypes",
      default="none",
      help="comma-separated dtypes the factors are sent in: none (the"
      " gradients', float32), " + ", ".join(adam_geometry.COMM_DTYPE_NAMES),
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
      "--num_devices", type=int, default=8, help="devices simulated"
  )
  parser.add_argument(
      "--tiny", action="store_true", help="a tiny model: a smoke test"
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  start = time.perf_counter()
  rows = measure(
      args.char_lm_path,
      warmup_steps=args.warmup_steps,
      measure_steps=args.measure_steps,
      ranks=tuple(int(r) for r in args.ranks.split(",")),
      methods=tuple(args.methods.split(",")),
      geometries=tuple(
          None if g == "none" else g for g in args.geometries.split(",")
      ),
      comm_dtypes=tuple(
          None if d == "none" else d for d in args.comm_dtypes.split(",")
      ),
      num_devices=args.num_devices,
      seed=args.seed,
      tiny=args.tiny,
  )
  print(f"{'variant':28s}" + "".join(f"{k:>12s}" for k in METRICS))
  for row in rows:
    print(
        f"{row['variant']:28s}"
        + "".join(
            f"{row[k]:12.4f}" if row[k] is not None else f"{'-':>12s}"
            for k in METRICS
        )
    )
  print(
      "RESULT "
      + json.dumps({"rows": rows, "wall_s": time.perf_counter() - start}),
      flush=True,
  )


if __name__ == "__main__":
  sys.exit(main())
