"""One schema for every option: a dataclass field holds its default, its help text and its allowed values.

The command line (``eyas.flags``), run configs (``eyas.config``) and Python callers all read an
option from its field, so a default is written once (flag > file > default), and so is its range:
``option(check=...)`` is tested when an options dataclass is built (every one derives from
:class:`Options`), when a run config is read, and so on the command line. Each stage keeps its
options next to it (``data/options.py``, ``capture/options.py``, ...); this module holds the field
helper and its checks, the engine options ``eyas bench`` and ``eyas generate`` share, and the
options of the commands that are not stages. Nothing here imports torch: ``eyas --help`` and
``import eyas.config`` stay light.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from eyas.errors import EyasError, OptionError
from eyas.speculation import DRAFT_SAMPLING, DRAWN_TREES_FROM, MODE_SPELLING, VERIFICATION, Sampling, parse_mode


@dataclass(frozen=True)
class Check:
    """What an option's value must be: ``test`` passes or fails a value, ``expected`` says what passes (in errors,
    and in the flag's help when ``shown``); ``items``: the rule is each item's, of a tuple or list."""

    test: Callable[[Any], bool]
    expected: str
    shown: bool = True
    items: bool = False

    @property
    def summary(self) -> str:
        """The rule in the flag's help: "≥ 1", "each in [0, 1)"."""
        return ("each " if self.items else "") + self.expected

    def problem(self, value: Any) -> str | None:
        """None when ``value`` passes (None, an option not given, always does), else the rule it breaks
        ("must be ≥ 1", "each must be in [0, 1)")."""
        if value is None:
            return None
        try:
            passed = self.test(value)
        except (TypeError, ValueError, EyasError) as refused:
            if getattr(refused, "rule", None):  # a check function that says which rule it is (a mode's)
                return refused.rule
            passed = False
        return None if passed else ("each " if self.items else "") + "must be " + self.expected


def at_least(low: float) -> Check:
    """Values ≥ ``low``."""
    return Check(lambda value: value >= low, f"≥ {low}")


def above(low: float) -> Check:
    """Values > ``low``."""
    return Check(lambda value: value > low, f"> {low}")


