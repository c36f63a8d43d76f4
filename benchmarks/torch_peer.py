"""One PyTorch DDP worker: the PyTorch peer of the JAX cluster benchmark.

The orchestrator starts one of these per worker (each possibly in its own
network namespace, with GLOO_SOCKET_IFNAME set), all with the same flags but
--process_id. The workers join a gloo process group over TCP, train a BERT
masked-LM on synthetic tokens with DDP, plain all-reduce ("ssgd") or PyTorch's
PowerSGD communication hook ("power_sgd"), and each prints exactly one line to
stdout: `RESULT {json}` with the step times, the throughput and a digest of
the final parameters (equal on every worker if they stayed in sync).

The model has the parameter shapes of `train.models.Bert` (torch's Linear
weights are flax's kernels transposed), so PowerSGD sees the same matrices.
PowerSGD runs one DDP bucket at a time (see `_powersgd_one_bucket_at_a_time`):
with gloo and several buckets the stock hook mismatches collectives.

  python -m benchmarks.torch_peer --compressor=power_sgd --steps=8 \
      --layers=2 --hidden=768 --heads=12 --ffn=3072 --vocab_size=8192 \
      --seq_len=16 --batch_size=2 --master_addr=10.0.0.1 --master_port=29500 \
      --world_size=2 --process_id=0
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn import functional as F

from train import digest

MASK_RATE = 0.15  # As `synthetic_tokens` with task="masked_lm".
START_POWERSGD_ITER = 2  # The smallest the hook accepts with error feedback.
# Required int flags, all positive; --process_id is required too.
SIZE_FLAGS = (
    "layers hidden heads ffn vocab_size seq_len batch_size master_port"
    " world_size"
).split()


class BertLayer(nn.Module):
  """Post-LN encoder layer, as `train.models.BertLayer`."""

  def __init__(self, hidden, heads, ffn, dropout):
    super().__init__()
    self.heads, self.dropout = heads, dropout
    self.query, self.key, self.value, self.out = (
        nn.Linear(hidden, hidden) for _ in range(4)
    )
    self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
    self.ffn_in = nn.Linear(hidden, ffn)
    self.ffn_out = nn.Linear(ffn, hidden)
    self.ffn_norm = nn.LayerNorm(hidden, eps=1e-12)

  def forward(self, x):
    b, l, d = x.shape
    q, k, v = (
        f(x).view(b, l, self.heads, d // self.heads).transpose(1, 2)
        for f in (self.query, self.key, self.value)
    )
    p = self.dropout if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
    y = self.out(y.transpose(1, 2).reshape(b, l, d))
    x = self.attention_norm(x + F.dropout(y, p, self.training))
    y = self.ffn_out(F.gelu(self.ffn_in(x)))  # Exact (erf) GELU, as BERT.
    return self.ffn_norm(x + F.dropout(y, p, self.training))


class Bert(nn.Module):
  """BERT encoder with the tied masked-LM head, as `train.models.Bert`."""

  def __init__(
      self, *, layers, hidden, heads, ffn, vocab_size, max_len, dropout=0.1
  ):
    super().__init__()
    self.dropout = dropout
    self.word_embed = nn.Embedding(vocab_size, hidden)
    self.position_embed = nn.Embedding(max_len, hidden)
    self.type_embed = nn.Embedding(2, hidden)
    self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
    self.layers = nn.ModuleList(
        BertLayer(hidden, heads, ffn, dropout) for _ in range(layers)
    )
    self.mlm_dense = nn.Linear(hidden, hidden)
    self.mlm_norm = nn.LayerNorm(hidden, eps=1e-12)
    self.mlm_bias = nn.Parameter(torch.zeros(vocab_size))
    for m in self.modules():
      if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
      if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)

  def forward(self, tokens):
    positions = torch.arange(tokens.shape[1])
    x = self.word_embed(tokens) + self.position_embed(positions)
    x = x + self.type_embed.weight[0]  # Token types are all 0.
    x = F.dropout(self.embed_norm(x), self.dropout, self.training)
    for layer in self.layers:
      x = layer(x)
    x = self.mlm_norm(F.gelu(self.mlm_dense(x)))
    return x @ self.word_embed.weight.T + self.mlm_bias


def masked_lm_batch(args, step):
  """Random tokens, round(15%) of each row masked to token 0 in the inputs.

  As `synthetic_tokens` with task="masked_lm" (which masks to 103; for
  throughput the id does not matter), drawn from (seed, process_id, step).
  """
  seed = np.random.SeedSequence([args.seed, args.process_id, step])
  g = torch.Generator().manual_seed(int(seed.generate_state(1, np.uint64)[0]))
  shape = (args.batch_size, args.seq_len)
  targets = torch.randint(0, args.vocab_size, shape, generator=g)
  num_masked = max(1, round(MASK_RATE * args.seq_len))
  masked = torch.zeros(shape, dtype=torch.bool)
  masked.scatter_(
      1, torch.rand(shape, generator=g).argsort(1)[:, :num_masked], True
  )
  return targets.masked_fill(masked, 0), targets, masked


def parse_args(argv=None):
  """The flags, checked before anything starts; SystemExit names a bad one."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add = parser.add_argument
  add("--compressor", choices=("ssgd", "power_sgd"), required=True)
  add("--rank", type=int, default=4, help="PowerSGD approximation rank")
  add("--steps", type=int, required=True, help="steps in all, with warmup")
  add("--warmup", type=int, default=3, help="untimed first steps")
  for flag in SIZE_FLAGS + ["process_id"]:
    add(f"--{flag}", type=int, required=True)
  add("--max_len", type=int, default=512, help="learned positions")
  add("--master_addr", required=True)
  add("--seed", type=int, default=0)
  add("--threads", type=int, default=None, help="torch.set_num_threads")
  a = parser.parse_args(argv)
  positive = SIZE_FLAGS + ["rank", "max_len"]
  min_warmup = START_POWERSGD_ITER if a.compressor == "power_sgd" else 0
  warmup_why = f"must be >= {min_warmup} with --compressor={a.compressor}"
  in_range = f"must be in [0, --world_size={a.world_size})"
  checks = [  # (bad, flag, why); the first bad one is reported.
      *((getattr(a, f) < 1, f, "must be >= 1") for f in positive),
      (a.threads is not None and a.threads < 1, "threads", "must be >= 1"),
      (a.warmup < min_warmup, "warmup", warmup_why),
      (a.steps <= a.warmup, "steps", f"must exceed --warmup={a.warmup}"),
      (a.hidden % max(a.heads, 1), "heads", f"must divide --hidden={a.hidden}"),
      (a.seq_len > a.max_len, "seq_len", f"must be <= --max_len={a.max_len}"),
      (a.process_id not in range(a.world_size), "process_id", in_range),
  ]
  for bad, flag, why in checks:
    if bad:
      raise SystemExit(f"--{flag}={getattr(a, flag)!r} {why}")
  return a


