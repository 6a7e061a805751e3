"""TEST ENVIRONMENT ONLY: with this folder on ``PYTHONPATH``, a Python subprocess of the vLLM tests (``accelerate
launch recipes/qwen3_respo.py ...``) gets the CPU-only weight-sync workaround of ``../cpu_weight_sync.py`` as soon
as it imports vLLM, exactly as the in-process tests do. Nothing is imported at startup."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "cpu_weight_sync.py"
_spec = importlib.util.spec_from_file_location("cpu_weight_sync", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.install_on_import()
