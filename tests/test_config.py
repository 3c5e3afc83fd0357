"""Config groups compose; bad configs fail with one line naming the field, before anything spawns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from testbed import config
from testbed.batch import global_batch, per_rank_batch
from testbed.checks import resolved_backend, resolved_device
from testbed.config import ConfigError, validate
from testbed.paths import config_dir, short_dirname
from testbed.preflight import check_command_line
from testbed.sweeps import excluded

GROUPS = {group: sorted(p.stem for p in (Path(config_dir()) / group).glob("*.yaml")) for group in config.GROUP_SCHEMAS}


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group: str, option: str, tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(bytes(400))
    (tmp_path / "images" / "cat").mkdir(parents=True)
    Image.new("RGB", (10, 8)).save(tmp_path / "images" / "cat" / "0.png")
    extra = {
        "model=transformer": ["data=lm"], "data=lm": ["model=transformer"],
        "model=gpt2": ["data=lm", "model.n_layer=1"], "model=bert": ["data=lm", "model.n_layer=1"],
        "data=tokens": ["model=transformer", f"data.path={tmp_path / 'train.bin'}", "data.vocab_size=256", "data.seq_len=16"],
        "data=image_folder": [f"data.root={tmp_path / 'images'}", "data.image_size=8"],
        "model=vgg16": ["data.shape=[3,32,32]"],
        "model=custom": ["model.target=torch.nn.Linear", "data.shape=[8]", "+model.kwargs.in_features=8",
                         "+model.kwargs.out_features=10"],
        "fault=kill_rank": ["world_size=2"], "fault=kill_ps": ["sync=ps"],
        "fault=link_down": ["world_size=2", "network=emulated"],
        "fault=link_slow": ["world_size=2", "network=emulated"],
        "launcher=virtual": ["cluster=here"],
    }.get(f"{group}={option}", [])
    cfg = composed([f"{group}={option}", *extra])
    # A variant (ps_async) is its schema's option (ps) with other defaults, named <option>_<what>.
    assert cfg[group].name == option or option.startswith(f"{cfg[group].name}_")
    validate(cfg)


def test_every_schema_has_an_option_on_disk() -> None:
    for group, options in GROUPS.items():
        assert set(config.GROUP_SCHEMAS[group]) <= set(options), group


BAD = {
    "wrong type": (["world_size=abc"], "world_size"),
    "unknown option": (["sync=foo"], "sync=foo: unknown option; allowed: " + "|".join(sorted(p.stem for p in (REPO / "experiments" / "sync").glob("*.yaml")))),
    "unknown key": (["sync.foo=1"], "sync.foo: unknown key"),
    "bad enum": (["data.scaling=bogus"], "data.scaling"),
    "world_size < 1": (["world_size=0"], "world_size=0"),
    "batch does not divide": (
        ["data.scaling=strong", "data.batch_size=10", "world_size=4"],
        "data.batch_size=10 does not divide by world_size=4",
    ),
    "nccl without GPUs": (["backend=nccl", "world_size=2"], "backend=nccl needs one CUDA GPU per local rank"),
    "ranks over machines unevenly": (["network=emulated", "world_size=4", "network.nodes=3"],
                                     "network.nodes=3: the ranks spread evenly over the machines: a divisor of world_size=4"),
    "bad intra-machine rate": (["network=emulated", "network.nodes=1", "network.intra_bandwidth=fast"], "network.intra_bandwidth=fast"),
    "byteps servers": (["sync=byteps", "sync.servers=-1"], "sync.servers=-1: server machines, >= 0"),
    "byteps with a codec": (["sync=byteps", "compress=fp16"], "sync=byteps carries no codec yet"),
    "byteps node that does not divide": (["sync=byteps", "world_size=4", "sync.ranks_per_node=3"],
                                         "sync.ranks_per_node=3: a divisor of world_size=4"),
    "bad server placement": (["network=emulated", "network.servers=rack"], "network.servers=rack: one of separate|colocated"),
    "model/data mismatch": (["model=transformer"], "model=transformer cannot read data=synthetic; allowed: data=lm|tokens"),
    "one bad sweep point": (["-m", "sync=ring,tree", "world_size=1,0"], "world_size=0"),
    "bad point of a preset's sweep": (
        ["+experiment=compare", "data.scaling=strong", "data.batch_size=3"],
        "data.batch_size=3 does not divide by world_size=2",
    ),
    "unknown name": (["model.name=foo"], "model.name=foo: unknown; allowed: mlp|cnn|cnn1d|transformer"),
    "ps mode": (["sync=ps", "sync.mode=bsp"], "sync.mode=bsp: allowed: sync|async|ssp"),
    "ps addresses": (["sync=ps", "sync.servers=2", "sync.addresses=[localhost:1]"], "sync.addresses has 1 entries but sync.servers=2"),
    "straggler beyond the world": (
        ["imbalance=straggler", "imbalance.ranks=[3]", "world_size=2"],
        "imbalance.ranks=[3]: ranks [3] do not exist with world_size=2",
    ),
    "jitter distribution": (["imbalance=jitter", "imbalance.distribution=gamma"], "imbalance.distribution=gamma: allowed: normal|lognormal|exponential"),
    "exponential std": (
        ["imbalance=jitter", "imbalance.distribution=exponential", "imbalance.std_ms=2"],
        "an exponential delay has std = mean; set imbalance.std_ms=null",
    ),
    "uneven shares": (["imbalance=uneven", "imbalance.shares=[1,2,3]", "world_size=2"], "give one positive share per rank"),
    "heterogeneous speed": (["imbalance=heterogeneous", "imbalance.speeds=[1,2]"], "each speed must be in (0, 1]"),
    "bandwidth": (["network=emulated", "network.bandwidth=fast"], "network.bandwidth=fast: 'fast': expected <number><bit|kbit|mbit|gbit>"),
    "codec on a synchronizer without one": (["compress=topk", "sync=local_sgd"], "compress=topk with sync=local_sgd: it averages parameters"),
    "powersgd on a parameter server": (["compress=powersgd", "sync=ps"], "compress=powersgd with sync=ps: PowerSGD needs every worker's P"),
    "codec ratio": (["compress=topk", "compress.ratio=0"], "compress.ratio=0.0: must be in (0, 1]"),
    "learning rate": (["sync=ring", "optim.lr=-1"], "optim.lr=-1.0: the learning rate must be > 0"),
    "momentum": (["optim.momentum=-0.5"], "optim.momentum=-0.5: must be >= 0"),
    "nesterov without momentum": (["optim=sgd_plain", "optim.nesterov=true"], "optim.nesterov=true needs momentum"),
    "weight decay": (["optim=adamw", "optim.weight_decay=-0.1"], "optim.weight_decay=-0.1: must be >= 0"),
    "adam betas": (["optim=adamw", "optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0]: two decay rates, each in [0, 1)"),
    "adam eps": (["optim=adamw", "optim.eps=-1e-8"], "optim.eps=-1e-08: must be >= 0"),
    "cosine floor above the peak": (["optim.schedule=cosine", "optim.lr=0.01", "optim.min_lr=0.5"],
                                    "optim.min_lr=0.5 is above the peak rate 0.01"),
    "floor of another schedule": (["optim.min_lr=0.001"], "optim.min_lr=0.001 is the cosine schedule's floor"),
    "factor of another schedule": (["optim.schedule=cosine", "optim.gamma=0.5"], "optim.gamma=0.5 is the step schedule's"),
}


# The real CLI for each way an error reaches it: Hydra's override parser, the schema, validation,
# the machine, one point of a sweep, a preset's sweep. Every case of BAD is also checked in-process
# (test_preflight_raises_the_same_errors): check_command_line is what the CLI runs before anything.
ON_THE_COMMAND_LINE = ["wrong type", "unknown option", "unknown key", "bad enum", "batch does not divide",
                       "nccl without GPUs", "one bad sweep point", "bad point of a preset's sweep"]


@pytest.mark.parametrize("case", ON_THE_COMMAND_LINE)
def test_bad_config_is_one_line_before_spawning(tmp_path: Path, case: str) -> None:
    args, expected = BAD[case]
    if case == "nccl without GPUs":
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("a GPU is visible")
    out = tmp_path / "job"
    key = "hydra.sweep.dir" if "-m" in args or "+experiment=compare" in args else "hydra.run.dir"
    proc = run_cli([*args, f"{key}={out}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: ") and expected in lines[0], lines[0]
    assert not out.exists(), "nothing may be created (no job dir, no ranks) for a bad config"


@pytest.mark.parametrize("case", list(BAD))
def test_preflight_raises_the_same_errors(case: str) -> None:
    args, expected = BAD[case]
    if case == "nccl without GPUs":
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match=None) as info:
        check_command_line(args)
    assert expected in str(info.value)


def test_derived_batch_sizes() -> None:
    weak = composed(["world_size=4", "data.batch_size=8"])
    strong = composed(["world_size=4", "data.batch_size=8", "data.scaling=strong"])
    assert (per_rank_batch(weak), global_batch(weak)) == (8, 32)
    assert (per_rank_batch(strong), global_batch(strong)) == (2, 8)


def test_cpu_defaults_resolve_to_gloo() -> None:
    cfg = composed(["device=cpu"])
    assert resolved_device(cfg) == "cpu" and resolved_backend(cfg) == "gloo"


PRESETS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates_every_point(preset: str, tmp_path: Path) -> None:
    text = (Path(config_dir()) / "experiment" / f"{preset}.yaml").read_text()
    assert text.startswith("# @package _global_")
    if f"python -m testbed.sim +experiment={preset}" in text:
        # Simulated: every point of every other axis is predicted at one world size, one link rate
        # and one paper model (sizes, rates and models themselves are predicted in test_sim_step).
        swept = OmegaConf.load(Path(config_dir()) / "experiment" / f"{preset}.yaml").hydra.sweeper.params
        first = [f"{key}={str(swept[key]).split(',')[0]}" for key in ("network.bandwidth", "+paper_model") if key in swept]
        proc = run_cli([f"+experiment={preset}", "world_size=8", *first, "steps=4", "warmup_steps=1", f"hydra.sweep.dir={tmp_path}"],
                       cwd=tmp_path, module="testbed.sim")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return
    assert f"python -m testbed +experiment={preset}" in text or f"python -m testbed.tune +experiment={preset}" in text
    try:
        check_command_line([f"+experiment={preset}"])  # composes every point of its sweep and validates it
    except ConfigError as exc:
        # Presets on emulated links need root and iproute2; that is the only complaint allowed.
        assert "network=emulated" in str(exc) and ("root" in str(exc) or "iproute2" in str(exc)), exc


def test_a_command_line_key_replaces_the_presets_sweep_of_it() -> None:
    """``+paper_model=vgg16`` on the command line replaces the preset's ``+paper_model`` sweep."""
    assert check_command_line(["+experiment=horovod", "+paper_model=vgg16", "world_size=1,2"]) == 4 * 2


