"""``results/REPORT.md``: the measurements' tables and figures, with the
targets of ``targets.py`` checked against them.

Everything in the report comes from the JSON files beside it; each section
says the machine, date and command that made its numbers.
"""

import os
import pathlib
from typing import Any

from benchmarks import cluster
from benchmarks import comm
from benchmarks import convergence
from benchmarks import overhead
from benchmarks import plots
from benchmarks import project
from benchmarks import records
from benchmarks import targets
from benchmarks import workloads
from train import models

# Each model's table has a heading that gives these.
_PER_MODEL_COLUMNS = {
    k: v
    for k, v in comm.COLUMNS.items()
    if k not in ("model", "params", "compressed_matrices")
}


def _provenance(rows: list[dict[str, Any]]) -> str:
  runs = sorted({(r["machine"], r["date"], r["command"]) for r in rows})
  return "\n".join(
      f"_Measured on {machine}, {date}, by `{command}`._"
      for machine, date, command in runs
  )


def _comm_section(rows, out: pathlib.Path) -> list[str]:
  plots.bars(
      rows,
      "bytes_per_step",
      "bytes per step per device",
      "Bytes each device sends per step (ACP-SGD: mean of P and Q)",
      out / "comm_bytes.png",
  )

  acp = [r for r in rows if r["compressor"] == "acp_sgd"]
  lines = [
      "## 1. Communication per step",
      "",
      _provenance(rows),
      "",
      "Bytes each device sends per step, from `acp_jax.comm_bytes` and from"
      " the compiled HLO of the compressor's update under `shard_map` (lowered"
      " on abstract shapes, so the large models need no memory). Op counts"
      " are taken with XLA:CPU's all-reduce combiner off, so they show what"
      " each method issues: one collective per bucket (of 25 MiB of"
      " gradient, see `acp_jax.collectives`), dtype and round, Power-SGD's"
      " buckets merged into one on a CPU. *Rounds* is the longest chain of"
      " collectives that wait on each other (`acp_jax.collective_rounds`):"
      " what a step cannot overlap with its own backprop. ACP-SGD needs one,"
      " like S-SGD; Power-SGD needs two.",
      "",
      "![bytes per step](comm_bytes.png)",
      "",
  ]
  for model in plots.model_names(rows):
    model_rows = [r for r in rows if r["model"] == model]
    first = model_rows[0]
    lines += [
        f"**{model}**: {first['params']:,} parameters in {first['leaves']}"
        f" leaves; {first['compressed_matrices']} matrices compressed at"
        f" rank {first['rank']} ({first['dense_bytes']:,} bytes of leaves"
        f" sent dense); Top-k density {first['density']};"
        f" {first['num_devices']} devices.",
        "",
        records.table(model_rows, _PER_MODEL_COLUMNS),
        "",
    ]
  lines += [
      "ACP-SGD against the target (half of Power-SGD plus the dense leaves,"
      " which both send whole):",
      "",
      records.table(
          acp,
          {
              "model": "model",
              "bytes_per_step": "ACP-SGD bytes/step",
              "target_bytes": "0.5 x Power + dense",
              "vs_power_sgd": "ACP / Power",
              "meets_target": "met",
          },
      ),
      "",
  ]
  return lines


