"""The curves of compared runs, read from their ``metrics.jsonl``.

``python -m train --compare`` draws them into ``WORKDIR/comparison.png``:
loss and accuracy (train lines, held-out points) against steps and against
the bytes each device sent. Drawing needs matplotlib (the train extra).
"""

import os

from train import metrics as metrics_lib

# (row, metric) pairs: the train metric and its held-out twin share a plot.
ROWS = (("loss", "eval_loss"), ("accuracy", "eval_accuracy"))
COLUMNS = (("step", "step"), ("bytes_sent_total", "bytes sent per device"))
FILENAME = "comparison.png"


def comparison_figure(runs: dict[str, str]):
  """A figure of each run's curves; ``runs`` maps a label to its workdir.

  Rows: loss, accuracy (those the runs logged); columns: against steps,
  against bytes sent. Lines are the train metric, markers the held-out one.
  """
  from matplotlib import figure  # pylint: disable=g-import-not-at-top

  curves = {
      label: metrics_lib.read_curves(workdir) for label, workdir in runs.items()
  }
  rows = [
      row
      for row in ROWS
      if any(k in r for c in curves.values() for r in c for k in row)
  ]
  fig = figure.Figure(figsize=(11, 4 * len(rows)), layout="constrained")
  axes = fig.subplots(len(rows), len(COLUMNS), squeeze=False)
  for i, (train_key, eval_key) in enumerate(rows):
    for j, (x_key, x_label) in enumerate(COLUMNS):
      ax = axes[i][j]
      for n, (label, records) in enumerate(curves.items()):
        color = f"C{n}"
        for key, style in ((train_key, "-"), (eval_key, "o--")):
          points = [(r[x_key], r[key]) for r in records if key in r]
          if points:
            xs, ys = zip(*points)
            name = label if key == train_key else f"{label} (held out)"
            ax.plot(xs, ys, style, color=color, label=name, markersize=4)
      ax.set_xlabel(x_label)
      ax.set_ylabel(train_key)
      ax.grid(alpha=0.3)
      if x_key == "bytes_sent_total":
        ax.set_xscale("log")
  axes[0][0].legend(fontsize="small")
  return fig


def draw_comparison(runs: dict[str, str], workdir: str) -> str | None:
  """``comparison_figure(runs)`` saved in ``workdir``; its path, or None
  (with a line saying why) without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print("matplotlib is not installed: no comparison plot")
    return None
  path = os.path.join(workdir, FILENAME)
  comparison_figure(runs).savefig(path, dpi=100)
  return path
