"""Log filters for third-party noise on calls that ended on the client's side."""

from __future__ import annotations

import logging

import pytest

from compactd import telemetry


def test_grpc_s_error_for_a_send_the_client_abandoned_becomes_one_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry.quiet_cancelled_stream_detach()
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.DEBUG, logger="grpc._cython.cygrpc"):
        try:
            raise RuntimeError("execute_batch failed")
        except RuntimeError:
            grpc_log.exception(
                "ExecuteBatchError raised in core by servicer method [%s]",
                "/compactd.v1.SessionService/ListEvents",
            )
            grpc_log.exception("Unexpected [%s] raised by servicer method", "KeyError")
    abandoned, other = caplog.records
    assert (abandoned.levelno, abandoned.exc_info) == (logging.DEBUG, None)
    assert "/compactd.v1.SessionService/ListEvents" in abandoned.getMessage()
    assert other.levelno == logging.ERROR  # other errors stay errors
    assert other.exc_info is not None
