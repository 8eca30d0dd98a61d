"""A compiled round is the eager round's arithmetic in bf16: the same drafts, the same target logits, bit for bit.

torch.compile fuses a round's elementwise ops; left to itself it keeps what lies between fused ops in fp32,
where eager bf16 rounds after every op, so a compiled round scored the drafter's candidates differently and
chose other drafts than the eager round on the same inputs. The engine compiles with eager's rounding kept
(:func:`eyas.engine.graphs.compiled`); here both rounds run from the same committed state, on the CPU (inductor
compiles for it as for a GPU, through the same decompositions), and must agree exactly — while the plain
compile of the same round does not, which shows the comparison can tell.
"""

import pytest
import torch

from eyas.engine.decode import round_for
from eyas.families.eagle3.runner import DraftRunner
from eyas.engine.graphs import compiled
from eyas.engine.target_runner import TargetRunner
from eyas.speculation import Sampling, Tree
from eyas.target.layout import discover_layout
from test_drafter_consistency import random_drafter, tiny_config
from test_engine_greedy import prompt_of
from zoo import ARCHITECTURES

TREE = Tree(top_k=4, depth=3, total=10)


def round_outputs(decoding_round):
    """Draft → verify → judge (the greedy decoder) from the round's state, nothing committed → every tensor it decided."""
    decoder = decoding_round.decoder(Sampling())
    draft, _ = decoder.proposer.propose(decoding_round, None)
    logits = decoding_round.verify(draft)
    verdict = decoder.judge.judge(decoding_round, draft, logits, None, None)
    return draft.tokens, draft.parents, logits, verdict.accepted


def bf16_round():
    model = ARCHITECTURES["llama"][0]().to(torch.bfloat16)
    layout = discover_layout(model)
    drafter = random_drafter(tiny_config(vocab_size=layout.vocab_size, draft_vocab_size=100), seed=0)
    drafter.load_target_embedding(layout.embed.weight)
    target = TargetRunner(model, layout, None, 64, lean=True)
    decoding_round, _ = round_for(target, DraftRunner(drafter.to(torch.bfloat16), 64), TREE)
    return target, decoding_round


def run_from(target, decoding_round, prompt, step):
    logits, aux = target.prefill(prompt)
    decoding_round.begin(prompt, aux, int(logits.argmax()))
    with torch.no_grad():
        return [t.clone() for t in step()]


def test_a_compiled_round_chooses_what_the_eager_round_chooses_bit_for_bit():
    torch._dynamo.reset()
    target, decoding_round = bf16_round()
    assert target.fused is not None  # the lean forward, as the engine decodes Llama-family targets by default
    eager = lambda: round_outputs(decoding_round)  # noqa: E731
    ours = compiled(eager)
    plain = torch.compile(eager, dynamic=False)
    differs = 0
    for seed in range(3):
        prompt = prompt_of(seed, length=12)
        expected = run_from(target, decoding_round, prompt, eager)
        got = run_from(target, decoding_round, prompt, ours)
        for name, a, b in zip(("drafts", "parents", "target logits", "accepted"), expected, got, strict=True):
            assert torch.equal(a, b), f"prompt {seed}: the compiled round's {name} differ from the eager round's"
        unrounded = run_from(target, decoding_round, prompt, plain)
        differs += not torch.equal(unrounded[2], expected[2])
    assert differs, "torch.compile without eager's rounding gave the eager logits too: this test cannot tell them apart"
