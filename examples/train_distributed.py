"""Train a small MXFP4 transformer on several processes: FSDP2 with the MXFP4 all-gather,
a distributed checkpoint every N steps, and resuming after a kill.

Run it with torchrun, one process per GPU (nccl) or several on the CPU (gloo):

    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py --out out/dist
    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py --out out/killed --kill-at 15
    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py --out out/killed --resume

(the first trains to the end; the second is killed in step 15, after the checkpoint of
step 10; the third continues from that checkpoint, and its loss.jsonl then equals the
first run's byte for byte.)

The model: a pre-RMSNorm GPT (token and position embeddings, attention and GELU MLP
blocks, an fp32 head) whose block linears are ``pmx.nn.convert``-ed to MXLinear;
``pmx.nn.enable_fsdp_mx_all_gather`` then ``fully_shard`` on each block and the root.
The task: sequences counting from a random start by a random stride (next-token cross
entropy);
the batch of step s is drawn from a generator seeded by s, so any run that reaches step
s sees the same data. Every ``--ckpt-every`` steps the model and optimizer are saved
with ``torch.distributed.checkpoint`` (``get_state_dict``) into ``OUT/step_<n>``
(written under a temporary name and renamed once every rank has finished, so a kill
mid-save leaves the previous checkpoint intact). ``--resume`` continues from the latest
one, on any number of processes; ``--kill-at S`` SIGKILLs every rank in the middle of
step S (after the backward, before the optimizer step), as a preempted job would die.
Rank 0 appends each step's loss (averaged over the ranks) to ``OUT/loss.jsonl``, once per
step (a resumed run drops the lines of the steps after its checkpoint, which it runs
again): a run resumed after a kill continues the uninterrupted run's loss curve exactly.
A run without ``--resume`` refuses an ``--out`` that holds checkpoints already (their
runs would mix), and ``--resume`` refuses an ``--out`` that holds none.

Each step's line also gives the bytes of the MXFP4 layers' weights this rank passed to
FSDP2's all-gathers in that step (``pmx.nn.gathered_bytes``): those weights only, not
the other parameters (embeddings, norms, biases, the head), which FSDP2 gathers too; 0
on one process (FSDP2 gathers nothing there), and not counted under ``--no-mx-gather``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import portable_mx as pmx


HEADS = 4
"""Attention heads of each block (``--d-model`` must be a multiple)."""


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def batch(step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """The global batch of ``step``: ``rows`` sequences counting modulo ``vocab`` from a
    random start by a random stride of 1 to 3 (predictable from the second token on)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 4, (rows, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % vocab


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    steps = [(int(p.name.removeprefix("step_")), p) for p in out.glob("step_*")
             if p.is_dir() and p.name.removeprefix("step_").isdigit()]
    return max(steps) if steps else None


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", type=Path, required=True, help="checkpoints and loss.jsonl")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank in the middle of this step")
    p.add_argument("--recipe", default="{}", help='QuantRecipe fields as JSON, e.g. \'{"macro_block": 64}\'')
    p.add_argument("--no-mx-gather", action="store_true", help="FSDP2's own high-precision all-gather")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over all ranks")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    # every rank checks the same arguments and folder before the process group exists;
    # rank 0 alone says why, so that a bad argument gives one clear error
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def fail(message: str) -> NoReturn:
        if int(os.environ.get("RANK", "0")) == 0:
            p.error(message)
        raise SystemExit(2)

    for name, value, least in (("--steps", args.steps, 1), ("--ckpt-every", args.ckpt_every, 1),
                               ("--batch", args.batch, 1), ("--seq", args.seq, 2), ("--vocab", args.vocab, 2),
                               ("--d-model", args.d_model, 1), ("--layers", args.layers, 1)):
        if value < least:
            fail(f"{name} must be at least {least}, not {value}"
                 + (" (the next-token loss needs 2 tokens a sequence)" if name == "--seq" else ""))
    if args.batch % world:
        fail(f"--batch {args.batch} must be a multiple of the number of processes ({world})")
    if args.d_model % HEADS:
        fail(f"--d-model {args.d_model} must be a multiple of the number of attention heads ({HEADS})")
    if not args.lr > 0:
        fail(f"--lr must be positive, not {args.lr}")
    try:
        fields = json.loads(args.recipe)
        if not isinstance(fields, dict):
            raise ValueError(f"a JSON object of QuantRecipe fields is needed, not {type(fields).__name__}")
        recipe = pmx.QuantRecipe(**fields)
    except (ValueError, TypeError) as e:
        errors = getattr(e, "errors", None)  # pydantic's ValidationError: one line a field
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'recipe'}: {err['msg']}" for err in errors()) \
            if callable(errors) else str(e)
        fail(f"--recipe {args.recipe!r}: {why}")
    if args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} is a file, not a folder")
    found = latest_checkpoint(args.out) if args.out.is_dir() else None
    if args.resume and found is None:
        fail(f"--resume: {args.out} holds no checkpoint (step_<n>) to resume from; "
             "run without --resume to start a new run there")
    if not args.resume and found is not None:
        fail(f"{args.out} holds checkpoints already (the latest {found[1].name}): add --resume to continue "
             "that run, or give another --out (a new run there would mix with the old one)")
    start = found[0] if args.resume else 0
    if args.kill_at is not None and not start <= args.kill_at < args.steps:
        fail(f"--kill-at {args.kill_at} is never reached: this run does steps {start} to {args.steps - 1}"
             if start < args.steps else f"--kill-at {args.kill_at} is never reached: this run has no steps left")

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed.checkpoint as dcp

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert world == dist.get_world_size(), (world, dist.get_world_size())

    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.d_model, heads=HEADS, hidden=4 * args.d_model, layers=args.layers)
    pmx.nn.convert(model, recipe, skip=["head"])
    model.to(device)
    if not args.no_mx_gather:
        pmx.nn.enable_fsdp_mx_all_gather(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    kw = {} if mp is None else {"mp_policy": mp}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        path = found[1]
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {path} (step {start}) on {world} processes", flush=True)
    log = None
    if rank == 0:  # the log holds each step once: a resumed run rewrites the steps after its checkpoint
        path = args.out / "loss.jsonl"
        kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
                if line.strip() and json.loads(line)["step"] < start]
        path.write_text("".join(line + "\n" for line in kept))
        log = open(path, "a")
        if start >= args.steps:
            print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}", flush=True)

    per_rank = args.batch // world
    for step in range(start, args.steps):
        tokens = batch(step, args.batch, args.seq, args.vocab)[rank * per_rank:(rank + 1) * per_rank].to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if step == args.kill_at:
            print(f"rank {rank}: killed in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = (mean / world).item()
        # the MXFP4 layers' weights only (the other parameters are all-gathered too); one
        # process all-gathers nothing; FSDP2's own gather (--no-mx-gather) is not counted
        sent = pmx.nn.gathered_bytes(model)
        if log is not None:
            log.write(json.dumps({"step": step, "loss": mean, "world": world}) + "\n")
            log.flush()
            what = "not counted (--no-mx-gather)" if args.no_mx_gather else \
                f"{sent}" + (" (one process: nothing is all-gathered)" if world == 1 else "")
            print(f"step {step:4d}  loss {mean:.6f}  MXFP4 layer-weight bytes all-gathered by this rank {what}",
                  flush=True)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            final, tmp = args.out / f"step_{step + 1}", args.out / f"step_{step + 1}.tmp"
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
            dist.barrier()
    if log is not None:
        log.close()
    # finished work objects must not outlive the group into interpreter shutdown (gloo's
    # threads can then abort the process); every rank leaves together
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
