"""Drafter families: what differs between EAGLE-3, DFlash and any other drafter, asked of one object.

A family is a folder (``eyas/families/<name>/``) whose ``__init__`` registers one :class:`Family`: its name (the value
of ``eyas train --drafter``), its own training options (a dataclass of :class:`eyas.options.Options` fields that
``eyas train`` adds to its flags), and the methods the stages call — build a drafter, train it one micro-batch at a
time, evaluate it, export it, check an exported directory, and decode with it in eyas' engine. The trainer, export,
check, bench and generate name no family: they ask the registry for the one a run, a RUN_DIR or a DRAFT_DIR is of.

A family's ``__init__`` stays light (no torch: ``eyas --help`` builds ``eyas train``'s flags from every family's
options); its methods import their modules when called.

Families outside eyas register the same way, from a module that calls :func:`register` on import, named in the
``EYAS_FAMILIES`` environment variable (comma-separated module names) or in an installed package's
``eyas.families`` entry point; docs/architecture.md, "Where to add a family or a rule", says how.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.errors import EyasError

if TYPE_CHECKING:
    import torch

BUILT_IN = ("eyas.families.eagle3", "eyas.families.dflash", "eyas.families.dspark")  # the families eyas ships, registered in this order
DEFAULT = "eagle3"  # the family of a RUN_DIR that records none, and of a DRAFT_DIR no other family claims
PLUGINS_VARIABLE = "EYAS_FAMILIES"
ENTRY_POINTS = "eyas.families"


@dataclasses.dataclass
class BuildInputs:
    """What :meth:`Family.build` builds a drafter from: the target's HF ``config``, the eyas ``layer_ids`` the data
    taps, the run's ``options`` (``eyas train``'s), the target's lm_head and embedding weights as loaded (on the CPU
    offline), ``vocab_path`` (the draft vocabulary DATA_DIR or FEATURES_DIR holds), the ``device`` and the dtype the
    teacher runs in."""

    config: Any
    layer_ids: tuple[int, ...]
    options: Any
    head: torch.Tensor
    embed: torch.Tensor
    vocab_path: Path
    device: torch.device
    teacher_dtype: torch.dtype


@dataclasses.dataclass
class Built:
    """A new drafter (an ``nn.Module`` with ``config.to_dict()`` and ``trainable_parameters()``), the target ids of its
    draft vocabulary (None: it predicts the target's whole vocabulary) and the target's embedding on the device when
    training reads it (None otherwise)."""

    drafter: Any
    draft_ids: torch.Tensor | None = None
    embed: torch.Tensor | None = None


class Family:
    """One drafter family. Subclasses set the attributes and implement the methods; each method names the stage that
    calls it. ``setup`` below is :class:`eyas.train.setup.TrainingSetup`: the drafter, the data sources, the teacher
    (``head``), ``draft_ids`` and ``embed`` as :meth:`build` returned them."""

    name: str = ""  # --drafter's value, train_options.json's "drafter"
    summary: str = ""  # what --drafter's help says of it
    options: type | None = None  # its own `eyas train` options: a dataclass of eyas.options fields, each with a default
    formats: dict[str, str] = {}  # `eyas export --format` values it writes → what each is; the first is its default
    shardable: bool = False  # whether `--fsdp` can shard it

    # ---------------------------------------------------------------- eyas train
    def validate(self, options, target_config) -> None:
        """Refuse, in one line naming the flags and a value that works, ``options`` (``eyas train``'s) with which
        :meth:`build` could not build a drafter beside a target of HF config ``target_config``. ``eyas train`` asks
        before it reads the target's weights or writes --out (ranges are the options' own: ``option(check=...)``);
        :meth:`build` should ask too. By default every value in range builds."""

    def training_bytes(self, options, target_config) -> int | None:
        """Bytes the drafter ``options`` build beside a target of HF config ``target_config`` holds on its device while
        it trains — its weights, their gradients and AdamW's two moments — counted from its config, before it is built
        (at least that: a part the options do not fix, such as a draft vocabulary, counted at its least). ``eyas train``
        refuses a drafter that cannot fit the device's free memory, naming :meth:`fitting`. None (the default): not
        estimated, not checked."""
        return None

    def fitting(self, options, target_config, free: int) -> str:
        """What to give instead, in one clause naming the flags, so that :meth:`training_bytes` fits ``free`` bytes."""
        return "choose smaller drafter options"

    def check_samples(self, options, longest: int) -> None:
        """Refuse, in one line naming the flag and a value that fits, ``options`` under which no training sample — the
        longest holds ``longest`` tokens — has a position to learn from (a block longer than every sample). ``eyas
        train`` asks once its data is read, before the drafter is built or anything is written. By default any
        length fits."""

    def nothing_learned(self, options) -> str:
        """What to change, in one clause naming the flags, when a run's steps found no position to learn from."""
        return "give training samples with trained (assistant) tokens"

    def build(self, inputs: BuildInputs) -> Built:
        """A new drafter for the target, on ``inputs.device``, seeded by ``inputs.options.seed``."""
        raise NotImplementedError

    def tally_weights(self, options, drafter) -> list[float]:
        """The weight of each of a step's tallies (losses, hits, counts) in its loss: one per TTT step, block slot, …"""
        raise NotImplementedError

    def micro_batch(self, setup, batch, options, weights: list[float], autocast, tallies: tuple, seed: int) -> int:
        """Forward and backward of one micro-batch (the loss divided by ``options.grad_accum``); adds to ``tallies``
        (losses, hits, counts: device tensors, one entry per weight) without reading them back; ``seed``: this batch's
        own (:func:`eyas.train.data.batch_seed`), for anything drawn at random → the batch's real tokens."""
        raise NotImplementedError

    def evaluate(self, setup, options, weights: list[float], autocast) -> dict:
        """Holdout acceptance of the drafter as it is now: at least ``loss``, ``accuracy`` (per tally),
        ``acceptance_cumulative`` and ``tau`` (simulated); ``positions``, what it judged (0: nothing, and the figures
        say nothing: ``eyas train`` says so instead of printing them); ``tau_meaning``, optional, says what that τ is."""
        raise NotImplementedError

    def shard(self, drafter) -> None:
        """FSDP2 over ranks (only when :attr:`shardable`)."""
        raise EyasError(f"--fsdp does not shard {self.name} drafters: train without it")

    # ---------------------------------------------------------------- eyas export / eyas check
    def exported(self, config: dict) -> bool:
        """Whether a DRAFT_DIR's ``config.json`` is this family's."""
        raise NotImplementedError

    def fit_config(self, config: dict) -> dict:
        """config.json as :func:`eyas.export.fit.fit_problems` reads it (the width of the target states the drafter
        reads, ``target_hidden_size`` else ``hidden_size``; ``vocab_size``; its layer ids): as written, by default."""
        return config

    def export(self, recorded: dict, weights: dict, fmt: str, dtype: str, train_options: dict, report: dict,
               target: dict, out: Path) -> tuple[dict, dict, str]:
        """RUN_DIR's drafter (``recorded``: its drafter_config.json; ``weights``: final/model.safetensors' tensors) in
        format ``fmt`` and ``dtype`` → (config.json's object, the tensors to write, the model card's markdown)."""
        raise NotImplementedError

    def check(self, directory: Path, config: dict, target, result) -> None:
        """``eyas check``: add to ``result`` (:class:`eyas.export.check.CheckResult`) what is wrong with the DRAFT_DIR
        ``directory`` whose config.json is ``config`` (and, given the ``target``'s sizes, what does not fit it)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- eyas bench / eyas generate
    def runner(self, draft_dir: Path, layout, capacity: int, modes: list) -> Any:
        """The engine's drafter runner for ``draft_dir`` beside a target of ``layout`` (its embedding, lm_head and
        layer count; the drafter takes the embedding's device and dtype) whose cache holds ``capacity`` positions — the
        runner's holds more, what its rounds write beyond the target's (:func:`eyas.engine.modes.drafter_spare`) — for
        ``modes`` (refused in one line when it cannot decode one). It has ``layer_ids``: the taps it reads."""
        raise NotImplementedError

    def default_modes(self, config: dict) -> list | None:
        """The modes eyas bench decodes when --mode is not given (None: bench's default)."""
        return None

    def vllm_chains(self, config: dict, modes: list) -> tuple[list[tuple[str, int, str | None]], list[str]]:
        """What eyas bench asks of vLLM for ``modes``: (row name, proposals a round, vLLM's speculative method or None
        for its default) per configuration, and a note per mode vLLM does not run."""
        return [], [f"{self.name} drafters: measured in eyas' engine only (vLLM has no loader for them)"]


_registry: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Add ``family`` (once per name; a second family of a name already taken is refused) → it."""
    if not family.name or not family.name.isidentifier():
        raise EyasError(f"a drafter family needs a name that is an identifier, not {family.name!r}")
    known = _registry.get(family.name)
    if known is not None and type(known) is not type(family):
        raise EyasError(f"two drafter families are named {family.name!r}: {type(known).__module__} and "
                        f"{type(family).__module__}")
    for f in dataclasses.fields(family.options) if family.options is not None else ():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EyasError(f"drafter family {family.name!r}: option {f.name} needs a default (eyas train runs every "
                            "family from one set of flags)")
    _registry[family.name] = family
    return family


def _load() -> None:
    """Import the built-in families, then those named by $EYAS_FAMILIES and by installed packages' entry points."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    named = [name.strip() for name in os.environ.get(PLUGINS_VARIABLE, "").split(",") if name.strip()]
    for module in (*BUILT_IN, *named):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise EyasError(f"{PLUGINS_VARIABLE} names {module!r}, which does not import ({err}): fix the name or "
                            "PYTHONPATH") from err
    for point in entry_points(group=ENTRY_POINTS):
        point.load()


def families() -> list[Family]:
    """Every registered family, built-in first."""
    _load()
    return list(_registry.values())


def names() -> list[str]:
    """The registered families' names."""
    return [family.name for family in families()]


def named(name: str, where: str = "") -> Family:
    """The family called ``name``; one line naming the known ones (and how to add one) if none is."""
    _load()
    family = _registry.get(name)
    if family is None:
        raise EyasError(f"{where or 'drafter family'} {name!r} is no drafter family this eyas knows (known: "
                        f"{', '.join(_registry)}); a family from outside eyas is loaded by naming its module in "
                        f"${PLUGINS_VARIABLE}")
    return family


def of_run(train_options: dict, where: str = "RUN_DIR") -> Family:
    """The family a RUN_DIR's train_options.json trained (its ``drafter``; a run recording none is EAGLE-3's)."""
    return named(str(train_options.get("drafter", DEFAULT)), f"{where} trained a drafter of family")


def of_config(config: dict) -> Family:
    """The family a DRAFT_DIR's config.json is of: the first other family that claims it, else the default."""
    for family in families():
        if family.name != DEFAULT and family.exported(config):
            return family
    return named(DEFAULT)


def of_draft_dir(draft_dir: Path) -> Family:
    """The family of the DRAFT_DIR ``draft_dir`` (its config.json read; see :func:`of_config`)."""
    from eyas.export.files import read_draft_config

    return of_config(read_draft_config(Path(draft_dir)))


def export_formats() -> dict[str, str]:
    """Every family's export formats → what each is, with the family that writes it."""
    return {name: f"{what} ({family.name} runs)" for family in families() for name, what in family.formats.items()}


def options_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """Every family's own options as (name, type, field) for ``eyas train``'s schema, each help led by the names of
    the families that read it; an option two families share must be declared alike (same type and default)."""
    import typing

    from eyas.options import copied_field

    merged: dict[str, tuple[Any, dataclasses.Field, list[str]]] = {}
    for family in families():
        if family.options is None:
            continue
        hints = typing.get_type_hints(family.options)
        for f in dataclasses.fields(family.options):
            seen = merged.get(f.name)
            if seen is not None:
                if seen[0] != hints[f.name] or seen[1].default != f.default:
                    raise EyasError(f"drafter families {seen[2][0]} and {family.name} both declare option {f.name}, "
                                    "differently: rename one")
                seen[2].append(family.name)
                continue
            merged[f.name] = (hints[f.name], f, [family.name])
    # the help is the first declaration's, led by every family that reads the option
    return [(name, kind, copied_field(f, f"{', '.join(owners)}: ")) for name, (kind, f, owners) in merged.items()]


def _readers() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every family option's name → (its field, the families that read it)."""
    readers: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for family in families():
        for f in dataclasses.fields(family.options) if family.options is not None else ():
            readers.setdefault(f.name, (f, []))[1].append(family.name)
    return readers


def unread_names(drafter: str) -> set[str]:
    """The options only families other than ``drafter`` read: a value of theirs means nothing to its runs (a resume
    does not compare them)."""
    return {name for name, (_, owners) in _readers().items() if drafter not in owners}


def unread_options(drafter: str, values: dict[str, Any]) -> list[tuple[dataclasses.Field, list[str]]]:
    """The options in ``values`` (name → value) given a value other than their default although only families other
    than ``drafter`` read them → (field, the families that read it) each; an option the chosen family shares with
    others, and every option no family declares (the shared ones), is read."""
    unread = []
    for name, (f, owners) in _readers().items():
        if drafter in owners or name not in values:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if values[name] != default:
            unread.append((f, owners))
    return unread


def unread_refusal(drafter: str, values: dict[str, Any], spell, choose) -> str | None:
    """The one line refusing :func:`unread_options` (None when there are none): ``spell(field)`` says how the option is
    written (``--hidden-size``), ``choose(name)`` how choosing family ``name`` is (``--drafter NAME``)."""
    unread = unread_options(drafter, values)
    if not unread:
        return None
    owners = list(dict.fromkeys(owner for _, names in unread for owner in names))
    named = ", ".join(spell(f) for f, _ in unread)
    one = len(unread) == 1
    return (f"{named} {'is an option' if one else 'are options'} of {' and '.join(owners)} drafters; {choose(drafter)} "
            f"does not read {'it' if one else 'them'}: leave {'it' if one else 'them'} out (or choose "
            f"{' or '.join(choose(owner) for owner in owners)})")
