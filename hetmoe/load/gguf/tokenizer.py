"""A GGUF file's tokenizer (``tokenizer.ggml.*``) as hetmoe's ``Tokenizer``, over a ``tokenizers.Tokenizer``.

``tokenizer_from_gguf(f)`` rebuilds what Hugging Face's tokenizer.json would hold, from the keys llama.cpp's
converter writes:

* ``tokenizer.ggml.model`` "gpt2": byte-level BPE. ``tokens`` (id order, byte-level strings as in tokenizer.json)
  are the vocabulary, ``merges`` ("a b") the merges. ``pre`` names the pre-tokenizer; llama.cpp's regexes for it
  (src/llama-vocab.cpp) become ``Split`` pre-tokenizers (each isolating its matches, applied in turn, as llama.cpp
  applies its list) followed by ``ByteLevel`` without its own regex, as the published tokenizer.json files have
  them: "qwen2" (and deepseek-r1-qwen; NFC-normalized first, as Qwen's tokenizer.json does and llama.cpp does not),
  "llama-bpe" (llama3, llama-v3; merges ignored for whole-word tokens, as in llama.cpp), "deepseek-v3",
  "deepseek-llm" (DeepSeek-V2), "gpt-4o" (o200k: GPT-4o's and gpt-oss's, with tokenizer.json's own regex, of which
  llama.cpp's is a rewrite without \\p{Lu}-style classes), "default" (also when the key is absent, as llama.cpp reads
  such files). "gpt-2" (and
  phi-2) is ByteLevel with its built-in GPT-2 regex, exactly GPT-2's tokenizer.json (llama.cpp's copy of that regex
  lacks the final ``|\\s+``, which only decides whether an unmatched run of spaces is its own piece: it is either
  way). Another ``pre`` raises GGUFError naming it.
* "llama": SentencePiece BPE (Llama, Mistral, Mixtral), as transformers' LlamaConverter writes it: BPE with
  byte fallback over ``tokens``, merges derived from ``scores`` (every split of a token into two tokens, ranked by
  the token's score: llama.cpp merges the best-scoring adjacent pair first), spaces as U+2581 with one prepended
  (``add_space_prefix``, default true), the U+2581 / byte-fallback / fuse / strip decoder.
* Any other model (bert, t5, rwkv...) raises GGUFError naming it.

``token_type`` CONTROL (and UNKNOWN) tokens become special added tokens (matched in text, skipped by ``decode``
when asked), USER_DEFINED ones plain added tokens; both are pre-normalized in GGUF, so neither is normalized.
bos / eos / pad / unk come from ``bos_token_id`` ... ``unknown_token_id``; ``add_bos_token`` from its key (absent:
llama.cpp's default, true for SentencePiece and llama-bpe, false otherwise); ``add_eos_token`` adds a
post-processor. The end-of-sequence ids are llama.cpp's end-of-generation set: eos, ``eot_token_id``,
``eom_token_id`` and the tokens it recognises by text (<|im_end|>, <|endoftext|>, <|eot_id|>, ...), less <|end|> in a
vocabulary with <|return|> and <|call|> (o200k harmony, gpt-oss: <|end|> closes a message, such as the reasoning, not
the turn; llama.cpp drops it from the set, and gpt-oss's generation_config.json does not list it).
``tokenizer.chat_template`` is the chat template.
"""

from __future__ import annotations

from hetmoe.load.gguf.reader import GGUFError, GGUFFile
from hetmoe.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_O200K_UPPER, _O200K_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K = (rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# DeepSeek-V2's cased-letter class, written with escapes: several of its characters (U+1F7D, U+1FBE, U+2126, U+212A
# ...) have canonical equivalents that editors silently substitute
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# pre-tokenizer name -> the regexes of its Split pre-tokenizers (None: ByteLevel's own GPT-2 regex)
PRE_TOKENIZERS = {
    "gpt-2": None,
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]"),
    "qwen2": (_QWEN2,),
    "llama-bpe": (_LLAMA3,),
    "gpt-4o": (_O200K,),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
    "deepseek-llm": ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                     r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                     "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+"),
}
_PRE_ALIASES = {"phi-2": "gpt-2", "deepseek-r1-qwen": "qwen2", "llama3": "llama-bpe", "llama-v3": "llama-bpe"}
# llama.cpp's end-of-generation tokens by text (llama-vocab.cpp, "maintain a list of tokens that cause
# end-of-generation"), besides the eos / eot / eom ids
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})
_HARMONY_ENDS = ("<|return|>", "<|call|>", "<|end|>")  # all three: <|end|> is no end of generation
_SPACE = "\u2581"


