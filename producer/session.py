"""A producer's side of the protocol as pure decisions: no socket, no clock, no files.

The worker (``producer/worker.py``) feeds it decoded consumer messages and the time (``now_s``,
monotonic seconds) and does what it answers: the messages to send, the next lease to build (with
the data path chosen: the consumer's slot file or payload frames), whether to exit and with which code.
State: DISCONNECTED --HELLO/WELCOME--> ACTIVE. Leaving ACTIVE drops every pending lease (the consumer
reissues them): the consumer silent for ``liveness_s``, a WELCOME/LEASE/HB of another epoch, or
``ERR UNKNOWN_PEER``. While DISCONNECTED, HELLO repeats with doubling back-off up to ``backoff_max_s``;
a consumer message that sends us back (``UNKNOWN_PEER``, a new epoch) makes the next HELLO go at once;
any other reply keeps the back-off (no ERR ping-pong). ``ERR PROTO``/``ERR CONTRACT`` cannot be fixed by
retrying: exit 78.
Learned rows (``buckets.batch_size: auto`` without ``buckets.rows``): HELLO sends each bucket's row count as
``LEARN_ROWS`` and the WELCOME of a new epoch must carry one row count per bucket, each at most ``max_rows``
(``buckets.max_batch_size``); those are ``rows`` until we leave that epoch, and the next epoch's WELCOME sets them
anew (a restarted consumer may have measured others). A WELCOME without them, or with rows of another length or
above ``max_rows``, is a consumer this producer cannot build for: exit 78, nothing joined.
Learned plan (``buckets.cost: measured``): HELLO has no buckets, and the WELCOME of a new epoch must carry the weights
(``costs``) and the consumer's shapes (``buckets``, rows included); the injected planner
(``producer/learned_plan.py``) plans ours with those weights, and only shapes equal to the consumer's are adopted
(``buckets``) until we leave that epoch; the next epoch's WELCOME plans anew (a restarted consumer may have measured
other weights). A WELCOME without them, or whose shapes are not the ones we plan with its weights, is refused: exit 78
with one line naming both, nothing joined.
Join nonce: every HELLO of one join carries the same random nonce, and leaving ACTIVE (dropping the
leases) draws a new one. So a HELLO repeated before the consumer's WELCOME arrived (a loaded machine)
is answered again with our leases kept, while a join after we dropped ours makes the consumer return
them at once. A WELCOME echoing an earlier nonce answers an abandoned join and is ignored; one echoing
ours for the epoch already joined is that repeat's answer and changes nothing.
The consumer's plan ended (its HB says ``done``): drop the leases, and either leave with BYE and exit 0
(``exit_at_plan_end``, set by ``run``) or say BYE and wait for the next consumer (systemd, by hand);
that consumer's epoch is never joined again (its WELCOME is answered with BYE, the back-off goes on).
Invariants: only leases of the joined epoch are ever built (docs/design.md, invariant 2), the
pending queue never holds a batch id twice, and every timer is a due time compared with ``now_s``
(invariant 6: the worker's waits are bounded by ``poll_timeout_s``).
Shutdown: ``fail`` records why the process is about to exit non-zero; ``farewell`` is the BYE to send
before closing (carrying that code and reason) or ``None`` when no consumer knows us.
"""

from __future__ import annotations

import errno
import logging
import reprlib
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from melfeed.shared.errors import EXIT_CONFIG, ConfigError
from melfeed.shared.printable import escape_line
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    FATAL_REJECTS,
    LEARN_ROWS,
    PROTOCOL_VERSION,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    Message,
    RejectCode,
    StageCounters,
    Welcome,
)

__all__ = ["ProducerSessionConfig", "BuildOrder", "Planner", "ProducerSession", "failure_reason", "random_nonce"]

log = logging.getLogger(__name__)

_WAITING_WARN_S = 10.0  # warn when no consumer answered for this long (silent connect failures)
_FIRST_BACKOFF_S = 0.1
_MIN_POLL_S = 0.001  # the worker's poll granularity (ZeroMQ polls in whole milliseconds)
_MAX_MISSING_FILES = 3  # more consecutive missing slot files: shm_dir is not visible here, use payload frames
_SHAPES = reprlib.Repr()  # a refused plan's shapes on one bounded line (a WELCOME may list many)
_SHAPES.maxlist, _SHAPES.maxlevel = 16, 3

# Our shapes planned with a WELCOME's (token_cost, attention_cost) and its row counts (``CostPlanner``).
Planner = Callable[[tuple[float, float], list[int]], tuple[Bucket, ...]]


