"""The README.md model card of an exported DFlash drafter: what it is, how it was made, how vLLM serves it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eyas.export.card import acceptance, serve_target, tau
from eyas.train.options import trains_online


def dflash_card(config: dict, train_options: dict, report: dict, target: dict, draft_dir: Path) -> str:
    """Markdown for a DFlash block drafter: target, data, training, measured acceptance, and vLLM's serving command."""
    spec = train_options.get("target", "?")
    online = trains_online(train_options.get("online"), train_options.get("features"), train_options.get("data"))
    data = train_options.get("features") or train_options.get("data") or "?"
    first, final = report.get("initial_eval") or {}, report.get("final_eval") or {}
    engine_target, note = serve_target(target)
    note = f"\n\n{note[0].upper()}{note[1:]}." if note else ""
    draft = str(Path(draft_dir).resolve())
    remote = " --trust-remote-code" if train_options.get("trust_remote_code") else ""
    proposals = int(config["block_size"]) - 1
    taps, flash_ids = config["eagle_aux_hidden_state_layer_ids"], config["dflash_config"]["target_layer_ids"]
    speculative = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": proposals})
    return f"""# {Path(draft_dir).name}: DFlash block drafter for {spec}

Trained with eyas: each block of {config['block_size']} (an anchor and {proposals} mask slots) proposes {proposals}
tokens in one forward, every slot trained against the target's greedy token.

| | |
| --- | --- |
| target | `{spec}` |
| training data | `{data}` ({'online' if online else 'offline features'}) |
| steps / tokens | {report.get('steps', '?')} / {report.get('tokens', '?')} |
| drafter | {config['num_hidden_layers']} Qwen3 layers, hidden {config['hidden_size']}; the target's embedding and lm_head |
| target layers tapped | {taps} (eyas ids: the input of those decoder layers; DFlash's `target_layer_ids` {flash_ids}) |
| mask token | {config['dflash_config']['mask_token_id']} |
| holdout acceptance (cumulative, per block slot) | {acceptance(final)} (before training: {acceptance(first)}) |
| simulated τ (a chain of {proposals} drafts) | {tau(final, 'tau')} (before training: {tau(first, 'tau')}) |

## Serve it

The paths are where `eyas export` found the target and wrote this drafter; change them if either moves.{note}

vLLM (0.32 or later):

```bash
vllm serve {shlex.quote(engine_target)}{remote} --speculative-config {shlex.quote(speculative)}
```

eyas: `eyas bench --target {shlex.quote(spec)} --draft {shlex.quote(draft)} --mode chain:{proposals}` decodes it in eyas' engine.
"""
