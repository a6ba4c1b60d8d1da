"""``melfeed deploy``: rendered units, rescaling, bad flags, ``systemd-analyze`` verify/security."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[4]
# Exposure scores from `systemd-analyze security --offline=yes` in tenths (0 = locked down, 100 = exposed),
# measured with --user root (a dedicated user scores lower).
# Ratchet: lower these when the units get tighter; a test fails if a change makes them worse.
SECURITY_THRESHOLD = {"consumer.service": 40, "producer@1.service": 40}  # tenths: 40 = 4.0

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed on this machine"
)


def _deploy(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "units").mkdir(exist_ok=True)  # deploy writes into an existing directory only
    config = tmp_path / "melfeed.yaml"
    if not config.exists():
        config.write_text(
            yaml.safe_dump({"cache_dir": "/srv/cache", "producer": {"data_gpu": "1"}, "consumer": {"model_gpu": "0"}})
        )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "deploy",
            "--user",
            "root",
            "--config",
            str(config),
            "--target-dir",
            str(tmp_path / "units"),
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_units_are_rendered_with_this_venv_config_gpus_and_the_wanted_producers(tmp_path: Path) -> None:
    run = _deploy(tmp_path, "--producers", "3")
    assert run.returncode == 0, run.stderr
    units = tmp_path / "units"
    consumer = (units / "consumer.service").read_text()
    producer = (units / "producer@.service").read_text()
    assert f"ExecStart={sys.prefix}/bin/python -m melfeed consumer --config {tmp_path}/melfeed.yaml" in consumer
    assert f"WorkingDirectory={REPO}\n" in consumer and f"WorkingDirectory={REPO}\n" in producer  # deploy's cwd
    assert "CUDA_VISIBLE_DEVICES=0" in consumer and "CUDA_VISIBLE_DEVICES=1" in producer
    assert "--instance %i" in producer and "StateDirectory=melfeed" in consumer
    # 78 (configuration) and, on the consumer, 65 (too many quarantined rows): a restart cannot fix either
    assert "RestartPreventExitStatus=65 78" in consumer and "RestartPreventExitStatus=78" in producer
    assert not any(line.startswith("PrivateDevices") for line in consumer.splitlines())  # the GPU stays visible
    assert (units / "pipeline.target.d" / "producers.conf").read_text().splitlines()[
        -1
    ] == "Wants=producer@1.service producer@2.service producer@3.service"
    assert "@" not in consumer.replace("producer@", "").replace("pipeline.target", "")  # no placeholder left


def test_the_producer_unit_sets_nice_to_producer_nice_and_the_consumer_unit_none(tmp_path: Path) -> None:
    (tmp_path / "melfeed.yaml").write_text(yaml.safe_dump({"cache_dir": "/srv/cache", "producer": {"nice": 12}}))
    assert _deploy(tmp_path, "--producers", "1").returncode == 0
    units = tmp_path / "units"
    assert [ln for ln in (units / "producer@.service").read_text().splitlines() if ln.startswith("Nice=")] == [
        "Nice=12"
    ]
    assert "Nice=" not in (units / "consumer.service").read_text()  # the step keeps its priority


def test_rescaling_rewrites_only_the_drop_in_and_says_which_instances_to_stop(tmp_path: Path) -> None:
    assert _deploy(tmp_path, "--producers", "4").returncode == 0
    down = _deploy(tmp_path, "--producers", "2")
    assert down.returncode == 0
    assert down.stdout.count("wrote ") == 1 and "producers.conf" in down.stdout
    assert "systemctl stop producer@3.service producer@4.service" in down.stdout
    again = _deploy(tmp_path, "--producers", "2")
    assert "units already up to date" in again.stdout and "systemctl stop" not in again.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--producers", "-1"), "--producers: must be >= 0, got -1"),
        (("--producers", "0"), "--producers: 0 needs a consumer whose transport.endpoint is tcp://"),
        (("--producers", "2", "--prefix", "/nonexistent"), "--prefix: has no executable /nonexistent/bin/python"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag_and_exit_78(
    tmp_path: Path, flags: tuple[str, ...], needle: str
) -> None:
    run = _deploy(tmp_path, *flags)
    assert run.returncode == 78
    assert needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--state-dir", "/x\nExecStartPre=/bin/touch /tmp/pwned"), "--state-dir: must not contain control characters"),
        (("--env-file", "/etc/melfeed/m.env\n[Service]"), "--env-file: must not contain control characters"),
        (("--user", "root\nUser=nobody"), "--user: must not contain control characters"),
        (("--state-dir", "/x --model-step evil:run"), "--state-dir: must not contain ' ' (systemd would split"),
        (("--state-dir", "/var/lib/%h"), "--state-dir: must not contain '%'"),
        (("--state-dir", "state"), "--state-dir: must be an absolute path"),
        (("--env-file", "melfeed.env"), "--env-file: must be an absolute path"),
        (("--group", "no-such-group-melfeed"), "--group: is not a group on this host"),
        (("--producers", "65"), "--producers: must be in 1..64 (the bound on producer.count), got 65"),
        (("--target-dir", "{tmp}/nowhere/units"), "--target-dir: does not exist (deploy creates no unit directory)"),
        (("--target-dir", "{tmp}/melfeed.yaml"), "--target-dir: is not a directory"),
    ],
)
def test_a_value_that_would_break_or_inject_into_a_unit_is_one_line_and_nothing_is_written(
    tmp_path: Path, flags: tuple[str, ...], needle: str
) -> None:
    flags = tuple(flag.format(tmp=tmp_path) for flag in flags)
    run = _deploy(tmp_path, *(() if "--producers" in flags else ("--producers", "1")), *flags)
    assert run.returncode == 78, run.stdout + run.stderr
    assert needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not any((tmp_path / "units").iterdir()) and not (tmp_path / "nowhere").exists()


def test_a_config_value_with_a_newline_never_reaches_a_unit(tmp_path: Path) -> None:
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.service.units import DeployPlan, render_units

    config = tmp_path / "melfeed.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": "/srv/cache"}))
    good = DeployPlan(Path(sys.executable), config, "root", "root", 1, "/var/lib/melfeed", "/etc/melfeed.env")
    assert "ExecStartPre" not in render_units(good)[Path("consumer.service")]
    bad = DeployPlan(
        Path(sys.executable), config, "root", "root", 1, "/var/lib/x\nExecStartPre=/bin/true", "/etc/melfeed.env"
    )  # a plan built around plan_from_args: the renderer still refuses
    with pytest.raises(ConfigError, match="^--state-dir: must not contain control characters"):
        render_units(bad)


def test_a_file_in_the_way_of_a_unit_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "units" / "pipeline.target.d" / "producers.conf").mkdir(parents=True)  # a directory, not a file
    run = _deploy(tmp_path, "--producers", "1")
    assert run.returncode == 78 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"melfeed deploy: --target-dir: cannot write {tmp_path}/units/pipeline.target.d/producers.conf: "
        f"Is a directory, got '{tmp_path}/units/pipeline.target.d'"
    ]


def test_an_unknown_user_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "deploy",
            "--producers",
            "1",
            "--user",
            "no-such-user-melfeed",
            "--target-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 78 and "--user: is not a user on this host" in run.stderr


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, paths)], capture_output=True, text=True, timeout=60
    )


@needs_systemd
def test_systemd_analyze_verify_reports_nothing_on_the_rendered_units(tmp_path: Path) -> None:
    assert _deploy(tmp_path, "--producers", "2").returncode == 0
    units = tmp_path / "units"
    paths = [units / "pipeline.target", units / "consumer.service", units / "producer@1.service"]
    run = _verify(paths)
    assert run.returncode == 0 and run.stderr == "", run.stderr  # unknown keys only warn: any output fails
    broken = units / "consumer.service"
    broken.write_text(broken.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    assert "Unknown key 'WatchdogSecs'" in _verify(paths).stderr  # the check can fail


@needs_systemd
@pytest.mark.parametrize("unit", sorted(SECURITY_THRESHOLD))
def test_hardening_exposure_stays_at_or_below_the_ratchet(tmp_path: Path, unit: str) -> None:
    assert _deploy(tmp_path, "--producers", "1").returncode == 0
    run = subprocess.run(
        [
            "systemd-analyze",
            "security",
            "--offline=yes",
            f"--threshold={SECURITY_THRESHOLD[unit]}",
            str(tmp_path / "units" / unit),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout[-600:] + run.stderr


def _tf_configs(tmp_path: Path) -> list[Path]:
    """One job's TF_CONFIG files: the same cluster, task index 0 and 1."""
    paths = []
    for index in (0, 1):
        path = tmp_path / f"tf_config-{index}.json"
        path.write_text(
            json.dumps(
                {
                    "cluster": {"worker": ["127.0.0.1:20000", "127.0.0.1:20001"]},
                    "task": {"type": "worker", "index": index},
                }
            ),
            encoding="utf-8",
        )
        paths.append(path)
    return paths


