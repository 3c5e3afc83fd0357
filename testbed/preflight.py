"""Check every job of a command line before Hydra runs the first one.

A sweep with one bad point should fail in a second, not after the good points have trained. The
command line's overrides are expanded like Hydra's basic sweeper does, each point is composed with
the Compose API and validated, and the first problem is reported as one line naming the field,
the allowed values and the fix. Command lines this cannot expand (other sweepers, config
overrides from the command line's -cp/-cn) are left to Hydra, where each job is still validated.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import socket
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed.config import ConfigError, validate
from testbed.launch.existing import surrounding_world
from testbed.paths import config_dir
from testbed.sweeps import excluded
from testbed.sync import SYNCHRONIZERS

_SKIP_FLAGS = ("-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir", "--help", "-h",
               "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """All jobs of a command line's overrides (cartesian product of the comma-separated sweeps)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = OverridesParser.create().parse_overrides(overrides)
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def _configured_sweep(overrides: list[str]) -> list[str]:
    """Sweep parameters set in config (an experiment preset's hydra.sweeper.params), as overrides.

    The command line wins over them for the same key, as in Hydra's basic sweeper.
    """
    plain = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    try:
        cfg = compose(config_name="config", overrides=plain, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException):
        return []  # reported with the point that fails
    params = cfg.hydra.sweeper.get("params") or {}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [f"{key}={value}" for key, value in params.items() if key.lstrip("+~") not in given]


MIN_FREE_MB = 100  # below this on the results' file system, a run would fail part-way


def check_output_dirs(argv: list[str]) -> None:
    """Refuse a results directory (``hydra.run.dir``, ``hydra.sweep.dir``, else the working
    directory Hydra writes under) that cannot be written or whose file system is nearly full."""
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))}
    for key, target in given.items() or [("the working directory", ".")]:
        where = Path(target).absolute()
        existing = next(p for p in (where, *where.parents) if p.exists())
        name = f"{key}={target}" if key.startswith("hydra.") else key
        try:
            if not existing.is_dir():
                raise NotADirectoryError(f"{existing} is not a directory")
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            raise ConfigError(f"{name}: results cannot be written under {existing} ({exc.strerror or exc}); "
                              "choose a writable directory") from None
        free = shutil.disk_usage(existing).free / 2**20
        if free < MIN_FREE_MB:
            raise ConfigError(f"{name}: {free:.0f} MB free on the file system of {existing}, under {MIN_FREE_MB} MB; "
                              "free some space or choose another directory")
    _check_not_a_finished_run(given, "sweep_resume=true" in {a.lstrip("+").lower() for a in argv})


def _check_not_a_finished_run(given: dict[str, str], sweep_resume: bool) -> None:
    """Refuse a results directory that holds a run's results: Hydra would write its config and log
    over the earlier run's before the job starts, and the job its step logs, summary and model."""
    run_dir = given.get("hydra.run.dir")
    if run_dir is not None and (Path(run_dir) / "summary.json").is_file():
        raise ConfigError(f"hydra.run.dir={run_dir} holds a run's results (its summary.json), which a run never writes "
                          f"over; choose a new hydra.run.dir (to go on from that run: resume={run_dir} "
                          "hydra.run.dir=<a new directory>)")
    sweep_dir = given.get("hydra.sweep.dir")
    if sweep_dir is not None and not sweep_resume:
        done = next(iter(sorted(Path(sweep_dir).glob("*/summary.json"))), None)
        if done is not None:
            raise ConfigError(f"hydra.sweep.dir={sweep_dir} holds the results of a sweep ({done.parent.name}, ...), which "
                              "a sweep never writes over; choose a new hydra.sweep.dir, or add sweep_resume=true to go "
                              "on with it (its finished jobs are kept, the others' files set aside under attempts/)")


PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def check_free_ports(need: int, host: str = "127.0.0.1") -> None:
    """Refuse when this machine cannot give a run the ``need`` ports its rendezvous store, ranks and
    parameter servers listen on, all from the ephemeral range (they bind port 0): held at once and
    released, so that a used-up range fails here, in words, not as a rank's bind error later."""
    held: list[socket.socket] = []
    try:
        for _ in range(need):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((host, 0))
    except OSError as exc:
        lo, hi = PORT_RANGE.read_text().split() if PORT_RANGE.exists() else ("?", "?")
        raise ConfigError(
            f"no free TCP port on {host}: a run here listens on {need} ({exc.strerror or exc}); the ephemeral range "
            f"{lo}-{hi} (net.ipv4.ip_local_port_range) is used up: end what holds its ports (ss -tanp) or widen it "
            "(sysctl -w net.ipv4.ip_local_port_range='15000 65000')") from None
    finally:
        for sock in held:
            sock.close()


