"""Where in a conversation a drafter's drafts are accepted: simulated τ by turn, by place in the answer, and by
context (how many tokens come before).

    python benchmarks/acceptance_by_place.py --draft DRAFT_DIR --data DATA_DIR [--target demo]
        [--conversations 40] [--ttt-steps 7] [--token-budget 4096] [--min-tokens 0]

The holdout evaluation of ``eyas train`` (simulated τ = 1 + mean accepted depth of a greedy chain of
K drafts, teacher-forced on the data's tokens) averages over every assistant token of whole
conversations. ``eyas bench`` decodes the first 128 tokens of first answers. When the two disagree,
this splits the simulation the way the bench samples it: by turn (first answer, later answers) and
by the token's place within its answer (0–63, 64–127, 128–255, 256–511, 512 on). Same drafter,
same holdout conversations; fp32 on the CPU, or bf16 autocast on a GPU like training.

The second table splits the same positions by context: the predicted token's position in its conversation (0–1k,
1–2k, 2–4k, 4–8k, 8k on), which is what a long prompt changes (issue 47). With --min-tokens only the holdout
conversations of at least that many tokens are read (e.g. 2049 with a DATA_DIR prepared with --max-length 8192:
their first 2 k positions are the same conversations' short-context control); --token-budget must hold the longest.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from eyas.families.eagle3.ttt import shift_left
from eyas.families.eagle3.load import load_drafter
from eyas.target import load_target
from eyas.train.data import OnlineSource
from eyas.families.eagle3.evaluate import answer_places, unroll
from eyas.train.trainer import training_autocast

PLACES = ((0, 64), (64, 128), (128, 256), (256, 512), (512, 1 << 30))
CONTEXTS = ((0, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 1 << 30))


def span(lo: int, hi: int) -> str:
    return f"{lo}–{hi - 1}" if hi < 1 << 30 else f"{lo}+"


def table(title: str, rows: list[tuple[str, str, int, float]]) -> None:
    """Rows of (group, span, positions, depth summed) as simulated τ = 1 + mean accepted depth."""
    print(f"{title:<14} {'tokens':<17} {'positions':>9} {'simulated τ':>12}")
    for group, where, positions, depth in rows:
        if positions:
            print(f"{group:<14} {where:<17} {positions:>9} {1 + depth / positions:>12.2f}")
    total = sum(r[2] for r in rows)
    print(f"{'all':<14} {'':<17} {total:>9} {1 + sum(r[3] for r in rows) / max(1, total):>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR (eyas prepare); its holdout split is read")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--conversations", type=int, default=40, help="holdout conversations (the first of the plan)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--min-tokens", type=int, default=0, help="only holdout conversations at least this long")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=device)
    drafter = load_drafter(args.draft, target.layout.embed.weight, target.layout.num_layers, device=device)
    source = OnlineSource(target, args.data, "holdout", drafter.config.layer_ids, args.token_budget, device, torch.float32)
    if args.min_tokens:
        long = [s for s in source.samples if len(s.input_ids) >= args.min_tokens]
        source = OnlineSource(target, None, None, drafter.config.layer_ids, args.token_budget, device, torch.float32,
                              samples=long)
    # the drafter's own vocabulary: DATA_DIR's (vocab.safetensors) is another one unless the drafter was trained on it
    draft_ids = drafter.vocabulary()
    head = target.layout.lm_head.weight.detach().float()
    autocast = training_autocast(device)
    depth_sum: dict = defaultdict(float)
    count: dict = defaultdict(int)
    seen = 0
    for b in range(len(source.batches)):
        if seen >= args.conversations:
            break
        batch = source.batch(b)
        seen += batch.input_ids.shape[0]
        with torch.no_grad(), autocast():
            unrolled = unroll(drafter, batch, head, draft_ids, args.ttt_steps)
        # the predicted token's place: token i + 2 is where the chain's first draft lands
        place, turn = (shift_left(x, 2, fill=-1).cpu() for x in answer_places(batch.loss_mask))
        depth, base = unrolled.depth.cpu(), unrolled.counted.cpu()
        context = torch.arange(depth.shape[1]).expand_as(depth) + 2
        groups = [(("by place", turn_name, lo, hi), turn_ok & (place >= lo) & (place < hi)) for lo, hi in PLACES
                  for turn_name, turn_ok in (("first answer", turn == 0), ("later answers", turn > 0))]
        groups += [(("by context", "any answer", lo, hi), (context >= lo) & (context < hi)) for lo, hi in CONTEXTS]
        for key, chosen in groups:
            depth_sum[key] += float(depth[base & chosen].sum())
            count[key] += int((base & chosen).sum())
    print(f"{seen} holdout conversations, TTT {args.ttt_steps}, {device}; simulated τ = 1 + mean accepted depth")
    for title, what in (("answer", "by place"), ("context", "by context")):
        keys = sorted(k for k in count if k[0] == what)  # by place: first answers before later ones
        table(title, [(k[1], span(k[2], k[3]), count[k], depth_sum[k]) for k in keys])


if __name__ == "__main__":
    main()
