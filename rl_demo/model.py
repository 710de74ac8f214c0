"""A small pre-RMSNorm GPT, trained from scratch, with a KV cache for generation.

Block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; the attention and MLP GEMMs are
``nn.Linear`` layers without bias (``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``):
these are what :func:`portable_mx.nn.convert` turns into MXFP4 layers. The token and
position embeddings, the final norm and the ``head`` stay in high precision. Norms are
``torch.nn.RMSNorm`` (what AQN perturbs).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import portable_mx as pmx


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 14
    max_len: int = 16
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig: d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    def to_dict(self) -> dict:
        return asdict(self)


EMBED_STD = 1.0

Cache = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, past: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        # a prefix (past is None) is causal; one new token attends to everything before it
        causal = past is None and t > 1
        if past is not None and t > 1:
            raise ValueError("with a cache, feed one token at a time")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, past=None):
        a, kv = self.attn(self.norm1(x), past)
        x = x + a
        return x + self.mlp(self.norm2(x)), kv


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style scaled residual projections
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / (2 * cfg.n_layers) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=EMBED_STD)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor, cache: Optional[Cache] = None):
        """idx [B, T] and their position ids [T] -> logits [B, T, V]; with ``cache`` (a
        list to fill, or the previous one) also returns the new cache."""
        x = self.tok(idx) + self.pos(positions.to(idx.device))
        new_cache: Cache = []
        for i, blk in enumerate(self.blocks):
            x, kv = blk(x, None if not cache else cache[i])
            new_cache.append(kv)
        logits = self.head(self.norm(x))
        return (logits, new_cache) if cache is not None else logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the GEMM layers that the MXFP4 arms convert (not the head)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "head"]


def numerics_view(model: GPT, recipe: Optional[pmx.QuantRecipe]) -> GPT:
    """A model that computes with ``recipe`` (MXFP4 linears; None: high precision) and
    shares every Parameter of ``model`` (no copy: an optimizer step on one is seen by
    both). Embeddings, norms and the head stay high precision."""
    view = _shallow_tree(model)
    if recipe is not None:
        pmx.nn.convert(view, recipe, skip=["head"])
    return view


def _shallow_tree(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    new._modules = {k: (None if c is None else _shallow_tree(c)) for k, c in module._modules.items()}
    new._parameters = dict(module._parameters)  # the same Parameter objects
    new._buffers = dict(module._buffers)
    return new


def generate(
    model: GPT,
    prompts: torch.Tensor,
    positions: torch.Tensor,
    n_new: int,
    *,
    greedy: bool,
    generator: Optional[torch.Generator] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode ``n_new`` tokens after ``prompts`` [B, P] with a KV cache; ``positions``
    holds the position ids of the whole sequence (at least P + n_new - 1).

    Returns (tokens [B, n_new], log-probabilities of the chosen tokens under the sampling
    distribution [B, n_new], entropy of that distribution [B, n_new]). Sampling draws
    on the CPU from ``generator`` so that a seed gives the same samples on every device.
    """
    out, logps, ents = [], [], []
    # one weight version serves every decode step: quantize each MXLinear weight once
    with torch.no_grad(), pmx.nn.weight_cache(model):
        pos = prompts.shape[1]
        logits, cache = model(prompts, positions[:pos], cache=[])
        for i in range(n_new):
            last = logits[:, -1].float() / temperature
            logp = torch.log_softmax(last, dim=-1)
            if greedy:
                nxt = logp.argmax(dim=-1)
            else:
                u = torch.rand(logp.shape[0], 1, generator=generator).to(logp.device)
                cdf = logp.exp().cumsum(dim=-1)
                nxt = (cdf < u * cdf[:, -1:]).sum(dim=-1).clamp(max=logp.shape[-1] - 1)
            out.append(nxt)
            logps.append(logp.gather(1, nxt[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
            if i + 1 < n_new:
                logits, cache = model(nxt[:, None], positions[pos : pos + 1], cache=cache)
                pos += 1
    return torch.stack(out, 1), torch.stack(logps, 1), torch.stack(ents, 1)


def answer_logits(model: GPT, prompts: torch.Tensor, answers: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits [B, A, V] that predict each answer token."""
    seq = torch.cat([prompts, answers], dim=1)
    logits = model(seq[:, :-1], positions[: seq.shape[1] - 1])
    return logits[:, prompts.shape[1] - 1 :].float()


def token_logprobs(model: GPT, prompts: torch.Tensor, answers: torch.Tensor, positions: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log pi_T(answer_t | prefix) [B, A] (differentiable): at the sampling ``temperature``
    T, the distribution :func:`generate` draws from (its ``old_logp``)."""
    logits = answer_logits(model, prompts, answers, positions)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(2, answers[..., None])[..., 0]
