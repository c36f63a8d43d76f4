"""The low-rank compressors' arithmetic: the orthogonalization of tall
factors and the passes that a step makes over each gradient matrix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acp_jax
from acp_jax import orthogonalize
from acp_jax_tools import hlo
from tests import helpers

# Tall enough, at a rank high enough, for Cholesky-QR2 on a CPU.
N, R = 1024, 32


def defect(q):
  """max |Q^T Q - I|."""
  q = np.asarray(q, np.float64)
  return np.abs(q.T @ q - np.eye(q.shape[1])).max()


def normal(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def ill_conditioned(cond, seed=0):
  """An N x R matrix with singular values from 1 down to 1 / ``cond``."""
  u, _ = np.linalg.qr(normal((N, R), seed))
  v, _ = np.linalg.qr(normal((R, R), seed + 1))
  return ((u * np.logspace(0, -np.log10(cond), R)) @ v.T).astype(np.float32)


def test_tall_factors_take_cholesky_qr2_and_come_out_orthonormal():
  assert orthogonalize.uses_cholesky_qr(N, R)
  assert not orthogonalize.uses_cholesky_qr(N, 4)  # Householder is faster there
  assert not orthogonalize.uses_cholesky_qr(64, R)
  x = normal((N, R))
  q = jax.jit(orthogonalize.orthogonalize)(x)
  householder = np.linalg.qr(x)[0]
  # Not Householder's own result (its columns carry other signs, at least),
  # but the same span, and orthonormal to float32 accuracy.
  assert not np.array_equal(np.asarray(q), householder)
  assert defect(q) < 1e-5
  np.testing.assert_allclose(
      np.abs(np.asarray(q).T @ householder), np.eye(R), atol=1e-4
  )


@pytest.mark.parametrize(
    "case",
    [
        "zero",
        "rank_deficient",
        "cond_1e7",
    ],
)
def test_cholesky_qr2_falls_back_to_householder_where_it_would_fail(case):
  x = {
      "zero": np.zeros((N, R), np.float32),
      "rank_deficient": normal((N, 5)) @ normal((5, R), 1),
      "cond_1e7": ill_conditioned(1e7),
  }[case]
  # Unguarded, one pass of Cholesky-QR is NaN or far from orthonormal here.
  gram = jnp.asarray(x).T @ jnp.asarray(x)
  first = jnp.asarray(x) @ orthogonalize._inverse_cholesky_factor(gram)
  assert not np.isfinite(first).all() or defect(first) > 0.1
  q = jax.jit(orthogonalize.orthogonalize)(x)
  np.testing.assert_array_equal(q, jax.jit(orthogonalize._householder)(x))
  assert defect(q) < 1e-5
  if case != "zero":  # the span of x is kept
    q = np.asarray(q)
    np.testing.assert_allclose(q @ (q.T @ x), x, atol=1e-4)


def test_acp_sgd_on_a_zero_gradient_keeps_finite_orthonormal_factors():
  # Its P-step all-reduces a zero P, which the Q-step orthogonalizes (on
  # the Cholesky-QR2 path, a 1024 x 32 factor).
  tx = acp_jax.acp_sgd(rank=R)
  params = {"w": jnp.zeros((N, 128))}
  dp = acp_jax.DataParallel(tx, helpers.mesh())
  compress = jax.jit(dp.compress)
  state = dp.init_comm(params)
  grads = jax.tree.map(lambda g: jnp.zeros((dp.num_devices,) + g.shape), params)
  for _ in range(3):  # P, Q, P
    mean, state = compress(grads, state)
    np.testing.assert_array_equal(mean["w"], 0.0)
  assert np.isfinite(state.q["w"]).all() and np.isfinite(state.p["w"]).all()
  assert defect(orthogonalize.orthogonalize(state.p["w"])) < 1e-5


def step_text(
    name,
    phase,
    shape,
    devices=1,
    nonfinite="propagate",
    rank=32,
    out_shardings=False,
):
  """The compiled text of one step of ``name`` at ``rank`` under
  ``DataParallel``, on one leaf of ``shape``, its state donated; with
  ``out_shardings``, jitted with the shardings of its results."""
  tx = getattr(acp_jax, name)(rank=rank)
  mesh = jax.make_mesh(
      (devices,),
      ("data",),
      devices=jax.devices()[:devices],
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  dp = acp_jax.DataParallel(tx, mesh, nonfinite=nonfinite)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  comm = dp.phase_states(dp.abstract_comm(params))[phase]
  jit_kwargs = {}
  if out_shardings:
    jit_kwargs["out_shardings"] = dp.compress_shardings(params)
  return (
      jax.jit(dp.compress, donate_argnums=(1,), **jit_kwargs)
      .lower(dp.abstract_local_grads(params), comm)
      .compile()
      .as_text()
  )


def step_passes(name, phase, shape=(3072, 768), **kwargs):
  """``hlo.buffer_passes`` over the leaf's n x m matrix in one compiled
  step (``step_text``'s keyword arguments)."""
  text = step_text(name, phase, shape, **kwargs)
  return hlo.buffer_passes(text, int(np.prod(shape)))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize(
    "name, phase, rank, most",
    [
        # Reads of G and E by the projection (2), E' = G + E - F B^T in one
        # fusion (3), the update (1).
        ("acp_sgd", "p", 32, 6),
        ("acp_sgd", "q", 32, 6),
        # Two projections read G and E each.
        ("power_sgd", "step", 8, 8),
        # At rank 32, E' = G + E - P Q^T reads back the update P Q^T rather
        # than recompute it: one pass more, r multiply-adds per element less.
        ("power_sgd", "step", 32, 9),
    ],
)
def test_error_feedback_makes_the_fewest_passes_over_the_matrix(
    name, phase, rank, most
):
  passes = step_passes(name, phase, rank=rank)
  assert sum(p.reads + p.writes for p in passes) == most, passes
  # No n x m temporary is written and read back, nor E' copied.
  assert [p.writes for p in passes].count(1) == 2, passes
  assert "copy" not in [p.op for p in passes], passes
  # Keeping the residual through a non-finite step (DataParallel's default)
  # selects between the donated block of E and E' in the same fusion that
  # writes E': no pass more, no copy.
  kept = step_passes(name, phase, nonfinite="keep", rank=rank)
  assert sum(p.reads + p.writes for p in kept) == most, kept
  assert "copy" not in [p.op for p in kept], kept
  # On several devices, jitted with its results' shardings, the donated
  # residual is E's own buffer again: the same passes.
  spread = step_passes(
      name, phase, nonfinite="keep", rank=rank, devices=2, out_shardings=True
  )
  assert sum(p.reads + p.writes for p in spread) == most, spread
  assert "copy" not in [p.op for p in spread], spread


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("name", ["acp_sgd", "power_sgd"])
def test_a_user_step_donating_params_and_state_copies_no_residual(name):
  # Without out_shardings, XLA pairs each donated buffer with the first
  # unpaired output of its size: donated together, params and state pair
  # with their own updates. The state donated alone, its residual pairs
  # with the new params, and is copied before it is read.
  shape = (3072, 768)
  mesh = jax.make_mesh(
      (2,),
      ("data",),
      devices=jax.devices()[:2],
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  dp = acp_jax.DataParallel(getattr(acp_jax, name)(rank=32), mesh)
  tx = dp.chain(optax.sgd(0.1))
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  state = jax.eval_shape(tx.init, params)
  # One row per device, which could as well be time-major: said.
  batch = jax.ShapeDtypeStruct((2, 8, shape[0]), jnp.float32)
  specs = (jax.sharding.PartitionSpec("data"),)

  def loss(p, x):
    return jnp.mean((x @ p["w"]) ** 2)

  def step(p, s, x):
    grads = dp.value_and_grad(loss, batch_specs=specs)(p, x)[1]
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def copies(donate):
    text = (
        jax.jit(step, donate_argnums=donate)
        .lower(params, state, batch)
        .compile()
        .as_text()
    )
    passes = hlo.buffer_passes(text, int(np.prod(shape)))
    return [p.op for p in passes].count("copy")

  assert copies((0, 1)) == 0
  assert copies((1,)) == 1


def fused_body(text, result):
  """The instructions of the fused computation that the entry's fusion
  with shape ``result`` calls."""
  (called,) = re.findall(
      rf"= {re.escape(result)}\{{[0-9,]*\}} fusion\(.*calls=(%[\w.\-]+)", text
  )
  return re.search(
      rf"^{re.escape(called)} .*?\{{\n(.*?)^\}}", text, re.M | re.S
  )[1]


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize(
    "name, phase, rank",
    # Power-SGD at a rank whose residual still recomputes the product.
    [("acp_sgd", "p", 32), ("acp_sgd", "q", 32), ("power_sgd", "step", 8)],
)
def test_the_residual_fusion_reads_its_factors_in_their_own_layout(
    name, phase, rank
):
  # E' = G + E - sum_k u_k v_k^T, one loop over the n x m block, along its
  # rows. A relayout of the r x m factor inside it reads that factor with a
  # stride of r along the loop: five times the loop's time. (The n x r one
  # may be read in any layout: its element is the same along a row.)
  n, m = 3072, 768
  text = step_text(name, phase, (n, m), rank=rank)
  body = fused_body(text, f"f32[1,{n},{m}]")
  assert f"f32[{rank},{m}]" in body, body
  relayouts = re.findall(
      r"= (f32\[[0-9,]+\])\{[0-9,]*\} (?:copy|transpose)\(", body
  )
  assert set(relayouts) <= {f"f32[{n},{rank}]"}, body


def test_buffer_passes_reads_operands_and_results_of_the_size():
  text = """
ENTRY %main (a: f32[4,8], b: f32[1,4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[1,4,8]{2,1,0} parameter(1)
  %bitcast = f32[4,8]{1,0} bitcast(%b)
  %fusion = f32[4,8]{1,0} fusion(%a, %bitcast), kind=kLoop, calls=%f
  %dot = f32[4,2]{1,0} dot(%fusion, %c), lhs_contracting_dims={1}
  ROOT %copy = f32[4,8]{1,0} copy(%fusion)
}
"""
  assert hlo.buffer_passes(text, 32) == [
      hlo.BufferPass("%fusion", "fusion", 2, 1),
      hlo.BufferPass("%dot", "dot", 1, 0),
      hlo.BufferPass("%copy", "copy", 1, 1),
  ]


def test_limit_lapack_threads_limits_the_blas_behind_jaxlib_and_restores():
  from threadpoolctl import threadpool_info  # pylint: disable=g-import-not-at-top

  jax.block_until_ready(jnp.linalg.qr(jnp.ones((4, 2))))  # loads the LAPACK
  scipy_blas = lambda: [
      i["num_threads"] for i in threadpool_info() if "scipy" in i["filepath"]
  ]
  before = scipy_blas()
  assert before
  with acp_jax.limit_lapack_threads(1):
    assert set(scipy_blas()) == {1}
    with acp_jax.limit_lapack_threads(2):
      assert set(scipy_blas()) == {2}
  assert scipy_blas() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_limit_lapack_threads_refuses_a_bad_count(bad):
  with pytest.raises(
      ValueError, match=f"num_threads must be a positive int, got {bad!r}"
  ):
    acp_jax.limit_lapack_threads(bad)
