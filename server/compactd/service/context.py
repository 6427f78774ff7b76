"""A session's service state, typed and built once: its meter, its policy, its memory.

Every resident session (``SessionHandle``) holds one ``SessionContext``, built when the session
is restored (``SessionManager`` calls its ``sessions.ContextBuilder``) and never replaced while
the session stays in memory:

- ``meter``: the session's ``SessionMeter``. It starts from the node prices a snapshot kept, and
  follows every commit (an observer that also follows a restore's tail); the builder that the
  pressure service installs also prices large batches ahead of their commit and feeds the
  service's usage calibration.
- ``policy``: the session's policy resolved over the service's, kept until either changes.
- ``memory``: what the session's compactions learned in this process (``SessionMemory``: the
  failure memory of ``core.attempts``, the targets already warned about). It
  outlives an eviction (the manager hands it to the next context of the session) but not a
  restart; the log keeps every failed bracket for audit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compactd.core.attempts import AttemptLedger
from compactd.core.meter import SessionMeter
from compactd.core.policy import PressurePolicy


@dataclass(eq=False)
class SessionMemory:
    """What a session's compactions learned in this process (kept across an eviction)."""

    #: Failed spans per summary target.
    failures: AttemptLedger = field(default_factory=AttemptLedger)
    #: Targets whose pressure could not be checked, already warned about once.
    warned_targets: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A session's overrides resolved over a service policy (valid while both are the same)."""

    overrides: dict[str, object]
    service: PressurePolicy
    policy: PressurePolicy


@dataclass(eq=False)
class SessionContext:
    """One resident session's service state (see the module docstring)."""

    meter: SessionMeter
    memory: SessionMemory = field(default_factory=SessionMemory)
    policy: ResolvedPolicy | None = None
