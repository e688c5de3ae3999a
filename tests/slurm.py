"""A private Slurm cluster for the tests: Debian's slurmctld and slurmd (22.05) as a single-node cluster on
127.0.0.1, every state, spool, pid and log file in a temporary folder, free ports, no systemd, no cgroups,
no accounting, and stopped afterwards; never a cluster left over from elsewhere. The daemons run as root
(slurmd starts each job as its user); where they cannot start (not root, Slurm not installed), the tests
that need one skip and say why. `SLURM_CONF` names the cluster's settings to every command the tests run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODE = "localhost"  # the node's name: slurmd is started with -N, since the machine's own name differs
CPUS = 4  # declared to Slurm (more than a 2-core machine has: config_overrides), so 4 tasks run at once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One Slurm cluster of our own (see the module's docstring). `run(...)` runs a client command
    (sbatch, squeue, scancel, scontrol) against it; `env` is the environment that reaches it."""

    def __init__(self) -> None:
        missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
                   if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"Slurm is not installed ({', '.join(missing)} not found; "
                               "apt-get install slurmctld slurmd slurm-client)")
        if os.geteuid() != 0:
            raise RuntimeError("slurmd must run as root to start jobs, and this test process is not root")
        self.folder = Path(tempfile.mkdtemp(prefix="towerlab-slurm-"))
        os.chmod(self.folder, 0o755)
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir()
        self.conf = self.folder / "slurm.conf"
        self.conf.write_text(self._settings(_free_port(), _free_port()))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pids: list[int] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _settings(self, ctld_port: int, d_port: int) -> str:
        f = self.folder
        return "\n".join([
            "ClusterName=towerlab", f"SlurmctldHost={NODE}", f"SlurmctldPort={ctld_port}", f"SlurmdPort={d_port}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/none", "CredType=cred/none",
            # a requeued task waits this + 1 s before it runs again (the default is about 121 s)
            "AuthInfo=cred_expire=10",
            f"StateSaveLocation={f / 'state'}", f"SlurmdSpoolDir={f / 'spool'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}", f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}", f"SlurmdLogFile={f / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "MailProg=/bin/true",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides", "ReturnToService=2",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=30", "MinJobAge=300",
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
            f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP", ""])

    def _start(self) -> None:
        subprocess.run(["slurmctld", "-i"], env=self.env, check=True, capture_output=True, timeout=60)
        self._pids.append(self._pid("slurmctld"))
        subprocess.run(["slurmd", "-N", NODE], env=self.env, check=True, capture_output=True, timeout=60)
        self._pids.append(self._pid("slurmd"))
        deadline = time.monotonic() + 60
        while True:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never became idle (sinfo: {state!r}); see {self.folder}/*.log")
            time.sleep(0.3)

    def _pid(self, daemon: str) -> int:
        path = self.folder / f"{daemon}.pid"
        deadline = time.monotonic() + 30
        while not path.is_file() or not path.read_text().strip():
            if time.monotonic() > deadline:
                log = self.folder / f"{daemon}.log"
                raise RuntimeError(f"{daemon} did not start: {log.read_text()[-500:] if log.is_file() else 'no log'}")
            time.sleep(0.1)
        return int(path.read_text().strip())

    def run(self, *command: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        """A client command against this cluster; `env`: the environment it runs in (a job submitted by
        it gets it too), with this cluster's SLURM_CONF."""
        done = subprocess.run(list(command), env={**(env or self.env), "SLURM_CONF": str(self.conf)},
                              capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def close(self) -> None:
        """Cancel every job, stop the daemons (by the pids they wrote) and wait until they are gone."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user", "root", check=False)
        for pid in reversed(self._pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.folder, ignore_errors=True)
