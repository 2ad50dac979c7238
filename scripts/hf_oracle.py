"""Live Hugging Face transformers oracle for tests.

Helpers that run a saved HF model directory through transformers (float32, eager attention, CPU) so
tests can compare the numpy runtime against the reference implementation. torch and transformers are
imported lazily, inside the functions, so a test module can call ``pytest.importorskip("torch")``
before using them and the module itself imports fine without torch.

- ``hf_logits(model_dir, input_ids, attention_mask, dtype)`` -> ``[B, T, V]`` (no cache, one forward), float32
  or (``dtype="float64"``, the whole model in float64) the exact reference of ``float_error.py``.
- ``hf_greedy(model_dir, prompt_ids, steps)`` -> (int64 ``[steps]`` ids, float32 ``[steps, V]`` logits),
  greedy decoding with the KV/recurrent cache: ``logits[k]`` is the distribution ``ids[k]`` was taken from
  (``logits[0]`` is the last prompt position after prefill). The EOS token does not stop the loop.

Both run single-threaded (torch's thread count is set to 1 for the call and restored afterwards): the
chunked Gated-DeltaNet path of Qwen3.5 otherwise changes in the 1e-5 range with the number of threads.
``scripts/make_fixtures.py`` uses exactly these functions to write ``tests/fixtures/reference/*.npz``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


def _torch() -> Any:
    import torch

    return torch


@functools.lru_cache(maxsize=16)
def load_model(model_dir: str, dtype: str = "float32") -> Any:
    """Load (and cache per directory and dtype) the model class named in config.json, eager, eval mode."""
    torch = _torch()
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    arch = (config.architectures or ["AutoModelForCausalLM"])[0]
    model_cls = getattr(transformers, arch)
    with float64_everywhere() if dtype == "float64" else contextlib.nullcontext():
        model = model_cls.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="eager")
    model.eval()
    return model


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Inside: every float32 a torch call asks for (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float``)
    is float64 instead.

    transformers computes RMSNorm, softmax, rotary frequencies and the Gated DeltaNet kernels in float32 even in
    a float64 model; a float64 reference must not keep those float32 roundings (they depend on the CPU).
    """
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    def promote(value: Any) -> Any:
        if value is torch.float32:
            return torch.float64
        if isinstance(value, (list, tuple)):
            return type(value)(promote(v) for v in value)
        return value

    class Promote(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if getattr(func, "__name__", "") == "float":
                return args[0].double()
            return func(*promote(tuple(args)), **{k: promote(v) for k, v in (kwargs or {}).items()})

    with Promote():
        yield


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    torch = _torch()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _model(model_dir: str | Path, dtype: str = "float32") -> Any:
    return load_model(str(Path(model_dir).resolve()), dtype)


def _as_batch(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array, dtype=np.int64)
    return array[None, :] if array.ndim == 1 else array


def hf_logits(
    model_dir: str | Path, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, dtype: str = "float32"
) -> np.ndarray:
    """Full logits of one no-cache forward pass: [B, T, V] (a 1-D input is treated as B=1) in ``dtype``.

    ``dtype="float64"`` runs the whole model in float64: the exact reference the float32 error model of
    ``float_error.py`` measures against.
    """
    torch = _torch()
    model = _model(model_dir, dtype)
    ids = torch.from_numpy(_as_batch(input_ids))
    mask = None if attention_mask is None else torch.from_numpy(_as_batch(attention_mask))
    promotion = float64_everywhere() if dtype == "float64" else contextlib.nullcontext()
    with torch.no_grad(), _single_thread(), promotion:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    return out.logits.numpy().astype(np.dtype(dtype))


def _cache_kwarg(model: Any) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use whichever forward() takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def hf_greedy(model_dir: str | Path, prompt_ids: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation with cache: (ids int64 [steps], logits float32 [steps, V])."""
    torch = _torch()
    model = _model(model_dir)
    key = _cache_kwarg(model)
    ids = torch.from_numpy(_as_batch(prompt_ids))
    cache = None
    out_ids: list[int] = []
    out_logits: list[np.ndarray] = []
    with torch.no_grad(), _single_thread():
        for _ in range(steps):
            kwargs = {key: cache} if cache is not None else {}
            out = model(input_ids=ids, use_cache=True, **kwargs)
            cache = _returned_cache(out)
            last = out.logits[0, -1].float()
            next_id = int(torch.argmax(last))
            out_ids.append(next_id)
            out_logits.append(last.numpy().astype(np.float32))
            ids = torch.tensor([[next_id]], dtype=torch.int64)
    return np.asarray(out_ids, dtype=np.int64), np.stack(out_logits)
