"""The tool-result pruner: head + fixed marker + tail, each REPLACE preceded by its prune event."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.core.events import SessionEvent, event_type
from compactd.core.fold import SessionFold
from compactd.core.pricing import heuristic_price
from compactd.core.projection import offload_placeholder
from compactd.core.pruner import (
    MARKER_ROOM,
    PRUNE_MARKER,
    PrunerConfig,
    code_points,
    plan_prunes,
    plan_window_prunes,
    prune_content,
    prune_events,
    slice_code_points,
)
from compactd.core.recall import prune_handle
from compactd.core.surface import SurfaceNode
from compactd.errors import ConfigError
from compactd.v1 import events_pb2
from tests.builders import (
    assistant,
    image_block,
    offload,
    replace,
    system,
    text_block,
    tool_result,
    user,
)

DEFAULT = PrunerConfig()
PAIR = "\ud83d\ude00"  # U+1F600 as a UTF-16 surrogate pair, as a JSON decoder may leave it


def shadow_price(node: SurfaceNode) -> int:
    """A stand-in heuristic price: a quarter of the event's bytes."""
    return node.event.ByteSize() // 4


def letters(count: int, seed: str = "x") -> str:
    """``count`` code points of recognisable text."""
    pattern = f"{seed}0123456789abcdefghijklmnopqrstuvwxyz"
    return (pattern * (count // len(pattern) + 1))[:count]


def texts(blocks: list[events_pb2.ContentBlock]) -> list[str]:
    return [b.text.text if b.HasField("text") else f"<image {b.image.name}>" for b in blocks]


def fold_with(*events: SessionEvent) -> SessionFold:
    fold = SessionFold()
    fold.admit([system("sys"), *events])
    return fold


def test_default_thresholds_are_the_spec_numbers() -> None:
    assert (DEFAULT.max_code_points, DEFAULT.head_code_points, DEFAULT.tail_code_points) == (
        8192,
        4096,
        1024,
    )


def test_text_at_the_threshold_is_not_pruned() -> None:
    assert prune_content([text_block(letters(8192))], DEFAULT) is None


def test_text_over_the_threshold_keeps_head_marker_and_tail() -> None:
    text = letters(8193)
    pruned = prune_content([text_block(text)], DEFAULT)
    assert pruned is not None
    assert texts(pruned.content) == [text[:4096] + PRUNE_MARKER + text[-1024:]]
    assert (pruned.original_code_points, pruned.retained_code_points) == (8193, 5120)


def test_head_and_tail_are_counted_across_text_blocks_with_one_marker() -> None:
    blocks = [letters(3000, seed) for seed in "abcd"]  # 12000 code points; tail starts at 10976
    pruned = prune_content([text_block(t) for t in blocks], DEFAULT)
    assert pruned is not None
    # Block b meets the removed span first and gets the marker; block c is removed entirely.
    assert texts(pruned.content) == [blocks[0], blocks[1][:1096] + PRUNE_MARKER, blocks[3][1976:]]
    assert "".join(texts(pruned.content)).count(PRUNE_MARKER) == 1


def test_marker_goes_into_the_next_block_when_the_head_ends_on_a_block_boundary() -> None:
    head, rest = letters(4096, "h"), letters(5000, "r")
    pruned = prune_content([text_block(head), text_block(rest)], DEFAULT)
    assert pruned is not None
    assert texts(pruned.content) == [head, PRUNE_MARKER + rest[-1024:]]


def test_text_block_left_empty_is_dropped() -> None:
    middle = letters(2000, "m")
    blocks = [text_block(letters(5000)), text_block(middle), text_block(letters(5000))]
    pruned = prune_content(blocks, DEFAULT)
    assert pruned is not None
    assert len(pruned.content) == 2
    assert middle not in "".join(texts(pruned.content))


def test_non_text_blocks_keep_their_relative_order() -> None:
    blocks = [
        text_block(letters(5000, "a")),
        image_block("one.png"),
        text_block(letters(3000, "b")),  # inside the removed span: dropped
        image_block("two.png"),
        text_block(letters(5000, "c")),
    ]
    pruned = prune_content(blocks, DEFAULT)
    assert pruned is not None
    assert texts(pruned.content)[1:3] == ["<image one.png>", "<image two.png>"]
    assert len(pruned.content) == 4


def test_an_astral_character_is_one_code_point_and_never_split() -> None:
    text = letters(4095) + "\U0001f600" + letters(6000)
    pruned = prune_content([text_block(text)], DEFAULT)
    assert pruned is not None
    kept = texts(pruned.content)[0]
    assert kept.startswith(letters(4095) + "\U0001f600" + PRUNE_MARKER)


def test_a_surrogate_pair_counts_as_one_code_point() -> None:
    assert code_points(f"a{PAIR}b") == 3
    assert code_points("\ud83d") == 1  # a lone surrogate is a code point of its own


def test_slicing_never_splits_a_surrogate_pair() -> None:
    text = f"ab{PAIR}cd{PAIR}"
    assert slice_code_points(text, 0, 3) == f"ab{PAIR}"
    assert slice_code_points(text, 3, 6) == f"cd{PAIR}"
    assert slice_code_points(text, 2, 3) == PAIR


@given(
    st.lists(st.sampled_from(["a", "\u00e9", PAIR, "\ud83d", "\ude00"]), max_size=40),
    st.data(),
)
def test_slices_at_any_code_point_reassemble_the_text_without_splitting_pairs(
    pieces: list[str], data: st.DataObject
) -> None:
    text = "".join(pieces)
    cut = data.draw(st.integers(0, code_points(text)))
    head, tail = slice_code_points(text, 0, cut), slice_code_points(text, cut, code_points(text))
    assert head + tail == text
    assert code_points(head) == cut
    assert not (head.endswith("\ud83d") and tail.startswith("\ude00"))


def test_config_rejects_head_marker_and_tail_over_the_threshold() -> None:
    with pytest.raises(ConfigError, match=r"pruner\.max_code_points"):
        PrunerConfig(max_code_points=5120, head_code_points=4096, tail_code_points=1024)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"head_code_points": -1}, "compaction.pruner.head_code_points"),
        ({"tail_code_points": True}, "compaction.pruner.tail_code_points"),
        ({"max_code_points": 0}, "compaction.pruner.max_code_points"),
        ({"max_code_points": "8192"}, "compaction.pruner.max_code_points"),
        ({"head_chars": 10}, "compaction.pruner.head_chars"),
        ({"max_code_points": 100}, "compaction.pruner.max_code_points"),
    ],
)
def test_config_from_a_table_names_the_bad_key(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        PrunerConfig.from_mapping(values)


def test_config_from_a_table_fills_defaults() -> None:
    config = PrunerConfig.from_mapping({"max_code_points": 20000, "head_code_points": 8000})
    assert config == PrunerConfig(20000, 8000, 1024)


def test_small_thresholds_that_fit_the_marker_are_accepted() -> None:
    room = MARKER_ROOM  # the marker and the longest recall handle
    config = PrunerConfig(max_code_points=room + 10, head_code_points=6, tail_code_points=4)
    pruned = prune_content([text_block(letters(room + 11))], config)
    assert pruned is not None
    assert code_points(texts(pruned.content)[0]) == code_points(PRUNE_MARKER) + 10
    with pytest.raises(ConfigError):
        PrunerConfig(max_code_points=room + 9, head_code_points=6, tail_code_points=4)


def test_plan_rewrites_only_oversized_tool_results() -> None:
    fold = fold_with(
        user(letters(20000)),
        assistant("go", calls=[("c1", "read", "{}"), ("c2", "read", "{}")]),
        tool_result("c1", letters(9000)),
        tool_result("c2", letters(100)),
    )
    plans = plan_prunes(fold, DEFAULT, shadow_price)
    assert [plan.shadowed_seq for plan in plans] == [3]


def test_replacement_copies_the_result_except_its_content() -> None:
    fold = fold_with(
        assistant("go", calls=[("c1", "read", "{}")]),
        tool_result("c1", letters(9000), name="read", is_error=True),
    )
    [plan] = plan_prunes(fold, DEFAULT, shadow_price, compaction_id="k7")
    new = plan.replacement
    assert (new.tool_result.tool_call_id, new.tool_result.tool_name) == ("c1", "read")
    assert new.tool_result.is_error
    assert new.surface_op.kind == events_pb2.SURFACE_OP_KIND_REPLACE
    assert (new.surface_op.start_seq, new.surface_op.end_seq) == (2, 2)
    assert list(new.source_event_seqs) == [2]


def test_a_pruned_result_names_its_recall_handle_after_the_fixed_marker() -> None:
    fold = fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "x" * 9000))
    [plan] = plan_prunes(fold, DEFAULT, shadow_price)
    [again] = plan_prunes(
        fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "x" * 9000)),
        DEFAULT,
        shadow_price,
    )
    text = plan.replacement.tool_result.content[0].text.text
    assert "x" * 4096 + PRUNE_MARKER + f"[recall:{prune_handle(2)}]\n\n" + "x" * 1024 == text
    assert again.replacement == plan.replacement  # the same result always gets the same text


