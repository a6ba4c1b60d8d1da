"""A real but tiny TensorFlow training step for tests that restart consumers many times.

It compiles in well under a second (the reference model takes ~15-30 s on 2 cores) and its final
variables depend on every batch and on their order (momentum), so a resumed run that lost,
repeated or reordered a batch ends with different variables than an uninterrupted one.
"""

from __future__ import annotations

import os

import tensorflow as tf

from melfeed.consumer.train.model import StepSpec, global_sum


class _TinyStep:
    def __init__(self, spec: StepSpec) -> None:
        self.lr = float(spec.learning_rate)
        self.w = tf.Variable(tf.zeros([spec.n_mels]), name="w")
        self.momentum = tf.Variable(tf.zeros([spec.n_mels]), name="momentum")
        self.iterations = tf.Variable(tf.constant(0, tf.int64), name="iterations")

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        mask = tf.sequence_mask(mel_len, mel.shape[1], tf.float32)[..., None]
        n_valid = tf.maximum(tf.reduce_sum(mask) * mel.shape[2], 1.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(mel - self.w) * mask) / n_valid
        grad = tape.gradient(loss, self.w)
        self.momentum.assign(0.9 * self.momentum + grad)
        self.w.assign_sub(self.lr * self.momentum)
        self.iterations.assign_add(1)
        return loss

    def variables(self) -> list[tf.Variable]:
        return [self.w, self.momentum, self.iterations]

    def checkpoint_items(self) -> dict[str, object]:
        return {"w": self.w, "momentum": self.momentum, "iterations": self.iterations}


def tiny_step(spec: StepSpec) -> _TinyStep:
    return _TinyStep(spec)


_SLOW_MATMULS = 12  # chained [512, 512] matmuls per step: ~50-100 ms on the 2-core CI machine
_SLOW_SIDE = 512


