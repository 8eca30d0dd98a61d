"""The README.md model card of an exported drafter: what it is for, how it was made, how to serve it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eyas.train.options import trains_online


def serve_target(facts: dict) -> tuple[str, str | None]:
    """The target as a serving engine must be given it, and a note when it is not the spec: a hub id as is, a local HF
    directory by its absolute path, a GGUF (or ``demo``) by the HF directory eyas converted it into; a placeholder
    ``<...>`` when that directory is gone."""
    spec = facts["spec"]
    source = facts.get("source") or spec
    converted = spec == "demo" or spec.endswith(".gguf")
    local = Path(source).expanduser()
    if (local / "config.json").is_file():
        note = f"`{spec}` is served as the HF directory eyas converted it into" if converted else None
        return str(local.resolve()), note
    if not converted and source == spec and not local.is_absolute():  # resolve_target leaves only hub ids as given
        return spec, None
    if converted:
        return (f"<HF directory converted from {spec}>", f"eyas converted `{spec}` into `{source}`, which is gone: any eyas "
                f"command that loads `{spec}` converts it again (into the eyas cache); put that directory in its place")
    return f"<HF directory of {spec}>", f"the target directory `{source}` is gone: put where it now lies in its place"


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
    return f"""# {Path(draft_dir).name}: EAGLE-3 drafter for {spec}

Trained with eyas (training-time test, {train_options.get('ttt_steps', '?')} steps).

| | |
| --- | --- |
| target | `{spec}` |
| training data | `{data}` ({'online' if online else 'offline features'}) |
| steps / tokens | {report.get('steps', '?')} / {report.get('tokens', '?')} |
| drafter | 1 Llama layer, hidden {config['hidden_size']}, draft vocabulary {config['draft_vocab_size']} of {config['vocab_size']} |
| target layers tapped | {ids} (input of those decoder layers) |
| holdout acceptance (cumulative, per draft position) | {_acceptance(final)} (before training: {_acceptance(first)}) |
| simulated τ (greedy chain) | {_tau(final, 'tau')} (before training: {_tau(first, 'tau')}) |
| simulated τ over the first 128 tokens of first answers | {_tau(final, 'tau_answer_start')} (before: {_tau(first, 'tau_answer_start')}) |
{_tau_at_temperatures(first, final)}
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


def _acceptance(evaluation: dict) -> str:
    return ", ".join(f"{a:.3f}" for a in evaluation.get("acceptance_cumulative", [])) or "not evaluated"


def _tau_at_temperatures(first: dict, final: dict) -> str:
    """A row per sampling temperature the evaluation simulated: τ of chains drawn from the drafter at T."""
    before, rows = first.get("tau_at_temperature", {}), []
    for t, tau in final.get("tau_at_temperature", {}).items():
        was = f" (before: {before[t]:.2f})" if t in before else ""
        rows.append(f"| simulated τ sampling at T = {t} (drafts drawn from the drafter) | {tau:.2f}{was} |\n")
    return "".join(rows)


def _tau(evaluation: dict, key: str) -> str:
    return f"{evaluation[key]:.2f}" if key in evaluation else "not evaluated"


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
| holdout acceptance (cumulative, per block slot) | {_acceptance(final)} (before training: {_acceptance(first)}) |
| simulated τ (a chain of {proposals} drafts) | {_tau(final, 'tau')} (before training: {_tau(first, 'tau')}) |

## Serve it

The paths are where `eyas export` found the target and wrote this drafter; change them if either moves.{note}

vLLM (0.32 or later):

```bash
vllm serve {shlex.quote(engine_target)}{remote} --speculative-config {shlex.quote(speculative)}
```

eyas: `eyas bench --target {shlex.quote(spec)} --draft {shlex.quote(draft)} --mode chain:{proposals}` decodes it in eyas' engine.
"""
