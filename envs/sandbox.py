"""Run model-written code in a contained process tree and report what happened.

Containment, all enforced by the kernel (docs/envs.md lists what each stops):
- bubblewrap (`bwrap`, run as root, no user namespace) builds IPC, PID,
  network, UTS and cgroup namespaces and a minimal read-only root: /usr (with
  the /bin, /lib symlinks), the interpreter's prefixes, the paths a run names,
  a fresh /proc and /dev, a size-capped /tmp and /dev/shm, and the workspace
  writable. Nothing else of the host exists inside (no /etc, /root, /home,
  project checkout, other workspaces, host sockets); PID 1 of the namespace
  takes every process with it when it exits;
- `setpriv` drops to a private uid per workspace with no capabilities and
  no_new_privs;
- a seccomp-bpf filter (`envs.containment`) denies new namespaces, mounts,
  bpf, keyrings, ptrace and the like;
- per-run cgroups cap memory, processes and CPU of the whole tree;
- rlimits on CPU time, address space, file size, processes, open files;
- a wall-clock timer that kills every process of the run's cgroup;
- a scrubbed environment and secrets redacted from the output tails.
Where a protection is unavailable the sandbox refuses to run (`SandboxUnavailable`);
it never runs code with less containment than it reports.
"""

from __future__ import annotations

import os
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from composer_mesh.configs.sections.env import SandboxConfig
from composer_mesh.envs.containment import ContainmentUnavailable, RunCgroup, probe_cgroups, seccomp_fd, seccomp_filter
from composer_mesh.envs.grade_cache import GradeCache
from composer_mesh.envs.tree import remove_tree, walk

