"""``run_pipeline.py deploy``: render the systemd units for one venv and config, and set the scale.

Writes into ``--target-dir`` (default ``/etc/systemd/system``): ``pipeline.target``,
``consumer.service``, ``producer@.service`` (templates in ``deploy/units/`` with ``@KEY@``
placeholders) and the drop-in ``pipeline.target.d/producers.conf`` whose ``Wants=`` lists
``producer@1..N``. Re-running with another N rewrites only that drop-in (and any unit whose rendering
changed) and prints the ``systemctl`` commands that apply the change live: start the new instances,
stop the ones above N. Nothing here talks to systemd; the operator (or a test) runs those commands.
Every file is written atomically (temp + rename); bad flags exit 78 naming the flag.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from shared.config_loader import load_config
from shared.errors import ConfigError
from shared.service.children import REPO_ROOT

__all__ = ["DeployPlan", "main_deploy", "render_units"]

REPO = REPO_ROOT
TEMPLATES = REPO / "deploy" / "units"
UNIT_NAMES = ("pipeline.target", "consumer.service", "producer@.service")
DROPIN = Path("pipeline.target.d") / "producers.conf"
DEFAULT_STATE_DIR = "/var/lib/melfeed"
_WANTS = re.compile(r"producer@(\d+)\.service")


@dataclass(frozen=True, slots=True)
class DeployPlan:
    python: Path            # the venv's interpreter
    config: Path            # absolute path of the YAML config the units pass to --config
    user: str
    group: str
    producers: int
    state_dir: str
    env_file: str
    repo: Path = REPO


def _fail(flag: str, message: str, got: object) -> ConfigError:
    return ConfigError(message, path=(flag,), got=got)


def plan_from_args(args: argparse.Namespace) -> DeployPlan:
    if args.producers < 1:
        raise _fail("--producers", "must be >= 1", args.producers)
    python = Path(args.prefix).resolve() / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise _fail("--prefix", f"has no executable {python} (pass the venv the services run)", args.prefix)
    try:
        user = pwd.getpwnam(args.user)
    except KeyError:
        raise _fail("--user", "is not a user on this host", args.user) from None
    group = args.group or grp.getgrgid(user.pw_gid).gr_name
    config = Path(args.config).resolve()
    cfg = load_config(str(config))          # a broken config must fail now, not at the first start
    if cfg.cache_dir is None:
        raise _fail("--config", "must set cache_dir (the services have no other way to learn it)", str(config))
    return DeployPlan(python, config, args.user, group, args.producers, args.state_dir, args.env_file)


def render_units(plan: DeployPlan) -> dict[Path, str]:
    """Relative path -> text of every file ``deploy`` writes."""
    cfg = load_config(str(plan.config))
    state_directive = ("StateDirectory=melfeed\nStateDirectoryMode=0750" if plan.state_dir == DEFAULT_STATE_DIR
                       else f"ReadWritePaths={plan.state_dir}")
    values = {"PYTHON": str(plan.python), "REPO": str(plan.repo), "CONFIG": str(plan.config), "USER": plan.user,
              "GROUP": plan.group, "STATE_DIR": plan.state_dir, "ENV_FILE": plan.env_file,
              "STATE_DIRECTIVE": state_directive, "MODEL_GPU": cfg.consumer.model_gpu or "",
              "DATA_GPU": cfg.producer.data_gpu, "NICE": str(cfg.producer.nice)}
    out = {}
    for name in UNIT_NAMES:
        text = (TEMPLATES / name).read_text(encoding="utf-8")
        for key, value in values.items():
            text = text.replace(f"@{key}@", value)
        leftover = re.findall(r"@[A-Z_]+@", text)
        if leftover:
            raise RuntimeError(f"{name}: unrendered placeholders {leftover}")
        out[Path(name)] = text
    wants = " ".join(f"producer@{i}.service" for i in range(1, plan.producers + 1))
    out[DROPIN] = (f"# Written by run_pipeline.py deploy --producers {plan.producers}; re-run deploy to rescale.\n"
                   f"[Unit]\nWants={wants}\n")
    return out


def _write_atomic(path: Path, text: str) -> bool:
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return True


def _wanted_before(target_dir: Path) -> set[int]:
    try:
        return {int(n) for n in _WANTS.findall((target_dir / DROPIN).read_text(encoding="utf-8"))}
    except FileNotFoundError:
        return set()


def main_deploy(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    target = Path(args.target_dir)
    before = _wanted_before(target)
    changed = [rel for rel, text in render_units(plan).items() if _write_atomic(target / rel, text)]
    for rel in changed:
        print(f"wrote {target / rel}")
    if not changed:
        print(f"{target}: units already up to date")
    if plan.state_dir != DEFAULT_STATE_DIR and not Path(plan.state_dir).is_dir():
        print(f"note: {plan.state_dir} does not exist; the consumer may write only there (ProtectSystem=strict): "
              f"install -d -o {plan.user} -g {plan.group} -m 0750 {plan.state_dir}")
    now = set(range(1, plan.producers + 1))
    print("apply with:")
    print("  systemctl daemon-reload")
    print("  systemctl enable pipeline.target && systemctl start pipeline.target   # starts producer@1..%d"
          % plan.producers)
    extra = sorted(before - now)
    if extra:
        print("  systemctl stop " + " ".join(f"producer@{i}.service" for i in extra) + "   # scaled down")
    return 0
