"""The trainer side of MoE Routing Replay (R3): ``GRPOTrainer`` hook overrides that record the sampler's routing in
``_generate`` and replay it in every log-prob forward, and the generation settings under which it cannot be recorded.

The engine (recording, layout, replay; pure torch) is :mod:`respo_trl.routing_replay`. This module is written against
TRL 1.16's method names and the exact signature of ``_get_per_token_logps_and_entropies`` (``tests/test_trainer.py``
compares them), without importing TRL, so a TRL release that renames a hook shows up in one file.
"""

from __future__ import annotations

from contextlib import nullcontext

from .routing_replay import ROUTES_KEY, RoutingReplay


def config_problems(args) -> list[str]:
    """Why the generation configured by ``args`` (a TRL ``GRPOConfig``) cannot be recorded; empty if it can."""
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(
            "use_vllm=True: TRL 1.16 starts vLLM without enable_return_routed_experts and keeps only token ids and "
            "logprobs of its outputs, so the sampler's routing never reaches the trainer. Set use_vllm=False "
            "(transformers generate is recorded) or respo_routing_replay=False; docs/moe.md lists what TRL would need"
        )
    if getattr(args, "use_transformers_continuous_batching", False) or getattr(args, "use_transformers_paged", False):
        problems.append(
            "use_transformers_continuous_batching=True: generate_batch schedules requests itself and is not recorded; "
            "set it to False"
        )
    return problems


class RoutingReplayMixin:
    """GRPOTrainer hook overrides that record routing in ``_generate`` and replay it in every log-prob forward.

    Put it before ``GRPOTrainer`` in the bases and set ``self.routing_replay`` (a :class:`RoutingReplay`, or None
    to do nothing) after ``GRPOTrainer.__init__``. Written against TRL 1.16's method names, without importing TRL:

    - ``_generate``: runs TRL's generation inside :meth:`RoutingReplay.recording` and keeps per-sequence routes;
    - ``_get_per_token_logps_and_entropies``: every log-prob forward (old log-probs, reference through the same
      modules, the loss) replays the routes of its rows;
    - ``_generate_and_score_completions``: stores the batch's routes as ``ROUTES_KEY`` (``(B, P + C, L, k)`` int16),
      so they follow the rows through shuffling, micro-batching, the rollout buffer and its checkpoints;
    - ``_compute_loss``: serves the micro-batch's routes and logs ``routing/drift`` (share of replayed token-layer
      slots whose free top-k would differ from the replayed one) and ``routing/drift_tokens`` (share of tokens that
      differ in at least one MoE layer), summed over processes.
    """

    routing_replay: RoutingReplay | None = None

    @classmethod
    def attach_routing_replay(cls, trainer) -> RoutingReplay:
        """Validate ``trainer``'s generation setup and model, and return a :class:`RoutingReplay` on its model."""
        problems = config_problems(trainer.args)
        if getattr(trainer, "tools", None):
            problems.append("tools: the multi-turn tool loop calls generate several times per batch; not recorded")
        if getattr(trainer, "rollout_func", None) is not None:
            problems.append("rollout_func: a custom rollout does not go through the recorded generate call")
        if problems:
            raise ValueError("respo_routing_replay=True cannot record the sampler's routing: " + "; ".join(problems))
        return RoutingReplay(trainer.accelerator.unwrap_model(trainer.model))

    def routing_batch(self, inputs: dict):
        """Context in which log-prob forwards replay the routes stored in ``inputs`` (no-op when replay is off)."""
        return self.routing_replay.batch(inputs) if self.routing_replay is not None else nullcontext()

    def _generate(self, prompts):
        replay = self.routing_replay
        if replay is None:
            return super()._generate(prompts)
        with replay.recording():
            output = super()._generate(prompts)
        replay.finish(output[0], output[1])  # prompt_ids, completion_ids (lists)
        return output

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.routing_replay is not None:
            output[ROUTES_KEY] = self.routing_replay.take_layout(output["prompt_ids"], output["completion_ids"])
        return output

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        # TRL 1.16's exact signature (tests/test_trainer.py compares them), passed through by keyword
        kwargs = dict(
            batch_size=batch_size, compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
            pixel_values=pixel_values, image_grid_thw=image_grid_thw, num_images=num_images,
            pixel_attention_mask=pixel_attention_mask, spatial_shapes=spatial_shapes, num_tiles=num_tiles,
            image_sizes=image_sizes, token_type_ids=token_type_ids, mm_token_type_ids=mm_token_type_ids,
            image_position_ids=image_position_ids,
        )  # fmt: skip
        replay = self.routing_replay
        if replay is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)
        with replay.replaying(input_ids, replay.forward_routes(input_ids, logits_to_keep)):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)

    def _compute_loss(self, model, inputs):
        replay = self.routing_replay
        if replay is None:
            return super()._compute_loss(model, inputs)
        with replay.batch(inputs):
            loss = super()._compute_loss(model, inputs)
        stats = self.accelerator.reduce(replay.last_stats.to(self.accelerator.device), "sum").float()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["routing/drift"].append((stats[0] / stats[1].clamp(min=1)).item())
        self._metrics[mode]["routing/drift_tokens"].append((stats[2] / stats[3].clamp(min=1)).item())
        return loss
