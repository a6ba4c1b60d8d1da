"""Pipeline configuration: frozen dataclasses, one per section, validated at construction.

Role: what every setting means, its unit, its default and its valid range. Reading a YAML file,
turning a mapping into a config and back, and dotted CLI overrides live in
``shared/config/loader.py``.
Invariant: every ``PipelineConfig`` that exists is valid; a bad value raises ``ConfigError``
naming the key path and the value (``buckets.batch_size: must be >= 1, got 0``).
Environment lookups happen only in ``resolve_runtime_dir`` (called from the CLI layer).
Shutdown: nothing to release; configs are immutable values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from melfeed.shared.config.checks import (
    check_boundaries,
    check_cost_setting,
    check_distinct_binds,
    check_endpoint,
    check_int32,
    check_not_abstract,
    check_planner_settings,
    check_rows_settings,
    check_seed,
    check_transport_mode,
    plain_params,
    resolve_checksum,
)
from melfeed.shared.config.checks import require as _check
from melfeed.shared.config.features import FeatureConfig
from melfeed.shared.gpu_select import check_gpu_list
from melfeed.shared.wire.layout import MEL_WIRE_DTYPES

__all__ = [
    "BucketConfig",
    "TransportConfig",
    "check_transport_mode",
    "resolve_checksum",
    "ConsumerConfig",
    "ProducerConfig",
    "ModelConfig",
    "FeatureConfig",
    "PipelineConfig",
    "resolve_runtime_dir",
]


def _is_loopback_tcp(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return endpoint.startswith("tcp://") and host in ("127.0.0.1", "localhost", "[::1]")


RowsSetting = Literal["auto"] | int  # BucketConfig.batch_size; the loader passes it through unchanged


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """How utterances are grouped into a few fixed batch shapes."""

    boundaries: tuple[int, ...] | None = None  # upper frame bound per bucket (1-D); None = derive from lengths
    num_buckets: int | None = None  # set: that many 1-D buckets over frames; None: 2-D within max_shapes
    max_shapes: int = 8  # 2-D shape budget; each shape is one compiled program (1..16)
    # 2-D row cost in frames: T + token_cost * L + attention_cost * T * L (shared/wire/grid.py, 0.001 steps)
    token_cost: float = 1.0  # 1.0 = a padded token costs a padded frame; 0 = frames alone
    attention_cost: float = 0.0  # > 0 favours shapes of small T x L (attention-heavy models)
    # "formula" = token_cost and attention_cost as set; "measured" = the built-in consumer fits both to its
    # compiled step's time at start (docs/guide/batches.md "Measured costs"; 2-D plans only) and a producer
    # learns them from each consumer it joins
    cost: str = "formula"
    # 2-D: the fewest shapes within this share of the least padded cost (each shape is a compile); 0 = the least cost
    # within max_shapes
    cost_tolerance: float = 0.01
    max_frames_per_token: float | None = None  # outside these: left out, listed in STATE_DIR/outliers.tsv
    min_frames_per_token: float | None = None  # None = no limit
    # rows per batch in every bucket; None = use frame_budget; "auto" = the built-in consumer measures each
    # bucket's rows on its compiled step at start (docs/guide/batches.md "Rows per bucket") and a producer
    # without `rows` learns them from each consumer it joins
    batch_size: RowsSetting | None = 32
    frame_budget: int | None = None  # rows = frame_budget // bucket frames (constant tokens/step)
    max_frames: int | None = None  # longest frames kept; None = longest utterance (rounded up)
    max_tokens: int | None = None  # longest token sequence kept; None = longest in the bucket
    overlong: str = "truncate"  # "truncate" or "drop" utterances longer than max_frames
    frame_multiple: int = 8  # bucket frame sizes are multiples of this (XLA-friendly)
    max_batch_size: int = 256  # "auto": most rows tried per bucket, and most a producer accepts from a consumer
    rows: tuple[int, ...] | None = None  # rows of each bucket (index order), over batch_size; "auto" sets it
    # A bucket's last batch of an epoch: "pad" = run it with mel_len 0 padding rows (the step gets
    # rows / row_mask), "drop" = leave it out of the plan (its samples skip that epoch; counted).
    partial: str = "pad"

    def __post_init__(self) -> None:
        p = ("buckets",)
        if self.num_buckets is not None:
            _check(1 <= self.num_buckets <= 16, "must be in 1..16", p + ("num_buckets",), self.num_buckets)
        _check(1 <= self.max_shapes <= 16, "must be in 1..16", p + ("max_shapes",), self.max_shapes)
        check_planner_settings(
            self.token_cost,
            self.attention_cost,
            self.min_frames_per_token,
            self.max_frames_per_token,
            self.cost_tolerance,
        )
        _check(
            (self.batch_size is None) != (self.frame_budget is None),
            "set exactly one of batch_size and frame_budget",
            p + ("batch_size",),
            self.batch_size,
        )
        check_rows_settings(self.batch_size, self.rows, self.max_batch_size)
        check_cost_setting(self.cost, self.num_buckets, self.boundaries)
        if self.frame_budget is not None:
            _check(self.frame_budget >= 1, "must be >= 1", p + ("frame_budget",), self.frame_budget)
        check_boundaries(self.boundaries)
        for name in ("max_frames", "max_tokens"):
            v = getattr(self, name)
            if v is not None:
                _check(v >= 1, "must be >= 1", p + (name,), v)
        for name in ("frame_budget", "max_frames", "max_tokens"):
            check_int32(getattr(self, name), p + (name,))
        _check(self.overlong in ("truncate", "drop"), "must be 'truncate' or 'drop'", p + ("overlong",), self.overlong)
        _check(self.frame_multiple >= 1, "must be >= 1", p + ("frame_multiple",), self.frame_multiple)
        _check(self.partial in ("pad", "drop"), "must be 'pad' or 'drop'", p + ("partial",), self.partial)


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """ZeroMQ endpoint, handshake and liveness settings shared by both sides."""

    endpoint: str | None = None  # None = ipc://<runtime_dir>/melfeed.sock
    heartbeat_interval_s: float = 0.5  # both directions
    liveness_intervals: int = 6  # peer declared dead after this many silent intervals
    lease_window: int = 2  # leases one producer may hold at once
    lease_timeout_s: float = 30.0  # a lease not delivered by then goes back to the queue
    lease_expiry_limit: int = 3  # a producer letting this many leases in a row expire is benched ...
    lease_backoff_s: float = 60.0  # ... and gets no leases for this long (a delivery resets the count)
    checksum: bool | None = None  # crc32 on payloads; None = only for tcp without CURVE (resolve_checksum)
    connect_backoff_max_s: float = 5.0  # producer re-HELLO back-off ceiling while no consumer answers
    # Descriptor bound of the consumer's endpoint (docs/security.md "Hostile peers"): connections beyond
    # max_connections are cut as they are accepted; one that has not finished its ZeroMQ/CURVE
    # handshake after handshake_timeout_s is dropped by libzmq (ZMQ_HANDSHAKE_IVL).
    max_connections: int = 64  # open connections to transport.endpoint (producers + spare)
    handshake_timeout_s: float = 10.0  # a loaded host finishes a CURVE handshake in milliseconds
    # CURVE (required for every tcp://, loopback included, unless insecure; files from `melfeed keys`)
    curve_secret_key: str | None = None  # this side's NAME.key_secret (consumer: consumer.key_secret)
    curve_server_key: str | None = None  # producers: the consumer's public consumer.key
    curve_allowed_dir: str | None = None  # consumer: directory of allowed producers' public NAME.key files
    insecure: bool = False  # true = tcp:// (loopback too) without CURVE: any local user may connect
    # Same-host shared memory: producers write straight into the consumer's ring slots (1 copy).
    mode: str = "auto"  # "auto" = shm for ipc://, zmq for tcp://; "shm"; "zmq" = payload frames
    # slot files' directory; None = the ipc socket's directory if it is on tmpfs, else /dev/shm
    shm_dir: str | None = None
    # The mel's dtype on the wire and in the slots: "float16" halves the bytes of every path (a float32
    # cache is cast by the producer; a value beyond float16's range is refused). Both sides must agree
    # (HELLO); the step gets mel in this dtype and casts (StepSpec.mel_dtype; consumer/README.md).
    mel_dtype: str = "float32"  # "float32" | "float16"

    def __post_init__(self) -> None:
        p = ("transport",)
        if self.endpoint is not None:
            _check(
                self.endpoint.startswith(("ipc://", "tcp://")),
                "must start with ipc:// or tcp://",
                p + ("endpoint",),
                self.endpoint,
            )
            check_endpoint(self.endpoint, p + ("endpoint",))
        _check(self.heartbeat_interval_s > 0, "must be > 0", p + ("heartbeat_interval_s",), self.heartbeat_interval_s)
        _check(self.liveness_intervals >= 2, "must be >= 2", p + ("liveness_intervals",), self.liveness_intervals)
        _check(1 <= self.lease_window <= 64, "must be in 1..64", p + ("lease_window",), self.lease_window)
        _check(self.lease_timeout_s > 0, "must be > 0", p + ("lease_timeout_s",), self.lease_timeout_s)
        _check(self.lease_expiry_limit >= 1, "must be >= 1", p + ("lease_expiry_limit",), self.lease_expiry_limit)
        _check(self.lease_backoff_s >= 0, "must be >= 0", p + ("lease_backoff_s",), self.lease_backoff_s)
        _check(
            self.connect_backoff_max_s > 0, "must be > 0", p + ("connect_backoff_max_s",), self.connect_backoff_max_s
        )
        _check(
            1 <= self.max_connections <= 65536, "must be in 1..65536", p + ("max_connections",), self.max_connections
        )
        _check(
            0 < self.handshake_timeout_s <= 3600,
            "must be in (0, 3600] seconds",
            p + ("handshake_timeout_s",),
            self.handshake_timeout_s,
        )
        _check(self.mode in ("auto", "shm", "zmq"), "must be 'auto', 'shm' or 'zmq'", p + ("mode",), self.mode)
        check_transport_mode(self.mode, self.endpoint)
        _check(self.mel_dtype in MEL_WIRE_DTYPES, "must be 'float32' or 'float16'", p + ("mel_dtype",), self.mel_dtype)
        if self.shm_dir is not None:
            _check(os.path.isabs(self.shm_dir), "must be an absolute path or null", p + ("shm_dir",), self.shm_dir)

    @property
    def liveness_s(self) -> float:
        """Silence after which a peer counts as gone."""
        return self.heartbeat_interval_s * self.liveness_intervals


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """The training side: ring, step loop, reporting."""

    ring_slots: int = 3  # preallocated batch slots; >= 3 (filling, ready, in step)
    # batches in flight between ring and step (staged or stepping): 2 = copy batch n+1 while step n runs; 1 = no
    # overlap; < ring_slots
    stage_depth: int = 2
    # stop once this many batches were applied in total (a resumed run continues to the same end); None = run until
    # stopped
    steps: int | None = 300
    status_interval_s: float = 5.0  # period of the status line
    warmup_steps: int = 5  # excluded from stall % and rates
    # timed steps per bucket on a resident batch after warm-up (the limit of feed efficiency; costs ~(steps + 1) x
    # buckets steps at start); 0 = off (no feed efficiency figure)
    feed_efficiency_steps: int = 10
    # CUDA_VISIBLE_DEVICES for the consumer (indices or UUIDs, applied before TensorFlow is imported); None = inherit
    model_gpu: str | None = None
    gpu_memory_limit_mb: int | None = None  # cap on each visible GPU; None = memory growth
    gpu_memory_fraction: float = 0.9  # buckets.batch_size auto on a GPU: the step's peak stays below this share
    # model replicas (tf.distribute.MirroredStrategy): the first N visible GPUs, or N logical CPU devices without a
    # GPU; None = one per GPU listed in model_gpu ("1,2": 2), else 1
    replicas: int | None = None
    # persistent XLA compilation cache (shareable between state dirs); None = <state_dir>/xla-cache, no cache without
    # a state_dir
    xla_cache_dir: str | None = None
    state_dir: str | None = None  # checkpoints and logs; None = no persistent state
    wait_timeout_s: float = 2.0  # one bounded wait of the step loop for its next batch
    checkpoint_every_steps: int = 200  # with state_dir: checkpoint period (also on stop and at the end)
    keep_checkpoints: int = 2  # complete checkpoints kept in state_dir (>= 1; >= 2 in a multi-worker job)
    peer_timeout_s: float = 30.0  # multi-worker job: a rank silent this long (dead, frozen) ends the others
    collective_timeout_s: float = 600.0  # multi-worker job: longest wait for the other ranks, to join and per step
    metrics_window_s: float = 30.0  # sliding window of the live figures (snapshots, status, Prometheus)
    gpu_sample_interval_s: float = 1.0  # NVML sampling period of the model and data GPUs; 0 = off
    metrics_file: str | None = None  # JSON lines, one snapshot per status interval + a final one; None = off
    metrics_port: int | None = None  # Prometheus HTTP endpoint port; None = off (needs prometheus_client)
    metrics_host: str = "127.0.0.1"  # address the Prometheus endpoint listens on
    control_endpoint: str | None = None  # REP socket serving `status`; None = derived from transport.endpoint
    # TensorBoard scalars of the built-in loop (docs/guide/watching.md): here, DIR/rank-K in a multi-worker
    # job; None = off
    tensorboard_dir: str | None = None
    # None = at each status line; N = every N steps (one more device read of the accumulated outputs per N steps)
    tensorboard_every_steps: int | None = None

    def __post_init__(self) -> None:
        p = ("consumer",)
        _check(3 <= self.ring_slots <= 256, "must be in 3..256", p + ("ring_slots",), self.ring_slots)
        _check(
            1 <= self.stage_depth < self.ring_slots,
            f"must be in 1..{self.ring_slots - 1} (below consumer.ring_slots: producers need a slot to fill)",
            p + ("stage_depth",),
            self.stage_depth,
        )
        if self.steps is not None:
            _check(self.steps >= 1, "must be >= 1 or null", p + ("steps",), self.steps)
        _check(self.status_interval_s > 0, "must be > 0", p + ("status_interval_s",), self.status_interval_s)
        _check(self.warmup_steps >= 0, "must be >= 0", p + ("warmup_steps",), self.warmup_steps)
        _check(
            0 <= self.feed_efficiency_steps <= 10_000,
            "must be in 0..10000 (0 = off)",
            p + ("feed_efficiency_steps",),
            self.feed_efficiency_steps,
        )
        if self.model_gpu is not None:
            _check(
                check_gpu_list(self.model_gpu) is None,
                check_gpu_list(self.model_gpu) or "",
                p + ("model_gpu",),
                self.model_gpu,
            )
        if self.gpu_memory_limit_mb is not None:
            _check(
                self.gpu_memory_limit_mb >= 64,
                "must be >= 64 or null",
                p + ("gpu_memory_limit_mb",),
                self.gpu_memory_limit_mb,
            )
        _check(
            0 < self.gpu_memory_fraction <= 1,
            "must be in (0, 1]",
            p + ("gpu_memory_fraction",),
            self.gpu_memory_fraction,
        )
        if self.replicas is not None:
            _check(1 <= self.replicas <= 64, "must be in 1..64 or null", p + ("replicas",), self.replicas)
            listed = len(self.model_gpu.split(",")) if self.model_gpu else 0
            _check(
                listed in (0, self.replicas),
                f"must equal the {listed} GPUs consumer.model_gpu lists (or leave it null)",
                p + ("replicas",),
                self.replicas,
            )
        if self.xla_cache_dir is not None:
            _check(bool(self.xla_cache_dir), "must be a path or null", p + ("xla_cache_dir",), self.xla_cache_dir)
        _check(self.wait_timeout_s > 0, "must be > 0", p + ("wait_timeout_s",), self.wait_timeout_s)
        _check(
            self.checkpoint_every_steps >= 1,
            "must be >= 1",
            p + ("checkpoint_every_steps",),
            self.checkpoint_every_steps,
        )
        _check(self.keep_checkpoints >= 1, "must be >= 1", p + ("keep_checkpoints",), self.keep_checkpoints)
        _check(
            1 <= self.peer_timeout_s <= 3600, "must be in 1..3600 seconds", p + ("peer_timeout_s",), self.peer_timeout_s
        )
        _check(
            self.peer_timeout_s <= self.collective_timeout_s <= 86400,
            "must be in consumer.peer_timeout_s..86400 seconds",
            p + ("collective_timeout_s",),
            self.collective_timeout_s,
        )
        _check(self.metrics_window_s > 0, "must be > 0", p + ("metrics_window_s",), self.metrics_window_s)
        _check(
            self.gpu_sample_interval_s >= 0,
            "must be >= 0 (0 = off)",
            p + ("gpu_sample_interval_s",),
            self.gpu_sample_interval_s,
        )
        if self.metrics_port is not None:
            _check(
                1 <= self.metrics_port <= 65535, "must be in 1..65535 or null", p + ("metrics_port",), self.metrics_port
            )
        _check(bool(self.metrics_host), "must not be empty", p + ("metrics_host",), self.metrics_host)
        if self.metrics_file is not None:
            _check(bool(self.metrics_file), "must be a path or null", p + ("metrics_file",), self.metrics_file)
        if self.control_endpoint is not None:
            _check(
                self.control_endpoint.startswith("ipc://") or _is_loopback_tcp(self.control_endpoint),
                "must be ipc://PATH or tcp:// on a loopback address (it is unauthenticated)",
                p + ("control_endpoint",),
                self.control_endpoint,
            )
            check_endpoint(self.control_endpoint, p + ("control_endpoint",))
        if self.tensorboard_dir is not None:
            _check(bool(self.tensorboard_dir), "must be a path or null", p + ("tensorboard_dir",), self.tensorboard_dir)
        if self.tensorboard_every_steps is not None:
            _check(
                self.tensorboard_every_steps >= 1,
                "must be >= 1 or null",
                p + ("tensorboard_every_steps",),
                self.tensorboard_every_steps,
            )

    @property
    def replica_count(self) -> int:
        """Model replicas: ``replicas``, else one per GPU ``model_gpu`` lists, else 1."""
        if self.replicas is not None:
            return self.replicas
        return len(self.model_gpu.split(",")) if self.model_gpu else 1


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """The data side: how many producer processes and where they run."""

    count: int = 2  # producer processes under one parent
    data_gpu: str = ""  # CUDA_VISIBLE_DEVICES for producers; "" = CPU only
    gpu_memory_limit_mb: int | None = None  # cap when TensorFlow is imported on the data GPU
    restart_backoff_s: float = 1.0  # first delay before restarting a crashed producer
    bad_samples: str = "quarantine"  # bad cache file: "quarantine" (empty row, counted) or "fail"
    # the consumer stops the run (exit 65) once more of the rows it trained were quarantined
    # (consumer/train/quarantine.py); 1.0 = no ceiling
    max_quarantined_fraction: float = 0.01
    exit_at_plan_end: bool = False  # exit 0 once the consumer's plan ended (``run`` sets it); else wait on
    # cache files each producer keeps open (LRU; held to half of RLIMIT_NOFILE); 0 = open and close every file on
    # every read; 8192 = the 2,000-utterance demo cache with its 2 extras (4 per utterance)
    open_files: int = 8192
    # "auto": CACHE/melfeed-<mel_dtype>.pack (melfeed pack), mapped, when it serves this manifest, else the .npy
    # files; "preadv": the pack read, not mapped; "off": the .npy files
    pack: str = "auto"
    # CPU niceness of producers and prepare workers (0..19), set at start (and Nice= in the unit): where they share
    # cores with the step, a higher value lets the step win; the ring absorbs their delay. Never lowers a niceness set
    # from outside.
    nice: int = 0

    def __post_init__(self) -> None:
        p = ("producer",)
        _check(1 <= self.count <= 64, "must be in 1..64", p + ("count",), self.count)
        _check(
            all(c.isdigit() or c == "," for c in self.data_gpu),
            "must be a comma-separated list of GPU indices or empty",
            p + ("data_gpu",),
            self.data_gpu,
        )
        if self.gpu_memory_limit_mb is not None:
            _check(
                self.gpu_memory_limit_mb >= 64, "must be >= 64", p + ("gpu_memory_limit_mb",), self.gpu_memory_limit_mb
            )
        _check(
            self.bad_samples in ("quarantine", "fail"),
            "must be 'quarantine' or 'fail'",
            p + ("bad_samples",),
            self.bad_samples,
        )
        _check(
            0.0 <= self.max_quarantined_fraction <= 1.0,
            "must be in 0..1 (1 = no ceiling)",
            p + ("max_quarantined_fraction",),
            self.max_quarantined_fraction,
        )
        _check(self.restart_backoff_s >= 0, "must be >= 0", p + ("restart_backoff_s",), self.restart_backoff_s)
        _check(0 <= self.open_files <= 1_000_000, "must be in 0..1000000", p + ("open_files",), self.open_files)
        _check(self.pack in ("auto", "preadv", "off"), "must be 'auto', 'preadv' or 'off'", p + ("pack",), self.pack)
        _check(
            0 <= self.nice <= 19, "must be in 0..19 (a niceness; below 0 needs privileges)", p + ("nice",), self.nice
        )


JitSetting = Literal["auto"] | bool  # ModelConfig.jit_compile; the loader passes it through unchanged


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The training step. ``step`` names a factory ``module:function`` (see consumer/README.md)."""

    step: str = "melfeed.consumer.train.model:build_reference_step"  # the step factory, module:function
    vocab_size: int = 256  # token ids must be < vocab_size
    learning_rate: float = 1e-3  # the optimizer's step size (StepSpec.learning_rate; the reference: Adam)
    mixed_precision: bool = False  # float16 compute with loss scaling (bfloat16 on CPU)
    seed: int = 0  # weight initialisation
    # "auto": XLA where it compiles and is faster, else graph mode; true: XLA or fail (exit 1); false: graph-mode
    # tf.function
    jit_compile: JitSetting = "auto"
    # Free-form settings for the step factory (StepSpec.params); YAML values only; null = empty.
    # Always a plain dict after construction (a deep copy); left out of the hash (dicts have none).
    params: Mapping[str, Any] | None = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        p = ("model",)
        _check(
            ":" in self.step and all(self.step.split(":", 1)),
            "must look like 'module:function'",
            p + ("step",),
            self.step,
        )
        _check(self.vocab_size >= 2, "must be >= 2", p + ("vocab_size",), self.vocab_size)
        check_int32(self.vocab_size, p + ("vocab_size",))  # token ids are int32 on the wire
        check_seed(self.seed, p + ("seed",))
        _check(self.learning_rate > 0, "must be > 0", p + ("learning_rate",), self.learning_rate)
        _check(
            isinstance(self.jit_compile, bool) or self.jit_compile == "auto",
            "must be auto, true or false",
            p + ("jit_compile",),
            self.jit_compile,
        )
        params = {} if self.params is None else self.params
        _check(isinstance(params, Mapping), "must be a mapping (name: value)", p + ("params",), params)
        # slots + frozen: object.__setattr__ is the documented way to normalise in __post_init__
        object.__setattr__(self, "params", plain_params(params, p + ("params",)))


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Root configuration. ``cache_dir`` holds mels/, tokens/ and manifest.json."""

    cache_dir: str | None = None  # the prepared cache; None = none: a command that reads one refuses
    seed: int = 0  # data order; the plan depends on (manifest, seed, epoch)
    n_mels: int = 80  # mel bins per frame (1..1024); the cache's manifest must agree
    buckets: BucketConfig = field(default_factory=BucketConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    consumer: ConsumerConfig = field(default_factory=ConsumerConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)  # used by prepare; checked against the cache

    def __post_init__(self) -> None:
        _check(1 <= self.n_mels <= 1024, "must be in 1..1024", ("n_mels",), self.n_mels)
        check_seed(self.seed, ("seed",))
        control = self.consumer.control_endpoint
        _check(
            control is None or not control.startswith("tcp://") or self.transport.insecure,
            "serves status without authentication over tcp://; use ipc:// or set transport.insecure: true",
            ("consumer", "control_endpoint"),
            control,
        )
        for key, end in (
            (("transport", "endpoint"), self.transport.endpoint),
            (("consumer", "control_endpoint"), control),
        ):
            check_not_abstract(end, self.transport.insecure, key)
        check_distinct_binds(
            {("transport", "endpoint"): self.transport.endpoint, ("consumer", "control_endpoint"): control},
            (("consumer", "metrics_port"), self.consumer.metrics_host, self.consumer.metrics_port),
        )
        n, batch = self.consumer.replica_count, self.buckets.batch_size
        checked: list[tuple[int | None, str]] = [(batch if isinstance(batch, int) else None, "batch_size")]
        for rows, name in checked + [(r, "rows") for r in self.buckets.rows or ()]:
            _check(
                rows is None or rows % n == 0,
                f"must divide by the {n} model replicas (consumer.replicas, "
                "consumer.model_gpu): each replica takes an equal share of every batch's rows",
                ("buckets", name),
                rows,
            )


def resolve_runtime_dir(environ: Mapping[str, str]) -> Path:
    """Private directory for sockets: systemd's RUNTIME_DIRECTORY, else XDG, else /tmp/melfeed-UID. A relative
    value is ignored, as the XDG spec asks: it would name another directory in each process's working directory."""
    systemd, xdg = environ.get("RUNTIME_DIRECTORY", "").split(":")[0], environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(systemd):
        return Path(systemd)
    if os.path.isabs(xdg):
        return Path(xdg) / "melfeed"
    return Path(f"/tmp/melfeed-{os.getuid()}")
