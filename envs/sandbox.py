"""Run model-written code in a contained process tree and report what happened.

Containment, all enforced by the kernel (docs/envs.md lists what each stops):
- network, PID and mount namespaces (`unshare`): no network at all (only a
  down loopback), the program is PID 1 of its namespace so every process it
  leaves behind dies with it, and `/proc` shows only the sandbox;
- a private uid per workspace: nothing outside the workspace is writable
  (world-writable dirs are re-mounted read-only, home dirs hidden), other
  sandboxes and the host's processes cannot be signalled, RLIMIT_NPROC counts
  only this sandbox;
- rlimits on CPU time, address space, file size, processes, open files;
- a wall-clock timer that kills the whole process group;
- a scrubbed environment (no inherited variables except named ones) and
  secrets redacted from the output tails.
Where a protection is unavailable the sandbox refuses to run (`SandboxUnavailable`);
it never runs code with less containment than it reports.
"""

from __future__ import annotations

import json
import marshal
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from configs.sections.env import SandboxConfig

_INIT = Path(__file__).with_name("_sandbox_init.py")
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm", "/dev/mqueue")
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
_SIGNAL_VIOLATIONS = {
    signal.SIGXCPU: "cpu_time_limit",
    signal.SIGXFSZ: "file_size_limit",
}


