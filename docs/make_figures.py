"""Draws the figures of the docs into docs/_static/ (committed).

  python docs/make_figures.py   # needs matplotlib (the [bench] extra)

`acp_sgd_steps.svg`: two steps of Power-SGD and of ACP-SGD (which
computation waits on which all-reduce), beside each method's bytes per step
on ResNet-50 as `python -m benchmarks comm` measured them
(benchmarks/results/comm.json).
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
COMM = os.path.join(HERE, "..", "benchmarks", "results", "comm.json")
OUT = os.path.join(HERE, "_static", "acp_sgd_steps.svg")

COMPUTE, SEND, WAIT = "#9ecae1", "#fdae6b", "#d9d9d9"
# (label, length, colour) per lane, in units of one backprop; each box
# starts where the one before it ends.
BACKPROP = ("backprop", 1.0, COMPUTE)
LANES = {
    "Power-SGD": 2 * [
        BACKPROP,
        ("P = MQ", 0.3, COMPUTE),
        ("all-reduce P", 0.5, SEND),
        ("Q = M^T P", 0.3, COMPUTE),
        ("all-reduce Q", 0.5, SEND),
    ],
    "ACP-SGD": [
        BACKPROP,
        ("P = MQ'", 0.3, COMPUTE),
        ("all-reduce P", 0.5, SEND),
        BACKPROP,
        ("Q = M^T P'", 0.3, COMPUTE),
        ("all-reduce Q", 0.5, SEND),
    ],
}
METHODS = [
    ("ssgd", "S-SGD"),
    ("sign_sgd", "Sign-SGD"),
    ("topk_sgd", "Top-k (1%)"),
    ("power_sgd", "Power-SGD (r=4)"),
    ("acp_sgd", "ACP-SGD (r=4)"),
]


def resnet50_bytes():
  with open(COMM) as f:
    records = [r for r in json.load(f) if r["model"] == "resnet50"]
  by_name = {r["compressor"]: r for r in records}
  return [(label, by_name[name]["bytes_per_step"]) for name, label in METHODS]


def draw_lanes(ax):
  for row, (name, boxes) in enumerate(LANES.items()):
    y = len(LANES) - 1 - row
    start = 0.0
    for label, length, colour in boxes:
      ax.broken_barh([(start, length)], (y - 0.35, 0.7), color=colour,
                     edgecolor="black", linewidth=0.5)
      ax.text(start + length / 2, y, label, ha="center", va="center",
              fontsize=6, rotation=0 if length >= 0.5 else 90)
      start += length
  ax.set_yticks(range(len(LANES)), list(LANES)[::-1])
  ax.set_xlabel(
      "time: two steps of each; every box waits for the one before it"
  )
  ax.set_xticks([])
  ax.set_xlim(0, 5.3)
  ax.set_title(
      "Power-SGD: two dependent rounds a step; ACP-SGD: one", fontsize=9
  )
  for side in ("top", "right"):
    ax.spines[side].set_visible(False)


def draw_bytes(ax):
  labels, values = zip(*resnet50_bytes())
  bars = ax.barh(labels[::-1], [v / 1e6 for v in values[::-1]],
                 color=[SEND] + [WAIT] * 4)
  ax.set_xscale("log")
  ax.set_xlabel("MB per step per device (log)")
  ax.set_title("Bytes per step, ResNet-50, 8 devices, fp32", fontsize=9)
  for bar, value in zip(bars, values[::-1]):
    ax.text(bar.get_width() * 1.1, bar.get_y() + bar.get_height() / 2,
            f"{value / 1e6:.2f}", va="center", fontsize=7)
  ax.set_xlim(0.3, 1000)
  for side in ("top", "right"):
    ax.spines[side].set_visible(False)


def main():
  plt.rcParams["svg.fonttype"] = "none"  # text stays text: a small file
  plt.rcParams["svg.hashsalt"] = "acp_jax"  # the same file on every run
  fig, (lanes, volume) = plt.subplots(
      1, 2, figsize=(10, 2.4), gridspec_kw={"width_ratios": [3, 2]}
  )
  draw_lanes(lanes)
  draw_bytes(volume)
  fig.tight_layout()
  fig.savefig(OUT, metadata={"Date": None})
  print(OUT)


if __name__ == "__main__":
  main()
