"""Reference text-to-mel model and the step-factory contract the consumer compiles.

A step factory (``ModelConfig.step`` = ``"module:function"``) takes a ``StepSpec`` and returns a
``TrainStep``: a callable that runs one optimisation step on one padded batch and returns its named
scalars (a mapping with ``"loss"``, or the bare scalar loss). ``consumer/train/step.py`` wraps it in
one program per bucket shape (XLA or graph mode, ``ModelConfig.jit_compile``).

Invariants:
    * With several replicas (``StepSpec.replicas`` > 1, consumer/train/replicas.py) the step runs on each
      replica's rows and returns that replica's share: counts that normalise a loss are summed over
      replicas with ``global_sum`` first, so the replicas' outputs sum to the value one replica computes
      on the whole batch, and a Keras optimizer's summed gradients are that value's gradients.
    * Rows with ``mel_len == 0`` (padding rows) and frames ``t >= mel_len`` contribute nothing to
      the loss or the gradients; the loss is normalised by valid frames x n_mels, so adding padding
      rows or padding frames leaves the loss unchanged.
    * Every variable (model and optimizer, including iteration and loss-scale counters) exists
      before the factory returns, so ``TrainStep.variables()`` is complete and tracing never
      creates variables.
    * Weights depend only on ``StepSpec.seed`` (stateless seeded initialisers, no global RNG).
Shutdown: nothing to release; the step holds only TensorFlow variables.

The reference model is deliberately small (a real TTS model is the user's factory): token
embedding + one residual conv encoder; each frame's query is a function of its relative position
``t / mel_len`` (r, sin/cos octaves) attending over the encoded text, masked by ``tok_len``; keys
carry the token's relative position ``(i + 0.5) / tok_len`` features, and a learnable-width
Gaussian location prior (frame t prefers token ``t * tok_len / mel_len``) makes alignment easy from
step one. The attention is local (``_WINDOW`` tokens around that alignment) and all dense layers but
the final mel projection run per token, because per-frame work is what costs on 2 CPU cores: full
[B, T, L] attention measured ~176 ms a step at [32, 872, 80], this model ~55 ms (p50).
Frame count T and n_mels must be static (they are, under the consumer's fixed input signatures).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import keras
import numpy as np
import tensorflow as tf

from melfeed.shared.wire.schema import ExtraSpec

if TYPE_CHECKING:
    from melfeed.shared.config import PipelineConfig

__all__ = ["CheckpointedStep", "StepSpec", "TrainStep", "build_reference_step", "global_sum", "optimizer_variables"]

log = logging.getLogger(__name__)

_D_MODEL = 64  # embedding / encoder width (per token: cheap)
_D_VALUE = 32  # attended value width; with out_proj, the per-frame cost that dominates a step
_N_FREQS = 6  # sinusoid octaves of the relative position (pi * 2**k * r)
_N_FEATURES = 2 + 2 * _N_FREQS  # position features: r, 1, sin/cos per octave
_WINDOW = 3  # tokens each frame attends to, centred on its proportional alignment
_INIT_WIDTH = 0.3  # location prior width in tokens; < 0.5 so a frame prefers its own token
_MASKED = -1e9  # finite: an all-padding row (tok_len 0) must give a uniform softmax, not NaN


@dataclass(frozen=True, slots=True)
class StepSpec:
    """What a step factory needs to know; built from ``PipelineConfig`` by the consumer."""

    n_mels: int  # M, last axis of "mel"
    vocab_size: int  # token ids are in 0..vocab_size-1; 0 is padding
    learning_rate: float  # model.learning_rate (the reference model's Adam step size)
    mixed_precision: bool  # model.mixed_precision (the reference model: float16 on a GPU / bfloat16 on the CPU
    # compute, float32 variables and loss, loss scaling); a factory applies it itself
    seed: int  # model.seed: weight initialisation
    # One read-only {"mel": (B, T, M), "mel_len": (B,), "tokens": (B, L), "tok_len": (B,), <extras>...} per
    # bucket, in bucket order: the only shapes the step is ever called with (e.g. to size a decoder).
    bucket_shapes: tuple[Mapping[str, tuple[int, ...]], ...] = field(default=(), hash=False)
    total_steps: int | None = None  # consumer.steps: where the run stops; None = until stopped
    batches_per_epoch: int | None = None  # plan batches in one pass over the data (schedules per epoch)
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)  # model.params, read-only
    # Model replicas the step runs on (consumer.replicas); > 1: each call sees bucket rows / replicas rows
    # and returns its share of each named scalar (normalise by global_sum of the count, see the module doc).
    replicas: int = 1
    # The batch schema beyond the base arrays: name, kind, dtype, trailing shape of each extra (shapes per
    # bucket in bucket_shapes). ``__call__`` receives each one it names as a keyword argument (or all
    # with ``**extras``); a sequence extra's length comes as ``<name>_len``.
    extras: tuple[ExtraSpec, ...] = ()
    # The dtype "mel" arrives in (transport.mel_dtype): "float16" halves the bytes of every data path, and
    # the step casts it inside its compiled program (``tf.cast(mel, tf.float32)``, as the reference step does).
    mel_dtype: str = "float32"

    def __post_init__(self) -> None:
        if (
            self.n_mels < 1
            or self.vocab_size < 2
            or not self.learning_rate > 0
            or self.replicas < 1
            or self.mel_dtype not in ("float32", "float16")
        ):
            raise ValueError(f"invalid StepSpec: {self}")
        # frozen + slots: object.__setattr__ is how __post_init__ may normalise; read-only views
        # so a factory cannot change what the next factory call (or the summary) sees.
        object.__setattr__(
            self,
            "bucket_shapes",
            tuple(MappingProxyType({k: tuple(int(d) for d in v) for k, v in b.items()}) for b in self.bucket_shapes),
        )
        object.__setattr__(self, "params", MappingProxyType(copy.deepcopy(dict(self.params))))  # nested: a copy

    @classmethod
    def from_config(
        cls,
        cfg: PipelineConfig,
        bucket_shapes: Sequence[Mapping[str, tuple[int, ...]]],
        batches_per_epoch: int | None,
        extras: Sequence[ExtraSpec] = (),
    ) -> StepSpec:
        """The spec of ``cfg.model`` for these buckets (``Consumer._bucket_set``), plan length and extras."""
        m = cfg.model
        return cls(
            cfg.n_mels,
            m.vocab_size,
            m.learning_rate,
            m.mixed_precision,
            m.seed,
            bucket_shapes=tuple(bucket_shapes),
            total_steps=cfg.consumer.steps,
            batches_per_epoch=batches_per_epoch,
            params=dict(m.params or {}),
            replicas=cfg.consumer.replica_count,
            extras=tuple(extras),
            mel_dtype=cfg.transport.mel_dtype,
        )


def global_sum(value: tf.Tensor) -> tf.Tensor:
    """``value`` summed over every replica of the step (itself with one replica).

    Call it inside the step on a count that normalises a loss (valid frames, tokens, rows), so every
    replica divides its own sum by the whole batch's count. Outside a replica context it returns
    ``value`` unchanged.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def optimizer_variables(optimizer: Any) -> list[tf.Variable]:
    """Every variable of a Keras 3 or tf_keras (Keras 2) optimizer, once each, as ``tf.Variable`` s.

    For a step's ``variables()``: Keras 3 lists them in ``optimizer.variables`` (the iteration count and the
    learning rate included); tf_keras in ``optimizer.variables()`` (a method; a list that can also be called
    in tf_keras 2.11+), which leaves out the ``current_learning_rate`` a learning-rate schedule assigns on
    every step: ``optimizer.learning_rate`` is that variable then. ``optimizer.iterations`` is added in case.
    """
    listed = optimizer.variables
    found = [*(listed() if callable(listed) else listed), optimizer.iterations]
    rate = getattr(optimizer, "learning_rate", None)
    if isinstance(rate, tf.Variable):  # tf_keras; Keras 3's is a keras.Variable, listed already
        found.append(rate)
    out: dict[int, tf.Variable] = {}
    for variable in found:
        inner = getattr(variable, "value", None)  # keras.Variable -> its tf.Variable; a tf.Variable's is a method
        tv = inner if inner is not None and not callable(inner) else variable
        out.setdefault(id(tv), tv)
    return list(out.values())


