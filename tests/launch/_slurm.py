"""A real single-node Slurm for the tests: munged, slurmctld and slurmd started from configs
written to a temporary directory (own munge socket and key, free ports, cgroup features off:
proctrack/linuxproc, task/none, no accounting), stopped by PID afterwards.

Imported as ``_slurm`` from tests/launch (tests/conftest.py puts tests/ on ``sys.path``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from _launch import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _which(b: str) -> str:
    return shutil.which(b) or str(Path("/usr/sbin", b))


class SlurmCluster:
    """One node (this host, as ``NodeName=<short hostname>`` at 127.0.0.1), one partition."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]  # an outer allocation's variables would confuse sbatch

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.out", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        r = self.root
        for d in ("munge", "state", "spool"):
            (r / d).mkdir(mode=0o700, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = r / "munge" / "munge.socket"
        self._spawn("munged", [_which("munged"), "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munge' / 'munged.log'}",
                               f"--seed-file={r / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        cpus = os.cpu_count() or 1
        self.cluster_name = f"moeasync{os.getpid()}"
        self.conf.write_text(f"""\
ClusterName={self.cluster_name}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser={self.user}
SlurmdUser={self.user}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])

        def idle() -> bool:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            return p.returncode == 0 and p.stdout.strip() == "idle"

        self._wait(idle, timeout_s, "the node to be idle in sinfo")
        return self

    def _wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: waiting for {what} failed (exited: {dead}); logs:\n"
                                   + self.logs())
            time.sleep(0.2)

    def logs(self, n: int = 2000) -> str:
        out = []
        for f in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
        return "\n".join(out)

    def run(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=kw.pop("env", self.env), capture_output=True, text=True, check=True,
                              **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, RunTime, TimeLimit, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, timeout_s: float, poll=None) -> dict[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING (a requeued job: until its next
        life ends); ``poll()`` runs each time."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_FED"):
                return info
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env)
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout_s:.0f} s")
            if poll is not None:
                poll()
            time.sleep(0.5)

    def stop(self) -> None:
        subprocess.run(["scancel", "--user", self.user], env=self.env, capture_output=True)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged: the PIDs started above
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)
