"""Image offload: selecting the oldest input images, and the fold's validation of the event."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.offload import (
    OffloadSelection,
    image_count,
    offload_event,
    offloadable,
    select_offload,
)
from compactd.errors import InvalidArgument
from compactd.v1 import events_pb2
from tests.builders import (
    assistant,
    image_block,
    offload,
    system,
    text_block,
    tool_result,
    user,
)


def pictures(*names: str) -> list[events_pb2.ContentBlock]:
    return [image_block(name) for name in names]


def gallery() -> SessionFold:
    """seq 0 system, 1 user (2 images), 2 assistant with an image and a call, 3 tool (1 image
    between texts), 4 user (text only), 5 user (3 images)."""
    output = assistant(text="drawn", calls=[("c1", "draw", "{}")])
    output.assistant_message.content.insert(0, image_block("output.png"))
    fold = SessionFold()
    fold.admit(
        [
            system("You look at images."),
            user("two plots", blocks=pictures("a.png", "b.png")),
            output,
            tool_result("c1", "before", blocks=[image_block("c.png"), text_block("after")]),
            user("no images here"),
            user("three more", blocks=pictures("d.png", "e.png", "f.png")),
        ]
    )
    return fold


def test_the_oldest_input_images_are_selected_in_message_order() -> None:
    fold = gallery()

    selection = select_offload(fold.surface.nodes, fold.offloads, 4)

    assert selection.targets == ((1, (0, 1)), (3, (0,)), (5, (0,)))
    assert selection.count == 4


def test_assistant_output_and_offloaded_images_are_skipped() -> None:
    fold = gallery()
    fold.admit([offload({1: [0]}), offload({5: [1]})])

    selection = select_offload(fold.surface.nodes, fold.offloads, 10)

    assert selection.targets == ((1, (1,)), (3, (0,)), (5, (0, 2)))
    assert offloadable(fold.surface.nodes, fold.offloads) == 4


def test_fewer_images_than_asked_selects_what_remains_and_zero_selects_none() -> None:
    fold = gallery()
    assert select_offload(fold.surface.nodes, fold.offloads, 99).count == 6
    assert select_offload(fold.surface.nodes, fold.offloads, 0) == OffloadSelection(())
    with pytest.raises(ValueError, match="at least one target"):
        offload_event(OffloadSelection(()))


def test_the_selection_folds_as_a_valid_offload_event() -> None:
    fold = gallery()
    selection = select_offload(fold.surface.nodes, fold.offloads, 3)

    fold.admit([offload_event(selection)])

    assert fold.offloads == {1: frozenset({0, 1}), 3: frozenset({0})}
    assert image_count(fold.surface[2].event) == 0  # assistant images are not input


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12))
def test_repeated_offloads_never_select_an_image_twice(counts: list[int]) -> None:
    fold = gallery()
    chosen: list[tuple[int, int]] = []
    for count in counts:
        selection = select_offload(fold.surface.nodes, fold.offloads, count)
        if not selection.targets:
            continue
        chosen += [(seq, i) for seq, indexes in selection.targets for i in indexes]
        fold.admit([offload_event(selection)])
    assert len(chosen) == len(set(chosen))
    assert len(chosen) == min(sum(counts), 6)


# ---- the fold validates every offload --------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "field", "reason"),
    [
        (
            events_pb2.SessionEvent(image_offload=events_pb2.ImageOffload()),
            "image_offload.targets",
            "at least one image",
        ),
        (
            events_pb2.SessionEvent(
                image_offload=events_pb2.ImageOffload(
                    targets=[
                        events_pb2.ImageOffloadTarget(seq=1, image_indexes=[0]),
                        events_pb2.ImageOffloadTarget(seq=1, image_indexes=[1]),
                    ]
                )
            ),
            "image_offload.targets[1].seq",
            "targeted twice",
        ),
        (offload({5: [1, 0]}), "image_offload.targets[0].image_indexes", "strictly increasing"),
        (offload({5: [1, 1]}), "image_offload.targets[0].image_indexes", "strictly increasing"),
        (offload({5: [3]}), "image_offload.targets[0].image_indexes", "the node has 3 image"),
        (offload({2: [0]}), "image_offload.targets[0].seq", "only user and tool input images"),
        (offload({9: [0]}), "image_offload.targets[0].seq", "not a current surface node"),
    ],
    ids=["no-targets", "seq-twice", "decreasing", "repeated", "out-of-range", "assistant", "gone"],
)
def test_an_invalid_offload_is_rejected_naming_the_field(
    event: events_pb2.SessionEvent, field: str, reason: str
) -> None:
    fold = gallery()

    with pytest.raises(InvalidArgument, match=reason) as caught:
        fold.admit([event])

    assert caught.value.violations[0].field == f"events[0].{field}"
    assert fold.offloads == {}
