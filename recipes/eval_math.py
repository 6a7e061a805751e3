"""Evaluate a checkpoint on math benchmarks (avg@n, unbiased pass@k, maj@n), graded like the training reward.

    python recipes/eval_math.py --model outputs/qwen3-respo --benchmarks math500 aime24 aime25 amc23 --n 16
    python recipes/eval_math.py --model outputs/qwen3-tiny-respo      # the embedded default, as it trained

Every option, the benchmarks and the paper's protocol: the package ``respo_trl/recipe/eval_math/`` (the code; its
``__init__`` lists one module per job) and docs/evaluation.md. Bad input ends as the training recipe's does: one
``error: ...`` line, exit status 2.
"""

from respo_trl.recipe.eval_math import cli

if __name__ == "__main__":
    cli()
