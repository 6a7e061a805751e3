"""The names of the files a recipe run and an evaluation leave in their output directory, defined once for the modules
that write them (:mod:`respo_trl.recipe.report`, :mod:`respo_trl.recipe.eval_math`, :mod:`respo_trl.hub.card`) and
those that read them (the model card reads ``report.json`` and ``eval_math.json``; the evaluator reads a run's
``report.json`` for its defaults).

Why a module of its own: a writer and its reader cannot drift apart when both import the same name, and the Hub side
(:mod:`respo_trl.hub`) can read a run's files without importing the recipe, which imports the Hub side to write the
card. This module imports nothing.
"""

# -- a training run (respo_trl.recipe) ---------------------------------------------------------------------------------
REPORT_FILE = "report.json"  # every measured number, with the arguments (read by the model card and eval_math)
CURVE_FILE = "heldout_curve.json"  # every held-out point as it is measured: a resumed run keeps the curve
# every greedy held-out answer of each point, one JSON line per point ({"step", "answers"}), appended as measured: how a
# policy fails (lengths, the form of wrong answers) is read here. After a resume a step may appear twice; the last wins.
ANSWERS_FILE = "heldout_answers.jsonl"
CURVES_FILE = "training_curves.png"  # the model card's plot of the log history (respo_trl.hub.card writes it)

# -- a benchmark evaluation (respo_trl.recipe.eval_math) ---------------------------------------------------------------
RESULTS_JSON = "eval_math.json"  # every setting, the command, versions, metrics, length bins (read by the model card)
RESULTS_MD = "eval_math.md"  # the same results as tables
SAMPLES_JSONL = "eval_math_samples.jsonl"  # every completion, with --save_samples
LENGTH_PLOT = "eval_math_length_bins.png"
PREVIOUS_JSON = "eval_math.previous-{index}.json"  # an earlier RESULTS_JSON (and its .md), moved aside, never replaced
