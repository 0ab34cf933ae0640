"""executor.slurm.tunnel=ssh: submission through nemo-run's SSHTunnel to a real sshd on loopback, in front of the
real single-node Slurm of tests/test_slurm.py.

The sshd is this module's own (openssh-server's binary; .ci/run installs it): a fresh host key, a fresh client key
pair, a free port on 127.0.0.1, its host key in ~/.ssh/known_hosts for the module's duration (the `ssh` command
that nemo-run's rsync runs reads only that file). The "cluster side" is a different folder from the local run
directory, so the upload of the config and the copy of the metrics back are real.
"""

from __future__ import annotations

import getpass
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from recipes.config import ConfigError, SshTunnelConfig
from recipes.slurm import JOB_RECORD, JobRecord
from recipes.ssh import check_remote_checkout, tunnel
from conftest import missing
from test_slurm import FINISHED, REPO, TINY_CPU, run_py, status, steps, wait_for

SSHD = Path("/usr/sbin/sshd")
START_WAIT_S = 10


@dataclass
class Sshd:
    port: int
    key: Path  # authorized
    stranger_key: Path  # not authorized


def keypair(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_listening(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"sshd exited: {server.stderr.read()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"sshd is not listening on 127.0.0.1:{port} after {START_WAIT_S}s")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Sshd:
    if not SSHD.is_file() or shutil.which("rsync") is None:
        missing("no sshd or rsync here: apt-get install openssh-server rsync")
    folder = tmp_path_factory.mktemp("sshd")
    host_key, key, stranger = keypair(folder / "host_key"), keypair(folder / "key"), keypair(folder / "stranger")
    shutil.copy(key.with_suffix(".pub"), folder / "authorized_keys")
    port = free_port()
    # A second test cluster (scripts/slurm/start.sh's FP8_SLURM_CONF) is the one sbatch reaches over SSH too.
    slurm_conf = f"SetEnv SLURM_CONF={os.environ['SLURM_CONF']}\n" if "SLURM_CONF" in os.environ else ""
    (folder / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {folder / 'sshd.pid'}
AuthorizedKeysFile {folder / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
{slurm_conf}""")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    server = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(folder / "sshd_config")],
                              stderr=subprocess.PIPE, text=True)
    known_hosts = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh" / "known_hosts"
    entry = f"[127.0.0.1]:{port} {' '.join(host_key.with_suffix('.pub').read_text().split()[:2])}\n"
    try:
        wait_listening(port, server)
        known_hosts.parent.mkdir(mode=0o700, exist_ok=True)
        with known_hosts.open("a") as file:
            file.write(entry)
        yield Sshd(port, key, stranger)
    finally:
        server.terminate()
        server.wait(timeout=10)
        if known_hosts.is_file():
            known_hosts.write_text("".join(line for line in known_hosts.read_text().splitlines(True) if line != entry))


def over_ssh(tmp_path: Path, port: int | str, key: Path | str, host: str = "127.0.0.1") -> tuple[str, ...]:
    """Overrides for the test sshd; the user is left to its default, the user name here."""
    return ("executor.slurm.tunnel=ssh", f"executor.slurm.ssh.host={host}", f"executor.slurm.ssh.port={port}",
            f"executor.slurm.ssh.identity={key}",
            f"executor.slurm.ssh.job_dir={tmp_path / 'cluster'}", f"executor.slurm.ssh.repo={REPO}",
            f"executor.slurm.ssh.python={sys.executable}")


def test_dryrun_renders_the_script_as_it_runs_on_the_cluster_without_connecting(tmp_path):
    result = run_py(tmp_path, "executor=slurm", "gpu=h100", "trainer.global_batch_size=64", "executor.slurm.tunnel=ssh",
                    "executor.slurm.ssh.host=login.invalid", "executor.slurm.ssh.job_dir=/lustre/me/fp8",
                    "executor.slurm.ssh.repo=/lustre/me/fp8-recipes", f"run.dir={tmp_path / 'run'}", "dryrun=true")
    script = (tmp_path / "run" / "sbatch.sh").read_text()
    assert script in result.stdout and str(tmp_path) not in script  # only the cluster's paths
    lines = script.splitlines()
    (output,) = [line for line in lines if line.startswith("#SBATCH --output=")]
    assert output.startswith("#SBATCH --output=/lustre/me/fp8/experiments/tiny_llama-fp8_current/")
    assert "export PYTHONPATH=/lustre/me/fp8-recipes" in lines
    (srun,) = [line for line in lines if line.startswith("srun ") and "torch_engine" in line]
    assert "--container-mounts /lustre/me/fp8-recipes:/lustre/me/fp8-recipes,/lustre/me/fp8:/lustre/me/fp8," in srun
    assert srun.endswith(" -m recipes.engine.torch_engine /lustre/me/fp8/runs/run/config.yaml")
    # the plan prints the command the job runs there: the cluster's Python and config, not this machine's
    assert [line.split(None, 1)[1] for line in result.stdout.splitlines() if line.startswith("command ")] == [
        "torchrun --nproc-per-node=8 --nnodes=1 -m recipes.engine.torch_engine /lustre/me/fp8/runs/run/config.yaml"]


def settings(sshd: Sshd, tmp_path: Path, **changes) -> SshTunnelConfig:
    return SshTunnelConfig(**{"host": "127.0.0.1", "port": sshd.port, "user": getpass.getuser(),
                              "identity": str(sshd.key), "job_dir": str(tmp_path / "cluster"), "repo": str(REPO),
                              "python": sys.executable, **changes})


def test_a_bad_host_key_checkout_or_python_is_a_clear_error(sshd, tmp_path):
    for changes, message in [({"port": free_port()}, "Connection refused"),
                             ({"identity": str(sshd.stranger_key)}, "Permission denied (publickey)"),
                             ({"host": "localhost"}, "Host key verification failed")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            tunnel(settings(sshd, tmp_path, **changes), job_dir=str(tmp_path)).connect()
    missing = settings(sshd, tmp_path, repo=str(tmp_path))
    with pytest.raises(ConfigError, match="no checkout of this repository"):
        check_remote_checkout(tunnel(missing, job_dir=str(tmp_path)), missing, sys.executable)
    present = settings(sshd, tmp_path)
    with pytest.raises(ConfigError, match=re.escape("executor.slurm.ssh.python='/no/python' is not found")):
        check_remote_checkout(tunnel(present, job_dir=str(tmp_path)), present, "/no/python")
    # On the command line: one line naming the fix, no traceback, nothing submitted.
    result = run_py(tmp_path, *TINY_CPU, *over_ssh(tmp_path, sshd.port, sshd.stranger_key), check=False)
    assert result.returncode != 0 and "error: ssh " in result.stderr and "Traceback" not in result.stderr
    assert "(publickey)" in result.stderr and not (tmp_path / "cluster").exists()


def test_a_user_name_like_an_option_is_only_a_user_name_to_ssh(sshd, tmp_path):
    """The launch refuses it (tests/test_shell_values.py); the tunnel's own `ssh` ends its options before user@host
    all the same, so the real ssh takes it for a user that cannot log in and runs no ProxyCommand."""
    probe = tmp_path / "pwned"
    with pytest.raises(ConfigError, match=re.escape("ssh -oProxyCommand=")):
        tunnel(settings(sshd, tmp_path, user=f"-oProxyCommand=touch {probe}"), job_dir=str(tmp_path)).connect()
    assert not list(tmp_path.glob("pwned*"))


def test_job_submitted_over_ssh_trains_and_its_metrics_come_back(cluster, sshd, tmp_path):
    run_dir, remote_run_dir = tmp_path / "run", tmp_path / "cluster" / "runs" / "run"
    result = run_py(tmp_path, *TINY_CPU, *over_ssh(tmp_path, sshd.port, sshd.key), "executor.gpus=2",
                    "trainer.max_steps=3", f"run.dir={run_dir}")
    record = JobRecord.load(run_dir / JOB_RECORD)
    assert f"submitted   Slurm job {record.job_id}" in result.stdout
    assert (record.ssh["user"], record.ssh["port"]) == (getpass.getuser(), sshd.port)
    assert record.remote_run_dir == str(remote_run_dir)
    assert record.log_dir.startswith(f"{tmp_path / 'cluster' / 'experiments'}/")
    uploaded = yaml.safe_load((remote_run_dir / "config.yaml").read_text())
    assert uploaded["run"]["dir"] == str(remote_run_dir)  # the config the job runs, with the cluster's run dir
    assert f"torch_engine {remote_run_dir}/config.yaml" in (run_dir / "sbatch.sh").read_text()
    assert wait_for(record.job_id, FINISHED) == "COMPLETED"
    assert steps(remote_run_dir) == [1, 2, 3] and not (run_dir / "metrics.jsonl").exists()  # written there only
    [(job, state, restarts, last_step, _)] = status(run_dir, tmp_path)  # over SSH; copies the outputs here
    assert (job, state, restarts, last_step) == (record.job_id, "COMPLETED", "0", "3")
    assert steps(run_dir) == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert "[default0]:step     3/3" in (run_dir / "train.log").read_text()
    [(job, state, *_)] = status(record.experiment, tmp_path)  # the experiment by name, as nemo-run groups it
    assert (job, state) == (record.job_id, "COMPLETED")
