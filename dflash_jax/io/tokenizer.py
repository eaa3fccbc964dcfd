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

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the DFlash drafter's placeholder for not-yet-drafted positions
PAD_TOKEN = "<|pad|>"  # optional; the shipped tokenizer has none (pad_id is None)
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, MASK_TOKEN)  # order fixes ids 0, 1


class Tokenizer:
    """Byte-level BPE tokenizer with EOS (``<|endoftext|>``) and ``<|mask|>``."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        # Not persisted in tokenizer.json, so it must be set on every load.
        self._hf.encode_special_tokens = True
        eos = hf.token_to_id(EOS_TOKEN)
        mask = hf.token_to_id(MASK_TOKEN)
        if eos is None or mask is None:
            raise ValueError(f"tokenizer lacks required special tokens {EOS_TOKEN!r}/{MASK_TOKEN!r}")
        self._eos_id: int = eos
        self._mask_id: int = mask
        self._pad_id: int | None = hf.token_to_id(PAD_TOKEN)

    # --- construction / persistence -------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(path), pretty=False)

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HF tokenizer (escape hatch; prefer the methods below)."""
        return self._hf

    # --- ids ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (embedding table size)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def mask_id(self) -> int:
        return self._mask_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    # --- text <-> ids ---------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode text to ids. Never emits special ids and never adds BOS/EOS."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like :meth:`encode` for many texts; runs in parallel inside the Rust core."""
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

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

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, mask_id={self.mask_id}, pad_id={self.pad_id})"
