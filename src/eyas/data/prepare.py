"""``eyas prepare``: conversations → DATA_DIR (token ids, loss masks, split, draft vocabulary).

Order of work: read every source (bad records become counted skips) → drop exact duplicates →
optionally regenerate the assistant turns with the target → render with the chat template and
mask the assistant tokens → apply the length policy → split train/holdout by a hash of the
conversation's id (every answer set of a conversation on one side) → count masked tokens of the
train split into the draft vocabulary → write the files atomically, ``manifest.json`` last (its
presence means the directory is complete).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eyas.data.conversation import Conversation, Skip
from eyas.data.fits_target import tokenizer_sha256, tokenizer_vocab_sha256
from eyas.data.options import PrepareOptions
from eyas.data.readers import read_source
from eyas.data.regenerate_workers import regenerate_in_dir
from eyas.data.render import ChatRenderer, RenderError, read_chat_template, require_chat_template
from eyas.data.samples import Sample, conversation_of, repeated_id, write_samples
from eyas.data.vocab import VOCAB_FILE, build_draft_vocab, count_masked_tokens, save_vocab
from eyas.errors import EyasError
from eyas.io import write_json_atomic
from eyas.manifest import MANIFEST, clear_manifest, input_record, manifest_fields
from eyas.out_lock import one_writer
from eyas.outputs import StageOut
from eyas.progress import progress_bar

FILES = {"train": "train.parquet", "holdout": "holdout.parquet", "vocab": VOCAB_FILE}
MARKERS = (*FILES.values(), "regenerate*")  # what prepare writes before its manifest: the files, regeneration journals


@dataclass
class PrepareStats:
    """Counts for the manifest and the printed summary."""

    records_read: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason → count (bad or unusable records)
    skip_examples: list[str] = field(default_factory=list)  # "file:line reason: detail", first few
    duplicates: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason → count (after rendering)
    truncated: int = 0
    train_samples: int = 0
    holdout_samples: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    prefix_unstable: int = 0  # rendered through the character-offset fallback
    clipped_for_length: int = 0  # conversations whose late turns were not regenerated (beyond max length)
    regeneration: dict | None = None
    seconds: float = 0.0


@one_writer("prepare", lambda options: options.out)
def prepare(options: PrepareOptions) -> PrepareStats:
    """Run the prepare stage; returns the statistics (also saved in the manifest)."""
    from eyas.target.facts import target_facts, target_input
    from eyas.target.loading import load_target_config, load_tokenizer, ships_chat_template

    _check_options(options)
    template = read_chat_template(options.chat_template)  # a missing file fails before the target is loaded
    require_chat_template(template, ships_chat_template(options.target))  # a GGUF's header says, before it converts
    started = time.perf_counter()
    out = Path(options.out)
    stage_out = StageOut.claim("prepare", out, options.force, MARKERS)
    previous = stage_out.previous
    config, source = load_target_config(options.target, options.trust_remote_code)
    tokenizer = load_tokenizer(source, options.trust_remote_code)
    if tokenizer is None:
        raise EyasError(f"target {options.target!r} ships no tokenizer at {source}; prepare needs one")
    renderer = ChatRenderer(tokenizer, template)
    fingerprint = _fingerprint(options, tokenizer, renderer.template)
    if previous is not None:  # a DATA_DIR prepare finished: the same result is skipped, another one kept unless --force
        recorded = previous.get("fingerprint") or {k: previous.get(k) for k in fingerprint}  # older: at the top level
        if recorded == fingerprint and not options.force:
            raise AlreadyPrepared(out)
        stage_out.keep_inputs(recorded, fingerprint)

    stats = PrepareStats()
    conversations = _read_all(options, stats)
    if options.regenerate:
        conversations = _clip_for_regeneration(conversations, renderer, options.max_length, stats)
        conversations, regen = regenerate_in_dir(conversations, out, options.target, options.regeneration,
                                                 workers=options.workers, chat_template=renderer.template)
        stats.regeneration = asdict(regen)
    samples = _render_all(conversations, renderer, options, stats)
    train, holdout = _split(samples, options.holdout)
    stats.train_samples, stats.holdout_samples = len(train), len(holdout)
    if not train:
        raise EyasError(_nothing_left(stats, options.data))

    vocab_size = max(_target_vocab_size(config), len(tokenizer))
    counts = count_masked_tokens(((s.input_ids, s.loss_mask) for s in train), vocab_size)
    vocab = build_draft_vocab(counts, options.draft_vocab_size)
    # int32 ids + uint8 masks (before Parquet's compression), the vocabulary's int64 counts and d2t and bool t2d
    stage_out.need(5 * stats.tokens + 9 * vocab_size + 8 * len(vocab.d2t) + 2**20, "the prepared data")
    inputs = [*(input_record("source", spec) for spec in options.data), target_input(target_facts(options.target, config, source))]
    with stage_out.writing(f"{out} holds no finished DATA_DIR now (no manifest.json): free space, then rerun the same "
                           "command"):
        clear_manifest(out)  # until the new files are all written, nothing claims DATA_DIR is finished
        write_samples(train, out / FILES["train"])
        write_samples(holdout, out / FILES["holdout"])
        save_vocab(vocab, out / FILES["vocab"])
        stats.seconds = time.perf_counter() - started
        write_json_atomic(out / MANIFEST, _manifest(options, fingerprint, stats, vocab_size, len(vocab.d2t), inputs,
                                                        tokenizer_vocab_sha256(tokenizer)))
    return stats


class AlreadyPrepared(EyasError):
    """DATA_DIR already holds a complete run with the same inputs and options."""

    def __init__(self, out: Path):
        super().__init__(f"{out} already holds this prepared data (same sources, tokenizer, template and options); "
                         "pass --force to prepare it again")


def _check_options(options: PrepareOptions) -> None:
    if not options.data:
        raise EyasError("give at least one --data source (a file, a folder, 'sharegpt' or a hub dataset)")


def _read_all(options: PrepareOptions, stats: PrepareStats) -> list[Conversation]:
    seen_content: set[str] = set()
    seen_ids: Counter = Counter()
    kept: list[Conversation] = []
    for spec in options.data:
        for record in read_source(spec):
            stats.records_read += 1
            if not isinstance(record, Skip) and not options.regenerate:
                record = _trainable_as_is(record)
            if isinstance(record, Skip):
                stats.skipped[record.reason] += 1
                if len(stats.skip_examples) < 20:
                    stats.skip_examples.append(f"{record.origin} {record.reason}" + (f": {record.detail}" if record.detail else ""))
                continue
            digest = hashlib.sha256(json.dumps(record.messages(), ensure_ascii=False).encode()).hexdigest()
            if digest in seen_content:
                stats.duplicates += 1
                continue
            seen_content.add(digest)
            seen_ids[record.id] += 1
            if seen_ids[record.id] > 1:  # same id, other content (two sources): keep both, distinctly
                record.id = repeated_id(record.id, seen_ids[record.id])
            kept.append(record)
            if options.limit is not None and len(kept) >= options.limit:
                return kept
    return kept


def _nothing_left(stats: PrepareStats, sources: list[str]) -> str:
    counted = [*stats.skipped.items(), *stats.dropped.items(), *([("exact duplicates", stats.duplicates)]
                                                                 if stats.duplicates else [])]
    listed = "; ".join(f"{reason}: {count}" for reason, count in counted if count) or "no records at all"
    hint = " (prompt-only data needs --regenerate)" if stats.skipped.get("prompt-only record") else ""
    examples = "".join(f"\n  {e}" for e in stats.skip_examples[:5])
    read = f"{stats.records_read} records read in {', '.join(sources)}"
    return f"no training samples left from {read} — {listed}{hint}{examples}"


def _trainable_as_is(conversation: Conversation) -> Conversation | Skip:
    """Without regeneration: records with no answer are unusable; a trailing unanswered user turn is dropped."""
    if not any(t.role == "assistant" and t.content for t in conversation.turns):
        return Skip(conversation.origin, "prompt-only record", "no assistant answer; --regenerate can write them")
    while conversation.turns[-1].role != "assistant":
        conversation.turns.pop()
    return conversation


def _clip_for_regeneration(conversations, renderer: ChatRenderer, max_length: int, stats) -> list[Conversation]:
    """Drop the turns whose answer would start beyond --max-length: they would be cut off anyway,
    and generating them costs the most (the longest prompts) and can overflow the server's context."""
    kept = []
    with progress_bar("measuring prompts", total=len(conversations), unit="conv") as advance:
        for start in range(0, len(conversations), _CLIP_CHUNK):
            chunk = conversations[start:start + _CLIP_CHUNK]
            for conversation, turns in zip(chunk, _turns_within(chunk, renderer, max_length), strict=True):
                if turns is None:
                    stats.dropped["template error"] += 1
                elif not any(t.role == "user" for t in turns):
                    stats.dropped["first prompt longer than max length"] += 1
                else:
                    stats.clipped_for_length += len(turns) < len(conversation.turns)
                    conversation.turns = turns
                    kept.append(conversation)
            advance(len(chunk))
    return kept


