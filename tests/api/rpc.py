"""Test helpers for reading gRPC errors the way a client would."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass
class ErrorDetails:
    """A failed call's code, message, ErrorInfo reason/metadata, BadRequest fields, the
    QuotaFailure violations (quota ids) and the RetryInfo delay in seconds (None: none sent)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    fields: list[str] = field(default_factory=list)
    quotas: list[str] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    retry_delay: float | None = None


def details(error: grpc.aio.AioRpcError) -> ErrorDetails:
    """Decode ``google.rpc.Status`` details from a failed call."""
    out = ErrorDetails(error.code(), error.details() or "")
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return out
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out.reason, out.metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.fields = [v.field for v in bad.field_violations]
        elif detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            failure = error_details_pb2.QuotaFailure()
            detail.Unpack(failure)
            out.quotas = [v.quota_id for v in failure.violations]
            out.subjects = [v.subject for v in failure.violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            out.retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
    return out
