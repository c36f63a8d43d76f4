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

Variants: Power-SGD and ACP-SGD at each rank, as they are, and compressed in
Adam's geometry: each compressed n x m leaf M is scaled elementwise to
``M * W`` before compression and its mean divided by W after, W being the
inverse square root of a running second moment (decay b2) of the
*decompressed mean*, identical on every replica, so no byte is added:

- ``factored``: Adafactor's factored moment (n + m floats), so W = D_r 1 1^T
  D_c and the mean D_r^-1 P Q^T D_c^-1 is still rank r; the residual is
  kept in the gradient's space (re-expressed when W changes);
- ``factored_scaled``: the same, the residual kept in the scaled space;
- ``full``: the full moment (n x m floats, Adam's own v), the mean no
  longer of rank r;
- ``momentum``: ``acp_jax.compressed_adam``, the compressor averaging
  Adam's first moment (each device's b1 mu + (1 - b1) G_i) instead of the
  gradient, v frozen at the end of the warm-up. Its ``grad`` is the
  cosine of its mean momentum with the true mean of what its devices hold,
  b1 mu + (1 - b1) g; its ``adam`` that of its own update with S-SGD's;
  ``adam_shared`` does not apply (None);
- ``momentum_preconditioned``: the same, the momentum compressed divided
  by sqrt(v) + eps (``compressed_adam(..., preconditioned=True)``).

The devices are simulated by ``jax.vmap`` over the mapped axis (see
``_Run``), on the default device.

  python -m benchmarks.direction --char_lm_path PATH [--measure_steps 30]
