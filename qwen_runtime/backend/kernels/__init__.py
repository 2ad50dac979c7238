"""The compiled kernels: numba machine code for the products of each stored type, each tested against its numpy
reference in :mod:`qwen_runtime.quants`.

One table (:func:`kernel_table`) names the kernel class of each (activation form, stored type).  Importing this
package imports neither numba nor a kernel module, so the numpy path never loads numba; the table imports the kernel
modules when first asked, which compiles nothing: each kernel compiles (or loads numba's on-disk cache) when a weight
that calls it is built (:class:`.base.Declared`), so a process holds machine code only for the types its models store
and the forms they use.
"""

from __future__ import annotations

import functools

import numpy as np

from ...quants.base import QType, TileKernel

# The activation forms (``Workspace.activations`` once resolved): "float", the exact float kernels; "q8", every
# product of a quantized type with 8-bit activations as llama.cpp multiplies (integer dot products, prompts on AMX
# tiles where the CPU has them); "q8-prompts", 8-bit activations only in prompts on AMX tiles, the exact float
# kernel in every other product.  A type without a kernel of its own in a form takes its float kernel.
FORMS = ("float", "q8", "q8-prompts")


@functools.cache
def kernel_table() -> dict[str, dict[QType, type[TileKernel]]]:
    """The compiled kernel class of each activation form and stored type (the i-quants below IQ4 and TQ2_0 have no
    AMX prompt kernel: with ``"q8"`` they prefill with their float kernels)."""
    from . import amx, amx_blocks, amx_k, dense, int8, int8_k, iq4, kquants, lattice, lattice_int8, legacy, q8_0

    return {
        "float": {
            QType.F32: dense.F32JitKernel, QType.F16: dense.F16JitKernel, QType.BF16: dense.BF16JitKernel,
            QType.Q8_0: q8_0.Q8_0JitKernel,
            QType.Q4_0: legacy.Q4_0JitKernel, QType.Q4_1: legacy.Q4_1JitKernel,
            QType.Q5_0: legacy.Q5_0JitKernel, QType.Q5_1: legacy.Q5_1JitKernel,
            QType.Q2_K: kquants.Q2_KJitKernel, QType.Q3_K: kquants.Q3_KJitKernel, QType.Q4_K: kquants.Q4_KJitKernel,
            QType.Q5_K: kquants.Q5_KJitKernel, QType.Q6_K: kquants.Q6_KJitKernel,
            QType.IQ4_NL: iq4.IQ4_NLJitKernel, QType.IQ4_XS: iq4.IQ4_XSJitKernel,
            QType.IQ2_XXS: lattice.IQ2_XXSJitKernel, QType.IQ2_XS: lattice.IQ2_XSJitKernel,
            QType.IQ2_S: lattice.IQ2_SJitKernel, QType.IQ3_XXS: lattice.IQ3_XXSJitKernel,
            QType.IQ3_S: lattice.IQ3_SJitKernel, QType.IQ1_S: lattice.IQ1_SJitKernel,
            QType.IQ1_M: lattice.IQ1_MJitKernel, QType.TQ2_0: lattice.TQ2_0JitKernel,
        },
        "q8": {
            QType.Q8_0: int8.Q8_0AmxKernel,
            QType.Q4_0: int8.Q4_0AmxKernel, QType.Q4_1: int8.Q4_1AmxKernel,
            QType.Q5_0: int8.Q5_0AmxKernel, QType.Q5_1: int8.Q5_1AmxKernel,
            QType.Q2_K: int8_k.Q2_KAmxKernel, QType.Q3_K: int8_k.Q3_KAmxKernel, QType.Q4_K: int8_k.Q4_KAmxKernel,
            QType.Q5_K: int8_k.Q5_KAmxKernel, QType.Q6_K: int8_k.Q6_KAmxKernel,
            QType.IQ4_NL: int8.IQ4_NLAmxKernel, QType.IQ4_XS: int8.IQ4_XSAmxKernel,
            QType.IQ2_XXS: lattice_int8.IQ2_XXSInt8Kernel, QType.IQ2_XS: lattice_int8.IQ2_XSInt8Kernel,
            QType.IQ2_S: lattice_int8.IQ2_SInt8Kernel, QType.IQ3_XXS: lattice_int8.IQ3_XXSInt8Kernel,
            QType.IQ3_S: lattice_int8.IQ3_SInt8Kernel, QType.IQ1_S: lattice_int8.IQ1_SInt8Kernel,
            QType.IQ1_M: lattice_int8.IQ1_MInt8Kernel, QType.TQ2_0: lattice_int8.TQ2_0Int8Kernel,
        },
        "q8-prompts": {
            QType.Q8_0: amx.Q8_0AmxPromptKernel,
            QType.Q4_0: amx_blocks.Q4_0AmxPromptKernel, QType.Q4_1: amx_blocks.Q4_1AmxPromptKernel,
            QType.Q5_0: amx_blocks.Q5_0AmxPromptKernel, QType.Q5_1: amx_blocks.Q5_1AmxPromptKernel,
            QType.Q2_K: amx_k.Q2_KAmxPromptKernel, QType.Q3_K: amx_k.Q3_KAmxPromptKernel,
            QType.Q4_K: amx_k.Q4_KAmxPromptKernel, QType.Q5_K: amx_k.Q5_KAmxPromptKernel,
            QType.Q6_K: amx_k.Q6_KAmxPromptKernel,
            QType.IQ4_NL: amx_blocks.IQ4_NLAmxPromptKernel, QType.IQ4_XS: amx_k.IQ4_XSAmxPromptKernel,
        },
    }


def kernel_class(qtype: QType, activations: str = "float") -> type[TileKernel] | None:
    """The compiled kernel class of ``qtype`` in the activation form ``activations`` (its float kernel where the
    form has none of its own; None for a type without a compiled kernel)."""
    table = kernel_table()
    return table.get(activations, {}).get(qtype) or table["float"].get(qtype)


def jit_kernel(qtype: QType, raw: np.ndarray, activations: str = "float") -> TileKernel | None:
    """The compiled tile kernel of a matrix stored as ``raw`` (None for a type without one, and for rows that are
    not one contiguous array, e.g. a Fortran-ordered npy file: the numpy kernels handle any strides), in the
    activation form ``activations`` (:data:`FORMS`)."""
    kernel = kernel_class(qtype, activations)
    return kernel(raw) if kernel is not None and np.asarray(raw).flags.c_contiguous else None