def _overlap_section(out: pathlib.Path) -> list[str]:
  """The structure of each paper model's train step: how much backprop its
  collectives could hide behind, in one bucket and in the default buckets."""
  rows = records.read("overlap", out)
  if not rows:
    return [
        "_The overlap with backprop has not been measured: `python -m"
        " benchmarks comm`._",
        "",
    ]
  percent = lambda x: f"{x:.1%}"
  shown = [
      {
          **r,
          "compressor": plots.LABELS[r["compressor"]],
          "phase": r["phase"].upper() if r["phase"] != "step" else "",
          **{
              f"{share}_{layout}": percent(r[f"{share}_{layout}"])
              for share in ("independent", "upstream")
              for layout in comm.LAYOUTS
          },
      }
      for r in rows
  ]
  devices = sorted({r["num_devices"] for r in rows})
  seconds = sum(r["compile_s"] for r in rows)
  return [
      "### Overlap with backprop",
      "",
      _provenance(rows),
      "",
      "Each model's whole train step (`train/train.py`: forward, backward,"
      " compressor, the config's optimizer and the step's metrics) compiled"
      f" for {', '.join(map(str, devices))} simulated devices on abstract"
      " state and batch, with XLA:CPU's all-reduce combiner off, in every"
      " phase, twice: *before*, every leaf in one bucket (one packed buffer"
      " per round, which waits for every gradient); *after*, the default"
      " buckets of 25 MiB of uncompressed gradient, cut in the reverse of"
      " the params' leaf order as a proxy for the order in which backprop"
      " produces them. For each collective, `acp_jax.overlap_potential`"
      " splits the step's compute (each instruction weighed by its output"
      " bytes) into what the collective waits for, what waits for it, and"
      " the rest: *independent* is that rest, *upstream* the part of it that"
      " feeds some collective (forward, backward, compression), the backprop"
      " it could hide behind; the rest of *independent* comes after the"
      " exchanges (another leaf's optimizer update, a residual that needs"
      " only local values). Both are means over the step's collectives"
      " weighted by their bytes. A bucket sends one collective per dtype"
      " (Sign-SGD and Top-k two: bits or indices beside floats), and every"
      " step adds one small all-reduce of its metrics. Power-SGD sends one"
      " bucket on a CPU backend (`collectives.for_dependent_rounds`): a"
      " bucket's Q round needs its P round, and XLA:CPU's all-reduce"
      " combiner, on by default, would merge one bucket's Q with the next"
      " one's P into a chain of rounds. Its two layouts are one program"
      " here; on other backends it takes the default buckets. Lowering and"
      f" compiling both layouts took {seconds:.0f} s in all.",
      "",
      records.table(shown, comm.OVERLAP_COLUMNS),
      "",
      "What this cannot show. It is the program's dependency structure, not"
      " a schedule nor a timing: XLA:CPU runs a collective after the"
      " computation before it and overlaps nothing at run time, and how"
      " much of the potential a GPU uses is up to its scheduler (`python -m"
      " benchmarks gpu` reads XLA:GPU's schedule). Output bytes stand in for"
      " time: a convolution's or a matmul's cost is not proportional to its"
      " output. And the leaf order is only a proxy for backward order:"
      " dicts sort their keys, and a leaf whose gradient backprop completes"
      " last but that sorts late is sent first, in a bucket that then waits"
      " for all of backprop. ResNet's `stem_layer` sorts after `blocks` and"
      " `fc` and joins the last block in the first bucket; BERT's word"
      " embedding, tied to the output layer and complete only once its input"
      " lookup is differentiated, last, fills the first bucket alone, and"
      " the position and token-type embeddings join the output head and the"
      " last layer in the second.",
      "",
  ]