def test_prune_event_records_the_shadowed_node_and_its_heuristic_price() -> None:
    fold = fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "x" * 9000))
    [plan] = plan_prunes(fold, DEFAULT, shadow_price, compaction_id="k7")
    prune = plan.prune.compaction_prune
    assert plan.events == (plan.prune, plan.replacement)
    assert prune.compaction_id == "k7"
    assert prune.shadowed_seq == 2
    assert prune.shadowed_tokens == shadow_price(fold.surface[2])
    assert (prune.original_code_points, prune.retained_code_points) == (9000, 5120)


def test_prune_batch_folds_with_each_prune_just_before_its_replacement() -> None:
    fold = fold_with(
        assistant("go", calls=[("c1", "read", "{}"), ("c2", "read", "{}")]),
        tool_result("c1", letters(9000, "a")),
        tool_result("c2", letters(12000, "b")),
        user("next"),
    )
    batch = fold.admit(prune_events(plan_prunes(fold, DEFAULT, shadow_price)))
    assert [event_type(e) for e in batch.events] == [
        "compaction/prune",
        "tool/result",
        "compaction/prune",
        "tool/result",
    ]
    assert [n.seq for n in fold.surface] == [0, 1, 6, 8, 4]  # same positions, new nodes
    assert [batch.events[i].compaction_prune.shadowed_seq for i in (0, 2)] == [2, 3]


