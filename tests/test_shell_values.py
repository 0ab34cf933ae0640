"""No setting reaches a shell unquoted: each value that goes into the sbatch script, onto the srun line, or into
ssh's and rsync's commands either arrives as one argument, byte for byte, with nothing run, or is refused before
anything is written, in one line naming its setting (where Slurm's or ssh's grammar is narrower than a shell word).

A rendered script runs here under bash with `srun` and `scontrol` (and `ssh`, for the login probe) replaced by a
recorder that writes its argv, NUL-separated, to a file: srun's argv holds torchrun's or Python's, so one record
shows every argument the job would start with. Every hostile value carries a `touch PROBE` that must create nothing.
Slurm's own reading of an #SBATCH line is tested on the real cluster (tests/test_slurm.py, the injection job).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from recipes.config import ConfigError, SlurmConfig, SshTunnelConfig
from recipes.plan.cluster import check_cluster, check_slurm_settings, check_ssh_settings
from recipes.ssh import BatchSSHTunnel
from test_slurm import REPO, hydra_quoted, run_py
from test_slurm_ssh import free_port

ENGINE = "recipes.engine.torch_engine"
RECORDER = """#!/bin/sh
printf '%s\\0' "$@" > "$ARGV_DIR/$(basename "$0").$$"
"""


def hostile(probe: Path, tag: str) -> str:
    """A value starting with "-" that runs `touch PROBE` in each way a shell could be made to, with every character
    a shell treats specially, a newline and non-ASCII."""
    return (f"-{tag} a b;touch {probe} $(touch {probe}) `touch {probe}` | touch {probe} & \"dq\" 's' \\ é #c"
            f"\nline2 $HOME")


def recorders(tmp_path: Path, *commands: str) -> dict[str, str]:
    """The environment that runs `commands` as the recorder (their argv lands in ARGV_DIR, one file per call)."""
    folder, argv_dir = tmp_path / "recorders", tmp_path / "argv"
    folder.mkdir(exist_ok=True)
    argv_dir.mkdir(exist_ok=True)
    for command in commands:
        (folder / command).write_text(RECORDER)
        (folder / command).chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "ARGV_DIR": str(argv_dir)}


def recorded(tmp_path: Path, command: str) -> list[list[str]]:
    return [[arg.decode() for arg in path.read_bytes().split(b"\0")[:-1]]
            for path in sorted((tmp_path / "argv").glob(f"{command}.*"))]


def run_script(tmp_path: Path, script: Path) -> list[str]:
    """Run the rendered sbatch script under bash, Slurm's commands recorded; the argv of its srun of the engine."""
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=dict(os.environ, **recorders(tmp_path, "srun",
                          "scontrol")), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    (srun,) = [argv for argv in recorded(tmp_path, "srun") if ENGINE in argv]
    return srun


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def assert_nothing_ran(tmp_path: Path) -> None:
    assert not [path for path in tmp_path.rglob("pwned*") if path.is_file()]


def render(tmp_path: Path, run_dir: Path, *overrides: str) -> Path:
    run_py(tmp_path, *overrides, f"run.dir={hydra_quoted(str(run_dir))}", "dryrun=true")
    return run_dir / "sbatch.sh"


def hydra_list(values: list[str]) -> str:
    return f"[{','.join(hydra_quoted(value) for value in values)}]"


def test_every_srun_argument_arrives_as_one_argument_under_torchrun(tmp_path):
    """Two processes, a container: the srun settings, the mounts (with the run directory's) and the config path
    that nemo-run's torchrun launcher quotes itself."""
    probe = tmp_path / "pwned"
    image, mount, mpi, cpu_bind, srun_arg = (hostile(probe, tag) for tag in ("image", "mount", "mpi", "cpu", "srun"))
    run_dir = tmp_path / f"run {hostile(probe, 'dir')}"
    script = render(tmp_path, run_dir, "executor=slurm", "gpu=cpu", "executor.gpus=2",
                    f"executor.slurm.container_image={hydra_quoted(image)}",
                    f"executor.slurm.container_mounts={hydra_list([mount, '/a:/b:ro'])}",
                    f"executor.slurm.mpi={hydra_quoted(mpi)}", f"executor.slurm.cpu_bind={hydra_quoted(cpu_bind)}",
                    f"executor.slurm.srun_args={hydra_list([srun_arg, '--label'])}",
                    f"+executor.slurm.sbatch_args.comment={hydra_quoted(hostile(probe, 'comment').split(chr(10))[0])}")
    srun = run_script(tmp_path, script)
    assert after(srun, "--container-image") == image
    runs = tmp_path / "runs"  # run.root, mounted with this checkout and the run directory outside it
    mounts = [mount, "/a:/b:ro", f"{REPO}:{REPO}", f"{runs}:{runs}", f"{run_dir}:{run_dir}"]
    assert after(srun, "--container-mounts").startswith(",".join(mounts) + ",")
    assert {f"--mpi={mpi}", f"--cpu-bind={cpu_bind}", srun_arg, "--label"} <= set(srun)
    assert srun[srun.index("torchrun"):][-3:] == ["-m", ENGINE, f"{run_dir}/config.yaml"]
    assert_nothing_ran(tmp_path)