def _overhead_section(rows, out: pathlib.Path) -> list[str]:
  plots.bars(
      rows,
      "update_ms",
      "update time, ms (median)",
      "Compressor update on one device (no communication)",
      out / "overhead.png",
  )

  return [
      "## 2. Compression overhead",
      "",
      _provenance(rows),
      "",
      "Wall time of each compressor's update on the model's gradient shapes"
      " (random normal gradients), on one device so that no collective"
      " moves data: jitted, warmed up, the compressors timed in turns, the"
      " state donated and carried from call to call as in a train step;"
      " the median of the repeats. S-SGD's update only divides by the"
      " device count, so *added over S-SGD* is the compressor's own"
      " arithmetic. ACP-SGD's P-steps and Q-steps are timed separately"
      " and averaged. BERT-Large is left out by default: its five states"
      " and Top-k's sort space need more than 24 GB (`--models bert_large`"
      " adds it).",
      "",
      "*torch_power_sgd* is PyTorch's `powerSGD_hook` (`torch_hook.py`),"
      " timed in the same turns: one process, one bucket holding every"
      " gradient in PyTorch's layouts, the model's Power-SGD rank and"
      " minimum compression rate, error feedback and warm start on, past"
      " its dense start. Its all-reduces run in a gloo group of one process"
      " and move nothing, so its time is its compression and decompression."
      " The *threads* column gives each side's settings: acp_jax runs on"
      " XLA:CPU's pool (one thread per core) with its LAPACK calls (QR,"
      " Cholesky, on SciPy's OpenBLAS) on one thread"
      " (`acp_jax.limit_lapack_threads`); PyTorch runs once with as many"
      " threads as XLA:CPU uses and once on one"
      " (*torch_power_sgd_1_thread*), its LAPACK (MKL's) following"
      " `torch.set_num_threads` with its products. *x PyTorch Power-SGD* is"
      " our update's time over the faster of the two. *psum_per_leaf* is a"
      " plain `lax.psum` of each leaf, S-SGD's exchange without buckets;"
      " *x psum per leaf* is S-SGD's time over it.",
      "",
      "![update time](overhead.png)",
      "",
      records.table(rows, overhead.COLUMNS),
      "",
      "Where the time goes. On a CPU the low-rank updates are bound by"
      " passes over each n x m matrix, which the compiled step makes as"
      " few as it can (`acp_jax.hlo.buffer_passes`, asserted in"
      " `tests/test_lowrank_arithmetic.py`): the projection reads the"
      " gradient G and the residual E (M = G + E is never formed), one"
      " fusion reads them again and writes E' = G + E - P B^T in place of"
      " E (the rank-r product spelled as r rank-one terms, so no n x m"
      " temporary), and the update is written: 6 passes for each ACP-SGD"
      " step on a 3072 x 768 matrix at rank 32, where there were 12, and 8"
      " for Power-SGD's two projections, where there were 12. The"
      " orthogonalization is Householder QR on one LAPACK thread, or"
      " Cholesky-QR2 with a Householder fallback for tall factors at rank"
      " 32, and the transposed projection B^T M takes XLA:CPU's fast dot"
      " path. ACP-SGD makes one projection a step where Power-SGD makes"
      " two, and orthogonalizes one factor where Power-SGD orthogonalizes"
      " two.",
      "",
  ]


def _convergence_section(finals, curves, out: pathlib.Path) -> list[str]:
  plots.convergence(curves, out / "convergence.png")
  rows = convergence.summarize(finals, curves)
  first = finals[0]
  char_lm = dict(convergence.TASKS["char_lm"][1])
  warmup = max(r["warmup_steps"] for r in finals)
  stalls = [
      {
          "variant": variant,
          **{
              f"K + {step - warmup}": loss
              for step, loss in convergence.stall(curves, variant, warmup).items()
          },
      }
      for variant in ("acp_sgd_warm", "acp_sgd_warm_cold", "acp_sgd")
      if any(c["variant"] == variant for c in curves)
  ]
  lines = [
      "## 3. Convergence",
      "",
      _provenance(finals),
      "",
      "The real train loop (`python -m train`) on"
      f" {first['num_devices']} simulated devices: MNIST's 10,000-image"
      " test set split 8,000 / 2,000 on the small CNN (`configs/mnist.py`),"
      " and tiny-shakespeare on the character LM (`configs/tinyshakespeare.py`"
      f" at batch {char_lm['batch_size']} x {char_lm['data.seq_len']}"
      " characters, half the config's batch and sequence length, to fit 2"
      " cores; held-out: the file's last 10 %), each for"
      f" {first['steps']} steps. Every variant runs with the same schedule"
      " and budget; a seed changes the initialization and the data order."
      " Variants: each compressor at the config's rank r (`power_sgd`,"
      " `acp_sgd`); ACP-SGD at equal bytes, rank 2r, which sends per step"
      " what Power-SGD sends at rank r (`acp_sgd_2r`); and each of these"
      f" after {warmup} dense S-SGD steps with the factors warmed on the"
      " mean gradient (`_warm`), or not warmed (`_warm_cold`). Held-out"
      " accuracy and loss at the end, as the mean and standard deviation"
      " over seeds; bytes sent include the warm-up's dense steps. Curves"
      " (means over seeds) against steps and against the bytes each device"
      " sent.",
      "",
      "![convergence](convergence.png)",
      "",
      records.table(rows, convergence.COLUMNS),
      "",
      f"The switch out of the warm-up (K = {warmup}): the char LM's training"
      " loss (mean over seeds, at the logged steps nearest) at the switch"
      " and 50 and 100 steps later, with and without warmed factors, and"
      " ACP-SGD without warm-up at the same steps.",
      "",
      records.table(stalls, {k: k for k in stalls[0]}) if stalls else "",
      "",
      "The char LM's held-out loss against S-SGD's (%, means over seeds)"
      " at each evaluation: a gap that still closes at the end is one the"
      " step budget leaves open.",
      "",
      _gap_table(curves),
      "",
      *_convergence_reading(rows, curves, warmup),
      "Wall time of the whole benchmark:"
      f" {sum(r['wall_seconds'] for r in finals) / 60:.0f} minutes of"
      f" training over {len(finals)} runs.",
      "",
  ]
  return lines


