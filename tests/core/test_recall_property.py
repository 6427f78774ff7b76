"""Recall and revert as properties of any session under any sequence of prunes and brackets.

A session of units (a request, a tool call, its result, an answer; some results oversized) is
folded, then any sequence of prunes (``core.pruner``), brackets over any balanced span
(``core.bracket``: start, summary, checkpoint, end) and reverts (``core.revert``) is applied to
it, the way the service appends them. Then:

- every handle in the model-visible request resolves, through the one event it names, to the
  events its replacement shadowed, and the pages of those events (``core.recall_page``) carry
  each one's projected message and the SHA-256 of its stored bytes;
- a revert right after a bracket gives back the surface's messages and the request it had.
"""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import bracket, recall_page
from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.pricing import heuristic_price
from compactd.core.projection import project
from compactd.core.pruner import PrunerConfig, plan_prunes, prune_events
from compactd.core.recall import covered_seqs, parse_handle
from compactd.core.revert import plan_revert
from compactd.core.selection import Selection
from compactd.v1 import events_pb2
from tests.builders import assistant, system, tool_result, user

HANDLE = re.compile(r"\[recall:([cp]\d+-[0-9a-f]{4})\]")
PRUNER = PrunerConfig(max_code_points=600, head_code_points=100, tail_code_points=50)
TOKENS = events_pb2.TokenMeasurement()


def unit(i: int, size: int) -> list[SessionEvent]:
    output = "".join(f"line {n} of output {i}\n" for n in range(size))
    return [
        user(f"request {i}"),
        assistant(f"calling {i}", calls=[(f"c{i}", "run", json.dumps({"n": i}))]),
        tool_result(f"c{i}", output, name="run"),
        assistant(f"answer {i}"),
    ]


class Session:
    """A fold and its log, appended to as the service does."""

    def __init__(self, sizes: list[int]) -> None:
        self.fold = SessionFold()
        self.log: list[SessionEvent] = []
        self.append([system("sys"), *(e for i, n in enumerate(sizes) for e in unit(i, n))])
        self.brackets = 0

    def append(self, events: list[SessionEvent]) -> None:
        batch = self.fold.admit(events)
        self.log.extend(batch.events)

    def messages(self) -> list[bytes]:
        return [m.SerializeToString(deterministic=True) for m in self.fold.messages()]

    def prune(self) -> None:
        plans = plan_prunes(self.fold, PRUNER, lambda node: heuristic_price(node.event))
        if plans:
            self.append(prune_events(plans))

    def cuts(self) -> list[int]:
        """Positions where a balanced span may start or end after: requests and checkpoints."""
        nodes = self.fold.surface.nodes
        return [p for p in range(1, len(nodes)) if nodes[p].type == "user/message"]

    def compact(self, first: int, length: int) -> bool:
        cuts = self.cuts()
        if len(cuts) < 2:
            return False
        start = cuts[first % (len(cuts) - 1)]
        later = [c for c in cuts if c > start]
        end = later[min(length, len(later) - 1)] - 1  # up to the node before a later request
        nodes = self.fold.surface.nodes[start : end + 1]
        selection = Selection(
            start, end, nodes[0].seq, nodes[-1].seq, tuple(n.seq for n in nodes), 0
        )
        cid = f"k{self.brackets}"
        self.brackets += 1
        trigger = events_pb2.COMPACTION_TRIGGER_MANUAL
        self.append([bracket.start_event(cid, trigger, selection, None)])
        start_seq = self.fold.revision - 1
        text = bracket.checkpoint_text(f"summary of {len(nodes)} nodes", start_seq)
        summary = bracket.summary_event(cid, "summary", selection, TOKENS)
        self.append([summary])
        checkpoint = bracket.checkpoint_event(
            cid, text, selection, start_seq, self.fold.revision - 1
        )
        self.append([checkpoint, bracket.end_event(cid)])
        return True

    def revert_last(self) -> None:
        """Revert the newest checkpoint on the surface (the highest seq)."""
        checkpoints = [
            (node.seq, position)
            for position, node in enumerate(self.fold.surface)
            if node.type == "user/message"
            and node.event.user_message.source.compaction_checkpoint.compaction_id
        ]
        if not checkpoints:
            return
        seq, position = max(checkpoints)
        event = self.log[seq]
        cid = event.user_message.source.compaction_checkpoint.compaction_id
        start = self.log[event.source_event_seqs[0]].compaction_start
        if start.compaction_id != cid:
            return  # a copy restored by an earlier revert: not this test's business
        originals = [self.log[s] for s in start.shadowed_seqs]
        plan = plan_revert(f"r{self.brackets}", cid, event, position, originals, self.fold.revision)
        self.brackets += 1
        self.append(plan.events)


operations = st.lists(
    st.tuples(
        st.sampled_from(["prune", "compact", "revert"]), st.integers(0, 50), st.integers(0, 5)
    ),
    max_size=8,
)
sessions = st.lists(st.integers(1, 40), min_size=2, max_size=10)


@settings(max_examples=60, deadline=None)
@given(sessions, operations)
def test_every_handle_in_the_request_recalls_its_originals_byte_for_byte(
    sizes: list[int], ops: list[tuple[str, int, int]]
) -> None:
    session = Session(sizes)
    for name, a, b in ops:
        if name == "prune":
            session.prune()
        elif name == "compact":
            session.compact(a, b)
        else:
            session.revert_last()

    texts = [
        block.text.text for m in session.fold.messages() for block in m.content if block.text.text
    ]
    handles = [h for text in texts for h in HANDLE.findall(text)]
    for quoted in handles:
        handle = parse_handle(quoted)
        assert handle is not None
        seqs = covered_seqs(handle, session.log[handle.seq])
        assert seqs, quoted
        pager = recall_page.Pager(recall_page.Cursor(), recall_page.MAX_MAX_BYTES)
        for seq in seqs:
            assert pager.add(session.log[seq])
        pager.finish(len(seqs))
        assert pager.next is None
        assert [e.seq for e in pager.events] == list(seqs)
        for recalled in pager.events:
            original = session.log[recalled.seq]
            stored = original.SerializeToString(deterministic=True)
            assert recalled.sha256 == recall_page.digest(original)
            assert recall_page.digest(events_pb2.SessionEvent.FromString(stored)) == recalled.sha256
            message = project(original)
            assert (recalled.message if recalled.HasField("message") else None) == message


@settings(max_examples=60, deadline=None)
@given(sessions, operations, st.integers(0, 50), st.integers(0, 5))
def test_a_revert_right_after_a_bracket_gives_back_the_surface_and_the_request(
    sizes: list[int], ops: list[tuple[str, int, int]], first: int, length: int
) -> None:
    session = Session(sizes)
    for name, a, b in ops:
        if name == "prune":
            session.prune()
        elif name == "compact":
            session.compact(a, b)
    before = session.messages()
    types = [node.type for node in session.fold.surface]
    if not session.compact(first, length):
        return
    assert session.messages() != before
    session.revert_last()
    assert session.messages() == before
    assert [node.type for node in session.fold.surface] == types
