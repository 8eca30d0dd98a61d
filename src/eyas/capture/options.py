"""The options of ``eyas capture`` (and of ``eyas capture --check``): each field's default and help, once."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from eyas.options import (
    Check,
    Options,
    above,
    at_least,
    compile_layers_option,
    each,
    force_option,
    one_of,
    option,
    remote_code,
    vllm_args_option,
    vllm_python_option,
)


def _json_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


JSON_OBJECT = Check(_json_object, "a JSON object")


def _writer_threads() -> int:
    # SHA-256 runs at ~1 GiB/s per core: several shards in flight keep up with a fast GPU.
    return max(2, min(4, (os.cpu_count() or 2) // 2))


@dataclass
class CaptureOptions(Options):
    """Capture the target's hidden states for DATA_DIR into FEATURES_DIR (sharded safetensors).

    Estimates the bytes first and refuses when the disk is short. Killed at any moment, the same
    command resumes; under `torchrun --nproc-per-node N eyas capture ...` each rank captures its
    share of the shards (NCCL on GPUs, gloo on CPU) and rank 0 writes the manifest.
    """

    target: str = option(help="the target whose hidden states are captured")
    data: Path = option(help="DATA_DIR written by eyas prepare")
    out: Path = option(help="FEATURES_DIR to write (resumable: rerun the same command)")
    dtype: str = option("bf16", "storage precision: bf16, fp16, fp32, or fp8 (e4m3 + per-token scale, half of bf16)")
    layer_ids: tuple[int, ...] | None = option(None, "eyas layer ids, e.g. 2,15,27 (default: 2, N//2, N-3)",
                                               check=each(at_least(0)))
    splits: tuple[str, ...] = option(("train", "holdout"), "which DATA_DIR splits to capture")
    token_budget: int = option(16384, "tokens per forward batch, padding included", check=at_least(1))
    max_batch: int = option(64, "most sequences per forward batch", check=at_least(1))
    shard_mb: int = option(256, "approximate shard size in MiB (0: one forward batch per shard)", check=at_least(0))
    max_gb: float | None = option(None, "cap the store size: samples beyond it are left out", check=above(0))
    force: bool = force_option()
    engine: str = option("hf", "hf (in-process transformers) or vllm (vLLM's extract_hidden_states)",
                         check=one_of("hf", "vllm"))
    compile_layers: bool = compile_layers_option()
    vllm_python: str | None = vllm_python_option()
    # The vLLM engine's settings (engine vllm): named as vLLM's own LLM(...) arguments; every value the worker used,
    # eyas' defaults included, is recorded in the store's manifest under "vllm_engine".
    vllm_dtype: str | None = option(None, "dtype vLLM computes in (engine vllm; default: auto on CUDA, float32 on CPU, "
                                    "bfloat16 for an MLA target on a CPU with AMX, whose MLA kernel takes bf16 only)",
                                    check=one_of("auto", "float32", "bfloat16", "float16"))
    tensor_parallel_size: int = option(1, "vLLM tensor-parallel size (engine vllm): GPUs (or CPU ranks) per replica",
                                       check=at_least(1))
    pipeline_parallel_size: int = option(1, "vLLM pipeline-parallel size (engine vllm)", check=at_least(1))
    enable_expert_parallel: bool = option(False, "vLLM expert parallelism for MoE layers (engine vllm)",
                                          flag="--enable-expert-parallel/--no-enable-expert-parallel")
    attention_backend: str | None = option(None, "vLLM attention backend, e.g. FLASH_ATTN, FLASHMLA, CPU_ATTN, CPU_MLA "
                                           "(engine vllm; default: vLLM's choice)")
    compilation_config: str | None = option(None, "vLLM compilation config as JSON (engine vllm); a custom_ops entry "
                                            "naming rotary_embedding replaces eyas' CPU MLA rotary workaround "
                                            "(-rotary_embedding)", check=JSON_OBJECT)
    vllm_args: list[str] = vllm_args_option("engine vllm")
    trust_remote_code: bool = remote_code()
    writer_threads: int = option(help="threads hashing and writing shards (default: half the cores, 2 to 4)",
                                 factory=_writer_threads, check=at_least(1))

    def vllm_settings_given(self) -> list[str]:
        """The vLLM engine settings set away from their defaults (they mean something with engine vllm only)."""
        return [f.name for f in fields(self) if f.name in (*VLLM_ARGS.values(), "vllm_args")
                and getattr(self, f.name) != (f.default if f.default is not MISSING else f.default_factory())]


# The options above that are LLM(...) arguments: LLM(...) name → option name.
VLLM_ARGS = {"dtype": "vllm_dtype", "tensor_parallel_size": "tensor_parallel_size",
             "pipeline_parallel_size": "pipeline_parallel_size", "enable_expert_parallel": "enable_expert_parallel",
             "attention_backend": "attention_backend", "compilation_config": "compilation_config"}


@dataclass
class StoreCheckOptions(Options):
    """``eyas capture --check FEATURES_DIR``: verify a store instead of capturing one."""

    check: Path | None = option(None, "verify FEATURES_DIR (checksums, counts, re-capture a few samples)")
    check_samples: int = option(4, "samples --check re-captures with the live target (0: checksums and counts only)",
                                check=at_least(0))
    check_dtype: str = option("auto", "compute dtype of --check's re-capture: auto (the target's default, bfloat16 on a "
                              "GPU) or float32, whose tighter bound resolves ~1 % errors when the capture ran in float32 too",
                              check=one_of("auto", "float32", "bfloat16", "float16"))