def _deploy_rank(tmp_path: Path, rank: int, producers: int = 2) -> subprocess.CompletedProcess[str]:
    tf_config = _tf_configs(tmp_path)[rank]
    return _deploy(tmp_path, "--producers", str(producers), "--rank", str(rank), "--tf-config", str(tf_config))


def test_two_ranks_units_on_one_host_share_no_name_directory_or_socket(tmp_path: Path) -> None:
    written: dict[int, set[str]] = {}
    for rank in (0, 1):
        run = _deploy_rank(tmp_path, rank)
        assert run.returncode == 0, run.stderr
        written[rank] = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("wrote ")}
        assert f"systemctl enable pipeline-rank{rank}.target" in run.stdout
        assert f"status --endpoint ipc:///run/melfeed-rank{rank}/melfeed-rank{rank}.control.sock" in run.stdout
        assert f"TensorFlow server listens on 127.0.0.1:2000{rank}" in run.stdout
    assert len(written[0]) == len(written[1]) == 4 and not written[0] & written[1]
    units = tmp_path / "units"
    assert not (units / "consumer.service").exists() and not (units / "pipeline.target").exists()
    for rank, tf_config in enumerate(_tf_configs(tmp_path)):
        sfx = f"-rank{rank}"
        consumer = (units / f"consumer{sfx}.service").read_text()
        producer = (units / f"producer{sfx}@.service").read_text()
        target = (units / f"pipeline{sfx}.target").read_text()
        assert (
            f"consumer --config {tmp_path}/melfeed.yaml --state-dir /var/lib/melfeed{sfx} --tf-config "
            f"{tf_config} --rank {rank}\n" in consumer
        )
        assert (
            f"producer --config {tmp_path}/melfeed.yaml --instance %i --tf-config {tf_config} --rank {rank}\n"
            in producer
        )
        for text in (consumer, producer):
            assert f"RuntimeDirectory=melfeed{sfx}\n" in text and f"PartOf=pipeline{sfx}.target\n" in text
            assert f", rank {rank} of 2 (" in text and re.search(r"@[A-Z_]+@", text) is None
        assert f"StateDirectory=melfeed{sfx}\n" in consumer and f"WantedBy=pipeline{sfx}.target\n" in consumer
        assert f"After=consumer{sfx}.service\n" in producer and f"Wants=consumer{sfx}.service\n" in target
        assert (units / f"pipeline{sfx}.target.d" / "producers.conf").read_text().splitlines()[
            -1
        ] == f"Wants=producer{sfx}@1.service producer{sfx}@2.service"


