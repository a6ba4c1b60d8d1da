"""Which leased ring slots a producer builds in place (shared-memory path), and their fencing.

Pure bookkeeping over a ``SlotFiles`` (the ring's slot files, ``melfeed.consumer.transport.shm_slots.ShmSlots``
in production, a fake in tests): no sockets, no clocks. The receiver session owns one instance.
Invariants (docs/design.md, invariants 2 and 3):
  * a slot is in the table exactly while it is LEASED to a producer that builds in it, mapped to the
    generation its lease named;
  * an shm lease takes a batch only from its own producer, naming that slot and generation
    (``check_claim``), so another producer's late copy never touches a file its holder may be writing;
  * a slot cancelled without an accepted batch (peer lost, deadline, revoke, requeue) is retired --
    its file orphaned, a new generation mapped -- so a zombie writes only into orphaned memory and
    its late BATCH names a generation that no lease holds any more.
Shutdown: nothing to release; the slot files belong to their ``SlotFiles`` owner.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from melfeed.consumer.flow.credit import ActiveLease
from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import BatchHeader, RejectCode, ShmSlot

__all__ = ["ShmLeases", "SlotFiles"]

log = logging.getLogger(__name__)


class SlotFiles(Protocol):
    """The ring's slot files as the lease bookkeeping sees them."""

    @property
    def directory(self) -> Path: ...

    @property
    def retired(self) -> int: ...

    def name(self, slot: int) -> str: ...

    def generation(self, slot: int) -> int: ...

    def is_shared(self, slot: int) -> bool: ...

    def retire(self, slot: int) -> None: ...


class ShmLeases:
    """Shared-memory leases: slot -> generation named in the lease, and the fencing decisions.

    Args:
        files: the ring's slot files, or ``None`` when the shared-memory path is off (every
            lease is then a payload lease and nothing here ever holds a slot).
    """

    def __init__(self, files: SlotFiles | None) -> None:
        self._files = files
        self._leased: dict[int, int] = {}  # LEASED shm slot -> generation named in its lease

    @property
    def is_enabled(self) -> bool:
        return self._files is not None

    @property
    def directory(self) -> str | None:
        """What a WELCOME names as ``shm_dir`` for a producer that builds in place."""
        return str(self._files.directory) if self._files is not None else None

    @property
    def retired(self) -> int:
        """Slot files orphaned so far because their lease was cancelled."""
        return self._files.retired if self._files is not None else 0

    def slot_for(self, lease: ActiveLease, uses_shm: bool) -> ShmSlot | None:
        """Claim the slot file a new lease names, or ``None`` for a payload lease."""
        files = self._files
        if files is None or not uses_shm or not files.is_shared(lease.slot):
            return None
        gen = files.generation(lease.slot)
        self._leased[lease.slot] = gen
        return ShmSlot(files.name(lease.slot), lease.slot, gen)

    def is_in_place(self, slot: int) -> bool:
        """True when the producer builds this LEASED slot itself (its BATCH is the header alone)."""
        return slot in self._leased

    def check_claim(self, ident: bytes, hdr: BatchHeader, active: ActiveLease | None) -> None:
        """An shm lease takes a batch only from its own producer, naming its slot and generation.

        Called before the lease book's ``accept``: another producer's late copy (payload or
        header-only) must never be written into or read from a slot file the lease holder may be
        writing right now. ``active`` is the open lease of ``hdr.batch_id`` (``None``: DUP or
        NOT_LEASED, decided by ``accept``; no slot is touched).

        Raises:
            ProtocolError: LEASE when the claim does not match the lease.
        """
        if active is None:
            return
        gen = self._leased.get(active.slot)
        if gen is None and hdr.shm is None:
            return  # payload lease, payload header
        if gen is None or active.peer != ident or (hdr.shm is not None and hdr.shm != (active.slot, gen)):
            raise ProtocolError(
                RejectCode.LEASE, f"batch {hdr.batch_id}: slot/generation {hdr.shm} is not this producer's lease"
            )

    def settle(self, slot: int) -> None:
        """The slot's batch was accepted: it is no longer a LEASED shm slot."""
        self._leased.pop(slot, None)

    def cancel(self, lease: ActiveLease) -> bool:
        """A lease ends unfilled: retire its slot file if it was an shm lease. True when retired."""
        if self._leased.pop(lease.slot, None) is None or self._files is None:
            return False
        self._files.retire(lease.slot)
        log.debug(
            "retired shm slot %d (batch %d not delivered); generation %d",
            lease.slot,
            lease.batch_id,
            self._files.generation(lease.slot),
        )
        return True