@dataclass(frozen=True, slots=True)
class ProducerSessionConfig:
    """Who this producer is, the data contract it announces in HELLO, and its protocol timing."""

    producer_id: str  # stable name (``producer-3``)
    endpoint: str  # the consumer's, for log lines only: the session never connects
    fingerprint: str  # the manifest's
    buckets: list[list[int]]  # ``BucketSet.as_wire()``; [] = learn the consumer's plan (``learns_plan``)
    n_mels: int
    seed: int
    heartbeat_interval_s: float  # our HB period while ACTIVE
    liveness_s: float  # consumer silent this long: it is gone, re-join
    backoff_max_s: float  # longest pause between two HELLOs
    exit_at_plan_end: bool = False  # the consumer's plan ended: exit 0 (``run``) instead of waiting for the next
    mel_dtype: str = "float32"  # ``transport.mel_dtype``, announced in HELLO (the consumer's must match)
    max_rows: int = 256  # ``buckets.max_batch_size``: the most rows a learned bucket may have

    @property
    def learns_rows(self) -> bool:
        """HELLO asks the consumer for its rows (a bucket's B is ``LEARN_ROWS``): they come with the WELCOME."""
        return any(len(b) >= 2 and b[1] == LEARN_ROWS for b in self.buckets)

    @property
    def learns_plan(self) -> bool:
        """No shapes (``buckets.cost: measured``): HELLO asks for the consumer's plan; it comes with the WELCOME."""
        return not self.buckets


@dataclass(frozen=True, slots=True)
class BuildOrder:
    """One lease to build now: into the slot file ``shm_dir/lease.shm.name`` or a send buffer."""

    epoch: int
    lease: Lease
    checksum: bool  # the WELCOME asked for a CRC32 of the payload
    shm_dir: str | None = None  # set: build in the consumer's slot file, send the header alone


def random_nonce() -> int:
    """A join nonce: 64 random bits (msgpack's largest unsigned integer)."""
    return secrets.randbits(64)


