"""Sessions in memory: each session's fold, kept in step with its durable log.

A ``SessionManager`` restores a session from the store on first use (appending
``session/end-seed``: a new lifecycle begins, so brackets left open by a dead process become
stale evidence), then keeps its ``SessionFold`` current as batches commit. Appends to one session
are serialized by its lock; the store shares commits across sessions (group commit).

Cost follows the work (issue 11):

- A large batch is background work. It is checked and admitted on the loop in steps of at most
  ``STEP_S``, and after each step it waits while other callbacks are ready, within bounds
  (``in_steps``): a call next door takes several loop turns, and none of them waits behind a
  step. Once committed, it is freed in steps too. Readers that do
  not take the lock see only committed state. Its texts are counted in a worker thread from the
  end of its checks (``add_precounter``; the tokenizers release the GIL) and its prices made from
  those counts, in steps on the loop, while the store commits it (``add_preparer``); the commit
  observers then run with those prices, still under the session's lock, before the append
  answers: a read after the commit sees its prices. Python work stays off worker threads: a
  thread running Python takes the GIL from the loop every switch interval.
- Every ``snapshot_interval`` events (more on a long log: ``snapshot_due``) a fold snapshot
  (``core.snapshot``: the state, the surface as seqs, the meter's node prices) is made in steps
  on the loop and written in one store transaction. A restore reads the latest
  snapshot, the events it names and the log after it, and folds them in worker threads; without a
  usable snapshot it replays the log, also off the loop.
- At most ``max_resident`` sessions stay in memory: the least recently used idle one (its lock
  free, no stream following it, no bracket open) is snapshotted and dropped, and restored on
  demand. Eviction is not a restart: a session restored after an eviction in the same process
  gets no ``session/end-seed``. A handle someone still holds stays the session's one handle (a
  weak reference finds it), so no session ever has two folds.

On a store several replicas share (PostgreSQL), the fold is a cache of the log that other
replicas also append to: ``service.replicas`` keeps it current (catch-up under the lock, appends
retried on a stale fold, bracket leases, change notifications), and a restore appends
``session/end-seed`` only when the process that owned a live bracket died (its lease expired).
Tenancy lives here, as a key: a session is (tenant, id), the tenant being the caller's
(``compactd.tenancy.current_tenant``) unless one is named. Another tenant's session is simply not
there (NotFound), so nothing past the manager needs to know tenants exist.
"""

from compactd.service.sessions.handle import AppendResult, Key, SessionHandle
from compactd.service.sessions.manager import Lineage, SessionManager
from compactd.service.sessions.residency import Residency, snapshot_due
from compactd.service.sessions.restore import ContextBuilder, Restored, metered_context

__all__ = [
    "AppendResult",
    "ContextBuilder",
    "Key",
    "Lineage",
    "Residency",
    "Restored",
    "SessionHandle",
    "SessionManager",
    "metered_context",
    "snapshot_due",
]
