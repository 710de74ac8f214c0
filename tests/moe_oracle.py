"""An independent oracle of the grouped GEMM (tests/test_moe.py, tests/test_triton_grouped.py):
the routing built by a Python loop over the (token, slot) pairs, and the forward in
float64 from the dequantized operands, with an error bound derived from fp32 arithmetic.

The bound of one output element: the fp32 accumulation of a length-K dot product
(K * 2^-24 * |a| . |w|), one rounding of the bias addition, the activation's sensitivity
to its inputs' errors (first order, doubled) plus a margin for fp32 exp/sigmoid, the
fp32 k-way combine (k * 2^-24 * sum |w_j z_j|) and the final rounding to the output dtype.
"""

import torch

EPS = 2.0**-24
UNIT = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def py_routing(ids: torch.Tensor, num_experts: int, tile_m: int = 16) -> dict:
    """The routing of ``ids`` [T, k] by a plain Python loop: a stable sort of the pairs
    p = t * k + j by expert, counts, cumulative ends, gather/scatter and the tile schedule."""
    t, k = ids.shape
    flat = ids.reshape(-1).tolist()
    pairs = sorted(range(t * k), key=lambda p: (flat[p], p))
    gather = [p // k for p in pairs]
    scatter = [0] * (t * k)
    for i, p in enumerate(pairs):
        scatter[p] = i
    counts = [flat.count(e) for e in range(num_experts)]
    offsets, run = [], 0
    for c in counts:
        run += c
        offsets.append(run)
    schedule, start = [], 0
    for e, c in enumerate(counts):
        for tile in range(-(-c // tile_m)):
            schedule.append([e, start + tile * tile_m])
        start += c
    slots = (t * k + min(num_experts, t * k) * (tile_m - 1)) // tile_m
    schedule += [[-1, 0]] * (slots - len(schedule))
    expert_of_row = [flat[p] for p in pairs]
    return dict(gather=gather, scatter=scatter, counts=counts, offsets=offsets, schedule=schedule,
                expert_of_row=expert_of_row, pairs=pairs)


def act64(h: torch.Tensor, name):
    """The activation in float64 and the magnitudes of its partial derivatives (gate, up)."""
    if name is None:
        return h, None
    if name == "swiglu_oai":
        gate, up = h[:, 0::2], h[:, 1::2]
        g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        z = g * torch.sigmoid(1.702 * g) * (u + 1)
        return z, ((1 + 0.5 * g.abs()) * (u.abs() + 1), g.abs() + 1)
    half = h.shape[1] // 2
    gate, up = h[:, :half], h[:, half:]
    z = gate * torch.sigmoid(gate) * up
    return z, ((1 + 0.5 * gate.abs()) * (up.abs() + 1), gate.abs() + 1)


def split(t: torch.Tensor, name):
    if name == "swiglu_oai":
        return t[:, 0::2], t[:, 1::2]
    half = t.shape[1] // 2
    return t[:, :half], t[:, half:]


def grouped_oracle(aq, wq, expert_of_row, bias=None, activation=None, scatter=None, weights=None, k=1,
                   out_dtype=torch.float32):
    """(exact float64 result, bound) of the grouped GEMM of the left rows ``aq`` [R, K]
    (already gathered, dequantized) and the dequantized weights ``wq`` [E, N, K]; rows
    sorted by expert (``expert_of_row``), optional bias [E, N], activation, and the
    k-way combine through ``scatter`` (the row of each (t, j)) with ``weights`` [T, k]."""
    aq, wq = aq.double(), wq.double()
    e = torch.tensor(expert_of_row, dtype=torch.int64)
    we = wq[e]  # [R, N, K]
    h = torch.einsum("rk,rnk->rn", aq, we)
    bound = aq.shape[1] * EPS * torch.einsum("rk,rnk->rn", aq.abs(), we.abs())
    if bias is not None:
        h = h + bias.double()[e]
        bound = bound + EPS * h.abs()
    z, sens = act64(h, activation)
    if activation is not None:
        bg, bu = split(bound, activation)
        bound = 2 * (sens[0] * bg + sens[1] * bu) + 2.0**-19 * z.abs()
    if scatter is not None:
        t = len(scatter) // k
        idx = torch.tensor(scatter, dtype=torch.int64).view(t, k)
        w = torch.ones(t, k, dtype=torch.float64) if weights is None else weights.double()
        terms = z[idx] * w[:, :, None]
        z = terms.sum(1)
        bound = (bound[idx] * w.abs()[:, :, None]).sum(1) + (k + 1) * EPS * terms.abs().sum(1)
    bound = bound + UNIT[out_dtype] * (z.abs() + bound) + 1e-30
    return z, bound


def assert_within(got, exact, bound):
    err = (got.detach().double() - exact).abs()
    assert got.shape == exact.shape, (got.shape, exact.shape)
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off; max excess {(err - bound).max().item():.3g}"
