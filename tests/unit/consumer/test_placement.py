"""melfeed.consumer.placement: which env the consumer sets before TensorFlow is imported (model GPU, XLA cache),
the refusal when TensorFlow was imported first, the memory settings, and the config validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.placement import (
    XLA_CACHE_FLAG,
    active_xla_cache_dir,
    apply_placement,
    configure_memory,
    placement_env,
    step_devices,
    xla_cache_dir,
    xla_cache_warm,
)
from melfeed.consumer.xla_cache import cache_namespace, step_identity, xla_cache_namespace
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from tests.conftest import REPO
from tests.fakes import FakeNvml


def _cfg(**consumer: Any) -> PipelineConfig:
    return config_from_mapping({"consumer": consumer})


@pytest.mark.parametrize("value", ["0", "1,3", "GPU-8f6c1e2a-0b1c-4d5e-9f00-123456789abc", "MIG-GPU-ab12/1/0", ""])
def test_model_gpu_accepts_indices_and_uuids(value: str) -> None:
    assert _cfg(model_gpu=value).consumer.model_gpu == value


@pytest.mark.parametrize("value", ["gpu0", "0, 1", "0,,1", "-1", "cuda:0", ","])
def test_a_bad_model_gpu_is_one_line_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(model_gpu=value)
    assert str(err.value).startswith("consumer.model_gpu: ") and "\n" not in str(err.value)


def test_a_bad_memory_limit_names_its_key() -> None:
    with pytest.raises(ConfigError, match=r"^consumer.gpu_memory_limit_mb: must be >= 64"):
        _cfg(gpu_memory_limit_mb=10)


def test_model_gpu_sets_visible_devices_in_pci_order_and_an_inherited_list_gets_the_order_too() -> None:
    assert placement_env(_cfg(model_gpu="1"), {}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert (
        placement_env(_cfg(model_gpu="1"), {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    )  # its own list: NVML's numbering
    assert placement_env(_cfg(), {"CUDA_VISIBLE_DEVICES": "0"}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert placement_env(_cfg(), {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == {}  # the user's choice stays


def test_the_cache_lives_in_the_state_dir_unless_a_shared_dir_is_named(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert xla_cache_dir(_cfg(state_dir=str(state))) == (state / "xla-cache").resolve()
    shared = tmp_path / "shared-cache"
    assert xla_cache_dir(_cfg(state_dir=str(state), xla_cache_dir=str(shared))) == shared.resolve()
    assert xla_cache_dir(_cfg()) is None


def test_the_cache_flag_replaces_an_older_one_and_keeps_other_flags(tmp_path: Path) -> None:
    env = {"TF_XLA_FLAGS": f"--tf_xla_auto_jit=2 {XLA_CACHE_FLAG}=/old"}
    flags = placement_env(_cfg(xla_cache_dir=str(tmp_path)), env)["TF_XLA_FLAGS"]
    assert flags == f"--tf_xla_auto_jit=2 {XLA_CACHE_FLAG}={tmp_path.resolve()}"
    assert active_xla_cache_dir({"TF_XLA_FLAGS": flags}) == tmp_path.resolve()
    assert active_xla_cache_dir({}) is None


def test_apply_sets_the_env_and_creates_the_cache_dir_before_tensorflow(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    cache = tmp_path / "c"
    changed = apply_placement(_cfg(model_gpu="2", xla_cache_dir=str(cache)), env, modules={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    active = active_xla_cache_dir(env)
    assert active is not None and active.parent == cache.resolve() and active.name.startswith("tf")  # namespaced
    assert env["TF_XLA_FLAGS"] == f"{XLA_CACHE_FLAG}={active}" and changed == env
    assert active.is_dir() and xla_cache_warm(active) is False
    assert (active.stat().st_mode & 0o027, cache.stat().st_mode & 0o027) == (0, 0)


def test_the_cache_made_inside_a_new_state_dir_keeps_the_state_dir_private(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    apply_placement(_cfg(state_dir=str(state)), {}, modules={})
    assert (state / "xla-cache").is_dir()
    assert state.stat().st_mode & 0o027 == 0 and (tmp_path / "new").stat().st_mode & 0o027 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user needs root to make")
def test_an_xla_cache_another_user_could_write_is_refused_naming_the_key(tmp_path: Path) -> None:
    cache = tmp_path / "team-cache"  # TensorFlow would load compiled code from it
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    env: dict[str, str] = {}
    with pytest.raises(
        ConfigError,
        match=f"consumer.xla_cache_dir: cannot use {cache} as the XLA compilation cache: .* belongs to uid 65534",
    ):
        apply_placement(_cfg(xla_cache_dir=str(cache)), env, modules={})
    assert env == {}
    with pytest.raises(ConfigError, match="consumer.state_dir: cannot use .* belongs to uid 65534"):
        apply_placement(_cfg(state_dir=str(cache)), env, modules={})


def test_apply_refuses_once_tensorflow_is_imported_with_a_different_setting() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(ConfigError, match=r"^consumer.model_gpu: TensorFlow was imported before"):
        apply_placement(_cfg(model_gpu="1"), env, modules={"tensorflow": object()})
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}  # nothing half-applied


def test_apply_after_tensorflow_changes_nothing_when_the_visible_gpus_match(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    late_cache = _cfg(model_gpu="1", xla_cache_dir=str(tmp_path / "c"))  # too late: warned, not set
    assert apply_placement(late_cache, env, modules={"tensorflow": object()}) == {}
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert apply_placement(_cfg(), {}, modules={"tensorflow": object()}) == {}


def test_the_cache_is_warm_once_it_holds_a_program(tmp_path: Path) -> None:
    assert xla_cache_warm(None) is None
    assert xla_cache_warm(tmp_path / "missing") is False
    (tmp_path / "xla_compile_cache__1__2__XLA_CPU_JIT.pb").write_bytes(b"x")
    assert xla_cache_warm(tmp_path) is True


class _FakeConfig:
    """tf.config's two calls, recorded."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus = [type("Dev", (), {"name": g})() for g in gpus]
        self.calls: list[tuple[str, Any]] = []
        self.experimental = self
        self.LogicalDeviceConfiguration = lambda memory_limit: memory_limit

    def list_physical_devices(self, kind: str) -> list[Any]:
        return self.gpus if kind == "GPU" else []

    def set_memory_growth(self, gpu: Any, on: bool) -> None:
        self.calls.append(("growth", gpu.name))

    def set_logical_device_configuration(self, gpu: Any, confs: list[int]) -> None:
        self.calls.append(("limit", (gpu.name, confs)))


