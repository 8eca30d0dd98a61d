"""Regeneration's batched decoding loop: greedy rows equal transformers' generate, stops, limits, seeded sampling."""

from __future__ import annotations

import pytest
import torch

from eyas.data.batched_decode import BatchedDecoder, pick, row_seed
from eyas.data.generators import HFGenerator
from eyas.data.options import RegenerationOptions
from eyas.data.render import chat_ids, chat_template_for
from test_engine_greedy import ReplayFirst
from test_regenerate import tiny_target  # noqa: F401 — the fixture: a random Llama with the demo's tokenizer
from zoo import ARCHITECTURES

LENGTHS = (5, 11, 3, 8, 1)  # a left-padded batch of 5 rows, filled to 8


def prompts(lengths=LENGTHS, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 240, (n,), generator=generator).tolist() for n in lengths]


def stop_of(model) -> int:
    eos = model.generation_config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos if eos is not None else 2


def hf_greedy(model, rows: list[list[int]], new_tokens: int, stop: int) -> list[list[int]]:
    """transformers' generate on the same left-padded batch, each row cut after its first stop."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for n, row in enumerate(rows):
        ids[n, width - len(row):], mask[n, width - len(row):] = torch.tensor(row), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=stop)[:, width:].tolist()
    return [row[: row.index(stop) + 1] if stop in row else row for row in out]


class FakeGraphs(ReplayFirst):
    """CUDA-graph semantics on the CPU (a key replays what was first recorded under it), plus what the decoder asks."""

    def __len__(self):
        return len(self.recorded)

    def drop(self, which):
        self.recorded = {k: v for k, v in self.recorded.items() if not which(k)}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "deepseek_v3"])
def test_greedy_rows_of_a_left_padded_batch_equal_generate_and_the_batch_of_one(arch):
    """Several window blocks (block 8, prompts + 20 tokens), Gemma 3's sliding layers (window 16), MLA; the
    rows stopped by the model's EOS and those that ran out alike."""
    model = ARCHITECTURES[arch][0]()
    stop, rows = stop_of(model), prompts()
    decoder = BatchedDecoder(model, [stop], pad_id=0, block=8, max_batch=8)
    decoder.graphs = FakeGraphs()
    got = decoder.decode(rows, 20)
    assert got == hf_greedy(model, rows, 20, stop)
    alone = BatchedDecoder(model, [stop], pad_id=0, block=8)
    assert [alone.decode([rows[n]], 20)[0] for n in (1, 4)] == [got[1], got[4]]  # the least and the most padded
    assert len(decoder.graphs) >= 2  # the steps crossed a block: more than one visible window was recorded


def test_rows_stop_at_any_stop_id_and_the_batch_stops_when_every_row_has():
    model = ARCHITECTURES["llama"][0]()
    rows = prompts()
    free = BatchedDecoder(model, [], pad_id=0).decode(rows, 12)  # no stop id: every row runs to the limit
    assert [len(r) for r in free] == [12] * len(rows)
    stops = {free[0][6], free[1][3], free[2][9], free[3][4], free[4][2]}  # every row meets one
    expected = [row[: next(k for k, t in enumerate(row) if t in stops) + 1] for row in free]
    decoder = BatchedDecoder(model, sorted(stops), pad_id=0, sync_every=1, max_batch=8)
    assert decoder.decode(rows, 12) == expected
    assert decoder.stats.steps == max(len(r) for r in expected) - 1 < 11  # stopped early, filler rows ignored
    assert BatchedDecoder(model, [], pad_id=0).decode(rows, 1) == [r[:1] for r in free]


def test_the_eyas_loop_answers_as_hf_generate_does_with_the_same_truncation_flags(tiny_target):  # noqa: F811
    model, tokenizer = tiny_target
    messages = [[{"role": "user", "content": "word " * n}] for n in (1, 7, 3, 12, 5)]
    first = chat_ids(tokenizer, messages[0], chat_template_for(tokenizer, None))
    decoded = BatchedDecoder(model, [], pad_id=0).decode([first], 6)[0]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = decoded[2]  # the first prompt's third token ends its answer
    try:
        options = dict(max_new_tokens=6, batch_size=4)
        ours = HFGenerator(model, tokenizer, RegenerationOptions(**options, generator="eyas"))
        theirs = HFGenerator(model, tokenizer, RegenerationOptions(**options, generator="hf-generate"))
        assert ours.loop == "eyas" and theirs.loop == "hf-generate"
        answers = ours.generate(messages)
        assert answers == theirs.generate(messages)
    finally:
        model.generation_config.eos_token_id = saved
    assert {a.truncated for a in answers} == {True, False} and not answers[0].truncated
    assert HFGenerator(model, tokenizer, RegenerationOptions()).loop == "hf-generate"  # the default off CUDA


