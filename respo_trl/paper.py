"""The paper this package implements, as its trainer, cards and tags name it (no imports: anything may use it)."""

import textwrap

ARXIV_ID = "2609.35433"
TITLE = "ReSPO: Reshaped Sequence Policy Optimization for Gradient Starvation in Off-Policy Learning"
TRAINER_TAGS = ("trl", "grpo", "respo", "rlvr", "reinforcement-learning")  # ReSPOTrainer's Hub tags
RESPO_CITATION = textwrap.dedent("""\
    @article{respo2026,
        title        = {{ReSPO: Reshaped Sequence Policy Optimization for Gradient Starvation in Off-Policy Learning}},
        author       = {Chen and Ban and Hsieh},
        year         = 2026,
        eprint       = {arXiv:2609.35433},
    }""")
