"""What ``acp_jax.advise`` measures on this device, before any advice.

The forward and backward time of one worker's share of a batch and each
candidate's update time (``acp_jax_tools.timing``), then each candidate's
error: the squared distance of its compressed mean from the true mean, in
units of the true mean's sampling noise (``error_to_noise``), over a few
steps on the user's own gradients, with the workers simulated by
``jax.vmap`` (``acp_jax_tools.simulated``). The candidates are
``acp_jax_tools.advice.Candidate``s; ``advice`` explains the measure and
turns it into a pick.
"""

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import functools
import math
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import optax

from acp_jax import _checks
from acp_jax import compressor as compressor_lib
from acp_jax import registry
from acp_jax_tools import simulated
from acp_jax_tools import timing

# Dense steps each low-rank candidate takes before its cosine is measured,
# and the batches of a measurement (the warm-up's and the measured ones).
WARMUP = 2
STEPS = 4


@dataclasses.dataclass(frozen=True)
class Measurements:
  """What the advice measures, by candidate name (``Candidate.name``).

  Attributes:
    forward_backward: seconds of one worker's forward and backward pass on
      its share of the batch.
    update: seconds of each candidate's update on one worker (the mean over
      its phases), communication left out.
    error_to_noise: each candidate's mean per-step squared distance between
      its compressed mean gradient and the true mean (S-SGD's, whose error
      is 0), over the true mean's sampling noise
      (``simulated.sampling_noise``).
    cosine: each candidate's mean per-step cosine between its compressed
      mean gradient and the true mean (S-SGD's is 1).
    steps: each candidate's steps per S-SGD step to the same held-out loss
      (``steps_behind``; S-SGD's is 1), the median of its short runs; empty
      where no run was made.
    steps_range: the lowest and the highest of those runs' steps.

  A candidate left out of ``error_to_noise`` was not measured: it is not
  picked, and one predicted faster than the pick is an error.
  """

  forward_backward: float
  update: Mapping[str, float]
  error_to_noise: Mapping[str, float] = dataclasses.field(default_factory=dict)
  cosine: Mapping[str, float] = dataclasses.field(default_factory=dict)
  steps: Mapping[str, float] = dataclasses.field(default_factory=dict)
  steps_range: Mapping[str, tuple[float, float]] = dataclasses.field(
      default_factory=dict
  )


def _split(batch: Any, workers: int) -> Any:
  """``batch`` with each leaf's rows split over a leading worker axis."""

  def split(x):
    if x.shape[0] % workers:
      raise ValueError(
          f"the batch's {x.shape[0]} rows do not split over workers={workers}"
      )
    return x.reshape((workers, -1) + x.shape[1:])

  return jax.tree.map(split, batch)


