"""A Slurm login node over SSH (executor.slurm.tunnel=ssh): nemo-run's SSHTunnel, made to fail clearly.

nemo-run connects with paramiko, accepting any host key, and when key authentication fails it falls back to
password and 2FA prompts and then ends the process (sys.exit) without saying why. Its upload of the job folder
runs the `ssh` command through rsync, which checks the host key against known_hosts. BatchSSHTunnel replaces the
authentication: first the `ssh` command in batch mode (what rsync will meet: the same key, the same host key
check), then paramiko, refusing unknown host keys. A failure is a ConfigError with ssh's own reason and the fix.

SshCluster is the login node as `launch/status.py` reads it back: Slurm's commands run there, files come here.
"""

from __future__ import annotations

import io
import logging
import posixpath
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection
from nemo_run.core.tunnel.client import SSHTunnel

from recipes.config import ConfigError, SshTunnelConfig
from recipes.folders import write_file

CONNECT_TIMEOUT_S = 15
# nemo-run's console logging would show paramiko's per-connection chatter ("Connected", "Opened sftp
# connection") among the submission's own lines; its warnings and errors still show.
logging.getLogger("paramiko").setLevel(logging.WARNING)


@dataclass(kw_only=True)
class BatchSSHTunnel(SSHTunnel):
    """nemo-run's SSHTunnel without prompts: key (or agent) authentication only, known host keys only."""

    def _authenticate(self) -> None:
        where = f"{self.user}@{self.host}:{self.port}"
        key = str(Path(self.identity).expanduser()) if self.identity else None
        identity = ["-i", key] if key else []
        try:  # "--": a destination that starts with "-" is not read as an option (recipes.plan.cluster refuses one)
            probe = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
                                    "-p", str(self.port), *identity, "--", f"{self.user}@{self.host}", "true"],
                                   capture_output=True, text=True, timeout=2 * CONNECT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise ConfigError("executor.slurm.tunnel=ssh needs the `ssh` command (and rsync) here: install "
                              "openssh-client and rsync") from None
        except subprocess.TimeoutExpired:
            raise ConfigError(f"ssh {where}: no answer in {2 * CONNECT_TIMEOUT_S}s; check executor.slurm.ssh.host "
                              "and port") from None
        if probe.returncode != 0:
            reason = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
            login = shlex.join(["ssh", "-p", str(self.port), *identity, f"{self.user}@{self.host}"])
            raise ConfigError(f"ssh {where} failed: {reason}. Check executor.slurm.ssh (host, port, user, identity); "
                              f"`{login}` must log in without a password or prompt (a key or agent, and the host in "
                              "~/.ssh/known_hosts)")
        session = Connection(self.host, user=self.user, port=self.port, connect_timeout=CONNECT_TIMEOUT_S,
                             connect_kwargs={"key_filename": [key]} if key else {},
                             config=FabricConfig(overrides={"run": {"in_stream": False}}))
        session.client.load_system_host_keys()  # ~/.ssh/known_hosts, which the `ssh` command just checked
        session.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            session.open()
        except (paramiko.SSHException, OSError) as error:
            raise ConfigError(f"ssh {where}: the `ssh` command logs in but paramiko (nemo-run's SSH) does not: "
                              f"{error}") from None
        self.session = session


def tunnel(ssh: SshTunnelConfig, job_dir: str) -> BatchSSHTunnel:
    return BatchSSHTunnel(host=ssh.host, user=ssh.user, port=ssh.port, identity=ssh.identity, job_dir=job_dir)


def check_remote_checkout(session: BatchSSHTunnel, ssh: SshTunnelConfig, python: Optional[str]) -> None:
    """The job imports this repository from ssh.repo and runs `python` there: check both before submitting
    (`python` None: it is inside the job's container, which the login node cannot check)."""
    engine = posixpath.join(ssh.repo, "recipes", "engine", "torch_engine.py")
    if not session.run(f"test -f {shlex.quote(engine)}", warn=True).ok:
        raise ConfigError(f"executor.slurm.ssh.repo={ssh.repo!r}: no checkout of this repository on {ssh.host} "
                          f"({engine} is missing); clone it there on storage the nodes see")
    if python is not None and not session.run(f"command -v {shlex.quote(python)}", warn=True).ok:
        raise ConfigError(f"executor.slurm.ssh.python={python!r} is not found on {ssh.host}; give the path of a "
                          "Python with this repository's dependencies (torch, PyYAML) on the cluster")


def upload(session: BatchSSHTunnel, text: str, remote_path: str) -> None:
    session.run(shlex.join(["mkdir", "-p", "--", posixpath.dirname(remote_path)]))
    session.put(io.BytesIO(text.encode()), remote_path)


class SshCluster:
    """Slurm's commands and the jobs' files on a login node, for launch/status.py."""

    def __init__(self, ssh: SshTunnelConfig):
        self.session = tunnel(ssh, job_dir=ssh.job_dir)
        self.session.connect()

    def run(self, *command: str) -> str:
        done = self.session.run(shlex.join(command), warn=True)
        return done.stdout if done.ok else ""

    def listdir(self, folder: str) -> list[str]:
        return self.run("ls", "-1A", "--", folder).splitlines()

    def fetch(self, path: str, local: Path) -> None:
        copy = io.BytesIO()
        self.session.get(path, copy)
        write_file(local, copy.getvalue())