class TrainStep(Protocol):
    """One optimisation step on one padded batch; the unit ``CompiledStep`` compiles.

    Optional class attributes say what the step needs of the batch's axes (consumer/train/axes.py):
    ``token_axis = "longest"`` (tokens cut to the batch's longest row in graph mode) and ``frame_multiple``.
    A step may also name its checkpoint trackables (``CheckpointedStep``).
    """

    # *args/**extras (Any): a step names the extras it takes as its own keyword parameters
    def __call__(
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, *args: Any, **extras: Any
    ) -> tf.Tensor | Mapping[str, tf.Tensor]:
        """Apply one update and return its named scalars (computed before the update).

        Either a mapping of names to scalar tensors that holds ``"loss"`` (e.g. ``{"loss": total,
        "mel_l1": l1, "stop_bce": bce}``), or the bare scalar loss (meaning ``{"loss": loss}``).
        Each is read as float32, averaged over the status interval and reported by name.
        Must be traceable by ``tf.function`` (with ``jit_compile=True`` when XLA is used) and
        create no variables.
        Shapes: mel [B, T, M] float32 (float16 when ``StepSpec.mel_dtype`` says so: cast it in the step),
        mel_len [B] int32, tokens [B, L] int32, tok_len [B] int32;
        extras (``StepSpec.extras``) come as keyword arguments when ``__call__`` names them.
        """
        ...

    def variables(self) -> list[tf.Variable]:
        """Every model and optimizer variable (restored bit-exactly after warm-up)."""
        ...