class SandboxUnavailable(RuntimeError):
    """A protection the sandbox needs is missing here; no code was run."""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed command did.

    exit_code: the program's exit status, or -N when signal N ended it.
    violations: limits hit or rules broken, as short names ("timeout",
    "cpu_time_limit", "file_size_limit", "memory_limit", "process_limit",
    "stray_process"); empty for a clean run.
    """

    exit_code: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    timed_out: bool
    violations: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.violations


@dataclass
class Workspace:
    """A private working directory owned by a sandbox uid; the host keeps a private scratch dir."""

    path: Path
    uid: int
    scratch: Path = field(repr=False)
    uid_lock: Path | None = field(default=None, repr=False)

    def adopt(self) -> None:
        """Give every entry under `path` to the sandbox uid (after the host copied files in)."""
        for root, dirs, files in os.walk(self.path):
            for name in dirs + files:
                os.lchown(os.path.join(root, name), self.uid, self.uid)
        os.chown(self.path, self.uid, self.uid)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.uid_lock is not None:
            self.uid_lock.unlink(missing_ok=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


_probe_cache: dict[str, str] = {}


def probe(unshare_binary: str = "unshare") -> str:
    """'' when namespaces, mounts and uid switching work here, else the reason they do not."""
    if unshare_binary in _probe_cache:
        return _probe_cache[unshare_binary]
    reason = ""
    if os.geteuid() != 0:
        reason = "needs root (or CAP_SYS_ADMIN and CAP_SETUID) for namespaces, mounts and a private uid"
    elif shutil.which(unshare_binary) is None:
        reason = f"{unshare_binary!r} (util-linux) not found"
    else:
        cmd = [unshare_binary, "--net", "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc", "true"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            reason = f"network/PID/mount namespaces unavailable: {proc.stderr.strip() or proc.returncode}"
    _probe_cache[unshare_binary] = reason
    return reason


class Sandbox:
    """Runs commands in private workspaces under the limits of a `SandboxConfig`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        reason = probe(self.config.unshare_binary)
        if reason:
            raise SandboxUnavailable(f"refusing to run untrusted code: {reason}")
        self._unshare = shutil.which(self.config.unshare_binary)
        self.root = Path(self.config.root_dir or tempfile.gettempdir()) / "composer-mesh-sandboxes"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # others may traverse to their workspace, not list

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A fresh private workdir, optionally a copy of a tree (see `copy_tree` for `skip`)."""
        uid, lock = self._reserve_uid()
        path = Path(tempfile.mkdtemp(prefix="ws-", dir=self.root))
        scratch = Path(tempfile.mkdtemp(prefix="host-", dir=self.root))
        if copy_from is not None:
            copy_tree(Path(copy_from), path, skip=skip)
        ws = Workspace(path=path, uid=uid, scratch=scratch, uid_lock=lock)
        ws.adopt()
        return ws

    def _reserve_uid(self) -> tuple[int, Path]:
        """A uid no other live workspace (of any process) holds: an exclusive lock file per uid."""
        for _ in range(1000):
            uid = self.config.uid_base + secrets.randbelow(self.config.uid_count)
            lock = self.root / f".uid-{uid}"
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue
            if not processes_of(uid):
                return uid, lock
            lock.unlink()
        raise SandboxUnavailable(f"no free sandbox uid in [{self.config.uid_base}, +{self.config.uid_count})")

    def python(self) -> str:
        """The interpreter sandboxed Python programs should use (this one)."""
        return sys.executable

    def run(
        self,
        argv: Sequence[str],
        ws: Workspace,
        *,
        stdin: bytes = b"",
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        tail_chars: int | None = None,
    ) -> SandboxResult:
        """Run `argv` in `ws` (cwd) as the workspace's uid; never raises for what the program does.

        tail_chars: how much of stdout/stderr to keep (default `output_tail_chars`).
        """
        cfg = self.config
        child_env = self._environment(ws, env)
        exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=child_env["PATH"])
        if exe is None:
            return SandboxResult(127, "", f"command not found: {argv[0]}", 0.0, 0.0, False)
        spec = {
            "workdir": str(ws.path),
            "uid": ws.uid,
            "readonly": list(_WORLD_WRITABLE),
            "hide": list(cfg.hide_paths),
            "expose": sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, _project_root())}),
            "limits": self._limits(),
            "argv": [exe, *argv[1:]],
            "env": child_env,
        }
        stdin_path, out_path, err_path, report_path = (
            ws.scratch / n for n in ("stdin", "stdout", "stderr", "report")
        )
        with os.fdopen(os.open(stdin_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(stdin)
        cmd = [
            self._unshare, "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
            "--mount-proc", sys.executable, "-I", "-S", str(_INIT), marshal.dumps(spec).hex(),
        ]
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, str(stdin_path), os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(out_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            (os.POSIX_SPAWN_OPEN, 2, str(err_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            (os.POSIX_SPAWN_OPEN, 3, str(report_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        ]
        timeout = cfg.wall_timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        pid = os.posix_spawn(self._unshare, cmd, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, file_actions=actions, setsid=True)
        fired = threading.Event()

        def kill_tree() -> None:
            fired.set()
            _killpg(pid)

        timer = threading.Timer(timeout, kill_tree)
        timer.start()
        try:
            _, wrapper_status, _ = os.wait4(pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        _killpg(pid)  # anything still in the group (the namespace is gone already)
        report = json.loads(report_path.read_text() or "null")
        if report is None:  # init never reported: killed by the timer, or setup failed
            exit_code, cpu_s = os.waitstatus_to_exitcode(wrapper_status), 0.0
        else:
            exit_code, cpu_s = os.waitstatus_to_exitcode(report["status"]), report["cpu_s"]
        violations = []
        if fired.is_set():
            violations.append("timeout")
        if kill_stray(ws.uid):
            violations.append("stray_process")
        n = self.config.output_tail_chars if tail_chars is None else tail_chars
        stdout, stderr = _tail(out_path, n), _tail(err_path, n)
        violations += _classify(exit_code, stdout + stderr, fired.is_set())
        return SandboxResult(
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            wall_s=wall,
            cpu_s=cpu_s,
            timed_out=fired.is_set(),
            violations=tuple(dict.fromkeys(violations)),
        )

    def _environment(self, ws: Workspace, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(ws.path),
            "TMPDIR": str(ws.path),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONUNBUFFERED": "1",
        }
        for name in self.config.env_passthrough:
            if name in os.environ and not _SECRET_NAME.search(name):
                env[name] = os.environ[name]
        env.update(extra or {})
        return env

    def _limits(self) -> dict[str, tuple[int, int]]:
        c = self.config
        mib = 1 << 20
        return {
            "RLIMIT_CPU": (c.cpu_time_s, c.cpu_time_s + 1),
            "RLIMIT_AS": (c.address_space_mb * mib, c.address_space_mb * mib),
            "RLIMIT_FSIZE": (c.file_size_mb * mib, c.file_size_mb * mib),
            "RLIMIT_NPROC": (c.max_processes, c.max_processes),
            "RLIMIT_NOFILE": (c.max_open_files, c.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }



def _tail(path: Path, n: int) -> str:
    """The last `n` characters of a file, secrets redacted."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * n))
        text = f.read().decode("utf-8", errors="replace")
    return redact(text[-n:] if n else "")


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Replace the values of secret-looking host variables (KEY, TOKEN, ...) with their names."""
    for name, value in (environ if environ is not None else os.environ).items():
        if value and len(value) >= 6 and _SECRET_NAME.search(name) and value in text:
            text = text.replace(value, f"<redacted:{name}>")
    return text


def copy_tree(
    src: Path, dst: Path, *, skip: Callable[[str], bool] | None = None, max_bytes: int = 256 << 20
) -> None:
    """Copy regular files and dirs only (no symlinks, FIFOs, devices), refusing trees over `max_bytes`.

    skip: called with each file's path relative to `src`; True leaves the file out.
    """
    total = 0
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in files:
            s = os.path.join(root, name)
            st = os.lstat(s)
            if not stat.S_ISREG(st.st_mode) or (skip is not None and skip(str(rel / name))):
                continue
            total += st.st_size
            if total > max_bytes:
                raise ValueError(f"{src} holds more than {max_bytes >> 20} MiB of files")
            shutil.copyfile(s, dst / rel / name, follow_symlinks=False)


def processes_of(uid: int) -> list[int]:
    """PIDs (host view) of live, non-zombie processes whose real uid is `uid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
            pids.append(int(entry))
    return pids


def processes_with(marker: str) -> list[int]:
    """PIDs (host view) whose command line contains `marker` (how tests find escaped processes)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def kill_stray(uid: int, grace_s: float = 2.0) -> bool:
    """Kill what is left of a sandbox uid; True when something survived `grace_s` of SIGKILLs.

    When the namespace's PID 1 exits the kernel kills the rest, but that takes a
    moment; only a process still alive after the grace period counts as an escape.
    """
    deadline = time.monotonic() + grace_s
    while pids := processes_of(uid):
        if time.monotonic() > deadline:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return False


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(exit_code: int, output: str, timed_out: bool) -> list[str]:
    """Name the limit a run hit, from its exit signal (or a shell's 128+N) and the errors it printed."""
    found = []
    signum = -exit_code if exit_code < 0 else exit_code - 128
    if signum in _SIGNAL_VIOLATIONS:
        found.append(_SIGNAL_VIOLATIONS[signum])
    elif exit_code == -signal.SIGKILL and not timed_out:
        found.append("cpu_time_limit")  # the hard RLIMIT_CPU sends SIGKILL
    if "MemoryError" in output:
        found.append("memory_limit")
    if "Resource temporarily unavailable" in output or "BlockingIOError" in output:
        found.append("process_limit")
    if "File too large" in output:
        found.append("file_size_limit")
    return found


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[1])