class _SlowStep(_TinyStep):
    """``tiny_step`` plus real, un-elidable compute (a sleep cannot live inside an XLA program:
    ``jit_compile=True`` rejects ``tf.py_function``), so the step, not the data, bounds throughput."""

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        loss = super().__call__(mel, mel_len, tokens, tok_len)
        x = (
            tf.reshape(
                tf.tile(self.w, [_SLOW_SIDE * _SLOW_SIDE // self.w.shape[0] + 1])[: _SLOW_SIDE * _SLOW_SIDE],
                [_SLOW_SIDE, _SLOW_SIDE],
            )
            + 1.0
        )

        def body(i: tf.Tensor, acc: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return i + 1, tf.tanh(tf.matmul(acc, x) * (1.0 / _SLOW_SIDE))

        _, acc = tf.while_loop(lambda i, acc: i < _SLOW_MATMULS, body, (tf.constant(0), x))
        return loss + 0.0 * tf.reduce_mean(acc)  # depends on the chain, so XLA must compute it


def slow_step(spec: StepSpec) -> _SlowStep:
    return _SlowStep(spec)


class _ReplicaTinyStep(_TinyStep):
    """``tiny_step`` that keeps the replica contract by hand (no Keras optimizer): the loss is normalised by
    the whole batch's valid values and the gradient summed over replicas (``global_sum``), and the variables
    are updated with ``ONLY_FIRST_REPLICA`` (every replica computes the same update). With one replica it is
    ``tiny_step``'s arithmetic exactly."""

    def __init__(self, spec: StepSpec) -> None:
        self.lr = float(spec.learning_rate)
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.w = tf.Variable(tf.zeros([spec.n_mels]), name="w", aggregation=first)
        self.momentum = tf.Variable(tf.zeros([spec.n_mels]), name="momentum", aggregation=first)
        self.iterations = tf.Variable(tf.constant(0, tf.int64), name="iterations", aggregation=first)

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        mask = tf.sequence_mask(mel_len, mel.shape[1], tf.float32)[..., None]
        n_valid = tf.maximum(global_sum(tf.reduce_sum(mask)) * mel.shape[2], 1.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(mel - self.w) * mask) / n_valid
        grad = global_sum(tape.gradient(loss, self.w))
        self.momentum.assign(0.9 * self.momentum + grad)
        self.w.assign_sub(self.lr * self.momentum)
        self.iterations.assign_add(1)
        return loss


def replica_tiny_step(spec: StepSpec) -> _ReplicaTinyStep:
    return _ReplicaTinyStep(spec)


class _RowsStep(_TinyStep):
    """``tiny_step`` that also takes the row inputs (consumer/train/rows.py) and reports them."""

    def __call__(  # type: ignore[override]  # takes the row inputs too
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        rows: tf.Tensor,
        row_mask: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        loss = super().__call__(mel, mel_len, tokens, tok_len)
        padding = tf.cast(tf.shape(mel)[0] - tf.reduce_sum(tf.cast(row_mask, tf.int32)), tf.float32)
        return {"loss": loss, "rows": tf.cast(rows, tf.float32), "padding_rows": padding}


def rows_step(spec: StepSpec) -> _RowsStep:
    return _RowsStep(spec)


class _FailAtStep(_TinyStep):
    """``tiny_step`` whose ``model.params["fail_at"]``-th training step (0-based: that many applied before it)
    fails a ``tf.debugging`` check, as a step meeting a bad value does; warm-up leaves ``iterations`` at 0."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__(spec)
        self.fail_at = int(spec.params["fail_at"])

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        check = tf.debugging.assert_less(
            self.iterations, tf.constant(self.fail_at, tf.int64), message="the fail_at check failed"
        )
        with tf.control_dependencies([check]):
            return super().__call__(mel, mel_len, tokens, tok_len)


def fail_at_step(spec: StepSpec) -> _FailAtStep:
    return _FailAtStep(spec)


class _XlaAbortStep(_TinyStep):
    """``tiny_step`` that kills the process with SIGABRT when it is traced for XLA, as a check failure inside
    TensorFlow's XLA compiler does; in graph mode it trains. The test is TensorFlow's own: ``tf.while_loop``
    asks the same question to require ``maximum_iterations`` under XLA."""

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        from tensorflow.python.ops import control_flow_util

        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            os.abort()
        return super().__call__(mel, mel_len, tokens, tok_len)


def xla_abort_step(spec: StepSpec) -> _XlaAbortStep:
    return _XlaAbortStep(spec)


class _MemoryBoundStep(_TinyStep):
    """``tiny_step`` on a device that holds at most ``model.params.max_rows`` rows: a batch with more raises
    TensorFlow's ``ResourceExhaustedError`` when its program is built, as a GPU's allocator would when it runs."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__(spec)
        self.max_rows = int(spec.params["max_rows"])

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        if mel.shape[0] > self.max_rows:
            raise tf.errors.ResourceExhaustedError(None, None, f"OOM when allocating tensor with shape {mel.shape}")
        return super().__call__(mel, mel_len, tokens, tok_len)


def memory_bound_step(spec: StepSpec) -> _MemoryBoundStep:
    return _MemoryBoundStep(spec)


_TOKEN_WIDTH = 256  # features per token position of token_heavy_step
_TOKEN_LAYERS = 8  # [B, L, 256] x [256, 256] matmuls per step: the step's time grows with B x L


class _TokenHeavyStep(_TinyStep):
    """``tiny_step`` plus real compute over the token axis only: its time grows with the rows and tokens, not
    the frames (a text encoder far costlier than the mel side), so ``buckets.cost: measured`` must find tokens
    dearer than frames."""

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        loss = super().__call__(mel, mel_len, tokens, tok_len)
        side = _TOKEN_WIDTH
        weight = tf.reshape(tf.tile(self.w, [side * side // self.w.shape[0] + 1])[: side * side], [side, side])
        x = tf.cast(tokens, tf.float32)[..., None] * tf.ones([side]) * 1e-3
        for _ in range(_TOKEN_LAYERS):
            x = tf.tanh(tf.matmul(x, weight) + 1e-3)
        return loss + 1e-9 * tf.reduce_mean(x)


def token_heavy_step(spec: StepSpec) -> _TokenHeavyStep:
    return _TokenHeavyStep(spec)
