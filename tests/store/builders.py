"""Event builders shared by the store tests."""

from __future__ import annotations

from compactd.v1 import events_pb2


def user_event(seq: int, event_id: str = "", text: str = "") -> events_pb2.SessionEvent:
    """A `user/message` at ``seq`` with a fixed time, so serialized bytes are reproducible."""
    event = events_pb2.SessionEvent(seq=seq, event_id=event_id)
    event.time.FromMicroseconds(1_700_000_000_000_000 + seq)
    event.user_message.content.add().text.text = text or f"message {seq}"
    return event


def batch(start: int, count: int, prefix: str = "") -> list[events_pb2.SessionEvent]:
    """``count`` contiguous events from ``start``; ids ``{prefix}{seq}`` when a prefix is given."""
    return [user_event(s, f"{prefix}{s}" if prefix else "") for s in range(start, start + count)]


def varied_events(start: int) -> list[events_pb2.SessionEvent]:
    """One event of several body kinds, with nested and repeated fields set."""
    events = [events_pb2.SessionEvent() for _ in range(5)]
    events[0].system_message.text = "be brief"
    assistant = events[1].assistant_message
    assistant.content.add().reasoning.text = "thinking"
    call = assistant.content.add().tool_call
    call.id, call.name, call.arguments_json = "c1", "grep", '{"pattern": "x"}'
    assistant.usage.input_tokens = 1200
    assistant.usage.output_tokens = 40
    result = events[2].tool_result
    result.tool_call_id, result.tool_name = "c1", "grep"
    result.content.add().image.data = bytes(range(256))
    events[3].compaction_start.compaction_id = "k1"
    events[3].compaction_start.shadowed_seqs.extend([1, 2])
    events[3].compaction_start.turn = 0
    events[4].request_header.config.extra.update({"reasoning": {"effort": "high"}, "n": 1})
    for i, event in enumerate(events):
        event.seq = start + i
        event.event_id = f"varied-{start + i}"
        event.time.FromSeconds(1_700_000_000 + i)
    return events


def wire(events: list[events_pb2.SessionEvent]) -> list[bytes]:
    """The deterministic bytes of each event, for exact comparisons."""
    return [e.SerializeToString(deterministic=True) for e in events]
