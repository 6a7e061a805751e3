"""The recipe's flow, top to bottom, in the shape of TRL's ``trl/scripts/grpo.py``: what ``recipes/qwen3_respo.py``
runs. Parse (once) and check everything that can be checked before compute is spent; build the rewards, the model
and the data; warm-start a model built here; train with ``ReSPOTrainer`` between two held-out measurements; save and
write the run's report. The pieces are the neighbouring modules: :mod:`.parsing` (presets, checks), :mod:`.data`,
:mod:`.model`, :mod:`.heldout` (``HeldoutEvaluator``), :mod:`.report` (``RunReport``) and :mod:`.cli`.
"""

from __future__ import annotations

import os
import time

from ..hub.card import write_trainer_card
from ..hub.push import creating_repository, push_to_hub
from ..rewards import ACCURACY_REWARDS
from .arguments import RecipeArguments
from .checks import build_reward
from .cli import Interrupted, one_line_errors
from .data import check_datasets, load_datasets
from .heldout import HeldoutEvaluator, make_callbacks
from .model import build_model, pick_cpu_threads, run_warm_start
from .parsing import parse_args, plan_table
from .report import RunReport, log_launch


def main(script_args: RecipeArguments, training_args, model_args) -> dict:
    started = time.time()
    import torch
    from accelerate import PartialState
    from accelerate.logging import get_logger
    from transformers import ProgressCallback, set_seed
    from trl import get_peft_config

    from respo_trl import ReSPOTrainer

    logger = get_logger(__name__)
    state = PartialState()
    pick_cpu_threads(training_args, script_args.tiny_model is not None, logger)
    log_launch(script_args, training_args, state.num_processes, logger)
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the latest complete checkpoint in output_dir
    set_seed(training_args.seed)

    # -- 1. rewards, model, data: cheap to build, checked before any weights load -------------------------------------
    reward_funcs = [build_reward(name, script_args, training_args) for name in script_args.reward_funcs]
    accuracy_fn = next((f for n, f in zip(script_args.reward_funcs, reward_funcs) if n in ACCURACY_REWARDS), None)
    model, tokenizer, model_name, model_info = build_model(script_args, training_args, model_args, logger)
    with state.main_process_first():
        train_dataset, heldout, dropped = load_datasets(script_args, training_args, model_args, tokenizer, logger)
    check_datasets(script_args, reward_funcs, accuracy_fn, train_dataset, heldout)

    # -- 2. warm start: a short supervised fine-tune on reference completions (a model built here, not on resume) -----
    warm = run_warm_start(model, tokenizer, train_dataset, script_args, training_args, accuracy_fn, resume,
                          show_progress=state.is_main_process)  # fmt: skip
    if "completion" in train_dataset.column_names:
        train_dataset = train_dataset.remove_columns("completion")  # RL sees prompts and answers only

    # -- 3. the trainer, held-out accuracy of its current weights, and the run's report ------------------------------
    evaluates_in_trainer = script_args.eval_mode == "sampled" or training_args.eval_strategy != "no"
    with creating_repository(training_args):  # push_to_hub=True creates the Hub repository here
        trainer = ReSPOTrainer(
            model=model, reward_funcs=reward_funcs, args=training_args, train_dataset=train_dataset,
            eval_dataset=heldout if evaluates_in_trainer else None, processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
        )  # fmt: skip
    trainer.card_writer = write_trainer_card  # ReSPO's card at every save and push (the kernel, the measured numbers)
    evaluator = HeldoutEvaluator(trainer, script_args, training_args, heldout, accuracy_fn)
    report = RunReport(script_args, training_args, model_args, model_name, model_info, trainer, state.num_processes,
                       resume, is_main=state.is_main_process)  # fmt: skip
    report.record_inputs(train_dataset, heldout, dropped, warm)
    if resume:  # the points the interrupted run measured, up to the checkpoint it resumes from
        report.resume_curve(resume)
    if script_args.compact_progress and not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
    for callback in make_callbacks(report, evaluator, set(script_args.save_at_steps), script_args.max_generated_tokens):
        trainer.add_callback(callback)

    # -- 4. held-out accuracy before RL (a resumed run kept the first run's), RL, held-out accuracy after ------------
    with report.timed("heldout_eval"):
        if evaluator.enabled and not resume:
            report.before(evaluator.measure(keep_answers=True))
            before = report.data["heldout"]["before_detail"]
            trainer.accelerator.print(f"held-out accuracy before RL: {100 * before['accuracy']:.1f}% (n={before['n']})")
    with report.timed("train"):
        try:
            train_result = trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            raise Interrupted(trainer) from None
    with report.timed("heldout_eval"):
        if evaluator.enabled:
            report.after(*evaluator.after_training(report.curve))

    # -- 5. save (the best in-training checkpoint measured on the whole held-out set too), report, push --------------
    trainer.save_model(training_args.output_dir)
    if evaluator.enabled:
        with report.timed("heldout_eval"):
            report.best(evaluator.best_checkpoint(report.curve, training_args.output_dir))
    trainer.save_state()  # trainer_state.json: the full log history the plots are drawn from
    result = report.finish(train_result, evaluator.sampled, started)
    if training_args.push_to_hub:
        push_to_hub(trainer, dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"pushed to https://huggingface.co/{trainer.hub_model_id}")
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def cli(argv: list[str] | None = None, configs_dir: str | os.PathLike | None = None) -> dict | None:
    """The command line: parse and check, then train (or print the batch plan with ``--dry_run [P]``)."""
    with one_line_errors(parsing=True):
        parsed = parse_args(argv, **({"configs_dir": configs_dir} if configs_dir is not None else {}))
    if parsed[0].dry_run:
        print(plan_table(*parsed))
        return None
    with one_line_errors(output_dir=parsed[1].output_dir):
        return main(*parsed)
