"""Loss masks are exactly the assistant's tokens plus their end-of-turn token, for five template families.

The tokenizers are built here, offline: the demo (SmolLM2) BPE vocabulary with each family's
special tokens added and a chat template of that family's shape (tests/templates/).
"""

from pathlib import Path

import pytest
from tokenizers import AddedToken

from eyas.data.conversation import Conversation, Turn
from eyas.data.render import ChatRenderer
from eyas.target.loading import load_tokenizer, resolve_target

TEMPLATES = Path(__file__).parent / "templates"

# family → (template file or None for the tokenizer's own, specials to add, bos, eos, end-of-turn token)
FAMILIES = {
    "chatml_smollm2": (None, [], None, None, "<|im_end|>"),
    "llama3": ("llama3.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", None, "<|eot_id|>"),
    "mistral_inst": ("mistral.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
    "gemma": ("gemma.jinja", ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", None, "<end_of_turn>"),
    "deepseek": ("deepseek.jinja", ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "kimi": ("kimi.jinja", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"], None, None, "<|im_end|>"),
}

CONVERSATIONS = [
    Conversation("multi", [
        Turn("system", "You answer tersely."),
        Turn("user", "What is the capital of France?"),
        Turn("assistant", "Paris."),
        Turn("user", "And of Italy? Answer with the city only."),
        Turn("assistant", "Rome, which is also the largest city of Italy.\nIt sits on the Tiber."),
    ]),
    Conversation("single", [Turn("user", "Write a haiku about rain."),
                            Turn("assistant", "Soft rain on the roof\nthe garden drinks in silence\nclouds hum their grey song")]),
    # The answer repeats the question: masks must still point at the assistant's copy.
    Conversation("echo", [Turn("user", "Say exactly: hello world"), Turn("assistant", "hello world"),
                          Turn("user", "Again: hello world"), Turn("assistant", "hello world")]),
]


@pytest.fixture(scope="module")
def demo_tokenizer_dir():
    return resolve_target("demo")


def family_tokenizer(directory, family):
    template_file, specials, bos, eos, _ = FAMILIES[family]
    tok = load_tokenizer(directory)
    if specials:
        tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials], special_tokens=True)
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    template = (TEMPLATES / template_file).read_text() if template_file else None
    return tok, template


def masked_spans(tok, ids, mask):
    spans, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tok.decode(span, skip_special_tokens=False) for span in spans]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_masked_spans_decode_to_assistant_texts_and_end_of_turn(demo_tokenizer_dir, family):
    tok, template = family_tokenizer(demo_tokenizer_dir, family)
    renderer = ChatRenderer(tok, chat_template=template)
    eot = FAMILIES[family][4]
    for conversation in CONVERSATIONS:
        rendered = renderer.render(conversation)
        assert len(rendered.input_ids) == len(rendered.loss_mask)
        expected = [t.content + eot for t in conversation.turns if t.role == "assistant"]
        spans = masked_spans(tok, rendered.input_ids, rendered.loss_mask)
        if family == "mistral_inst":
            # "[/INST] Paris": BPE merges the template's space into the first answer token (" Paris"),
            # which the model generates, so it is masked; nothing else of the template is.
            spans = [span.removeprefix(" ") for span in spans]
        assert spans == expected, (family, conversation.id)
        # The ids are what the template itself tokenizes to.
        direct = tok.apply_chat_template(conversation.messages(), chat_template=template, tokenize=True, return_dict=True)
        assert rendered.input_ids == list(direct["input_ids"])


def test_mistral_style_template_uses_the_offset_fallback(demo_tokenizer_dir):
    tok, template = family_tokenizer(demo_tokenizer_dir, "mistral_inst")
    assert not ChatRenderer(tok, template).render(CONVERSATIONS[0]).prefix_stable
    tok, template = family_tokenizer(demo_tokenizer_dir, "llama3")
    assert ChatRenderer(tok, template).render(CONVERSATIONS[0]).prefix_stable


def test_an_answer_cut_at_the_generation_limit_does_not_teach_its_end_of_turn(demo_tokenizer_dir):
    tok, template = family_tokenizer(demo_tokenizer_dir, "chatml_smollm2")
    conversation = Conversation("cut", [Turn("user", "Count to ten."),
                                        Turn("assistant", "one two three", regenerated=True, truncated=True)])
    rendered = ChatRenderer(tok, template).render(conversation)
    assert masked_spans(tok, rendered.input_ids, rendered.loss_mask) == ["one two three"]
