"""The benchmark's plain numpy peer: a Qwen2 / Qwen3 decode loop written the way a from-scratch numpy
implementation writes it, over the same GGUF file as our runtime and llama.cpp.

Every matrix is used as one float32 array: F32 tensors straight from the file's memory map, any other type
widened once at load, and every product is a single ``x @ W.T`` on the whole matrix with OpenBLAS's own
threads (``OPENBLAS_NUM_THREADS``).  No tiles, no thread pool, a preallocated float32 KV cache.  Only the
file reader comes from ``qwen_runtime`` (gguf's own ``GGUFReader`` takes ~20 s to parse a vocabulary); the
forward pass is its own: the yardstick of what plain numpy does on this machine.  Qwen3.5 (Gated DeltaNet)
is not covered.

    python scripts/numpy_peer.py MODEL.gguf --prompt 128 --new 32     # prints tokens/s
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from qwen_runtime.formats import open_gguf


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rotary embedding.  x: [T, heads, hd]; cos/sin: [T, 1, hd/2]"""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class PlainQwen:
    """Weights as whole float32 matrices and a KV cache for ``max_len`` tokens."""

    def __init__(self, path: str, max_len: int) -> None:
        files = open_gguf(path)
        cfg = files.config
        if cfg.arch not in ("qwen2", "qwen3"):
            raise SystemExit(f"numpy peer: architecture {cfg.arch!r} is not covered (qwen2 and qwen3 only)")
        self.layers, self.heads, self.kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps, theta = cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta
        self.w = {name: t.to_float32() for name, t in files.tensors.items()}  # F32: the memory map itself
        self.lm_head = self.w.get("output.weight", self.w["token_embd.weight"])
        self.inv_freq = 1.0 / theta ** (np.arange(0, self.head_dim, 2) / self.head_dim)
        shape = (self.layers, max_len, self.kv_heads, self.head_dim)
        self.k_cache, self.v_cache = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def forward(self, ids: list[int], start: int) -> np.ndarray:
        """Logits of the last of ``ids`` (positions ``start...``), filling the cache.  # [T] -> [V]"""
        w, t, hd = self.w, len(ids), self.head_dim
        x = np.asarray(self.w["token_embd.weight"][ids], np.float32)  # [T, H]
        angles = np.arange(start, start + t)[:, None] * self.inv_freq  # [T, hd/2]
        cos, sin = np.cos(angles).astype(np.float32)[:, None], np.sin(angles).astype(np.float32)[:, None]
        end = start + t
        causal = np.arange(end)[None, :] <= np.arange(start, end)[:, None]  # [T, S]
        for i in range(self.layers):
            p = f"blk.{i}."
            h = rms_norm(x, w[p + "attn_norm.weight"], self.eps)
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
            if p + "attn_q.bias" in w:
                q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
            q, k, v = q.reshape(t, self.heads, hd), k.reshape(t, self.kv_heads, hd), v.reshape(t, self.kv_heads, hd)
            if p + "attn_q_norm.weight" in w:
                q = rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
                k = rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.k_cache[i, start:end], self.v_cache[i, start:end] = k, v
            keys, values = self.k_cache[i, :end], self.v_cache[i, :end]  # [S, kv, hd]
            group = self.heads // self.kv_heads
            qg = q.reshape(t, self.kv_heads, group, hd).transpose(1, 2, 0, 3)  # [kv, g, T, hd]
            scores = qg @ keys.transpose(1, 2, 0)[:, None] / np.float32(np.sqrt(hd))  # [kv, g, T, S]
            scores = np.where(causal, scores, np.float32(-np.inf))
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o = (probs @ values.transpose(1, 0, 2)[:, None]).transpose(2, 0, 1, 3).reshape(t, -1)  # [T, nh * hd]
            x = x + o @ w[p + "attn_output.weight"].T
            h = rms_norm(x, w[p + "ffn_norm.weight"], self.eps)
            gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        return rms_norm(x[-1], w["output_norm.weight"], self.eps) @ self.lm_head.T


def run(path: str, prompt: list[int], new: int) -> dict[str, float]:
    """Load, prefill ``prompt`` and decode ``new`` greedy tokens; the same report as the benchmark worker."""
    t0 = time.perf_counter()
    model = PlainQwen(path, len(prompt) + new)
    loaded = time.perf_counter()
    token = int(np.argmax(model.forward(prompt, 0)))
    first = time.perf_counter()
    for i in range(new - 1):
        token = int(np.argmax(model.forward([token], len(prompt) + i)))
    done = time.perf_counter()
    return {"load_s": loaded - t0, "ttft_s": first - loaded, "prefill_tps": len(prompt) / (first - loaded),
            "decode_tps": (new - 1) / (done - first)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args()
    ids = np.random.default_rng(0).integers(1000, 100000, args.prompt).tolist()
    print(run(args.model, ids, args.new))


if __name__ == "__main__":
    main()