@functools.lru_cache(maxsize=4)
def _grad(loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """``loss_fn``'s gradient, compiled once for the times and the errors."""
  return jax.jit(jax.grad(loss_fn))


@dataclasses.dataclass(frozen=True)
class _Steps:
  """The steps the errors are measured on: each worker's gradients
  (stacked on a leading worker axis), their true mean, and its sampling
  noise (``simulated.sampling_noise``), one of each a batch."""

  grads: list[Any]
  means: list[Any]
  noise: list[float]


def _steps(grad, params: Any, batches: Sequence[Any], workers: int) -> _Steps:
  one = lambda b, i: jax.tree.map(lambda x: x[i], b)
  # The simulated devices are one device's: the gradients are put there.
  device = jax.local_devices()[0]
  grads = [
      jax.device_put(
          jax.tree.map(
              lambda *g: jnp.stack(g),
              *(grad(params, one(b, i)) for i in range(workers)),
          ),
          device,
      )
      for b in (_split(b, workers) for b in batches)
  ]
  means = [jax.tree.map(lambda g: g.mean(0), g) for g in grads]
  noise = [float(_noise(g)) for g in grads]
  return _Steps(grads, means, noise)


_noise = jax.jit(simulated.sampling_noise)


@jax.jit
def _distance(estimate: Any, mean: Any) -> tuple[jax.Array, jax.Array]:
  return simulated.squared_distance(estimate, mean), simulated.cosine(
      estimate, mean
  )


def _ratio(error: float, noise: float) -> float:
  if noise > 0:
    return error / noise
  return 0.0 if error == 0 else math.inf


class _Simulated:
  """``candidate``'s compressor on ``workers`` devices simulated by
  ``jax.vmap`` (``simulated.Devices``); a low-rank one takes the first
  ``warmup`` steps dense, warming its factors (its ``warmup_steps``)."""

  def __init__(self, candidate: Any, params: Any, workers: int, warmup: int):
    warm = warmup and candidate.method in registry.low_rank()
    self._tx = candidate.make(**({"warmup_steps": warmup} if warm else {}))
    state = jax.jit(self._tx.init)(params)
    self._devices = simulated.Devices(
        self._tx.update,
        state,
        simulated.device_axes(self._tx, state),
        self._tx.axis_name,
        workers,
    )
    self._device = jax.local_devices()[0]

  def mean(self, step: int, grads: Any) -> Any:
    """The compressed mean of ``grads`` (stacked on a leading worker axis)
    at ``step``; the state moves on."""
    # The phase markers that at_step sets are not yet on the device, the
    # update's outputs are: put there alike, the program that compresses
    # is compiled once rather than again on the step after the switch.
    self._devices.state = jax.device_put(
        self._tx.at_step(self._devices.state, step), self._device
    )
    return self._devices(grads)


def _errors_over_steps(
    candidate: Any,
    params: Any,
    steps: _Steps,
    workers: int,
    warmup: int,
) -> tuple[float, float]:
  """``candidate``'s mean ``error_to_noise`` and cosine with the true means
  over the steps after ``warmup``, on ``workers`` simulated devices; a
  low-rank candidate takes those first steps dense, warming its factors."""
  compressed = _Simulated(candidate, params, workers, warmup)
  errors, cosines = [], []
  for step, (g, m, noise) in enumerate(
      zip(steps.grads, steps.means, steps.noise)
  ):
    estimate = compressed.mean(step, g)
    if step >= warmup:
      error, cosine = _distance(estimate, m)
      errors.append(_ratio(float(error), noise))
      cosines.append(float(cosine))
  return statistics.fmean(errors), statistics.fmean(cosines)


def run_losses(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batches: Sequence[Any],
    eval_batches: Sequence[Any],
    candidate: Any,
    optimizer: optax.GradientTransformation,
    *,
    workers: int,
    every: int,
) -> list[float]:
  """``candidate``'s held-out losses over a short run: from ``params``, a
  step a batch of ``batches`` (each split over ``workers`` simulated
  devices), each step's compressed mean of the workers' gradients into
  ``optimizer``; the mean of ``loss_fn`` over ``eval_batches`` (the same
  ones each time) at the start and after every ``every`` steps."""
  compressed = _Simulated(candidate, params, workers, 0)
  grads_of = _worker_grads(loss_fn)
  held_out = _held_out_loss(loss_fn)
  apply = _apply(optimizer)
  state = optimizer.init(params)
  losses = [held_out(params, eval_batches)]
  for step, batch in enumerate(batches):
    grads = grads_of(params, _split(batch, workers))
    params, state = apply(params, compressed.mean(step, grads), state)
    if (step + 1) % every == 0:
      losses.append(held_out(params, eval_batches))
  return [float(x) for x in losses]


@functools.lru_cache(maxsize=4)
def _apply(optimizer: optax.GradientTransformation) -> Callable:
  """``(params, mean, state) -> (params, state)``: a step of
  ``optimizer``."""

  @jax.jit
  def apply(params, mean, state):
    updates, state = optimizer.update(mean, state, params)
    return optax.apply_updates(params, updates), state

  return apply


@functools.lru_cache(maxsize=4)
def _worker_grads(loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """Each worker's gradient at the same params, stacked on a leading
  worker axis."""
  return jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))


@functools.lru_cache(maxsize=4)
def _held_out_loss(loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """The mean of ``loss_fn`` over a list of batches."""
  loss = jax.jit(loss_fn)
  return lambda params, batches: jnp.mean(
      jnp.stack([loss(params, b) for b in batches])
  )


def _update_seconds(
    tx: compressor_lib.Compressor, params: Any, repeats: int
) -> float:
  """``tx``'s update on one device (``timing.phase_calls``): the mean over
  its phases of the median of ``repeats`` calls."""
  calls = timing.phase_calls(tx, params)
  times = timing.interleaved(dict(enumerate(calls)), repeats, warmup=1)
  return statistics.fmean(statistics.median(t) for t in times.values())


def timed_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
  """The ranks whose update is timed: the lowest, the middle and the
  highest of ``ranks``; the others' are interpolated between them."""
  ordered = sorted(set(ranks))
  return tuple(sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]}))


