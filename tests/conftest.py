import os
import sys
from pathlib import Path

# Tests never reach a model hub: everything is built from configs or shipped in PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))
