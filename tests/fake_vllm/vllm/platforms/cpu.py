"""vLLM's CPU platform test for AMX (vllm/platforms/cpu.py), as the fake answers it: not x86 with AMX."""

import enum


class CpuArchEnum(enum.Enum):
    X86 = "x86"
    OTHER = "other"


class CpuPlatform:
    @staticmethod
    def get_cpu_architecture():
        return CpuArchEnum.OTHER
