"""Plots of a training run from the trainer's log history: what the recipe writes next to ``report.json``.

Why against *generated tokens*: rollout reuse exists to save sampling compute, so progress is plotted against the
completion tokens sampled so far (``reuse/generated_tokens``), not against optimizer steps. The gradient-throughput
panel shows, per advantage sign, how much of the on-policy gradient the loss let through
(``starvation/grad_throughput/{pos,neg}``) next to TRL's clipped loss on the same batches
(``starvation/clip_grad_throughput/{pos,neg}``): sign-dependent starvation, visible on every step. Beside it, the
gradient norm of each reuse pass relative to its batch's fresh pass (``reuse/grad_norm_vs_fresh``): how large the
steps on stale rollouts are, which is where ReSPO under reuse can fail (docs/method.md, section 6).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence

TOKENS_KEY = "reuse/generated_tokens"
THROUGHPUT_KEYS = (
    ("starvation/grad_throughput/pos", "{loss}, A>0", "tab:green", "-"),
    ("starvation/grad_throughput/neg", "{loss}, A<0", "tab:red", "-"),
    ("starvation/clip_grad_throughput/pos", "clipped (dapo), A>0", "tab:green", ":"),
    ("starvation/clip_grad_throughput/neg", "clipped (dapo), A<0", "tab:red", ":"),
)


def train_series(log_history: Sequence[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """(steps, generated tokens, values) of ``key`` over the training logs that carry it."""
    steps, tokens, values = [], [], []
    for log in log_history:
        if key in log and TOKENS_KEY in log:
            steps.append(log.get("step", len(steps)))
            tokens.append(log[TOKENS_KEY])
            values.append(log[key])
    return steps, tokens, values


def plot_run(
    log_history: Sequence[dict],
    accuracy_curve: Sequence[dict],
    output_dir: str,
    title: str = "",
    accuracy_label: str = "held-out accuracy",
    loss_name: str = "loss",
    reward_label: str = "mean training reward",
) -> list[str]:
    """Write ``accuracy_reward_vs_tokens.png`` and ``grad_throughput.png`` into ``output_dir``; return the paths.

    ``accuracy_curve`` holds ``{"generated_tokens": ..., "accuracy": ..., "n": ...}`` points (before training at 0
    tokens). Points measured on fewer problems than the largest set (a subset during training) are drawn hollow and
    labelled with their size, so they are not mistaken for the full evaluations. ``reward_label`` says what the reward
    sums (e.g. accuracy + 0.1 x format, whose maximum is 1.1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    paths = []

    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(11, 4))
    if accuracy_curve:
        xs = [p["generated_tokens"] for p in accuracy_curve]
        ys = [100 * p["accuracy"] for p in accuracy_curve]
        ax_acc.plot(xs, ys, "-", color="tab:blue", alpha=0.6)
        sizes = [p.get("n") for p in accuracy_curve]
        full = max((n for n in sizes if n), default=None)
        for subset, style in ((False, dict(color="tab:blue")), (True, dict(markerfacecolor="white", color="tab:blue"))):
            points = [(x, y, n) for x, y, n in zip(xs, ys, sizes) if (n is not None and n < (full or 0)) == subset]
            if points:
                label = f"first {points[0][2]} problems" if subset else f"all {full} problems" if full else None
                ax_acc.plot([x for x, _, _ in points], [y for _, y, _ in points], "o", label=label, **style)
        if full:
            ax_acc.legend(loc="best", fontsize=8)  # a fixed corner hid the final point of some runs
    ax_acc.set_xlabel("generated tokens (sampling compute)")
    ax_acc.set_ylabel(f"{accuracy_label} (%)")
    ax_acc.set_title("held-out accuracy")
    ax_acc.grid(alpha=0.3)
    _, tokens, reward = train_series(log_history, "reward")
    if tokens:
        ax_rew.plot(tokens, reward, color="tab:orange", alpha=0.35, label="per step")
        window = max(1, len(reward) // 20)
        smooth = [
            sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
            for i in range(len(reward))
        ]
        ax_rew.plot(tokens, smooth, color="tab:orange", label=f"moving mean ({window})")
        ax_rew.legend(loc="best", fontsize=8)
    ax_rew.set_xlabel("generated tokens (sampling compute)")
    ax_rew.set_ylabel(textwrap.fill(reward_label, 40))  # a long formula label ran into the panel's title
    ax_rew.set_title("training reward")
    ax_rew.grid(alpha=0.3)
    paths.append(_save(fig, os.path.join(output_dir, "accuracy_reward_vs_tokens.png"), title))

    fig, (ax, ax_norm) = plt.subplots(1, 2, figsize=(12, 4))
    for key, label, color, style in THROUGHPUT_KEYS:
        steps, _, values = train_series(log_history, key)
        points = [(x, y) for x, y in zip(steps, values) if y is not None]  # None: no sequence of that sign
        if points:
            ax.plot(*zip(*points), linestyle=style, color=color, label=label.format(loss=loss_name))
    _label(ax, "gradient throughput by advantage sign", "gradient throughput (1 = on-policy)")
    by_pass: dict[int, list[tuple[float, float]]] = {}  # the ratio is logged on reuse passes only
    for log in log_history:
        if "reuse/grad_norm_vs_fresh" in log and "reuse/pass" in log:
            by_pass.setdefault(int(log["reuse/pass"]), []).append((log["step"], log["reuse/grad_norm_vs_fresh"]))
    for p, points in sorted(by_pass.items()):
        ax_norm.plot(*zip(*points), ".", ms=4, label=f"pass {p}")
    ax_norm.axhline(1.0, color="k", lw=0.8)
    _label(ax_norm, "step size on reused rollouts", "grad_norm / fresh pass's grad_norm")
    paths.append(_save(fig, os.path.join(output_dir, "grad_throughput.png"), title))
    return paths


def _save(fig, path: str, title: str) -> str:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93) if title else None)  # leave the figure title its own band
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax, title: str, ylabel: str, xlabel: str = "optimizer step") -> None:
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def reward_description(reward_funcs: Sequence[str], reward_weights: Sequence[float] | None) -> str:
    """Axis label saying what the training reward sums, e.g. 'mean training reward = 1 x accuracy + 0.1 x format'."""
    weights = reward_weights or [1.0] * len(reward_funcs)
    terms = " + ".join(f"{w:g} x {name}" for w, name in zip(weights, reward_funcs))
    return f"mean training reward = {terms}"
