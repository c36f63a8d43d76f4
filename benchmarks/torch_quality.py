"""One PyTorch DDP worker of ``python -m benchmarks quality``: the char LM of
a convergence task trained with DDP's plain all-reduce (``ssgd``: buckets
all-reduced while backprop runs, the paper's optimized S-SGD) or with its
PowerSGD hook (``power_sgd``), until the held-out loss reaches a target.

Everything but DDP is the trainer's: the config (``convergence.config``),
the initial params (the trainer's flax model for the seed, copied into the
PyTorch one), the batches of each step and the held-out set
(``train.data``), the learning-rate schedule (``train.optimizers``), the
loss. So a round of ``quality`` compares the methods on one draw of the
training, PyTorch's beside acp_jax's. Each worker prints one line,
``RESULT {json}``, in the form of ``benchmarks.worker quality``'s.

  python -m benchmarks.torch_quality --method=power_sgd --task=char_lm \\
      --data_path=input.txt --steps=500 --eval_every=25 --target=2.38 \\
      --master_addr=10.0.0.1 --master_port=29500 --world_size=2 \\
      --process_id=0
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import distributed as dist
from torch import nn
from torch.nn import functional as F

from benchmarks import convergence
from benchmarks import quality
from benchmarks import torch_peer
from train import data as data_lib
from train import digest


class Block(nn.Module):
  """Pre-LN causal decoder block, as ``train.models.CharLMBlock``."""

  def __init__(self, dim, heads):
    super().__init__()
    self.heads = heads
    # flax's LayerNorm epsilon.
    self.attention_norm = nn.LayerNorm(dim, eps=1e-6)
    self.attention = nn.ModuleDict(
        {k: nn.Linear(dim, dim) for k in ("query", "key", "value", "out")}
    )
    self.mlp_norm = nn.LayerNorm(dim, eps=1e-6)
    self.mlp_in = nn.Linear(dim, 4 * dim)
    self.mlp_out = nn.Linear(4 * dim, dim)

  def forward(self, x):
    b, l, d = x.shape
    a = self.attention
    y = self.attention_norm(x)
    q, k, v = (
        a[name](y).view(b, l, self.heads, d // self.heads).transpose(1, 2)
        for name in ("query", "key", "value")
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + a["out"](y.transpose(1, 2).reshape(b, l, d))
    # jax.nn.gelu's default, the tanh approximation.
    y = self.mlp_in(self.mlp_norm(x))
    return x + self.mlp_out(F.gelu(y, approximate="tanh"))


class CharLM(nn.Module):
  """``train.models.CharLM`` without dropout (the tasks train none)."""

  def __init__(self, *, vocab_size, max_len, dim, num_layers, num_heads):
    super().__init__()
    self.token_embed = nn.Embedding(vocab_size, dim)
    self.position_embed = nn.Embedding(max_len, dim)
    self.blocks = nn.ModuleList(
        Block(dim, num_heads) for _ in range(num_layers)
    )
    self.final_norm = nn.LayerNorm(dim, eps=1e-6)
    self.head = nn.Linear(dim, vocab_size)

  def forward(self, tokens):
    positions = torch.arange(tokens.shape[1])
    x = self.token_embed(tokens) + self.position_embed(positions)
    for block in self.blocks:
      x = block(x)
    return self.head(self.final_norm(x))


def torch_name(path: tuple) -> tuple[str, bool]:
  """The PyTorch name of a flax param at ``path``, and whether its array
  is the transpose (a Linear kernel is (in, out), its weight (out, in))."""
  *where, leaf = map(str, path)
  name = {"kernel": "weight", "embedding": "weight", "scale": "weight"}
  return ".".join([*where, name.get(leaf, leaf)]), leaf == "kernel"


def torch_model(cfg, vocab_size: int, params) -> CharLM:
  """The PyTorch char LM of ``cfg.model`` holding ``params``, the flax
  model's (``nnx.to_pure_dict`` of its ``nnx.Param`` state)."""
  import jax

  m = cfg.model
  model = CharLM(
      vocab_size=vocab_size,
      max_len=m.max_len,
      dim=m.dim,
      num_layers=m.num_layers,
      num_heads=m.num_heads,
  )
  own = dict(model.named_parameters())
  done = set()
  for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, transposed = torch_name(tuple(k.key for k in path))
    value = np.asarray(value, np.float32)
    with torch.no_grad():
      own[name].copy_(torch.tensor(value.T if transposed else value))
    done.add(name)
  missing = sorted(set(own) - done)
  if missing:
    raise RuntimeError(f"params the flax model lacks: {missing}")
  return model