def test_rescaling_one_rank_leaves_the_other_ranks_units_alone(tmp_path: Path) -> None:
    assert _deploy_rank(tmp_path, 0, producers=3).returncode == 0
    assert _deploy_rank(tmp_path, 1, producers=3).returncode == 0
    down = _deploy_rank(tmp_path, 1, producers=1)
    assert down.returncode == 0 and down.stdout.count("wrote ") == 1 and "pipeline-rank1.target.d" in down.stdout
    assert "systemctl stop producer-rank1@2.service producer-rank1@3.service" in down.stdout
    assert "producer-rank0@3.service" in (tmp_path / "units" / "pipeline-rank0.target.d" / "producers.conf").read_text()


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing", "--tf-config {tmp}/missing.json: cannot read"),
        ("mismatch", "--rank: 1, but --tf-config {tmp}/tf_config-0.json names task worker:0, which is rank 0 of 2"),
        (
            "out of range",
            "--rank: 2 is not a rank of the cluster in --tf-config {tmp}/tf_config-0.json: ranks are 0..1",
        ),
        ("not json", "--tf-config {tmp}/tf_config-0.json: invalid JSON"),
        ("rank alone", "--rank: needs --tf-config FILE"),
        ("file alone", "--tf-config: needs --rank R"),
    ],
)
def test_a_bad_rank_or_tf_config_is_one_line_exit_78_and_writes_nothing(tmp_path: Path, case: str, needle: str) -> None:
    tf0 = _tf_configs(tmp_path)[0]
    flags = {
        "missing": ("--rank", "0", "--tf-config", str(tmp_path / "missing.json")),
        "mismatch": ("--rank", "1", "--tf-config", str(tf0)),
        "out of range": ("--rank", "2", "--tf-config", str(tf0)),
        "not json": ("--rank", "0", "--tf-config", str(tf0)),
        "rank alone": ("--rank", "0"),
        "file alone": ("--tf-config", str(tf0)),
    }[case]
    if case == "not json":
        tf0.write_text('{"cluster": ', encoding="utf-8")
    run = _deploy(tmp_path, "--producers", "1", *flags)
    assert run.returncode == 78, run.stdout + run.stderr
    assert needle.format(tmp=tmp_path) in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not any((tmp_path / "units").iterdir())


@needs_systemd
def test_systemd_analyze_verify_reports_nothing_on_two_ranks_units(tmp_path: Path) -> None:
    paths = []
    for rank in (0, 1):
        assert _deploy_rank(tmp_path, rank).returncode == 0
        units = tmp_path / "units"
        paths += [
            units / f"pipeline-rank{rank}.target",
            units / f"consumer-rank{rank}.service",
            units / f"producer-rank{rank}@1.service",
        ]
    run = _verify(paths)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    broken = tmp_path / "units" / "producer-rank1@.service"
    broken.write_text(broken.read_text().replace("RuntimeDirectory=", "RuntimeDirectorys="))
    assert "Unknown key 'RuntimeDirectorys'" in _verify(paths).stderr  # the check can fail


