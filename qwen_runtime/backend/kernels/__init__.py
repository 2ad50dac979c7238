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


@functools.cache
def kernel_table() -> dict[str, dict[QType, type[TileKernel]]]:
    """The compiled kernel class of each activation form (``pool.ACTIVATION_FORMS``: "float", the exact float
    kernels; "q8", every product of a quantized type with 8-bit activations as llama.cpp multiplies; "q8-prompts",
    8-bit activations only in prompts on AMX tiles) and stored type, from each family module's ``KERNELS``.  A type
    without a kernel of its own in a form takes its float kernel (:func:`kernel_class`; the i-quants below IQ4 and
    TQ2_0 have no AMX prompt kernel: with ``"q8"`` they prefill with their float kernels)."""
    from . import amx, amx_blocks, amx_k, dense, int8, int8_k, iq4, kquants, lattice, lattice_int8, legacy, q8_0

    families = {"float": (dense, q8_0, legacy, kquants, iq4, lattice), "q8": (int8, int8_k, lattice_int8),
                "q8-prompts": (amx, amx_blocks, amx_k)}
    return {form: {kernel.qtype: kernel for module in modules for kernel in module.KERNELS}
            for form, modules in families.items()}


def kernel_class(qtype: QType, activations: str = "float") -> type[TileKernel] | None:
    """The compiled kernel class of ``qtype`` in the activation form ``activations`` (its float kernel where the
    form has none of its own; None for a type without a compiled kernel)."""
    table = kernel_table()
    return table.get(activations, {}).get(qtype) or table["float"].get(qtype)


def jit_kernel(qtype: QType, raw: np.ndarray, activations: str = "float") -> TileKernel | None:
    """The compiled tile kernel of a matrix stored as ``raw`` (None for a type without one, and for rows that are
    not one contiguous array, e.g. a Fortran-ordered npy file: the numpy kernels handle any strides), in the
    activation form ``activations`` (:func:`kernel_table`)."""
    kernel = kernel_class(qtype, activations)
    return kernel(raw) if kernel is not None and np.asarray(raw).flags.c_contiguous else None