def test_memory_growth_by_default_and_the_cap_when_set() -> None:
    tf: Any = type("TF", (), {})()
    tf.config = _FakeConfig(["/physical_device:GPU:0", "/physical_device:GPU:1"])
    assert len(configure_memory(_cfg(), tf)) == 2
    assert tf.config.calls == [("growth", "/physical_device:GPU:0"), ("growth", "/physical_device:GPU:1")]
    tf.config.calls.clear()
    configure_memory(_cfg(gpu_memory_limit_mb=4096), tf)
    assert tf.config.calls == [
        ("limit", ("/physical_device:GPU:0", [4096])),
        ("limit", ("/physical_device:GPU:1", [4096])),
    ]


def test_a_model_gpu_tensorflow_cannot_see_is_a_config_error_naming_the_key_and_what_it_sees() -> None:
    tf: Any = type("TF", (), {})()
    tf.config = _FakeConfig([])  # "7" on a host without it: no GPU visible
    with pytest.raises(
        ConfigError,
        match=r"^consumer.model_gpu: names 1 GPU\(s\) but TensorFlow sees no GPU .*"
        r", got '7'$",
    ):
        configure_memory(_cfg(model_gpu="7"), tf)
    assert tf.config.calls == []  # refused before any setting
    assert configure_memory(_cfg(model_gpu=""), tf) == []  # "" = the CPU on purpose
    tf.config = _FakeConfig(["/physical_device:GPU:0"])  # "0,1" in a container that shows one
    with pytest.raises(ConfigError, match=r"names 2 GPU\(s\) but TensorFlow sees /physical_device:GPU:0: "):
        configure_memory(_cfg(model_gpu="0,1"), tf)


