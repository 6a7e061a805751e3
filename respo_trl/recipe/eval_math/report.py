"""What an evaluation leaves in its output directory, written here and nowhere else: ``eval_math.json`` (every setting,
the command, versions, metrics, length bins), ``eval_math.md`` (the tables), the length-bin plot and, on request, every
completion; an earlier evaluation is kept, renamed, never silently replaced.

The file names are :mod:`respo_trl.run_files`', where the model card (:mod:`respo_trl.hub.card`) reads
``eval_math.json`` by the same :data:`~respo_trl.run_files.RESULTS_JSON`, so writer and reader cannot drift apart.
"""

from __future__ import annotations

import json
import os
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ...hub.card import weights_fingerprint
from ...run_files import LENGTH_PLOT, PREVIOUS_JSON, RESULTS_JSON, RESULTS_MD, SAMPLES_JSONL

OUTPUT_ROOT = "eval_math"  # results of a model that is not a training output_dir go to OUTPUT_ROOT/NAME
MIN_BIN_SAMPLES = 5  # the length-bin plot joins only bins with at least this many samples
GRADING = "respo_trl.grading.grade (trl.rewards.accuracy_reward, math-verify), gold answers boxed"


def package_versions() -> dict:
    names = ["respo-trl", "trl", "transformers", "torch", "datasets", "math-verify", "vllm"]
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            if name == "respo-trl":
                from respo_trl import __version__

                found[name] = __version__
    return found


def build_report(args, backend: str, rows: list[dict], command: str, seconds: float) -> dict:
    """The content of ``eval_math.json`` (less the length bins): what was evaluated, how, with what, and the results."""
    samples_per_problem = {row["benchmark"]: row["n"] for row in rows}
    uniform = len(set(samples_per_problem.values())) == 1 and not args.protocol_report
    return {
        "model": args.model,
        "revision": args.revision,
        "weights_sha256": weights_fingerprint(args.model),  # lets a model card check these are its weights
        "backend": backend,
        "protocol": args.protocol_report,
        "generation": {
            "n": next(iter(samples_per_problem.values())) if uniform else samples_per_problem,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "system_prompt": args.system_prompt,
            "prompt_template": args.prompt_template,
            "chat_template_kwargs": args.chat_template_kwargs,
        },
        "grading": GRADING,
        "results": rows,
        "command": command,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(seconds, 1),
        "versions": package_versions(),
    }


def archive_previous(output_dir: str) -> str | None:
    """Move an earlier ``eval_math.json``/``.md`` of ``output_dir`` aside (never silently replaced); returns its name."""
    old = Path(output_dir) / RESULTS_JSON
    if not old.is_file():
        return None
    index = 1
    while (Path(output_dir) / PREVIOUS_JSON.format(index=index)).exists():
        index += 1
    target = Path(output_dir) / PREVIOUS_JSON.format(index=index)
    old.rename(target)
    md = Path(output_dir) / RESULTS_MD
    if md.is_file():
        md.rename(target.with_suffix(".md"))
    return target.name


def default_output_dir(model: str) -> str:
    """A trained output_dir (it holds ``training_args.bin``) keeps its results; anything else gets its own folder."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "training_args.bin")):
        return model
    return os.path.join(OUTPUT_ROOT, model.rstrip("/").split("/")[-1])


def plot_length_bins(report: dict, path: str) -> str:
    """Accuracy by response-length bin (line, left axis) over the number of samples in each bin (bars, right axis),
    every benchmark pooled, plus one thin line per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = report["length_bins"]
    rows = bins["all"]
    centers = [(r["lo"] + r["hi"]) / 2 for r in rows]
    width = rows[0]["hi"] - rows[0]["lo"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    counts = ax.twinx()
    counts.bar(centers, [r["samples"] for r in rows], width=0.9 * width, color="0.85", zorder=0)
    counts.set_ylabel("samples in bin")
    ax.set_zorder(counts.get_zorder() + 1)
    ax.patch.set_visible(False)
    # A bin with a handful of samples has an accuracy of 0% or 100% by chance: the lines join only bins with at least
    # MIN_BIN_SAMPLES samples, and the sparse ones are drawn as hollow points (a 1-sample bin would look like a drop to 0%).
    def dense(per):
        return [((r["lo"] + r["hi"]) / 2, 100 * r["accuracy"]) for r in per
                if r["accuracy"] is not None and r["samples"] >= MIN_BIN_SAMPLES]  # fmt: skip

    for label, per in bins["by_benchmark"].items():
        points = dense(per)
        if points:
            ax.plot(*zip(*points), lw=0.8, alpha=0.6, label=label)
    points = dense(rows)
    if points:
        ax.plot(*zip(*points), "o-", color="black", lw=2, ms=4, label="all benchmarks")
    sparse = [((r["lo"] + r["hi"]) / 2, 100 * r["accuracy"]) for r in rows
              if r["accuracy"] is not None and r["samples"] < MIN_BIN_SAMPLES]  # fmt: skip
    if sparse:
        ax.plot(*zip(*sparse), "o", mfc="white", color="black", ms=4, label=f"bins with < {MIN_BIN_SAMPLES} samples")
    ax.set_xlim(0, bins["max_new_tokens"])
    ax.set_ylim(-2, 102)
    ax.set_xlabel(f"response length (tokens), {bins['bins']} equal-width bins")
    ax.set_ylabel("accuracy (%)")
    protocol = report.get("protocol") or {}
    ax.set_title(f"{report['model']}: accuracy by response length" + (f" ({protocol['name']})" if protocol else ""))
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: dict, samples: list[dict], output_dir: str, save_samples: bool) -> None:
    from respo_trl.grading import generation_summary, length_bins_table, results_table

    os.makedirs(output_dir, exist_ok=True)
    bins = report.get("length_bins")
    if bins:
        bins["plot"] = os.path.basename(plot_length_bins(report, os.path.join(output_dir, LENGTH_PLOT)))
    with open(os.path.join(output_dir, RESULTS_JSON), "w") as f:
        json.dump(report, f, indent=2)
    text = (
        f"`{report['model']}`. {generation_summary(report)} avg@n ± its standard error over problems.\n\n"
        + results_table(report)
    )
    if bins:
        text += (
            f"\n\n## Accuracy by response length\n\nAll benchmarks pooled: {bins['definition']}.\n\n"
            + length_bins_table(bins["all"])
            + f"\n\n![accuracy by response length]({bins['plot']})"
        )
    with open(os.path.join(output_dir, RESULTS_MD), "w") as f:
        f.write(text + f"\n\nCommand: `{report['command']}`\n")
    if save_samples:
        with open(os.path.join(output_dir, SAMPLES_JSONL), "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in samples)
