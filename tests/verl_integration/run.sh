#!/usr/bin/env bash
# Build the verl test environment and run the verl integration tests in it (CPU only, no network beyond PyPI).
#
# verl 0.9.1 needs transformers<5.11 while TRL 1.16 needs >=5.24, so the verl tests get a virtual environment of their
# own: torch==2.13.0 first (the CPU build), then requirements/verl.txt, then respo_trl itself with --no-deps (its base
# dependencies are TRL's stack). The README's test command calls this script after the main suite.
#
#   bash tests/verl_integration/run.sh                 # build .venv-verl (or reuse it) and run the tests
#   VERL_VENV=/path/to/env bash tests/verl_integration/run.sh -k plugin   # another location; extra pytest args
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${VERL_VENV:-.venv-verl}"
start=$(date +%s)
source tests/venv.sh
make_venv "$venv"   # torch==2.13.0 (CPU) first and pinned
"$py" -m pip install --quiet -r requirements/verl.txt
"$py" -m pip install --quiet --no-deps -e .         # registers the verl.plugins entry point
echo "verl environment ready in $(( $(date +%s) - start )) s ($venv)"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# -o addopts: the main run's addopts ignore this folder. The last line of output is pytest's own summary, with its time.
exec "$py" -m pytest -q -o addopts=-ra tests/verl_integration "$@"
