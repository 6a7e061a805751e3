"""The model's completions: vLLM's offline engine on a GPU, transformers' ``generate`` elsewhere (and in the tests).

Why one interface: every backend returns, for each prompt, ``n`` pairs ``(text, tokens)`` (``tokens``: the generated
length, the end-of-sequence token included), so grading, length bins and the report do not know which one ran, and
the tests can feed known completions through the same path (``main(generate=...)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..arguments import RecipeError

logger = logging.getLogger("eval_math")


@dataclass
class Sampling:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    import torch

    return torch.cuda.is_available()


def pick_backend(name: str) -> str:
    """``--backend``: ``auto`` is vLLM when it is installed and a GPU is visible, else transformers."""
    if name == "auto":
        return "vllm" if vllm_available() else "transformers"
    return name


def check_model(model: str) -> None:
    """A ``--model`` that is neither an existing model folder nor a Hub id fails here, in one line."""
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or path.exists() or model.count("/") != 1
    if not looks_local:
        return  # a Hub id: its download errors are reported when its tokenizer is loaded
    if not path.exists():
        raise RecipeError(f"--model {model!r}: no such directory (a local model folder, or a Hub id owner/name)")
    if not (path / "config.json").is_file():
        raise RecipeError(f"--model {model!r}: not a model folder (no config.json); pass a training output_dir or a snapshot")


def load_transformers_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, revision=args.revision, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )
    if device == "cpu" and sum(p.numel() for p in model.parameters()) < 50_000_000:
        from ..model import use_one_cpu_thread

        use_one_cpu_thread(logger, "small model on CPU")
    return model.to(device).eval()


def generate_transformers(
    model, tokenizer, prompts: list[str], sampling: Sampling, batch_size: int
) -> list[list[tuple[str, int]]]:
    """``n`` completions per prompt, each ``(text, tokens)``, with the recipe's generation helper
    (:func:`respo_trl.recipe.generation.generate`: ``model.generate`` in left-padded batches of ``batch_size``
    sequences, the longest prompts first, a bar counting sequences); ``tokens`` is the generated length up to and
    including the end-of-sequence token (``max_new_tokens`` when cut off)."""
    from ..generation import generate

    texts, lengths = generate(
        model, tokenizer, prompts, max_new_tokens=sampling.max_new_tokens, batch_size=batch_size,
        do_sample=sampling.temperature > 0, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, samples_per_prompt=sampling.n, seed=sampling.seed, longest_first=True, progress=True,
    )  # fmt: skip
    n = sampling.n
    return [list(zip(texts[i : i + n], lengths[i : i + n])) for i in range(0, len(texts), n)]


def load_vllm(args, seed: int):
    """The vLLM engine, built once per run (it is reused for every benchmark)."""
    from vllm import LLM

    return LLM(
        model=args.model,
        revision=args.revision,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=seed,
        trust_remote_code=args.trust_remote_code,
    )


def generate_vllm(llm, tokenizer, prompts: list[str], sampling: Sampling) -> list[list[tuple[str, int]]]:
    """``n`` completions per prompt, each ``(text, tokens)``, with vLLM's offline ``LLM.generate`` (its own tqdm bar).
    Prompts are passed as token ids, as TRL does, so the chat template's tokens are not re-tokenised with extra special
    tokens; ``tokens`` is ``len(output.token_ids)`` (the end-of-sequence token included when generated)."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
        top_k=sampling.top_k
        if sampling.top_k > 0
        else -1,  # -1 disables top-k in every vLLM release (0 only in newer)
        max_tokens=sampling.max_new_tokens,
    )
    requests = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
    results = llm.generate(requests, sampling_params=params, use_tqdm=True)
    return [[(completion.text, len(completion.token_ids)) for completion in result.outputs] for result in results]


def load_generate(backend: str, args, tokenizer):
    """The model of ``args.model`` loaded once for ``backend``, as ``generate(prompts, sampling) -> completions``."""
    if backend == "transformers":
        model = load_transformers_model(args)
        return lambda prompts, sampling: generate_transformers(model, tokenizer, prompts, sampling, args.batch_size)
    llm = load_vllm(args, args.seed)
    return lambda prompts, sampling: generate_vllm(llm, tokenizer, prompts, sampling)


def split_generated(generated, tokenizer) -> tuple[list[list[str]], list[list[int]]]:
    """Texts and token lengths from a backend's output. A ``generate`` callable may return plain strings (the tests'
    canned completions); their length is then the number of tokens the tokenizer gives the text (no special tokens)."""
    texts, lengths = [], []
    for row in generated:
        texts.append([c if isinstance(c, str) else c[0] for c in row])
        lengths.append(
            [len(tokenizer(c, add_special_tokens=False).input_ids) if isinstance(c, str) else int(c[1]) for c in row]
        )
    return texts, lengths