def test_sampling_depends_on_the_row_seed_not_on_the_batch():
    model = ARCHITECTURES["qwen3"][0]()
    rows = prompts()
    seeds = [row_seed(7, r) for r in rows]
    decoder = BatchedDecoder(model, [], pad_id=0, block=16, max_batch=8)
    decoder.graphs = FakeGraphs()
    batch = decoder.decode(rows, 10, temperature=1.0, seeds=seeds)
    assert decoder.decode(rows, 10, temperature=1.0, seeds=seeds) == batch  # reproducible
    assert [decoder.decode([r], 10, temperature=1.0, seeds=[s])[0] for r, s in zip(rows, seeds, strict=True)] == batch
    reordered = decoder.decode(rows[::-1], 10, temperature=1.0, seeds=seeds[::-1])
    assert reordered[::-1] == batch
    other = decoder.decode(rows, 10, temperature=1.0, seeds=[row_seed(8, r) for r in rows])
    assert other != batch
    assert batch != decoder.decode(rows, 10)  # not greedy
    assert row_seed(7, rows[0]) == row_seed(7, list(rows[0])) != row_seed(7, rows[1])


def test_draws_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    draws = 20000
    seeds = torch.arange(draws, dtype=torch.long) * 2654435761 % (1 << 32)
    for temperature in (0.5, 1.0, 2.0):
        tokens = pick(logits.expand(draws, -1), torch.tensor([temperature]), seeds, torch.tensor([3]))
        frequencies = torch.bincount(tokens, minlength=5).double() / draws
        assert torch.allclose(frequencies, torch.softmax(logits.double() / temperature, -1), atol=0.015)
    # one row's stream over its steps is as random as many rows at one step
    one_row = pick(logits.expand(draws, -1), torch.tensor([1.0]), seeds[:1].expand(draws), torch.arange(draws))
    frequencies = torch.bincount(one_row, minlength=5).double() / draws
    assert torch.allclose(frequencies, torch.softmax(logits.double(), -1), atol=0.015)
    assert torch.equal(pick(logits.expand(3, -1), None, seeds[:3], torch.tensor([0])), torch.zeros(3, dtype=torch.long))


def test_an_unknown_generator_is_refused_in_one_line_before_any_work(monkeypatch, tmp_path):
    import dataclasses

    from eyas.stages import STAGES
    from test_bad_input_mistakes import COMMAND_LINES, OUT, invoke, one_line_error

    ran = []
    for name, stage in STAGES.items():
        monkeypatch.setitem(STAGES, name, dataclasses.replace(stage, run=lambda *a: ran.append(a)))
    out = tmp_path / "out"
    line = [str(out) if a == OUT else a for a in [*COMMAND_LINES["prepare"], "--regenerate", "--generator", "vllm"]]
    one_line_error(invoke(line), "--generator vllm", "one of eyas, hf-generate")
    config = tmp_path / "run.toml"
    config.write_text(f'target = "t"\nworkdir = "{tmp_path / "work"}"\n[prepare]\ndata = ["x"]\n'
                      '[prepare.regeneration]\ngenerator = "vllm"\n')
    one_line_error(invoke(["run", str(config)]), str(config), "[prepare] regeneration generator = 'vllm'", "one of eyas")
    assert not ran and sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # no --out, no workdir


# cuDNN's attention, given no workspace when memory ran out (H200, 2026-12-03), fails with a plain RuntimeError
CUDNN_NO_WORKSPACE = RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() "
                                  "to be true, but got false.")


@pytest.mark.parametrize("failure", [torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)"), CUDNN_NO_WORKSPACE],
                         ids=["torch-oom", "cudnn-no-workspace"])