def _bpe_backend(f: GGUFFile, tokens: list, vocab: dict):
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    pre = f.get("tokenizer.ggml.pre") or "default"
    name = _PRE_ALIASES.get(pre, pre)
    if name not in PRE_TOKENIZERS:
        raise GGUFError(f"{f.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one hetmoe rebuilds "
                        f"(supported: {', '.join(sorted({*PRE_TOKENIZERS, *_PRE_ALIASES}))})")
    merges = []
    for m in f.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)  # as llama.cpp splits them: the first space after the first character
        if cut < 0:
            raise GGUFError(f"{f.path}: merge {m!r} (tokenizer.ggml.merges) is not two tokens joined by a space")
        merges.append((m[:cut], m[cut + 1:]))
    if not merges:
        raise GGUFError(f"{f.path}: a gpt2 (byte-level BPE) tokenizer without tokenizer.ggml.merges")
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=name == "llama-bpe")
    except Exception as e:  # the Rust side raises a bare Exception for a merge of tokens not in the vocabulary
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from None
    backend = Backend(model)
    if name == "qwen2":  # Qwen's tokenizer.json normalizes to NFC first (llama.cpp does not: a difference on
        backend.normalizer = normalizers.NFC()  # decomposed input only)
    regexes = PRE_TOKENIZERS[name]
    if regexes is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, name == "llama-bpe"


def spm_merges(tokens: list, scores: list) -> list:
    """BPE merges equivalent to SentencePiece's score-driven merging (transformers' SentencePieceExtractor): every
    split of a token into two tokens, ranked by the merged token's score, best first (ties: token id order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in local)
    ranked.sort(key=lambda m: -m[0])  # stable: equal scores keep token order
    return [(left, right) for _, left, right in ranked]


def _spm_backend(f: GGUFFile, tokens: list, vocab: dict):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    scores = f.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFError(f"{f.path}: a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores, one per token")
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk, fuse_unk=True,
                       byte_fallback=True)
    backend = Backend(model)
    prefix = f.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", _SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, True


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    """hetmoe's Tokenizer for the tokenizer stored in ``f`` (a GGUFFile); see the module docstring."""
    from tokenizers import AddedToken, processors

    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise GGUFError(f"{f.path} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    builders = {"gpt2": _bpe_backend, "llama": _spm_backend}
    if kind not in builders:
        raise GGUFError(f"{f.path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; hetmoe "
                        "rebuilds gpt2 (byte-level BPE) and llama (SentencePiece) tokenizers")
    types = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{f.path}: {len(types)} token types for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens has duplicates")
    backend, default_bos = builders[kind](f, tokens, vocab)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED])

    def token(key: str):
        i = f.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) else None

    eos = token("eos_token_id")
    if f.get("tokenizer.ggml.add_eos_token") and eos is not None:
        eos_id = vocab[eos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, eos_id)])
    config = {"bos_token": token("bos_token_id"), "eos_token": eos, "pad_token": token("padding_token_id"),
              "unk_token": token("unknown_token_id"),
              "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", default_bos))}
    end_ids = {vocab[t] for t in (eos, token("eot_token_id"), token("eom_token_id")) if t is not None}
    end_ids |= {vocab[t] for t in _EOG_TEXTS if t in vocab}
    if all(t in vocab for t in _HARMONY_ENDS):
        end_ids.discard(vocab["<|end|>"])
    bos_id = f.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(backend, config, eos_token_ids=sorted(end_ids),
                     bos_token_id=bos_id if isinstance(bos_id, int) else None,
                     chat_template=f.get("tokenizer.chat_template"))
