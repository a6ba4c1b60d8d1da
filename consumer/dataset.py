"""``tf.data.Dataset`` view of a running ``Consumer`` for Keras ``fit`` and custom loops, without copies.

Elements: ``(features, mel [B,T,M] float32)`` (float16 with ``transport.mel_dtype: float16``: the bytes
of the slot, cast by the model -- Keras layers and losses cast their inputs); ``features`` is a dict of the keys asked
for, from
``tokens`` [B,L] int32, ``tok_len`` [B] int32, ``mel_len`` [B] int32, ``frames`` [B] int32 (every row
holds the bucket's padded T, so a model predicting [B,T,M] needs no ``.map``), ``batch_id``
[B] int64, and the row inputs of the step contract (consumer/train/rows.py): ``rows`` [] int32 (real
rows, from the plan) and ``row_mask`` [B] bool (True for the real rows, which come first), and the
cache's extra arrays by name (the batch schema, ``Consumer.extras``; a sequence extra's ``<name>_len``
too).
Shapes per element are one of the bucket shapes (batch and time dims are ``None`` in the spec, so a
``tf.function`` traces once per bucket), or the largest bucket's when ``single_shape`` (then the spec
is fully static, T included).
How (one Python call per element; docs/performance.md, "as_dataset() CPU per batch"): the dataset is
tf.data's own generator dataset (what ``from_generator`` builds, without its per-element structure
checks and one tensor per array): per iterator an init call (``begin``: supersede the previous
iterator), per element a stateful ``numpy_function`` (``next``) that hands TensorFlow two arrays, the
batch's bytes in its 64-byte-aligned ring slot (one uint8 view, wrapped without a copy) and
``[bucket, batch_id, rows]`` (``StopIteration`` ends the iterator), and a finalizer that frees the slot
a dropped iterator still holds. The arrays are cut
out of the bytes inside the dataset's graph (a 64-byte-aligned slice along the only axis shares the
buffer, ``bitcast`` and ``reshape`` never copy), with per-bucket offset and shape tables built once
here; ``frames``, ``batch_id``, ``rows`` and ``row_mask`` are built in the graph too. ``single_shape``
pads every array to the largest bucket in the graph: one copy, so those elements own their memory.
``token_axis="longest"`` then cuts the token axis as the built-in loop cuts it for a step that declares it
(``cut_to_longest``, consumer/train/axes.py; its ``tok_len`` and ``<name>_len`` are read from the slot even when
``features`` leaves them out), and that dimension is ``None`` in the spec. The cut is a slice (a copy of the
first ``max(tok_len)`` entries of each row, or the array itself when nothing is cut), so an element reads its
slot no longer than an uncut one does (the rule below).
Invariants (docs/guide/your-model.md, "A loop of your own"):
    * The dataset has no read-ahead of its own (no prefetch stage; ``inject_prefetch`` and
      ``map_parallelization`` are off: either would pull elements ahead): the Python side runs
      only when the dataset's caller asks for an element. The ring is the prefetch buffer: producers
      fill up to ``consumer.ring_slots`` slots ahead in the background.
    * A batch counts as applied when the dataset hands it out; its slot is freed only when the
      caller asks for the next element, the iterator ends or is dropped, or a newer one starts.
    * Each new iterator (each ``fit``) supersedes the previous one and continues the plan where the
      previous one stopped; batches given back by a dropped ``batches()`` loop come first. Starting it
      frees the slot the superseded one held, so a late-collected Keras iterator keeps no slot.
Read-ahead to the model device (``prefetch_device``; "auto" = the first GPU TensorFlow sees, none on
CPU): ``copy_to_device`` + ``prefetch(1)`` after the element is built, then a last ``map`` whose hook
applies the batch. The generator then only *holds* what it takes (``HandoutDesk.hold``); the hook
runs when the caller takes the element (nothing follows it), so exactly the batches the caller received
are applied; what the stage still holds when the iterator is dropped or superseded is handed out again,
first. A device copy frees its slot when taken; a host stage (a device name without "GPU": tests) keeps
it until the next element, as above. The invariants below describe the dataset without the stage.
The dataset ends when the consumer's plan ends, ``close()`` is called, or a newer iterator took over.
Shutdown: a dropped iterator's finalizer frees the slot it still holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

# Private, but it is the op ``from_generator`` is made of (init / next / finalize per iterator, end by
# StopIteration); the public function adds ~1 ms of Python checks per element.
from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset

from melfeed.consumer.train.axes import TOKEN_AXES, cut_names, cut_to_longest, program_inputs
from melfeed.shared.wire.schema import ExtraSpec

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.handout import Batch, HandoutDesk

__all__ = ["make_dataset", "FEATURE_KEYS", "feature_keys"]

FEATURE_KEYS = ("tokens", "tok_len", "mel_len", "frames", "batch_id", "rows", "row_mask")
_DERIVED = {"frames": tf.int32, "batch_id": tf.int64, "rows": tf.int32, "row_mask": tf.bool}
_BUCKET, _BATCH_ID, _ROWS, _TOKEN = range(4)  # fields of the info vector handed over with the bytes
_PREFETCH_BATCHES = 1  # read-ahead depth of the device stage: one batch hides its copy; each holds a ring slot


def feature_keys(consumer: Consumer) -> tuple[str, ...]:
    """Every key ``features`` may name: ``FEATURE_KEYS`` then the batch schema's extra arrays."""
    base = set(FEATURE_KEYS) | {"mel"}
    return FEATURE_KEYS + tuple(k for k in consumer.bucket_shapes[0] if k not in base)


