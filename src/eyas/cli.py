"""The ``eyas`` command: thin wrappers that parse flags and call the stage functions."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from eyas.errors import EyasError

app = typer.Typer(
    help=(
        "eyas trains EAGLE-3 draft models for a target LLM and measures that they make it faster.\n\n"
        "TARGET is everywhere a hub id, a local HF directory, a .gguf file, or 'demo' "
        "(SmolLM2-135M-Instruct, offline)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


@app.command()
def inspect(
    target: str = typer.Argument(..., help="hub id, HF directory, .gguf file, or 'demo'"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow model code shipped with the target"),
) -> None:
    """Print what eyas understood about TARGET: layout, sizes, layer ids in each engine's spelling.

    Reads only the config (and tokenizer); no weights are loaded.
    """
    from eyas.target.describe import describe_target

    with _user_errors():
        info = describe_target(target, trust_remote_code=trust_remote_code)
    if as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return
    table = Table(title=f"eyas inspect {target}", show_header=False)
    rows = [
        ("source", info.source),
        ("architecture", f"{info.architecture} (model_type {info.model_type})"),
        ("decoder layers", f"{info.layers_path}: N = {info.num_layers}"),
        ("hidden size H", str(info.hidden_size)),
        ("vocab", str(info.vocab_size)),
        ("parameters", f"{info.parameters / 1e6:,.1f} M"),
        ("token embedding", info.embed_path),
        ("final norm", info.norm_path),
        ("lm_head", info.lm_head_path),
        ("layer ids (eyas = vLLM)", f"{info.layer_ids}  (input of decoder layer L)"),
        ("  SGLang spelling", str(info.sglang_layer_ids) if info.sglang_layer_ids else "not expressible"),
        ("  SpecForge spelling", f"{info.specforge_layer_ids}  (output of layer L-1)"),
        ("chat template", {True: "present", False: "absent", None: "no tokenizer found"}[info.chat_template]),
        ("dtype", info.dtype),
        ("device plan", info.device_plan),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


@app.command()
def demo() -> None:
    """Run every built stage of the pipeline on the demo target, offline, and say what is not built yet."""
    from eyas.demo import run_demo

    with _user_errors():
        run_demo(console)


class _user_errors:
    """Turn EyasError into a red one-paragraph message and exit code 2 (no traceback)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if isinstance(err, EyasError):
            err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
            sys.exit(2)
        return False


def main() -> None:
    """Entry point for ``python -m eyas``."""
    app()
