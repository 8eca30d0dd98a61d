"""The model card of an exported EAGLE-3 drafter: target, data, training, measured acceptance, and how SGLang and vLLM
serve it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eyas.export.card import acceptance, serve_target, tau
from eyas.train.options import trains_online
from eyas.families.eagle3.contract import eagle31_switches


def model_card(config: dict, train_options: dict, report: dict, target: dict, draft_dir: Path) -> str:
    """Markdown: target, data, training, measured acceptance before and after training, and serving commands that run
    as written (the target as the engine loads it, the drafter's absolute path)."""
    spec = train_options.get("target", "?")
    online = trains_online(train_options.get("online"), train_options.get("features"), train_options.get("data"))
    data = train_options.get("features") or train_options.get("data") or "?"
    first, final = report.get("initial_eval") or {}, report.get("final_eval") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or "engine defaults (2, N//2, N-3)"
    engine_target, note = serve_target(target)
    note = f"\n\n{note[0].upper()}{note[1:]}." if note else ""
    draft = str(Path(draft_dir).resolve())
    remote = " --trust-remote-code" if train_options.get("trust_remote_code") else ""
    speculative = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 5})
    switches = eagle31_switches(config)
    norms = f" with EAGLE-3.1's norms ({', '.join(switches)})" if switches else ""
    return f"""# {Path(draft_dir).name}: EAGLE-3 drafter for {spec}

Trained with eyas (training-time test, {train_options.get('ttt_steps', '?')} steps).

| | |
| --- | --- |
| target | `{spec}` |
| training data | `{data}` ({'online' if online else 'offline features'}) |
| steps / tokens | {report.get('steps', '?')} / {report.get('tokens', '?')} |
| drafter | 1 Llama layer{norms}, hidden {config['hidden_size']}, draft vocabulary {config['draft_vocab_size']} of {config['vocab_size']} |
| target layers tapped | {ids} (input of those decoder layers) |
| holdout acceptance (cumulative, per draft position) | {acceptance(final)} (before training: {acceptance(first)}) |
| simulated τ (greedy chain) | {tau(final, 'tau')} (before training: {tau(first, 'tau')}) |
| simulated τ over the first 128 tokens of first answers | {tau(final, 'tau_answer_start')} (before: {tau(first, 'tau_answer_start')}) |
{tau_at_temperatures(first, final)}{predicted(final)}
## Serve it

The paths are where `eyas export` found the target and wrote this drafter; change them if either moves.{note}

vLLM:

```bash
vllm serve {shlex.quote(engine_target)}{remote} --speculative-config {shlex.quote(speculative)}
```

SGLang:

```bash
python -m sglang.launch_server --model-path {shlex.quote(engine_target)}{remote} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {shlex.quote(draft)} --speculative-num-steps 5 --speculative-eagle-topk 8 \\
    --speculative-num-draft-tokens 32
```
"""


def tau_at_temperatures(first: dict, final: dict) -> str:
    """A row per sampling temperature the evaluation simulated: τ of chains drawn from the drafter at T."""
    before, rows = first.get("tau_at_temperature", {}), []
    for t, tau in final.get("tau_at_temperature", {}).items():
        was = f" (before: {before[t]:.2f})" if t in before else ""
        rows.append(f"| simulated τ sampling at T = {t} (drafts drawn from the drafter) | {tau:.2f}{was} |\n")
    return "".join(rows)


def predicted(final: dict) -> str:
    """With ``eyas train --predict``: the τ eyas bench will measure, per dataset, chain, temperature and answer length."""
    if not final.get("predicted"):
        return ""
    from eyas.train.prediction import prediction_table

    return "\n## The τ eyas bench will measure\n\n" + prediction_table(final["predicted"], final.get("predicted_by"))
