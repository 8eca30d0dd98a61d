"""The round as proposer and judge: which pair each mode, drafter and sampling rule gets (chosen once, in
eyas.engine.decoders), and a round that asks nothing of modes or rules (engine/round.py compares no name)."""

import ast
from pathlib import Path

import pytest

from eyas.engine import judges, proposers
from eyas.engine.acceptance import block_sampled, chain_sampled
from eyas.engine.decode import round_for
from eyas.families.dflash.config import dflash_config_from_target
from eyas.families.dflash.model import DFlashDrafter
from eyas.families.dflash.runner import BlockDraftRunner
from eyas.speculation import Chain, Sampling, Tree
from eyas.target.layer_ids import default_layer_ids
from eyas.target.layout import discover_layout
from test_engine_greedy import runners
from zoo import ARCHITECTURES

GREEDY = Sampling()
T1 = Sampling(temperature=1.0)  # auto: drawn chains, and drawn trees (T ≥ 0.85)
T05 = Sampling(temperature=0.5)  # auto: drawn chains, a tree's top-k
ARGMAX_DRAFTS = Sampling(temperature=1.0, draft_sampling="greedy")
BLOCK_RULE = Sampling(temperature=1.0, verification="block")

EAGLE = [  # (mode, sampling) → (proposer, judge[, the chain rule])
    (None, GREEDY, proposers.NoDraft, judges.PlainGreedy),
    (None, T1, proposers.NoDraft, judges.PlainSampled),
    (Chain(3), GREEDY, proposers.GreedyChain, judges.ChainGreedy),
    (Chain(3), T1, proposers.DrawnChain, judges.ChainSampled, chain_sampled),
    (Chain(3), ARGMAX_DRAFTS, proposers.GreedyChain, judges.ChainSampled, chain_sampled),
    (Chain(3), BLOCK_RULE, proposers.DrawnChain, judges.ChainSampled, block_sampled),
    (Tree(10, 3, 4), GREEDY, proposers.TopKTree, judges.TreeGreedy),
    (Tree(10, 3, 4), T1, proposers.DrawnTree, judges.TreeDrawn),
    (Tree(10, 3, 4), T05, proposers.TopKTree, judges.TreeSampled),
]


@pytest.fixture(scope="module")
def model():
    return ARCHITECTURES["llama"][0]()


@pytest.mark.parametrize("case", EAGLE, ids=lambda case: f"{case[0] and case[0].label()}-{case[1].rule_label or case[1].temperature}")
def test_each_mode_and_rule_gets_its_proposer_and_judge(model, case):
    speculation, sampling, proposer, judge, *rule = case
    target, drafter = runners(model, capacity=64)
    decoding_round, _ = round_for(target, drafter if speculation else None, speculation)
    decoder = decoding_round.decoder(sampling.resolved(decoding_round.mode))
    assert type(decoder.proposer) is proposer and type(decoder.judge) is judge
    if rule:
        assert decoder.judge.rule is rule[0]
    assert decoding_round.decoder(sampling.resolved(decoding_round.mode)) is decoder  # made once per rule


def test_a_block_drafter_proposes_its_chain_in_one_forward(model):
    layout = discover_layout(model)
    config = dflash_config_from_target(model.config, default_layer_ids(layout.num_layers), 4, draft_layers=1)
    runner = BlockDraftRunner(DFlashDrafter(config).eval(), layout.embed.weight, layout.lm_head, 80)
    target, _ = runners(model, capacity=64)
    decoding_round, _ = round_for(target, runner, Chain(3))
    assert type(decoding_round.decoder(GREEDY).proposer) is proposers.BlockChain
    assert type(decoding_round.decoder(T1.resolved("chain")).proposer) is proposers.DrawnBlockChain


NAMES = {"plain", "chain", "tree", "auto", "greedy", "probabilistic", "standard", "block"}


def test_the_round_compares_no_mode_or_rule_name():
    source = Path(__file__).resolve().parents[1] / "src" / "eyas" / "engine" / "round.py"
    found = []
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            named = [p.value for p in parts if isinstance(p, ast.Constant) and p.value in NAMES]
            asked = [p.attr for p in parts if isinstance(p, ast.Attribute) and p.attr in
                     ("mode", "draft_sampling", "verification", "greedy")]
            if named or asked:
                found.append(f"line {node.lineno}: {named or asked}")
    assert not found, f"engine/round.py asks which mode or rule it runs: {found}"
