"""Runs inside vLLM's virtualenv (not eyas'): greedy generation of given prompt token ids, with or
without an EAGLE-3 drafter, and vLLM's own spec_decode counters. Called by vllm_eagle3_acceptance.py.

    python vllm_greedy_worker.py TARGET_DIR PROMPTS_JSON OUT_JSON MAX_NEW_TOKENS [DRAFT_DIR K]

No eyas import here: this interpreter has vLLM's torch, and what it measures must be vLLM's alone.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


if __name__ == "__main__":
    target, prompts_path, out_path, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    draft, k = (sys.argv[5], int(sys.argv[6])) if len(sys.argv) > 6 else (None, 0)
    prompts = json.loads(open(prompts_path).read())
    speculative = {"method": "eagle3", "model": draft, "num_speculative_tokens": k} if draft else None
    # fp32 like eyas' CPU side; eager (no graphs on CPU); one sequence at a time so that batching
    # cannot change what is drafted or accepted
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1,
              disable_log_stats=False, speculative_config=speculative, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=False)
    start = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.time() - start
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds, "counters": counters(llm),
              "draft": draft, "k": k}
    with open(out_path, "w") as f:
        json.dump(result, f)
