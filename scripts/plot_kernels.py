"""Plot the kernels' coefficient phi(w) by advantage sign, for docs/method.md.

Draws ReSPO (package defaults), VESPO (TRL 1.16 defaults) and clipped token PPO (TRL's dapo/grpo, epsilon 0.2) as the
main curves, and the other registered losses (GSPO, CISPO, SAPO, plain importance sampling) as thin lines, against the
importance weight ``w`` from 1e-4 to 20 on a log scale; the top row has a linear coefficient axis, the bottom row a log
one (zeros of the clipped losses drop to the bottom edge). The curves are read off the registry by autograd
(:func:`respo_trl.kernels.gradient_coefficients` on a one-token sequence, where the token ratio, the sequence product
and every normalisation coincide), so the figure shows what the code computes, not a re-drawing of the formulas. The
spec's table values for ReSPO are marked as dots.

How to run
----------
    PYTHONPATH=. python scripts/plot_kernels.py                        # writes docs/figures/kernels.png
    PYTHONPATH=. python scripts/plot_kernels.py --out /tmp/kernels.png --params respo_alpha_pos=0.3
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

from respo_trl.kernels import LossParams, gradient_coefficients, kernel_sup  # noqa: E402

# label -> (registry name, LossParams overrides, style); the first three are the figure's subject
CURVES = {
    "ReSPO (0.5, 0.5) / (2, 2), this package": ("respo", {}, dict(color="tab:blue", lw=2.8)),
    "VESPO (2, 3) / (3, 2), TRL 1.16": ("vespo", {}, dict(color="tab:purple", lw=2.0)),
    "clipped PPO, eps 0.2 (TRL dapo/grpo)": ("ppo", {}, dict(color="tab:red", lw=2.0)),
    "GSPO, eps 3e-4/4e-4": ("gspo", {"epsilon_low": 3e-4, "epsilon_high": 4e-4},
                            dict(color="tab:orange", lw=1.0, ls="--")),
    "CISPO, eps_max 5": ("cispo", {"epsilon_high": 5.0}, dict(color="tab:brown", lw=1.0, ls="-.")),
    "SAPO, tau 1.0/1.05": ("sapo", {}, dict(color="tab:pink", lw=1.0, ls="--")),
    "plain IS (w)": ("is", {}, dict(color="gray", lw=1.0, ls=":")),
}
SPEC_W = [1e-4, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0]  # spec section 2's table


def coefficients(name: str, params: LossParams, w: torch.Tensor, sign: float) -> torch.Tensor:
    log_w = torch.log(w).float().unsqueeze(-1)
    return gradient_coefficients(name, log_w, torch.full((len(w),), sign), torch.ones_like(log_w), params)[:, 0]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/kernels.png")
    parser.add_argument("--params", nargs="*", default=[], help="LossParams overrides (e.g. respo_alpha_pos=0.3)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.params:
        key, _, value = item.partition("=")
        default = getattr(LossParams(), key)
        overrides[key] = value if isinstance(default, str) else float(value)
    base = dataclasses.replace(LossParams(), **overrides)

    w = torch.cat([torch.logspace(-4, 0, 400, dtype=torch.float64), torch.logspace(0, math.log10(20), 200,
                                                                                    dtype=torch.float64)[1:]])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, (sign, title) in enumerate(((1.0, "A > 0: correct rollouts"), (-1.0, "A < 0: wrong rollouts"))):
        for row, scale in enumerate(("linear", "log")):
            ax = axes[row][col]
            for label, (name, extra, style) in CURVES.items():
                c = coefficients(name, dataclasses.replace(base, **extra), w, sign).double()
                ax.plot(w, c.clamp(min=1e-12) if scale == "log" else c, label=label, **style)
            branch = (base.respo_alpha_pos, base.respo_lambda_pos) if sign > 0 else (base.respo_alpha_neg,
                                                                                      base.respo_lambda_neg)
            spec = coefficients("respo", base, torch.tensor(SPEC_W, dtype=torch.float64), sign).double()
            ax.plot(SPEC_W, spec.clamp(min=1e-12) if scale == "log" else spec, "o", color="tab:blue", ms=4)
            sup, argmax = kernel_sup(*branch)
            if math.isfinite(sup) and math.isfinite(argmax) and argmax > 0:
                ax.plot([argmax], [sup], "*", color="tab:blue", ms=10)
            ax.set_xscale("log")
            ax.axvline(1.0, color="k", lw=0.6, ls=":")
            ax.grid(alpha=0.3)
            if scale == "log":
                ax.set_yscale("log")
                ax.set_ylim(1e-8, 40)
                ax.set_xlabel("importance weight w = pi_theta / mu (token or sequence)")
            else:
                ax.set_ylim(-0.03, 1.6)
                ax.set_title(f"{title}\nReSPO branch (alpha, lambda) = {branch}: sup phi = {sup:.3g} at w = "
                             f"{argmax:.3g}", fontsize=10)
        axes[0][col].set_ylabel("coefficient phi(w) on A * grad log pi")
        axes[1][col].set_ylabel("phi(w), log scale")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Effective gradient coefficient by advantage sign (dots: the spec's table; star: sup phi)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
