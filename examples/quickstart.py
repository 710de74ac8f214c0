"""A first look at portable_mx: quantize, decompose and multiply in MXFP4.

Prints, for Gaussian and Student-t(3) data, the relative MSE of each recipe and its
split into scale bias / deadzone / grid noise, then an MXFP4 matmul against fp32.
Runs on the CPU in a few seconds; pass --device cuda to run on a GPU.
"""

from __future__ import annotations

import argparse

import torch

import portable_mx as pmx

RECIPES = {
    "floor (OCP)": pmx.QuantRecipe(),
    "rceil": pmx.QuantRecipe(scale_rule="rceil"),
    "MBS-64": pmx.QuantRecipe(macro_block=64),
    "MBS-128": pmx.QuantRecipe(macro_block=128),
    "OF-1": pmx.QuantRecipe(outliers_per_block=1),
    "OF-2": pmx.QuantRecipe(outliers_per_block=2),
    "MBS-64 + OF-1": pmx.QuantRecipe(macro_block=64, outliers_per_block=1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=1024)
    args = parser.parse_args()
    if args.rows < 1:
        parser.error(f"--rows must be >= 1; got {args.rows}")
    torch.manual_seed(0)  # StudentT samples from the global generator
    gen = torch.Generator().manual_seed(0)
    data = {
        "N(0,1)": torch.randn(args.rows, 1024, generator=gen),
        "t(3)": torch.distributions.StudentT(3.0).sample((args.rows, 1024)),
    }
    for name, x in data.items():
        x = x.to(args.device)
        print(f"\n{name}, {tuple(x.shape)}: relative MSE and its exact 3-way split (gain definition)")
        print(f"  {'recipe':<15} {'rel. MSE':>9} {'scale':>7} {'dead':>7} {'grid':>7} {'mean beta':>10}")
        for label, recipe in RECIPES.items():
            s = pmx.decompose(x, recipe, full=False).summary()
            print(
                f"  {label:<15} {s['relative_mse']:9.5f} {s['share_scale']:7.3f} "
                f"{s['share_dead']:7.3f} {s['share_grid']:7.3f} {s['mean_beta']:10.4f}"
            )

    a = torch.randn(256, 1000, generator=gen).to(args.device)
    b = torch.randn(1000, 512, generator=gen).to(args.device)
    exact = a.double() @ b.double()
    print("\nmatmul a[256, 1000] @ b[1000, 512] (K padded to 1024), relative Frobenius error vs fp64:")
    for label in ("floor (OCP)", "MBS-64", "OF-2"):
        out = pmx.matmul(a, b, RECIPES[label])
        err = ((out.double() - exact).norm() / exact.norm()).item()
        print(f"  {label:<15} {err:.4f}")
    mx = pmx.quantize(b, axis=0)
    print(f"\n{mx}: {mx.nbytes()} bytes vs {b.numel() * 2} in bf16")


if __name__ == "__main__":
    main()