def _convergence_reading(rows, curves, warmup: int) -> list[str]:
  """What the char LM's runs say about the warm-up, in their own numbers."""
  by = {r["variant"]: r for r in rows if r["task"] == "char_lm"}
  needed = ("acp_sgd_2r_warm", "power_sgd_warm", "acp_sgd_2r", "power_sgd",
            "acp_sgd_warm", "acp_sgd_warm_cold")
  if not all(v in by for v in needed):
    return []
  gap = lambda v: by[v]["loss_vs_ssgd_pct"]
  warm = convergence.stall(curves, "acp_sgd_warm", warmup)
  cold = convergence.stall(curves, "acp_sgd_warm_cold", warmup)
  after = warmup + 50
  return [
      "Reading it. At equal bytes on the char LM, ACP-SGD at rank 2r ends"
      f" {gap('acp_sgd_2r_warm'):+.1f} % from S-SGD with warm-up and"
      f" {gap('acp_sgd_2r'):+.1f} % without; Power-SGD at rank r"
      f" {gap('power_sgd_warm'):+.1f} % and {gap('power_sgd'):+.1f} %. In the"
      " gap table the warm-up variants match S-SGD until the switch, and"
      " from there every low-rank variant's gap widens with the steps that"
      " follow: what it loses is lost at every compressed step and not"
      " recovered by error feedback within this budget, not a start-up"
      " cost that a warm-up removes. Warming the factors changes the"
      f" training loss {after - warmup} steps after the switch by"
      f" {warm[after] - cold[after]:+.3f} and the final held-out loss by"
      f" {by['acp_sgd_warm']['eval_loss'] - by['acp_sgd_warm_cold']['eval_loss']:+.3f}.",
      "",
  ]


def _gap_table(curves) -> str:
  variants = tuple(
      v
      for v in ("power_sgd", "acp_sgd", "acp_sgd_2r", "power_sgd_warm",
                "acp_sgd_warm", "acp_sgd_2r_warm")
      if any(c["variant"] == v and c["task"] == "char_lm" for c in curves)
  )
  rows = convergence.gaps(curves, "char_lm", variants)
  if not rows:
    return ""
  columns = {k: k for row in rows for k in row}
  return records.table(rows, columns)


def _workload_text(model: dict[str, Any]) -> str:
  size = model["size"]
  text = (
      f"The workload is BERT (`configs/bert_base.py`: masked LM, AdamW) with"
      f" {size['num_layers']} layers of hidden {size['hidden']}, FFN"
      f" {size['ffn']} and {size['heads']} heads, a"
      f" {model['vocab_size']:,}-token vocabulary and {model['batch_size']}"
      f" sequences of {model['seq_len']} tokens per worker, compressed at"
      f" rank {model['rank']}."
  )
  base = models.BERT_SIZES["base"]
  if all(size[k] == base[k] for k in ("hidden", "heads", "ffn")):
    text += (
        f" Its matrices are BERT-Base's, so each compresses as in the"
        f" paper's BERT-Base; {size['num_layers']} of its 12 layers and"
        " short sequences keep the compute within 2 cores, so that the"
        " link sets S-SGD's step at 1 Gb/s, as on the paper's GPUs."
    )
  return text