def resolve_prefetch_device(setting: str | None) -> str | None:
    """``prefetch_device`` of ``as_dataset``: "auto" = the first GPU TensorFlow sees, else None (no stage).

    Raises:
        ValueError: a device name TensorFlow cannot parse or does not see (checked here, when the dataset is
            made, not at its first batch).
    """
    if setting is None:
        return None
    if setting == "auto":
        gpus = tf.config.list_logical_devices("GPU")
        return gpus[0].name if gpus else None
    seen = [d.name for d in tf.config.list_logical_devices()]
    try:
        spec = tf.DeviceSpec.from_string(setting) if isinstance(setting, str) else None
    except ValueError:
        spec = None
    if (
        spec is None
        or spec.device_type is None
        or not any(_same_device(spec, tf.DeviceSpec.from_string(name)) for name in seen)
    ):
        raise ValueError(
            f"prefetch_device must be 'auto', None or a device TensorFlow sees ({', '.join(seen)}), got {setting!r}"
        )
    return setting


def _same_device(wanted: tf.DeviceSpec, seen: tf.DeviceSpec) -> bool:
    return str(wanted.device_type).upper() == str(seen.device_type).upper() and (wanted.device_index or 0) == (
        seen.device_index or 0
    )


class _Tables:
    """Where each array lies in a slot and its shape, per bucket: int64 [n_buckets, ...] constants."""

    def __init__(self, consumer: Consumer, names: Sequence[str]) -> None:
        ring, buckets = consumer._ring, consumer._bucket_set.buckets
        base = ring.memory.buffer(0).ctypes.data
        views = [ring.views(0, b.index) for b in buckets]  # addresses only: no data is read
        self.names = tuple(names)
        self.end = np.array([max(v.ctypes.data - base + v.nbytes for v in vs.values()) for vs in views], np.int64)
        self.offset = {k: tf.constant([vs[k].ctypes.data - base for vs in views], tf.int64) for k in names}
        self.nbytes = {k: tf.constant([vs[k].nbytes for vs in views], tf.int64) for k in names}
        self.shape = {k: tf.constant([vs[k].shape for vs in views], tf.int64) for k in names}
        dtypes = buckets[0].dtypes()  # the same in every bucket
        self.dtype = {k: tf.as_dtype(dtypes[k]) for k in names}

    def array(self, raw: tf.Tensor, bucket: tf.Tensor, name: str) -> tf.Tensor:
        """One array of the batch as a view of ``raw`` (aligned slice, bitcast, reshape: no copy)."""
        piece = tf.slice(raw, [self.offset[name][bucket]], [self.nbytes[name][bucket]])
        dtype = self.dtype[name]
        if dtype.size > 1:
            piece = tf.reshape(piece, [-1, dtype.size])
        flat = tf.bitcast(piece, dtype) if dtype != tf.uint8 else piece
        return tf.reshape(flat, self.shape[name][bucket])