def test_a_sweep_leaves_out_the_points_it_excludes() -> None:
    """PowerSGD on a parameter server, excluded (as the compression preset does): preflight passes
    the sweep over it, and refuses the same sweep without the exclusion."""
    sweep = ["world_size=2", "sync=ps,ring", "compress=powersgd,topk"]
    assert check_command_line([*sweep, "sweep_exclude=[['sync=ps','compress=powersgd']]"]) == 4
    with pytest.raises(ConfigError, match="compress=powersgd with sync=ps"):
        check_command_line(sweep)
    assert excluded(["sync=ps", "+paper_model=vgg16", "compress=powersgd"], [["sync=ps", "compress=powersgd"]])
    assert excluded(["sync=ps_sharded", "compress=powersgd"], [["sync=ps", "compress=powersgd"]]) is None
    # A sweep over x=true,false names its jobs x=True and x=False: either spelling excludes them.
    assert excluded(["sync=ring", "sync.overlap=False"], [["sync=ring", "sync.overlap=false"]])
    assert excluded(["sync=ring", "sync.overlap=True"], [["sync=ring", "sync.overlap=false"]]) is None


def test_long_override_lists_give_short_unique_job_directories() -> None:
    long = ",".join(f"model.key{i}=value{i}" for i in range(20))  # 359 bytes: over the file-name limit
    assert short_dirname("sync=ring,world_size=2") == "sync=ring,world_size=2"
    cut = short_dirname(long)
    assert len(cut.encode()) <= 200 and cut.startswith("model.key0=value0,")
    assert cut != short_dirname(long.replace("value19", "value20"))  # the hash keeps them apart


