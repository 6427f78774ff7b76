"""``SessionFold.appended_since``: a request built at a revision stays the prefix of today's
exactly while the log only appended surface nodes (PrepareStep's ``held_revision``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from compactd.core.fold import SessionFold
from compactd.core.projection import derive_messages
from tests.builders import (
    SessionEvent,
    assistant,
    header,
    image_block,
    offload,
    replace,
    system,
    turn_start,
    user,
)

OPS = ("user", "image", "assistant", "header", "offload", "replace", "log_only")


def request_of(fold: SessionFold) -> tuple[list[bytes], bytes]:
    """What BuildRequest shows: the messages and the header."""
    messages = [m.SerializeToString(deterministic=True) for m in fold.messages()]
    head = b"" if fold.header is None else fold.header.SerializeToString(deterministic=True)
    return messages, head


def has_image(event: SessionEvent) -> bool:
    return event.HasField("user_message") and any(
        block.HasField("image") for block in event.user_message.content
    )


def rewrites(event: SessionEvent) -> bool:
    """A replacement, an offload or a header: what changes a request built before it."""
    kind = event.WhichOneof("body")
    return event.HasField("surface_op") or kind in ("request_header", "image_offload")


def next_event(fold: SessionFold, op: str, index: int) -> SessionEvent:
    """A legal event for ``op`` in ``fold``'s state (an APPEND when ``op`` does not apply)."""
    nodes = fold.surface.nodes
    if op == "image":
        return user(f"look {index}", blocks=[image_block(f"{index}.png")])
    if op == "assistant":
        return assistant(f"answer {index}")
    if op == "header":
        return header("p", f"m{index % 2}")
    if op == "log_only":
        return turn_start(index)
    if op == "offload":
        images = [n for n in nodes if n.seq not in fold.offloads and has_image(n.event)]
        if images:
            return offload({images[-1].seq: [0]})
    if op == "replace" and len(nodes) > 1:  # the last node, never the system head
        last = nodes[-1]
        return replace(user(f"condensed {index}"), last.seq, last.seq, [last.seq])
    return user(f"ask {index}")


@given(st.lists(st.sampled_from(OPS), max_size=30))
def test_a_held_request_is_extended_exactly_while_only_appends_happened(ops: list[str]) -> None:
    fold = SessionFold()
    fold.admit([system("s")])
    requests = {fold.revision: request_of(fold)}
    rewritten: list[int] = []
    for index, op in enumerate(ops):
        event = next_event(fold, op, index)
        (admitted,) = fold.admit([event]).events
        if rewrites(admitted):
            rewritten.append(admitted.seq)
        requests[fold.revision] = request_of(fold)
    now_messages, now_header = request_of(fold)
    for held, (messages, head) in requests.items():
        appended = fold.appended_since(held)
        assert (appended is None) == any(seq >= held for seq in rewritten)
        if appended is not None:
            extra = derive_messages(((n.seq, n.event) for n in appended), fold.offloads)
            assert messages + [m.SerializeToString(deterministic=True) for m in extra] == (
                now_messages
            )
            assert head == now_header


def test_a_revision_outside_the_log_is_never_trusted() -> None:
    fold = SessionFold()
    fold.admit([system("s"), user("a")])
    assert fold.appended_since(-1) is None
    assert fold.appended_since(3) is None
    assert fold.appended_since(2) == []


def test_a_rolled_back_replacement_restores_the_trust_in_held_requests() -> None:
    fold = SessionFold()
    fold.admit([system("s"), user("a"), user("b")])
    batch = fold.admit([replace(user("c"), 2, 2, [2])])
    assert fold.appended_since(3) is None
    fold.rollback(batch)
    assert fold.appended_since(3) == []


def test_a_fold_restored_at_a_revision_trusts_no_request_before_it() -> None:
    fold = SessionFold()
    fold.revision = 5  # as a snapshot restore sets it, without admitting the log
    fold.admit([user("a")])
    assert fold.appended_since(4) is None
    assert [n.seq for n in fold.appended_since(5) or []] == [5]