def initial_model(cfg) -> tuple[CharLM, object]:
  """The PyTorch model holding the trainer's initial params for ``cfg``
  (made as the trainer makes them, in one jitted call), and the data."""
  import jax
  from flax import nnx

  from train import experiment

  built = experiment.build(cfg)
  params = jax.jit(
      lambda: nnx.to_pure_dict(nnx.state(built.create_model(), nnx.Param))
  )()
  return torch_model(cfg, built.dataset.num_classes, params), built.dataset


def learning_rates(cfg) -> np.ndarray:
  """The trainer's learning rate at each step of ``cfg``."""
  import jax
  import jax.numpy as jnp

  from train import optimizers

  schedule = jax.vmap(optimizers.schedule(cfg))
  return np.asarray(schedule(jnp.arange(cfg.num_train_steps)))


def optimizer(cfg, params) -> torch.optim.Optimizer:
  """``cfg``'s optimizer as ``train.optimizers`` makes it: AdamW with
  decoupled weight decay scaled by the learning rate, or SGD with L2 weight
  decay that momentum carries."""
  args = cfg.optimizer
  if args.name == "adamw":
    a = args.adamw
    return torch.optim.AdamW(
        params, lr=0.0, betas=(a.b1, a.b2), eps=a.eps,
        weight_decay=args.weight_decay,
    )
  s = args.sgd
  return torch.optim.SGD(
      params, lr=0.0, momentum=s.momentum, nesterov=s.nesterov,
      weight_decay=args.weight_decay,
  )


def weighted_sums(logits, batch) -> torch.Tensor:
  """``train.loss.weighted_sums``' loss and weight sums, as a tensor."""
  targets = torch.from_numpy(np.asarray(batch["targets"], np.int64))
  weights = batch.get("weights")
  weights = (
      torch.ones(targets.shape) if weights is None
      else torch.from_numpy(np.asarray(weights, np.float32))
  )
  loss = F.cross_entropy(
      logits.flatten(0, -2), targets.flatten(), reduction="none"
  )
  return torch.stack([(loss * weights.flatten()).sum(), weights.sum()])


def _tokens(batch) -> torch.Tensor:
  return torch.from_numpy(np.asarray(batch["inputs"], np.int64))


def evaluate(model, dataset, global_batch, args) -> float:
  """The held-out loss: each worker's rows of every evaluation batch, the
  sums all-reduced."""
  totals = torch.zeros(2)
  model.eval()
  with torch.no_grad():
    for batch in data_lib.eval_batches(
        dataset.eval,
        global_batch=global_batch,
        process_index=args.process_id,
        process_count=args.world_size,
    ):
      totals += weighted_sums(model(_tokens(batch)), batch)
  model.train()
  dist.all_reduce(totals)
  return float(totals[0] / totals[1])


def bytes_per_step(model, method: str, rank: int) -> tuple[int, int]:
  """What one worker contributes to all-reduces in a dense step and in a
  compressed one: every gradient; or, with the hook, the P and Q of each
  gradient it compresses, viewed as (n, m) = (shape[0], the rest), where
  ``(n + m) * r * 2 < n * m`` (its test at ``min_compression_rate=2``, r at
  most n and m), and every other gradient whole."""
  dense = sum(4 * p.numel() for p in model.parameters())
  if method != "power_sgd":
    return dense, dense
  compressed = 0
  for p in model.parameters():
    n = p.shape[0]
    m = p.numel() // n
    r = min(n, m, rank)
    compressed += 4 * ((n + m) * r if (n + m) * r * 2 < n * m else n * m)
  return dense, compressed


