"""The tokenizer a llama.cpp GGUF file carries in its metadata, as a ``TextTokenizer``.

    tok = gguf_tokenizer("model.gguf")      # TextTokenizer: encode / decode / bos_id ...
    tok.special                             # GGUFSpecialTokens(bos_id, eos_id, pad_id, ...)
    tok.chat_template                       # tokenizer.chat_template, or None

llama.cpp's converter (``convert_hf_to_gguf.py``: ``_set_vocab_gpt2`` /
``_set_vocab_sentencepiece``) stores the vocabulary as ``tokenizer.ggml.tokens`` (id =
position), ``tokenizer.ggml.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte), ``tokenizer.ggml.merges`` (``"left right"``, in rank order) or
``tokenizer.ggml.scores``, and the special ids ``tokenizer.ggml.{bos,eos,eot,eom,unknown,
padding}_token_id``.  This module rebuilds a ``tokenizers.Tokenizer`` from them, by
``tokenizer.ggml.model``:

* ``"gpt2"``, byte-level BPE (Llama 3, Qwen2, GPT-2): ``BPE(vocab, merges)`` with the
  pre-tokenizer of the original ``tokenizer.json`` that ``tokenizer.ggml.pre`` names
  (``_PRE``): ``"gpt-2"`` (or absent) ``ByteLevel``'s own GPT-2 split; ``"llama-bpe"``
  (``"llama3"``, ``"llama-v3"``) Llama 3's split regex and ``ignore_merges`` (a word that
  is a token is taken whole, as llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_LLAMA3`` and the
  original tokenizer.json do); ``"qwen2"`` Qwen2's split regex (single digits) after NFC
  normalisation; ``"smollm"`` (SmolLM, SmolLM2) single digits, then the GPT-2 split.  Decoder: ``ByteLevel``.  Another ``pre`` is refused by name.
* ``"llama"``, SentencePiece BPE (Llama 2, Mistral 7B): ``BPE(vocab, merges,
  byte_fallback=True, fuse_unk=True)``, the merges (unless stored) derived from the
  scores as transformers' GGUF conversion does (every split of a normal piece into two
  pieces of the vocabulary, ranked by the piece's score, then by the halves' scores);
  normaliser ``Prepend("▁")`` (when ``tokenizer.ggml.add_space_prefix``, default true) and
  spaces to ``"▁"``; decoder byte fallback, fuse, ``"▁"`` -> space, strip the first
  space.  SentencePiece itself breaks ties between two splits of one piece by position,
  the merge list by rank, so the two can differ on such ties (as with transformers' own
  conversion of a Llama tokenizer).
* anything else raises a ``ValueError`` naming it.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain
added tokens (both matched whole before the model, never split; ``normalized=False``),
as the converter made them from the original tokenizer's added tokens.
(transformers' ``integrations/ggml.py`` -- ``GGUFLlamaConverter`` for every ``llama``
GGUF, ``GGUFQwen2Converter`` for ``qwen2`` -- is the reference the ``"llama"`` case
follows; for ``"gpt2"`` vocabularies it uses ``ByteLevel``'s GPT-2 split whatever the
``pre``, and adds no user-defined tokens.)  ``encode`` adds no special tokens
(``TextTokenizer``); ``special.add_bos`` says whether llama.cpp would prepend BOS.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from jax_seqpar.data.gguf_file import meta, open_gguf
from jax_seqpar.data.text_tokenizer import TextTokenizer, _import_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: SmolLM's tokenizer.json: every digit its own piece, then ByteLevel's GPT-2 split
_DIGITS = "digits"
#: tokenizer.ggml.pre -> (split regex, or None for ByteLevel's GPT-2 one; NFC;
#: ignore_merges; llama.cpp's add_bos default)
_PRE = {"gpt-2": (None, False, False, False), "llama-bpe": (_LLAMA3, False, True, True),
        "llama3": (_LLAMA3, False, True, True), "llama-v3": (_LLAMA3, False, True, True),
        "qwen2": (_QWEN2, True, False, False), "smollm": (_DIGITS, False, False, False)}
MODELS = ("gpt2", "llama")


class GGUFSpecialTokens(NamedTuple):
    """A GGUF's special token ids (None: not stored) and llama.cpp's BOS / EOS flags."""
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: Optional[int]
    unk_id: Optional[int]
    eot_id: Optional[int]      # end of turn (chat models), where it differs from eos
    add_bos: bool
    add_eos: bool
    chat_template: Optional[str]


class GGUFTextTokenizer(TextTokenizer):
    """``TextTokenizer`` with the GGUF's ``special`` tokens and ``chat_template``."""

    def __init__(self, tokenizer, special: GGUFSpecialTokens):
        super().__init__(tokenizer, bos_id=special.bos_id, eos_id=special.eos_id,
                         pad_id=special.pad_id, chat_template=special.chat_template)
        self.special = special