def _step_parts(r: dict[str, Any]) -> dict[str, Any]:
  """A JAX cluster record's step taken apart, in milliseconds."""
  ms = {k: 1e3 * r[k] for k in r if k.endswith("_s")}
  return {
      "workers": r["workers"],
      "bandwidth": r["bandwidth"],
      "compressor": r["compressor"],
      "step": ms["step_s"],
      "compute": ms["step_local_s"],
      "forward_backward": ms["forward_backward_s"],
      "compression": ms["compress_local_s"],
      "collectives": ms["compress_s"] - ms["compress_local_s"],
      "optimizer": ms["optimizer_s"],
      "dispatch": ms["dispatch_s"],
      "comm": ms["predicted_step_s"] - ms["step_local_s"],
      "comm_busy": ms["predicted_busy_step_s"] - ms["step_local_s"],
      "error_pct": r["error_pct"],
  }


def _cluster_reading(mine) -> str:
  """Where ACP-SGD's step goes on the slowest link, computed."""
  text = []
  for r in mine:
    if r["compressor"] != "acp_sgd" or r["bandwidth"] != targets.SLOW_LINK:
      continue
    parts = _step_parts(r)
    step = parts["step"]
    text.append(
        f"At {r['workers']} workers and 1 Gb/s, ACP-SGD's step takes"
        f" {step:.0f} ms against {parts['compute']:.0f} ms compute-only"
        f" (+{100 * (step / parts['compute'] - 1):.1f}%). Taken apart:"
        f" forward and backward {parts['forward_backward']:.0f} ms, the"
        f" compressor's arithmetic {parts['compression']:.0f} ms, its"
        f" collectives {parts['collectives']:.0f} ms, the optimizer"
        f" {parts['optimizer']:.0f} ms, the host's dispatch"
        f" {parts['dispatch']:.1f} ms; the model gives the collectives"
        f" {parts['comm']:.0f} ms."
    )
  return " ".join(text)


def _model_reading(mine) -> str:
  """How the model and its busy-link variant fare, computed."""
  def within(key):
    errors = [abs(r[key] / r["step_s"] - 1) for r in mine]
    hits = sum(e <= targets.MODEL_ERROR for e in errors)
    return (
        f"{hits} of the {len(errors)} measured steps within"
        f" {targets.MODEL_ERROR:.0%}"
        + (f" (largest error {max(errors):.0%})" if errors else "")
    )

  return (
      f" With the compute-only step taken in lockstep, the model puts"
      f" {within('predicted_step_s')}. Pricing the"
      " collectives on a *busy* link instead (calibrated with each"
      " all-reduce right after every worker's pass over memory, the"
      " hypothesis that on oversubscribed cores a ring's every hop waits"
      " for its receiver to be scheduled) puts"
      f" {within('predicted_busy_step_s')}: it charges that latency to"
      " every collective, where a step would pay it at most once per"
      " dependent round."
  )


