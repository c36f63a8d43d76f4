"""The report's figures, each drawn from the benchmark records into a PNG."""

import re

import matplotlib

matplotlib.use("Agg")  # files only, no display
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

from acp_jax import registry
from benchmarks import workloads

# How the figures name and colour each compressor (acp_jax.registry).
LABELS = {n: registry.get(n).label for n in registry.names()}
COLORS = {n: registry.get(n).color for n in registry.names()}


def link_label(bandwidth: str) -> str:
  """``1gbit`` as ``1 Gb/s``, ``100mbit`` as ``100 Mb/s``; a name of
  another kind (``unshaped``) as it is."""
  match = re.fullmatch(r"(\d+)([gm])bit", bandwidth)
  if not match:
    return bandwidth
  return f"{match[1]} {match[2].upper()}b/s"


def model_names(rows):
  """The models of ``rows``, in order of first appearance."""
  return list(dict.fromkeys(r["model"] for r in rows))


def ran(xs: list[float], cells: list) -> tuple[list[float], list]:
  """The bars' positions and cells where a method ran (its cell is not
  None): one that did not run is left out, not drawn as zero."""
  kept = [(x, c) for x, c in zip(xs, cells) if c is not None]
  return [x for x, _ in kept], [c for _, c in kept]


def bars(rows, value: str, ylabel: str, title: str, path) -> None:
  """Log-scale bars of ``value``, grouped by model, coloured by compressor."""
  models = model_names(rows)
  cell = {(r["model"], r["compressor"]): r[value] for r in rows}
  width = 0.8 / len(workloads.COMPRESSORS)
  fig, ax = plt.subplots(figsize=(8, 4))
  for i, name in enumerate(workloads.COMPRESSORS):
    xs, ys = ran(
        [m + (i - 2) * width for m in range(len(models))],
        [cell.get((model, name)) for model in models],
    )
    ax.bar(xs, ys, width, label=LABELS[name], color=COLORS[name])
  ax.set_xticks(range(len(models)), models, rotation=20)
  ax.set_yscale("log")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def convergence(curves, path) -> None:
  """Held-out metric (mean over seeds) against steps and against bytes
  sent, per task and variant: a variant's colour is its compressor's,
  dashed without warm-up, dotted with unwarmed factors, thick at twice the
  rank."""
  tasks = list(dict.fromkeys(c["task"] for c in curves))
  metric = {"mnist": "eval_accuracy", "mnist_long": "eval_accuracy"}
  fig, axes = plt.subplots(
      len(tasks), 2, figsize=(11, 4 * len(tasks)), squeeze=False
  )
  for row_axes, task in zip(axes, tasks):
    key = metric.get(task, "eval_loss")
    points: dict[str, dict[int, list[dict]]] = {}
    for c in curves:
      if c["task"] == task and c.get(key) is not None:
        points.setdefault(c["variant"], {}).setdefault(c["step"], []).append(c)
    for variant, by_step in points.items():
      first = next(iter(by_step.values()))[0]
      steps = sorted(by_step)
      mean = lambda k: [
          sum(p[k] for p in by_step[s]) / len(by_step[s]) for s in steps
      ]
      style = {
          "color": COLORS[first["compressor"]],
          "linestyle": (
              ":"
              if variant.endswith("_cold")
              else "--"
              if first["rank"] is not None and not first["warmup_steps"]
              else "-"
          ),
          "linewidth": 2.5 if "_2r" in variant else 1.2,
          "marker": ".",
          "label": variant,
      }
      for ax, x in zip(row_axes, ("step", "bytes_sent")):
        ax.plot(mean(x), mean(key), **style)
    for ax, x in zip(row_axes, ("step", "bytes sent per device")):
      ax.set_xlabel(x)
      ax.set_ylabel(f"{task} held-out {key.split('_')[1]}")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    row_axes[1].set_xscale("log")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def quality(points, target: float, path) -> None:
  """Held-out loss against training seconds, a panel per (task, workers,
  link), a line per variant and round (its colour its ``compressor``'s,
  thick where ``thick``, dashed where ``dashed``), and the target as a
  horizontal line."""
  panels = list(
      dict.fromkeys((p["task"], p["workers"], p["bandwidth"]) for p in points)
  )
  fig, axes = plt.subplots(
      1, len(panels), figsize=(5 * len(panels), 4), squeeze=False
  )
  for ax, panel in zip(axes[0], panels):
    lines: dict[tuple, list] = {}
    for p in points:
      if (p["task"], p["workers"], p["bandwidth"]) == panel:
        lines.setdefault((p["variant"], p["round"]), []).append(p)
    for (variant, round_), line in lines.items():
      ax.plot(
          [p["train_seconds"] for p in line],
          [p["eval_loss"] for p in line],
          color=COLORS[line[0]["compressor"]],
          linewidth=2.5 if line[0]["thick"] else 1.2,
          linestyle="--" if line[0].get("dashed") else "-",
          marker=".",
          label=variant if round_ == 1 else None,
      )
    ax.axhline(target, color="gray", linestyle=":", label="target")
    task, workers, bandwidth = panel
    ax.set_title(f"{task}, {workers} workers, {link_label(bandwidth)}")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("held-out loss")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def cluster(rows, path) -> None:
  groups = {}
  for r in rows:
    groups.setdefault(r["workers"], []).append(r)
  fig, axes = plt.subplots(
      1, len(groups), figsize=(7 * len(groups), 4), squeeze=False
  )
  for ax, (workers, group) in zip(axes[0], groups.items()):
    bandwidths = list(dict.fromkeys(r["bandwidth"] for r in group))
    systems = list(dict.fromkeys((r["system"], r["compressor"]) for r in group))
    cell = {(r["bandwidth"], r["system"], r["compressor"]): r for r in group}
    width = 0.8 / len(systems)
    for i, (system, name) in enumerate(systems):
      xs = [
          b + (i - len(systems) / 2 + 0.5) * width
          for b in range(len(bandwidths))
      ]
      xs, found = ran(xs, [cell.get((b, system, name)) for b in bandwidths])
      ys = [r["examples_per_sec"] for r in found]
      # The runs' range, where the record kept one.
      spread = [
          (
              y - r.get("examples_per_sec_min", y),
              r.get("examples_per_sec_max", y) - y,
          )
          for y, r in zip(ys, found)
      ]
      torch = system == "torch"
      ax.bar(
          xs,
          ys,
          width,
          yerr=list(zip(*spread)),
          capsize=2,
          label=("PyTorch DDP " if torch else "") + LABELS[name],
          color=COLORS[name],
          hatch="//" if torch else None,
          edgecolor="white" if torch else None,
      )
    ax.set_xticks(range(len(bandwidths)), map(link_label, bandwidths))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_ylabel("examples/s (all workers)")
    ax.set_title(f"{workers} workers on switched links")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def projection(rows, path) -> None:
  models = model_names(rows)
  scales = sorted({r["compute_scale"] for r in rows})
  fig, axes = plt.subplots(
      2, len(models), figsize=(3.2 * len(models), 6), squeeze=False
  )
  styles = ["-", "--", ":"]
  colors = {"1gbit": "#d55e00", "10gbit": "#0072b2", "100gbit": "#009e73"}
  for j, model in enumerate(models):
    for i, versus in enumerate(("ssgd", "power_sgd")):
      ax = axes[i][j]
      for bandwidth, color in colors.items():
        for scale, style in zip(scales, styles):
          points = sorted(
              (r["workers"], r["acp_speedup"])
              for r in rows
              if r["model"] == model
              and r["compressor"] == versus
              and r["bandwidth"] == bandwidth
              and r["compute_scale"] == scale
          )
          if points:
            ax.plot(
                *zip(*points),
                style,
                color=color,
                marker="o",
                markersize=3,
                label=f"{bandwidth}, compute x{scale}",
            )
      ax.axhline(1, color="grey", linewidth=0.8)
      ax.set_xscale("log", base=2)
      ax.set_title(f"{model}: ACP-SGD / {LABELS[versus]}", fontsize=9)
      ax.set_xlabel("workers")
  axes[0][0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
