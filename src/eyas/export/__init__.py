"""Export drafters for SGLang and vLLM, check any EAGLE-3 drafter directory, import third-party ones."""
