import os
import sys
from pathlib import Path

# Tests never reach a model hub: everything is built from configs or shipped in PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

# The real-vLLM tests start vLLM engines (minutes each) from a venv of their own: `make test-vllm` runs them by path
# (a path named on the command line is collected even when listed here); a plain `pytest tests` leaves them out.
collect_ignore = ["test_vllm_real.py"]
