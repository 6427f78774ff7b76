"""``compactd.v1.CompactionService``: pressure reports and compaction."""

from __future__ import annotations

from compactd.api.status import unimplemented
from compactd.v1 import compaction_service_pb2_grpc


class CompactionServicer(compaction_service_pb2_grpc.CompactionServiceServicer):
    """Adapter from the wire to the pressure and compaction services."""

    CheckPressure = unimplemented("CheckPressure")
    WatchPressure = unimplemented("WatchPressure")
    PrepareStep = unimplemented("PrepareStep")
    Compact = unimplemented("Compact")
    RecoverFromError = unimplemented("RecoverFromError")
    SwitchModel = unimplemented("SwitchModel")
