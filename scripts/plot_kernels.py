"""Plot the kernels' gradient coefficient phi(W) by advantage sign, for docs/method.md (docs/figures/kernels.png).

Draws both ReSPO branches (the paper's constants: ``(alpha, beta, lam) = (2, 0.5, 2)`` for ``A >= 0``, ``(1, 0.5, 2)``
for ``A < 0``) beside VESPO (TRL 1.16 defaults), GRPO's token clip (TRL ``dapo``/``grpo``, epsilon 0.2) and GSPO
(epsilon 3e-4 / 4e-4), against the importance weight ``W`` from 1e-4 to 20 on a log scale; the top row has a linear
coefficient axis, the bottom row a log one (zeros of the clipped losses drop to the bottom edge).

Every curve is read off the loss registry by autograd (:func:`respo_trl.kernels.gradient_coefficients`), so the figure
shows what the code computes, not a re-drawing of the formulas:

* solid lines: a one-token sequence, where the token ratio, GSPO's geometric mean and the sequence product coincide
  (``W = r``): the picture the spec's table uses;
* thin dashed lines: GRPO's clip and GSPO on a 100-token sequence whose tokens drifted equally (``r = W^(1/100)``), the
  mean coefficient over its tokens: the token-level losses see ``W^(1/L)``, so their starvation at low ``W`` depends on
  length, while ReSPO and VESPO see the raw product ``W`` whatever the length.

Dots mark the spec's table values for ReSPO; the star marks each ReSPO branch's maximum, found numerically on a fine
grid (for ``A >= 0`` it is the left end of the grid: the supremum ``e/2`` is approached as ``W -> 0``).

How to run (from the repository root, with the package installed: ``pip install -e .``)
----------------------------------------------------------------------------------------
    python scripts/plot_kernels.py                        # writes docs/figures/kernels.png
    python scripts/plot_kernels.py --out /tmp/kernels.png --params respo_lambda_pos=1
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from respo_trl.kernels import LossParams, gradient_coefficients  # noqa: E402

GSPO_EPS = {"epsilon_low": 3e-4, "epsilon_high": 4e-4}
# label -> (registry name, LossParams overrides, tokens per sequence, style)
CURVES = {
    "ReSPO (paper): (2, 0.5, 2) for A >= 0, (1, 0.5, 2) for A < 0": ("respo", {}, 1, dict(color="tab:blue", lw=2.8)),
    "VESPO (2, 3) / (3, 2), TRL 1.16": ("vespo", {}, 1, dict(color="tab:purple", lw=2.0)),
    "GRPO token clip, eps 0.2 (TRL dapo), one token": ("ppo", {}, 1, dict(color="tab:red", lw=4.0, alpha=0.5)),
    "GSPO, eps 3e-4 / 4e-4, one token": ("gspo", GSPO_EPS, 1, dict(color="tab:orange", lw=1.4)),
    "GRPO token clip, 100 tokens (r = W^(1/100))": ("ppo", {}, 100, dict(color="tab:red", lw=1.0, ls="--")),
    "GSPO, 100 tokens": ("gspo", GSPO_EPS, 100, dict(color="tab:orange", lw=1.0, ls="--")),
}
SPEC_W = [1e-4, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 20.0]  # spec section 2's table


def coefficients(name: str, params: LossParams, w: torch.Tensor, sign: float, tokens: int = 1) -> torch.Tensor:
    """Mean coefficient over the tokens of a ``tokens``-token sequence with product weight ``w`` spread evenly."""
    log_r = (torch.log(w.double()) / tokens).float().unsqueeze(-1).expand(-1, tokens).contiguous()
    c = gradient_coefficients(name, log_r, torch.full((len(w),), sign), torch.ones_like(log_r), params)
    return c.double().mean(-1)


def branch_maximum(params: LossParams, sign: float) -> tuple[float, float]:
    """``(max phi, argmax W)`` of ReSPO's branch for ``sign``, numerically on 20,001 points of log W in [-20, 3]."""
    w = torch.logspace(-20 / math.log(10), 3 / math.log(10), 20_001, dtype=torch.float64)
    c = coefficients("respo", params, w, sign)
    i = int(c.argmax())
    return float(c[i]), float(w[i])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/kernels.png")
    parser.add_argument("--params", nargs="*", default=[], help="LossParams overrides (e.g. respo_lambda_pos=1)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.params:
        key, _, value = item.partition("=")
        default = getattr(LossParams(), key)
        overrides[key] = value if isinstance(default, str) else float(value)
    base = dataclasses.replace(LossParams(), **overrides)

    w = torch.cat([torch.logspace(-4, 0, 400, dtype=torch.float64),
                   torch.logspace(0, math.log10(20), 200, dtype=torch.float64)[1:]])
    fig, axes = plt.subplots(2, 2, figsize=(12.5, 8.5), sharex=True)
    for col, (sign, title) in enumerate(((1.0, "A >= 0: correct rollouts"), (-1.0, "A < 0: wrong rollouts"))):
        branch = ((base.respo_alpha_pos, base.respo_beta_pos, base.respo_lambda_pos) if sign > 0 else
                  (base.respo_alpha_neg, base.respo_beta_neg, base.respo_lambda_neg))
        peak, argmax = branch_maximum(base, sign)
        for row, scale in enumerate(("linear", "log")):
            ax = axes[row][col]
            for label, (name, extra, tokens, style) in CURVES.items():
                c = coefficients(name, dataclasses.replace(base, **extra), w, sign, tokens)
                ax.plot(w, c.clamp(min=1e-12) if scale == "log" else c, label=label, **style)
            spec = coefficients("respo", base, torch.tensor(SPEC_W, dtype=torch.float64), sign)
            ax.plot(SPEC_W, spec.clamp(min=1e-12) if scale == "log" else spec, "o", color="tab:blue", ms=4)
            ax.plot([max(argmax, float(w[0]))], [peak], "*", color="tab:blue", ms=12)  # left edge if W -> 0
            ax.set_xscale("log")
            ax.axvline(1.0, color="k", lw=0.6, ls=":")
            ax.grid(alpha=0.3)
            if scale == "log":
                ax.set_yscale("log")
                ax.set_ylim(1e-8, 40)
                ax.set_xlabel("importance weight W = pi_theta(o) / pi_old(o)")
            else:
                ax.set_ylim(-0.03, 1.6)
                where = f"W = {argmax:.3g}" if argmax > 1e-8 else "W -> 0"
                ax.set_title(f"{title}\nReSPO branch (alpha, beta, lam) = {branch}: max phi = {peak:.4f} at {where}",
                             fontsize=10)
        axes[0][col].set_ylabel("coefficient phi(W) on A * grad log pi")
        axes[1][col].set_ylabel("phi(W), log scale")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8.5, frameon=False)
    fig.suptitle("Effective gradient coefficient by advantage sign, read off the loss registry by autograd "
                 "(dots: the spec's table; star: numerical maximum)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"wrote {args.out}")
    for sign, name in ((1.0, "A >= 0"), (-1.0, "A < 0")):
        peak, argmax = branch_maximum(base, sign)
        print(f"ReSPO {name}: max phi {peak:.6f} at W = {argmax:.4g}")
    return args.out


if __name__ == "__main__":
    main()