"""

import argparse
import json
import statistics
import sys
import time
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import acp_jax
from acp_jax import state_trees
from acp_jax import lowrank
from benchmarks import workloads
from train import data as data_lib
from train import experiment as experiment_lib

RANKS = (4, 8)
METHODS = ("power_sgd", "acp_sgd")
# None: the compressor as it is; else a key of GEOMETRY_KINDS.
GEOMETRIES = (
    None,
    "factored_scaled",
    "factored",
    "full",
    "momentum",
    "momentum_preconditioned",
)
# name -> compressed_adam's preconditioned.
MOMENTUM = {"momentum": False, "momentum_preconditioned": True}
METRICS = ("grad", "adam", "adam_shared")
B1, B2, EPS = 0.9, 0.99, 1e-8
# Below this fraction of its leaf's mean, a row's or column's second moment
# counts as this fraction: the scaling stays finite on rows never used.
FLOOR = 1e-6


class Scaled(NamedTuple):
  """A compressor's state with a running second moment of its means.

  Attributes:
    inner: the compressor's own state.
    moment: per compressed leaf, the running mean of the squared mean
      gradient: factored, a pair of (n,) (the mean over columns) and (m,)
      (over rows) float32; full, (n, m) float32. Identical on every replica.
    count: int32 scalar, the means seen.
  """

  inner: Any
  moment: list
  count: Any


def _inverse_root(v, count):
  """``v``'s normalized inverse square root, ones before any mean was
  seen."""
  v = v / jnp.maximum(v.mean(), 1e-30)
  d = jnp.sqrt(1.0 / jnp.maximum(v, FLOOR))
  return jnp.where(count > 0, d, jnp.ones_like(d))


class Geometry(NamedTuple):
  """The weights W that a variant compresses M * W in (elementwise), and
  sends back M = approx / W: rank-r preserving when W is an outer product."""

  init: Any  # (n, m) -> zero moment
  weights: Any  # (moment, count) -> (n, m) W
  accumulate: Any  # (moment, mean matrix) -> moment


def _ema(old, new):
  return B2 * old + (1 - B2) * new


def _factored() -> Geometry:
  return Geometry(
      lambda n, m: (jnp.zeros((n,), jnp.float32), jnp.zeros((m,), jnp.float32)),
      lambda v, count: (
          _inverse_root(v[0], count)[:, None] * _inverse_root(v[1], count)
      ),
      lambda v, x: (
          _ema(v[0], jnp.mean(jnp.square(x), 1)),
          _ema(v[1], jnp.mean(jnp.square(x), 0)),
      ),
  )


def _full() -> Geometry:
  return Geometry(
      lambda n, m: jnp.zeros((n, m), jnp.float32),
      _inverse_root,
      lambda v, x: _ema(v, jnp.square(x)),
  )


# name -> (its Geometry, whether the residual stays in the scaled space).
GEOMETRY_KINDS = {
    "factored_scaled": (_factored, True),
    "factored": (_factored, False),
    "full": (_full, False),
}


class Variant:
  """A compressor as measured: its update on one device's gradients, with
  or without the scaling in Adam's geometry."""

  def __init__(self, method: str, rank: int, geometry: str | None, warmup):
    self.name = method + f"_r{rank}" + (f"_{geometry}" if geometry else "")
    self.geometry = None
    self.momentum = geometry in MOMENTUM
    if geometry and not self.momentum:
      make, self.scaled_residual = GEOMETRY_KINDS[geometry]
      self.geometry = make()
    self.tx = getattr(acp_jax, method)(
        rank, warmup_steps=warmup, bucket_bytes=float("inf")
    )
    if self.momentum:
      self.tx = acp_jax.compressed_adam(
          self.tx, b1=B1, b2=B2, eps=EPS, preconditioned=MOMENTUM[geometry]
      )
    self._spec = lambda x: lowrank.matrix_spec(tuple(x.shape), rank, 2.0)

  def init(self, params):
    inner = self.tx.init(params)
    if self.geometry is None:
      return inner
    specs = [self._spec(x) for x in jax.tree.leaves(params)]
    return Scaled(
        inner,
        [self.geometry.init(s.n, s.m) for s in specs if s],
        jnp.zeros((), jnp.int32),
    )

  def at_step(self, state, step: int):
    if self.geometry is None:
      return self.tx.at_step(state, step)
    return state._replace(inner=self.tx.at_step(state.inner, step))

  def local_fields(self, state) -> Any:
    """``state`` with True at the fields that differ across devices."""
    inner = state.inner if self.geometry else state
    flags = type(inner)(*(f in self.tx.local_fields for f in inner._fields))
    if self.geometry is None:
      return flags
    return Scaled(flags, False, False)

  def _per_matrix(self, xs, weights, fn):
    """``fn(x as n x m, W)`` at the compressed leaves of ``xs``."""
    out, it = list(xs), iter(weights)
    for i, x in enumerate(xs):
      spec = self._spec(x) if not state_trees.is_masked(x) else None
      if spec:
        out[i] = fn(x.reshape(spec.n, spec.m), next(it)).reshape(x.shape)
    return out

  def update(self, grads, state):
    """The compressed mean of one device's ``grads``, inside the mapping."""
    if self.geometry is None:
      return self.tx.update(grads, state)
    g = self.geometry
    leaves, treedef = jax.tree.flatten(grads)
    weights = [g.weights(v, state.count) for v in state.moment]
    scaled = self._per_matrix(leaves, weights, lambda x, w: x * w)
    mean, inner = self.tx.update(
        jax.tree.unflatten(treedef, scaled), state.inner
    )
    mean = self._per_matrix(jax.tree.leaves(mean), weights, lambda x, w: x / w)
    matrices = [
        x.reshape(spec.n, spec.m) for x in mean if (spec := self._spec(x))
    ]
    moment = [g.accumulate(v, x) for v, x in zip(state.moment, matrices)]
    count = state.count + 1
    if not self.scaled_residual and "error" in inner._fields:
      # The residual, stored scaled by the old W, is re-expressed in the new
      # one: the unscaled residual is kept.
      ratios = [g.weights(v, count) / w for v, w in zip(moment, weights)]
      errors = state_trees.state_leaves(inner.error)
      errors = self._per_matrix(errors, ratios, lambda e, r: e * r)
      inner = inner._replace(
          error=jax.tree.unflatten(
              jax.tree.structure(inner.error, is_leaf=state_trees.is_masked),
              errors,
          )
      )
    return jax.tree.unflatten(treedef, mean), Scaled(inner, moment, count)


class _Run:
  """A variant's compiled update, its compressor state and Adam moments.

  The devices are simulated by ``jax.vmap`` over the mapped axis, whose
  collectives then run in one program on one device: the same arithmetic as
  under ``shard_map``, with no threads to wait on each other. The local
  fields of the state (the residuals) carry a leading device axis; the
  others, identical on every replica, are held once.
  """

  def __init__(self, variant: Variant, params, num_devices: int):
    self.variant = variant
    state = variant.init(params)
    axes = jax.tree.map(
        lambda local: 0 if local else None,
        variant.local_fields(state),
        is_leaf=lambda x: isinstance(x, bool),
    )
    self._update = jax.jit(
        jax.vmap(
            variant.update,
            in_axes=(0, axes),
            out_axes=(None, axes),
            axis_name=variant.tx.axis_name,
        )
    )
    self.state = jax.tree.map(
        lambda a, sub: jax.tree.map(
            lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), sub
        )
        if a == 0
        else sub,
        axes,
        state,
        is_leaf=lambda x: x is None or isinstance(x, int),
    )
    self.adam = None

  def step(self, grads, step: int):
    """The compressed mean of the stacked ``grads`` at step ``step``."""
    state = self.variant.at_step(self.state, step)
    mean, self.state = self._update(grads, state)
    return mean