def test_python_and_config_path_arrive_as_one_argument_each_without_a_launcher(tmp_path):
    """One process, no container, over SSH (a dry run does not connect): the cluster's Python and checkout and the
    config path go into the script as the job's own command."""
    probe = tmp_path / "pwned"
    python = f"/opt/{hostile(probe, 'py')}/bin/python3"
    repo = f"/lustre/{hostile(probe, 'repo')}"
    run_dir = tmp_path / f"run {hostile(probe, 'dir')}"
    script = render(tmp_path, run_dir, "executor=slurm", "gpu=cpu", "executor.gpus=1",
                    "executor.slurm.container_image=null", "executor.slurm.tunnel=ssh",
                    "executor.slurm.ssh.host=login.invalid", "executor.slurm.ssh.job_dir=/lustre/fp8",
                    f"executor.slurm.ssh.repo={hydra_quoted(repo)}",
                    f"executor.slurm.ssh.python={hydra_quoted(python)}")
    srun = run_script(tmp_path, script)
    assert srun[-4:] == [python, "-m", ENGINE, f"/lustre/fp8/runs/{run_dir.name}/config.yaml"]
    assert_nothing_ran(tmp_path)


# ---- refused by grammar, in one line naming the setting ----

NOT_A_WORD = ["gpu\ntouch pwned\n#", "gpu\n", "gpu\r", "gpu\tx", "gpu;touch pwned", "$(touch pwned)",
              "`touch pwned`", "gpu'x", 'gpu"x', "gpu x", "-gpu", "gpü", "gpu\\x", ""]


def refused(check, setting: str) -> str:
    with pytest.raises(ConfigError) as error:
        check()
    message = str(error.value)
    assert message.startswith(setting) and "\n" not in message, message
    return message


def sbatch_check(tmp_path: Path, **settings):
    return lambda: check_slurm_settings(SlurmConfig(**settings), tmp_path / "jobs", str(tmp_path / "run"))


NOT_IN_GRAMMAR = {"account": ["a,b", "a/b"], "partition": ["a,", ",a", "a,,b", "a, b"],
                  "time": ["١٢", "12\n", "1 day", "1:2:3:4", "1-", "-1", "forever"],
                  "mem": ["١٢", "10\n", "10GB", "1.5G", "-1", "10 G"]}


@pytest.mark.parametrize("field", NOT_IN_GRAMMAR)
def test_sbatch_values_outside_slurms_grammar_are_refused(tmp_path, field):
    for value in NOT_A_WORD + NOT_IN_GRAMMAR[field]:
        refused(sbatch_check(tmp_path, **{field: value}), f"executor.slurm.{field}={value!r}")
        setting = f"executor.slurm.sbatch_args.{field}={value!r}"  # the same option given as any other
        refused(sbatch_check(tmp_path, sbatch_args={field: value}), setting)


def test_sbatch_values_slurm_takes_are_accepted(tmp_path):
    for settings in [{"partition": "gpu,gpu-long", "account": "my_acct-01", "time": "04:00:00", "mem": "0"},
                     {"partition": "batch", "account": "ACCT.x", "time": "30", "mem": "200G"},
                     {"time": "1-12", "mem": "512m", "sbatch_args": {"qos": "high", "time": "2-00:30:00"}},
                     {"time": "UNLIMITED", "sbatch_args": {"mem": "1T", "mail-user": "me@x.org"}},
                     {"time": "infinite", "sbatch_args": {"comment": "a b 'c' \"d\" $(e) `f` ; # é \\ -g"}}]:
        sbatch_check(tmp_path, **settings)()


def test_a_control_character_in_any_sbatch_value_is_refused(tmp_path):
    for value in ["x\ntouch pwned", "x\rtouch pwned", "x\n", "x\0", "x\x1b[2J", "x\x7f"]:
        refused(sbatch_check(tmp_path, sbatch_args={"comment": value}), f"executor.slurm.sbatch_args.comment={value!r}")
        refused(sbatch_check(tmp_path, sbatch_args={"qos": value}), f"executor.slurm.sbatch_args.qos={value!r}")
    refused(sbatch_check(tmp_path, sbatch_args={"qos\n": "high"}), "executor.slurm.sbatch_args: ['qos\\n']")
    refused(sbatch_check(tmp_path, env_vars={"A\n": "1"}), "executor.slurm.env_vars: ['A\\n']")
    refused(sbatch_check(tmp_path, secret_env=["A\n"]), "executor.slurm.secret_env: ['A\\n']")