def _reader(source):
    return open_gguf(source) if not hasattr(source, "fields") else source


def gguf_special_tokens(source) -> GGUFSpecialTokens:
    """The special tokens of a GGUF file (a path or a ``gguf.GGUFReader``)."""
    r = _reader(source)
    model, pre = meta(r, "tokenizer.ggml.model"), meta(r, "tokenizer.ggml.pre", "gpt-2")
    ids = {k: meta(r, f"tokenizer.ggml.{k}_token_id")
           for k in ("bos", "eos", "padding", "unknown", "eot")}
    add_bos = model == "llama" or (model == "gpt2" and _PRE.get(pre, (0, 0, 0, False))[3])
    return GGUFSpecialTokens(ids["bos"], ids["eos"], ids["padding"], ids["unknown"],
                             ids["eot"], bool(meta(r, "tokenizer.ggml.add_bos_token", add_bos)),
                             bool(meta(r, "tokenizer.ggml.add_eos_token", False)),
                             meta(r, "tokenizer.chat_template"))


def _spm_merges(tokens, scores, types):
    """Merges of a SentencePiece BPE vocabulary: every split of a normal piece into two
    pieces of the vocabulary, ranked by (piece score desc, piece id, halves' scores desc)."""
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    found = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or ids[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append(((-scores[i], i, -scores[ids[left]], -scores[ids[right]]),
                              (left, right)))
    return [pair for _, pair in sorted(found, key=lambda f: f[0])]


def gguf_tokenizer(source) -> GGUFTextTokenizer:
    """The tokenizer of a GGUF file (a path or a ``gguf.GGUFReader``): a
    ``TextTokenizer`` whose ``.tokenizer`` is the ``tokenizers.Tokenizer``, with
    ``bos_id`` / ``eos_id`` / ``pad_id``, ``.special`` (``GGUFSpecialTokens``) and
    ``.chat_template`` (the module docstring says how each model type is rebuilt)."""
    tk = _import_tokenizers()
    r = _reader(source)
    model = meta(r, "tokenizer.ggml.model")
    if model not in MODELS:
        raise ValueError(f"tokenizer.ggml.model={model!r} is not supported; supported: "
                         f"{MODELS} (byte-level BPE, SentencePiece BPE)")
    tokens = meta(r, "tokenizer.ggml.tokens")
    types = meta(r, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    special = gguf_special_tokens(r)
    merges = [tuple(m.split(" ", 1)) for m in meta(r, "tokenizer.ggml.merges") or []]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if model == "gpt2":
        pre = meta(r, "tokenizer.ggml.pre", "gpt-2")
        if pre not in _PRE:
            raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; supported: "
                             f"{sorted(_PRE)}")
        regex, nfc, ignore_merges, _ = _PRE[pre]
        tok = tk.Tokenizer(tk.models.BPE(vocab, merges, ignore_merges=ignore_merges))
        if regex is None:
            tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=True)
        elif regex == _DIGITS:
            tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
                tk.pre_tokenizers.Digits(individual_digits=True),
                tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
                tk.pre_tokenizers.Split(tk.Regex(regex), behavior="isolated", invert=False),
                tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if nfc:
            tok.normalizer = tk.normalizers.NFC()
        tok.decoder = tk.decoders.ByteLevel()
    else:
        scores = meta(r, "tokenizer.ggml.scores")
        if scores is None and not merges:
            raise ValueError("tokenizer.ggml.model='llama' without tokenizer.ggml.scores")
        unk = tokens[special.unk_id] if special.unk_id is not None else None
        tok = tk.Tokenizer(tk.models.BPE(vocab, merges or _spm_merges(tokens, scores, types),
                                         unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = bool(meta(r, "tokenizer.ggml.add_space_prefix", True))
        tok.normalizer = tk.normalizers.Sequence(
            [tk.normalizers.Prepend("▁")] * prefix + [tk.normalizers.Replace(" ", "▁")])
        tok.decoder = tk.decoders.Sequence(
            [tk.decoders.ByteFallback(), tk.decoders.Fuse(), tk.decoders.Replace("▁", " ")]
            + [tk.decoders.Strip(" ", 1, 0)] * prefix)
    added = [tk.AddedToken(t, special=types[i] == CONTROL, normalized=False)
             for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return GGUFTextTokenizer(tok, special)


__all__ = ["GGUFSpecialTokens", "GGUFTextTokenizer", "gguf_special_tokens", "gguf_tokenizer"]
