"""Semantic verification: prove a converted model (our npy directory, or any GGUF) matches its HF source.

A conversion can finish cleanly and still be wrong: a (1 + w) norm offset applied twice, value heads in the
wrong order, a metadata key missing, a tensor dropped.  :func:`verify_against` opens the output through the
runtime's readers, leniently (``open_model_files(path, expected=config)``), and checks it against the Hugging
Face source directory, one module per concern:

1. **Tensors** (:mod:`.tensors`): every output tensor, its transform undone and its value heads matched, against
   its source tensor within each element's bound (the error model, :mod:`.bounds`), streamed through the one
   error accumulator :mod:`qwen_convert.error_sums` that ``qwen-inspect --compare`` uses too; every source tensor
   converted or skipped for a stated reason.
2. **Metadata** (:mod:`.metadata`): GGUF model and tokenizer keys against ``config.json`` and the tokenizer files;
   npy: the manifest and the copied files.
3. **Behaviour** (:mod:`.behaviour`, imported only when run: it loads both models): next-token distributions of
   source and output on a probe.

:mod:`.report` holds what was found and renders it; :mod:`.verifier` runs the checks and is the converter's
``--verify``.
"""

from .bounds import GRID_SLACK, round_to_bf16, weighted_search_blocks
from .metadata import MetadataCheck
from .report import VerifyReport, report_json, report_summary, report_table
from .tensors import TensorCheck
from .verifier import FAILED_SUFFIX, BatchVerifier, ConversionVerifier, failed_path, verify_against

__all__ = ["FAILED_SUFFIX", "GRID_SLACK", "BatchVerifier", "ConversionVerifier", "MetadataCheck", "TensorCheck",
           "VerifyReport", "failed_path", "report_json", "report_summary", "report_table", "round_to_bf16",
           "verify_against", "weighted_search_blocks"]
