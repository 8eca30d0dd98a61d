"""The README.md model card of an exported DSpark drafter: what it is, how it was made, how vLLM serves it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eyas.export.card import acceptance, serve_target, tau
from eyas.train.options import trains_online


def dspark_card(config: dict, train_options: dict, report: dict, target: dict, draft_dir: Path) -> str:
    """Markdown for a DSpark drafter: target, data, training, measured acceptance, and vLLM's serving command."""
    spec = train_options.get("target", "?")
    online = trains_online(train_options.get("online"), train_options.get("features"), train_options.get("data"))
    data = train_options.get("features") or train_options.get("data") or "?"
    first, final = report.get("initial_eval") or {}, report.get("final_eval") or {}
    engine_target, note = serve_target(target)
    note = f"\n\n{note[0].upper()}{note[1:]}." if note else ""
    draft = str(Path(draft_dir).resolve())
    remote = " --trust-remote-code" if train_options.get("trust_remote_code") else ""
    block = int(config["block_size"])
    taps, spelt = config["eagle_aux_hidden_state_layer_ids"], config["dflash_config"]["target_layer_ids"]
    speculative = json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": block})
    confidence = ", a confidence head (vLLM's adaptive verification reads it)" if config["enable_confidence_head"] else ""
    shape = (f"{config['num_hidden_layers']} Qwen3 layers, hidden {config['hidden_size']}, Markov rank "
             f"{config['markov_rank']}{confidence}; the target's embedding and lm_head")
    return f"""# {Path(draft_dir).name}: DSpark drafter for {spec}

Trained with eyas: one forward of its backbone over a block of {block} (the anchor and {block - 1} mask slots) proposes
{block} tokens, and its Markov head (rank {config['markov_rank']}) adds to each slot's logits a bias from the token before
it, sampled left to right. Each slot is trained against the target's distribution (L1) and greedy token (cross-entropy).

| | |
| --- | --- |
| target | `{spec}` |
| training data | `{data}` ({'online' if online else 'offline features'}) |
| steps / tokens | {report.get('steps', '?')} / {report.get('tokens', '?')} |
| drafter | {shape} |
| target layers tapped | {taps} (eyas ids: the input of those decoder layers; `dflash_config.target_layer_ids` {spelt}) |
| mask token | {config['dflash_config']['mask_token_id']} |
| holdout acceptance (cumulative, per block slot, greedy) | {acceptance(final)} (before training: {acceptance(first)}) |
| simulated τ, greedy chain of {block} | {tau(final, 'tau')} (before training: {tau(first, 'tau')}) |
| simulated τ, chain of {block} drawn at T = 1 | {tau(final, 'tau_drawn')} (before training: {tau(first, 'tau_drawn')}) |

## Serve it

The paths are where `eyas export` found the target and wrote this drafter; change them if either moves.{note}

vLLM (0.32 or later; its dspark method runs on Model Runner V2):

```bash
vllm serve {shlex.quote(engine_target)}{remote} --speculative-config {shlex.quote(speculative)}
```

eyas: `eyas bench --target {shlex.quote(spec)} --draft {shlex.quote(draft)} --mode chain:{block}` decodes it in eyas' engine.
"""