def failure_reason(err: BaseException) -> str:
    """``"<ExceptionType>: <message>"`` on one line: the BYE's reason (a CacheError names its file)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass(slots=True)
class _Joining:
    """HELLO timing while DISCONNECTED."""

    backoff_s: float = _FIRST_BACKOFF_S
    next_hello_s: float = 0.0
    since_s: float = 0.0  # waiting for a consumer since
    warned: bool = False


@dataclass(slots=True)
class _Counts:
    rejoins: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # ERR codes received


class ProducerSession:
    """The producer's protocol state; every method takes the time instead of reading a clock.

    Args:
        cfg: name, contract and timing.
        now_s: the time the session starts (the first HELLO is due at once).
        offers_shm: HELLO offers ``CAP_SHM`` (the worker can map the consumer's slot files).
        new_nonce: draws a join nonce (tests inject a counter).
        planner: plans our shapes with a WELCOME's weights; required when ``cfg.learns_plan``.

    Raises:
        ValueError: ``cfg.learns_plan`` without a planner.
    """

    def __init__(
        self,
        cfg: ProducerSessionConfig,
        now_s: float,
        *,
        offers_shm: bool = False,
        new_nonce: Callable[[], int] = random_nonce,
        planner: Planner | None = None,
    ) -> None:
        if cfg.learns_plan and planner is None:
            raise ValueError("a session that learns its plan needs a planner")
        self.cfg = cfg
        self._planner = planner
        self._plan: tuple[Bucket, ...] | None = None  # adopted from the joined epoch's WELCOME (``learns_plan``)
        self.exit_code = 0  # non-zero: leave the loop and exit with it
        self.reason = ""  # one line, why ``exit_code`` is not 0 (for the BYE)
        self.finished = False  # the plan ended under ``exit_at_plan_end``: leave the loop, exit 0
        self.counts = _Counts()
        self._offers_shm = offers_shm
        self._epoch: int | None = None
        self._checksum = False
        self._shm_dir: str | None = None  # from WELCOME: shm leases name files here
        self._rows: list[int] | None = None  # learned from the joined epoch's WELCOME (``learns_rows``)
        self._leases: deque[tuple[Lease, float]] = deque()  # (lease, expiry on our clock)
        self._last_heard_s = now_s
        self._next_hb_s = 0.0
        self._missing_files = 0  # consecutive slot files not found
        self._joining = _Joining(next_hello_s=now_s, since_s=now_s)
        self._ended_epoch: int | None = None  # a consumer whose plan ended: never joined again
        self._outbox: list[Message] = []  # replies decided in ``on_message``, sent by the next ``on_turn``
        self._new_nonce = new_nonce
        self._nonce = new_nonce()  # this join's, in every HELLO until we drop our leases

    @property
    def joined_epoch(self) -> int | None:
        """The consumer epoch we joined, or ``None`` while DISCONNECTED."""
        return self._epoch

    @property
    def rows(self) -> list[int] | None:
        """Each bucket's rows as the joined consumer gave them (``learns_rows``); ``None`` otherwise, or while
        DISCONNECTED. Every ``BuildOrder`` handed out is built with these."""
        return self._rows if self._epoch is not None else None

    @property
    def buckets(self) -> tuple[Bucket, ...] | None:
        """The shapes (rows included) learned from the joined consumer (``learns_plan``); ``None`` otherwise, or while
        DISCONNECTED. Every ``BuildOrder`` handed out is built with these."""
        return self._plan if self._epoch is not None else None

    @property
    def offers_shm(self) -> bool:
        """False once a slot file could not be mapped: payload frames for the rest of the process."""
        return self._offers_shm

    @property
    def pending_leases(self) -> int:
        return len(self._leases)

    def hello(self) -> Hello:
        caps = [CAP_SHM] if self._offers_shm else []
        c = self.cfg
        return Hello(
            PROTOCOL_VERSION, c.producer_id, c.fingerprint, c.buckets, c.n_mels, c.seed, self._nonce, caps, c.mel_dtype
        )

    def on_turn(self, now_s: float) -> list[Message]:
        """Replies owed, then timers at the top of a loop turn: drop a silent consumer; HELLO when one is due."""
        out, self._outbox = self._outbox, []
        if self._epoch is not None:
            if now_s - self._last_heard_s <= self.cfg.liveness_s:
                return out
            log.warning(
                "consumer silent for %.1f s; dropping %d leases and re-joining",
                now_s - self._last_heard_s,
                len(self._leases),
            )
            self._leave(now_s)
        j = self._joining
        if now_s >= j.next_hello_s:
            out.append(self.hello())
            j.next_hello_s = now_s + j.backoff_s
            j.backoff_s = min(j.backoff_s * 2, self.cfg.backoff_max_s)
        if not j.warned and now_s - j.since_s > _WAITING_WARN_S:
            log.warning("no consumer answered at %s for %.0f s; still waiting", self.cfg.endpoint, now_s - j.since_s)
            j.warned = True
        return out

    def hello_soon(self, now_s: float) -> None:
        """HELLO again soon, from the shortest back-off: the worker just connected its socket (the HELLO sent
        with the connect may find no pipe yet), or is still waiting for a socket file it can trust (so that a
        consumer binding later is joined within ``_FIRST_BACKOFF_S``, not after a grown back-off)."""
        self._joining.backoff_s = _FIRST_BACKOFF_S * 2
        self._joining.next_hello_s = now_s + _FIRST_BACKOFF_S

    def poll_timeout_s(self, now_s: float) -> float:
        """How long the worker may wait for input before the next timer is due (0 with work pending)."""
        if self._epoch is not None:
            if self._leases:
                return 0.0
            due_s = min(self._next_hb_s, self._last_heard_s + self.cfg.liveness_s)
        else:
            due_s = self._joining.next_hello_s
        return max(_MIN_POLL_S, min(self.cfg.heartbeat_interval_s, due_s - now_s))

    def on_message(self, msg: Message, now_s: float) -> None:
        """Take one decoded consumer message (WELCOME, LEASE, HB, ERR; others are ignored)."""
        if isinstance(msg, Welcome):
            self._on_welcome(msg, now_s)
        elif isinstance(msg, LeaseGrant | Heartbeat):
            if msg.epoch != self._epoch:
                if self._epoch is not None:
                    log.warning("consumer epoch changed (%s -> %d); re-joining", self._epoch, msg.epoch)
                    self._leave(now_s)
            else:
                self._last_heard_s = now_s
                if isinstance(msg, LeaseGrant):
                    self._take_leases(msg.leases, now_s)
                elif msg.done:
                    self._on_plan_end(msg.epoch, now_s)
        elif isinstance(msg, Err):
            self._on_err(msg, now_s)

    def _take_leases(self, leases: list[Lease], now_s: float) -> None:
        held = {x.batch_id for x, _ in self._leases}
        for x in leases:
            if x.batch_id not in held:  # a batch id already pending (or repeated in this grant) once
                held.add(x.batch_id)
                self._leases.append((x, now_s + x.deadline_s))

    def _on_plan_end(self, epoch: int, now_s: float) -> None:
        """The joined consumer's plan is finished: build nothing more; exit 0, or wait for the next consumer."""
        self._ended_epoch = epoch
        self._leases.clear()
        if self.cfg.exit_at_plan_end:  # ``farewell`` says BYE (exit 0) once the loop has ended
            log.info("consumer epoch=%d finished its plan; exiting (producer.exit_at_plan_end)", epoch)
            self.finished = True
            return
        log.info("consumer epoch=%d finished its plan; waiting for the next consumer", epoch)
        self._outbox.append(Bye(epoch))
        self._epoch, self._nonce = None, self._new_nonce()
        self._joining = _Joining(next_hello_s=now_s + _FIRST_BACKOFF_S, since_s=now_s)

    def _on_welcome(self, msg: Welcome, now_s: float) -> None:
        if msg.nonce != self._nonce:
            log.debug("WELCOME epoch=%d answers a join we gave up; ignored", msg.epoch)
            return
        if msg.epoch == self._epoch:
            self._last_heard_s = now_s  # the answer to a HELLO we repeated: our leases stand
            return
        if msg.epoch == self._ended_epoch:  # the finished consumer answered a HELLO: leave it at once
            self._outbox.append(Bye(msg.epoch))
            self._joining.since_s = now_s  # it answered: not a silent endpoint
            return
        if self.cfg.learns_plan and not self._take_plan(msg):
            return
        if self.cfg.learns_rows and not self._take_rows(msg):
            return
        if self._epoch is not None:
            self.counts.rejoins += 1
        self._epoch, self._checksum = msg.epoch, msg.checksum
        self._shm_dir = msg.shm_dir if self._offers_shm else None  # slot leases without it: we join again
        self._leases.clear()
        self._last_heard_s = now_s
        log.info(
            "joined consumer epoch=%d window=%d transport=%s%s",
            msg.epoch,
            msg.window,
            f"shm ({self._shm_dir})" if self._shm_dir else "zmq",
            f" rows by bucket {self._rows} (the consumer's)" if self.cfg.learns_rows else "",
        )

    def _take_rows(self, msg: Welcome) -> bool:
        """Adopt a new epoch's rows (``learns_rows``); False after refusing a WELCOME whose rows we cannot build."""
        n, cap = len(self.cfg.buckets), self.cfg.max_rows
        if msg.rows is None:
            problem = "carries no rows, and this producer learns them (buckets.batch_size: auto)"
        elif len(msg.rows) != n:
            problem = f"gives rows for {len(msg.rows)} buckets, this producer has {n}"
        elif max(msg.rows) > cap:
            problem = (
                f"gives {max(msg.rows)} rows, above this producer's buckets.max_batch_size {cap} "
                "(set it as the consumer's)"
            )
        else:
            self._rows = list(msg.rows)
            return True
        return self._refuse(msg.epoch, problem)

    def _take_plan(self, msg: Welcome) -> bool:
        """Adopt a new epoch's plan (``learns_plan``) when ours with its weights is its shapes; False after refusing."""
        if msg.costs is None or msg.buckets is None:
            return self._refuse(
                msg.epoch, "carries no plan (costs and buckets), and this producer learns it (buckets.cost: measured)"
            )
        costs = (msg.costs[0], msg.costs[1])
        assert self._planner is not None  # __init__ requires one with learns_plan
        try:
            planned = self._planner(costs, [b[1] for b in msg.buckets])
        except ConfigError as err:
            return self._refuse(
                msg.epoch,
                f"plans with token_cost {costs[0]:g} attention_cost {costs[1]:g}, and this producer cannot: {err}",
            )
        ours = [b.as_wire() for b in planned]
        if ours != msg.buckets:
            return self._refuse(
                msg.epoch,
                f"plans shapes {_SHAPES.repr(msg.buckets)} with token_cost {costs[0]:g} attention_cost {costs[1]:g}; "
                f"this producer plans {_SHAPES.repr(ours)} with them (another cache, version or bucket setting)",
            )
        self._plan = planned
        log.info(
            "plan learned from consumer %d: token_cost %g attention_cost %g, %d shapes",
            msg.epoch,
            costs[0],
            costs[1],
            len(ours),
        )
        return True

    def _refuse(self, epoch: int, problem: str) -> bool:
        """A consumer this producer cannot build for: exit 78, nothing joined. Returns False."""
        log.error("refusing consumer epoch=%d: its WELCOME %s", epoch, problem)
        self.exit_code = EXIT_CONFIG
        self.reason = f"the consumer's WELCOME {problem}"
        return False

    def _on_err(self, msg: Err, now_s: float) -> None:
        self.counts.errors[msg.code] = self.counts.errors.get(msg.code, 0) + 1
        if msg.code == RejectCode.UNKNOWN_PEER:
            log.info("consumer does not know us (%s); re-joining", escape_line(msg.why))
            self._leave(now_s)
        elif msg.code in FATAL_REJECTS:
            log.error("consumer refused this producer: %s: %s", escape_line(msg.code), escape_line(msg.why))
            self.exit_code = EXIT_CONFIG
            self.reason = f"{msg.code}: {msg.why}"
        else:
            log.warning("consumer rejected a message: %s: %s", escape_line(msg.code), escape_line(msg.why))

    def _leave(self, now_s: float) -> None:
        """Back to DISCONNECTED: drop every lease; the next HELLO goes at once."""
        if self._epoch is not None:
            self.counts.rejoins += 1
        self._epoch, self._nonce = None, self._new_nonce()  # the consumer returns the leases we dropped
        self._leases.clear()
        self._joining = _Joining(next_hello_s=now_s, since_s=now_s)

    def next_build(self, now_s: float) -> BuildOrder | None:
        """Pop the oldest pending lease: what to build, or ``None`` (nothing due, expired, or unusable)."""
        if self._epoch is None or not self._leases or self.exit_code != 0 or self.finished:
            return None
        lease, expiry_s = self._leases.popleft()
        if now_s > expiry_s:
            log.info("lease for batch %d expired before it was built; skipping", lease.batch_id)
            return None
        if lease.shm is None:
            return BuildOrder(self._epoch, lease, self._checksum)
        if self._shm_dir is None:
            log.warning(
                "lease for batch %d names a slot file, but shared memory was not agreed; joining again", lease.batch_id
            )
            self._leave(now_s)
            return None
        return BuildOrder(self._epoch, lease, self._checksum, self._shm_dir)

    def on_slot_mapped(self) -> None:
        self._missing_files = 0

    def on_slot_error(self, order: BuildOrder, err_no: int | None, detail: str, now_s: float) -> bool:
        """The order's slot file could not be mapped. Returns True when shared memory is given up for good.

        A missing file is a slot retired while the lease was in flight (a re-handshake race): the consumer
        has already re-leased it, so skip it. Only repeated misses, or any other error, mean we cannot
        use ``shm_dir``: stop offering ``CAP_SHM`` and join again (the consumer returns our leases at once).
        """
        assert order.lease.shm is not None and order.shm_dir is not None  # only shm orders are mapped
        if err_no == errno.ENOENT and self._missing_files < _MAX_MISSING_FILES:
            self._missing_files += 1
            log.info("slot file %s is gone (retired); skipping batch %d", order.lease.shm.name, order.lease.batch_id)
            return False
        log.warning(
            "cannot map slot file %s (errno %s: %s); using ZeroMQ payload frames from now on",
            f"{order.shm_dir}/{order.lease.shm.name}",
            err_no,
            detail,
        )
        self._offers_shm = False
        self._leave(now_s)
        return True

    def heartbeat(self, now_s: float, stats: StageCounters) -> Heartbeat | None:
        """The HB to send at the end of an ACTIVE turn, when one is due."""
        if self._epoch is None or now_s < self._next_hb_s or self.exit_code != 0 or self.finished:
            return None
        self._next_hb_s = now_s + self.cfg.heartbeat_interval_s
        return Heartbeat(self._epoch, stats=stats)

    def fail(self, exit_code: int, err: BaseException) -> None:
        """This process is about to exit ``exit_code`` because of ``err``: remember why for the BYE."""
        self.exit_code = exit_code
        self.reason = failure_reason(err)

    def farewell(self) -> Bye | None:
        """The BYE to send before closing (``None`` when no consumer knows us): its leases go back at once,
        and a non-zero ``exit_code`` tells the consumer why we are leaving."""
        if self._epoch is None:
            return None
        if self.exit_code == 0:
            return Bye(self._epoch)
        return Bye(self._epoch, self.exit_code, self.reason)
