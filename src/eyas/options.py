"""One schema for every option: a dataclass field holds its default and its help text.

The command line (``eyas.flags``), run configs (``eyas.config``) and Python callers all read an
option from its field, so a default is written once (flag > file > default). Each stage keeps its
options next to it (``data/options.py``, ``capture/options.py``, ...); this module holds the field
helper, the engine options ``eyas bench`` and ``eyas generate`` share, and the options of the
commands that are not stages. Nothing here imports torch: ``eyas --help`` and ``import eyas.config``
stay light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, positional: bool = False,
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field: its default (none = required; ``factory`` = computed), help, and flag if not ``--name``.

    ``flag`` spells a bool pair as ``--x/--no-x``; ``positional`` makes it a command argument.
    On the command line a tuple is comma-separated text (``--layer-ids 2,15,27``), a list a
    repeatable flag, and a nested options dataclass contributes its own fields as flags.
    """
    metadata = {"help": help, "flag": flag, "positional": positional}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def remote_code() -> Any:
    """The ``trust_remote_code`` field every command that loads a target has."""
    return option(False, "allow (and run) model code shipped with the target")


def chat_template_file() -> Any:
    """The ``chat_template`` field of every command that renders prompts (prepare, bench, generate)."""
    return option(None, "a Jinja chat template file to render prompts with instead of the target's own (needed for a "
                  "target without one, such as a base model)")


def force_option() -> Any:
    """The ``--force`` field of every stage that writes a directory (:func:`eyas.outputs.claim_out`): one meaning."""
    return option(False, "replace what --out already holds (other data, or this stage's earlier output: finished, made "
                  "from other inputs, or a run --resume would continue) and skip the free-space check")


@dataclass(kw_only=True)
class EngineOptions:
    """How eyas' engine decodes (``eyas bench``, ``eyas generate``): sampling, answer length, device, CUDA graphs."""

    temperature: float = option(0.0, "sampling temperature; 0 = greedy (eyas bench then also compares the outputs with "
                                "plain decoding)")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this probability")
    max_new_tokens: int = option(256, "longest answer in tokens")
    seed: int = option(0, "sampling seed")
    device: str | None = option(None, "cuda or cpu (default: cuda when available)")
    trust_remote_code: bool = remote_code()
    chat_template: Path | None = chat_template_file()
    graphs: bool = option(True, "on CUDA, replay decoding rounds from CUDA graphs", flag="--graphs/--no-graphs")
    compile: bool = option(False, "on CUDA, fuse each decoding round with torch.compile before recording it "
                           "(faster rounds; each mode compiles once)", flag="--compile/--no-compile")
    lean: bool = option(True, "decode Llama-family targets through eyas' fused Llama forward (q/k/v and gate/up one "
                        "matmul each); --no-lean: the model's own forward", flag="--lean/--no-lean")


@dataclass
class InspectOptions:
    """The options of ``eyas inspect``."""

    target: str = option(help="hub id, HF directory, .gguf file, or 'demo'", positional=True)
    as_json: bool = option(False, "print one JSON object instead of a table", flag="--json")
    trust_remote_code: bool = remote_code()


@dataclass
class CheckOptions:
    """The options of ``eyas check``."""

    draft_dir: Path = option(help="a drafter directory (eyas', SpecForge's, EAGLE's, ...)", positional=True)
    target: str | None = option(None, "the target, to check what each engine's layer ids capture")


@dataclass
class GenerateOptions(EngineOptions):
    """The options of ``eyas generate``."""

    prompt: str = option(help="the user message (the chat template is applied)", positional=True)
    target: str = option(help="the target that answers")
    draft: Path | None = option(None, "DRAFT_DIR; without it the target decodes alone")
    mode: str = option("chain:5", "chain:K or tree:TOTAL,DEPTH,TOPK")
    as_json: bool = option(False, "print one JSON object at the end instead of streaming: token_ids (generated only), "
                           "text, and with --draft tau and rounds", flag="--json")


@dataclass
class RunOptions:
    """The options of ``eyas run``."""

    config: Path = option(help="a TOML run config (see examples/*.toml)", positional=True)
    overrides: list[str] = option(help="override one option, e.g. --set train.lr=1e-4 (repeatable; over the file, which is "
                                  "over the defaults)", flag="--set", factory=list)
    stages: tuple[str, ...] | None = option(None, "comma-separated subset of the config's stages to run now")


@dataclass
class DemoOptions:
    """The options of ``eyas demo``."""

    out: Path = option(Path("eyas-demo"), "where the demo writes its stage directories")
    quick: bool = option(False, "every stage at smoke-test size (about a minute)")