# Prompts are tokenized a chunk at a time in one batched call, which the tokenizer spreads over all cores.
_CLIP_CHUNK = 512


def _turns_within(chunk: list[Conversation], renderer: ChatRenderer, max_length: int) -> list[list | None]:
    """Per conversation, its turns up to the first answer whose prompt reaches max_length (None: the
    template refused it)."""
    prompts, owners = [], []  # every answer's prompt, and (conversation, answer position) for each
    failed = set()
    for n, conversation in enumerate(chunk):
        turns, messages = conversation.turns, conversation.messages()
        positions = [i for i, t in enumerate(turns) if t.role == "assistant"]
        if turns[-1].role == "user":
            positions.append(len(turns))  # regeneration answers a final user turn too
        try:
            texts = [renderer.text(messages[:i], generation_prompt=True) for i in positions]
        except RenderError:
            failed.add(n)
            continue
        prompts.extend(texts)
        owners.extend((n, i) for i in positions)
    lengths = [len(ids) for ids in renderer.tokenizer(prompts, add_special_tokens=False)["input_ids"]] if prompts else []
    cut: dict[int, int] = {}
    for (n, i), length in zip(owners, lengths, strict=True):
        if length >= max_length - 1 and n not in cut:
            cut[n] = max(0, i - 1)  # also drop the user turn that asked for it
    return [None if n in failed else c.turns[:cut[n]] if n in cut else c.turns for n, c in enumerate(chunk)]