def test_a_results_directory_that_cannot_hold_results_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = run_cli(["hydra.run.dir=/proc/testbed-results"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: hydra.run.dir=/proc/testbed-results: results cannot be written under /proc "
        "(No such file or directory); choose a writable directory"]
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return
    tiny = tmp_path / "tiny"  # a file system of 1 MB: as good as full
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tiny)], capture_output=True).returncode:
        return
    try:
        proc = run_cli(["-m", "world_size=1,2", f"hydra.sweep.dir={tiny / 'sweep'}"], cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and f"hydra.sweep.dir={tiny / 'sweep'}: 1 MB free on the file system" in proc.stderr
        assert not (tiny / "sweep").exists()
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="a network namespace of its own needs root")
def test_a_used_up_port_range_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # The ephemeral range is per network namespace: one of two ports, both held, stands for a machine
    # whose range is used up, without touching the host's.
    ns = f"tbports{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    holder = None
    try:
        inside = ["ip", "netns", "exec", ns]
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run([*inside, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=40000 40001"], check=True)
        hold = ("import socket, sys\nheld = [socket.socket() for _ in range(2)]\n[s.bind(('127.0.0.1', 0)) for s in held]\n"
                "print('held', flush=True)\nsys.stdin.read()")
        holder = subprocess.Popen([*inside, sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        job = tmp_path / "job"
        proc = subprocess.run([*inside, sys.executable, "-m", "testbed", "world_size=2", "device=cpu", f"hydra.run.dir={job}"],
                              cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            "config error: no free TCP port on 127.0.0.1: a run here listens on 3 (Address already in use); the "
            "ephemeral range 40000-40001 (net.ipv4.ip_local_port_range) is used up: end what holds its ports "
            "(ss -tanp) or widen it (sysctl -w net.ipv4.ip_local_port_range='15000 65000')"], proc.stderr[-2000:]
        assert not job.exists()
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        subprocess.run(["ip", "netns", "del", ns], check=True)
