"""Capture a target's hidden states with vLLM's ``extract_hidden_states`` speculative method.

A standalone script for the vLLM environment (it never imports eyas): eyas runs it as a
subprocess with the Python that has vLLM, for targets too large to load through HF.

    python vllm_worker.py --model DIR --requests REQ.jsonl --layer-ids 2,15,27,30 --out DIR
    python vllm_worker.py --model DIR --requests - --max-model-len L ...   # requests on stdin, in groups

Each request line is ``{"id": str, "input_ids": [int, ...]}``; every request becomes one prefill
(``max_tokens=1``, fed as token ids, so the tokenization is exactly the caller's). vLLM copies
the residual stream at the requested layer ids into a cache-only draft layer and its
``ExampleHiddenStatesConnector`` saves it per request. vLLM layer id ``L`` is the input of
decoder layer ``L`` and id ``N`` the last layer's output before the final norm (not normalized).

Output in ``--out``: per request ``<safe id>.safetensors`` with ``hidden_states``
[T, len(layer_ids), H] in the order the ids were given and ``token_ids`` [T]; ``index.jsonl`` with
one ``{"id", "file", "tokens"}`` line per finished request, appended and flushed as each one
lands, so a killed worker resumes by skipping the ids already listed; ``meta.json`` records the
model, ids and engine settings, and a resume with different ones is refused; ``engine.json`` every
``LLM(...)`` argument used and the defaults chosen (``vllm_settings.py``), one log line each.

On a CPU-only host the stock connector cannot run (it stages copies in pinned memory on a
CUDA stream), so there the worker loads a subclass whose only change is a synchronous copy,
through vLLM's ``kv_connector_module_path`` plugin hook; everything else is stock vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

CPU_CONNECTOR = "EyasCpuHiddenStatesConnector"
PLUGIN_MODULE = "eyas_vllm_worker"  # the name this file is imported under by vLLM's engine processes
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
ENGINE_FILE = "engine.json"  # every LLM(...) argument this worker ran vLLM with, and the defaults it chose


def safe_name(sample_id: str) -> str:
    """A file name for ``sample_id``: its readable part plus a hash, so distinct ids never collide."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", sample_id)[:80].strip("._") or "sample"
    digest = hashlib.sha1(sample_id.encode("utf-8")).hexdigest()[:12]
    return f"{readable}-{digest}.safetensors"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description="Capture hidden states with vLLM's extract_hidden_states method.")
    parser.add_argument("--model", required=True, help="HF model directory or hub id")
    parser.add_argument("--requests", required=True, type=Path,
                        help='JSONL: {"id": str, "input_ids": [int, ...]}; - reads them from stdin, each group ended '
                        "by an empty line (a stream: eyas train --stream)")
    parser.add_argument("--layer-ids", required=True, help="vLLM layer ids, e.g. 2,15,27,30 (N = pre-norm last layer)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--engine-args", default="{}", type=json.loads,
                        help="JSON: the LLM(...) arguments asked for (null = the worker's default), e.g. "
                        '{"dtype": "bfloat16", "tensor_parallel_size": 8}')
    parser.add_argument("--max-model-len", type=int, default=None, help="default: longest request + 8")
    parser.add_argument("--batch-size", type=int, default=64, help="requests per generate() call (resume granularity)")
    return parser.parse_args(argv)


def parse_layer_ids(text: str) -> list[int]:
    """``"2,15,27,30"`` → [2, 15, 27, 30]; duplicates are refused (one slot per id)."""
    ids = [int(part) for part in text.strip("[] ").split(",") if part.strip()]
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise SystemExit(f"vllm_worker: --layer-ids {text!r} must be distinct non-negative integers")
    return ids


def read_requests(path: Path) -> list[tuple[str, list[int]]]:
    """The (id, input_ids) pairs of the requests file, checked for empty and repeated ids."""
    requests, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            sample_id, ids = str(record["id"]), [int(t) for t in record["input_ids"]]
            if sample_id in seen:
                raise SystemExit(f"vllm_worker: {path}:{number}: id {sample_id!r} appears twice")
            if not ids:
                raise SystemExit(f"vllm_worker: {path}:{number}: request {sample_id!r} has no tokens")
            seen.add(sample_id)
            requests.append((sample_id, ids))
    return requests


def finished_ids(out: Path) -> set[str]:
    """Ids already listed in ``index.jsonl`` whose file is present (a torn last line is ignored)."""
    index = out / "index.jsonl"
    if not index.exists():
        return set()
    done = set()
    for line in index.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the worker was killed mid-line; that request is redone
        if (out / record["file"]).exists():
            done.add(record["id"])
    return done


