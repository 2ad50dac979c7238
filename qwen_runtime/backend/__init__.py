"""The machine under the math: the one layer that knows numba, threads and the choice of kernels.

Stored weights and their products (:mod:`.weights`), the numpy ops beside their compiled twins (:mod:`.ops`,
:mod:`.ops_jit`), the KV cache (:mod:`.cache`), the tile thread pool (:mod:`.pool`), numba's set-up and compile
events (:mod:`.jit_setup`, :mod:`.compile_events`), memory advice and limits (:mod:`.memory`, :mod:`.limits`), and
the compiled kernels of every stored type (:mod:`.kernels`).  The models above call what this layer chose at load.
"""
