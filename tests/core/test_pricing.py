"""Pricing one message, the system head, tools and config: the reference heuristic and exact."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.core import pricing as pricing_module
from compactd.core.pricing import (
    HEURISTIC,
    Framing,
    ImagePricing,
    NodeCost,
    PricingProfile,
    TextsAhead,
    canonical_block_json,
    heuristic_price,
    node_cost,
    node_texts,
    price_config,
    price_message,
    price_node,
    price_nodes,
    price_tools,
    quarter_tokens,
    tools_json,
    utf16_length,
    with_counted,
)
from compactd.core.projection import project
from compactd.tokenizers import load_tokenizer
from compactd.v1 import events_pb2, session_service_pb2
from tests.builders import (
    ContentBlock,
    SessionEvent,
    assistant,
    developer,
    header,
    image_block,
    system,
    text_block,
    tool,
    tool_result,
    user,
)


def heuristic_with(**changes: object) -> PricingProfile:
    return PricingProfile(HEURISTIC.tokenizer, HEURISTIC.framing, **changes)  # type: ignore[arg-type]


def test_user_abcd_prices_nine() -> None:
    assert heuristic_price(user("abcd")) == 9  # ceil(4/4) + 4 for the block, + 4 for the message


def test_system_you_are_terse_prices_eight() -> None:
    assert heuristic_price(system("You are terse.")) == 8  # ceil(14/4) + 4, no block overhead


def test_an_empty_system_message_prices_zero() -> None:
    assert heuristic_price(system("")) == 0


def test_length_is_counted_in_utf16_code_units() -> None:
    assert utf16_length("abc") == 3
    assert utf16_length("中文") == 2
    assert utf16_length("😀") == 2  # an astral character is a surrogate pair
    assert heuristic_price(user("😀😀")) == math.ceil(4 / 4) + 4 + 4
    assert heuristic_price(user("中文字")) == math.ceil(3 / 4) + 4 + 4


def test_a_message_is_its_blocks_plus_four() -> None:
    event = user(blocks=[text_block("a" * 10), text_block("b" * 3)])
    assert heuristic_price(event) == (3 + 4) + (1 + 4) + 4


def test_reasoning_blocks_price_like_text() -> None:
    event = assistant("hello", reasoning="x" * 17)
    assert heuristic_price(event) == (5 + 4) + (2 + 4) + 4


def test_a_tool_call_prices_name_and_arguments() -> None:
    event = assistant(calls=[("c1", "read_file", '{"path": "a.py"}')])
    assert heuristic_price(event) == math.ceil(9 / 4) + math.ceil(16 / 4) + 4 + 4


def test_an_empty_assistant_message_prices_zero() -> None:
    assert heuristic_price(assistant("")) == 0


def test_a_log_only_event_prices_zero() -> None:
    assert heuristic_price(header("deepseek", "deepseek-chat")) == 0


def test_other_blocks_price_their_canonical_json() -> None:
    block = image_block("cat.png", attachment_id="att-1")
    text = canonical_block_json(block)
    assert json.loads(text) == {
        "image": {"attachmentId": "att-1", "mediaType": "image/png", "name": "cat.png"}
    }
    assert heuristic_price(user(blocks=[block])) == 4 + math.ceil(len(text) / 4) + 4


def test_a_tool_result_prices_its_content_plus_four() -> None:
    assert heuristic_price(tool_result("c1", "x" * 8, name="read")) == 2 + 4 + 4


def test_a_developer_message_is_an_ordinary_message() -> None:
    assert heuristic_price(developer("abcd")) == 9


def test_heuristic_price_of_a_projected_message_equals_that_of_its_event() -> None:
    event = assistant("done", calls=[("c1", "ls", "{}")], reasoning="think")
    message = project(event)
    assert message is not None
    assert heuristic_price(message) == heuristic_price(event)


def test_tools_price_their_json_plus_four_and_nothing_when_absent() -> None:
    tools = [tool("read", '{"type":"object"}', "Read a file"), tool("ls")]
    text = tools_json(tools)
    assert json.loads(text) == [
        {"name": "read", "description": "Read a file", "inputSchema": {"type": "object"}},
        {"name": "ls", "description": "", "inputSchema": {}},
    ]
    assert price_tools(tools, HEURISTIC) == math.ceil(utf16_length(text) / 4) + 4
    assert price_tools([], HEURISTIC) == 0


def test_the_heuristic_prices_no_request_framing() -> None:
    assert price_config(None, HEURISTIC) == 0


@given(st.text(max_size=300))
def test_a_text_message_prices_quarter_utf16_plus_eight(text: str) -> None:
    expected = math.ceil(len(text.encode("utf-16-le")) / 2 / 4) + 4 + 4
    assert heuristic_price(user(blocks=[text_block(text)])) == expected


@given(st.text(max_size=300))
def test_a_system_message_prices_quarter_utf16_plus_four_or_zero(text: str) -> None:
    expected = quarter_tokens(text) + 4 if text else 0
    assert heuristic_price(system(text)) == expected


def test_offloaded_images_cost_their_placeholder_text_as_images() -> None:
    event = user("look", blocks=[image_block("a.png"), image_block("b.png")])
    message = project(event, {0})
    assert message is not None
    placeholder = message.content[1].text.text
    cost = price_node(event, HEURISTIC, {0})
    sent = 4 + quarter_tokens(canonical_block_json(image_block("b.png")))
    assert cost == NodeCost(messages=(1 + 4) + 4, images=quarter_tokens(placeholder) + 4 + sent)


def test_route_image_pricing_replaces_the_structural_price() -> None:
    pricing = heuristic_with(image_pricing=ImagePricing(per_image=258))
    event = user(blocks=[image_block("photo.png")])
    assert price_node(event, pricing) == NodeCost(
        messages=4, images=258 + quarter_tokens("photo.png")
    )


def test_an_offloaded_image_costs_its_placeholder_even_with_image_pricing() -> None:
    pricing = heuristic_with(image_pricing=ImagePricing(per_image=1000))
    event = tool_result("c1", blocks=[image_block("x.png", path="/tmp/x.png")])
    cost = price_node(event, pricing, {0})
    assert cost.images < 1000
    assert cost == price_node(event, HEURISTIC, {0})


def test_size_based_image_pricing_follows_the_tile_formula() -> None:
    tiles = ImagePricing(per_image=85, per_tile=170)
    assert tiles.tokens(1024, 1024) == 85 + 170 * 4  # scaled to 768x768: 2x2 tiles
    assert tiles.tokens(2048, 4096) == 85 + 170 * 6  # fit to 1024x2048, then 768x1536: 2x3
    assert tiles.tokens(0, 0) == 85 + 170 * 4  # unknown size: a short-side square
    assert tiles.tokens(100, 100) == 85 + 170  # never scaled up
    assert ImagePricing(per_image=258).tokens(4000, 3000) == 258


def test_exact_pricing_counts_tokens_and_the_family_framing() -> None:
    framing = Framing(per_message=4, per_system=4, per_tool_call=3, per_tool=7, per_request=3)
    exact = PricingProfile(load_tokenizer("cl100k_base"), framing)
    assert price_node(user("hello world"), exact) == NodeCost(2 + 4)
    assert price_node(system("hello world"), exact) == NodeCost(2 + 4)
    call = assistant(calls=[("c1", "hello", "world")])
    assert price_node(call, exact) == NodeCost(1 + 1 + 3 + 4)
    tools = [tool("t")]
    assert price_tools(tools, exact) == exact.tokenizer.count(tools_json(tools)) + 7
    assert price_config(None, exact) == 3


def test_exact_routes_that_drop_reasoning_do_not_price_it() -> None:
    tokenizer = load_tokenizer("cl100k_base")
    sends = PricingProfile(tokenizer, Framing())
    drops = PricingProfile(tokenizer, Framing(), sends_reasoning=False)
    event = assistant("hello", reasoning="a long chain of thought")
    assert price_node(event, drops).total == tokenizer.count("hello")
    assert price_node(event, sends).total > price_node(event, drops).total


def test_profiles_with_equal_pricing_are_one_cache_key() -> None:
    a = PricingProfile(load_tokenizer("cl100k_base"), Framing(per_message=4))
    b = PricingProfile(load_tokenizer("cl100k_base"), Framing(per_message=4))
    assert a == b
    assert hash(a) == hash(b)
    assert a != PricingProfile(load_tokenizer("deepseek-v4"), Framing(per_message=4))


def test_a_system_role_message_uses_the_system_formula() -> None:
    message = session_service_pb2.Message(
        role=session_service_pb2.MESSAGE_ROLE_SYSTEM, content=[text_block("You are terse.")]
    )
    assert price_message(message, HEURISTIC) == NodeCost(8)


def test_an_empty_text_block_still_costs_its_overhead() -> None:
    event = SessionEvent(
        user_message=events_pb2.UserMessage(content=[ContentBlock(text=events_pb2.TextBlock())])
    )
    assert heuristic_price(event) == 4 + 4


def _block(kind: str, text: str) -> ContentBlock:
    if kind == "text":
        return text_block(text)
    if kind == "reasoning":
        return ContentBlock(reasoning=events_pb2.ReasoningBlock(text=text))
    if kind == "call":
        return ContentBlock(
            tool_call=events_pb2.ToolCallBlock(id="c", name=text, arguments_json=text)
        )
    return image_block(text)


BLOCKS = st.lists(
    st.builds(
        _block, st.sampled_from(["text", "reasoning", "call", "image"]), st.text(max_size=20)
    ),
    max_size=4,
)


@given(st.sampled_from(["user_message", "assistant_message", "tool_result"]), BLOCKS)
def test_pricing_a_node_prices_exactly_what_it_projects_to(
    kind: str, blocks: list[ContentBlock]
) -> None:
    event = SessionEvent()
    getattr(event, kind).content.extend(blocks)
    message = project(event)
    for pricing in (HEURISTIC, PricingProfile(load_tokenizer("cl100k_base"), Framing(3, 1, 2, 5))):
        expected = price_message(message, pricing) if message is not None else NodeCost(0)
        assert price_node(event, pricing) == expected


# ---- batched pricing ------------------------------------------------------------------------

_TEXTS = st.text(max_size=60)
_NODES = st.lists(
    st.one_of(
        _TEXTS.map(lambda t: assistant(t, calls=[("c1", "read", '{"p": 1}')], reasoning=t[:5])),
        _TEXTS.map(lambda t: tool_result("c1", t, blocks=[image_block("a.png")])),
        _TEXTS.map(system),
        _TEXTS.map(developer),
    ),
    max_size=12,
)


@given(_NODES, st.booleans())
def test_batched_pricing_equals_pricing_one_node_at_a_time(
    events: list[SessionEvent], offload: bool
) -> None:
    items = [(e, frozenset({0}) if offload and e.HasField("tool_result") else frozenset())
             for e in events]  # fmt: skip
    for name in ("cl100k_base", "deepseek-v4", "heuristic"):
        tokenizer = load_tokenizer(name)
        profile = PricingProfile(tokenizer, Framing(per_message=3, per_block=1, per_tool_call=2))
        assert price_nodes(items, profile) == [price_node(e, profile, o) for e, o in items]


class _Refusing:
    """A tokenizer that counts nothing: what it is asked for was not counted ahead."""

    def __init__(self, name: str, exact: bool) -> None:
        self.name, self.exact = name, exact

    def count(self, text: str) -> int:
        raise AssertionError(f"not counted ahead: {text!r}")


@given(_NODES, st.booleans())
def test_a_node_priced_on_its_texts_counted_apart_is_priced_as_price_node_does(
    events: list[SessionEvent], offload: bool
) -> None:
    for name in ("cl100k_base", "heuristic"):
        tokenizer = load_tokenizer(name)
        profile = PricingProfile(tokenizer, Framing(per_message=3, per_block=1, per_tool_call=2))
        refusing = PricingProfile(_Refusing(tokenizer.name, tokenizer.exact), profile.framing)
        for event in events:
            offloaded = frozenset({0}) if offload and event.HasField("tool_result") else frozenset()
            texts = node_texts(event, profile, offloaded)
            assert texts is not None
            counted = with_counted(refusing, {text: profile.count(text) for text in texts})
            assert price_node(event, counted, offloaded) == price_node(event, profile, offloaded)


def _sends_nothing(texts: list[str]) -> SessionEvent:
    """An assistant message of empty text blocks: it projects to no message."""
    return SessionEvent(
        assistant_message=events_pb2.AssistantMessage(content=[text_block(t) for t in texts])
    )


_AHEAD_NODES = st.lists(
    st.one_of(
        _NODES.map(lambda nodes: nodes[0] if nodes else user("")),
        _TEXTS.map(lambda t: user(t, blocks=[image_block(t[:8]), text_block(t)])),
        _TEXTS.map(lambda t: assistant(t, reasoning=t, calls=[("c1", t[:3], t)])),
        st.lists(st.just(""), max_size=2).map(_sends_nothing),
    ),
    max_size=10,
)


@given(_AHEAD_NODES)
def test_prices_made_from_texts_counted_ahead_equal_price_node(events: list[SessionEvent]) -> None:
    for name in ("cl100k_base", "deepseek-v4"):
        tokenizer = load_tokenizer(name)
        for profile in (
            PricingProfile(tokenizer, Framing(per_message=3, per_block=1, per_tool_call=2)),
            PricingProfile(tokenizer, Framing()),  # nothing framed: a 0 price may hold texts
            PricingProfile(tokenizer, Framing(4, 4), image_pricing=ImagePricing(per_image=85)),
            PricingProfile(tokenizer, Framing(4), image_pricing=ImagePricing(per_image=0)),
            PricingProfile(tokenizer, Framing(4, per_block=1), sends_reasoning=False),
        ):
            ahead = TextsAhead.of(profile)
            assert ahead is not None
            for event in events:
                ahead.add(event)
            counted = ahead.count()
            priced = with_counted(profile, counted.counts)
            for event, price in zip(events, counted.prices, strict=True):
                made = price_node(event, priced) if price is None else price
                assert made == price_node(event, profile)


def test_text_only_nodes_counted_ahead_are_priced_with_their_counts() -> None:
    profile = PricingProfile(load_tokenizer("cl100k_base"), Framing(3, per_block=1))
    ahead = TextsAhead.of(profile)
    assert ahead is not None
    events = [user("hello there"), assistant("ok", calls=[("c1", "read", "{}")]), system("")]
    for event in [*events, user(blocks=[image_block("a.png")])]:
        ahead.add(event)
    prices = ahead.count().prices
    assert prices[:3] == [price_node(event, profile) for event in events]
    assert prices[3] is None  # an image's handle is priced with it: price_node prices it


def test_equal_text_only_costs_are_one_shared_object() -> None:
    assert node_cost(17) is node_cost(17) is node_cost(17, 0)
    assert node_cost(17) == NodeCost(17, 0)
    assert node_cost(17, 3) == NodeCost(17, 3)  # image costs are made as they are


def test_costs_past_the_shared_table_are_made_unshared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pricing_module, "_SHARED_COSTS", {})
    monkeypatch.setattr(pricing_module, "SHARED_COSTS_MAX", 2)
    shared = [node_cost(1), node_cost(2)]
    past = node_cost(3)
    assert [node_cost(1), node_cost(2)] == shared
    assert node_cost(1) is shared[0]
    assert node_cost(2) is shared[1]
    assert past == NodeCost(3)
    assert node_cost(3) is not past
    assert len(pricing_module._SHARED_COSTS) == 2