def check_meta(out: Path, meta: dict) -> None:
    """Write ``meta.json``, or refuse to resume into a directory captured with other settings."""
    path = out / "meta.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if any(old.get(k) != meta[k] for k in ("model", "layer_ids", "engine")):
            raise SystemExit(
                f"vllm_worker: {out} holds states captured with {old}, not {meta}; use another --out or empty it"
            )
        return
    write_json(path, meta)


def write_json(path: Path, record: dict) -> None:
    """Replace ``path`` with ``record`` as JSON, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def engine_kwargs(args: argparse.Namespace, vllm_ids: list[int], storage: Path, max_model_len: int, on_cpu: bool,
                  settings: dict) -> dict:
    """The ``LLM(...)`` arguments: ``settings`` (:func:`choose_settings`), then extract_hidden_states + the
    hidden-states connector, which the capture needs as they are."""
    transfer = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if on_cpu:
        transfer.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=PLUGIN_MODULE)
    return dict(
        **settings,
        model=args.model,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,  # requests are token ids and one sampled token is thrown away: no tokenizer needed
        # Chunked prefill would split a prompt over steps; a cached prefix would skip computing
        # (and so capturing) its states. Both must be off.
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}},
        },
        kv_transfer_config=transfer,
    )


def load_settings_rules():
    """``vllm_settings.py`` beside this file, by path: this script runs without eyas installed, and its own folder is
    kept off sys.path (its siblings must not shadow vLLM's modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eyas_vllm_settings", Path(__file__).with_name("vllm_settings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_plugin(out: Path) -> Path:
    """Make this file importable as ``eyas_vllm_worker`` from a private folder (for the CPU connector)."""
    folder = out / ".vllm_plugin"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).resolve(), folder / f"{PLUGIN_MODULE}.py")
    # vLLM forks or spawns its engine processes; they inherit the environment and import the
    # connector module by name from it.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(folder))
    return folder


