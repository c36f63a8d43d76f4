"""Sign-SGD's arithmetic: the packing, and the passes that an
error-feedback step makes over each gradient matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import acp_jax
from acp_jax import sign
from acp_jax_tools import hlo


@pytest.mark.parametrize("shape", [(5, 7), (4, 8), (3,)])
def test_packing_with_magnitudes_is_packbits_and_the_abs_sum(shape):
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  x.ravel()[:2] = [0.0, -0.0]  # both sent as +1
  bits, total = jax.jit(sign._pack_signs_and_sum_magnitudes)(x)
  np.testing.assert_array_equal(bits, np.packbits(x.ravel() >= 0))
  np.testing.assert_allclose(total, np.abs(x).sum(), rtol=1e-6)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("devices", [1, 2])
def test_error_feedback_makes_eight_passes_over_the_matrix(devices):
  shape = (256, 512)
  mesh = jax.make_mesh(
      (devices,),
      ("data",),
      devices=jax.devices()[:devices],
      axis_types=(jax.sharding.AxisType.Auto,),
  )
  dp = acp_jax.DataParallel(acp_jax.sign_sgd(), mesh)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  text = (
      jax.jit(
          dp.compress,
          donate_argnums=(1,),
          out_shardings=dp.compress_shardings(params),
      )
      .lower(dp.abstract_local_grads(params), dp.abstract_comm(params))
      .compile()
      .as_text()
  )
  passes = hlo.buffer_passes(text, int(np.prod(shape)))
  # Signs and magnitudes read G and E once (2); E' = p - c sign(p), kept
  # through a non-finite step, reads them again and writes (3); the mean
  # is written (1); E' is copied into the donated block (2): the fusion
  # reads that block through a reshape, so XLA does not write in place.
  # Unfused, p = G + E was written for the magnitudes' reduce and read back
  # beside the packing's own read (12 passes).
  assert sum(p.reads + p.writes for p in passes) == 8, passes
  assert [p.op for p in passes].count("copy") == 1, passes
