"""Where in a conversation a drafter's drafts are accepted: simulated τ by turn and by place in the answer.

    python benchmarks/acceptance_by_place.py --draft DRAFT_DIR --data DATA_DIR [--target demo]
        [--conversations 40] [--ttt-steps 7] [--token-budget 4096]

The holdout evaluation of ``eyas train`` (simulated τ = 1 + mean accepted depth of a greedy chain of
K drafts, teacher-forced on the data's tokens) averages over every assistant token of whole
conversations. ``eyas bench`` decodes the first 128 tokens of first answers. When the two disagree,
this splits the simulation the way the bench samples it: by turn (first answer, later answers) and
by the token's place within its answer (0–63, 64–127, 128–255, 256–511, 512 on). Same drafter,
same holdout conversations; fp32 on the CPU, or bf16 autocast on a GPU like training.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from eyas.data.vocab import load_vocab
from eyas.families.eagle3.ttt import shift_left
from eyas.families.eagle3.load import load_drafter
from eyas.target import load_target
from eyas.train.data import OnlineSource
from eyas.families.eagle3.evaluate import answer_places, unroll
from eyas.train.trainer import training_autocast

PLACES = ((0, 64), (64, 128), (128, 256), (256, 512), (512, 1 << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="DATA_DIR (eyas prepare); its holdout split is read")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--conversations", type=int, default=40, help="holdout conversations (the first of the plan)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--token-budget", type=int, default=4096)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=device)
    drafter = load_drafter(args.draft, target.layout.embed.weight, target.layout.num_layers, device=device)
    source = OnlineSource(target, args.data, "holdout", drafter.config.layer_ids, args.token_budget, device, torch.float32)
    draft_ids = load_vocab(args.data / "vocab.safetensors").draft_ids.to(device)
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
        for lo, hi in PLACES:
            for turn_name, turn_ok in (("first answer", turn == 0), ("later answers", turn > 0)):
                chosen = base & turn_ok & (place >= lo) & (place < hi)
                key = (turn_name, lo, hi)
                depth_sum[key] += float(depth[chosen].sum())
                count[key] += int(chosen.sum())
    print(f"{seen} holdout conversations, TTT {args.ttt_steps}, {device}; simulated τ = 1 + mean accepted depth")
    print(f"{'answer':<14} {'tokens in answer':<17} {'positions':>9} {'simulated τ':>12}")
    for key in sorted(count):  # first answers before later ones, each by place
        turn_name, lo, hi = key
        if count[key]:
            place_name = f"{lo}–{hi - 1}" if hi < 1 << 30 else f"{lo}+"
            print(f"{turn_name:<14} {place_name:<17} {count[key]:>9} {1 + depth_sum[key] / count[key]:>12.2f}")
    total = sum(count.values())
    print(f"{'all':<14} {'':<17} {total:>9} {1 + sum(depth_sum.values()) / max(1, total):>12.2f}")


if __name__ == "__main__":
    main()
