"""Tokenizers (tokenizer.json and rebuilt from GGUF metadata), streaming detokenization, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import fixture_dir
from shared_data import MODEL_CONFIGS, tokenizer_json

from qwen_runtime.errors import TemplateError
from qwen_runtime.formats import open_model_files
from qwen_runtime.text.chat import ChatFormat, ChatTemplate, load_chat_format, token_text
from qwen_runtime.text.tokenizer import PIECE_CHARS, StreamDecoder, Tokenizer, cut_text

TEXTS = ("Hello world! The quick brown fox's 12345 jumps\r\n  over\tthe lazy dog.",
         "日本語のテキスト、中文句子，한국어 문장 🎉🙂👍🏽 naïve café",
         "def f(x):\n    return x ** 2  # comment\n\n\n<|im_start|>user\nhi<|im_end|>",
         "<think>\nhmm</think>\n\n  trailing   spaces   ")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def real_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(tokenizer_json("qwen2_qwen3"))


def real_format(tokenizer: Tokenizer, model: str) -> ChatFormat:
    """A ChatFormat from a published tokenizer_config.json (template, bos/eos, add_bos)."""
    cfg = json.loads((MODEL_CONFIGS / model / "tokenizer_config.json").read_text())
    return ChatFormat(tokenizer, ChatTemplate(cfg["chat_template"]), token_text(cfg.get("bos_token")),
                      token_text(cfg.get("eos_token")), bool(cfg.get("add_bos_token", False)), frozenset())


def gguf_metadata(tokenizer_json: Path, vocab_size: int, pre: str) -> dict:
    """The tokenizer.ggml.* keys llama.cpp's converter writes for a tokenizer.json (with [PADn] fillers)."""
    t = json.loads(tokenizer_json.read_text())
    tokens = {i: s for s, i in t["model"]["vocab"].items()}
    types = dict.fromkeys(tokens, 1)
    for added in t["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] or added["content"].startswith("<|") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.tokens": [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)],
            "tokenizer.ggml.token_type": [types.get(i, 5) for i in range(vocab_size)]}


@pytest.mark.slow
def test_gguf_rebuilt_tokenizer_matches_tokenizer_json(real_tokenizer: Tokenizer) -> None:
    rebuilt = Tokenizer.from_gguf_metadata(gguf_metadata(tokenizer_json("qwen2_qwen3"), 151936, "qwen2"), "meta")
    for text in TEXTS:
        assert rebuilt.encode(text) == real_tokenizer.encode(text)
        assert rebuilt.decode(rebuilt.encode(text), skip_special=False) == text
    assert real_tokenizer.special_ids <= rebuilt.special_ids  # plus <|...|> tokens llama.cpp marks CONTROL
    assert rebuilt.decode([151900, 151935]) == ""  # [PADn] fillers decode to nothing
    assert rebuilt.token_bytes(151900) == b""


@pytest.mark.parametrize("name", ["qwen2-tiny", "deepseek-tiny", "qwen3-tiny"])
def test_gguf_rebuilt_tokenizer_matches_fixture(name: str) -> None:
    path = fixture_dir(name) / "tokenizer.json"
    vocab = json.loads((path.parent / "config.json").read_text())["vocab_size"]
    pre = "deepseek-r1-qwen" if name.startswith("deepseek") else "qwen2"
    rebuilt, original = Tokenizer.from_gguf_metadata(gguf_metadata(path, vocab, pre), "meta"), Tokenizer.from_file(path)
    for text in TEXTS:
        assert rebuilt.encode(text) == original.encode(text)


def test_unknown_pre_tokenizer_is_a_format_error() -> None:
    from qwen_runtime.errors import FormatError

    with pytest.raises(FormatError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, "x")


