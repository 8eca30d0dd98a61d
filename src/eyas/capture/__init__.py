"""The capture stage: DATA_DIR → FEATURES_DIR, in-process (HF) or through vLLM (a client and its worker)."""
