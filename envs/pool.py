"""A pool of warm sandbox workers: grading at RL speed with every containment layer of a cold run.

`SandboxPool(config)` starts `pool_size` workers ahead. A worker is one slot:
a private uid (held for the slot's life), a workspace directory, and a
sandbox built exactly as `Sandbox.run` builds one (bwrap namespaces and
minimal root, setpriv, seccomp, rlimits, a scrubbed environment) whose program
is `_zygote.py`: Python with pytest and the grader's scripts loaded, which forks
a child per job. Each job still gets its own memory/pids/cpu cgroup, the job's
rlimits, a wall timer that kills the job's cgroup, and the stray-process check:
the zygote forks the next job's process ahead and the host moves it into that
job's cgroup while the slot is idle (`_place`), so the move is off the grade's path.

The graders lease slots through `scratch_workspace` (the judge's and the
callee's short-lived workspaces); `run` on a leased slot runs there warm, and
`python -E -s -P -B <grader script>` runs in the forked interpreter without an
exec. Agents' own workspaces (`workspace`) and runs in them stay cold: an
episode holds its workspace while the model writes, a slot is held for one grade.
When no slot frees up within `pool_wait_s`, a lease is a cold workspace (same
containment, cold cost; counted in `stats()["cold_fallbacks"]`).

Returning a lease hands the slot to a resetter thread: strays killed, the
workspace, the sandbox's /tmp and /dev/shm and the host scratch wiped (at any
depth: `envs.tree`), then checked (empty, only the zygote alive as the uid, the
zygote not stopped), the next job's process placed, and only then is the slot
free again; a slot that fails the check, whose reset raised, or whose worker
died, is replaced by a fresh worker. Free slots are leased oldest first, so a
slot serves as judge and as callee in turn.

A job runs as its zygote's uid, so it can change what the zygote's later
children inherit: its rlimits (prlimit), nice, scheduling policy and
parameters, CPU affinity and I/O priority. Before the zygote forks a job's
process (`_place`), the host reads all of these (`_Inherited`, a few syscalls)
and puts back what differs from when the worker became ready; a zygote that
cannot be put back is replaced. A job lost to its worker (the zygote died,
stopped, answered nonsense, or could not set the job's process up) is the
violation `worker_lost`: no verdict about the job.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import platform
import queue
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Mapping, Sequence

from composer_mesh.configs.sections.env import SandboxConfig
from composer_mesh.envs.containment import RunCgroup, seccomp_fd
from composer_mesh.envs.sandbox import (
    Sandbox, SandboxResult, SandboxUnavailable, Workspace, _classify, _tail, copy_tree, interpreter, kill_stray,
    kill_until_gone, processes_of,
)
from composer_mesh.envs.tree import clear_dir, remove_tree

_log = logging.getLogger(__name__)

_ENVS = Path(__file__).resolve().parent
_ZYGOTE = _ENVS / "_zygote.py"
# the grader's scripts a job may run in the warm interpreter (and all the worker exposes)
_SCRIPTS = tuple(str(_ENVS / n) for n in ("_grade_runner.py", "_callee.py", "_wire.py"))
# what the zygote compiles and imports once: the scripts, and the wire protocol under the name the judge loads it as
_PRELOAD = json.dumps({"scripts": _SCRIPTS, "modules": {"_composer_wire": str(_ENVS / "_wire.py")}})
_PY_FLAGS = ["-E", "-s", "-P", "-B"]
# IPC objects that would outlive a job in the worker's IPC namespace: denied in pool workers
_IPC_SYSCALLS = ("msgget", "semget", "shmget", "mq_open")
_START_S = 30.0
_REPLY_GRACE_S = 5.0
# the syscalls Python does not wrap, by machine: a zygote's I/O priority and full scheduling attributes
_SYSCALLS = {
    "x86_64": {"ioprio_set": 251, "ioprio_get": 252, "sched_setattr": 314, "sched_getattr": 315},
    "aarch64": {"ioprio_set": 30, "ioprio_get": 31, "sched_setattr": 274, "sched_getattr": 275},
}
_IOPRIO_WHO_PROCESS = 1
_libc = ctypes.CDLL(None, use_errno=True)


class _SchedAttr(ctypes.Structure):
    """The kernel's struct sched_attr: policy and its flags, nice, RT priority, the fair slice (`sched_runtime`)
    or deadline parameters, utilization clamps."""

    _fields_ = [
        ("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class _Inherited:
    """What a process of the slot's uid may change in its zygote (same uid: prlimit, setpriority,
    sched_setscheduler/sched_setattr, sched_setaffinity, ioprio_set) and every child the zygote forks later
    inherits. Nothing else of the zygote is theirs to change: it is non-dumpable (its /proc files are root's),
    ptrace and process_vm_* are denied, and signals it has blocked stay pending only until the next fork
    (`_zygote.drain_signals`)."""

    limits: bytes  # /proc/PID/limits: soft and hard of every resource (compared as read, parsed to restore)
    sched: tuple[int, ...]  # the sched_attr fields after `size`
    affinity: frozenset[int]
    ioprio: int

    def changed(self, baseline: _Inherited) -> list[str]:
        """The names of the fields that differ from `baseline`."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(baseline, f.name)]


@dataclass(eq=False)
class _Worker:
    """One slot: its uid, workspace and scratch dirs, cgroup, and the sandboxed zygote."""

    uid: int
    lock: Path
    path: Path
    scratch: Path
    cgroup: RunCgroup
    proc: subprocess.Popen
    ctrl: socket.socket
    zygote: int = 0
    # the slot cgroup's processes while idle: bwrap's and the zygote
    idle: set[int] = field(default_factory=set)
    # the own cgroup of the next job's process, which the zygote forked ahead and the host moved in while idle
    placed: RunCgroup | None = None
    broken: bool = False
    # what bwrap mounted read-only in the sandbox and the directories it made on the way (under the sandbox's
    # /tmp when the checkout or the interpreter lives there): root's, kept by every reset
    mounts: frozenset[Path] = frozenset()
    # the zygote's inherited state when the worker became ready: every job's process is forked from this
    inherited: _Inherited | None = None


@dataclass
class _Lease(Workspace):
    """A slot's workspace for one grader run; `cleanup` resets the slot and gives it back."""

    pool: SandboxPool | None = field(default=None, repr=False)
    worker: _Worker | None = field(default=None, repr=False)
    owner: int = field(default=0, repr=False)

    def cleanup(self) -> None:
        if self.pool is not None and self.worker is not None:
            worker, self.worker = self.worker, None
            self.pool._release(worker, self.owner)


class SandboxPool:
    """A `SandboxBackend` with warm workers for grading; every other run is the wrapped cold `Sandbox`'s."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.sandbox = Sandbox(config)
        self.config = self.sandbox.config
        if platform.machine() not in _SYSCALLS:
            raise SandboxUnavailable(
                f"refusing to pool workers on {platform.machine()}: no way to check what a job changed in its worker"
            )
        self.root = self.sandbox.root
        self.tag = self.sandbox.tag
        self.grades = self.sandbox.grades
        self.dir = Path(tempfile.mkdtemp(prefix="pool-", dir=self.root))
        self._free: list[_Worker] = []
        # per thread: slots it holds, and the second slot reserved for its grade's next lease
        self._held: dict[int, int] = {}
        self._reserved: dict[int, _Worker] = {}
        self._all: set[_Worker] = set()
        self._cond = threading.Condition()
        self._closed = False
        self.counts = dict(warm_runs=0, resets=0, reset_failures=0, restored=0, replaced=0, cold_fallbacks=0)
        self._count_lock = threading.Lock()
        # bwrap --die-with-parent ties a worker to the thread that started it: one long-lived thread starts them all
        self._spawns: queue.Queue = queue.Queue()
        threading.Thread(target=self._spawner, name="sandbox-pool-spawner", daemon=True).start()
        # returned slots are reset (and their next job's process placed) off the grader's thread
        self._resets: queue.Queue = queue.Queue()
        threading.Thread(target=self._resetter, name="sandbox-pool-resetter", daemon=True).start()
        atexit.register(self.close)
        try:
            for worker in [self._spawn().result() for _ in range(self.config.pool_size)]:
                self._add(worker)
        except BaseException:
            self.close()
            raise

    # -- SandboxBackend -------------------------------------------------------------------------

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """An agent's workspace (cold: it lives for a whole episode)."""
        return self.sandbox.workspace(copy_from, skip)

    def python(self) -> str:
        return self.sandbox.python()

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
        """`Sandbox.run`; warm in a leased slot's worker, cold in any other workspace."""
        worker = ws.worker if isinstance(ws, _Lease) else None
        if worker is None:
            return self.sandbox.run(argv, ws, stdin=stdin, timeout_s=timeout_s, env=env, tail_chars=tail_chars,
                                    expose=expose, pass_fds=pass_fds, hand_over=hand_over)
        try:
            return self._run_warm(worker, argv, ws, stdin, timeout_s, env, tail_chars, expose, pass_fds)
        finally:
            for fd in hand_over:
                os.close(fd)

    # -- leases -----------------------------------------------------------------------------------

    def scratch_workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A warm slot's workspace for one grader run (a cold workspace when none frees up in `pool_wait_s`)."""
        me = threading.get_ident()
        with self._cond:
            worker = self._reserved.pop(me, None)
            if worker is None:
                # a grade leases a judge and a callee: take two at once (one reserved for this thread's next
                # lease), so two grades never each hold one slot while waiting for another
                need = min(2, len(self._all)) or 1
                self._cond.wait_for(lambda: len(self._free) >= need or self._closed, timeout=self.config.pool_wait_s)
                if len(self._free) >= need and not self._closed:
                    # the slots free the longest first: a slot serves as judge and callee in turn
                    worker = self._free.pop(0)
                    if need == 2:
                        self._reserved[me] = self._free.pop(0)
            if worker is not None:
                self._held[me] = self._held.get(me, 0) + 1
        if worker is None:
            self._count("cold_fallbacks")
            return self.sandbox.workspace(copy_from, skip)
        lease = _Lease(path=worker.path, uid=worker.uid, scratch=worker.scratch, pool=self, worker=worker, owner=me)
        try:
            if copy_from is not None:
                copy_tree(Path(copy_from), worker.path, skip=skip)
            lease.adopt()
        except BaseException:
            lease.cleanup()
            raise
        return lease

    def _release(self, worker: _Worker, owner: int) -> None:
        """Hand the slot to the resetter (kill, wipe, check, place the next job's process), which frees it."""
        with self._cond:
            self._held[owner] -= 1
            if not self._held[owner]:
                del self._held[owner]
                spare = self._reserved.pop(owner, None)
                if spare is not None:  # the owner's grade is over: its unused reservation goes back
                    self._free.append(spare)
                    self._cond.notify_all()
        self._count("resets")
        self._resets.put(worker)

    def _resetter(self) -> None:
        """Reset returned slots one at a time; a slot that fails the check, or whose reset raised (whatever a job
        left behind), is replaced, and the thread goes on."""
        while (worker := self._resets.get()) is not None:
            if self._closed:
                continue
            try:
                clean = not worker.broken and self._reset(worker)
            except Exception as exc:  # the zygote went away, a job changed it beyond repair, a tree resisted, ...
                _log.warning("sandbox pool: resetting the slot of uid %d failed (%s: %s); replacing it", worker.uid,
                             type(exc).__name__, str(exc)[:200])
                clean = False
            if not clean:
                self._count("reset_failures", not worker.broken)
                self._replace(worker)
                continue
            with self._cond:
                self._free.append(worker)
                self._cond.notify_all()

    def _reset(self, worker: _Worker) -> bool:
        """Wipe everything a job could leave and check it is gone; False when the slot is not clean (it may raise:
        the resetter then replaces the slot too).

        Every process of the slot's uid descends from the zygote and stays in the slot's cgroup or a job's
        (only root can move it), and each job's end already checked the uid: here the slot's cgroup must
        hold exactly what it held when the worker became ready.
        """
        if not self._alive(worker) or set(worker.cgroup.pids()) != worker.idle:
            return False
        inside = Path(f"/proc/{worker.zygote}/root")
        areas = (worker.path, worker.scratch, inside / "tmp", inside / "dev" / "shm")
        # the root-owned directories bwrap made on the way to the workspace's mount point, and its read-only
        # mounts with theirs, stay
        mount = inside / worker.path.relative_to("/")
        keep = {inside / p.relative_to("/") for p in (*worker.path.parents, *worker.mounts)} | {mount}
        for area in areas:
            clear_dir(area, keep)
        clean = all(Path(e.path) in keep for a in areas for e in os.scandir(a))
        # the workspace is still mounted where jobs expect it, and the zygote still serves
        clean = clean and os.path.samefile(mount, worker.path) and self._alive(worker)
        clean = clean and set(worker.cgroup.pids()) == worker.idle
        os.chown(worker.path, worker.uid, worker.uid)
        os.chmod(worker.path, 0o700)
        # a lease with no run leaves its placed process unused (no job of the uid ran since it was placed)
        if clean and worker.placed is None:
            worker.placed = self._place(worker)
        return clean

    def _place(self, worker: _Worker) -> RunCgroup:
        """Have the zygote fork the next job's process and move it into that job's own cgroup.

        The zygote's inherited state is put back first (`_settle`): the process forked now is what the next
        job starts from. Done while the slot is idle (the move costs the kernel ~10 ms per job on cgroup v1):
        a job then only renames the cgroup to a run's name and sends its description.
        """
        if not self._settle(worker):
            raise ValueError("a job changed its zygote's inherited state and it could not be put back")
        cfg = self.config
        worker.ctrl.settimeout(_START_S)
        worker.ctrl.send(b'{"spare": true}')
        pid = json.loads(worker.ctrl.recv(4096))["pid"]
        name = f"pool-{self.tag}-{worker.uid}-next-{uuid.uuid4().hex[:8]}"
        cgroup = RunCgroup.create(name, cfg.memory_mb, cfg.max_processes + 4, cfg.cpu_cores)
        try:
            cgroup.attach(_host_pid(worker.cgroup, pid))
        except BaseException:
            worker.broken = True
            cgroup.destroy()
            raise
        return cgroup

    def _settle(self, worker: _Worker) -> bool:
        """The zygote's inherited state is what it was when the worker became ready: put back from here (as root)
        when a job changed it (counted in `restored`); False when it cannot be (the slot is then replaced)."""
        now = _inherited(worker.zygote)
        if now == worker.inherited:
            return True
        self._count("restored")
        changed = now.changed(worker.inherited)
        _log.warning("sandbox pool: a job changed the %s of its zygote (uid %d); putting them back", changed, worker.uid)
        try:
            _restore(worker.zygote, worker.inherited, changed)
        except (OSError, ValueError):
            return False
        return _inherited(worker.zygote) == worker.inherited

    def _alive(self, worker: _Worker) -> bool:
        """The zygote runs and is not stopped (a job of its uid may have sent it SIGSTOP)."""
        try:
            status = Path(f"/proc/{worker.zygote}/status").read_text()
        except OSError:
            return False
        state = next(line for line in status.splitlines() if line.startswith("State:"))
        return worker.proc.poll() is None and state.split()[1] not in ("T", "t", "Z", "X")

    def _replace(self, worker: _Worker) -> None:
        """Stop a worker and start another for its slot in the background."""
        self._stop(worker)
        if self._closed:
            return
        self._count("replaced")

        def done(future: Future) -> None:
            if future.exception() is None:
                self._add(future.result())

        self._spawn().add_done_callback(done)

    def _add(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                self._stop(worker)
                return
            self._all.add(worker)
            self._free.append(worker)
            self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[name] += n

    def stats(self) -> dict[str, int]:
        """Warm runs, resets, failed reset checks, replaced workers, cold fallbacks; slots free now."""
        with self._cond, self._count_lock:
            return {**self.counts, "free": len(self._free), "workers": len(self._all)}

    def close(self) -> None:
        """Stop every worker and remove the pool's directories (again: nothing to do). Never raises: what cannot
        be stopped or removed is logged."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            workers, self._free, self._reserved = list(self._all), [], {}
            self._cond.notify_all()
        for worker in workers:
            self._stop(worker)
        self._spawns.put(None)
        self._resets.put(None)
        _attempt(lambda: remove_tree(self.dir), "removing the pool's directory")

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers ----------------------------------------------------------------------------------

    def _spawn(self) -> Future:
        future: Future = Future()
        self._spawns.put(future)
        return future

    def _spawner(self) -> None:
        while (future := self._spawns.get()) is not None:
            try:
                future.set_result(self._start())
            except BaseException as exc:
                future.set_exception(exc)

    def _start(self) -> _Worker:
        """A new slot: uid, directories, cgroup, and the zygote in its sandbox (ready when this returns)."""
        cfg = self.config
        uid, lock = self.sandbox._reserve_uid()
        path = Path(tempfile.mkdtemp(prefix="ws-", dir=self.dir))
        scratch = Path(tempfile.mkdtemp(prefix="host-", dir=self.dir))
        os.chown(path, uid, uid)
        # named apart from per-run cgroups (`<tag>-...`): they hold only the idle zygote
        cgroup = RunCgroup.create(f"pool-{self.tag}-{uid}-{uuid.uuid4().hex[:8]}", cfg.memory_mb, 8, cfg.cpu_cores)
        host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ws = Workspace(path=path, uid=uid, scratch=scratch)
        limits = self.sandbox._limits()
        # the zygote's own CPU time grows with every fork; each job gets RLIMIT_CPU afresh
        limits["RLIMIT_CPU"] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        limits["RLIMIT_NPROC"] = (cfg.max_processes + 1, cfg.max_processes + 1)

        def enter() -> None:  # in the child, before exec: join the slot's cgroups, set the rlimits
            cgroup.join()
            for name, value in limits.items():
                resource.setrlimit(getattr(resource, name), value)

        filter_fd = seccomp_fd(_IPC_SYSCALLS)
        argv = [interpreter(), *_PY_FLAGS, str(_ZYGOTE), str(worker_end.fileno()), _PRELOAD]
        expose = (str(_ZYGOTE), *_SCRIPTS)
        mounts = frozenset(p for e in self.sandbox._exposed(expose) for p in (Path(e), *Path(e).parents[:-1]))
        try:
            cmd = self.sandbox._command(argv[0], argv, ws, expose, filter_fd)
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=self.sandbox._environment(ws, {}), preexec_fn=enter, pass_fds=(filter_fd, worker_end.fileno()),
                start_new_session=True,
            )
        finally:
            os.close(filter_fd)
            worker_end.close()
        worker = _Worker(uid, lock, path, scratch, cgroup, proc, host_end, mounts=mounts)
        host_end.settimeout(_START_S)
        try:
            ready = host_end.recv(4096)
            zygotes = [p for p in cgroup.pids() if p in processes_of(uid)]
            if not ready or json.loads(ready) != {"ready": True} or len(zygotes) != 1:
                raise SandboxUnavailable(f"a pool worker did not start (exit {proc.poll()})")
        except BaseException:
            self._stop(worker)
            raise
        worker.zygote, worker.idle = zygotes[0], set(cgroup.pids())
        try:
            worker.inherited = _inherited(worker.zygote)
            worker.placed = self._place(worker)
        except BaseException:
            self._stop(worker)
            raise
        return worker

    def _stop(self, worker: _Worker) -> None:
        """Kill the worker's whole tree, remove its cgroups and directories (at any depth), free its uid. Never
        raises: each step runs whatever the others did (a step that fails is logged)."""
        worker.broken = True
        with self._cond:
            self._all.discard(worker)
        steps: list[tuple[str, Callable[[], object]]] = [
            ("killing the worker", worker.cgroup.kill),
            ("waiting for the worker", lambda: worker.proc.wait(timeout=_REPLY_GRACE_S)),
            ("closing its control socket", worker.ctrl.close),
            ("removing its cgroup", worker.cgroup.destroy),
            *([("removing its next job's cgroup", worker.placed.destroy)] if worker.placed is not None else []),
            ("killing what is left of its uid", lambda: kill_stray(worker.uid)),
            ("removing its workspace", lambda: remove_tree(worker.path)),
            ("removing its scratch dir", lambda: remove_tree(worker.scratch)),
            ("freeing its uid", lambda: worker.lock.unlink(missing_ok=True)),
        ]
        for what, step in steps:
            _attempt(step, what)

    # -- a warm run -------------------------------------------------------------------------------

    def _run_warm(
        self, worker: _Worker, argv: Sequence[str], ws: Workspace, stdin: bytes, timeout_s: float | None,
        env: Mapping[str, str] | None, tail_chars: int | None, expose: Sequence[str], pass_fds: Sequence[int],
    ) -> SandboxResult:
        """One job in the worker: its own cgroup, rlimits and timer; the same checks and result as a cold run."""
        cfg, sandbox = self.config, self.sandbox
        missing = {os.path.realpath(p) for p in expose} - {os.path.realpath(p) for p in (*_SCRIPTS, *cfg.expose_paths)}
        if missing:
            raise ValueError(f"pool workers expose only the grader's scripts and expose_paths, not {sorted(missing)}")
        child_env = sandbox._environment(ws, env)
        exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0], path=child_env["PATH"])
        if exe is None:
            return SandboxResult(127, "", f"command not found: {argv[0]}", 0.0, 0.0, False)
        in_process = exe == interpreter() and list(argv[1:5]) == _PY_FLAGS and len(argv) > 5 and argv[5] in _SCRIPTS
        stdin_path, out_path, err_path = (ws.scratch / n for n in ("stdin", "stdout", "stderr"))
        with os.fdopen(os.open(stdin_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(stdin)
        limits = sandbox._limits()
        limits["RLIMIT_NPROC"] = (cfg.max_processes + 1, cfg.max_processes + 1)  # the zygote is one of the uid's
        job = {
            "argv": [exe, *argv[1:]], "env": child_env, "cwd": str(ws.path), "in_process": in_process,
            "limits": [[name, *value] for name, value in limits.items()], "fds": [0, 1, 2, *pass_fds],
        }
        # the job's process waits in its own cgroup already (placed while the slot was idle), else is placed now
        cgroup, worker.placed = worker.placed, None
        timeout = cfg.wall_timeout_s if timeout_s is None else timeout_s
        fired = threading.Event()
        timer = threading.Timer(timeout, lambda: (fired.set(), cgroup.kill()))
        exit_code, cpu_s, start, lost = -signal.SIGKILL, 0.0, time.perf_counter(), False
        try:
            if cgroup is None:
                cgroup = self._place(worker)
            # named as a cold run's cgroup while the job runs
            cgroup.rename(f"{self.tag}-{ws.uid}-{uuid.uuid4().hex[:8]}")
            start = time.perf_counter()
            with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
                worker.ctrl.settimeout(_START_S)
                socket.send_fds(worker.ctrl, [json.dumps(job).encode()], [fin.fileno(), fout.fileno(), ferr.fileno(), *pass_fds])
            timer.start()
            worker.ctrl.settimeout(timeout + _REPLY_GRACE_S)
            reply = json.loads(worker.ctrl.recv(4096))
            exit_code, cpu_s = int(reply["exit"]), float(reply["cpu"])
            # a process the zygote could not set the job up in never ran the job: the worker's fault, not the job's
            lost = reply["started"] is not True
            self._count("warm_runs")
        except (OSError, ValueError, KeyError, TypeError):
            # the zygote died, stopped or answered nonsense (a job of its uid can signal it): the job is lost
            lost = True
            if cgroup is not None:
                cgroup.kill()
        finally:
            timer.cancel()
        worker.broken = worker.broken or lost
        wall = time.perf_counter() - start
        # first: no other name says why a lost job ended (its -9 is no CPU limit)
        violations = ["worker_lost"] if lost else []
        violations += ["timeout"] if fired.is_set() else []
        violations += cgroup.limits_hit() if cgroup is not None else []
        # the job's cgroup, then the slot's: every process of the slot's uid is in one of them (only root moves
        # a process between cgroups), so no scan of /proc is needed here; without a job cgroup, scan the uid
        stray = cgroup.destroy() or _kill_strays(worker) if cgroup is not None else kill_stray(ws.uid, worker.zygote)
        if stray:
            violations.append("stray_process")
        n = cfg.output_tail_chars if tail_chars is None else tail_chars
        stdout, stderr = _tail(out_path, n), _tail(err_path, n)
        violations += _classify(exit_code, stdout + stderr, fired.is_set())
        return SandboxResult(exit_code, stdout, stderr, wall, cpu_s, fired.is_set(), tuple(dict.fromkeys(violations)))


def _host_pid(slot: RunCgroup, ns_pid: int) -> int:
    """The host pid of the worker's child `ns_pid` (still in the slot's cgroup: it waits for the host)."""
    for pid in slot.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspids) > 1 and int(nspids[-1]) == ns_pid:
            return pid
    raise ValueError(f"job {ns_pid} is not in its worker's cgroup")


def _kill_strays(worker: _Worker, grace_s: float = 2.0) -> bool:
    """Kill the processes in the slot's cgroup that were not there while it was idle (a job's process that
    had the zygote fork it, say); True when one survived `grace_s` of SIGKILLs."""
    return kill_until_gone(lambda: [p for p in worker.cgroup.pids() if p not in worker.idle], grace_s)


def _attempt(step: Callable[[], object], what: str) -> None:
    """Run one step of stopping or removing; a failure is logged, never raised (the steps after it still run)."""
    try:
        step()
    except Exception as exc:
        _log.warning("sandbox pool: %s failed: %s: %s", what, type(exc).__name__, exc)


def _syscall(name: str, *args: object) -> int:
    """A raw syscall by its name in `_SYSCALLS`; OSError when it fails."""
    result = _libc.syscall(_SYSCALLS[platform.machine()][name], *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")
    return result


def _inherited(pid: int) -> _Inherited:
    """What process `pid` (host view) would hand a child it forks now, of what a process of its uid may change."""
    attr = _SchedAttr()
    _syscall("sched_getattr", pid, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    # /proc: prlimit would need CAP_SYS_RESOURCE to read another uid's limits; the file is world-readable and
    # lists every resource, RLIMIT_LOCKS too
    with open(f"/proc/{pid}/limits", "rb") as f:
        limits = f.read()
    return _Inherited(
        limits=limits,
        sched=tuple(getattr(attr, name) for name, _ in _SchedAttr._fields_[1:]),
        affinity=frozenset(os.sched_getaffinity(pid)),
        ioprio=_syscall("ioprio_get", _IOPRIO_WHO_PROCESS, pid),
    )


def _parse_limits(table: bytes) -> list[tuple[int, int]]:
    """(soft, hard) of every resource, by number, from a /proc/PID/limits table (RLIM_INFINITY for unlimited)."""
    # "Max open files            256                  256                  files": a 25-character name column
    pairs = [row[26:].split()[:2] for row in table.decode().splitlines()[1:]]
    return [(_limit(soft), _limit(hard)) for soft, hard in pairs]


def _limit(value: str) -> int:
    return resource.RLIM_INFINITY if value == "unlimited" else int(value)


def _restore(pid: int, want: _Inherited, changed: Sequence[str]) -> None:
    """Put back the `changed` fields of process `pid`'s inherited state. A lowered hard limit takes
    CAP_SYS_RESOURCE to raise again: without it prlimit fails (OSError) and the slot is replaced."""
    if "limits" in changed:
        for number, value in enumerate(_parse_limits(want.limits)):
            resource.prlimit(pid, number, value)
    if "sched" in changed:
        attr = _SchedAttr(ctypes.sizeof(_SchedAttr), *want.sched)
        _syscall("sched_setattr", pid, ctypes.byref(attr), 0)
    if "affinity" in changed:
        os.sched_setaffinity(pid, want.affinity)
    if "ioprio" in changed:
        _syscall("ioprio_set", _IOPRIO_WHO_PROCESS, pid, want.ioprio)