def _cluster_section(rows, calibration, out: pathlib.Path) -> list[str]:
  plots.cluster(rows, out / "cluster.png")
  model = workloads.CLUSTER_MODELS[rows[0]["model"]]
  mine = [r for r in rows if r["system"] == "acp_jax"]
  groups = targets.by_workers(rows)
  links_rows = {}
  for r in calibration:
    links_rows[r["workers"], r["bandwidth"]] = {
        "workers": r["workers"],
        "bandwidth": r["bandwidth"],
        "alpha_us": r["alpha_s"] * 1e6,
        "mb_per_s": 1 / r["beta_s_per_byte"] / 1e6,
        "busy_alpha_us": r["busy_alpha_s"] * 1e6,
        "busy_mb_per_s": 1 / r["busy_beta_s_per_byte"] / 1e6,
    }
  lines = [
      "## 4. A cluster on shaped links",
      "",
      _provenance(rows),
      "",
      f"{' and '.join(str(w) for w in groups)} worker processes on this"
      " machine's 2 cores (2 workers: one per core, the control; 4: two per"
      " core), each in its own network namespace with one veth link to a"
      " bridge (the switch), every link limited in both directions by `tc"
      " tbf` (`benchmarks/links.py`). A bandwidth is per link and full"
      " duplex, as a host's port on a switch. Each JAX worker runs the"
      " workload's data-parallel step on one CPU device (`DataParallel`,"
      " the way a user's own loop runs it) and joins the others through"
      " `jax.distributed`, collectives over gloo; the PyTorch peer runs the"
      " same model shapes, batch and optimizer with DDP over gloo (plain,"
      " and with `powerSGD_hook` at the same rank) in the same namespaces."
      " Examples/s is the median step's, after warm-up, every step started"
      " by a barrier. *Compute only* is the same fused step on each"
      " worker's own device, taken in the same run and in lockstep, so"
      " that the cores are shared as in the cluster step.",
      "",
      _workload_text(model),
      "",
      "The model (`benchmarks/costmodel.py`, `cluster.predict`): the"
      " compute-only step plus the step's compiled collectives, alpha-beta"
      " per ring all-reduce and all-gather on the link as the psum"
      " microbenchmark calibrated it (all-reduces of 4 KiB to 16 MiB on"
      " idle workers, least squares on 2(p-1) alpha + 2(p-1)/p B beta)."
      " Nothing in it is fitted to the steps it predicts. Its compute term"
      " is the one that changed: a compute-only step taken from lone"
      " processes running free is not the cluster's compute when workers"
      " outnumber cores, so the compute-only step is now the same fused"
      " step on each worker's own device, in lockstep with the others, in"
      " the same run." + _model_reading(mine),
      "",
      "![cluster](cluster.png)",
      "",
  ]
  for workers, group in groups.items():
    lines += [
        f"### {workers} workers",
        "",
        records.table(group, cluster.COLUMNS),
        "",
        "Speedups of ACP-SGD, per link:",
        "",
        records.table(
            [
                {
                    "bandwidth": b,
                    **{
                        label: targets.ratio(
                            group, ("acp_jax", "acp_sgd"), (system, name), b
                        )
                        for label, system, name, _ in targets.CLUSTER_SPEEDUPS
                    },
                    "PyTorch DDP": targets.ratio(
                        group, ("acp_jax", "acp_sgd"), ("torch", "ssgd"), b
                    ),
                }
                for b in dict.fromkeys(r["bandwidth"] for r in group)
            ],
            {
                "bandwidth": "link",
                **{
                    label: f"x {label}"
                    for label, *_ in targets.CLUSTER_SPEEDUPS
                },
                "PyTorch DDP": "x PyTorch DDP",
            },
        ),
        "",
    ]
  lines += [
      "### Where the step goes",
      "",
      "Each JAX step taken apart, in milliseconds, the slowest worker's"
      " median. *step* is the fused step; *compute* the same step on each"
      " worker's device alone. The parts run as separate programs, each"
      " after a barrier: *forward+backward*, the compressor's"
      " *arithmetic* (the same compressor on a one-device mesh, its"
      " collectives moving nothing), its *collectives* (the compressor on"
      " the cluster less its arithmetic), the *optimizer* (AdamW and the"
      " update), and the host's *dispatch* of the fused step (its call's"
      " return, before the host waits). Separately compiled, the parts need"
      " not add up to the fused step. *model comm* is the model's"
      " communication and the error the model's step against the measured"
      " one; *busy link* prices the same collectives on the link"
      " calibrated with every all-reduce right after a pass over"
      f" {cluster.BUSY_MB} MB on every worker, as a step's follow its"
      " compute.",
      "",
      records.table(
          [_step_parts(r) for r in mine],
          {
              "workers": "workers",
              "bandwidth": "link",
              "compressor": "compressor",
              "step": "step",
              "compute": "compute only",
              "forward_backward": "forward+backward",
              "compression": "arithmetic",
              "collectives": "collectives",
              "optimizer": "optimizer",
              "dispatch": "dispatch",
              "comm": "model comm",
              "error_pct": "model error, %",
              "comm_busy": "model comm, busy link",
          },
      ),
      "",
      _cluster_reading(mine),
      "",
      "The links as the psum microbenchmark saw them:",
      "",
      records.table(
          list(links_rows.values()),
          {
              "workers": "workers",
              "bandwidth": "link",
              "alpha_us": "alpha idle, us",
              "mb_per_s": "1/beta idle, MB/s",
              "busy_alpha_us": "alpha busy, us",
              "busy_mb_per_s": "1/beta busy, MB/s",
          },
      ),
      "",
  ]
  return lines