def _render_all(conversations: list[Conversation], renderer: ChatRenderer, options, stats) -> list[Sample]:
    samples: list[Sample] = []
    with progress_bar("tokenizing", total=len(conversations), unit="conv") as advance:
        for conversation in conversations:
            advance(1)
            try:
                rendered = renderer.render(conversation)
            except RenderError as err:
                stats.dropped["template error"] += 1
                if len(stats.skip_examples) < 20:
                    stats.skip_examples.append(f"{conversation.origin} template error: {err}")
                continue
            ids, mask = rendered.input_ids, rendered.loss_mask
            if len(ids) > options.max_length:
                if options.overflow == "drop":
                    stats.dropped["longer than max length"] += 1
                    continue
                ids, mask = ids[: options.max_length], mask[: options.max_length]
                stats.truncated += 1
            if not any(mask):
                stats.dropped["no assistant token within max length"] += 1
                continue
            stats.prefix_unstable += not rendered.prefix_stable
            stats.tokens += len(ids)
            stats.masked_tokens += sum(mask)
            samples.append(Sample(conversation.id, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return samples


def _split(samples: list[Sample], fraction: float) -> tuple[list[Sample], list[Sample]]:
    """Deterministic: a sample is held out when the hash of its conversation's id falls below ``fraction``, so every
    answer set of one conversation falls on the same side (a second answer to a held-out prompt never trains)."""
    train, holdout = [], []
    for sample in samples:
        bucket = int.from_bytes(hashlib.sha256(conversation_of(sample.id).encode()).digest()[:8], "big") / 2**64
        (holdout if bucket < fraction else train).append(sample)
    return train, holdout


def _target_vocab_size(config) -> int:
    from eyas.target.layout import text_config

    return int(getattr(text_config(config), "vocab_size", 0) or 0)


def _fingerprint(options: PrepareOptions, tokenizer, template: str) -> dict:
    return {
        "sources": list(options.data),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "options": {
            "max_length": options.max_length,
            "overflow": options.overflow,
            "holdout": options.holdout,
            "draft_vocab_size": options.draft_vocab_size,
            "limit": options.limit,
            "regenerate": options.regenerate,
            "regeneration": _regeneration_print(options.regeneration) if options.regenerate else None,
        },
    }


def _regeneration_print(options) -> dict:
    """The regeneration options as the fingerprint records them: one temperature as a number, as before several could
    be given (a DATA_DIR prepared then is still the same data)."""
    recorded = asdict(options)
    if len(options.temperature) == 1:
        recorded["temperature"] = options.temperature[0]
    return recorded


def _manifest(options: PrepareOptions, fingerprint: dict, stats: PrepareStats, vocab_size: int, draft_vocab: int,
              inputs: list[dict], vocab_sha256: str) -> dict:
    stats_dict = asdict(stats)
    stats_dict["skipped"] = dict(stats.skipped)
    stats_dict["dropped"] = dict(stats.dropped)
    return {
        **manifest_fields("prepare", options, inputs, options.out, FILES.values()),
        "target": options.target,
        "fingerprint": fingerprint,
        "sources": fingerprint["sources"],
        "tokenizer_sha256": fingerprint["tokenizer_sha256"],
        "tokenizer_vocab_sha256": vocab_sha256,  # what later stages compare with their target's (eyas.data.fits_target)
        "chat_template_sha256": fingerprint["chat_template_sha256"],
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab,
        "files": FILES,
        "stats": stats_dict,
    }
