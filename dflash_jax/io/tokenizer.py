"""Thin, typed wrapper around a HF ``tokenizers`` byte-level BPE tokenizer.

WHY byte-level BPE: the project's text is Python source, where whitespace,
tabs, newlines and indentation are semantics. A ByteLevel pre-tokenizer plus a
ByteLevel decoder (no added prefix space, no normalizer, no unk token) maps
every string to bytes and back, so ``decode(encode(s)) == s`` for *any* text.

WHY special tokens are never produced by ``encode``: ``encode_special_tokens``
is switched on, so a literal ``"<|endoftext|>"`` inside a source file is
encoded as ordinary bytes. Only the caller inserts EOS / mask ids explicitly;
text can never smuggle a control token into the model, and the round trip
stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer

from dflash_jax.io.gguf import GGUFFile, is_gguf

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the DFlash drafter's placeholder for not-yet-drafted positions
PAD_TOKEN = "<|pad|>"  # optional; the shipped tokenizer has none (pad_id is None)
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, MASK_TOKEN)  # order fixes ids 0, 1


class _TokenizerBase:
    """What `Tokenizer` and `ModelTokenizer` share: the HF tokenizer, its size, the EOS / pad ids and `decode`.
    Subclasses set `_hf`, `_eos_id` and `_pad_id`."""

    _hf: HFTokenizer
    _eos_id: int | None
    _pad_id: int | None

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HF tokenizer (escape hatch; prefer the methods below)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (embedding table size)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Decode ids to text.

        Negative ids are dropped (WHY: callers use -1 as "no token" padding in
        fixed-shape JAX buffers). Nothing is truncated at EOS: the caller decides
        where generation stops. Special tokens are rendered as their literal text
        unless ``skip_special`` is set.
        """
        clean = [int(i) for i in ids if int(i) >= 0]
        return self._hf.decode(clean, skip_special_tokens=skip_special)

    def __len__(self) -> int:
        return self.vocab_size


class Tokenizer(_TokenizerBase):
    """Byte-level BPE tokenizer with EOS (``<|endoftext|>``) and ``<|mask|>``."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        # Not persisted in tokenizer.json, so it must be set on every load.
        self._hf.encode_special_tokens = True
        eos = hf.token_to_id(EOS_TOKEN)
        mask = hf.token_to_id(MASK_TOKEN)
        if eos is None or mask is None:
            raise ValueError(f"tokenizer lacks required special tokens {EOS_TOKEN!r}/{MASK_TOKEN!r}")
        self._eos_id = eos
        self._mask_id: int = mask
        self._pad_id = hf.token_to_id(PAD_TOKEN)

    # --- construction / persistence -------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(path), pretty=False)

    # --- ids (vocab_size, eos_id: never None here, pad_id: _TokenizerBase) -------------------------------------
    @property
    def mask_id(self) -> int:
        return self._mask_id

    # --- text <-> ids ---------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode text to ids. Never emits special ids and never adds BOS/EOS."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like :meth:`encode` for many texts; runs in parallel inside the Rust core."""
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, mask_id={self.mask_id}, pad_id={self.pad_id})"


# -- model tokenizers: GGUF files and tokenizer.json ---------------------------------------------------------------

# llama.cpp picks the pre-tokenizer split from `tokenizer.ggml.pre` (llama-vocab.cpp); the same choices here.
_GPT2_PRE = ("default", "gpt-2", "gpt2", "phi-2", "olmo", "roberta-bpe")
# StarCoder-style: every digit on its own, then GPT-2's split (SmolLM, StarCoder, Refact, CodeShell, Command-R).
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "pixtral")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE

# GGUF token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str, where: str):
    from tokenizers import Regex, pre_tokenizers as pt

    if pre in _GPT2_PRE:
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.pre' = {pre!r} is not a known pre-tokenizer "
                             f"(known: {', '.join(PRE_TOKENIZERS)})")
    return pt.Sequence([pt.Split(Regex(split), behavior="isolated", invert=False),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _hf_from_gguf(g) -> tuple[HFTokenizer, dict]:
    """A byte-level BPE `tokenizers.Tokenizer` rebuilt from a GGUF's `tokenizer.ggml.*` keys, and its specials."""
    from tokenizers import AddedToken, decoders, models

    where = str(g.path)
    kind = g.require("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.model' is {kind!r}; only 'gpt2' (byte-level "
                             "BPE) tokenizers are supported")
    tokens = g.require("tokenizer.ggml.tokens", list)
    if "tokenizer.ggml.merges" not in g.metadata:
        raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.merges' is missing: a gpt2 (BPE) tokenizer "
                             "needs its merges")
    merges = g.require("tokenizer.ggml.merges", list)
    types = g.get("tokenizer.ggml.token_type", None, list)
    if types is not None and len(types) != len(tokens):
        raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries for "
                             f"{len(tokens)} tokens")
    vocab = {}
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.tokens'[{i}] is not a string")
        vocab.setdefault(t, i)  # a duplicate keeps its first id, as llama.cpp's token_to_id map does
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise TokenizerError(f"{where}: metadata key 'tokenizer.ggml.merges'[{i}] = {m!r} is not two known "
                                 "tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False))
    hf.pre_tokenizer = _pre_tokenizer(g.get("tokenizer.ggml.pre", "default", str), where)
    hf.decoder = decoders.ByteLevel()
    if types is not None:
        types = [int(t) for t in types]
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _USER_DEFINED]
        if special:
            hf.add_special_tokens(special)
        if user:
            hf.add_tokens(user)
    ids = {}
    for field, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
                       ("pad", "tokenizer.ggml.padding_token_id")):
        value = g.get(key, None, int)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise TokenizerError(f"{where}: metadata key {key!r} = {value} is outside the {len(tokens)}-token "
                                 "vocabulary")
        ids[field] = None if value is None else int(value)
    ids["chat_template"] = g.get("tokenizer.chat_template", None, str)
    ids["add_bos"] = bool(g.get("tokenizer.ggml.add_bos_token", False, bool))
    return hf, ids