def _projection_section(rows, out: pathlib.Path):
  projected = [r for r in rows if r["kind"] == "projection"]
  if not projected:
    return []
  plots.projection(projected, out / "projection.png")
  inputs = {}
  for r in projected:
    inputs.setdefault(
        r["model"],
        {
            "model": r["model"],
            "batch_per_worker": r["batch_per_worker"],
            "forward_backward_s": r["forward_backward_s"],
        },
    )[f"update_ms_{r['compressor']}"] = (
        r["update_s"] * 1e3
    )
  averages = project.averages(projected)
  alpha = projected[0]["alpha_s"]
  return [
      "## 5. Projection to the paper's clusters",
      "",
      _provenance(projected),
      "",
      "The cost model (`benchmarks/costmodel.py`) with the inputs measured"
      " here: each model's forward+backward time at the paper's per-GPU"
      " batch (the train step timed at two small batches on one CPU device"
      " and extrapolated linearly, on this CPU) and"
      " each compressor's update time on one device; the bytes of"
      " `acp_jax.comm_bytes` at each cluster size; links of 1, 10 and"
      f" 100 Gb/s with the latency calibrated here ({alpha * 1e6:.0f} us"
      " per message, the unshaped link's). Each method's all-reduces are"
      " fused into its rounds (one, Power-SGD two), and S-SGD and ACP-SGD"
      " hide communication behind backward (two thirds of forward +"
      " backward), as a pipelining runtime does.",
      "",
      "This CPU computes about two orders of magnitude slower than the"
      " paper's GPUs, and at its speed compute dominates every step, so"
      " the projection is also shown with all compute 10 and 100 times"
      " faster (*compute x10*, *x100*): a sensitivity of the model, not a"
      " measurement of any accelerator.",
      "",
      "![projection](projection.png)",
      "",
      records.table(
          list(inputs.values()),
          {
              "model": "model",
              "batch_per_worker": "batch/worker",
              "forward_backward_s": "fwd+bwd, s",
              **{
                  f"update_ms_{c}": f"{plots.LABELS[c]} update, ms"
                  for c in workloads.COMPRESSORS
              },
          },
      ),
      "",
      "ACP-SGD's average speedups over every model, cluster size and link:",
      "",
      records.table(
          averages,
          {
              "compute_source": "compute on",
              "compute_scale": "compute x",
              "acp_vs_ssgd": "x S-SGD",
              "paper_acp_vs_ssgd": "paper",
              "acp_vs_power_sgd": "x Power-SGD",
              "paper_acp_vs_power_sgd": "paper",
          },
      ),
      "",
  ]


def _hierarchical_section(rows) -> list[str]:
  first = rows[0]
  table = [
      {
          **r,
          "method": f"{plots.LABELS[r['compressor']]}, {r['mode']}",
      }
      for r in rows
  ]
  return [
      "## 6. Hierarchical compression across nodes",
      "",
      _provenance(rows),
      "",
      f"{first['nodes']} worker processes, each a node of"
      f" {first['devices_per_node']} CPU devices in its own network"
      " namespace, on the switched links of section 4, training"
      f" {first['model']}. *Hierarchical*: a mesh of nodes x devices per"
      " node; the gradients are averaged densely within a node, then the"
      " compressor runs across nodes, each device of a node sending its"
      " chunk of every buffer and the chunks gathered back within the node"
      " (`acp_jax.collectives.split_over`). *Flat*: one axis over all"
      " devices, whose rings cross the links. *Slow link* is what each"
      " node's interface sent per step, counted by the kernel (gloo's"
      " framing included); the axes' columns are each device's bytes per"
      " step by `DataParallel.comm_bytes` (the local axis stays inside a"
      " process and crosses no link).",
      "",
      records.table(
          table,
          {
              "bandwidth": "link",
              "method": "method",
              "examples_per_sec": "examples/s",
              "slow_link_bytes_per_step": "bytes/step on the slow link",
              "node_axis_bytes_per_device": "node axis, per device",
              "local_axis_bytes_per_device": "local axis, per device",
              "params_identical": "same params",
          },
      ),
      "",
  ]