def _update_times(
    candidates: Sequence[Any],
    params: Any,
    repeats: int,
    say: Callable[[str], None],
) -> dict[str, float]:
  """Each candidate's update seconds: timed, or, for a low-rank rank that
  ``timed_ranks`` leaves out, interpolated linearly in rank between the
  nearest timed ranks of the same method and factor dtype."""
  groups = {}
  for c in candidates:
    groups.setdefault((c.method, c.comm_dtype), []).append(c)
  times = {}
  for group in groups.values():
    timed = timed_ranks([c.rank for c in group]) if group[0].rank else ()
    by_rank = {}
    for c in group:
      if c.rank is None or c.rank in timed:
        say(f"update of {c.name}")
        times[c.name] = by_rank[c.rank] = _update_seconds(
            c.make(), params, repeats
        )
    for c in group:
      if c.name not in times:
        lo = max(r for r in timed if r < c.rank)
        hi = min(r for r in timed if r > c.rank)
        w = (c.rank - lo) / (hi - lo)
        times[c.name] = (1 - w) * by_rank[lo] + w * by_rank[hi]
  return times


def _check_warmup(warmup: int, batches: Sequence[Any]) -> None:
  _checks.integer("warmup", warmup, 0)
  if len(batches) <= warmup:
    raise ValueError(
        f"batches must hold more than warmup={warmup} batches, got"
        f" {len(batches)}"
    )


def _times(grad, params, batches, candidates, workers, repeats, say):
  """The forward and backward time by ``grad`` and each candidate's update
  time, on this device (no errors yet)."""
  say(f"forward and backward on one worker's share of {workers}")
  first = jax.tree.map(lambda x: x[0], _split(batches[0], workers))
  times = timing.interleaved({0: lambda: grad(params, first)}, repeats, 1)
  update = _update_times(candidates, params, repeats, say)
  return Measurements(statistics.median(times[0]), update)


def _errors(grad, params, batches, candidates, workers, warmup, enough, say):
  """Each candidate's ``error_to_noise`` and cosine, by name, measured in
  the order of ``candidates``, stopping once ``enough`` (if given) accepts
  the errors measured so far."""
  steps = _steps(grad, params, batches, workers)
  errors, cosines = {}, {}
  for i, c in enumerate(candidates):
    say(f"[{i + 1}/{len(candidates)}] error of {c.name}")
    # S-SGD is the reference: its mean is the true mean.
    errors[c.name], cosines[c.name] = (
        (0.0, 1.0)
        if c.method == "ssgd"
        else _errors_over_steps(c, params, steps, workers, warmup)
    )
    if enough is not None and enough(errors):
      break
  return errors, cosines


def measure(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batches: Sequence[Any],
    candidates: Sequence[Any],
    *,
    workers: int,
    warmup: int = WARMUP,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    order: Callable[[Measurements], Sequence[Any]] | None = None,
    enough: Callable[[Mapping[str, float]], bool] | None = None,
) -> Measurements:
  """Measures on this device what ``recommend`` needs: the times, then the
  errors.

  Args:
    loss_fn: ``(params, batch) -> scalar loss`` of one worker's batch.
    params: the parameters (the initial ones, or a checkpoint's).
    batches: global batches, one a step, each leaf's rows split evenly over
      the ``workers``; the errors are taken over all but the first
      ``warmup`` steps.
    candidates: the compressors to measure.
    workers: how many workers to simulate.
    warmup: the dense steps each Power-SGD and ACP-SGD candidate takes
      first, warming its factors (the others' residuals settle in them);
      the errors are taken after them.
    repeats: timed calls of each update after the one that compiles it
      (the median is kept); ranks between those of ``timed_ranks`` are
      interpolated.
    progress: called with a line before each measurement.
    order: from the times, the candidates whose errors are measured, in
      that order; default ``candidates``.
    enough: stop measuring errors once it accepts those measured so far
      (by candidate name).
  """
  _checks.integer("workers", workers, 1)
  _check_warmup(warmup, batches)
  say = progress or (lambda line: None)
  grad = _grad(loss_fn)
  timed = _times(grad, params, batches, candidates, workers, repeats, say)
  errors, cosines = _errors(
      grad,
      params,
      batches,
      order(timed) if order else candidates,
      workers,
      warmup,
      enough,
      say,
  )
  return dataclasses.replace(timed, error_to_noise=errors, cosine=cosines)


def volumes(
    candidates: Sequence[Any], params: Any, workers: int
) -> dict[str, dict[str, compressor_lib.CommVolume]]:
  """Each candidate's bytes per phase on ``workers`` (``comm_bytes``)."""
  return {
      c.name: compressor_lib.comm_bytes(c.make(), params, num_devices=workers)
      for c in candidates
  }
