"""The recipe's own arguments (``RecipeArguments``: data, task, warm start, evaluation, presets) and the error type of
everything a user fixes. TRL's fields are ``ReSPOConfig``'s and ``trl.ModelConfig``'s; :mod:`.parsing` parses all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class RecipeError(ValueError):
    """A problem with the recipe's input (a flag, a preset, a path, a dataset column) that the user fixes: the recipe
    prints its message as one line and exits non-zero, without a traceback."""


BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = ("arithmetic",)
EVAL_MODES = ("greedy", "sampled", "none")
TINY_MODELS = ("dense", "moe")
# --algorithm: the paper's comparison as one switch, each entry in TRL's own terms (docs/recipes.md, section 4).
ALGORITHMS = {
    "respo": {"loss_type": "respo", "importance_sampling_level": "token"},
    # GRPO with token-level clipping, epsilon 0.2 both sides, token-mean aggregation over the global batch
    "grpo": {"loss_type": "dapo", "importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.2},
    # GSPO as TRL documents it (paper index): sequence-level ratio (length-normalised), sequence clip 3e-4 / 4e-4
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    # VESPO with TRL's defaults (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
    "vespo": {"loss_type": "vespo", "importance_sampling_level": "token"},
}
LAUNCH_PROCESSES = -1  # a bare --dry_run: the process count of the launch it runs under


@dataclass
class RecipeArguments:
    """Script arguments: data, task, warm start, evaluation and the launch a preset was sized for."""

    preset: str | None = field(
        default=None,
        metadata={"help": "Name of a YAML preset in respo_trl/recipe/presets/ (e.g. 'paper-qwen3-1.7b-base' or 'qwen3-4b-epochs4'); same as --config <path>."},
    )
    # -- data -------------------------------------------------------------------------------------------------------
    dataset_name: str = field(
        default="builtin:arithmetic",
        metadata={
            "help": "Training data: 'builtin:arithmetic' (generated locally, see respo_trl.builtin.task), a Hub dataset id "
            "(e.g. 'open-r1/DAPO-Math-17k-Processed') or a local path/data file loadable by datasets.load_dataset."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name used for training."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column of dataset_name holding the problem."})
    answer_column: str = field(
        default="solution", metadata={"help": "Column of dataset_name holding the final answer math-verify grades."}
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Held-out data (e.g. 'HuggingFaceH4/MATH-500'). Unset with the built-in task: its disjoint test "
            "split is used."
        },
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Configuration of eval_dataset_name."})
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name."})
    eval_prompt_column: str = field(default="problem", metadata={"help": "Problem column of eval_dataset_name."})
    eval_answer_column: str = field(default="answer", metadata={"help": "Answer column of eval_dataset_name."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "Optional system message prepended to every prompt (train and held-out)."}
    )
    prompt_template: str = field(
        default="{problem}",
        metadata={
            "help": "User turn built from a text prompt column (train and held-out); {problem} is replaced by the "
            "problem. The paper presets: '{problem} Please reason step by step, and put your final answer within "
            "\\boxed{}.'"
        },
    )
    strip_dapo_instruction: bool = field(
        default=False,
        metadata={
            "help": "Remove DAPO-Math-17k's instruction around each problem ('Solve the following math problem step by "
            "step. The last line of your response should be of the form Answer: $Answer ...' and 'Remember to put your "
            "answer on its own line after \"Answer:\".') before prompt_template is applied, as the paper's data "
            "preparation does (it asks for \\boxed{} instead)."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop training problems whose chat-formatted prompt is longer than this many tokens (the paper: "
            "1,024, verl's filter_overlong_prompts); the count is reported. TRL 1.16 has no prompt-length setting."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows (smoke tests)."}
    )
    # -- built-in task -----------------------------------------------------------------------------------------------
    train_size: int | None = field(
        default=20000,
        metadata={"help": "Built-in task: number of distinct training problems (None: every problem of the split)."},
    )
    heldout_size: int | None = field(
        default=500,
        metadata={"help": "Held-out problems (built-in task: generated; Hub eval set: first N rows; None = all)."},
    )
    heldout_split: str = field(
        default="test",
        metadata={
            "help": "Built-in task: the split the held-out evaluation reads. 'validation' (needs "
            "task_validation_fraction) is where settings are chosen; 'test' is scored once, never to choose.",
            "choices": ["validation", "test"],
        },
    )
    task_min_terms: int = field(default=3, metadata={"help": "Built-in task: fewest operands per problem."})
    task_max_terms: int = field(default=5, metadata={"help": "Built-in task: most operands per problem."})
    task_max_operand: int = field(default=9, metadata={"help": "Built-in task: operands are drawn from 0..N."})
    task_min_operand: int = field(default=0, metadata={"help": "Built-in task: the smallest operand."})
    task_split_by: str = field(
        default="expression",
        metadata={
            "help": "Built-in task: what the train/validation/test hash split is taken of. 'canonical': the problem's "
            "signed terms sorted, so no split holds a re-ordered twin (b+a for a+b) of another's problem. 'answer' "
            "(sums only): canonical forms stratified by answer, so the splits also share their answer distribution.",
            "choices": ["expression", "canonical", "answer"],
        },
    )
    task_test_fraction: float = field(default=0.1, metadata={"help": "Built-in task: share of problems held out for test."})
    task_validation_fraction: float = field(
        default=0.0, metadata={"help": "Built-in task: share of problems held out for validation (0: none)."}
    )
    task_operators: str = field(
        default="+-", metadata={"help": "Built-in task: operators between operands ('+-' or '+')."}
    )
    task_teacher_error_rate: float = field(
        default=0.0,
        metadata={
            "help": "Built-in task: probability that a reference (warm-start) completion forgets a needed carry "
            "(needs task_operators='+'). The answers RL and evaluation grade against are always the true ones."
        },
    )
    task_nuisance: bool = field(
        default=False,
        metadata={
            "help": "Built-in task: reference completions choose each step's form at random (operand order, separator, "
            "an optional '!'), none of which changes the answer: reward-irrelevant entropy, as in long reasoning "
            "(needs task_operators='+'; the regime benchmark's task, docs/benchmarks.md section 5)."
        },
    )
    task_nuisance_swap: bool = field(
        default=True,
        metadata={
            "help": "Built-in task with task_nuisance: whether the operand order is one of the free choices (False: "
            "separators and notes only, the running sum first; a tiny model loses track of the terms otherwise)."
        },
    )
    task_scratchpad: bool = field(
        default=True,
        metadata={"help": "Built-in task: reference completions show the partial results before the boxed answer."},
    )
    task_seed: int = field(
        default=0, metadata={"help": "Seed of the built-in problem sets (fixed across training seeds by default)."}
    )
    # -- tiny model built locally -------------------------------------------------------------------------------------
    tiny_model: str | None = field(
        default=None,
        metadata={
            "help": "Build a random-init tiny Qwen3 locally instead of loading model_name_or_path: 'dense' or 'moe' "
            "(a character tokenizer is built too). Used by the CPU preset.",
            "choices": [*TINY_MODELS, None],
        },
    )
    tiny_hidden_size: int = field(default=128, metadata={"help": "Tiny model: hidden size."})
    tiny_num_layers: int = field(default=4, metadata={"help": "Tiny model: number of decoder layers."})
    tiny_num_heads: int = field(default=4, metadata={"help": "Tiny model: attention heads (2 key/value heads)."})
    tiny_intermediate_size: int = field(default=384, metadata={"help": "Tiny model: MLP width."})
    # -- warm start ---------------------------------------------------------------------------------------------------
    warmstart_steps: int = field(
        default=0,
        metadata={
            "help": "Supervised warm-start steps on the dataset's 'completion' column before RL (0 = none), for a "
            "model built here. The tiny preset imitates an imperfect teacher (task_teacher_error_rate), leaving RL a "
            "habit to fix."
        },
    )
    warmstart_learning_rate: float = field(default=3e-3, metadata={"help": "Warm start: peak AdamW learning rate."})
    warmstart_batch_size: int = field(default=64, metadata={"help": "Warm start: sequences per step."})
    warmstart_shipped: bool = field(
        default=True,
        metadata={
            "help": "Load the warm-started weights the package ships when this run's model, data, seed and warm-start "
            "settings are exactly the ones they were made from (the embedded default at seed 0; respo_trl/recipe/"
            "shipped.py says how they are made and matched); false: train the warm start here."
        },
    )
    # -- rewards ------------------------------------------------------------------------------------------------------
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={
            "help": "Reward functions: 'accuracy' (trl.rewards.accuracy_reward, math-verify), 'reasoning_accuracy' "
            "(the same on the text after </think>), 'format' (one \\boxed{} answer), 'think_format' "
            "(trl.rewards.think_format_reward), 'dapo_accuracy' (+1 correct / -1 otherwise, math-verify; verl's DAPO "
            "reward, the paper's), 'soft_overlong' (trl.rewards.get_soft_overlong_punishment, see soft_overlong_cache) "
            "or a dotted import path. Weights: --reward_weights."
        },
    )
    soft_overlong_cache: int = field(
        default=0,
        metadata={
            "help": "Ramp length of the 'soft_overlong' reward, built as trl.rewards.get_soft_overlong_punishment("
            "max_completion_length, soft_overlong_cache): 0 up to max_completion_length - soft_overlong_cache tokens, "
            "then falling linearly to -1 at max_completion_length (the paper's 30B runs: 4,096 of 8,192)."
        },
    )
    # -- the paper's batch contract and its comparison (paper-* presets) -----------------------------------------------
    prompts_per_update: int | None = field(
        default=None,
        metadata={
            "help": "The paper's mini-batch M: prompts per optimizer update (32; x num_generations completions). When "
            "set, per_device_train_batch_size x processes x gradient_accumulation_steps must equal M x num_generations "
            "on the launch's process count: gradient_accumulation_steps is derived for that count unless given on the "
            "command line, and what does not divide fails before any model loads."
        },
    )
    algorithm: str | None = field(
        default=None,
        metadata={
            "help": "The paper's comparison as one switch: 'respo', 'grpo' (loss_type='dapo': token-level clip, epsilon "
            "0.2, token-mean), 'gspo' (loss_type='grpo', importance_sampling_level='sequence', epsilon 3e-4/4e-4, as "
            "TRL documents GSPO) or 'vespo' (TRL's VESPO defaults). Sets those TRL fields (an explicit conflicting "
            "flag is an error); unset leaves loss_type as given.",
            "choices": [*ALGORITHMS, None],
        },
    )
    # -- held-out evaluation ------------------------------------------------------------------------------------------
    eval_mode: str = field(
        default="greedy",
        metadata={
            "help": "Held-out accuracy before and after training: 'greedy' (HF generate, one greedy answer per "
            "problem), 'sampled' (trainer.evaluate(): num_generations_eval samples per problem at the training "
            "temperature, through vLLM when enabled; mean accuracy) or 'none'.",
            "choices": list(EVAL_MODES),
        },
    )
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Greedy evaluation: token budget per answer (default max_completion_length)."}
    )
    eval_batch_size: int = field(default=128, metadata={"help": "Greedy evaluation: prompts per generate call."})
    heldout_eval_steps: int = field(
        default=0,
        metadata={
            "help": "Greedy mode: also measure held-out accuracy every N optimizer steps for the accuracy-vs-tokens "
            "plot (0 = before and after only). Sampled mode: use --eval_strategy steps --eval_steps N instead."
        },
    )
    heldout_eval_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Greedy mode: a held-out point each time the completion tokens sampled pass another multiple of "
            "this, instead of every heldout_eval_steps steps (curves of reuse settings at equal sampling cost)."
        },
    )
    max_generated_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Stop training once this many completion tokens were sampled (summed over processes), at the "
            "first step after which the next micro-batch would sample a new rollout batch, so no batch is cut short "
            "by the budget; max_steps still caps the run. Compares reuse settings at an equal sampling budget."
        },
    )
    heldout_curve_size: int | None = field(
        default=None, metadata={"help": "Held-out problems used for the in-training points (None = all)."}
    )
    save_at_steps: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Also save a complete checkpoint after each of these optimizer steps, besides save_strategy's (a "
            "policy a given number of updates after a rollout batch was sampled: the staleness probe of "
            "benchmarks/smollm2_staleness.py).",
            "nargs": "+",
        },
    )
    keep_best_heldout: bool = field(
        default=False,
        metadata={
            "help": "Greedy mode with heldout_eval_steps: save the weights at the best in-training held-out point to "
            "output_dir/checkpoint-best-heldout (a checkpoint-* folder: a push leaves it out) and measure them on the whole held-out set at the end, so the report shows the "
            "best and the final checkpoint (RL curves on small models can peak before the last step). Without "
            "in-training points it does nothing."
        },
    )
    # -- the launch this preset was sized for -------------------------------------------------------------------------
    expected_num_processes: int | None = field(
        default=None,
        metadata={"help": "GPU (process) count the preset's batch arithmetic was sized for; a mismatch is reported."},
    )
    accelerate_config: str | None = field(
        default=None, metadata={"help": "The recipes/accelerate/ config the preset expects (documentation + report)."}
    )
    compact_progress: bool = field(
        default=True,
        metadata={"help": "One progress bar with reward/accuracy instead of printing every log dict."},
    )
    dry_run: int = field(
        default=0,
        metadata={
            "help": "Check the configuration as it would run on this many processes, print the batch arithmetic in "
            "TRL's and the paper's terms, and exit without loading a model, tokenizer or dataset (0: train; a bare "
            "--dry_run: the launch's process count, 1 without a launcher).",
            "nargs": "?",
            "const": LAUNCH_PROCESSES,
        },
    )