def test_step_devices_names_each_distinct_device() -> None:
    dev = type("T", (), {"device": "/job:localhost/replica:0/task:0/device:CPU:0"})()
    assert step_devices({"loss": dev, "acc": dev}) == ["/job:localhost/replica:0/task:0/device:CPU:0"]


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter with only the repo on the path (TensorFlow not imported yet)."""
    env = {"PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.tf
def test_prepare_in_a_fresh_process_sets_the_env_before_tensorflow_and_the_real_import_then_refuses_a_change(
    tmp_path: Path,
) -> None:
    """The real order: no TF at first, the env set, then TF imported (memory settings a no-op on CPU). Then, the real
    TensorFlow being imported, the same model_gpu is fine and one that would change the visible GPUs is refused
    (one fresh process for both: its TensorFlow import is most of the cost)."""
    code = (
        "import os, sys\n"
        "from melfeed.shared.config.loader import config_from_mapping\n"
        "from melfeed.shared.errors import ConfigError\n"
        "from melfeed.consumer.placement import apply_placement, prepare_tensorflow, XLA_CACHE_FLAG\n"
        "assert 'tensorflow' not in sys.modules\n"
        f"cfg = config_from_mapping({{'consumer': {{'model_gpu': '', 'xla_cache_dir': {str(tmp_path)!r}}}}})\n"
        "prepare_tensorflow(cfg)\n"
        "import tensorflow as tf\n"
        "assert os.environ['CUDA_VISIBLE_DEVICES'] == '' and XLA_CACHE_FLAG in os.environ['TF_XLA_FLAGS']\n"
        "assert tf.config.list_physical_devices('GPU') == []\n"
        "print(tf.constant(1.0).device)\n"
        "apply_placement(config_from_mapping({'consumer': {'model_gpu': ''}}))\n"  # same: fine
        "try:\n"
        "    apply_placement(config_from_mapping({'consumer': {'model_gpu': '1'}}))\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
    )
    proc = _fresh_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[0].endswith("device:CPU:0"), proc.stdout  # TensorFlow on the CPU
    assert lines[1:] == [lines[-1]] and lines[-1].startswith(  # the refusal, alone
        "consumer.model_gpu: TensorFlow was imported before it could be applied"
    ), proc.stdout


def test_the_cache_namespace_names_tensorflow_the_gpus_the_driver_the_flags_and_the_step() -> None:
    env = {"TF_XLA_FLAGS": f"--tf_xla_auto_jit=2 {XLA_CACHE_FLAG}=/somewhere"}
    name = cache_namespace("2.21.0", ["NVIDIA H100 80GB HBM3"], "550.54.15", env, "abc")
    assert name.startswith("tf2.21.0-nvidia-h100-80gb-hbm3-drv550.54.15-flags") and name.endswith("-stepabc")
    assert cache_namespace("2.21.0", ["cpu"], None, {}, "abc").startswith("tf2.21.0-cpu-flags")
    same_flags = cache_namespace(
        "2.21.0", ["NVIDIA H100 80GB HBM3"], "550.54.15", {"TF_XLA_FLAGS": "--tf_xla_auto_jit=2"}, "abc"
    )
    assert same_flags == name  # the cache flag itself is not part of it
    assert cache_namespace(
        "2.21.0", ["cpu"], None, {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}, "abc"
    ) != cache_namespace("2.21.0", ["cpu"], None, {}, "abc")
    assert cache_namespace("2.22.0", ["cpu"], None, {}, "abc") != cache_namespace("2.21.0", ["cpu"], None, {}, "abc")


def test_the_step_identity_follows_model_step_and_the_bucket_shapes() -> None:
    one = [[("mel", (16, 64, 80))]]
    base = step_identity(_cfg(), lambda cfg: one)
    assert base == step_identity(_cfg(), lambda cfg: one)
    assert base != step_identity(_cfg(), lambda cfg: [[("mel", (16, 72, 80))]])
    other = config_from_mapping({"model": {"step": "tests.steps:tiny_step"}})
    assert base != step_identity(other, lambda cfg: one)


def test_the_namespace_names_the_model_gpu_as_nvml_matches_it_by_uuid() -> None:
    nvml = FakeNvml(["GPU-aaaa-0000", "GPU-bbbb-1111"], names=["NVIDIA RTX A4000", "NVIDIA H100 PCIe"])
    name = xla_cache_namespace(_cfg(model_gpu="GPU-bbbb"), {}, nvml=nvml)
    assert "-nvidia-h100-pcie-drv550.54.15-" in name and "a4000" not in name and nvml.shut
    assert "-cpu-" in xla_cache_namespace(_cfg(model_gpu=""), {}, nvml=nvml)  # no GPU visible
    inherited = xla_cache_namespace(_cfg(), {"CUDA_VISIBLE_DEVICES": "0"}, nvml=nvml)
    assert "-nvidia-rtx-a4000-" in inherited