def _powersgd_one_bucket_at_a_time(state, bucket):
  """`powerSGD_hook`, finished before DDP moves on to the next bucket.

  The hook issues the P and Q all-reduces of a bucket from gloo's completion
  threads, so with several buckets the workers can issue collectives in
  different orders, which gloo pairs up wrongly ("Received data size doesn't
  match expected size"). Waiting here keeps one order on every worker, at the
  cost of not overlapping a bucket's communication with the rest of backward.
  """
  fut = powerSGD_hook.powerSGD_hook(state, bucket)
  fut.wait()
  return fut


def join_group(args) -> None:
  """Joins the workers' gloo group (``--master_addr``, ``--master_port``,
  ``--world_size``, ``--process_id``), with ``--threads`` threads."""
  if args.threads is not None:
    torch.set_num_threads(args.threads)
  dist.init_process_group(
      "gloo",
      init_method=f"tcp://{args.master_addr}:{args.master_port}",
      world_size=args.world_size,
      rank=args.process_id,
      timeout=datetime.timedelta(seconds=120),
  )


def main(argv=None):
  args = parse_args(argv)
  join_group(args)
  torch.manual_seed(args.seed)  # Identical initial params on every worker.
  model = Bert(
      layers=args.layers,
      hidden=args.hidden,
      heads=args.heads,
      ffn=args.ffn,
      vocab_size=args.vocab_size,
      max_len=args.max_len,
  )
  torch.manual_seed(args.seed + 1 + args.process_id)  # Per-worker dropout.
  step_seconds = _train(
      args, ddp(model, args.compressor, args.rank, args.seed)
  )
  print("RESULT " + json.dumps(_result(args, model, step_seconds)), flush=True)
  dist.destroy_process_group()


def ddp(
    model: nn.Module, compressor: str, rank: int, seed: int
) -> nn.parallel.DistributedDataParallel:
  """``model`` under DDP, with PowerSGD's hook at ``rank`` for
  ``compressor="power_sgd"``."""
  wrapped = nn.parallel.DistributedDataParallel(model)
  if compressor == "power_sgd":
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=START_POWERSGD_ITER,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    wrapped.register_comm_hook(state, _powersgd_one_bucket_at_a_time)
  return wrapped


def _train(args, ddp) -> list[float]:
  """``--steps`` AdamW steps of ``ddp``; the seconds of each after the
  warm-up."""
  optimizer = torch.optim.AdamW(
      ddp.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01
  )
  ddp.train()
  step_seconds = []
  for step in range(args.steps):
    inputs, targets, masked = masked_lm_batch(args, step)
    start = time.perf_counter()
    optimizer.zero_grad()
    logits = ddp(inputs)
    loss = F.cross_entropy(logits[masked], targets[masked])
    loss.backward()  # Returns once DDP's all-reduces are done.
    optimizer.step()
    if step >= args.warmup:
      step_seconds.append(time.perf_counter() - start)
  return step_seconds


def _result(args, model, step_seconds: list[float]) -> dict:
  """The worker's ``RESULT`` record."""
  return {
      "system": "torch",
      "compressor": args.compressor,
      "rank": args.rank if args.compressor == "power_sgd" else None,
      "workers": args.world_size,
      "process_id": args.process_id,
      "batch_size": args.batch_size,
      "seq_len": args.seq_len,
      "steps": args.steps,
      "warmup": args.warmup,
      "step_seconds": step_seconds,
      "examples_per_sec": (
          args.batch_size * args.world_size / statistics.median(step_seconds)
      ),
      "params": sum(p.numel() for p in model.parameters()),
      # The bytes train.metrics.params_digest hashes of the same params.
      "params_sha256": digest.sha256(
          p.detach().float().numpy() for p in model.parameters()
      ),
  }


if __name__ == "__main__":
  main()
  # With its result printed and its group destroyed, a worker still aborted
  # while the interpreter tore down DDP's and gloo's objects ("terminate
  # called without an active exception"; 2 of 12 runs, a barrier before the
  # destroy included): a process with nothing left to do skips that teardown.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
