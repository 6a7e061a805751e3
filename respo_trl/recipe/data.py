"""The recipe's data: the built-in task (:mod:`respo_trl.builtin.task`), Hub or local datasets, their columns checked
first, prompts as chats.

Every training row ends up with a conversational ``prompt`` and the answer math-verify grades in ``solution`` (plus a
reference ``completion`` for the warm start, when the dataset has one); the held-out set has the same two columns.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..builtin.task import ArithmeticTask, check_answer_balance, check_disjoint
from .arguments import BUILTIN_PREFIX, RecipeArguments, RecipeError

# DAPO-Math-17k's instruction around every problem (it asks for an "Answer:" line); the paper's data preparation
# removes it and asks for \boxed{} instead (--strip_dapo_instruction, --prompt_template).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'



def strip_dapo_instruction(text: str) -> str:
    """A DAPO-Math-17k problem without the instruction around it (its 'Answer:' preamble and closing line)."""
    return text.replace(DAPO_PREFIX, "").replace(DAPO_SUFFIX, "").strip()


def to_conversation(problem, system_prompt: str | None, template: str = "{problem}", strip_dapo: bool = False):
    """A chat prompt: a text problem becomes the user turn ``template.format(problem=...)`` (after removing the DAPO
    instruction when ``strip_dapo``); a conversation is kept as it is. ``system_prompt`` is prepended when set."""
    if isinstance(problem, list):
        messages = list(problem)
    else:
        text = strip_dapo_instruction(str(problem)) if strip_dapo else str(problem)
        messages = [{"role": "user", "content": template.replace("{problem}", text)}]
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def drop_long_prompts(dataset, tokenizer, max_tokens: int, chat_template_kwargs: dict | None = None):
    """``(dataset, dropped)``: rows whose chat-formatted prompt (as TRL tokenises it: chat template with the generation
    prompt) is longer than ``max_tokens`` tokens are removed, like verl's ``filter_overlong_prompts``."""
    kwargs = json.loads(chat_template_kwargs) if isinstance(chat_template_kwargs, str) else chat_template_kwargs or {}

    def fits(row):
        ids = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True, **kwargs)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return len(ids) <= max_tokens

    kept = dataset.filter(fits)
    return kept, len(dataset) - len(kept)


