"""Turn one raw record into a clean Conversation, or a counted Skip — by documented rules.

Rules (docs/data.md repeats them for users):

- roles: human/user → user; gpt/assistant/chatgpt/bing/bard/model/bot → assistant; system → system.
  Any other role skips the conversation ("unknown role").
- content: a string, or a list of ``{"type": "text", "text": …}`` parts (joined). Any image,
  audio or other non-text part, or a non-string value, skips the conversation.
- leading system turns are kept (merged into one); a system turn later on skips the conversation.
- an empty system turn is dropped; the conversation is cut before its first empty user or
  assistant turn (the turns before it stay usable).
- assistant turns before the first user turn are dropped (nothing prompted them); consecutive
  turns of one role are merged with a blank line, since many templates demand alternation.
- a conversation with no turns left is skipped ("empty conversation").
- prompt-only records (prompt / instruction+input / question / MT-bench turns) become user turns
  with empty assistant placeholders between them: only regeneration can use them.
"""

from __future__ import annotations

from eyas.data.conversation import Conversation, Skip, Turn

_ROLE = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}
_PROMPT_FIELDS = ("prompt", "instruction", "question", "turns")


def normalize_record(row, origin: str, fallback_id: str):
    """Return a Conversation, or a Skip naming ``origin`` and the reason."""
    found = _normalize(row, origin, fallback_id)
    return found if isinstance(found, Skip) else _encodable(found, origin)


def _encodable(conversation: Conversation, origin: str):
    """The conversation, or a Skip when its id or a turn holds what UTF-8 cannot encode (a lone surrogate, which JSON's
    ``\\ud800`` escapes can spell): the tokenizer and the manifest could not take it."""
    for number, text in enumerate([conversation.id, *(turn.content for turn in conversation.turns)]):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            where = "its id" if number == 0 else f"turn {number}"
            return Skip(origin, "invalid text", f"{where}: {err.reason} at character {err.start}")
    return conversation


def _normalize(row, origin: str, fallback_id: str):
    if not isinstance(row, dict):
        return Skip(origin, "not an object", f"got {type(row).__name__}")
    sample_id = str(row["id"]) if isinstance(row.get("id"), (str, int)) and str(row.get("id")) else fallback_id
    if isinstance(row.get("conversations"), list):
        raw_turns, role_key, text_key = row["conversations"], "from", "value"
    elif isinstance(row.get("messages"), list):
        raw_turns, role_key, text_key = row["messages"], "role", "content"
    elif isinstance(row.get("turns"), list) and row["turns"] and all(isinstance(t, dict) for t in row["turns"]):
        # eyas' regeneration journal (regenerated*.jsonl): what was regenerated so far is data as it is
        raw_turns, role_key, text_key = row["turns"], "role", "content"
    elif any(isinstance(row.get(k), (str, list)) for k in _PROMPT_FIELDS):
        return _prompt_only(row, sample_id, origin)
    else:
        keys = ", ".join(sorted(map(str, row))) or "none"
        return Skip(origin, "missing fields", f"no 'conversations', 'messages' or prompt field (keys: {keys})")

    turns: list[Turn] = []
    for number, raw in enumerate(raw_turns, start=1):
        if not isinstance(raw, dict):
            return Skip(origin, "missing fields", f"turn {number} is not an object")
        role_name = raw.get(role_key, raw.get("role", raw.get("from")))
        if not isinstance(role_name, str):
            return Skip(origin, "missing fields", f"turn {number} has no role")
        role = _ROLE.get(role_name.strip().lower())
        if role is None:
            return Skip(origin, "unknown role", f"turn {number}: {role_name!r}")
        text = _text(raw.get(text_key, raw.get("content", raw.get("value"))))
        if text is None:
            return Skip(origin, "non-text content", f"turn {number} ({role_name})")
        # A journal's flags travel: a truncated answer must not be taught to end its turn.
        turns.append(Turn(role, text, regenerated=raw.get("regenerated") is True, truncated=raw.get("truncated") is True))
    return _clean(turns, sample_id, origin)


def _text(value) -> str | None:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    return None


def _clean(turns: list[Turn], sample_id: str, origin: str):
    kept: list[Turn] = []
    for turn in turns:
        if turn.role == "system":
            if any(t.role != "system" for t in kept):
                return Skip(origin, "system turn mid-conversation")
            if not turn.content.strip():
                continue
        elif not turn.content.strip():
            break  # cut before the first empty user/assistant turn
        if turn.role == "assistant" and not any(t.role == "user" for t in kept):
            continue  # nothing prompted it
        if kept and kept[-1].role == turn.role:
            kept[-1] = Turn(turn.role, kept[-1].content + "\n\n" + turn.content, turn.regenerated, turn.truncated)
        else:
            kept.append(turn)
    if not any(t.role == "user" for t in kept):
        return Skip(origin, "empty conversation")
    return Conversation(id=sample_id, turns=kept, origin=origin)


def _prompt_only(row: dict, sample_id: str, origin: str):
    if isinstance(row.get("turns"), list):
        prompts = row["turns"]
    elif isinstance(row.get("instruction"), str):
        extra = row.get("input")
        prompts = [row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")]
    else:
        prompts = [row.get("prompt", row.get("question"))]
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        return Skip(origin, "non-text content" if prompts else "empty conversation", "prompt-only record")
    turns: list[Turn] = []
    for prompt in prompts:
        if turns:
            turns.append(Turn("assistant", ""))  # placeholder: regeneration writes it
        turns.append(Turn("user", prompt))
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        turns.insert(0, Turn("system", system))
    return Conversation(id=sample_id, turns=turns, origin=origin)
