"""Tokenizers built from GGUF metadata (``tokenizer.ggml.*``) as llama.cpp
builds them: byte-level BPE (model ``gpt2``: SmolLM2, Llama 3, ...) in
:class:`Tokenizer`, SentencePiece (model ``llama``: Llama 2, TinyLlama,
Mistral, ...) in :class:`SpmTokenizer`.

BPE:

* Pre-tokenisation: the regex list of llama.cpp for the file's
  ``tokenizer.ggml.pre`` (each regex splits the pieces the previous one
  produced; text that no alternative matches stays a piece of its own).
* BPE over the GPT-2 byte→unicode alphabet with merge ranks from
  ``tokenizer.ggml.merges``.
* Control and user-defined tokens (``<|im_start|>``, ``<|im_end|>``, ...)
  are recognised in the text when ``special=True`` (the default), as
  llama.cpp does with ``parse_special``.
* :meth:`Tokenizer.chat` renders a list of ``{"role", "content"}`` messages
  with the ChatML template SmolLM2-Instruct ships (system prompt added when
  the first message is not one).

Needs the ``regex`` package (``\\p{L}`` / ``\\p{N}`` classes).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Tokenizer", "SpmTokenizer", "bytes_to_unicode", "PRE_TOKENIZER_REGEXES"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` → regexes applied in turn (llama.cpp llama-vocab.cpp).
PRE_TOKENIZER_REGEXES: Dict[str, Tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "default": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
}

# token types (llama.cpp LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte → printable-unicode-char table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _regex():
    try:
        import regex
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "kvh_cache.model's tokenizer needs the `regex` package (pip install 'kvh-cache[model]')"
        ) from exc
    return regex


class Tokenizer:
    """Byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``). Build any
    GGUF's tokenizer with :meth:`from_gguf_metadata`, which returns an
    :class:`SpmTokenizer` for SentencePiece vocabularies (``llama``)."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Optional[Sequence[int]] = None,
        *,
        pre: str = "gpt2",
        bos_id: Optional[int] = None,
        eos_id: Optional[int] = None,
        add_bos: bool = False,
        chat_template: Optional[str] = None,
    ) -> None:
        self._init_common(tokens, token_types, bos_id, eos_id, add_bos, chat_template)
        self.ranks: Dict[Tuple[str, str], int] = {}
        for i, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"bad merge {m!r} (expected 'left right')")
            self.ranks.setdefault((a, b), i)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ValueError(f"unknown pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZER_REGEXES)}")
        self.pre = pre
        rx = _regex()
        self._pre = [rx.compile(p) for p in PRE_TOKENIZER_REGEXES[pre]]
        self._b2u = bytes_to_unicode()
        self._u2b = {c: b for b, c in self._b2u.items()}
        self._cache: Dict[str, Tuple[int, ...]] = {}

    def _init_common(self, tokens, token_types, bos_id, eos_id, add_bos, chat_template) -> None:
        self.tokens: List[str] = list(tokens)
        self.vocab: Dict[str, int] = {
            t: i for i, t in enumerate(self.tokens)
        }  # duplicates: the last wins, as in llama.cpp
        self.token_types = [int(t) for t in token_types] if token_types is not None else [NORMAL] * len(self.tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special: Dict[str, int] = {
            t: i for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)) if ty in (CONTROL, USER_DEFINED) and t
        }
        rx = _regex()
        if self.special:
            alts = sorted(self.special, key=len, reverse=True)
            self._special_rx = rx.compile("(" + "|".join(rx.escape(s) for s in alts) + ")")
        else:
            self._special_rx = None

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, object]) -> "Tokenizer":
        model = md.get("tokenizer.ggml.model")
        types = md.get("tokenizer.ggml.token_type")
        common = dict(
            bos_id=_opt_int(md.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(md.get("tokenizer.ggml.eos_token_id")),
            chat_template=md.get("tokenizer.chat_template"),
        )
        if model == "llama":
            return SpmTokenizer(
                md["tokenizer.ggml.tokens"],  # type: ignore[arg-type]
                md.get("tokenizer.ggml.scores"),  # type: ignore[arg-type]
                list(types) if types is not None else None,  # type: ignore[arg-type]
                add_bos=bool(md.get("tokenizer.ggml.add_bos_token", True)),
                add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)),
                **common,  # type: ignore[arg-type]
            )
        if model != "gpt2":
            raise ValueError(
                f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
            )
        pre = str(md.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZER_REGEXES)}")
        return cls(
            md["tokenizer.ggml.tokens"],  # type: ignore[arg-type]
            md["tokenizer.ggml.merges"],  # type: ignore[arg-type]
            list(types) if types is not None else None,  # type: ignore[arg-type]
            pre=pre,
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
            **common,  # type: ignore[arg-type]
        )

    def __len__(self) -> int:
        return len(self.tokens)

    # ---- encoding ----
    def _pretokenize(self, text: str) -> List[str]:
        pieces = [text]
        for rx in self._pre:
            out: List[str] = []
            for p in pieces:
                pos = 0
                for m in rx.finditer(p):
                    if m.start() > pos:
                        out.append(p[pos : m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    pos = m.end()
                if pos < len(p):
                    out.append(p[pos:])
            pieces = out
        return pieces

    def _bpe(self, piece: str) -> Tuple[int, ...]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        word = [self._b2u[b] for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = -1, None
            for i in range(len(word) - 1):
                r = ranks.get((word[i], word[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = word[best], word[best + 1]
            merged: List[str] = []
            i = 0
            while i < len(word):  # merge every occurrence of the pair, left to right
                if i < len(word) - 1 and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids: List[int] = []
        for sym in word:
            tid = self.vocab.get(sym)
            if tid is None:  # cannot happen with a complete byte alphabet; fall back to single bytes
                for ch in sym:
                    ids.append(self.vocab[ch])
            else:
                ids.append(tid)
        out = tuple(ids)
        if len(self._cache) < 100_000:
            self._cache[piece] = out
        return out

    def _encode_plain(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece in self._pretokenize(text):
            ids.extend(self._bpe(piece))
        return ids

    def encode(self, text: str, *, special: bool = True, add_bos: Optional[bool] = None) -> List[int]:
        """Token ids of text. ``special``: control/user-defined token strings
        in the text become their ids (otherwise they are plain text).
        ``add_bos``: default from the file (``tokenizer.ggml.add_bos_token``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        ids: List[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        if special and self._special_rx is not None:
            for i, part in enumerate(self._special_rx.split(text)):
                if i % 2:
                    ids.append(self.special[part])
                elif part:
                    ids.extend(self._encode_plain(part))
        else:
            ids.extend(self._encode_plain(text))
        return ids

    # ---- decoding ----
    def token_bytes(self, token_id: int) -> bytes:
        t = self.tokens[token_id]
        if self.token_types[token_id] in (CONTROL, USER_DEFINED):
            return t.encode("utf-8")
        u2b = self._u2b
        try:
            return bytes(u2b[c] for c in t)
        except KeyError:  # not in the byte alphabet (should not happen): raw text
            return t.encode("utf-8")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False, errors: str = "replace") -> str:
        """Text of token ids. ``skip_special`` drops control tokens."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self.tokens) - 1})")
            if skip_special and self.token_types[i] == CONTROL:
                continue
            out += self.token_bytes(i)
        return out.decode("utf-8", errors)

    # ---- chat ----
    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        default_system: Optional[str] = SMOLLM_SYSTEM,
    ) -> str:
        """ChatML text of messages (the SmolLM2-Instruct template: a default
        system message is inserted when the first message is not one)."""
        if "<|im_start|>" not in self.special:
            raise ValueError("this vocabulary has no <|im_start|> token: the ChatML template does not apply")
        parts: List[str] = []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if i == 0 and role != "system" and default_system is not None:
                parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], **kw: object) -> List[int]:
        return self.encode(self.chat(messages, **kw), special=True)  # type: ignore[arg-type]

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        """Ids that end a generation: eos and <|im_end|> where present."""
        s = set()
        if self.eos_id is not None:
            s.add(self.eos_id)
        for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            if t in self.special:
                s.add(self.special[t])
        return tuple(sorted(s))


class SpmTokenizer(Tokenizer):
    """SentencePiece vocabulary (``tokenizer.ggml.model = llama``: Llama 1/2,
    TinyLlama, Mistral, ...), tokenised as llama.cpp does: spaces become
    ``▁``, a space is prefixed to the text and to text after a special token
    (``add_space_prefix``), adjacent symbols are merged highest-score pair
    first (ties: leftmost), and symbols not in the vocabulary fall back to
    ``<0xXX>`` byte tokens."""

    SPACE = "\u2581"

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Optional[Sequence[float]],
        token_types: Optional[Sequence[int]] = None,
        *,
        bos_id: Optional[int] = None,
        eos_id: Optional[int] = None,
        add_bos: bool = True,
        add_space_prefix: bool = True,
        chat_template: Optional[str] = None,
    ) -> None:
        self._init_common(tokens, token_types, bos_id, eos_id, add_bos, chat_template)
        self.scores = [float(x) for x in scores] if scores is not None else [0.0] * len(self.tokens)
        self.add_space_prefix = add_space_prefix
        self.pre = "spm"
        self._byte_ids: Dict[int, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty == BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                self._byte_ids[int(t[3:5], 16)] = i
        self._cache: Dict[str, Tuple[int, ...]] = {}

    def _spm(self, text: str) -> List[int]:
        import heapq

        syms = list(text)  # one symbol per code point
        n = len(syms)
        if n == 0:
            return []
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        heap: List[Tuple[float, int, int, str]] = []
        vocab, scores = self.vocab, self.scores

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            t = syms[left] + syms[right]
            tid = vocab.get(t)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, t))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, t = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or syms[left] + syms[right] != t or nxt[left] != right:
                continue  # stale: one side was merged since
            syms[left] = t
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        out: List[int] = []
        i = 0
        while i != -1:
            tid = vocab.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:
                for b in syms[i].encode("utf-8"):
                    bid = self._byte_ids.get(b)
                    if bid is None:
                        raise ValueError(f"no token for byte 0x{b:02X} in this vocabulary")
                    out.append(bid)
            i = nxt[i]
        return out

    def _encode_fragment(self, text: str, prefix: bool) -> List[int]:
        if prefix and self.add_space_prefix:
            text = " " + text
        text = text.replace(" ", self.SPACE)
        hit = self._cache.get(text)
        if hit is None:
            hit = tuple(self._spm(text))
            if len(self._cache) < 10_000:
                self._cache[text] = hit
        return list(hit)

    def encode(self, text: str, *, special: bool = True, add_bos: Optional[bool] = None) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        ids: List[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        prev_special = True  # the first fragment gets the space prefix
        parts = self._special_rx.split(text) if special and self._special_rx is not None else [text]
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.special[part])
                prev_special = True
            elif part:
                ids.extend(self._encode_fragment(part, prev_special))
                prev_special = False
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        t = self.tokens[token_id]
        ty = self.token_types[token_id]
        if ty == BYTE and len(t) == 6 and t.startswith("<0x"):
            return bytes([int(t[3:5], 16)])
        if ty in (CONTROL, USER_DEFINED):
            return t.encode("utf-8")
        return t.replace(self.SPACE, " ").encode("utf-8")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False, errors: str = "replace") -> str:
        out = bytearray()
        strip = self.add_space_prefix  # undo the prefix encode added: at the start and after special tokens
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self.tokens) - 1})")
            ty = self.token_types[i]
            if ty in (CONTROL, USER_DEFINED):
                if not (skip_special and ty == CONTROL):
                    out += self.token_bytes(i)
                strip = self.add_space_prefix
                continue
            piece = self.token_bytes(i)
            if strip and piece.startswith(b" "):
                piece = piece[1:]
            strip = False
            out += piece
        return out.decode("utf-8", errors)


def _opt_int(v: object) -> Optional[int]:
    return None if v is None else int(v)  # type: ignore[call-overload]
