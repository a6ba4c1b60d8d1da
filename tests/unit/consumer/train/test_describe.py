"""The one line of a failing user step: the reason kept from wrapped messages, the op's full name, the user's line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from melfeed.consumer.train import describe
from melfeed.consumer.train.describe import (
    MAX_LINE_CHARS,
    code_location,
    describe_exception,
    describe_tf_error,
    is_user_file,
)

pytestmark = pytest.mark.tf


def test_op_error_names_the_node_and_keeps_the_first_line_only() -> None:
    message = (
        'shape of dy was [8,64,80] instead of [8,0,80]\n\nStack trace for op definition:\nFile "x.py"\n'
        "\t [[{{node gradient_tape/cond/gradients/cond/strided_slice_2_grad/StridedSliceGrad}}]]\n"
        "\ttf2xla conversion failed while converting cond_false_grad"
    )
    err = tf.errors.InvalidArgumentError(None, None, message)
    assert describe_tf_error(err) == (
        "op gradient_tape/cond/gradients/cond/strided_slice_2_grad/StridedSliceGrad: "
        "shape of dy was [8,64,80] instead of [8,0,80]"
    )


def test_wrapped_user_code_error_keeps_its_original_last_line() -> None:
    wrapped = RuntimeError(
        'in user code:\n\n    File "m.py", line 3, in step\n        x[0]\n\n'
        "    TypeError: 'int' object is not subscriptable\n"
    )
    assert describe_tf_error(wrapped) == "TypeError: 'int' object is not subscriptable (m.py:3)"  # the user's line
    assert describe_tf_error(ValueError("plain")) == "ValueError: plain"
    long = describe_tf_error(tf.errors.UnimplementedError(None, None, "x" * 1000))
    assert len(long) == 300 and "\n" not in long


def test_a_failed_run_names_the_op_the_users_line_and_the_reason() -> None:
    message = (
        "Graph execution error:\n\nDetected at node Gather defined at (most recent call last):\n"
        '  File "/srv/melfeed/run_pipeline.py", line 81, in <module>\n\n'
        '  File "/home/u/tts/model.py", line 11, in __call__\n\n'
        '  File "/usr/lib/python3/site-packages/keras/src/layers/core/embedding.py", line 140, in call\n\n'
        "indices[7,2] = 50 is not in [0, 32)\n\t [[{{node Gather}}]] [Op:__inference_traced_187]"
    )
    err = tf.errors.InvalidArgumentError(None, None, message)
    assert describe_tf_error(err) == "op Gather (/home/u/tts/model.py:11): indices[7,2] = 50 is not in [0, 32)"


def test_a_factory_exception_is_one_line_with_the_line_that_raised_it() -> None:
    def factory() -> None:
        raise KeyError("hidden")  # the user's bug, one line below the def

    with pytest.raises(KeyError) as info:
        factory()
    assert describe_exception(info.value) == f"KeyError: 'hidden' ({__file__}:{factory.__code__.co_firstlineno + 1})"


def test_a_keras_wrapped_message_keeps_its_reason_lines_not_the_preamble() -> None:
    def factory() -> None:
        raise ValueError(
            "Exception encountered when calling Decoder.call().\n\n\x1b[1mshapes do not match\n"
            "[8,4] vs [8,5]\x1b[0m\n\nArguments received by Decoder.call():\n  • x=tf.Tensor(shape=(8, 4))"
        )

    with pytest.raises(ValueError) as info:
        factory()
    assert describe_exception(info.value) == (
        f"ValueError: shapes do not match [8,4] vs [8,5] ({__file__}:{factory.__code__.co_firstlineno + 1})"
    )


def test_a_trace_time_error_under_tf_keras_keeps_the_reason_not_the_call_arguments(tmp_path: Path) -> None:
    wrapped = RuntimeError(
        'in user code:\n\n    File "/srv/tts/train.py", line 20, in step  *\n        return self.decoder(x)\n'
        f'    File "{tmp_path}/tf_keras/src/engine/base_layer.py", line 10, in __call__  **\n        raise e\n'
        '    File "/srv/tts/decoder.py", line 6, in call\n        return tf.while_loop(c, b, [x])\n\n'
        "    ValueError: Exception encountered when calling layer 'decoder' (type Decoder).\n    \n"
        "    maximum_iterations is required for XLA compilation in TensorFlow 2.x.\n    \n"
        "    Call arguments received by layer 'decoder' (type Decoder):\n      • inputs=tf.Tensor(shape=(8, 4))\n"
    )
    assert describe_tf_error(wrapped) == (
        "ValueError: maximum_iterations is required for XLA compilation in TensorFlow 2.x. (/srv/tts/decoder.py:6)"
    )


def test_the_op_is_named_by_its_full_scope_where_tensorflow_gives_it() -> None:
    message = (
        "Graph execution error:\n\nDetected at node decoder/while/token_embedding/GatherV2 defined at (most "
        'recent call last):\n  File "/srv/tts/train.py", line 9, in step\n\nindices[0,1] = 50 is not in '
        "[0, 32)\n\t [[{{function_node __inference_body_12}}{{node GatherV2}}]] [Op:__inference_step_40]"
    )
    err = tf.errors.InvalidArgumentError(None, None, message)
    assert describe_tf_error(err) == (
        "op decoder/while/token_embedding/GatherV2 (/srv/tts/train.py:9): indices[0,1] = 50 is not in [0, 32)"
    )


def test_a_long_reason_is_cut_and_the_location_kept() -> None:
    wrapped = RuntimeError(
        f'in user code:\n\n    File "/srv/tts/train.py", line 7, in step\n        f()\n\n    ValueError: {"y" * 1000}\n'
    )
    line = describe_tf_error(wrapped)
    assert len(line) == MAX_LINE_CHARS and line.endswith("... (/srv/tts/train.py:7)")
    op = describe_tf_error(
        tf.errors.InvalidArgumentError(
            None,
            None,
            "Graph execution error:\n\nDetected at node a/b "
            'defined at (most recent call last):\n  File "/srv/t.py", line 3, in s\n\n' + "z" * 900,
        )
    )
    assert len(op) == MAX_LINE_CHARS and op.startswith("op a/b (/srv/t.py:3): zzz") and op.endswith("...")


def test_user_code_is_neither_stdlib_site_packages_melfeed_nor_a_package_installed_on_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "pp"  # pip install --target pp tf_keras; PYTHONPATH=pp
    (target / "tf_keras" / "src").mkdir(parents=True)
    library = target / "tf_keras" / "src" / "base_layer.py"
    library.write_text("")
    dist = target / "tf_keras-2.21.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tf_keras\nVersion: 2.21.0\n")
    (dist / "RECORD").write_text("tf_keras/src/base_layer.py,,\ntf_keras-2.21.0.dist-info/RECORD,,\n")
    own = target / "mymodel.py"  # the user's module in the same PYTHONPATH directory: not installed there
    own.write_text("")
    monkeypatch.setattr(sys, "path", [*sys.path, str(target)])
    assert not is_user_file(str(library)) and is_user_file(str(own)) and is_user_file(__file__)
    assert not is_user_file(os.__file__) and not is_user_file(describe.__file__)
    assert not is_user_file("/usr/lib/python3/dist-packages/keras/layer.py") and not is_user_file("<frozen runpy>")
    assert not is_user_file("/tmp/__autograph_generated_fileab12.py")
    assert code_location([(str(own), 3), (str(library), 10)]) == f"{own}:3"
    assert code_location([(str(library), 10)]) == f"{library}:10"  # no user frame: the innermost


def test_real_tensorflow_errors_keep_their_reason_and_the_users_line() -> None:
    import keras

    class Failing(keras.layers.Layer):  # type: ignore[misc]  # Keras is untyped
        def call(self, x: tf.Tensor) -> tf.Tensor:
            raise ValueError("the decoder needs 80 channels\ngot 3")

    raising_line = Failing.call.__code__.co_firstlineno + 1
    with pytest.raises(ValueError) as eager:
        Failing()(tf.ones((2, 3)))
    expected = f"ValueError: the decoder needs 80 channels got 3 ({__file__}:{raising_line})"
    assert describe_exception(eager.value) == expected
    with pytest.raises(ValueError) as traced:
        tf.function(lambda x: Failing()(x))(tf.ones((2, 3)))
    assert describe_tf_error(traced.value) == expected
