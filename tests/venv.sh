# Sourced by the integration-test runners (tests/verl_integration/run.sh, tests/vllm_integration/run.sh): a virtual
# environment of their own at "$1" (created if missing), pip upgraded, and the verified CPU build of torch installed
# FIRST and pinned: an unpinned torch, asked for by any later requirement, pulls a multi-GB CUDA build.
# Sets `py` to the environment's python.
make_venv() {
  if [ ! -x "$1/bin/python" ]; then
    python3 -m venv "$1"
  fi
  py="$1/bin/python"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet torch==2.13.0
}
