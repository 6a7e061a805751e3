"""Benchmark evaluation of a checkpoint: what ``python recipes/eval_math.py`` runs (see :mod:`.run`).

``respo_trl/recipe/eval_math.py`` moved here as :mod:`.run` (unchanged but for its relative imports, one level
deeper), so its history follows the file; the next commit splits it into one module per job. Every public name stays
importable from ``respo_trl.recipe.eval_math``.
"""

from .run import *