def train(args) -> dict:
  """Trains to ``--target`` or ``--steps``; the ``RESULT`` record."""
  cfg = convergence.config(
      args.task, "ssgd", args.data_path, args.quick, args.seed
  )
  cfg.num_train_steps = args.steps
  model, dataset = initial_model(cfg)
  ddp = torch_peer.ddp(model, args.method, args.rank, args.seed)
  opt = optimizer(cfg, ddp.parameters())
  rates = learning_rates(cfg)
  loader = data_lib.Loader(
      dataset.train,
      global_batch=cfg.batch_size,
      seed=cfg.seed,
      process_index=args.process_id,
      process_count=args.world_size,
  )
  seconds, curve, target_step, eval_loss = [], [], None, math.nan
  for step in range(args.steps):
    start = time.perf_counter()
    batch = loader.batch(step)
    for group in opt.param_groups:
      group["lr"] = float(rates[step])
    opt.zero_grad()
    sums = weighted_sums(ddp(_tokens(batch)), batch)
    (sums[0] / sums[1].clamp(min=1.0)).backward()
    opt.step()
    seconds.append(time.perf_counter() - start)
    done = step + 1
    if done % args.eval_every == 0 or done == args.steps:
      eval_loss = evaluate(model, dataset, cfg.batch_size, args)
      curve.append({
          "step": done, "eval_loss": eval_loss, "train_seconds": sum(seconds)
      })
      if eval_loss <= args.target:
        target_step = done
        break
  dense, compressed = bytes_per_step(model, args.method, args.rank)
  warm = torch_peer.START_POWERSGD_ITER if args.method == "power_sgd" else 0
  steps = len(seconds)
  sent = dense * min(steps, warm) + compressed * max(steps - warm, 0)
  return {
      "global_batch": cfg.batch_size,
      "summary": {
          "step": steps,
          "target_step": target_step,
          "eval_loss": eval_loss,
          "train_seconds": sum(seconds),
          "bytes_per_step": compressed,
          "bytes_sent": sent,
          # As the trainer's: the median step after the first.
          "examples_per_sec": cfg.batch_size / statistics.median(
              seconds[1:] or seconds
          ),
          "num_devices": args.world_size,
      },
      "curve": curve,
      "params_sha256": digest.sha256(
          p.detach().numpy() for p in model.parameters()
      ),
  }


def parse_args(argv=None):
  """The flags, checked before anything starts."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add = parser.add_argument
  add("--method", choices=("ssgd", "power_sgd"), required=True)
  add("--rank", type=int, default=4, help="PowerSGD's rank")
  add("--task", choices=quality.TORCH_TASKS, required=True)
  add("--data_path", required=True)
  add("--seed", type=int, default=0)
  add("--steps", type=int, required=True, help="the cap")
  add("--eval_every", type=int, required=True)
  add("--target", type=float, required=True, help="held-out loss")
  add("--quick", action="store_true")
  add("--master_addr", required=True)
  add("--master_port", type=int, required=True)
  add("--world_size", type=int, required=True)
  add("--process_id", type=int, required=True)
  add("--threads", type=int, default=1, help="torch.set_num_threads")
  a = parser.parse_args(argv)
  for flag in ("rank", "steps", "eval_every", "world_size", "threads"):
    if getattr(a, flag) < 1:
      parser.error(f"--{flag}={getattr(a, flag)} must be >= 1")
  if a.process_id not in range(a.world_size):
    parser.error(
        f"--process_id={a.process_id} must lie in [0, {a.world_size})"
    )
  return a


def main(argv=None):
  args = parse_args(argv)
  torch_peer.join_group(args)
  result = train(args)
  print("RESULT " + json.dumps(result), flush=True)
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
  # As torch_peer's workers: skip the teardown that can abort after DDP.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
