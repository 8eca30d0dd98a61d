"""Render a conversation with the target's chat template and mark exactly the assistant's tokens.

Which template renders, everywhere prompts are rendered (prepare, regeneration, bench, generate), is
one rule here: a ``--chat-template`` FILE's, else the tokenizer's, else one line saying what to pass.

The loss mask is derived from the template itself, never from hard-coded header strings:

1. Render the whole conversation once. For each assistant turn ``i`` render the messages before it
   with the generation prompt, and the messages up to and including it without. When the template
   is prefix-stable (the whole text starts with the second, the second with the first), the
   difference between the two is exactly this turn: its content and its end-of-turn scaffolding.
2. When a template is not prefix-stable (some move the system prompt to the last user turn, or
   drop past reasoning), fall back to character offsets: find each message's text in order in the
   full rendering.
3. Tokenize the full text with offsets. Masked: every token overlapping the assistant content, plus
   the end-of-turn token — the first special token after the content within the turn — which the
   drafter must learn to predict. Headers, whitespace scaffolding, user and system text stay 0.
   A token straddling content and scaffolding is masked (the model generates it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.data.conversation import Conversation
from eyas.errors import EyasError

# In fallback mode the end-of-turn token must come within this many tokens after the content.
_EOT_LOOKAHEAD = 3


class RenderError(EyasError):
    """One conversation cannot be rendered with this template (counted as a skip, not fatal)."""


class ChatTemplateError(EyasError):
    """No usable chat template: none given and none in the tokenizer, or a file that cannot be used (fatal)."""


# --------------------------------------------------------------------------- the template, and prompts

NO_TEMPLATE = ("the target's tokenizer has no chat template (a base model?); pass one with --chat-template FILE (a "
               "Jinja file, e.g. examples/chat-template.jinja)")


def read_chat_template(path: Path | None) -> str | None:
    """The text of a ``--chat-template`` FILE (None when none is given); one line naming the file if it is unusable."""
    if path is None:
        return None
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ChatTemplateError(f"--chat-template {path} does not exist; give a Jinja chat template file") from None
    except IsADirectoryError:
        raise ChatTemplateError(f"--chat-template {path} is a directory; give a Jinja chat template file") from None
    except UnicodeDecodeError:
        raise ChatTemplateError(f"--chat-template {path} is not UTF-8 text; a chat template is a Jinja text file") from None
    except OSError as err:
        raise ChatTemplateError(f"--chat-template {path} cannot be read ({err.strerror or err}); check the file and "
                                "its permissions") from None
    if not text.strip():
        raise ChatTemplateError(f"--chat-template {path} is empty; give a Jinja chat template file")
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:  # compiled as transformers compiles it, so a syntax error names this file, not a conversation
        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=text, add_generation_prompt=True)
    except TemplateSyntaxError as err:
        raise ChatTemplateError(f"--chat-template {path} is not valid Jinja (line {err.lineno}: {err.message}); "
                                "fix the file") from None
    except Exception:  # noqa: BLE001 — it compiles; refusing this probe conversation is the template's right
        pass
    return text


def chat_template_for(tokenizer, template: str | None) -> str:
    """The template prompts are rendered with: ``template`` (a --chat-template file's text), else the tokenizer's."""
    if tokenizer is None:
        raise ChatTemplateError("the target has no tokenizer, so prompts cannot be rendered; point --target at a "
                                "directory with tokenizer files, or a GGUF")
    chosen = template or getattr(tokenizer, "chat_template", None)
    if not chosen:
        raise ChatTemplateError(NO_TEMPLATE)
    return chosen


def require_chat_template(template: str | None, target_has_one: bool | None) -> None:
    """Refuse, before the target is loaded, a target known to carry no chat template when no ``--chat-template`` file
    was given (``template``): ``target_has_one`` is what a GGUF's header says (None: not known before the tokenizer
    loads, which :func:`chat_template_for` then judges)."""
    if template is None and target_has_one is False:
        raise ChatTemplateError(NO_TEMPLATE)


def chat_ids(tokenizer, messages: list[dict], template: str, generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered with ``template`` (by default with the generation prompt, as a prompt) as token ids.

    Tokenized without added specials: the template writes BOS and friends itself."""
    text = _apply(tokenizer, messages, template, generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _apply(tokenizer, messages: list[dict], template: str, generation_prompt: bool) -> str:
    """The template's text for ``messages``: a template that does not parse is fatal, a refused conversation not."""
    from jinja2 import TemplateSyntaxError

    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {err.lineno}: {err.message}); pass a "
                                "valid one with --chat-template FILE") from None
    except Exception as err:  # noqa: BLE001 — jinja raise_exception and friends: this conversation only
        raise RenderError(f"chat template error: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err


@dataclass
class Rendered:
    """Token ids and the 0/1 loss mask (1 = assistant token to learn), of equal length."""

    input_ids: list[int]
    loss_mask: list[int]
    prefix_stable: bool


class ChatRenderer:
    """Renders conversations with one tokenizer and chat template; computes loss masks."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        template = chat_template_for(tokenizer, chat_template)
        if not getattr(tokenizer, "is_fast", False):
            raise EyasError("loss masks need a fast tokenizer (character offsets); this target's tokenizer is not one")
        self.tokenizer = tokenizer
        self.template = template
        self.special_ids = _special_ids(tokenizer)

    def text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The template's rendering of ``messages`` as text."""
        return _apply(self.tokenizer, messages, self.template, generation_prompt)

    def render(self, conversation: Conversation) -> Rendered:
        """Token ids and assistant-only loss mask of one conversation."""
        messages = conversation.messages()
        full = self.text(messages)
        spans, stable = self._assistant_spans(messages, full)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        mask = [0] * len(ids)
        token = 0
        # An answer cut at the generation limit did not end there: its end-of-turn token is the
        # template's, not the model's, so it is not taught.
        cut = [t.truncated for t in conversation.turns if t.role == "assistant"]
        for (start, end, turn_end), truncated in zip(spans, cut, strict=True):
            while token < len(ids) and offsets[token][1] <= start:
                token += 1
            while token < len(ids) and offsets[token][0] < end:
                if offsets[token][1] > offsets[token][0]:  # skip zero-width artefacts
                    mask[token] = 1
                token += 1
            if not truncated:
                self._mark_end_of_turn(ids, offsets, mask, token, turn_end)
        return Rendered(input_ids=list(ids), loss_mask=mask, prefix_stable=stable)

    def _mark_end_of_turn(self, ids, offsets, mask, token: int, turn_end: int | None) -> None:
        limit = len(ids) if turn_end is not None else min(len(ids), token + _EOT_LOOKAHEAD)
        for j in range(token, limit):
            if turn_end is not None and offsets[j][0] >= turn_end:
                return
            if ids[j] in self.special_ids:
                mask[j] = 1
                return

    def _assistant_spans(self, messages: list[dict], full: str) -> tuple[list[tuple[int, int, int | None]], bool]:
        """(content start, content end, turn end or None) in characters, per assistant turn."""
        spans: list[tuple[int, int, int | None]] = []
        stable = True
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] == "system":
                continue  # templates move the system prompt around (e.g. into the last user turn)
            if message["role"] == "user":
                found = _find(full, message["content"], cursor)
                cursor = found[1] if found else cursor
                continue
            before = self.text(messages[:i], generation_prompt=True)
            through = self.text(messages[: i + 1])
            if full.startswith(through) and through.startswith(before):
                found = _find(full[: len(through)], message["content"], len(before))
                turn_end: int | None = len(through)
            else:
                stable = False
                found = _find(full, message["content"], cursor)
                turn_end = None
            if found is None:
                raise RenderError(f"the chat template changes assistant turn {i + 1}'s text; cannot locate it to mask")
            spans.append((found[0], found[1], turn_end))
            cursor = found[1]
        return spans, stable


def _find(text: str, content: str, start: int) -> tuple[int, int] | None:
    """Where ``content`` (or its trimmed form: templates often trim) appears in ``text`` from ``start``."""
    for needle in (content, content.strip()):
        if needle:
            at = text.find(needle, start)
            if at >= 0:
                return at, at + len(needle)
    return None


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids
