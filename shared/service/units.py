"""``melfeed deploy``: render the systemd units for one venv and config, and set the scale.

Writes into ``--target-dir`` (default ``/etc/systemd/system``): ``pipeline.target``,
``consumer.service``, ``producer@.service`` (templates in ``deploy/units/`` with ``@KEY@``
placeholders) and the drop-in ``pipeline.target.d/producers.conf`` whose ``Wants=`` lists
``producer@1..N``. With ``--rank R --tf-config FILE`` (one host's share of a multi-worker job) the
file is read now (a missing or unusable file, or a task that is not rank R: one line, exit 78), every
name gets the rank's suffix (``consumer-rankR.service``, ``producer-rankR@.service``,
``pipeline-rankR.target``, ``/run/melfeed-rankR``, ``/var/lib/melfeed-rankR``:
``shared/service/rank_defaults.py``), so two ranks' units on one host never collide, and both the
consumer and the producers start with ``--tf-config FILE --rank R``. A world of 1 renders today's names.
``--producers-only`` (a producer host feeding a consumer on another host over tcp + CURVE) writes no
consumer unit, and the target wants only the producers. Re-running with another N rewrites only that
drop-in (and any unit whose rendering changed) and prints the ``systemctl`` commands that apply the
change live: start the new instances, stop the ones above N. Nothing here talks to systemd; the
operator (or a test) runs those commands.
Every file is written atomically (temp + rename) into an existing ``--target-dir`` (only the drop-in
directory is created); bad flags exit 78 naming the flag. No value reaches a unit unchecked: every one
is a single line (a newline would add directives), and paths (``--state-dir``, ``--env-file``,
``--config``, ``--prefix``, ``--tf-config``) are absolute with nothing systemd splits or expands
(whitespace, ``%``, ``$``, quotes, backslash, ``;``). ``--producers`` and ``--group`` are checked like
``--user``: the config's cap on ``producer.count``, a group of this host.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.checks import check_text
from melfeed.shared.config.loader import load_config, with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import resolve_path
from melfeed.shared.output_files import check_output_dir, replace_output
from melfeed.shared.service.lifecycle import resolve_control_endpoint
from melfeed.shared.service.rank_defaults import check_expected_rank, rank_suffix, with_rank_defaults
from melfeed.shared.service.tf_config import SINGLE_WORKER, WorkerPlace, resolve_worker_place

__all__ = ["DeployPlan", "main_deploy", "render_units"]

# deploy/ of the repository; a wheel ships it as melfeed/deploy: three levels above this file either way
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
TEMPLATES = DEPLOY_DIR / "units"
UNIT_NAMES = ("pipeline.target", "consumer.service", "producer@.service")  # the templates' names
DROPIN = Path("pipeline.target.d") / "producers.conf"
DEFAULT_STATE_DIR = "/var/lib/melfeed"  # a rank's: /var/lib/melfeed-rankR (StateDirectory=)
_UNIT_SPECIAL = "%$\\\"';"  # systemd's specifiers, variables, quoting and command separator
_SOURCES = {
    "PYTHON": "--prefix",
    "WORK_DIR": "--work-dir",
    "CONFIG": "--config",
    "USER": "--user",
    "GROUP": "--group",
    "STATE_DIR": "--state-dir",
    "ENV_FILE": "--env-file",
    "RANK_ARGS": "--tf-config",
    "SET_ARGS": "--set",
    "MODEL_GPU_ENV": "consumer.model_gpu",
    "DATA_GPU": "producer.data_gpu",
}  # where each outside @KEY@ comes from


@dataclass(frozen=True, slots=True)
class DeployPlan:
    python: Path  # the venv's interpreter
    config: Path  # absolute path of the YAML config the units pass to --config
    user: str
    group: str
    producers: int
    state_dir: str
    env_file: str
    work_dir: str = "/"  # the units' WorkingDirectory: where model.step's module is found first
    tf_config: Path | None = None  # absolute path the units pass to --tf-config; None = no rank
    place: WorkerPlace = SINGLE_WORKER  # the rank and world the file names (checked against --rank)
    producers_only: bool = False  # a producer host feeding a consumer elsewhere over tcp: no consumer unit
    settings: tuple[str, ...] = ()  # --set KEY=VALUE as given, checked; passed to both units

    def effective_config(self) -> PipelineConfig:
        """The config the units run with: ``--config`` with every ``--set`` applied."""
        return _with_settings(load_config(str(self.config)), self.settings)

    @property
    def suffix(self) -> str:
        """``""`` (world of 1) or ``-rankR``: part of every unit, directory and drop-in name."""
        return rank_suffix(self.place)

    def unit_name(self, template: str) -> str:
        """``consumer.service`` -> ``consumer-rank1.service``, ``producer@.service`` -> ``producer-rank1@.service``."""
        stem, sep, rest = template.partition("@") if "@" in template else template.partition(".")
        return f"{stem}{self.suffix}{sep}{rest}"

    @property
    def dropin(self) -> Path:
        return Path(f"{self.unit_name('pipeline.target')}.d") / DROPIN.name


def _fail(flag: str, message: str, got: object) -> ConfigError:
    return ConfigError(message, path=(flag,), got=got)


def _unit_path(flag: str, value: str) -> str:
    """A path written into a unit: absolute, and nothing systemd would split, expand or end a line at.

    A newline would add directives (``ExecStartPre=``), a space another argument or path, ``%`` and ``$``
    a specifier or variable, quotes and backslashes systemd's own quoting.
    """
    check_text(value, (flag,))  # control characters: one line, as every config string (shared/config/checks.py)
    bad = sorted({ch for ch in value if ch.isspace() or ch in _UNIT_SPECIAL})
    if bad:
        raise _fail(
            flag,
            f"must not contain {' '.join(repr(ch) for ch in bad)} (systemd would split, expand or "
            "quote it in the unit)",
            value,
        )
    if not os.path.isabs(value):
        raise _fail(flag, "must be an absolute path (systemd takes no relative one)", value)
    return value


def plan_from_args(args: argparse.Namespace) -> DeployPlan:
    if args.producers < 0:
        raise _fail("--producers", "must be >= 0", args.producers)
    for flag in ("user", "group"):
        if getattr(args, flag) is not None:
            check_text(getattr(args, flag), (f"--{flag}",))
    python = resolve_path(args.prefix, ("--prefix",)) / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise _fail("--prefix", f"has no executable {python} (pass the venv the services run)", args.prefix)
    try:
        user = pwd.getpwnam(args.user)
    except KeyError:
        raise _fail("--user", "is not a user on this host", args.user) from None
    if args.group is not None:
        try:
            grp.getgrnam(args.group)
        except KeyError:
            raise _fail("--group", "is not a group on this host", args.group) from None
    group = args.group or grp.getgrgid(user.pw_gid).gr_name
    config = resolve_path(args.config, ("--config",))
    settings = tuple(_unit_setting(text) for text in (getattr(args, "set", None) or ()))
    cfg = _with_settings(load_config(str(config)), settings)  # a broken config must fail now, not at the first start
    if args.producers > 0:
        try:  # the instances share the config's cap on producer.count
            with_overrides(cfg, {"producer.count": args.producers})
        except ConfigError as err:
            raise _fail("--producers", f"{err.reason} (the bound on producer.count)", args.producers) from None
    if cfg.cache_dir is None:
        raise _fail("--config", "must set cache_dir (the services have no other way to learn it)", str(config))
    remote = (cfg.transport.endpoint or "").startswith("tcp://")
    producers_only = bool(getattr(args, "producers_only", False))
    if producers_only and not remote:
        raise _fail("--producers-only", f"needs transport.endpoint tcp://CONSUMER_HOST:PORT in {config}", True)
    if args.producers == 0 and (not remote or producers_only):
        raise _fail(
            "--producers",
            "0 needs a consumer whose transport.endpoint is tcp:// (producers on other hosts) and no --producers-only",
            0,
        )
    tf_config, place = _place_from_args(args)
    state_dir = _unit_path("--state-dir", args.state_dir or DEFAULT_STATE_DIR + rank_suffix(place))
    for flag, path in (("--prefix", str(python)), ("--config", str(config)), ("--tf-config", tf_config)):
        if path is not None:
            _unit_path(flag, str(path))
    return DeployPlan(
        python,
        config,
        args.user,
        group,
        args.producers,
        state_dir,
        _unit_path("--env-file", args.env_file),
        work_dir=_unit_path("--work-dir", str(resolve_path(args.work_dir or os.getcwd(), ("--work-dir",)))),
        tf_config=tf_config,
        place=place,
        settings=settings,
        producers_only=producers_only,
    )


def _with_settings(cfg: PipelineConfig, settings: tuple[str, ...]) -> PipelineConfig:
    from melfeed.shared.service.cli.settings import with_settings  # the parser imports this module

    return with_settings(cfg, [_parsed(text) for text in settings])


def _parsed(text: str) -> tuple[str, object]:
    from melfeed.shared.service.cli.options import setting

    try:
        return setting(text)
    except argparse.ArgumentTypeError as err:
        raise _fail("--set", str(err), text) from None


def _unit_setting(text: str) -> str:
    """One ``--set KEY=VALUE`` for a unit's command line: parsed as the other commands parse it, and refused by
    name when systemd would split, expand or quote it (whitespace, ``%``, ``$``, quotes, backslash, ``;``)."""
    _parsed(text)
    check_text(text, ("--set",))
    bad = sorted({ch for ch in text if ch.isspace() or ch in _UNIT_SPECIAL})
    if bad:
        raise _fail(
            "--set",
            f"must not contain {' '.join(repr(ch) for ch in bad)} in a unit's command line: put "
            "this key in the config file",
            text,
        )
    return text


def _place_from_args(args: argparse.Namespace) -> tuple[Path | None, WorkerPlace]:
    """``--tf-config FILE`` read now and checked against ``--rank`` (both or neither)."""
    if args.tf_config is None:
        if args.rank is not None:
            raise _fail("--rank", "needs --tf-config FILE (the TF_CONFIG this host's consumer reads)", args.rank)
        return None, SINGLE_WORKER
    if args.rank is None:
        raise _fail("--tf-config", "needs --rank R (this host's rank, checked against the file's task)", args.tf_config)
    path = resolve_path(args.tf_config, ("--tf-config",))
    place = resolve_worker_place(path, {})  # the file only: this shell's TF_CONFIG is not the units'
    check_expected_rank(place, args.rank)
    return path, place


def render_units(plan: DeployPlan) -> dict[Path, str]:
    """Relative path -> text of every file ``deploy`` writes."""
    cfg = plan.effective_config()
    sfx, place = plan.suffix, plan.place
    state_directive = (
        f"StateDirectory=melfeed{sfx}\nStateDirectoryMode=0750"
        if plan.state_dir == DEFAULT_STATE_DIR + sfx
        else f"ReadWritePaths={plan.state_dir}"
    )
    rank_args = "" if plan.tf_config is None else f" --tf-config {plan.tf_config} --rank {place.rank}"
    set_args = "".join(f" --set {text}" for text in plan.settings)
    values = {
        "PYTHON": str(plan.python),
        "WORK_DIR": plan.work_dir,
        "CONFIG": str(plan.config),
        "USER": plan.user,
        "GROUP": plan.group,
        "STATE_DIR": plan.state_dir,
        "ENV_FILE": plan.env_file,
        "STATE_DIRECTIVE": state_directive,
        # null model_gpu: the environment's GPUs (no CUDA_VISIBLE_DEVICES; an empty one would hide them all)
        "MODEL_GPU_ENV": "" if cfg.consumer.model_gpu is None else f" CUDA_VISIBLE_DEVICES={cfg.consumer.model_gpu}",
        "DATA_GPU": cfg.producer.data_gpu,
        "NICE": str(cfg.producer.nice),
        "SUFFIX": sfx,
        "RANK_ARGS": rank_args,
        "SET_ARGS": set_args,
        "RANK_TEXT": f", rank {place.rank} of {place.world}" if place.is_multi_worker else "",
    }
    for key, source in _SOURCES.items():  # whatever the source, no value may add a line to a unit
        check_text(values[key], (source,))
    out = {}
    for name in UNIT_NAMES:
        if plan.producers_only and name == "consumer.service":
            continue
        text = (TEMPLATES / name).read_text(encoding="utf-8")
        if plan.producers_only and name == "pipeline.target":  # the consumer runs on another host
            text = text.replace("Wants=consumer@SUFFIX@.service", "# deploy --producers-only: no consumer on this host")
        for key, value in values.items():
            text = text.replace(f"@{key}@", value)
        leftover = re.findall(r"@[A-Z_]+@", text)
        if leftover:
            raise RuntimeError(f"{name}: unrendered placeholders {leftover}")
        out[Path(plan.unit_name(name))] = text
    producer = plan.unit_name("producer@")
    wants = " ".join(f"{producer}{i}.service" for i in range(1, plan.producers + 1))
    out[plan.dropin] = (
        f"# Written by melfeed deploy --producers {plan.producers}; re-run deploy to "
        f"rescale.\n[Unit]\n" + (f"Wants={wants}\n" if wants else "# producers on other hosts\n")
    )
    return out


def _check_target_dir(target: Path) -> None:
    """``--target-dir`` must be an existing, writable directory: a mistyped one is never created (systemd
    would not read units there); only the drop-in directory below it is."""
    check_text(str(target), ("--target-dir",))
    if not target.is_dir():
        why = "is not a directory" if target.exists() else "does not exist (deploy creates no unit directory)"
        raise _fail("--target-dir", why, str(target))
    if not os.access(target, os.W_OK | os.X_OK):
        raise _fail("--target-dir", "is not writable (run deploy as root for /etc/systemd/system)", str(target))
    check_output_dir(target, "--target-dir")  # units are run by systemd: nobody else may change them


def _write_atomic(path: Path, text: str) -> bool:
    """Write ``path`` by temp file + rename unless it already holds ``text``; False when unchanged.

    The temporary file has a random name and is created exclusively, and the rename replaces a link
    rather than writing through it; a target or drop-in directory another user could change (or reached
    through another user's link) is refused (``melfeed.shared.output_files.replace_output``): root would otherwise
    write units, which systemd runs, where that user chose.

    Raises:
        ConfigError: naming ``--target-dir`` and the file, with the reason (read-only, a directory in the
            way, disk full, another user's place): one line, never a traceback.
    """
    try:
        if path.is_file() and not path.is_symlink() and path.read_text(encoding="utf-8") == text:
            return False
        path.parent.mkdir(mode=0o755, exist_ok=True)  # the drop-in directory; the target itself exists
        replace_output(path, text.encode("utf-8"), 0o644, what="--target-dir")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise _fail("--target-dir", f"cannot write {path}: {reason}", str(path.parent)) from None
    return True


def _wanted_before(target_dir: Path, plan: DeployPlan) -> set[int]:
    wants = re.compile(re.escape(plan.unit_name("producer@")) + r"(\d+)\.service")
    try:
        return {int(n) for n in wants.findall((target_dir / plan.dropin).read_text(encoding="utf-8"))}
    except (OSError, UnicodeDecodeError):  # none yet (or unreadable: rewritten below, or refused there)
        return set()


def main_deploy(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    target = Path(args.target_dir)
    _check_target_dir(target)
    before = _wanted_before(target, plan)
    changed = [rel for rel, text in render_units(plan).items() if _write_atomic(target / rel, text)]
    for rel in changed:
        print(f"wrote {target / rel}")
    if not changed:
        print(f"{target}: units already up to date")
    custom_state_dir = plan.state_dir != DEFAULT_STATE_DIR + plan.suffix  # StateDirectory= makes the default
    if not plan.producers_only and custom_state_dir and not Path(plan.state_dir).is_dir():
        print(
            f"note: {plan.state_dir} does not exist; the consumer may write only there (ProtectSystem=strict): "
            f"install -d -o {plan.user} -g {plan.group} -m 0750 {plan.state_dir}"
        )
    now = set(range(1, plan.producers + 1))
    target_unit, producer = plan.unit_name("pipeline.target"), plan.unit_name("producer@")
    print("apply with:")
    print("  systemctl daemon-reload")
    starts = f"starts {producer}1..{plan.producers}" if plan.producers else "no producer on this host"
    print(f"  systemctl enable {target_unit} && systemctl start {target_unit}   # {starts}")
    extra = sorted(before - now)
    if extra:
        print("  systemctl stop " + " ".join(f"{producer}{i}.service" for i in extra) + "   # scaled down")
    if plan.place.is_multi_worker and not plan.producers_only:
        _print_rank_notes(plan)
    return 0


def _print_rank_notes(plan: DeployPlan) -> None:
    """Where this rank listens, how to ask it, and which config values a second rank here would share."""
    place = plan.place
    address = place.cluster[place.task_type][place.task_index]
    print(
        f"rank {place.rank} of {place.world} ({plan.tf_config}: task {place.task_type}:{place.task_index}); "
        f"its TensorFlow server listens on {address}: open that port to the other workers only"
    )
    cfg = plan.effective_config()
    environ = {"RUNTIME_DIRECTORY": f"/run/melfeed{plan.suffix}"}  # what systemd gives both units
    control = resolve_control_endpoint(
        with_rank_defaults(cfg, place, environ, create_dir=False), environ, create_dir=False
    )
    print(f"status: {plan.python} -m melfeed status --endpoint {control}")
    shared = {
        "transport.endpoint": cfg.transport.endpoint,
        "consumer.control_endpoint": cfg.consumer.control_endpoint,
        "consumer.metrics_port": cfg.consumer.metrics_port,
        "consumer.metrics_file": cfg.consumer.metrics_file,
    }
    for key, value in shared.items():
        if value is not None:
            print(
                f"note: {plan.config} sets {key} ({value}): another rank on this host needs a config of its own "
                "(a value set in the config wins over the per-rank default)"
            )