def ssh_config(**changes) -> SshTunnelConfig:
    return SshTunnelConfig(**{"host": "login1", "user": "me", "job_dir": "/lustre/fp8", "repo": "/lustre/repo",
                              **changes})


def test_ssh_user_and_host_outside_ssh_grammar_are_refused(tmp_path):
    for field in ("user", "host"):
        for value in NOT_A_WORD + ["-oProxyCommand=touch pwned", "me@login1", "login1:22"]:
            refused(lambda: check_ssh_settings(ssh_config(**{field: value}), tmp_path),
                    f"executor.slurm.ssh.{field}={value!r}")
    for host in ("login1", "login-1.cluster.org", "10.0.0.1", "::1", "fe80::1:2"):
        check_ssh_settings(ssh_config(host=host, user="first.last_2"), tmp_path)


def test_what_nemo_runs_rsync_writes_unquoted_is_refused_over_ssh(tmp_path, hydra_compose):
    """The key file, this machine's experiment folder (the upload's source) and the job folder (its target),
    through the launch's own checks."""
    ssh = ("executor=slurm", "gpu=cpu", "executor.slurm.tunnel=ssh", "executor.slurm.ssh.host=login1",
           "executor.slurm.ssh.job_dir=/lustre/fp8", "executor.slurm.ssh.repo=/lustre/repo", "dryrun=true")
    for override, setting in [("executor.slurm.ssh.identity", "executor.slurm.ssh.identity"),
                              ("executor.nemo_run_home", "executor.nemo_run_home"),
                              ("executor.slurm.ssh.job_dir", "executor.slurm.ssh.job_dir")]:
        for value in ["/a b/key", "/a/$(touch pwned)", "/a/`touch pwned`", "/a;touch pwned", "/a'b", "/a/é",
                      "/a\nb"]:
            cfg = hydra_compose(*ssh, f"{override}={hydra_quoted(value)}")
            refused(lambda: check_cluster(cfg, tmp_path / "run"), setting)
    check_cluster(hydra_compose(*ssh, "executor.slurm.ssh.identity='~/.ssh/id_ed25519'"), tmp_path / "run")


def test_launch_refuses_a_hostile_sbatch_value_in_one_line_before_writing(tmp_path):
    probe = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    result = run_py(tmp_path, "executor=slurm", "gpu=cpu", f"run.dir={run_dir}", "dryrun=true",
                    f"executor.slurm.partition={hydra_quoted(f'gpu{chr(10)}touch {probe}{chr(10)}#')}", check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert re.fullmatch(r"error: executor\.slurm\.partition='gpu\\ntouch .*\n", result.stderr), result.stderr
    assert not run_dir.exists() and not probe.exists()


def test_a_user_that_ssh_would_read_as_an_option_is_refused_before_connecting(tmp_path):
    probe = tmp_path / "pwned"
    result = run_py(tmp_path, "executor=slurm", "gpu=cpu", f"run.dir={tmp_path / 'run'}",
                    "executor.slurm.tunnel=ssh", "executor.slurm.ssh.host=127.0.0.1",
                    f"executor.slurm.ssh.port={free_port()}", "executor.slurm.ssh.job_dir=/lustre/fp8",
                    "executor.slurm.ssh.repo=/lustre/repo", f"executor.slurm.ssh.user='-oProxyCommand=touch {probe}'",
                    check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: executor.slurm.ssh.user='-oProxyCommand=")
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()
    assert_nothing_ran(tmp_path)


def test_ssh_login_probe_ends_its_options_before_the_destination(tmp_path, monkeypatch):
    """Whatever the user name, ssh reads user@host as the destination: "--" ends its options."""
    for name, value in recorders(tmp_path, "ssh").items():
        monkeypatch.setenv(name, value)
    user = "-oProxyCommand=touch pwned"
    session = BatchSSHTunnel(host="127.0.0.1", user=user, port=free_port(), job_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="paramiko"):  # the recorder "logs in"; nothing listens on the port
        session.connect()
    (argv,) = recorded(tmp_path, "ssh")
    assert argv[argv.index("--"):] == ["--", f"{user}@127.0.0.1", "true"]


@pytest.mark.parametrize("folder", ["/lustre/a,b/run", "/lustre/a:b/run"])
def test_a_mounted_folder_that_pyxis_would_split_is_refused(folder):
    from recipes.plan.cluster import Site, check_mounted_folders

    check_mounted_folders(Site(repo="/lustre/repo", storage="/lustre/runs", job_root="/j", run_dir="/lustre/runs/r",
                               python="python"))
    with pytest.raises(ConfigError, match=re.escape(f"run.dir: {folder!r} holds ',' or ':'")):
        check_mounted_folders(Site(repo="/lustre/repo", storage="/lustre/runs", job_root="/j", run_dir=folder,
                                   python="python"))
