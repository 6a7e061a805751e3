"""The paper's mechanism on SmolLM2-135M (issue 45): on a stale batch, whose gradient points where the on-policy
gradient does, ReSPO's, VESPO's, ``dapo``'s or the unclipped importance-weighted one's?

The end-to-end comparison (``smollm2_staleness``, section 6 of docs/benchmarks/smollm2_staleness.md) cannot resolve
the paper's +4-6 points at this budget. This asks the question the paper's reshaping answers, one gradient at a time
(section 7 of the page has the design, the pilot, the rule and the reading: the design expected a few checkpoints to
suffice; with five, whose differences dominate the interval, no pre-registered pair was resolved):

* the policies ``theta_t`` are the checkpoints of one on-policy ``dapo`` run of the comparison (``onpolicy_s4``, lr
  2e-5, every 4 updates; ``theta_0`` is the pretrained model);
* for each ``t`` of :data:`T` and staleness ``N`` of :data:`N`: stale batches at the training shape (2 prompts x 8
  completions of the training split, temperature 0.7) sampled by ``theta_{t-N}``, rewards and TRL's group advantages
  as in training; on each, at ``theta_t``, the ascent direction of each loss (:mod:`benchmarks.gradient_alignment`);
* the on-policy gradient at ``theta_t``: REINFORCE with the group baseline on :data:`REFERENCE` fresh completions
  sampled by ``theta_t`` (independent of the stale batches), computed once per ``t`` and kept in ``--work``;
* per batch and loss, the cosine with it and the first-order gain along the unit step; the reading pairs the losses
  on each batch and bootstraps over checkpoints and the batches within them.

    python -m benchmarks.smollm2_mechanism pilot --workers 2    # t = 24, N = 4 and 16, 3 batches each; the sizing
    python -m benchmarks.smollm2_mechanism run --workers 2      # every t and N, the batches the sizing asks for
    python -m benchmarks.smollm2_mechanism read                 # the rule's reading: mechanism.json, mechanism.png

Resumable: every batch's record (``OUT/<stage>/t<t>-N<N>-b<k>.json``, naming its commit and start time) is written
as it lands and never redone; a reference gradient is computed once. One torch thread per worker; a worker holds two
policies and five gradients of 135M floats (~4 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks import gradient_alignment as ga
from benchmarks.common import code_commit, command, run_pool
from benchmarks.smollm2_task import MODEL, TEMPERATURE, sample_completions, split_rows

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "smollm2_staleness" / "mechanism"
WORK = ROOT / "docs" / "benchmarks" / "smollm2_staleness" / "attempt2-work"  # where the comparison kept its checkpoints
RUN = "onpolicy_s4"  # the comparison's on-policy dapo run whose checkpoints are theta_t
TASK = "add2_30"  # the task the comparison ran on (attempt2/gate.json)
T = (16, 24, 32, 40, 48)
N = (4, 16)
SHAPE = (2, 8)  # a stale batch: prompts x completions, the training shape
REFERENCE = (32, 8)  # the on-policy estimate: 256 completions
PILOT = {"t": (24,), "batches": 3}
# A fresh-batch control (N = 0, added after the rule was read, a pointer): the cosine a batch of the training shape
# sampled by theta_t itself reaches with the reference, the level the batch's and the reference's noise allow.
CONTROL = {"batches": 16}  # 6 at first; raised to the main run's 16 after 20 batches had landed
POWER_Z = 1.96 + 0.84  # two-sided 5%, 80% power
BATCH_RANGE = (4, 16)  # the sizing's batches per (t, N) are kept within this
SMOKE = {"t": (4,), "n": (4,), "batches": 1, "reference": (2, 2), "shape": (2, 2), "train_problems": 8}


def policy_path(args, step: int) -> str:
    return args.model if step == 0 else str(Path(args.work, "checkpoints", args.run, f"checkpoint-{step}"))


def batch_seed(stage: str, t: int, n: int, k: int) -> int:
    """Each batch its own prompts and sampling, the pilot's apart from the run's."""
    return {"pilot": 1, "run": 2, "control": 3}[stage] * 10_000_000 + t * 100_000 + n * 1_000 + k


def load(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # no dropout: the gradient of the loss at theta_t, not of a perturbed network
    return model


def reference_gradient(args, t: int, model, tokenizer, train: dict):
    """The on-policy gradient at ``theta_t`` (cached in ``--work``): REINFORCE with the group baseline on
    ``REFERENCE`` fresh completions, accumulated over groups of prompts so memory stays one group's."""
    import torch

    path = Path(args.work, "mechanism", f"reference-{args.run}-t{t}.pt")
    if path.exists():
        return torch.load(path)
    prompts, per = args.reference
    rng = random.Random(9_000_000 + t)
    idx = rng.sample(range(len(train["prompt"])), prompts)
    rows = {"prompt": [train["prompt"][i] for i in idx], "solution": [train["solution"][i] for i in idx]}
    total, rewards = None, []
    for start in range(0, prompts, 2):
        chunk = {k: v[start : start + 2] for k, v in rows.items()}
        sampled = sample_completions(model, tokenizer, chunk, per, seed=9_000_000 + t * 100 + start)
        logps, mask = ga.token_logps(model, sampled["prompt_ids"], sampled["completion_ids"],
                                     tokenizer.pad_token_id, TEMPERATURE)  # fmt: skip
        advantages = ga.group_advantages(sampled["reward"], per, scale=False)
        objective = (advantages.unsqueeze(-1) * logps * mask).sum() / (prompts * per)
        g = ga.flat_gradient(model, objective, retain=False)
        total = g if total is None else total + g
        rewards += sampled["reward"]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(total, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    Path(path.with_suffix(".json")).write_text(json.dumps({"t": t, "completions": len(rewards),
                                                           "reward": statistics.fmean(rewards)}))  # fmt: skip
    return total


def run_checkpoint(spec: dict) -> dict:
    """Every batch of one ``theta_t`` not yet recorded: the stale batches of each ``N``, then their gradients."""
    import torch
    from transformers import AutoTokenizer

    args = argparse.Namespace(**spec["args"])
    t, out = spec["t"], Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = split_rows(args.model, "train", TASK, args.train_problems)
    current = load(policy_path(args, t))
    reference = reference_gradient(args, t, current, tokenizer, train)
    written = []
    for n in spec["n"]:
        todo = [k for k in range(spec["batches"]) if not Path(out, f"t{t}-N{n}-b{k}.json").exists()]
        if not todo:
            continue
        stale = load(policy_path(args, t - n))
        for k in todo:
            start, commit, started_at = time.time(), code_commit(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
            seed = batch_seed(spec["stage"], t, n, k)
            idx = random.Random(seed).sample(range(len(train["prompt"])), args.shape[0])
            rows = {"prompt": [train["prompt"][i] for i in idx], "solution": [train["solution"][i] for i in idx]}
            sampled = sample_completions(stale, tokenizer, rows, args.shape[1], seed=seed)
            with torch.no_grad():
                old, _ = ga.token_logps(stale, sampled["prompt_ids"], sampled["completion_ids"],
                                        tokenizer.pad_token_id, TEMPERATURE)  # fmt: skip
            logps, mask = ga.token_logps(current, sampled["prompt_ids"], sampled["completion_ids"],
                                         tokenizer.pad_token_id, TEMPERATURE)  # fmt: skip
            advantages = ga.group_advantages(sampled["reward"], args.shape[1])
            grads = ga.loss_gradients(current, logps, old, advantages, mask)
            log_w = ((logps.detach() - old) * mask).sum(-1).clamp(-20, 20)
            positive = advantages > 0
            record = {
                "stage": spec["stage"], "run": args.run, "t": t, "N": n, "batch": k, "seed": seed,
                "rewards": sampled["reward"], "advantages": [round(a, 6) for a in advantages.tolist()],
                "log_w": [round(w, 6) for w in log_w.tolist()], "lengths": mask.sum(-1).int().tolist(),
                "low_w_positives": int((positive & (log_w < -1)).sum()), "positives": int(positive.sum()),
                # k3 estimate of KL(pi_old || pi_theta) per token on pi_old's samples: r - 1 - log r, r = pi_theta / pi_old
                "kl_per_token": float(((torch.expm1(logps.detach() - old) - (logps.detach() - old)) * mask).sum()
                                      / mask.sum()),
                "alignment": {loss: ga.alignment(g, reference) for loss, g in grads.items()},
                "norms": {loss: g.norm().item() for loss, g in grads.items()},
                "reference_norm": reference.norm().item(), "commit": commit, "started_at": started_at,
                "seconds": time.time() - start,
            }  # fmt: skip
            tmp = Path(out, f"t{t}-N{n}-b{k}.json.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, Path(out, f"t{t}-N{n}-b{k}.json"))
            written.append(record)
        del stale
    return {"name": spec["name"], "written": len(written)}


def records(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("t*-N*-b*.json"))]


def run_stage(args, stage: str, ts, ns, batches: int) -> list[dict]:
    out = Path(args.out, stage)
    missing = [p for p in (policy_path(args, s) for t in ts for s in (t, *(t - n for n in ns))) if not Path(p).exists()]
    if missing:
        raise SystemExit(f"missing policy checkpoints (the comparison's {args.run} keeps them): {missing[0]}")
    specs = [{"name": f"{stage}-t{t}", "stage": stage, "t": t, "n": list(ns), "batches": batches, "out": str(out),
              "args": {k: v for k, v in vars(args).items() if k != "func"}} for t in ts]  # fmt: skip
    print(f"{stage}: {len(ts)} checkpoints x {len(ns)} staleness x {batches} batches, {len(records(out))} done",
          flush=True)  # fmt: skip
    run_pool(specs, run_checkpoint, workers=args.workers, done={},
             on_result=lambda i, n, r, s: print(f"  [{i}/{n}] {r['name']}: {r['written']} batches ({s / 60:.0f} min)",
                                                flush=True))  # fmt: skip
    return records(out)


# ---------------------------------------------------------------------------------------------------------------------
# The reading
# ---------------------------------------------------------------------------------------------------------------------

PAIRS = (("respo", "vespo"), ("respo", "dapo"), ("respo", "is"), ("vespo", "dapo"), ("dapo", "is"))
AFTER_RULE = (("vespo", "is"),)  # the one pair the rule did not name: read after it, a pointer only


def finite(value) -> bool:
    """A record's cosine or gain: None or NaN where the batch had no gradient."""
    return value is not None and math.isfinite(value)


def grouped(rows: list[dict], loss: str, metric: str) -> dict[int, list[float]]:
    """``metric`` of ``loss`` per batch, grouped by checkpoint (batches with no gradient left out)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if finite(r["alignment"][loss][metric]):
            out.setdefault(r["t"], []).append(r["alignment"][loss][metric])
    return out


def differences(rows: list[dict], a: str, b: str, metric: str) -> dict[int, list[float]]:
    """Paired ``a - b`` of ``metric`` per batch, grouped by checkpoint (batches with no gradient left out)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        x, y = r["alignment"][a][metric], r["alignment"][b][metric]
        if finite(x) and finite(y):
            out.setdefault(r["t"], []).append(x - y)
    return out


def staleness(rows: list[dict]) -> dict:
    """How stale the batches were (the paper's regime: positives below log W = -1) and how many carry a gradient
    (a batch whose advantages are all 0 has none under any loss)."""
    positives = sum(r["positives"] for r in rows)
    low = sum(r["low_w_positives"] for r in rows)
    log_w = [x for r in rows for x in r["log_w"]]
    with_gradient = [r for r in rows if finite(r["alignment"]["is"]["cos"])]
    return {"with_gradient": len(with_gradient), "positives": positives, "low_w_positives": low,
            "low_w_share": low / positives if positives else None,
            "median_log_w": statistics.median(log_w) if log_w else None,
            "median_kl_per_token": statistics.median(r["kl_per_token"] for r in rows) if rows else None,
            "median_seconds": statistics.median(r["seconds"] for r in rows) if rows else None}  # fmt: skip


def detectable(interval: dict) -> float | None:
    """The true difference this interval would exclude 0 for with 80% power: its half-width x (1.96 + 0.84) / 1.96
    (a normal approximation; with five checkpoints the interval itself is fragile)."""
    if interval["ci"] is None:
        return None
    return (interval["ci"][1] - interval["ci"][0]) / 2 * POWER_Z / 1.96


def verdict(interval: dict) -> str:
    if interval["ci"] is None:
        return "not read"
    if interval["ci"][0] > 0:
        return "closer"
    if interval["ci"][1] < 0:
        return "farther"
    return "no difference shown"


def reading(rows: list[dict]) -> dict:
    """Per staleness, all batches and those whose positives include a low-W one: each loss's mean cosine and gain, and
    every pair's paired difference with its hierarchical 95% interval and the rule's verdict."""
    result = {}
    for n in sorted({r["N"] for r in rows}):
        for subset, keep in (("all", lambda r: True), ("low_w_positives", lambda r: r["low_w_positives"] > 0)):
            chosen = [r for r in rows if r["N"] == n and keep(r)]
            entry = {"batches": len(chosen), "checkpoints": sorted({r["t"] for r in chosen}),
                     "staleness": staleness(chosen), "losses": {}, "pairs": {}}  # fmt: skip
            for loss in ga.LOSSES:
                for metric in ("cos", "gain"):
                    entry["losses"].setdefault(loss, {})[metric] = ga.hierarchical_bootstrap(grouped(chosen, loss, metric))
                cos = [v for values in grouped(chosen, loss, "cos").values() for v in values]
                entry["losses"][loss]["away_share"] = sum(v <= 0 for v in cos) / len(cos) if cos else None
            for a, b in PAIRS + AFTER_RULE:
                for metric in ("cos", "gain"):
                    interval = ga.hierarchical_bootstrap(differences(chosen, a, b, metric))
                    entry["pairs"].setdefault(f"{a} - {b}", {})[metric] = {
                        **interval, "verdict": verdict(interval), "detectable": detectable(interval),
                        "pre_registered": (a, b) in PAIRS}  # fmt: skip
            result[f"N{n} {subset}"] = entry
    return result


def sizing(rows: list[dict]) -> dict:
    """From the pilot: per staleness and for ``respo - vespo`` and ``respo - dapo`` in cosine, the mean difference,
    the sd of the per-batch differences, and the batches a mean difference of that size needs for a 95% interval to
    exclude 0 with 80% power, ``(2.8 sd / |mean|)^2``; spread over the checkpoints of :data:`T` (within
    :data:`BATCH_RANGE`)."""
    table, needed = {}, []
    for n in sorted({r["N"] for r in rows}):
        for a, b in (("respo", "vespo"), ("respo", "dapo")):
            values = [x for v in differences([r for r in rows if r["N"] == n], a, b, "cos").values() for x in v]
            if len(values) < 2:
                continue
            mean, sd = statistics.fmean(values), statistics.stdev(values)
            batches = math.inf if mean == 0 else math.ceil((POWER_Z * sd / abs(mean)) ** 2)
            table[f"N{n} {a} - {b}"] = {"mean": mean, "sd": sd, "batches": batches}
            needed.append(batches)
    worst = max(needed) if needed else math.inf
    per = BATCH_RANGE[1] if not math.isfinite(worst) else min(max(math.ceil(worst / len(T)), BATCH_RANGE[0]), BATCH_RANGE[1])
    return {"pairs": table, "largest_need": worst, "batches_per_checkpoint_and_n": per,
            "resolvable_with_that": {k: v["batches"] <= per * len(T) for k, v in table.items()}}  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """Cosine with the on-policy gradient per loss, by checkpoint, one panel per staleness (a dot per batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.2), squeeze=False)
    colors = {"dapo": "tab:blue", "vespo": "tab:green", "respo": "tab:red", "is": "tab:gray"}
    for ax, n in zip(axes[0], ns):
        for i, loss in enumerate(ga.LOSSES):
            pts = [(r["t"] + 1.2 * (i - 1.5), r["alignment"][loss]["cos"]) for r in rows if r["N"] == n]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, alpha=0.6, color=colors[loss], label=loss)
        ax.axhline(0, color="black", lw=0.6)
        ax.set(title=f"staleness N = {n}", xlabel="checkpoint t (policy updates)",
               ylabel="cosine with the on-policy gradient")  # fmt: skip
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def interval_text(d: dict, spec: str = ".3f") -> str:
    lo, hi = d["ci"] or (None, None)
    return f"{number(d['mean'], spec)} [{number(lo, spec)}, {number(hi, spec)}]"


def markdown(result: dict) -> str:
    header = "| staleness, batches with a gradient | pair | cosine difference [95%] | verdict | detectable at 80% | gain difference [95%] |"
    lines = [header, "|---|---|---|---|---:|---|"]
    for name, entry in result.items():
        for pair, metrics in entry["pairs"].items():
            c, g = metrics["cos"], metrics["gain"]
            if c["ci"] is None:
                continue
            pair = pair if c.get("pre_registered", True) else f"{pair} (after the rule)"
            lines.append(f"| {name} ({c['n']}) | {pair} | {c['mean']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | "
                         f"{c['verdict']} | {c['detectable']:.3f} | {g['mean']:+.3g} [{g['ci'][0]:+.3g}, {g['ci'][1]:+.3g}] |")
    for name, entry in result.items():
        s = entry["staleness"]
        away = ", ".join(f"{k} {number(v['away_share'], '.2f')}" for k, v in entry["losses"].items())
        lines.append(f"\n{name}: {entry['batches']} batches, {s['with_gradient']} with a gradient; "
                     f"{s['low_w_positives']} of {s['positives']} positives below log W = -1; median log W "
                     f"{number(s['median_log_w'], '.2f')}, per-token KL {number(s['median_kl_per_token'], '.3f')}; "
                     f"pointing away (cos <= 0): {away}")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def pilot(args) -> dict:
    rows = run_stage(args, "pilot", args.pilot_t, args.n, args.pilot_batches)
    result = {"sizing": sizing(rows), "reading": reading(rows), "batches": len(rows),
              "command": command("smollm2_mechanism", args.argv)}  # fmt: skip
    Path(args.out, "pilot.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["sizing"], indent=1, default=str))
    return result


def run(args) -> dict:
    path = Path(args.out, "pilot.json")
    if not path.exists():
        raise SystemExit(f"the pilot has not been read ({path} is missing): run the pilot stage first")
    batches = json.loads(path.read_text())["sizing"]["batches_per_checkpoint_and_n"]
    run_stage(args, "run", args.t, args.n, batches)
    return read(args)


def control(args) -> dict:
    run_stage(args, "control", args.t, (0,), args.control_batches)
    return read(args)


def control_reading(rows: list[dict], stale: list[dict] = ()) -> dict:
    """The fresh batches' cosine with the reference (on-policy every loss is the same gradient up to a constant:
    ``is`` stands for all), and how far each loss's stale batches fall below it at each ``N``: not paired batch by
    batch (different batches), but by checkpoint (the same reference)."""
    fresh = grouped(rows, "is", "cos")
    below = {f"N{n} {loss}": ga.hierarchical_difference(fresh, grouped([r for r in stale if r["N"] == n], loss, "cos"))
             for n in sorted({r["N"] for r in stale}) for loss in ga.LOSSES}  # fmt: skip
    return {"batches": len(rows), "with_gradient": sum(len(v) for v in fresh.values()),
            "cos": ga.hierarchical_bootstrap(fresh), "fresh_minus_stale": below,
            "commits": sorted({r["commit"] for r in rows})}  # fmt: skip


def read(args) -> dict:
    rows = records(Path(args.out, "run"))
    result = {"reading": reading(rows), "batches": len(rows), "commits": sorted({r["commit"] for r in rows}),
              "command": command("smollm2_mechanism", args.argv)}  # fmt: skip
    fresh = records(Path(args.out, "control"))
    if fresh:
        result["control"] = control_reading(fresh, rows)
    Path(args.out, "mechanism.json").write_text(json.dumps(result, indent=1, default=str))
    if rows:
        plot(rows, Path(args.out, "mechanism.png"))
    print(markdown(result["reading"]))
    if fresh:
        c = result["control"]
        print(f"\ncontrol (N = 0, after the rule): {c['with_gradient']} of {len(fresh)} fresh batches with a gradient, "
              f"cosine {interval_text(c['cos'])}; fresh minus stale:")  # fmt: skip
        for name, d in c["fresh_minus_stale"].items():
            print(f"  {name}: {interval_text(d, '+.3f')}")
    return result


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["pilot", "run", "read", "control"])
    p.add_argument("--model", default=str(ROOT / MODEL), help="the converted SmolLM2 checkpoint (theta_0)")
    p.add_argument("--work", default=str(WORK), help="where the comparison kept its checkpoints; references go here")
    p.add_argument("--run", default=RUN, help="the on-policy run whose checkpoints are theta_t")
    p.add_argument("--out", default=str(OUT), help="records, JSON, plot (committed)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny model, one batch (the tests)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    s = SMOKE if args.smoke else None
    args.t, args.n = (s["t"], s["n"]) if s else (T, N)
    args.pilot_t, args.pilot_batches = (s["t"], s["batches"]) if s else (PILOT["t"], PILOT["batches"])
    args.reference, args.shape = (s["reference"], s["shape"]) if s else (REFERENCE, SHAPE)
    args.train_problems = s["train_problems"] if s else None
    args.control_batches = s["batches"] if s else CONTROL["batches"]
    return args


def main(argv=None):
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return {"pilot": pilot, "run": run, "read": read, "control": control}[args.stage](args)


if __name__ == "__main__":
    main()