def test_a_pruned_result_is_never_pruned_again() -> None:
    fold = fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "x" * 9000))
    fold.admit(prune_events(plan_prunes(fold, DEFAULT, shadow_price)))
    assert plan_prunes(fold, DEFAULT, shadow_price) == []


def test_a_result_replaced_by_the_runtime_is_not_pruned() -> None:
    fold = fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "short"))
    fold.admit([replace(tool_result("c1", "y" * 9000), 2, 2, [2])])
    assert plan_prunes(fold, DEFAULT, shadow_price) == []


def test_offloaded_images_survive_as_their_placeholder_text() -> None:
    kept = image_block("kept.png")
    gone = image_block("gone.png", attachment_id="att-1", path="/att/gone.png")
    fold = fold_with(
        assistant("go", calls=[("c1", "shot", "{}")]),
        tool_result("c1", letters(9000), blocks=[gone, kept]),
    )
    fold.admit([offload({2: [0]})])
    [plan] = plan_prunes(fold, DEFAULT, shadow_price)
    content = list(plan.replacement.tool_result.content)
    placeholder = offload_placeholder(gone.image)
    assert texts(content)[1:] == [placeholder, "<image kept.png>"]
    assert plan.prune.compaction_prune.original_code_points == 9000 + len(placeholder)
    fold.admit(list(plan.events))
    assert fold.messages()[-1].content[1].text.text == placeholder


def test_pruning_is_byte_for_byte_deterministic() -> None:
    def once() -> list[bytes]:
        fold = fold_with(
            assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", letters(10000))
        )
        events = prune_events(plan_prunes(fold, DEFAULT, shadow_price))
        return [e.SerializeToString(deterministic=True) for e in events]

    assert once() == once()


# --- window-sized prunes (overflow recovery on small windows) ----------------------------------


def heuristic(event: SessionEvent, offloaded: frozenset[int] | set[int] = frozenset()) -> int:
    return heuristic_price(event, offloaded)


def test_a_result_under_the_threshold_that_alone_exceeds_the_room_is_pruned_to_half_of_it() -> None:
    fold = fold_with(
        assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", letters(8000))
    )
    assert plan_prunes(fold, DEFAULT, shadow_price) == []  # under max_code_points

    [plan] = plan_window_prunes(fold, DEFAULT, heuristic, 1500, shadow_price)

    assert heuristic(plan.replacement) <= 750
    kept = plan.replacement.tool_result.content[0].text.text
    head, tail = kept.split(PRUNE_MARKER)
    tail = tail.removeprefix(f"[recall:{prune_handle(2)}]\n\n")
    assert kept.startswith(letters(len(head)))
    assert len(head) == 4 * len(tail)  # the configured 4096:1024 ratio
    assert plan.replacement.source_event_seqs == [2]


def test_a_pruned_result_still_over_the_room_is_pruned_again() -> None:
    fold = fold_with(assistant("go", calls=[("c1", "read", "{}")]), tool_result("c1", "x" * 20000))
    fold.admit(prune_events(plan_prunes(fold, DEFAULT, shadow_price)))
    pruned = fold.surface[2]

    [plan] = plan_window_prunes(fold, DEFAULT, heuristic, 1000, shadow_price)

    assert plan.shadowed_seq == pruned.seq
    assert heuristic(plan.replacement) <= 500


def test_results_within_the_room_or_made_of_images_are_left_alone() -> None:
    images = [image_block(f"{i}.png") for i in range(40)]
    fold = fold_with(
        assistant("go", calls=[("c1", "read", "{}"), ("c2", "shot", "{}")]),
        tool_result("c1", letters(3000)),
        tool_result("c2", "shots", blocks=images),
    )
    assert heuristic(fold.surface[3].event) > 500  # the images alone cost more than the room
    assert plan_window_prunes(fold, DEFAULT, heuristic, 1000, shadow_price) == []
    [text_only] = plan_window_prunes(fold, DEFAULT, heuristic, 500, shadow_price)
    assert text_only.shadowed_seq == 2
