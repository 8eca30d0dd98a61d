"""The one in-memory shape every reader produces and every later step consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass
class Turn:
    """One message; ``regenerated`` marks an assistant turn written by the target itself, ``truncated``
    one whose generation stopped at the token limit (so its end-of-turn token is not the model's)."""

    role: str  # one of ROLES
    content: str
    regenerated: bool = False
    truncated: bool = False


@dataclass
class Conversation:
    """A conversation with a stable id and the place it came from (``file:line``) for messages."""

    id: str
    turns: list[Turn] = field(default_factory=list)
    origin: str = ""

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat-template messages ``[{role, content}]``."""
        return [{"role": t.role, "content": t.content} for t in self.turns]

    def has_assistant_turn(self) -> bool:
        """True when at least one turn is the assistant's (something to learn from)."""
        return any(t.role == "assistant" for t in self.turns)

    def to_json(self) -> dict:
        """A JSON-ready dict (the regeneration journal's line format)."""
        return {
            "id": self.id,
            "origin": self.origin,
            "turns": [
                {"role": t.role, "content": t.content, "regenerated": t.regenerated, "truncated": t.truncated}
                for t in self.turns
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> Conversation:
        """Inverse of :meth:`to_json`."""
        turns = [
            Turn(t["role"], t["content"], bool(t.get("regenerated", False)), bool(t.get("truncated", False)))
            for t in data["turns"]
        ]
        return cls(id=data["id"], turns=turns, origin=data.get("origin", ""))


@dataclass
class Skip:
    """A record left out, with where it was (``file:line``) and why (a short category)."""

    origin: str
    reason: str
    detail: str = ""