def listeners(cfg: DictConfig) -> int:
    """The ports one run of ``cfg`` listens on: a rank each, the local parameter servers, the store."""
    spec = SYNCHRONIZERS.get(cfg.sync.name)
    return int(cfg.world_size) + (spec.local_servers(cfg) if spec else 0) + 1


def check_command_line(argv: list[str]) -> int:
    """Raise ConfigError for the first job of ``argv`` that cannot run; return how many jobs it has
    (0 when it cannot tell)."""
    if any(a.split("=")[0] in _SKIP_FLAGS for a in argv):
        return 0
    check_output_dirs(argv)
    overrides = [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    joined = surrounding_world()
    local = joined[3] if joined else None  # ranks on this machine; the rest run elsewhere
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="preflight"):
        try:
            points = sweep_points(overrides + _configured_sweep(overrides))
        except HydraException:
            return 0  # a sweep syntax the basic sweeper does not expand; Hydra reports or runs it
        composed: dict[tuple[str, ...], DictConfig] = {}
        need = 0
        checked: set[tuple[str, ...]] = set()
        exclude = None  # the sweep's exclusions: the first point's, where no point sets its own
        for point in points:
            # A seed changes nothing a check reads: points apart only in it are checked once.
            unseeded = tuple(sorted(o for o in point if not o.lstrip("+").startswith("seed=")))
            own = any(o.lstrip("+").startswith("sweep_exclude") for o in point)
            if unseeded in checked or (exclude is not None and not own and excluded(point, exclude) is not None):
                continue  # an excluded point is not composed: that is most of the cost
            checked.add(unseeded)
            try:
                cfg = _compose(point, composed)
            except (HydraException, OmegaConfBaseException) as exc:
                raise ConfigError(describe_composition_error(exc)) from None
            exclude = None if own else cfg.sweep_exclude
            if excluded(point, cfg.sweep_exclude) is None:
                validate(cfg, local_world_size=local)
                need = max(need, listeners(cfg))
    if joined is None and need:  # under torchrun/Slurm the world and its ports are there already
        check_free_ports(need)
    return len(points)


def _compose(point: list[str], composed: dict[tuple[str, ...], DictConfig]) -> DictConfig:
    """The config of one sweep point. Hydra takes a few hundred milliseconds per composition, which
    a sweep of hundreds of points would pay over and over: points that share their config-group
    choices are composed once, whole (so its errors are Hydra's own), and the next ones get their
    plain ``key=value`` overrides set on a copy of it."""
    overrides = OverridesParser.create().parse_overrides(point)
    groups = {p.name for p in Path(config_dir()).iterdir() if p.is_dir()}
    plain = [o for o in overrides if o.type == OverrideType.CHANGE and o.package is None
             and "/" not in o.key_or_group and o.key_or_group not in groups]
    base = tuple(o.input_line for o in overrides if o not in plain)
    if base not in composed:
        composed[base] = cfg = compose(config_name="config", overrides=point)
        return cfg
    cfg = copy.deepcopy(composed[base])
    for o in plain:
        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
    return cfg


def describe_composition_error(exc: BaseException) -> str:
    """One line from Hydra's and OmegaConf's multi-line composition errors."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        options = _options(group)
        if options:
            return f"{group}={name}: unknown option; allowed: {'|'.join(options)}"
    inner: BaseException | None = exc
    while inner is not None and not isinstance(inner, OmegaConfBaseException):
        inner = inner.__cause__ or inner.__context__
    if isinstance(inner, OmegaConfBaseException) and getattr(inner, "full_key", None):
        key = str(inner.full_key)
        first = str(getattr(inner, "msg", inner)).splitlines()[0]
        if "not in" in first or "not in struct" in first:
            return f"{key}: unknown key; allowed keys here: {', '.join(_keys(getattr(inner, 'object_type', None)))}" + _owners(key)
        return f"{key}: {first}"
    return " ".join(str(exc).split())


def _owners(key: str) -> str:
    """For an option of another synchronizer: which ones have it, and why this one cannot."""
    group, _, name = key.partition(".")
    if group != "sync":
        return ""
    owners = [spec for spec in SYNCHRONIZERS.values() if name in {f.name for f in dataclasses.fields(spec.schema)}]
    if not owners:
        return ""
    why = next((spec.exclusive[name] for spec in owners if name in spec.exclusive), "")
    return f"; {name} is an option of sync={'|'.join(spec.name for spec in owners)}" + (f": {why}" if why else "")


def _options(group: str) -> list[str]:
    folder = Path(config_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _keys(schema: object) -> list[str]:
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return [f.name for f in dataclasses.fields(schema)]
    return ["(see the group's YAML under experiments/)"]
