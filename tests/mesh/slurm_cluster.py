"""A private two-node Slurm cluster on this machine, for the cluster tests (tests/mesh/test_mesh_slurm.py).

Monarch's `SlurmJob` runs one worker per node at `tcp://<node hostname>:22222`
and refuses hostnames that resolve to a loopback address, so a job with a
trainer and a generator mesh needs two nodes with distinct, non-loopback
addresses. On one machine:

- a network namespace of the cluster's own, whose loopback device also holds
  10.77.0.1 (this host's name, where the controller and the clients run) and
  10.77.0.2 / 10.77.0.3 (the nodes `cm-n1`, `cm-n2`); nothing outside sees them;
- a mount namespace whose /etc/hosts (a bind mount of a file in the temp dir)
  names those addresses;
- one UTS namespace per slurmd, so each node, and every process Slurm starts
  on it, has its node's hostname.

A holder process (`sleep`) keeps the namespaces; every daemon and client
command enters them with `nsenter`. munged, slurmctld and two slurmd run in the
foreground as children of this process (their PIDs are known; `stop()` ends
exactly those), with config, munge key and socket, state, spool, pid and log
files all under one temp dir, removed by `stop()`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "iproute2")
BINARIES = ("slurmctld", "slurmd", "sinfo", "squeue", "scancel", "scontrol", "munged", "ip", "unshare", "nsenter")
CONTROLLER_ADDR = "10.77.0.1"
NODES = {"cm-n1": "10.77.0.2", "cm-n2": "10.77.0.3"}
SLURMD_PORTS = {"cm-n1": 6818, "cm-n2": 6819}  # one network namespace: each slurmd needs its own port
# Where Debian's Slurm and munge keep files by default: the cluster must leave them as they were.
SYSTEM_DIRS = ("/etc/slurm", "/etc/munge", "/var/lib/munge", "/var/log/munge", "/var/log/slurm", "/run/munge",
               "/run/slurm", "/var/spool/slurmctld", "/var/spool/slurmd", "/var/lib/slurm")

SLURM_CONF = """\
ClusterName=composer
SlurmctldHost={host}({ctl_addr})
SlurmctldPort=6817
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=2
KillWait=3
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=down Nodes=ALL MaxTime=INFINITE State=DOWN
"""


def skip_reason() -> str | None:
    """Why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the private Slurm cluster needs root (namespaces, apt-get, daemons as root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing and shutil.which("apt-get") is None:
        return f"Slurm/munge not installed ({', '.join(missing)} missing) and no apt-get to install them"
    return None


def install(attempts: int = 20) -> None:
    """apt-get install the cluster's packages unless all binaries are there (retries while dpkg is locked)."""
    if all(shutil.which(b) for b in BINARIES):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    for attempt in range(attempts):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode == 0:
            return
        if "lock" not in out.stderr or attempt == attempts - 1:
            if "Unable to locate package" in out.stderr:  # a fresh machine without package lists
                subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
                continue
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        time.sleep(5)  # a colleague's apt-get holds the dpkg lock


class SlurmCluster:
    """The cluster's files under `root`; `start()` brings it up, `stop()` ends its processes and removes `root`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="composer-slurm-"))
        self.host = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.holder: subprocess.Popen | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.system_before = system_files()

    # -- running commands inside the cluster's namespaces -------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every cluster process: its slurm.conf, and TMPDIR in the temp dir (Monarch's
        own log file and Python's temp files land there, not in /tmp)."""
        return dict(os.environ, SLURM_CONF=str(self.conf), TMPDIR=str(self.root / "tmp"), **extra)

    def inside(self, argv: list[str], node: str | None = None, cwd: Path | None = None) -> list[str]:
        """`argv` run in the cluster's network and mount namespaces, in `cwd` (default: the temp dir's
        `work/`), and as `node` (with its hostname) if given."""
        assert self.holder is not None
        enter = ["nsenter", "-t", str(self.holder.pid), "--net", "--mount", f"--wd={cwd or self.root / 'work'}"]
        if node is None:
            return [*enter, *argv]
        return [*enter, "unshare", "--uts", "sh", "-c", f'hostname {node} && exec "$@"', "sh", *argv]

    def run(self, argv: list[str], timeout: float = 60, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        return subprocess.run(self.inside(argv, cwd=cwd), capture_output=True, text=True, timeout=timeout, **kw)

    def squeue_ids(self) -> list[str]:
        """Ids of the jobs Slurm still lists (pending, running or completing)."""
        out = self.run(["squeue", "-h", "-o", "%i %T"])
        return [line.split()[0] for line in out.stdout.splitlines()]

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _write_files(self) -> None:
        for d in ("state", "run", "log", "work", "tmp", *(f"spool/{n}" for n in NODES)):
            (self.root / d).mkdir(parents=True)
        self.root.chmod(0o755)  # munged wants its socket's directory reachable by all
        (self.root / "munge").mkdir(mode=0o755)
        key_dir = self.root / "munge-key"
        key_dir.mkdir(mode=0o700)
        (key_dir / "munge.key").write_bytes(os.urandom(1024))
        (key_dir / "munge.key").chmod(0o400)
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} Port={SLURMD_PORTS[n]} CPUs=2 State=UNKNOWN"
                          for n, a in NODES.items())
        self.conf.write_text(SLURM_CONF.format(host=self.host, ctl_addr=CONTROLLER_ADDR, root=self.root, nodes=nodes))
        (self.root / "hosts").write_text(
            f"127.0.0.1 localhost\n{CONTROLLER_ADDR} {self.host}\n" + "".join(f"{a} {n}\n" for n, a in NODES.items()))

    def _start_holder(self) -> None:
        ready = self.root / "run" / "namespaces-ready"
        setup = " && ".join([
            "ip link set lo up",
            *(f"ip addr add {a}/24 dev lo" for a in (CONTROLLER_ADDR, *NODES.values())),
            f"mount --bind {self.root / 'hosts'} /etc/hosts",
            f"touch {ready}",
            "exec sleep infinity",
        ])
        self.holder = subprocess.Popen(["unshare", "--net", "--mount", "sh", "-c", setup],
                                       stdout=subprocess.DEVNULL, stderr=open(self.root / "log" / "holder.log", "w"))
        self._wait(ready.exists, 20, "the cluster's namespaces")

    def _daemon(self, name: str, argv: list[str], node: str | None = None) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(self.inside(argv, node), env=self.env(), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout_s} s (exited: {dead}); logs: {self.logs()}")
            time.sleep(0.3)

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        """Bring up munged, slurmctld and the two slurmd; returns when `sinfo` shows both nodes idle."""
        self._write_files()
        self._start_holder()
        m = self.root / "munge"
        self._daemon("munged", ["munged", "-F", f"--socket={m}/munge.socket",
                                f"--key-file={self.root}/munge-key/munge.key", f"--pid-file={m}/munged.pid",
                                f"--log-file={self.root}/log/munged.log", f"--seed-file={self.root}/munge-key/seed"])
        self._wait((m / "munge.socket").exists, 20, "munged")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf)], node=node)
        self._wait(lambda: self.run(["sinfo", "-h", "-p", "debug", "-o", "%T %D"]).stdout.split() == ["idle", "2"],
                   timeout_s, "sinfo: 2 idle nodes")
        return self

    def stop(self) -> list[str]:
        """Cancel every job, end the daemons and the holder by PID, remove the temp dir. Returns what
        had to be SIGKILLed or was still alive (empty when everything ended cleanly)."""
        problems: list[str] = []
        if self.holder is not None and self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--user=root"])
            deadline = time.monotonic() + 30
            while self.squeue_ids() and time.monotonic() < deadline:
                time.sleep(0.5)
            if left := self.squeue_ids():
                problems.append(f"jobs still queued after scancel: {left}")
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.daemons.pop(name, None)
            if proc is not None and not _end(proc):
                problems.append(f"{name} (pid {proc.pid}) needed SIGKILL")
        if self.holder is not None:
            if stray := [p for p in self.processes() if p != self.holder.pid]:
                problems.append(f"processes left in the cluster's namespace: {_describe(stray)}")
                for pid in stray:
                    _kill(pid)
        if self.holder is not None and not _end(self.holder):
            problems.append(f"namespace holder (pid {self.holder.pid}) needed SIGKILL")
        shutil.rmtree(self.root, ignore_errors=True)
        if (after := system_files()) != self.system_before:
            changed = sorted(set(after.items()) ^ set(self.system_before.items()))
            problems.append(f"files changed outside the temp dir: {changed}")
        return problems

    def processes(self) -> list[int]:
        """PIDs of every process in the cluster's network namespace (daemons, job steps, clients)."""
        assert self.holder is not None
        ns = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        pids = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/net") == ns:
                    pids.append(int(entry))
            except OSError:  # exited meanwhile
                pass
        return pids

    def logs(self, tail: int = 1500) -> str:
        """The last characters of every log file (for failure messages)."""
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


def _end(proc: subprocess.Popen, timeout_s: float = 15) -> bool:
    """SIGTERM, then SIGKILL after `timeout_s`; True when SIGTERM was enough."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def system_files() -> dict[str, int]:
    """Every file under SYSTEM_DIRS with its modification time (ns)."""
    out = {}
    for d in SYSTEM_DIRS:
        for path in Path(d).rglob("*") if Path(d).is_dir() else ():
            try:
                out[str(path)] = path.lstat().st_mtime_ns
            except OSError:
                pass
    return out


def _describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ').decode()[:120]}")
        except OSError:
            out.append(f"{pid} (exited)")
    return "; ".join(out)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