class CheckpointedStep(TrainStep, Protocol):
    """A ``TrainStep`` that names its trackables; checkpoints of a step without them hold ``variables()``."""

    def checkpoint_items(self) -> dict[str, object]:
        """``{"model": ..., "optimizer": ...}`` trackables for ``tf.train.Checkpoint``."""
        ...


def _position_features(r: tf.Tensor) -> tf.Tensor:
    """[..., _N_FEATURES] float32 features of a relative position r in [0, 1]: r, 1, sin/cos.

    Octaves come from the double-angle identities (one sin/cos, then multiplies): on XLA:CPU a
    transcendental costs ~1 ns per element, and this runs on every frame.
    """
    sin, cos = tf.sin(np.pi * r), tf.cos(np.pi * r)
    feats = [r, tf.ones_like(r)]
    for _ in range(_N_FREQS):
        feats += [sin, cos]
        sin, cos = 2.0 * sin * cos, 1.0 - 2.0 * tf.square(sin)
    return tf.stack(feats, axis=-1)


class _TextToMel(keras.Model):  # type: ignore[misc]  # Keras is untyped
    """tokens [B, L] + lengths -> predicted mel [B, T, M] float32."""

    def __init__(self, spec: StepSpec, policy: str) -> None:
        super().__init__(name="text_to_mel", dtype=policy)
        seeds = iter(int(s) for s in np.random.SeedSequence(spec.seed).generate_state(8))

        def dense(units: int, activation: str | None = None) -> keras.layers.Dense:
            return keras.layers.Dense(
                units,
                activation=activation,
                dtype=policy,
                kernel_initializer=keras.initializers.GlorotUniform(seed=next(seeds)),
            )

        self.embed = keras.layers.Embedding(
            spec.vocab_size,
            _D_MODEL,
            dtype=policy,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=next(seeds)),
        )
        self.enc_conv = keras.layers.Conv1D(
            _D_MODEL,
            3,
            padding="same",
            activation="relu",
            dtype=policy,
            kernel_initializer=keras.initializers.GlorotUniform(seed=next(seeds)),
        )
        self.key_proj = dense(_N_FEATURES)  # keys live in the query feature space (see call)
        self.value_proj = dense(_D_VALUE, "relu")
        self.out_proj = dense(spec.n_mels)
        self.log_width = self.add_weight(
            shape=(), name="log_width", initializer=keras.initializers.Constant(float(np.log(_INIT_WIDTH)))
        )

    def call(self, tokens: tf.Tensor, tok_len: tf.Tensor, mel_len: tf.Tensor, n_frames: int) -> tf.Tensor:
        cdt = self.compute_dtype
        n_tok = tf.shape(tokens)[1]
        tok_mask = tf.sequence_mask(tok_len, n_tok)  # [B, L]
        tok_len_f = tf.cast(tf.maximum(tok_len, 1), tf.float32)[:, None]  # [B, 1]
        mel_len_f = tf.cast(tf.maximum(mel_len, 1), tf.float32)[:, None]
        r_key = (tf.cast(tf.range(n_tok), tf.float32)[None, :] + 0.5) / tok_len_f  # [B, L]
        r_query = tf.cast(tf.range(n_frames), tf.float32)[None, :] / mel_len_f  # [B, T]

        # Text side (L positions): everything heavy happens here, not per frame.
        emb = self.embed(tokens) * tf.cast(tok_mask, cdt)[..., None]  # [B, L, D]
        enc = emb + self.enc_conv(emb)
        enc_pos = tf.concat([enc, tf.cast(_position_features(r_key), cdt)], -1)
        # A frame query is a linear map of its position features q = P(r) Wq, so q . k equals
        # P(r) . (Wq k): keys are projected into feature space once per token instead.
        keys = self.key_proj(enc_pos)  # [B, L, F]
        kv = tf.concat([keys, self.value_proj(enc_pos)], -1)  # [B, L, F+V]
        query = tf.cast(_position_features(r_query), cdt)  # [B, T, F]

        # Local attention over the _WINDOW tokens around the frame's proportional alignment
        # t * tok_len / mel_len (full attention over [B, T, L] cost ~176 ms a step on 2 cores).
        # One [B, T] gather per offset keeps every reduction on the minor axis.
        centre = tf.cast(tf.floor(r_query * tok_len_f), tf.int32)  # [B, T]
        width = tf.exp(tf.cast(self.log_width, tf.float32))
        scores, windows = [], []
        for offset in range(-(_WINDOW // 2), _WINDOW - _WINDOW // 2):
            idx = centre + offset
            win = tf.gather(kv, tf.clip_by_value(idx, 0, n_tok - 1), batch_dims=1)  # [B, T, F+V]
            # Scores in float32: the mask constant and the softmax must not overflow float16.
            content = tf.cast(tf.reduce_sum(query * win[..., :_N_FEATURES], -1), tf.float32)
            dist = (r_query * tok_len_f - tf.cast(idx, tf.float32) - 0.5) / width
            in_text = (idx >= 0) & (idx < tok_len[:, None])
            scores.append(tf.where(in_text, content - 0.5 * tf.square(dist), _MASKED))
            windows.append(win[..., _N_FEATURES:])
        weights = tf.cast(tf.nn.softmax(tf.stack(scores, -1), axis=-1), cdt)  # [B, T, K]
        context = tf.add_n([weights[..., k : k + 1] * w for k, w in enumerate(windows)])
        return tf.cast(self.out_proj(context), tf.float32)  # [B, T, M]


def _masked_l1(pred: tf.Tensor, mel: tf.Tensor, mel_len: tf.Tensor) -> tf.Tensor:
    """Mean |pred - mel| over the valid frames x mels of the whole batch (every replica's rows: this
    replica's share, see ``global_sum``); 0.0 for an all-padding batch."""
    n_frames, n_mels = mel.shape[1], mel.shape[2]
    frame_mask = tf.sequence_mask(mel_len, n_frames)  # [B, T]
    # where(), not multiply: a non-finite prediction in a padding row must not leak as NaN.
    err = tf.where(frame_mask[..., None], tf.abs(pred - mel), 0.0)
    n_valid = tf.cast(global_sum(tf.reduce_sum(tf.cast(frame_mask, tf.int32))), tf.float32) * n_mels
    return tf.reduce_sum(err) / tf.maximum(n_valid, 1.0)


class _ReferenceStep:
    """``TrainStep`` around ``_TextToMel`` and Adam (wrapped in loss scaling when mixed)."""

    def __init__(self, spec: StepSpec) -> None:
        self.spec = spec
        has_gpu = bool(tf.config.list_physical_devices("GPU"))
        # bfloat16 on CPU: XLA:CPU has no fast float16 and bfloat16 keeps float32's range.
        policy = ("mixed_float16" if has_gpu else "mixed_bfloat16") if spec.mixed_precision else "float32"
        self.model = _TextToMel(spec, policy)
        adam = keras.optimizers.Adam(learning_rate=float(spec.learning_rate))
        # Loss scaling on both devices keeps one variable layout (and checkpoint) for GPU and CPU.
        self.optimizer: keras.optimizers.Optimizer = (
            keras.optimizers.LossScaleOptimizer(adam) if spec.mixed_precision else adam
        )
        # Build everything eagerly so no variable is created inside a traced step.
        one = tf.ones([1], tf.int32)
        self.model(tf.ones([1, 2], tf.int32), one, one, n_frames=2)
        self.optimizer.build(self.model.trainable_variables)
        log.debug("reference step built policy=%s params=%d", policy, self.model.count_params())

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        mel = tf.cast(mel, tf.float32)  # a float16 wire (StepSpec.mel_dtype): cast inside the program; else a no-op
        trainable = self.model.trainable_variables
        with tf.GradientTape() as tape:
            pred = self.model(tokens, tok_len, mel_len, n_frames=mel.shape[1])
            loss = _masked_l1(pred, mel, mel_len)
            scaled = (
                self.optimizer.scale_loss(loss)
                if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
                else loss
            )
        grads = tape.gradient(scaled, trainable)
        self.optimizer.apply(grads, trainable)
        return loss

    def variables(self) -> list[tf.Variable]:
        out: dict[int, tf.Variable] = {}
        for v in [*self.model.variables, *optimizer_variables(self.optimizer)]:
            tv = v.value if isinstance(v, keras.Variable) else v
            if not isinstance(tv, tf.Variable):
                raise TypeError(f"variable {v.path} is not backed by a tf.Variable")
            out.setdefault(id(tv), tv)
        return list(out.values())

    def checkpoint_items(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer}


def build_reference_step(spec: StepSpec) -> CheckpointedStep:
    """Build the reference text-to-mel step (the default ``ModelConfig.step``).

    Args:
        spec: sizes, optimiser settings and seed.

    Returns:
        A ``TrainStep`` whose variables all exist already. On a GPU, place it there by building
        and calling it under that device (the default when one is visible).
    """
    return _ReferenceStep(spec)
