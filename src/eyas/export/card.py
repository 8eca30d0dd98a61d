"""The README.md model card of an exported drafter: what it is for, how it was made, how to serve it."""

from __future__ import annotations


def model_card(config: dict, train_options: dict, report: dict, name: str) -> str:
    """Markdown: target, data, training, measured acceptance, and the serving command lines."""
    target = train_options.get("target", "?")
    data = train_options.get("features") or train_options.get("data") or "?"
    final = report.get("final_eval") or {}
    acceptance = ", ".join(f"{a:.3f}" for a in final.get("acceptance_cumulative", [])) or "not evaluated"
    tau = f"{final['tau']:.2f}" if "tau" in final else "not evaluated"
    start = f"{final['tau_answer_start']:.2f}" if "tau_answer_start" in final else "not evaluated"
    ids = config.get("eagle_aux_hidden_state_layer_ids") or "engine defaults (2, N//2, N-3)"
    return f"""# {name}: EAGLE-3 drafter for {target}

Trained with [eyas](https://pypi.org/project/eyas/) (training-time test, {train_options.get('ttt_steps', '?')} steps).

| | |
| --- | --- |
| target | `{target}` |
| training data | `{data}` ({'online' if train_options.get('online') else 'offline features'}) |
| steps / tokens | {report.get('steps', '?')} / {report.get('tokens', '?')} |
| drafter | 1 Llama layer, hidden {config['hidden_size']}, draft vocabulary {config['draft_vocab_size']} of {config['vocab_size']} |
| target layers tapped | {ids} (input of those decoder layers) |
| holdout acceptance (cumulative, per draft position) | {acceptance} |
| simulated τ (greedy chain) | {tau} |
| simulated τ over the first 128 tokens of first answers | {start} |

## Serve it

vLLM:

```bash
vllm serve {target} --speculative-config '{{"method": "eagle3", "model": "{name}", "num_speculative_tokens": 5}}'
```

SGLang:

```bash
python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {name} --speculative-num-steps 5 --speculative-eagle-topk 8 \\
    --speculative-num-draft-tokens 32
```
"""