def load_split(name: str, config: str | None, split: str, prompt_column: str, answer_column: str, what: str):
    """``load_dataset`` (Hub id, local dir or data file), with the columns checked before anything else runs."""
    from datasets import load_dataset

    path = Path(name)
    try:
        if path.is_file():
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if builder is None:
                raise RecipeError(f"unsupported data file type {path.suffix!r} (use .jsonl, .json, .parquet or .csv)")
            dataset = load_dataset(builder, data_files=str(path), split="train")
        else:
            dataset = load_dataset(name, name=config, split=split)
    except (FileNotFoundError, ValueError, OSError, ConnectionError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(f"cannot load the {what} dataset {name!r} (split {split!r}): {first}") from error
    prefix = "eval_" if what == "held-out" else ""
    missing = [(kind, c) for kind, c in (("prompt", prompt_column), ("answer", answer_column)) if c not in dataset.column_names]
    if missing:
        raise RecipeError(
            f"the {what} dataset {name!r} has no column "
            + " and no column ".join(f"{c!r} (set --{prefix}{kind}_column)" for kind, c in missing)
            + f"; its columns: {dataset.column_names}"
        )
    return dataset


def as_chat_rows(raw, prompt_column: str, answer_column: str, script_args: RecipeArguments, keep=frozenset()):
    """Rows of ``raw`` as a chat ``prompt`` (the recipe's system prompt, template and DAPO stripping) and a string
    ``solution``; the columns in ``keep`` stay, every other one goes."""
    system, template, strip = script_args.system_prompt, script_args.prompt_template, script_args.strip_dapo_instruction
    return raw.map(
        lambda row: {
            "prompt": to_conversation(row[prompt_column], system, template, strip),
            "solution": str(row[answer_column]),
        },
        remove_columns=[c for c in raw.column_names if c not in keep],
    )


def build_datasets(script_args: RecipeArguments):
    """(train, held-out) datasets with a conversational ``prompt`` and the answer in ``solution``."""
    from datasets import Dataset

    system, template = script_args.system_prompt, script_args.prompt_template
    if "{problem}" not in template:
        raise RecipeError(f"prompt_template {template!r} has no {{problem}} placeholder")
    if script_args.dataset_name.startswith(BUILTIN_PREFIX):
        task = ArithmeticTask.from_settings(script_args)
        try:
            train = task.rows("train", script_args.train_size, seed=script_args.task_seed)
            heldout = task.rows(script_args.heldout_split, script_args.heldout_size, seed=script_args.task_seed)
            # a split made to choose settings on (validation) or promised clean (canonical) is checked on what the
            # run will see: a held-out b+a whose a+b is trained on is not held out
            problems = lambda rows: [p[-1]["content"] for p in rows["prompt"]]  # noqa: E731
            if task.split_by != "expression" or task.validation_fraction:
                check_disjoint({"train": problems(train), script_args.heldout_split: problems(heldout)})
            whole = script_args.train_size is None and script_args.heldout_size is None
            if task.split_by == "answer" and whole:  # promised: held-out answers distributed as the training ones
                check_answer_balance({"train": problems(train), script_args.heldout_split: problems(heldout)})
        except ValueError as error:
            raise RecipeError(str(error)) from error
        for rows in (train, heldout):  # the task's one user turn is the problem: the template and system turn apply
            rows["prompt"] = [to_conversation(p[-1]["content"], system, template) for p in rows["prompt"]]
        train, heldout = Dataset.from_dict(train), Dataset.from_dict(heldout)
    else:
        raw = load_split(
            script_args.dataset_name,
            script_args.dataset_config,
            script_args.dataset_train_split,
            script_args.prompt_column,
            script_args.answer_column,
            "training",
        )
        if script_args.max_train_samples:
            raw = raw.select(range(min(script_args.max_train_samples, len(raw))))
        # a reference completion enables --warmstart_steps
        train = as_chat_rows(raw, script_args.prompt_column, script_args.answer_column, script_args, keep={"completion"})
        heldout = None
    if script_args.eval_dataset_name:
        raw = load_split(
            script_args.eval_dataset_name,
            script_args.eval_dataset_config,
            script_args.eval_dataset_split,
            script_args.eval_prompt_column,
            script_args.eval_answer_column,
            "held-out",
        )
        if script_args.heldout_size:
            raw = raw.select(range(min(script_args.heldout_size, len(raw))))
        heldout = as_chat_rows(raw, script_args.eval_prompt_column, script_args.eval_answer_column, script_args)
    return train, heldout


def load_datasets(script_args: RecipeArguments, training_args, model_args, tokenizer, logger):
    """(train, held-out, dropped): :func:`build_datasets`, minus training prompts longer than ``max_prompt_length``
    tokens (measured with the model's tokenizer, loaded alone when the trainer will load the model)."""
    from .model import load_tokenizer

    train_dataset, heldout = build_datasets(script_args)
    dropped = 0
    if script_args.max_prompt_length:
        length_tokenizer = tokenizer or load_tokenizer(
            model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code
        )
        train_dataset, dropped = drop_long_prompts(
            train_dataset, length_tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs
        )
        if len(train_dataset) == 0:
            raise RecipeError(f"every training prompt is longer than --max_prompt_length {script_args.max_prompt_length}")
        logger.info(f"dropped {dropped} training prompts longer than {script_args.max_prompt_length} tokens",
                    main_process_only=True)  # fmt: skip
    return train_dataset, heldout, dropped


def check_datasets(script_args: RecipeArguments, reward_funcs, accuracy_fn, train_dataset, heldout) -> None:
    """A held-out set where the run measures one, and every reward on a few training rows (the accuracy reward on
    held-out rows too) before compute is spent (:func:`respo_trl.rewards.probe_rewards`)."""
    from ..rewards import probe_rewards

    if script_args.eval_mode != "none" and heldout is None:
        raise RecipeError("no held-out set: set --eval_dataset_name (e.g. HuggingFaceH4/MATH-500) or --eval_mode none")
    accuracy = [accuracy_fn] if accuracy_fn else []
    probe_rewards(reward_funcs, train_dataset.select(range(min(8, len(train_dataset)))).to_dict(), "solution",
                  accuracy_funcs=accuracy)  # fmt: skip
    if heldout is not None and accuracy_fn is not None:
        probe_rewards([accuracy_fn], heldout.select(range(min(8, len(heldout)))).to_dict(), "solution",
                      accuracy_funcs=accuracy)  # fmt: skip
