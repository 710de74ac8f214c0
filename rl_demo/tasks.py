"""Verifiable tasks generated in code: reversed-digit arithmetic with an exact-match reward.

Every number is written least-significant digit first and zero-padded, so that a left-to-
right model produces each answer digit after the digits (and carries) it depends on.

- ``add`` (default): ``a+b=`` with a, b in [0, 999] (3 digits each), answer a+b in 4 digits.
- ``mul``: ``a*b=`` with a in [0, 999] and b in [0, 9], answer a*b in 4 digits.

Example (add): 123 + 456 = 579 is ``321+654=9750<eos>``. Prompts of one task all have the
same length, and every answer is exactly ``ANSWER_LEN`` tokens (4 digits then EOS), so a
batch needs no padding. The reward is 1.0 when the generated answer equals the target
exactly, else 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB = list("0123456789") + ["+", "*", "=", "<eos>"]
PLUS, TIMES, EQUALS, EOS = 10, 11, 12, 13
VOCAB_SIZE = len(VOCAB)
ANSWER_DIGITS = 4
ANSWER_LEN = ANSWER_DIGITS + 1  # digits + EOS
TASKS = ("add", "mul")


def _digits_reversed(n: torch.Tensor, width: int) -> torch.Tensor:
    """[B] int64 -> [B, width] digits, least significant first."""
    return torch.stack([(n // 10**i) % 10 for i in range(width)], dim=1)


@dataclass(frozen=True)
class Task:
    """A task: draws (prompt, answer) batches from a torch.Generator."""

    name: str = "add"

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {TASKS}; got {self.name!r}")

    @property
    def prompt_len(self) -> int:
        return 8 if self.name == "add" else 6

    @property
    def seq_len(self) -> int:
        return self.prompt_len + ANSWER_LEN

    def positions(self, coupled: bool = True) -> torch.Tensor:
        """Position ids [seq_len] of a whole sequence (prompt, answer).

        ``coupled`` (the default; "position coupling", Cho et al. 2024): digit i of each
        operand gets position i + 1, and the token that *predicts* answer digit i (the
        "=" for digit 0, then answer digit i - 1) gets position i + 1 too, so the digits
        that answer digit depends on sit at a fixed relative position; the operator and
        the EOS-predicting token get ids of their own. Otherwise 0, 1, 2, ...
        """
        if not coupled:
            return torch.arange(self.seq_len)
        d = [1, 2, 3]
        if self.name == "add":
            prompt = d + [5] + d + [1]  # a0 a1 a2 + b0 b1 b2 =
        else:
            prompt = d + [5] + [6] + [1]  # a0 a1 a2 * b =
        answer = [2, 3, 4, 7, 8]  # c0 c1 c2 c3 <eos> (the last one is never fed)
        return torch.tensor(prompt + answer)

    def operands(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randint(0, 1000, (n,), generator=generator)
        hi = 1000 if self.name == "add" else 10
        b = torch.randint(0, hi, (n,), generator=generator)
        return a, b

    def encode(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [n, prompt_len] and answers [n, ANSWER_LEN] (int64) for operands a, b."""
        n = a.shape[0]
        if self.name == "add":
            op, bd, c = PLUS, _digits_reversed(b, 3), a + b
        else:
            op, bd, c = TIMES, b.view(n, 1), a * b
        prompt = torch.cat(
            [_digits_reversed(a, 3), torch.full((n, 1), op), bd, torch.full((n, 1), EQUALS)], dim=1
        )
        answer = torch.cat([_digits_reversed(c, ANSWER_DIGITS), torch.full((n, 1), EOS)], dim=1)
        return prompt, answer

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(*self.operands(n, generator))


def reward(generated: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Exact match: [B, ANSWER_LEN] generated vs target tokens -> [B] float 0/1."""
    return (generated == answer).all(dim=1).to(torch.float32)


def detokenize(tokens: torch.Tensor) -> str:
    return "".join(VOCAB[int(t)] if int(t) != EOS else "$" for t in tokens)
