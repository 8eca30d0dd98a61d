"""``eyas train --stream``'s sources: the producer's plan from the run's options — started here (HF on
``--producer-device``, or vLLM) or awaited from another host (``--stream-listen``) — and the training and holdout
sources the trainer takes batches from."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.errors import EyasError


def stream_sources(options, device: torch.device, dtype: torch.dtype, facts: dict):
    """(train source, holdout source or None, layer ids, the draft vocabulary's path) of a --stream run against the
    target ``facts`` describe (:func:`eyas.target.facts.target_facts` and its weights' fingerprint)."""
    from eyas.data.fits_target import require_data_fits
    from eyas.data.vocab import VOCAB_FILE
    from eyas.manifest import verify_stage_dir
    from eyas.target.layer_ids import resolve_layer_ids
    from eyas.train.data import width_multiple
    from eyas.train.stream.source import StreamHoldout, StreamSource

    if options.data is None or options.features is not None or options.online:
        raise EyasError("--stream captures from DATA_DIR while it trains: give --data DATA_DIR, without --features or "
                        "--online")
    _refuse_unread(options)
    verify_stage_dir(options.data, "prepare")
    require_data_fits(options.data, options.target, options.trust_remote_code)
    data_dir = Path(options.data)
    layer_ids = tuple(resolve_layer_ids(options.layer_ids, facts["num_layers"]))
    multiple = width_multiple(device)
    holdout = (data_dir / "holdout.parquet").is_file()
    opened = _remote_stream if options.stream_listen is not None else _local_stream
    stream = opened(options, device, facts, data_dir, layer_ids, multiple, holdout)
    train = StreamSource(stream, data_dir, "train", options.token_budget, device, dtype, multiple)
    held = StreamHoldout(stream, data_dir, options.token_budget, device, dtype, multiple) if holdout else None
    return train, held, layer_ids, data_dir / VOCAB_FILE


def _refuse_unread(options) -> None:
    """Producer options this run's producer would not read, refused in one line."""
    if options.stream_listen is not None:
        given = [flag for flag, value in (("--producer-device", options.producer_device),
                                          ("--stream-producer", options.stream_producer != "auto"),
                                          ("--stream-engine", options.stream_engine != "hf"),
                                          ("--vllm-arg", options.vllm_args), ("--vllm-python", options.vllm_python))
                 if value]
        if given:
            raise EyasError(f"{', '.join(given)}: with --stream-listen the producer runs on another host; give "
                            f"{'it' if len(given) == 1 else 'them'} to eyas produce there")
    else:
        from eyas.train.stream.producer import engine_refusal

        refusal = engine_refusal(options.stream_engine, options.producer_device, "--producer-device",
                                 options.vllm_args, options.vllm_python)
        if refusal:
            raise EyasError(refusal)
        if options.stream_engine == "vllm" and not options.compile_layers:
            raise EyasError("--no-compile-layers configures the HF producer's capture; vLLM runs the target as its "
                            "--vllm-arg settings say (enforce_eager, compilation_config): leave it out")
        if options.stream_producer == "thread" and options.stream_engine == "vllm":
            raise EyasError("--stream-producer thread runs the target with HF in the trainer's process; the vllm engine "
                            "runs in a worker process of its own: leave --stream-producer out")


def _local_stream(options, device, facts, data_dir, layer_ids, multiple, holdout):
    """The producer on this host, a process or a thread (:class:`eyas.train.stream.source.Stream`)."""
    from eyas.capture.vllm_client import RESERVED_ARGS, parse_vllm_args
    from eyas.train.stream.producer import ProducerSpec
    from eyas.train.stream.source import Stream

    vllm = options.stream_engine == "vllm"
    spec = ProducerSpec(target=options.target, device=options.producer_device or _one_device(device), data=str(data_dir),
                        layer_ids=layer_ids, token_budget=options.token_budget, multiple=multiple,
                        dtype=options.stream_dtype, trust_remote_code=options.trust_remote_code, holdout=holdout,
                        compile_layers=options.compile_layers,
                        engine=options.stream_engine, vllm_python=options.vllm_python,
                        vllm_engine=parse_vllm_args(options.vllm_args, RESERVED_ARGS) if vllm else None)
    where = "with vLLM" if vllm else f"on {spec.device}"
    return Stream(spec, options.stream_depth, f"runs the target {where}, capturing {data_dir} at {spec.dtype} up to "
                  f"{options.stream_depth} batches ahead of the trainer", thread=producer_in_thread(options, device))


def _remote_stream(options, device, facts, data_dir, layer_ids, multiple, holdout):
    """The producer on another host, awaited at --stream-listen (:class:`eyas.train.stream.remote.RemoteStream`)."""
    from eyas.io import file_sha256
    from eyas.manifest import MANIFEST
    from eyas.train.stream.remote import Plan, RemoteStream

    plan = Plan(data_sha256=file_sha256(data_dir / MANIFEST), target=facts, layer_ids=layer_ids,
                token_budget=options.token_budget, multiple=multiple, dtype=options.stream_dtype,
                depth=options.stream_depth, holdout=holdout, compile_layers=options.compile_layers)
    hidden = facts["hidden_size"]
    command = f"eyas produce --trainer {options.stream_listen} --target TARGET --data DATA_DIR"
    return RemoteStream(options.stream_listen, plan, (len(layer_ids) * hidden, hidden), command)


def producer_in_thread(options, device: torch.device) -> bool:
    """Whether this host's producer runs as a thread of the trainer's process: ``--stream-producer thread``, or ``auto``
    with the target in HF on the trainer's own GPU, where a thread streamed faster than a process (0.909× offline
    training against 0.876×: BENCHMARKS, "Streaming capture against a store"); a process otherwise."""
    if options.stream_producer != "auto":
        return options.stream_producer == "thread"
    own_gpu = device.type == "cuda" and options.producer_device in (None, _one_device(device))
    return options.stream_engine == "hf" and own_gpu


def _one_device(device: torch.device) -> str:
    """The trainer's device as one device (a bare ``cuda`` would spread the producer's target over every GPU)."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