def _build_cpu_connector():
    """The stock hidden-states connector with its CUDA-only copy step replaced by a plain one."""
    import fcntl

    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    if not hasattr(ExampleHiddenStatesConnector, "_submit_async_write"):
        # The override below replaces this one step of the stock connector (vLLM 0.32.0).
        raise RuntimeError("this vLLM's ExampleHiddenStatesConnector has no _submit_async_write; the CPU connector needs updating")

    class _Done:
        """Stands in for the CUDA event the stock get_finished polls: the copy is already done."""

        def query(self) -> bool:
            return True

    class EyasCpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        """Writes each finished request's states synchronously (CPU tensors need no staging)."""

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            cache = self._kv_cache  # [blocks, num_states, block_size, hidden]
            blocks = cache[torch.tensor(pending.block_ids, dtype=torch.long)]
            states = blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])
            # The cache view is strided (vLLM's LBNHC layout); safetensors wants packed tensors.
            hidden = states[: pending.token_ids.shape[0]].clone(memory_format=torch.contiguous_format)
            tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                save_file(tensors, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the reader waiting in load_hidden_states
            self._req_copy_events[pending.req_id] = _Done()  # get_finished reports it done

    return EyasCpuHiddenStatesConnector


def __getattr__(name: str):
    # vLLM looks the connector class up by name in this module; building it lazily keeps vLLM
    # out of imports that only want the helpers above.
    if name == CPU_CONNECTOR:
        cls = _build_cpu_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_request(out: Path, sample_id: str, states, token_ids) -> str:
    """Write one request's file atomically; returns its name."""
    from safetensors.torch import save_file

    name = safe_name(sample_id)
    tmp = out / f".{name}.tmp"
    save_file({"hidden_states": states.contiguous(), "token_ids": token_ids.contiguous()}, str(tmp))
    os.chmod(tmp, 0o644)  # save_file creates 0600 files; the states are not secret
    os.replace(tmp, out / name)
    return name


def collect(output, sample_id: str, input_ids: list[int], order: list[int], expect_states: int):
    """Load the connector's file for one finished request, check it, reorder it to the given ids."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    params = output.kv_transfer_params or {}
    path = params.get("hidden_states_path")
    if not path:
        raise SystemExit(f"vllm_worker: request {sample_id!r} finished without a hidden_states_path ({params})")
    data = load_hidden_states(path)  # waits on the connector's lock until the file is complete
    cleanup_hidden_states(path)
    states, tokens = data["hidden_states"], data["token_ids"].to(torch.long)
    if tokens.tolist() != input_ids:
        raise SystemExit(
            f"vllm_worker: request {sample_id!r}: vLLM captured token ids that differ from the input "
            f"({tokens.numel()} vs {len(input_ids)} tokens, first difference at "
            f"{next((i for i, (a, b) in enumerate(zip(tokens.tolist(), input_ids, strict=False)) if a != b), 'end')})"
        )
    if tuple(states.shape[:2]) != (len(input_ids), expect_states):
        raise SystemExit(
            f"vllm_worker: request {sample_id!r}: hidden_states has shape {list(states.shape)}, "
            f"expected [{len(input_ids)}, {expect_states}, H]"
        )
    return states[:, order], tokens


def run(args: argparse.Namespace) -> int:
    """Capture every request not yet in the index (``--requests -``: each group stdin sends); returns the number
    captured now."""
    layer_ids = parse_layer_ids(args.layer_ids)
    streamed = str(args.requests) == "-"
    if streamed and not args.max_model_len:
        raise SystemExit("vllm_worker: --requests - (requests on stdin) needs --max-model-len")
    requests = [] if streamed else read_requests(args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    on_cpu = not torch.cuda.is_available()
    rules = load_settings_rules()
    facts = rules.target_facts(rules.read_config(args.model))
    settings, notes = rules.choose_settings(args.engine_args, on_cpu, on_cpu and rules.amx_available(), facts)
    for note in notes:
        log(f"default {note}")
    check_meta(args.out, {"model": args.model, "layer_ids": layer_ids, "engine": settings})
    done = finished_ids(args.out)
    pending = [(i, ids) for i, ids in requests if i not in done]
    if not streamed:
        log(f"{len(requests)} requests, {len(requests) - len(pending)} already captured, {len(pending)} to go")
        if not pending:
            return 0
    max_len = args.max_model_len or max(len(ids) for _, ids in pending) + 8
    llm, order, expect = start_engine(args, layer_ids, max_len, on_cpu, settings, notes)
    started, captured = time.perf_counter(), [0, 0]  # requests, tokens
    groups = stdin_groups() if streamed else (pending[i : i + args.batch_size] for i in range(0, len(pending), args.batch_size))
    with open(args.out / "index.jsonl", "a", encoding="utf-8") as index:
        for batch in groups:
            capture_group(llm, batch, order, expect, args.out, index, captured)
            if not streamed:
                rate = captured[1] / max(time.perf_counter() - started, 1e-9)
                log(f"{len(requests) - len(pending) + captured[0]}/{len(requests)} requests captured ({rate:.0f} tokens/s)")
    return captured[0]


def start_engine(args: argparse.Namespace, layer_ids: list[int], max_len: int, on_cpu: bool, settings: dict,
                 notes: list) -> tuple:
    """vLLM's engine with the hidden-states connector → (llm, the order of the ids as given among vLLM's, ids tapped)."""
    # vLLM sorts and de-duplicates the ids it taps and returns states in that order.
    vllm_ids = sorted(layer_ids)
    order = [vllm_ids.index(i) for i in layer_ids]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # without it the CPU build reserves most of RAM
    if on_cpu:
        install_plugin(args.out)
    storage = args.out.resolve() / ".vllm_raw"  # absolute: the engine processes resolve it too
    shutil.rmtree(storage, ignore_errors=True)  # leftovers of a killed run; their ids never recur
    started = time.perf_counter()
    from vllm import LLM

    kwargs = engine_kwargs(args, vllm_ids, storage, max_len, on_cpu, settings)
    write_json(args.out / ENGINE_FILE, {"llm_args": kwargs, "defaults": notes})
    llm = LLM(**kwargs)
    log(f"engine ready in {time.perf_counter() - started:.1f} s ({'CPU connector' if on_cpu else STOCK_CONNECTOR})")
    return llm, order, len(vllm_ids)


def stdin_groups():
    """``--requests -``: the requests stdin sends, one JSON line each, a group ended by an empty line (then captured
    at once), until stdin closes."""
    group: list[tuple[str, list[int]]] = []
    for line in sys.stdin:
        if line.strip():
            record = json.loads(line)
            group.append((str(record["id"]), [int(t) for t in record["input_ids"]]))
        elif group:
            yield group
            group = []
    if group:
        yield group


def capture_group(llm, batch: list[tuple[str, list[int]]], order: list[int], expect: int, out: Path, index,
                  captured: list[int]) -> None:
    """One generate() over ``batch``: each request's states written to ``out`` and listed in ``index``."""
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], sampling, use_tqdm=False)
    for (sample_id, ids), output in zip(batch, outputs, strict=True):
        states, tokens = collect(output, sample_id, ids, order, expect)
        name = save_request(out, sample_id, states, tokens)
        index.write(json.dumps({"id": sample_id, "file": name, "tokens": len(ids)}) + "\n")
        index.flush()
        os.fsync(index.fileno())  # a killed worker must not list a request it did not finish
        captured[0] += 1
        captured[1] += len(ids)


def log(message: str) -> None:
    """Progress to stderr (eyas streams it to the user)."""
    print(f"vllm_worker: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    run(parse_args(argv))


if __name__ == "__main__":
    # Run as a script, this file's folder is sys.path[0]; its sibling modules must never shadow
    # vLLM's imports here or in the engine processes it starts.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    main()