def _cosine(a, b):
  """The cosine between two trees, as vectors of all their leaves."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  dot = sum(jnp.vdot(x, y) for x, y in zip(la, lb))
  na = sum(jnp.vdot(x, x) for x in la)
  nb = sum(jnp.vdot(y, y) for y in lb)
  return dot / jnp.sqrt(na * nb)


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
    num_devices: int = 8,
    seed: int = 0,
    tiny: bool = False,
) -> list[dict[str, Any]]:
  """Per variant, the mean of each metric over the measured steps."""

  cfg = config(char_lm_path, tiny)
  cfg.seed = seed
  cfg.num_train_steps = warmup_steps + measure_steps
  exp = experiment_lib.build(cfg)
  graphdef = exp.graphdef
  # On the default device alone: the simulated devices are a vmapped axis.
  params = jax.jit(
      lambda: nnx.to_pure_dict(
          nnx.split(exp.create_model(), nnx.Param, nnx.BatchStat)[1]
      )
  )()

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params, {})
    logits = model(batch["inputs"], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]
    ).mean()

  # Each device's gradient of the loss of its shard.
  grads_fn = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))
  adam = optax.scale_by_adam(B1, B2, EPS)
  descent = optax.chain(
      optax.add_decayed_weights(cfg.optimizer.weight_decay),
      optax.scale_by_learning_rate(exp.schedule),
  )
  mean_fn = jax.jit(lambda g: jax.tree.map(lambda x: x.mean(0), g))
  adam_fn = jax.jit(adam.update)
  descent_state = descent.init(params)

  @jax.jit
  def metrics_fn(approx, mean, own_adam, ref_adam, ref_dir):
    direction, own_adam = adam.update(approx, own_adam)
    shared, _ = adam.update(approx, ref_adam)
    cosines = [
        _cosine(approx, mean),
        _cosine(direction, ref_dir),
        _cosine(shared, ref_dir),
    ]
    return cosines, own_adam

  @jax.jit
  def momentum_metrics(mu, old_mu, mean, direction, ref_dir):
    held = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, old_mu, mean)
    return [_cosine(mu, held), _cosine(direction, ref_dir)]

  @jax.jit
  def apply(direction, descent_state, params):
    updates, descent_state = descent.update(direction, descent_state, params)
    return optax.apply_updates(params, updates), descent_state

  variants = [
      Variant(m, r, g, warmup_steps)
      for m in methods
      for r in ranks
      for g in geometries
  ]
  runs = [_Run(v, params, num_devices) for v in variants]
  ref_adam = adam.init(params)
  loader = data_lib.Loader(
      exp.dataset.train, global_batch=exp.global_batch, seed=seed
  )
  values = {v.name: {k: [] for k in METRICS} for v in variants}
  for step in range(warmup_steps + measure_steps):
    batch = {
        k: v.reshape((num_devices, -1) + v.shape[1:])
        for k, v in loader.batch(step).items()
    }
    grads = grads_fn(params, batch)
    mean = mean_fn(grads)
    ref_dir, ref_adam_next = adam_fn(mean, ref_adam)
    for run in runs:
      if run.variant.momentum:
        old_mu = run.state.adam.mu
      approx = run.step(grads, step)
      if step < warmup_steps:
        continue
      if run.variant.momentum:
        cosines = momentum_metrics(
            run.state.adam.mu, old_mu, mean, approx, ref_dir
        )
      else:
        if step == warmup_steps:
          run.adam = ref_adam
        cosines, run.adam = metrics_fn(
            approx, mean, run.adam, ref_adam, ref_dir
        )
      for key, value in zip(METRICS, cosines):
        values[run.variant.name][key].append(float(value))
    ref_adam = ref_adam_next
    params, descent_state = apply(ref_dir, descent_state, params)
    if (step + 1) % 10 == 0:
      print(f"step {step + 1}", file=sys.stderr, flush=True)
  return [
      {
          "variant": name,
          **{
              k: statistics.fmean(xs) if xs else None
              for k, xs in metrics.items()
          },
          "steps": len(metrics["grad"]),
      }
      for name, metrics in values.items()
  ]


def main(argv: list[str] | None = None) -> None:
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
      + ", ".join((*GEOMETRY_KINDS, *MOMENTUM)),
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
      "--num_devices", type=int, default=8, help="devices simulated"
  )
  parser.add_argument(
      "--tiny", action="store_true", help="a tiny model: a smoke test"
  )
  args = parser.parse_args(argv)
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