def _pipeline_section(rows) -> list[str]:
  from benchmarks import pipeline

  return [
      "## Input pipeline",
      "",
      f"ImageNet-style batches of {rows[0]['global_batch']}"
      f" {rows[0]['image_size']}-pixel crops (decode, random-resized crop,"
      " flip, normalize) of small JPEGs, made by the grain pipeline with 0-2"
      " worker processes, beside the rate at which the train step consumes"
      " them. The pipeline keeps up where its images/s exceed the step's.",
      "",
      _provenance(rows),
      "",
      records.table(rows, pipeline.COLUMNS),
      "",
  ]


def write(results_dir: os.PathLike) -> str:
  """Writes ``REPORT.md`` and its plots into ``results_dir``; returns a line
  saying where."""
  out = pathlib.Path(results_dir)
  found = {
      name: records.read(name, out)
      for name in (
          "comm",
          "overhead",
          "convergence",
          "convergence_curves",
          "cluster",
          "cluster_links",
          "projection",
          "cluster_hierarchical",
          "pipeline",
      )
  }
  if not any(found[k] for k in ("comm", "overhead", "convergence", "cluster")):
    raise SystemExit(
        f"no results in {out}: run python -m benchmarks comm, overhead and"
        " convergence first"
    )
  sections = {
      "comm": lambda rows: _comm_section(rows, out) + _overlap_section(out),
      "overhead": lambda rows: _overhead_section(rows, out),
      "convergence": lambda rows: _convergence_section(
          rows, found["convergence_curves"], out
      ),
      "cluster": lambda rows: _cluster_section(
          rows, found["cluster_links"], out
      ),
      "projection": lambda rows: _projection_section(rows, out),
      "cluster_hierarchical": _hierarchical_section,
      "pipeline": _pipeline_section,
  }
  body = []
  for name, section in sections.items():
    if found[name]:
      body += section(found[name])
    else:
      command = {
          "projection": "project",
          "cluster_hierarchical": "cluster --hierarchical",
      }.get(name, name)
      body += [
          f"_`{command}` has not been run: `python -m benchmarks {command}`._",
          "",
      ]
  quick = any(r.get("quick") for name in sections for r in found[name])
  head = [
      "# acp_jax benchmark report",
      "",
      "Written by `python -m benchmarks report` from the JSON files beside"
      " it. To reproduce (about two hours on 2 cores; `cluster` needs root):",
      "",
      "```",
      'python -m pip install -e ".[bench,torch]"',
      "python -m benchmarks comm && python -m benchmarks overhead \\",
      "  && python -m benchmarks convergence && python -m benchmarks cluster \\",
      "  && python -m benchmarks project \\",
      "  && python -m benchmarks cluster --hierarchical \\",
      "  && python -m benchmarks pipeline && python -m benchmarks report",
      "```",
      "",
  ]
  if quick:
    head += [
        "**Some sections come from `--quick` runs: small models and short"
        " budgets, a smoke test, not a measurement.**",
        "",
    ]
  head += [
      "## Targets",
      "",
      records.table(
          [
              {"target": t, "measured": m, "met": ok}
              for t, m, ok in targets.check(found)
          ],
          {"target": "target", "measured": "measured", "met": "met"},
      ),
      "",
  ]
  path = out / "REPORT.md"
  path.write_text("\n".join(head + body))
  return f"wrote {path}"
