"""Reading collectives and their bytes from HLO text."""

import jax
import jax.numpy as jnp
import pytest

from acp_jax_tools import hlo
from tests import helpers
from tests.conftest import NUM_DEVICES

# Lines in the forms XLA prints: a variadic all-reduce whose tuple carries an
# index comment, a GPU async all-gather pair, a root instruction, and ops
# whose metadata mentions a collective without being one.
MODULE = """
HloModule jit_step
  %x = f32[2,3]{1,0} parameter(0)
  %all-reduce.3 = (f32[2,3]{1,0}, bf16[4]{0}, pred[3]{0}, s32[], f32[1]{0}, /*index=5*/u8[8,2]{1,0}) all-reduce(%x, %y), channel_id=1, replica_groups={{0,1}}, to_apply=%sum
  %all-gather-start.1 = (f32[4]{0}, f32[32]{0}) all-gather-start(%y), dimensions={0}
  %all-gather-done.1 = f32[32]{0} all-gather-done(%all-gather-start.1)
  %fusion = f32[4]{0} fusion(%z), kind=kLoop, metadata={op_name="jit(f)/all-reduce(x)"}
  ROOT %all-to-all = f8e4m3fn[10]{0} all-to-all(%z), dimensions={0}
"""


def test_counts_and_bytes():
  assert hlo.collective_stats(MODULE) == {
      "all-reduce": hlo.CollectiveStats(1, 24 + 8 + 3 + 4 + 4 + 16),
      "all-gather": hlo.CollectiveStats(1, 32 * 4),
      "all-to-all": hlo.CollectiveStats(1, 10),
  }


def test_async_collective_permute_counts_its_result():
  # The start returns (operand, result, two u32[] contexts).
  start = (
      "  %cp-start = (f32[2,3]{1,0}, f32[2,3]{1,0}, u32[], u32[])"
      " collective-permute-start(%x), source_target_pairs={{0,1}}\n"
      "  %cp-done = f32[2,3]{1,0} collective-permute-done(%cp-start)"
  )
  assert hlo.collective_stats(start) == {
      "collective-permute": hlo.CollectiveStats(1, 24)
  }


def test_traffic_of_a_compiled_program_has_every_kind():
  P = jax.sharding.PartitionSpec
  step = jax.jit(
      jax.shard_map(
          lambda x: jax.lax.psum(x, helpers.AXIS),
          mesh=helpers.mesh(),
          in_specs=P(helpers.AXIS),
          out_specs=P(),
      )
  )
  compiled = step.lower(jnp.zeros((NUM_DEVICES * 3,), jnp.float32)).compile()
  traffic = hlo.traffic(compiled)
  assert traffic == hlo.traffic(compiled.as_text())
  assert traffic == {
      "all-reduce": hlo.CollectiveStats(1, 3 * 4),
      "all-gather": hlo.CollectiveStats(0, 0),
      "reduce-scatter": hlo.CollectiveStats(0, 0),
      "all-to-all": hlo.CollectiveStats(0, 0),
      "collective-permute": hlo.CollectiveStats(0, 0),
  }


def test_no_collectives():
  assert not hlo.collective_stats("  %x = f32[2]{0} add(%a, %b)")


def test_unknown_element_type():
  with pytest.raises(ValueError, match="unknown HLO element type 'u4'"):
    hlo.collective_stats("  %a = u4[8]{0} all-reduce(%x)")


# Power-SGD's shape: P all-reduced, orthogonalized in a fusion, Q computed
# from it and all-reduced, while an independent dense leaf is all-reduced
# beside them. Computation headers and a called computation holding a
# collective are in the forms XLA prints.
CHAIN = """
HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%inner (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %all-reduce.9 = f32[8]{0} all-reduce(%p), to_apply=%sum
}

ENTRY %main (x: f32[8], y: f32[4]) -> (f32[8], f32[4]) {
  %x = f32[8]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %all-reduce = f32[8]{0} all-reduce(%x), channel_id=1, to_apply=%sum
  %orth = f32[8]{0} fusion(%all-reduce), kind=kLoop, calls=%sum
  %all-reduce.1 = f32[8]{0} all-reduce(%orth), channel_id=2, to_apply=%sum
  %dense = f32[4]{0} all-reduce(%y), channel_id=3, to_apply=%sum
  ROOT %out = (f32[8]{0}, f32[4]{0}) tuple(%all-reduce.1, %dense)
}
"""


def test_rounds_follow_dependencies():
  assert hlo.collective_rounds(CHAIN) == 2
  # Making the second all-reduce independent of the first leaves one round.
  assert hlo.collective_rounds(CHAIN.replace("(%orth)", "(%x)")) == 1
  # A call of a computation holding a collective adds its rounds.
  assert hlo.collective_rounds(CHAIN.replace("calls=%sum", "calls=%inner")) == 3


def test_rounds_without_collectives():
  assert hlo.collective_rounds("  %x = f32[2]{0} add(%a, %b)") == 0
  assert hlo.collective_rounds(MODULE) == 1