def _json_specials(path: Path, hf: HFTokenizer) -> dict:
    """bos / eos / pad and the chat template of a tokenizer.json, from a tokenizer_config.json beside it when
    there is one; else `<|endoftext|>` as EOS."""
    import json

    conf_path = path.with_name("tokenizer_config.json")
    conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}

    def token_id(field):
        value = conf.get(field)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        tid = hf.token_to_id(value)
        if tid is None:
            raise TokenizerError(f"{conf_path}: {field} {value!r} is not in {path}'s vocabulary")
        return tid

    eos = token_id("eos_token")
    if eos is None:
        eos = hf.token_to_id(EOS_TOKEN)
    template = conf.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return {"bos": token_id("bos_token"), "eos": eos, "pad": token_id("pad_token"), "chat_template": template,
            "add_bos": bool(conf.get("add_bos_token", False))}


class ModelTokenizer(_TokenizerBase):
    """The tokenizer of a pretrained model (a GGUF file's or a tokenizer.json): `encode` / `decode` as `Tokenizer`,
    `eos_id` / `bos_id` / `pad_id` from the file, and `apply_chat_template` rendering the file's own template.

    `encode(text)` treats special-token text inside `text` as ordinary characters (as `Tokenizer` does: text cannot
    smuggle a control token); a rendered chat template is encoded with its special tokens recognised."""

    def __init__(self, hf: HFTokenizer, *, eos_id: int | None, bos_id: int | None = None, pad_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False, source: str = "") -> None:
        self._hf, self._eos_id, self._bos_id, self._pad_id = hf, eos_id, bos_id, pad_id
        self.chat_template, self.add_bos, self.source = chat_template, add_bos, source

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def _encode(self, texts: list[str], special: bool) -> list[list[int]]:
        self._hf.encode_special_tokens = not special
        try:
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        finally:
            self._hf.encode_special_tokens = True

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`, never adding BOS / EOS. allow_special: recognise special-token text (`<|im_end|>`)."""
        return self._encode([text], allow_special)[0]

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        return self._encode(list(texts), allow_special)

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The file's chat template rendered with jinja2 (sandboxed, trim_blocks / lstrip_blocks and a
        `raise_exception` helper, as HF transformers renders it)."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template (GGUF metadata key "
                                 "'tokenizer.chat_template' or tokenizer_config.json 'chat_template')")
        return _compiled_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self._token(self._bos_id), eos_token=self._token(self._eos_id), **kwargs)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        """Ids of the rendered chat (special tokens recognised; BOS only where the template writes it)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs),
                           allow_special=True)

    def _token(self, tid: int | None) -> str:
        return "" if tid is None else (self._hf.id_to_token(tid) or "")

    def __repr__(self) -> str:
        return (f"ModelTokenizer({self.source}: vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, chat_template={self.chat_template is not None})")


_TEMPLATES: dict[str, object] = {}


def _compiled_template(source: str):
    if source not in _TEMPLATES:
        import json

        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def load_tokenizer(path: str | Path) -> ModelTokenizer:
    """A model's tokenizer from a GGUF file (its `gpt2` BPE tokens, merges and token types; EOS, BOS and the chat
    template from the metadata), a tokenizer.json (specials and template from a tokenizer_config.json beside it), or
    a folder holding a tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    if is_gguf(path):
        hf, specials = _hf_from_gguf(GGUFFile(path))
    else:
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
        specials = _json_specials(path, hf)
    hf.encode_special_tokens = True
    return ModelTokenizer(hf, eos_id=specials["eos"], bos_id=specials["bos"], pad_id=specials["pad"],
                          chat_template=specials["chat_template"], add_bos=specials["add_bos"], source=str(path))