def within(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    """Values between ``low`` and ``high``, each end included unless it is open."""
    def test(value):
        return (value > low if low_open else value >= low) and (value < high if high_open else value <= high)

    return Check(test, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


def one_of(*names: str) -> Check:
    """One of ``names`` (not repeated in the help, which names them)."""
    return Check(lambda value: value in names, "one of " + ", ".join(names), shown=False)


class _NoValues(ValueError):
    rule = "must hold one or more values"  # what Check.problem says of it


def each(check: Check, empty: bool = False) -> Check:
    """A tuple or list whose every item passes ``check``; one with no item only when ``empty`` (a repeatable flag given
    no time): a comma-separated option of none (``temperature = []`` in a run config) means nothing it could do."""
    def test(values) -> bool:
        if not empty and len(values) == 0:
            raise _NoValues
        return all(check.problem(v) is None for v in values)

    return Check(test, check.expected, check.shown, items=True)


HTTP_URL = Check(lambda value: re.fullmatch(r"https?://[^\s/]+(/\S*)?", value) is not None,
                 "an http:// or https:// URL (e.g. http://127.0.0.1:8000/v1)", shown=False)
SEED = within(0, 2**32 - 1)  # every seed: what torch, numpy and the servers' samplers all take
DEVICE = Check(lambda value: re.fullmatch(r"cpu|cuda(:\d+)?", value) is not None, "cpu, cuda or cuda:N", shown=False)


class Options:
    """Base of every options dataclass: building one tests each field against its ``option(check=...)``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rule = field_problem(f, value)
            if rule is not None:
                raise OptionError(type(self).__name__, f.name, value, rule)


def field_problem(f: dataclasses.Field, value: Any) -> str | None:
    """The rule of the field's check that ``value`` breaks ("must be ≥ 1"), or None when it passes."""
    check = f.metadata.get("check")
    return None if check is None else check.problem(value)


def field_flag(f: dataclasses.Field) -> str:
    """A field's flag: its ``option(flag=...)`` (a bool pair ``--x/--no-x``), else ``--name`` with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, positional: bool = False,
           factory: Callable[[], Any] | None = None, check: Check | None = None) -> Any:
    """A dataclass field: its default (none = required; ``factory`` = computed), help, flag if not ``--name``,
    and ``check``, what its values must be.

    ``flag`` spells a bool pair as ``--x/--no-x``; ``positional`` makes it a command argument.
    On the command line a tuple is comma-separated text (``--layer-ids 2,15,27``), a list a
    repeatable flag, and a nested options dataclass contributes its own fields as flags.
    """
    metadata = {"help": help, "flag": flag, "positional": positional, "check": check}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def copied_field(f: dataclasses.Field, help_prefix: str = "") -> Any:
    """A new field declared as ``f`` is (its default or factory, help, flag and check), for a dataclass composed of
    others' fields (``eyas train``'s: the shared options and every drafter family's); ``help_prefix`` leads its help."""
    metadata = {**f.metadata, "help": help_prefix + f.metadata.get("help", "")}
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=metadata)
    return field(default=f.default, metadata=metadata) if f.default is not MISSING else field(metadata=metadata)


def remote_code() -> Any:
    """The ``trust_remote_code`` field every command that loads a target has."""
    return option(False, "allow (and run) Python code shipped with the target (transformers' trust_remote_code): only "
                  "for a target you trust")


def compile_layers_option() -> Any:
    """The ``compile_layers`` field of every command that captures with the target loaded in HF (capture, train's
    --stream and --online; a remote producer, eyas produce, takes the trainer's in its plan)."""
    return option(True, "on CUDA, capture with each of the target's decoder layers compiled (torch.compile: its norms, "
                  "rotary embedding and activation fused; the first batches wait for the compilation); the capture's "
                  "hooks still run around every layer, so each tap is checked as in the eager forward. "
                  "--no-compile-layers runs the HF forward as it is", flag="--compile-layers/--no-compile-layers")


def chat_template_file() -> Any:
    """The ``chat_template`` field of every command that renders prompts (prepare, bench, generate)."""
    return option(None, "a Jinja chat template file to render prompts with instead of the target's own (needed for a "
                  "target without one, such as a base model)")


def _key_value(text: str) -> bool:
    key, sep, _ = text.partition("=")
    return bool(sep) and key.strip().isidentifier()


KEY_VALUE = Check(_key_value, "KEY=VALUE, e.g. max_num_seqs=16 (VALUE read as JSON where it parses)")


def vllm_python_option() -> Any:
    """The ``vllm_python`` field of every command that runs vLLM (capture, bench): one meaning."""
    return option(None, "python of the vLLM environment (default: $EYAS_VLLM_PYTHON; `make vllm-venv` builds one with "
                  "vLLM's CPU build)")


def vllm_args_option(what: str) -> Any:
    """The repeatable ``--vllm-arg KEY=VALUE`` field of every command that runs vLLM; ``what``: when it applies."""
    return option(help=f"another LLM(...) argument for vLLM ({what}; repeatable)", flag="--vllm-arg", factory=list,
                  check=each(KEY_VALUE, empty=True))


def force_option() -> Any:
    """The ``--force`` field of every stage that writes a directory (:func:`eyas.outputs.claim_out`): one meaning."""
    return option(False, "replace what --out already holds (other data, or this stage's earlier output: finished, made "
                  "from other inputs, or a run --resume would continue) and skip the free-space check")


def temperature_option(default: Any = 0.0, several: str | None = None) -> Any:
    """The ``temperature`` field of the engine's options: one temperature, or with ``several`` (what a comma-separated
    list of them does: ``eyas bench``'s) a tuple of them."""
    return _one_or_several(default, "sampling temperature", several,
                           "0 = greedy (eyas bench then also compares the outputs with plain decoding)", at_least(0))


def draft_sampling_option(default: Any = "auto", several: str | None = None) -> Any:
    """The ``draft_sampling`` field of the engine's options: how a sampled round drafts, one of :data:`DRAFT_SAMPLING`,
    or with ``several`` (what a comma-separated list of them does) a tuple of them."""
    return _one_or_several(default, "with --temperature > 0", several, "greedy = drafts are the drafter's argmax (a "
                           "tree's top-k), accepted with the target's probability; probabilistic = drafts drawn from the "
                           "drafter's own distribution (same temperature and top-p; a tree of fixed shape draws each "
                           "node's children without replacement), accepted with min(1, p/q); auto = probabilistic in "
                           f"chains, and in trees from T = {DRAWN_TREES_FROM} (greedy below) (measured: BENCHMARKS.md, "
                           "Sampling)", one_of(*DRAFT_SAMPLING))


def verification_option(default: Any = "standard", several: str | None = None) -> Any:
    """The ``verification`` field of the engine's options: how a sampled round judges its drafts, one of
    :data:`VERIFICATION`, or with ``several`` (what a comma-separated list of them does) a tuple of them."""
    return _one_or_several(default, "with --temperature > 0", several, "standard = token by token; block = a chain's "
                           "drafts judged together (Sun et al. 2024: never fewer kept on average)", one_of(*VERIFICATION))


def _one_or_several(default: Any, head: str, several: str | None, meaning: str, check: Check) -> Any:
    """A field of one value, or with ``several`` (what a comma-separated list of them does) a tuple of values: its help
    is ``head``, then ``several``, then what the values mean; ``check`` tests the value, or each item."""
    if several is None:
        return option(default, f"{head}: {meaning}", check=check)
    return option(default, f"{head}, {several}: {meaning}", check=each(check))


@dataclass(kw_only=True)
class EngineOptions(Options):
    """How eyas' engine decodes (``eyas bench``, ``eyas generate``): sampling, answer length, device, dtype, CUDA graphs."""

    temperature: float = temperature_option()
    top_p: float = option(1.0, "nucleus sampling (with --temperature > 0): sample from the smallest set of tokens "
                          "whose probabilities add up to this; 1 = every token", check=within(0, 1, low_open=True))
    max_new_tokens: int = option(256, "longest answer in tokens", check=at_least(1))
    seed: int = option(0, "seed of the sampling draws (with --temperature > 0): the same seed, the same output",
                       check=SEED)
    draft_sampling: str = draft_sampling_option()
    verification: str = verification_option()
    device: str | None = option(None, "where the target and drafter run: cuda, cuda:N or cpu (default: cuda when "
                                "available)", check=DEVICE)
    dtype: str = option("auto", "what the target and drafter decode in: bf16, fp32, or auto = bf16 on CUDA and on a CPU "
                        "with native bf16 matrix multiplies (AVX-512 BF16 or AMX: a forward of a few tokens then costs "
                        "what one costs), else fp32. Greedy speculation equals plain decoding token for token only in "
                        "fp32 (in bf16 a near-tie may round differently in a one-token and a k-token forward)",
                        check=one_of("auto", "bf16", "fp32"))
    trust_remote_code: bool = remote_code()
    chat_template: Path | None = chat_template_file()
    graphs: bool = option(True, "on CUDA, replay decoding rounds from CUDA graphs", flag="--graphs/--no-graphs")
    compile: bool = option(True, "on CUDA, fuse each decoding round with torch.compile before recording it: the "
                           "fastest rounds, after a warm-up of about a minute per mode that is timed apart and cached "
                           "on disk for later runs (--no-compile: record the model's own kernels, no warm-up)",
                           flag="--compile/--no-compile")
    lean: bool = option(True, "decode Llama-family targets through eyas' fused Llama forward (q/k/v and gate/up one "
                        "matmul each); --no-lean: the model's own forward", flag="--lean/--no-lean")

    def sampling(self) -> Sampling:
        """The :class:`eyas.speculation.Sampling` these options ask for."""
        return Sampling(self.temperature, self.top_p, self.seed, self.draft_sampling, self.verification)


@dataclass
class InspectOptions(Options):
    """The options of ``eyas inspect``."""

    target: str = option(help="hub id, HF directory, .gguf file, or 'demo'", positional=True)
    as_json: bool = option(False, "print one JSON object instead of a table", flag="--json")
    trust_remote_code: bool = remote_code()


@dataclass
class CheckOptions(Options):
    """The options of ``eyas check``."""

    draft_dir: Path = option(help="a drafter directory (eyas', SpecForge's, EAGLE's, ...)", positional=True)
    target: str | None = option(None, "the target, to check what each engine's layer ids capture")


@dataclass
class GenerateOptions(EngineOptions):
    """The options of ``eyas generate``."""

    prompt: str = option(help="the user message (the chat template is applied)", positional=True)
    target: str = option(help="the target that answers: a hub id, an HF directory, a .gguf file or 'demo'")
    draft: Path | None = option(None, "DRAFT_DIR; without it the target decodes alone")
    mode: str = option("chain:5", "chain:K or tree:TOTAL,DEPTH,TOPK", check=Check(parse_mode, MODE_SPELLING, shown=False))
    as_json: bool = option(False, "print one JSON object at the end instead of streaming: token_ids (generated only), "
                           "text, and with --draft tau and rounds", flag="--json")


@dataclass
class RunOptions(Options):
    """The options of ``eyas run``."""

    config: Path = option(help="a TOML run config (see examples/*.toml)", positional=True)
    overrides: list[str] = option(help="override one option, e.g. --set train.lr=1e-4 (repeatable; over the file, which is "
                                  "over the defaults)", flag="--set", factory=list)
    stages: tuple[str, ...] | None = option(None, "comma-separated subset of the config's stages to run now")


@dataclass
class DemoOptions(Options):
    """The options of ``eyas demo``."""

    out: Path = option(Path("eyas-demo"), "where the demo writes its stage directories")
    quick: bool = option(False, "every stage at smoke-test size (a few minutes on two cores): proves the pipeline runs, not the drafter")
    released: Path | None = option(None, "a drafter for the demo target to bench beside the demo's own (default: the "
                                   "checkout's releases/ drafter, when there is one)")


@dataclass
class ProduceOptions(Options):
    """Feed a trainer on another host: capture its batches here (``eyas train --stream --stream-listen HOST:PORT``
    there). The trainer says what to capture — its plan: the batches of DATA_DIR, the layer ids, the dtype —; this host's
    DATA_DIR and target must be the trainer's (checked by their manifest's and weights' fingerprints)."""

    trainer: str = option(help="HOST:PORT the trainer listens at (its --stream-listen)")
    target: str = option(help="the target, as this host holds it")
    data: Path = option(help="DATA_DIR, as this host holds it (the trainer's, by its manifest)")
    device: str | None = option(None, "where the target runs with HF (default: cuda:0 on a GPU host, else cpu; cuda "
                                "spreads it over every GPU)")
    engine: str = option("hf", "what runs the target: hf (transformers) or vllm (eyas' vLLM capture worker)",
                         check=one_of("hf", "vllm"))
    vllm_python: str | None = vllm_python_option()
    vllm_args: list[str] = vllm_args_option("--engine vllm")
    trust_remote_code: bool = remote_code()
