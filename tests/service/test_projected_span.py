"""The summary request's span as the gate reads it: beside each message, bytes that hold its text
blocks verbatim (the node's event unless an offload rewrote them), so that the echo check finds
what it finds on the messages' own serialized forms."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.core.gate import echoed_message
from compactd.core.probes import message_text
from compactd.service.bracket import projected_span
from tests.builders import system
from tests.core.test_meter import Driver, Session, routed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_each_message_s_bytes_hold_its_text_blocks_and_echo_as_its_serialized_form(
    data: st.DataObject,
) -> None:
    session = Session(routed(), system("head"))
    driver = Driver(data, session, usage=False)
    for _ in range(data.draw(st.integers(1, 15))):
        driver.step()
        messages, serialized = projected_span(session.fold, session.fold.surface)
        assert len(serialized) == len(messages)
        for message, data_bytes in zip(messages, serialized, strict=True):
            assert len(message_text(message).encode()) <= len(data_bytes)
            for block in message.content:
                if block.HasField("text"):
                    assert block.text.text.encode() in data_bytes
        if messages:
            text = message_text(messages[data.draw(st.integers(0, len(messages) - 1))])
            start = data.draw(st.integers(0, len(text)))
            summary = text[start : data.draw(st.integers(start, len(text)))].upper()
            assert echoed_message(summary, messages, serialized) == echoed_message(
                summary, messages
            )