@needs_systemd
def test_a_producer_host_gets_a_rank_s_producers_and_no_consumer(tmp_path: Path) -> None:
    tf_config = _tf_configs(tmp_path)[1]
    assert (
        "--producers-only: needs transport.endpoint tcp://"
        in _deploy(tmp_path, "--producers", "2", "--producers-only").stderr
    )
    (tmp_path / "melfeed.yaml").write_text(
        yaml.safe_dump(
            {
                "cache_dir": "/srv/cache",
                "transport": {
                    "endpoint": "tcp://10.0.0.2:5555",
                    "curve_secret_key": "/etc/melfeed/keys/feed1.key_secret",
                    "curve_server_key": "/etc/melfeed/keys/consumer.key",
                },
            }
        )
    )
    run = _deploy(tmp_path, "--producers", "2", "--producers-only", "--rank", "1", "--tf-config", str(tf_config))
    assert run.returncode == 0, run.stderr
    units = tmp_path / "units"
    assert sorted(p.name for p in units.iterdir()) == [
        "pipeline-rank1.target",
        "pipeline-rank1.target.d",
        "producer-rank1@.service",
    ]
    target = (units / "pipeline-rank1.target").read_text()
    assert "Wants=consumer" not in target and "note:" not in run.stdout
    assert f"--instance %i --tf-config {tf_config} --rank 1\n" in (units / "producer-rank1@.service").read_text()
    run = _verify([units / "pipeline-rank1.target", units / "producer-rank1@1.service"])
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_a_rank_whose_producers_are_elsewhere_gets_a_consumer_and_no_producer(tmp_path: Path) -> None:
    (tmp_path / "melfeed.yaml").write_text(
        yaml.safe_dump(
            {
                "cache_dir": "/srv/cache",
                "transport": {
                    "endpoint": "tcp://10.0.0.2:5555",
                    "curve_secret_key": "/etc/melfeed/keys/consumer.key_secret",
                    "curve_allowed_dir": "/etc/melfeed/keys/producers",
                },
            }
        )
    )
    run = _deploy(tmp_path, "--producers", "0", "--rank", "1", "--tf-config", str(_tf_configs(tmp_path)[1]))
    assert run.returncode == 0, run.stderr
    assert "# no producer on this host" in run.stdout
    assert "note: " in run.stdout and "sets transport.endpoint (tcp://10.0.0.2:5555)" in run.stdout
    units = tmp_path / "units"
    assert "Wants=" not in (units / "pipeline-rank1.target.d" / "producers.conf").read_text()
    assert "--rank 1\n" in (units / "consumer-rank1.service").read_text()


def test_a_null_model_gpu_renders_no_cuda_visible_devices_so_the_consumer_sees_the_environments_gpus(
    tmp_path: Path,
) -> None:
    (tmp_path / "melfeed.yaml").write_text(
        yaml.safe_dump({"cache_dir": "/srv/cache", "producer": {"data_gpu": "1"}, "consumer": {"model_gpu": None}})
    )
    run = _deploy(tmp_path, "--producers", "1", "--work-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    consumer = (tmp_path / "units" / "consumer.service").read_text()
    assert "CUDA_VISIBLE_DEVICES" not in consumer  # an empty value would hide every GPU
    assert "Environment=PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2\n" in consumer
    assert f"WorkingDirectory={tmp_path}\n" in consumer
    assert "CUDA_VISIBLE_DEVICES=1" in (tmp_path / "units" / "producer@.service").read_text()


def test_set_is_checked_now_and_passed_to_both_units_command_lines(tmp_path: Path) -> None:
    run = _deploy(tmp_path, "--producers", "1", "--set", "consumer.ring_slots=4", "--set", "seed=7")
    assert run.returncode == 0, run.stderr
    for unit in ("consumer.service", "producer@.service"):
        execs = [line for line in (tmp_path / "units" / unit).read_text().splitlines() if line.startswith("ExecStart=")]
        assert execs[0].endswith(" --set consumer.ring_slots=4 --set seed=7"), execs
    bad = _deploy(tmp_path, "--producers", "1", "--set", "consumer.ring_slots=2")  # the schema refuses 2
    assert bad.returncode == 78 and bad.stderr.startswith("melfeed deploy: consumer.ring_slots: "), bad.stderr
    split = _deploy(tmp_path, "--producers", "1", "--set", "model.step=my model:step")
    assert split.returncode == 78 and "put this key in the config file" in split.stderr, split.stderr
    assert len(split.stderr.strip().splitlines()) == 1