_SETPRIV = "/usr/bin/setpriv"
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
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
        """Give every entry under `path` to the sandbox uid (after the host copied files in); `TreeTooDeep` for a
        tree past `envs.tree`'s bounds."""
        for root, dirs, files in walk(self.path):
            for name in dirs + files:
                os.lchown(os.path.join(root, name), self.uid, self.uid)
        os.chown(self.path, self.uid, self.uid)

    def cleanup(self) -> None:
        """Remove the workspace and the scratch dir, at any depth, and free the uid (always, and once: a second
        call cannot free the lock of a later workspace that drew the same uid)."""
        try:
            remove_tree(self.path)
            remove_tree(self.scratch)
        finally:
            lock, self.uid_lock = self.uid_lock, None
            if lock is not None:
                lock.unlink(missing_ok=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


_probe_cache: dict[str, str] = {}


def probe(bwrap_binary: str = "bwrap") -> str:
    """'' when bubblewrap, setpriv, seccomp and the cgroups work here, else the reason they do not."""
    if bwrap_binary in _probe_cache:
        return _probe_cache[bwrap_binary]
    reason = ""
    if os.geteuid() != 0:
        reason = "needs root for namespaces without a user namespace, cgroups and a private uid"
    elif shutil.which(bwrap_binary) is None:
        reason = f"{bwrap_binary!r} (bubblewrap) not found; `apt-get install -y bubblewrap`"
    elif not os.access(_SETPRIV, os.X_OK):
        reason = f"{_SETPRIV} (util-linux) not found"
    else:
        reason = probe_cgroups()
        if not reason:
            try:
                seccomp_filter()
            except ContainmentUnavailable as exc:
                reason = str(exc)
        if not reason:
            cmd = [bwrap_binary, "--unshare-all", "--ro-bind", "/usr", "/usr", *_root_links(), "/usr/bin/true"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                reason = f"bubblewrap cannot build namespaces here: {proc.stderr.strip() or proc.returncode}"
    _probe_cache[bwrap_binary] = reason
    return reason


def _root_links() -> list[str]:
    """bwrap arguments recreating /bin, /lib, ... (merged-/usr symlinks, or read-only binds)."""
    args = []
    for link in _ROOT_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


class Sandbox:
    """Runs commands in private workspaces under the limits of a `SandboxConfig`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        reason = probe(self.config.bwrap_binary)
        if reason:
            raise SandboxUnavailable(f"refusing to run untrusted code: {reason}")
        self._bwrap = shutil.which(self.config.bwrap_binary)
        self.root = Path(self.config.root_dir or tempfile.gettempdir()) / "composer-mesh-sandboxes"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # others may traverse to their workspace, not list
        # uid locks are shared by every sandbox of the host, whatever its root: two graders never share a uid
        self.uid_locks = Path(tempfile.gettempdir()) / "composer-mesh-uids"
        self.uid_locks.mkdir(mode=0o700, exist_ok=True)
        # names this sandbox's cgroups, so a check can tell them from another grader's
        self.tag = uuid.uuid4().hex[:8]
        # grades by content (envs.grading.grade_workspace), shared by every task graded here
        self.grades = GradeCache(self.config.grade_cache) if self.config.grade_cache else None

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A fresh private workdir, optionally a copy of a tree (see `copy_tree` for `skip`); when the copy is
        refused (too large, too deep) nothing is left behind and the uid is free again."""
        uid, lock = self._reserve_uid()
        ws = Workspace(path=Path(tempfile.mkdtemp(prefix="ws-", dir=self.root)), uid=uid,
                       scratch=Path(tempfile.mkdtemp(prefix="host-", dir=self.root)), uid_lock=lock)
        try:
            if copy_from is not None:
                copy_tree(Path(copy_from), ws.path, skip=skip)
            ws.adopt()
        except BaseException:
            ws.cleanup()
            raise
        return ws

    def scratch_workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A workspace for one short run (a grade's judge or callee): `workspace` here, a warm slot in `envs.pool`."""
        return self.workspace(copy_from, skip)

    def _reserve_uid(self) -> tuple[int, Path]:
        """A uid no other live workspace (of any process) holds: an exclusive lock file per uid."""
        for _ in range(1000):
            uid = self.config.uid_base + secrets.randbelow(self.config.uid_count)
            lock = self.uid_locks / f"uid-{uid}"
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue
            if not processes_of(uid):
                return uid, lock
            lock.unlink()
        raise SandboxUnavailable(f"no free sandbox uid in [{self.config.uid_base}, +{self.config.uid_count})")

    def python(self) -> str:
        """The interpreter sandboxed Python programs should use (this one), by the path the sandbox binds.

        The sandbox binds the resolved prefix, so a virtualenv reached through a
        symlink is run from its real directory (its `bin/python` link, which
        keeps the virtualenv's site-packages).
        """
        return interpreter()

    def run(
        self,
        argv: Sequence[str],
        ws: Workspace,
        *,
        stdin: bytes = b"",
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        tail_chars: int | None = None,
        expose: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
        hand_over: Sequence[int] = (),
    ) -> SandboxResult:
        """Run `argv` in `ws` (cwd) as the workspace's uid; never raises for what the program does.

        tail_chars: how much of stdout/stderr to keep (default `output_tail_chars`).
        expose: extra host paths bound read-only (e.g. a runner script).
        pass_fds: host fds the program inherits (e.g. a pipe to another sandbox).
        hand_over: those of `pass_fds` the host closes once the program started (or failed to),
        so that the program holds the only copy (end-of-stream reaches its peer when it exits).
        """
        cfg = self.config
        child_env = self._environment(ws, env)
        exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=child_env["PATH"])
        if exe is None:
            return SandboxResult(127, "", f"command not found: {argv[0]}", 0.0, 0.0, False)
        stdin_path, out_path, err_path = (ws.scratch / n for n in ("stdin", "stdout", "stderr"))
        with os.fdopen(os.open(stdin_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(stdin)
        cgroup = RunCgroup.create(
            f"{self.tag}-{ws.uid}-{uuid.uuid4().hex[:8]}", cfg.memory_mb, cfg.max_processes + 4, cfg.cpu_cores
        )
        limits = self._limits()

        def enter() -> None:  # in the child, before exec: join the cgroups, set the rlimits
            cgroup.join()
            for name, value in limits.items():
                resource.setrlimit(getattr(resource, name), value)

        timeout = cfg.wall_timeout_s if timeout_s is None else timeout_s
        fired = threading.Event()
        filter_fd = seccomp_fd()
        try:
            cmd = self._command(exe, argv, ws, expose, filter_fd)
            start = time.perf_counter()
            with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
                proc = subprocess.Popen(
                    cmd, stdin=fin, stdout=fout, stderr=ferr, env=child_env, preexec_fn=enter,
                    pass_fds=(filter_fd, *pass_fds), start_new_session=True,
                )
        except BaseException:
            cgroup.destroy()
            raise
        finally:
            for fd in (filter_fd, *hand_over):
                os.close(fd)

        def kill_tree() -> None:
            fired.set()
            cgroup.kill()

        timer = threading.Timer(timeout, kill_tree)
        timer.start()
        try:
            _, wrapper_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wrapper_status)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        violations = []
        if fired.is_set():
            violations.append("timeout")
        violations += cgroup.limits_hit()
        if cgroup.destroy() or kill_stray(ws.uid):
            violations.append("stray_process")
        exit_code = proc.returncode
        n = self.config.output_tail_chars if tail_chars is None else tail_chars
        stdout, stderr = _tail(out_path, n), _tail(err_path, n)
        violations += _classify(exit_code, stdout + stderr, fired.is_set())
        return SandboxResult(
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime,
            timed_out=fired.is_set(),
            violations=tuple(dict.fromkeys(violations)),
        )

    def _exposed(self, expose: Sequence[str]) -> list[str]:
        """The host paths a run sees read-only at their own place (real paths outside /usr that exist), in mount
        order: the interpreter's prefixes, `expose_paths` and the run's own `expose`."""
        exposed = {sys.base_prefix, sys.prefix, *self.config.expose_paths, *expose}
        return [p for p in sorted({os.path.realpath(p) for p in exposed})
                if not p.startswith("/usr/") and os.path.exists(p)]

    def _command(self, exe: str, argv: Sequence[str], ws: Workspace, expose: Sequence[str], seccomp_fd: int) -> list[str]:
        """bwrap (namespaces, minimal root, seccomp) then setpriv (private uid, no caps) then the program."""
        cfg = self.config
        mib = 1 << 20
        cmd = [
            self._bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-add", "CAP_SETUID,CAP_SETGID",
            "--ro-bind", "/usr", "/usr",
        ]
        cmd += _root_links()
        cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(cfg.tmpfs_mb * mib), "--tmpfs", "/tmp",
                "--perms", "1777", "--size", str(cfg.tmpfs_mb * mib), "--tmpfs", "/dev/shm"]
        made = {"/tmp"}
        for path in self._exposed(expose):
            for parent in reversed(Path(path).parents[:-1]):  # traversable, whatever the host's modes
                if str(parent) not in made:
                    made.add(str(parent))
                    cmd += ["--perms", "0755", "--dir", str(parent)]
            cmd += ["--ro-bind", path, path]
        for parent in reversed(ws.path.parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += [
            "--bind", str(ws.path), str(ws.path), "--chdir", str(ws.path), "--seccomp", str(seccomp_fd),
            _SETPRIV, f"--reuid={ws.uid}", f"--regid={ws.uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", exe, *argv[1:],
        ]
        return cmd

    def _environment(self, ws: Workspace, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {
            "PATH": f"{Path(interpreter()).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(ws.path),
            "TMPDIR": "/tmp",  # the sandbox's own size-capped tmpfs
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


def interpreter() -> str:
    """This interpreter's path below the resolved `sys.prefix` (what exists inside the sandbox)."""
    prefix = os.path.abspath(sys.prefix)
    exe = os.path.abspath(sys.executable)
    if exe.startswith(prefix + os.sep):
        return os.path.join(os.path.realpath(prefix), os.path.relpath(exe, prefix))
    return os.path.realpath(exe)


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
    """Copy regular files and dirs only (no symlinks, FIFOs, devices), refusing trees over `max_bytes` (ValueError)
    and trees past `envs.tree`'s depth and path bounds (`TreeTooDeep`).

    skip: called with each file's path relative to `src`; True leaves the file out.
    """
    total = 0
    for root, _, files in walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
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
            with open(f"/proc/{entry}/status", "rb") as f:
                status = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # only the two fields read (every grade scans /proc several times)
        try:
            state = status[status.index(b"\nState:") + 7:].split(None, 1)[0]
            real_uid = int(status[status.index(b"\nUid:") + 5:].split(None, 1)[0])
        except (ValueError, IndexError):  # an exiting process's status can come back cut short
            continue
        if real_uid == uid and not state.startswith((b"Z", b"X")):
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


def kill_stray(uid: int, keep: int | None = None, grace_s: float = 2.0) -> bool:
    """Kill what is left of a sandbox uid but `keep` (a pool worker's zygote); True when something survived
    `grace_s` of SIGKILLs.

    When the namespace's PID 1 exits the kernel kills the rest, but that takes a
    moment; only a process still alive after the grace period counts as an escape.
    """
    return kill_until_gone(lambda: [p for p in processes_of(uid) if p != keep], grace_s)


def kill_until_gone(alive: Callable[[], list[int]], grace_s: float = 2.0) -> bool:
    """SIGKILL the pids `alive()` lists until it lists none; True when some outlived `grace_s`."""
    deadline = time.monotonic() + grace_s
    while pids := alive():
        if time.monotonic() > deadline:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return False


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