def test_out_of_memory_frees_the_caches_and_halves_the_batch_with_the_same_answers(tiny_target, failure):  # noqa: F811
    model, tokenizer = tiny_target
    messages = [[{"role": "user", "content": "word " * n}] for n in (2, 9, 4, 6)]
    options = RegenerationOptions(max_new_tokens=4, batch_size=4, generator="eyas")
    expected = HFGenerator(model, tokenizer, options).generate(messages)

    class Tight(BatchedDecoder):
        def _prefill(self, lane, *args):
            if lane.batch > 2:  # the cache of 4 rows was allocated, then the prefill ran out of memory
                raise failure
            return super()._prefill(lane, *args)

    generator = HFGenerator(model, tokenizer, options)
    generator._decoder = Tight(model, generator.eos_ids, generator.pad_id, max_batch=4)
    assert generator.generate(messages) == expected
    assert sorted(generator._decoder._lanes) == [2]  # the 4-row cache was freed, not kept beside the halves


def test_an_error_that_is_not_out_of_memory_is_raised_not_halved(tiny_target):  # noqa: F811
    model, tokenizer = tiny_target
    generator = HFGenerator(model, tokenizer, RegenerationOptions(max_new_tokens=4, batch_size=4, generator="eyas"))

    class Broken(BatchedDecoder):
        def _prefill(self, lane, *args):
            raise RuntimeError("shape mismatch (a real bug)")

    generator._decoder = Broken(model, generator.eos_ids, generator.pad_id, max_batch=4)
    with pytest.raises(RuntimeError, match="a real bug"):
        generator.generate([[{"role": "user", "content": "word"}]] * 4)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_a_prefill_split_into_forwards_of_a_few_rows_decodes_as_the_whole_batch(arch):
    """prefill_tokens small enough for 1 or 2 rows per forward (prompts of 1 to 11 tokens), each forward padded to
    its own longest prompt and written right-aligned into the batch's cache: the same greedy rows as one prefill
    forward of all 8, and as transformers' generate — MLA's unequal key/value widths included."""
    model = ARCHITECTURES[arch][0]()
    stop, rows = stop_of(model), prompts()
    whole = BatchedDecoder(model, [stop], pad_id=0, block=8, max_batch=8)
    whole.graphs = FakeGraphs()
    expected = whole.decode(rows, 16)
    for tokens in (11, 25):
        split = BatchedDecoder(model, [stop], pad_id=0, block=8, max_batch=8, prefill_tokens=tokens)
        split.graphs = FakeGraphs()
        assert split.decode(rows, 16) == expected
        if tokens == 11:  # (start, end, width) per forward: the 8 rows of lengths 5, 11, 3, 8, 1 (filled with 1s)
            assert split._prefill_forwards([*LENGTHS, 1, 1, 1]) == [(0, 1, 5), (1, 2, 11), (2, 3, 3), (3, 4, 8), (4, 8, 1)]
    assert expected == hf_greedy(model, rows, 16, stop)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_one_token_steps_attend_through_the_grouped_attention_and_agree_with_transformers_sdpa(arch, monkeypatch):
    """Grouped-query zoo models: every decoding step's attention runs grouped (no key copies); each call's output
    equals transformers' own SDPA attention on the same inputs (padding mask and sliding layers included)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eyas.engine import grouped_attention as grouped

    model = ARCHITECTURES[arch][0]()
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # the case the grouping is for
    calls, worst = [], [0.0]
    original = grouped.grouped_sdpa

    def checked(module, query, key, value, attention_mask, **kwargs):
        out, _ = original(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] == 1:
            calls.append(query.shape)
            reference, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
            worst[0] = max(worst[0], (out - reference).abs().max().item())
        return out, None

    monkeypatch.setattr(grouped, "grouped_sdpa", checked)
    stop, rows = stop_of(model), prompts()
    decoder = BatchedDecoder(model, [stop], pad_id=0, block=8, max_batch=8)
    decoder.graphs = FakeGraphs()
    got = decoder.decode(rows, 12)
    assert calls and worst[0] < 1e-5, (len(calls), worst)
    assert got == hf_greedy(model, rows, 12, stop)
    assert model.config._attn_implementation == "sdpa"  # switched back after decoding
