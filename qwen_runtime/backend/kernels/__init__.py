"""The compiled kernels: numba machine code for the products of each stored type, each tested against its numpy
reference in :mod:`qwen_runtime.quants`.

The table below names the kernel of each (stored type, activation form).  A family's module is imported on first
use: its kernels have explicit signatures and compile (or load numba's cache) at import, so a model compiles only
the families it stores and the numpy path never loads numba.
"""

from __future__ import annotations

import importlib

import numpy as np

from ...quants.base import QType, TileKernel

# The compiled kernel of each type that has one: (module of this package, class), imported on first use so
# that numba loads only for ``kernels="numba"`` and each family compiles only when a model uses it.
JIT_KERNELS: dict[QType, tuple[str, str]] = {
    QType.Q8_0: ("q8_0", "Q8_0JitKernel"),
    QType.Q2_K: ("kquants", "Q2_KJitKernel"),
    QType.Q3_K: ("kquants", "Q3_KJitKernel"),
    QType.Q4_K: ("kquants", "Q4_KJitKernel"),
    QType.Q5_K: ("kquants", "Q5_KJitKernel"),
    QType.Q6_K: ("kquants", "Q6_KJitKernel"),
    QType.F32: ("dense", "F32JitKernel"),
    QType.F16: ("dense", "F16JitKernel"),
    QType.BF16: ("dense", "BF16JitKernel"),
    QType.Q4_0: ("legacy", "Q4_0JitKernel"),
    QType.Q4_1: ("legacy", "Q4_1JitKernel"),
    QType.Q5_0: ("legacy", "Q5_0JitKernel"),
    QType.Q5_1: ("legacy", "Q5_1JitKernel"),
    QType.IQ4_NL: ("iq4", "IQ4_NLJitKernel"),
    QType.IQ4_XS: ("iq4", "IQ4_XSJitKernel"),
    QType.IQ2_XXS: ("lattice", "IQ2_XXSJitKernel"),
    QType.IQ2_XS: ("lattice", "IQ2_XSJitKernel"),
    QType.IQ2_S: ("lattice", "IQ2_SJitKernel"),
    QType.IQ3_XXS: ("lattice", "IQ3_XXSJitKernel"),
    QType.IQ3_S: ("lattice", "IQ3_SJitKernel"),
    QType.IQ1_S: ("lattice", "IQ1_SJitKernel"),
    QType.IQ1_M: ("lattice", "IQ1_MJitKernel"),
    QType.TQ2_0: ("lattice", "TQ2_0JitKernel"),
}

# Integer-dot kernels with 8-bit activations (``Workspace.activations == "q8"``; other types keep their float kernel),
# with prompts on AMX tiles where the CPU has them (:class:`.amx.AmxPrompts`; the i-quants below IQ4 and TQ2_0
# prefill with their float kernels).
JIT_Q8_KERNELS: dict[QType, tuple[str, str]] = {
    QType.Q8_0: ("int8", "Q8_0AmxKernel"),
    QType.Q4_0: ("int8", "Q4_0AmxKernel"),
    QType.Q5_0: ("int8", "Q5_0AmxKernel"),
    QType.Q4_1: ("int8", "Q4_1AmxKernel"),
    QType.Q5_1: ("int8", "Q5_1AmxKernel"),
    QType.Q2_K: ("int8_k", "Q2_KAmxKernel"),
    QType.Q3_K: ("int8_k", "Q3_KAmxKernel"),
    QType.Q4_K: ("int8_k", "Q4_KAmxKernel"),
    QType.Q5_K: ("int8_k", "Q5_KAmxKernel"),
    QType.Q6_K: ("int8_k", "Q6_KAmxKernel"),
    QType.IQ4_NL: ("int8", "IQ4_NLAmxKernel"),
    QType.IQ4_XS: ("int8", "IQ4_XSAmxKernel"),
    QType.IQ2_XXS: ("lattice_int8", "IQ2_XXSInt8Kernel"),
    QType.IQ2_XS: ("lattice_int8", "IQ2_XSInt8Kernel"),
    QType.IQ2_S: ("lattice_int8", "IQ2_SInt8Kernel"),
    QType.IQ3_XXS: ("lattice_int8", "IQ3_XXSInt8Kernel"),
    QType.IQ3_S: ("lattice_int8", "IQ3_SInt8Kernel"),
    QType.IQ1_S: ("lattice_int8", "IQ1_SInt8Kernel"),
    QType.IQ1_M: ("lattice_int8", "IQ1_MInt8Kernel"),
    QType.TQ2_0: ("lattice_int8", "TQ2_0Int8Kernel"),
}


# Kernels of ``activations="q8-prompts"``: 8-bit activations only in prompts on AMX tiles, the exact float kernel
# in every other product (other types keep their float kernel).
JIT_PROMPT_KERNELS: dict[QType, tuple[str, str]] = {
    QType.Q8_0: ("amx", "Q8_0AmxPromptKernel"),
    QType.Q2_K: ("amx_k", "Q2_KAmxPromptKernel"),
    QType.Q3_K: ("amx_k", "Q3_KAmxPromptKernel"),
    QType.Q4_K: ("amx_k", "Q4_KAmxPromptKernel"),
    QType.Q5_K: ("amx_k", "Q5_KAmxPromptKernel"),
    QType.Q6_K: ("amx_k", "Q6_KAmxPromptKernel"),
    QType.IQ4_XS: ("amx_k", "IQ4_XSAmxPromptKernel"),
    QType.Q4_0: ("amx_blocks", "Q4_0AmxPromptKernel"),
    QType.Q4_1: ("amx_blocks", "Q4_1AmxPromptKernel"),
    QType.Q5_0: ("amx_blocks", "Q5_0AmxPromptKernel"),
    QType.Q5_1: ("amx_blocks", "Q5_1AmxPromptKernel"),
    QType.IQ4_NL: ("amx_blocks", "IQ4_NLAmxPromptKernel"),
}
ACTIVATION_KERNELS = {"q8": JIT_Q8_KERNELS, "q8-prompts": JIT_PROMPT_KERNELS}


def jit_kernel(qtype: QType, raw: np.ndarray, activations: str = "float") -> TileKernel | None:
    """The compiled tile kernel of a matrix stored as ``raw`` (None for a type without one, and for rows that are
    not one contiguous array, e.g. a Fortran-ordered npy file: the numpy kernels handle any strides); with
    ``activations="q8"`` the integer-dot kernel where the type has one, with ``"q8-prompts"`` its AMX prompt kernel."""
    entry = ACTIVATION_KERNELS.get(activations, {}).get(qtype) or JIT_KERNELS.get(qtype)
    if entry is None or not np.asarray(raw).flags.c_contiguous:
        return None
    module, name = entry
    return getattr(importlib.import_module(f".{module}", __name__), name)(raw)