class _DatasetSource:
    """The Python side: one call per element for iterator ``token``; holds at most one slot per token."""

    def __init__(self, consumer: Consumer, tables: _Tables, read_ahead: bool) -> None:
        self._desk: HandoutDesk = consumer._desk
        self._ring = consumer._ring
        self._end = tables.end
        self._held: dict[int, Batch] = {}
        self._read_ahead = read_ahead  # a prefetch stage follows: apply on consumption, not here

    def begin(self) -> np.int64:
        """A new iterator asked for its first element: it supersedes the previous one."""
        self._held.clear()  # the desk's begin frees whatever slot was held
        return np.int64(self._desk.begin())

    def next(self, token_arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next batch's slot bytes and info for iterator ``token``; ``StopIteration`` at the end."""
        token = int(token_arr)
        desk = self._desk
        if not self._read_ahead:
            self.release(token_arr)  # the caller asked for the next element: its step is done
        batch = None
        if desk.is_current(token):
            try:
                batch = desk.wait_next(token)
            except RuntimeError:  # superseded while waiting: the newer iterator goes on
                if desk.is_current(token):  # anything else (not started) is the caller's to see
                    raise
                batch = None
        if batch is None:
            raise StopIteration
        if self._read_ahead:
            desk.hold(token, batch)  # applied when the caller takes it (``consumed``)
        else:
            desk.apply_and_hold(batch)  # handed to the caller = applied (see the module docstring)
            self._held[token] = batch
        raw = self._ring.memory.buffer(batch.slot)[: self._end[batch.bucket]]
        return raw, np.array([batch.bucket, batch.batch_id, batch.rows, token], np.int64)

    def consumed(self, info: np.ndarray, keep_slot: bool) -> np.int64:
        """The dataset's caller took the element ``info`` describes (read-ahead mode only)."""
        self._desk.consume_read_ahead(int(info[_TOKEN]), int(info[_BATCH_ID]), keep_slot)
        return np.int64(0)

    def release(self, token_arr: np.ndarray) -> np.int64:
        """Free the slot iterator ``token`` holds (next element, or the iterator ended or was dropped)."""
        held = self._held.pop(int(token_arr), None)
        if held is not None:
            self._desk.free_held_slot(held)
        return np.int64(0)


def _build(
    tables: _Tables,
    spec: tuple[dict[str, tf.TensorSpec], tf.TensorSpec],
    big: dict[str, tuple[int, ...]] | None,
    cut: Sequence[ExtraSpec] | None,
    raw: tf.Tensor,
    info: tf.Tensor,
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """The element from the slot bytes and the info vector (runs inside the dataset's graph); ``cut``: the
    extras of ``token_axis="longest"`` (None: the bucket's width)."""
    bucket = info[_BUCKET]
    arrays = {k: tables.array(raw, bucket, k) for k in tables.names}
    if big is not None:  # single_shape: pad every array to the largest bucket (a copy)
        for k, t in arrays.items():
            pad = tf.constant(big[k], tf.int32) - tf.shape(t)
            # Pad forwards its input when nothing is added: copy then, so no element aliases a slot.
            arrays[k] = tf.cond(
                tf.reduce_any(pad > 0),
                lambda t=t, pad=pad: tf.pad(t, tf.stack([tf.zeros_like(pad), pad], axis=1)),
                lambda t=t: tf.raw_ops.DeepCopy(x=t),
            )
    if cut is not None:
        arrays = cut_to_longest(arrays, cut)
    mel = arrays["mel"]
    rows_b, frames = tf.shape(mel)[0], tf.shape(mel)[1]
    rows = tf.cast(info[_ROWS], tf.int32)
    derived = {
        "frames": lambda: tf.fill([rows_b], frames),
        "batch_id": lambda: tf.fill([rows_b], info[_BATCH_ID]),
        "rows": lambda: rows,
        "row_mask": lambda: tf.sequence_mask(rows, rows_b),
    }
    feats = {k: tf.ensure_shape(arrays[k] if k in arrays else derived[k](), s.shape) for k, s in spec[0].items()}
    return feats, tf.ensure_shape(mel, spec[1].shape)


def _spec(
    consumer: Consumer,
    features: Sequence[str],
    big: dict[str, tuple[int, ...]] | None,
    cut: Sequence[ExtraSpec] | None = None,
) -> tuple[dict[str, tf.TensorSpec], tf.TensorSpec]:
    m = consumer._cfg.n_mels
    if big is not None:
        shapes: dict[str, tuple[int | None, ...]] = dict(big)
        b = big["mel"][0]
    else:
        shapes = {k: _varying_dims(consumer, k) for k in consumer.bucket_shapes[0]}  # extras too
        shapes.update({"tokens": (None, None), "tok_len": (None,), "mel_len": (None,), "mel": (None, None, m)})
        b = None
    shapes.update(frames=(b,), batch_id=(b,), rows=(), row_mask=(b,))
    for k in cut_names(cut) if cut is not None else ():  # the cut's width is each batch's own
        shapes[k] = (shapes[k][0], None, *shapes[k][2:])
    dtypes = {**{k: tf.as_dtype(v) for k, v in consumer._bucket_set.buckets[0].dtypes().items()}, **_DERIVED}
    feats = {k: tf.TensorSpec(shapes[k], dtypes[k], name=k) for k in features}
    return feats, tf.TensorSpec(shapes["mel"], dtypes["mel"], name="mel")  # float16 on a float16 wire


def _read_ahead(ds: tf.data.Dataset, device: str, source: _DatasetSource) -> tf.data.Dataset:
    """Copy to ``device`` (a GPU) and prefetch there, or prefetch on the host; then count consumption.

    The last stage runs only when the caller takes an element (nothing follows it), so its hook
    marks exactly the batches the caller received as applied.
    """
    is_copy = "GPU" in device.upper()
    if is_copy:
        ds = ds.apply(tf.data.experimental.copy_to_device(device))
        with tf.device(device):
            ds = ds.prefetch(_PREFETCH_BATCHES)
    else:
        ds = ds.prefetch(_PREFETCH_BATCHES)

    def hook(feats: dict[str, tf.Tensor], mel: tf.Tensor, info: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        with tf.device("/CPU:0"):
            done = tf.numpy_function(
                lambda i: source.consumed(i, keep_slot=not is_copy), [info], tf.int64, stateful=True
            )
        with tf.control_dependencies([done]):
            return {k: tf.identity(v) for k, v in feats.items()}, tf.identity(mel)

    return ds.map(hook)


def _big_shapes(consumer: Consumer) -> dict[str, tuple[int, ...]]:
    """The shape of every array when padded to the largest bucket in each dimension."""
    shapes = consumer.bucket_shapes
    return {k: tuple(max(s[k][d] for s in shapes) for d in range(len(shapes[0][k]))) for k in shapes[0]}


def _varying_dims(consumer: Consumer, key: str) -> tuple[int | None, ...]:
    """``key``'s shape across buckets: rows and any dim that differs between buckets are None."""
    shapes = [s[key] for s in consumer.bucket_shapes]
    return (None, *(d if all(s[i] == d for s in shapes) else None for i, d in enumerate(shapes[0]) if i > 0))


def make_dataset(
    consumer: Consumer,
    single_shape: bool,
    features: Sequence[str],
    prefetch_device: str | None = "auto",
    token_axis: str = "bucket",
) -> tf.data.Dataset:
    """The dataset described in the module docstring.

    ``prefetch_device``: "auto" (the model GPU when TensorFlow sees one, else none), None, or a device
    name; see "Read-ahead to the model device" in the module docstring. ``token_axis``: "bucket" (the
    bucket's width) or "longest" (cut to the batch's longest row).

    Raises:
        ValueError: ``features`` is empty or names a key outside ``feature_keys(consumer)``, or ``token_axis``
            is not one of ``TOKEN_AXES``.
    """
    if token_axis not in TOKEN_AXES:
        raise ValueError(f"token_axis must be one of {list(TOKEN_AXES)}, got {token_axis!r}")
    allowed = feature_keys(consumer)
    if isinstance(features, str):  # features="tokens": one key, not its letters
        features = (features,)
    unknown = [k for k in features if k not in allowed]
    if unknown or not features:
        raise ValueError(
            f"features must be a non-empty subset of {allowed}, got {tuple(features)}"
            + (f"; unknown: {unknown}" if unknown else "")
        )
    keys = tuple(features)
    cut = consumer.extras if token_axis == "longest" else None
    arrays = consumer.bucket_shapes[0]  # the slot's arrays: base, then extras
    read = keys if cut is None else ("tok_len", *program_inputs(keys, cut, token_axis))  # + the cut's lengths
    tables = _Tables(consumer, ["mel", *dict.fromkeys(k for k in read if k in arrays and k != "mel")])
    big = _big_shapes(consumer) if single_shape else None
    device = resolve_prefetch_device(prefetch_device)
    source = _DatasetSource(consumer, tables, read_ahead=device is not None)
    spec = _spec(consumer, keys, big, cut)

    def begin(_: Any) -> tf.Tensor:
        return tf.numpy_function(source.begin, [], tf.int64, stateful=True)

    def fetch(token: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        raw, info = tf.numpy_function(source.next, [token], [tf.uint8, tf.int64], stateful=True)
        return tf.ensure_shape(raw, [None]), tf.ensure_shape(info, [4])

    def finalize(token: tf.Tensor) -> tf.Tensor:
        return tf.numpy_function(source.release, [token], tf.int64, stateful=True)

    def per_iterator(dummy: tf.Tensor) -> tf.data.Dataset:  # a fresh token for every iterator
        return _GeneratorDataset(
            dummy, begin, fetch, finalize, (tf.TensorSpec([None], tf.uint8), tf.TensorSpec([4], tf.int64))
        )

    ds = tf.data.Dataset.from_tensors(np.int64(0)).flat_map(per_iterator)
    if device is not None:  # the info vector travels to the hook after the stage
        ds = _read_ahead(ds.map(lambda raw, info: (*_build(tables, spec, big, cut, raw, info), info)), device, source)
    else:
        ds = ds.map(lambda raw, info: _build(tables, spec, big, cut, raw, info))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # no read-ahead past the hand-out point
    options.experimental_optimization.map_parallelization = False  # a parallel map would pull elements ahead
    return ds.with_options(options)