def test_stream_decoder_never_splits_a_character(real_tokenizer: Tokenizer) -> None:
    text = "中文：你好，世界！🎉👩‍👩‍👧‍👦 emoji 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓"
    ids = real_tokenizer.encode(text)
    decoder = StreamDecoder(real_tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # some tokens end inside a multi-byte character and emit nothing yet
    partial = [len(real_tokenizer.token_bytes(i)) for i in ids]
    assert sum(partial) == len(text.encode())


def test_stream_decoder_skips_special_tokens_and_flushes_broken_bytes(real_tokenizer: Tokenizer) -> None:
    decoder = StreamDecoder(real_tokenizer)
    im_end = real_tokenizer.token_id("<|im_end|>")
    half = next(i for i in real_tokenizer.encode("𝔘𝔫𝔦 👩‍👩‍👧")  # a piece ending inside a character
                if not _complete_utf8(real_tokenizer.token_bytes(i)))
    assert decoder.push(real_tokenizer.encode("ok")[0]) == "ok"
    assert decoder.push(im_end) == ""
    assert decoder.push(half) == ""
    assert decoder.flush() == "\ufffd"


def _complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_qwen25_template(real_tokenizer: Tokenizer) -> None:
    fmt = real_format(real_tokenizer, "qwen2.5-0.5b-instruct")
    assert fmt.render(HI) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                              "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with_system = fmt.render([{"role": "system", "content": "Be brief."}, *HI])
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    ids = fmt.encode_chat(HI)
    assert ids[0] == real_tokenizer.token_id("<|im_start|>") and ids.count(real_tokenizer.token_id("<|im_end|>")) == 2


def test_qwen3_template_thinking_on_and_off(real_tokenizer: Tokenizer) -> None:
    fmt = real_format(real_tokenizer, "qwen3-0.6b")
    assert fmt.render(HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.render(HI, enable_thinking=False) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                                     "<think>\n\n</think>\n\n")
    assert fmt.render(HI, enable_thinking=True) == fmt.render(HI)


def test_deepseek_template(real_tokenizer: Tokenizer) -> None:
    fmt = real_format(real_tokenizer, "deepseek-r1-distill-qwen-1.5b")
    assert fmt.bos_token == "<｜begin▁of▁sentence｜>" and fmt.add_bos
    assert fmt.render(HI) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"


def test_deepseek_bos_is_never_doubled() -> None:
    fmt = load_chat_format(open_model_files(fixture_dir("deepseek-tiny")))
    bos = fmt.bos_id
    assert bos is not None and fmt.add_bos
    chat = fmt.encode_chat(HI)
    assert chat[0] == bos and chat.count(bos) == 1
    raw = fmt.encode_prompt("hello")
    assert raw[0] == bos and raw.count(bos) == 1
    assert fmt.encode_prompt(fmt.bos_token + "hello").count(bos) == 1


def test_stop_ids_are_the_union_of_the_model_files() -> None:
    qwen = load_chat_format(open_model_files(fixture_dir("qwen2-tiny")))
    tok = qwen.tokenizer
    assert {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")} <= qwen.stop_ids
    deepseek = load_chat_format(open_model_files(fixture_dir("deepseek-tiny")))
    assert deepseek.tokenizer.token_id("<｜end▁of▁sentence｜>") in deepseek.stop_ids


def test_template_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render(HI)
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}").render(HI)
    with pytest.raises(TemplateError):  # the sandbox refuses attribute tricks
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(HI)


def test_template_helpers() -> None:
    out = ChatTemplate("{{ {'a': 'é'} | tojson }} {{ strftime_now('%Y') | length }}").render(HI)
    assert out == '{"a": "é"} 4'


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_qwen3", "qwen3_5"])
def test_encoding_in_pieces_equals_encoding_whole(name: str) -> None:
    """Cut points never split a token (real Qwen tokenizers, texts full of cuts, marks and special tokens);
    encode_within stops once past the limit and the longest token bounds the characters per token."""
    tok = Tokenizer.from_file(tokenizer_json(name))
    assert tok.can_cut
    rng = np.random.default_rng(0)
    alphabet = list("ab xy\n\n\t  .,'é") + ["e\u0301", "\u0301", "日本", "😀", "<|im_start|>", "<think>", "12", "\r\n"]
    texts = list(TEXTS) + ["".join(rng.choice(alphabet, 400)) for _ in range(30)]
    for text in texts:
        pieces = cut_text(text, 7)
        assert "".join(pieces) == text
        assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text), repr(text)
        assert tok.encode_within(text, 10**6) == tok.encode(text)
    long_text = " ".join(texts) * 40
    whole = tok.encode(long_text)
    assert tok.encode_within(long_text, len(whole)) == whole and len(cut_text(long_text, PIECE_CHARS)) > 2
    assert tok.encode_within(long_text, len(whole) - 1) is None
    assert len(long_text) <= len(whole) * tok.longest_token_bytes * 2
