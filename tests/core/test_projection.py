"""Message projection: roles and order from the surface, empty nodes, image offload text."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.projection import derive_messages, offload_placeholder, project
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as pb
from tests.builders import (
    SessionEvent,
    assistant,
    checkpoint,
    developer,
    image_block,
    offload,
    replace,
    system,
    text_block,
    tool_result,
    turn_start,
    user,
)


def folded(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit(events)
    return fold


def block_kinds(message: pb.Message) -> list[str]:
    return [b.WhichOneof("block") or "" for b in message.content]


def test_messages_follow_surface_order_with_one_role_per_node_type() -> None:
    fold = folded(
        system("be brief"),
        developer("dev note"),
        user("read x"),
        turn_start(1),
        assistant(calls=[("c1", "read", '{"path":"x"}')]),
        tool_result("c1", "contents", name="read"),
        assistant("done"),
    )
    messages = fold.messages()
    assert [m.role for m in messages] == [
        pb.MESSAGE_ROLE_SYSTEM,
        pb.MESSAGE_ROLE_DEVELOPER,
        pb.MESSAGE_ROLE_USER,
        pb.MESSAGE_ROLE_ASSISTANT,
        pb.MESSAGE_ROLE_TOOL,
        pb.MESSAGE_ROLE_ASSISTANT,
    ]
    assert messages[0].content[0].text.text == "be brief"
    assert messages[1].content[0].text.text == "dev note"
    assert messages[3].content[0].tool_call.arguments_json == '{"path":"x"}'


def test_messages_follow_positions_after_a_replacement() -> None:
    fold = folded(system("s"), user("a"), assistant("b"), user("c"))
    fold.admit([replace(checkpoint("k1", "summary"), start=1, end=2, sources=[1, 2])])
    texts = [m.content[0].text.text for m in fold.messages()]
    assert texts == ["s", "summary", "c"]


def test_tool_message_carries_call_id_name_and_error_flag() -> None:
    event = tool_result("c7", "boom", name="sh", is_error=True)
    message = project(event)
    assert message is not None
    assert (message.role, message.tool_call_id, message.name, message.is_error) == (
        pb.MESSAGE_ROLE_TOOL,
        "c7",
        "sh",
        True,
    )
    assert message.content[0].text.text == "boom"


def test_empty_system_message_projects_to_nothing_but_keeps_its_node() -> None:
    fold = folded(system(""), user("a"))
    assert len(fold.surface) == 2
    assert [m.role for m in fold.messages()] == [pb.MESSAGE_ROLE_USER]


def test_empty_assistant_message_projects_to_nothing_but_keeps_its_node() -> None:
    fold = folded(user("a"), assistant(), assistant(""), user("b"))
    empty_text = SessionEvent()
    empty_text.assistant_message.content.add().text.text = ""
    fold.admit([empty_text])
    assert len(fold.surface) == 5
    assert [m.role for m in fold.messages()] == [pb.MESSAGE_ROLE_USER, pb.MESSAGE_ROLE_USER]


def test_assistant_with_only_reasoning_or_only_calls_is_not_empty() -> None:
    for event in (assistant(reasoning="hmm"), assistant(calls=[("c1", "t", "{}")])):
        message = project(event)
        assert message is not None
        assert message.role == pb.MESSAGE_ROLE_ASSISTANT


def test_empty_developer_message_still_projects() -> None:
    message = project(developer(""))
    assert message is not None
    assert message.role == pb.MESSAGE_ROLE_DEVELOPER


def test_log_only_event_projects_to_nothing() -> None:
    assert project(turn_start(1)) is None


def test_offloaded_images_become_placeholder_text_by_depth_first_index() -> None:
    event = tool_result(
        "c1",
        "three shots",
        blocks=[
            image_block("a.png", attachment_id="att-a", path="/att/a.png"),
            image_block("b.png"),
            image_block("c.png", attachment_id="att-c"),
        ],
    )
    message = project(event, offloaded={0, 2})
    assert message is not None
    assert block_kinds(message) == ["text", "text", "image", "text"]
    first, third = message.content[1].text.text, message.content[3].text.text
    assert all(part in first for part in ("a.png", "att-a", "/att/a.png"))
    assert all(part in third for part in ("c.png", "att-c"))
    assert "read-only path" not in third
    assert message.content[2].image.name == "b.png"


def test_placeholder_names_the_attachment_when_the_image_has_no_name() -> None:
    assert "att-9" in offload_placeholder(events_pb2.ImageBlock(attachment_id="att-9"))
    assert offload_placeholder(events_pb2.ImageBlock()).startswith("[image offloaded: image")


def test_offload_projects_through_derive_messages_and_leaves_the_log_event_unchanged() -> None:
    fold = folded(
        user("look", blocks=[image_block("x.png", path="/att/x.png"), image_block("y.png")]),
        user("and this", blocks=[image_block("z.png")]),
    )
    original = fold.surface[0].event.SerializeToString(deterministic=True)
    node = fold.surface[0]
    fold.admit([offload({0: [1]})])
    first, second = fold.messages()
    assert block_kinds(first) == ["text", "image", "text"]
    assert "y.png" in first.content[2].text.text
    assert block_kinds(second) == ["text", "image"]
    assert fold.surface[0] is node
    assert fold.surface[0].event.SerializeToString(deterministic=True) == original


def test_offloads_accumulate_across_events() -> None:
    fold = folded(user("look", blocks=[image_block("x.png"), image_block("y.png")]))
    fold.admit([offload({0: [0]})])
    fold.admit([offload({0: [1]})])
    (message,) = fold.messages()
    assert block_kinds(message) == ["text", "text", "text"]


def test_derive_messages_applies_offloads_only_to_their_seq() -> None:
    events = [(4, user("a", blocks=[image_block("p.png")])), (9, user("b", blocks=[image_block()]))]
    first, second = derive_messages(events, {9: frozenset({0})})
    assert block_kinds(first) == ["text", "image"]
    assert block_kinds(second) == ["text", "text"]


BLOCKS = st.lists(
    st.one_of(
        st.builds(text_block, st.text(max_size=8)),
        st.builds(image_block, st.sampled_from(["", "a.png"]), attachment_id=st.just("att")),
        st.builds(
            lambda text: events_pb2.ContentBlock(reasoning=events_pb2.ReasoningBlock(text=text)),
            st.text(max_size=4),
        ),
    ),
    max_size=5,
)


def reference_message(
    role: pb.MessageRole.ValueType, blocks: Sequence[events_pb2.ContentBlock], offloaded: set[int]
) -> pb.Message:
    """The projection spelled out: every block as it is, offloaded images as placeholder text."""
    images = [i for i, b in enumerate(blocks) if b.HasField("image")]
    content = [
        text_block(offload_placeholder(b.image)) if i in images and images.index(i) in offloaded
        else b
        for i, b in enumerate(blocks)
    ]  # fmt: skip
    return pb.Message(role=role, content=content)


@given(BLOCKS, st.sets(st.integers(0, 4)), st.booleans())
def test_a_user_message_or_tool_result_projects_to_its_blocks_with_offloads_applied(
    blocks: list[events_pb2.ContentBlock], offloaded: set[int], is_error: bool
) -> None:
    assert project(user(blocks=blocks), offloaded) == reference_message(
        pb.MESSAGE_ROLE_USER, blocks, offloaded
    )
    expected = reference_message(pb.MESSAGE_ROLE_TOOL, blocks, offloaded)
    expected.tool_call_id, expected.name, expected.is_error = "c1", "sh", is_error
    event = tool_result("c1", name="sh", is_error=is_error, blocks=blocks)
    assert project(event, offloaded) == expected


@given(BLOCKS)
def test_an_assistant_message_projects_to_its_blocks_unless_all_are_empty_text(
    blocks: list[events_pb2.ContentBlock],
) -> None:
    event = SessionEvent(assistant_message=events_pb2.AssistantMessage(content=blocks))
    event.assistant_message.content.add().tool_call.id = "c1"
    assert project(event) == pb.Message(
        role=pb.MESSAGE_ROLE_ASSISTANT, content=event.assistant_message.content
    )
    empty = SessionEvent(assistant_message=events_pb2.AssistantMessage(content=[text_block("")]))
    assert project(empty) is None


def test_a_developer_message_projects_to_its_text_even_when_empty() -> None:
    for text in ("", "note"):
        assert project(developer(text)) == pb.Message(
            role=pb.MESSAGE_ROLE_DEVELOPER,
            content=[events_pb2.ContentBlock(text=events_pb2.TextBlock(text=text))],
        )
