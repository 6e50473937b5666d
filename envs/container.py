"""The container sandbox backend: run a task's programs in the task's own image.

SWE-style instances ship an image with the repository's dependencies; their
tests run there, not in this interpreter. `ContainerBackend` implements
`envs.backend.SandboxBackend`: the workspace is a private host directory
bind-mounted read-write at the same path inside the container, and each `run`
is one `podman run --rm` (or docker) with no network, a read-only root, every
capability dropped, no_new_privs, pids/memory/CPU limits, explicit rlimits, a
size-capped /tmp, an unprivileged uid, and a wall timer that kills the
container. Apptainer (Slurm sites) gets the closest command line it offers.
Where the runtime cannot run containers here, the backend refuses
(`SandboxUnavailable`, with the runtime's own message) and runs nothing.
docs/envs.md ("Sandbox backends") has the measured start-up and build times.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

from composer_mesh.configs.sections.env import SweConfig
from composer_mesh.envs.sandbox import SandboxResult, SandboxUnavailable, Workspace, _classify, _tail, copy_tree

_OCI = ("podman", "docker")
# rlimits set explicitly: the runtimes' defaults exceed the hard limits of an unprivileged-resource host
_NOFILE, _FSIZE_MB = 1024, 256
_EXIT_KILLED = 137
_probe_cache: dict[tuple[str, str, str, str], tuple[str, str]] = {}


def probe(config: SweConfig, image: str) -> tuple[str, str]:
    """(reason, oci_runtime): reason '' when `image` runs under the configured runtime here.

    podman's default OCI runtime is tried first, then runc (crun refuses cgroup
    limits on a cgroups v1/v2 hybrid host); every failure message is kept.
    """
    key = (config.runtime, config.oci_runtime, image, config.python)
    if key not in _probe_cache:
        _probe_cache[key] = _probe(config, image)
    return _probe_cache[key]


def _probe(config: SweConfig, image: str) -> tuple[str, str]:
    runtime = config.runtime
    if runtime not in (*_OCI, "apptainer"):
        return f"env.swe.runtime = {runtime!r} is not a container runtime", ""
    if not image:
        return "no image: set env.swe.image or give the row an image field", ""
    if shutil.which(runtime) is None:
        package = {"podman": "podman", "docker": "docker.io", "apptainer": "apptainer"}[runtime]
        return f"{runtime!r} not found; `apt-get install -y {package}`", ""
    if runtime == "apptainer":
        if not os.path.isfile(image):
            return f"apptainer image {image!r} is not a file (.sif)", ""
        candidates = [""]
    else:
        found = subprocess.run([runtime, "image", "inspect", image], capture_output=True, text=True, timeout=60)
        if found.returncode != 0:
            return f"image {image!r} not in local {runtime} storage (build it: envs.container.build_image)", ""
        candidates = [config.oci_runtime] if config.oci_runtime else [""]
        if not config.oci_runtime and runtime == "podman" and shutil.which("runc"):
            candidates.append("runc")
    failures = []
    for oci in candidates:
        backend = ContainerBackend(config, image, _checked=oci)
        with backend.workspace() as ws:
            result = backend.run([config.python, "-c", "pass"], ws, timeout_s=60.0)
        if result.exit_code == 0:
            return "", oci
        failures.append(f"{runtime} {'--runtime ' + oci if oci else '(default runtime)'}: "
                        f"exit {result.exit_code}: {result.stderr.strip()[-400:]}")
    return "cannot run a contained container here: " + " | ".join(failures), ""


class ContainerBackend:
    """Workspaces on the host, commands in containers of one image (see the module docstring)."""

    def __init__(self, config: SweConfig, image: str = "", *, _checked: str | None = None) -> None:
        self.config = config
        self.image = image or config.image
        if _checked is None:
            reason, self.oci_runtime = probe(config, self.image)
            if reason:
                raise SandboxUnavailable(f"refusing to run untrusted code: {reason}")
        else:
            self.oci_runtime = _checked
        self.root = Path(tempfile.gettempdir()) / "composer-mesh-containers"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A fresh private directory owned by the container uid, optionally a copy of a tree."""
        path = Path(tempfile.mkdtemp(prefix="ws-", dir=self.root))
        scratch = Path(tempfile.mkdtemp(prefix="host-", dir=self.root))
        if copy_from is not None:
            copy_tree(Path(copy_from), path, skip=skip)
        ws = Workspace(path=path, uid=self.config.uid, scratch=scratch)
        ws.adopt()
        return ws

    def python(self) -> str:
        """The image's interpreter (`env.swe.python`)."""
        return self.config.python

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
        """Run `argv` in a fresh container with `ws` as working directory; never raises for what it does."""
        name = f"cm-{uuid.uuid4().hex[:12]}"
        child_env = {"HOME": str(ws.path), "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        child_env.update(env or {})
        cmd = self.command(name, argv, ws, child_env)
        stdin_path, out_path, err_path = (ws.scratch / n for n in ("stdin", "stdout", "stderr"))
        stdin_path.write_bytes(stdin)
        timeout = self.config.test_timeout_s if timeout_s is None else timeout_s
        fired = threading.Event()
        start = time.perf_counter()
        with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            # cwd: podman's conmon (before containers/conmon#514) creates an empty `oom` file in its working
            # directory when the container is OOM-killed; in the workspace's host scratch, not the caller's
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True, cwd=ws.scratch)

        def kill() -> None:
            fired.set()
            self._kill(name, proc)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        if fired.is_set():
            self._kill(name, proc)
        n = 4000 if tail_chars is None else tail_chars
        stdout, stderr = _tail(out_path, n), _tail(err_path, n)
        violations = ["timeout"] if fired.is_set() else []
        if proc.returncode == _EXIT_KILLED and not fired.is_set():
            violations.append("memory_limit")
        violations += _classify(proc.returncode, stdout + stderr, fired.is_set())
        return SandboxResult(
            exit_code=proc.returncode, stdout=stdout, stderr=stderr, wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime, timed_out=fired.is_set(),
            violations=tuple(dict.fromkeys(violations)),
        )

    def command(self, name: str, argv: Sequence[str], ws: Workspace, env: Mapping[str, str]) -> list[str]:
        """The runtime's command line for one contained run of `argv` (what `run` executes)."""
        c, mib = self.config, 1 << 20
        if c.runtime == "apptainer":
            # no cgroup limits without a delegated cgroups v2 tree; the wall timer and rlimits still hold
            cmd = ["apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--no-privs", "--net",
                   "--network", "none", "--bind", f"{ws.path}:{ws.path}", "--pwd", str(ws.path)]
            for key, value in env.items():
                cmd += ["--env", f"{key}={value}"]
            return ["prlimit", f"--nproc={c.max_processes}", f"--nofile={_NOFILE}", *cmd, self.image, *argv]
        cmd = [c.runtime]
        if self.oci_runtime:
            cmd += ["--runtime", self.oci_runtime]
        cmd += [
            "run", "--rm", "-i", "--name", name, "--pull", "never", "--network", "none", "--read-only",
            "--cap-drop", "all", "--security-opt", "no-new-privileges", "--user", f"{c.uid}:{c.uid}",
            "--pids-limit", str(c.max_processes), "--memory", f"{c.memory_mb}m", "--memory-swap", f"{c.memory_mb}m",
            "--cpus", f"{c.cpu_cores:g}", "--ulimit", f"nofile={_NOFILE}:{_NOFILE}",
            "--ulimit", f"nproc={c.max_processes}:{c.max_processes}",
            "--ulimit", f"fsize={_FSIZE_MB * mib}:{_FSIZE_MB * mib}", "--ulimit", "core=0:0",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={c.tmpfs_mb}m,mode=1777",
            "--volume", f"{ws.path}:{ws.path}:rw", "--workdir", str(ws.path), "--hostname", "sandbox",
        ]
        if c.runtime == "podman":
            cmd += ["--read-only-tmpfs=false", "--log-driver", "none"]
        for key, value in env.items():
            cmd += ["--env", f"{key}={value}"]
        return [*cmd, self.image, *argv]

    def _kill(self, name: str, proc: subprocess.Popen) -> None:
        """Remove the container (its processes die with it), then the client."""
        if self.config.runtime in _OCI:
            subprocess.run([self.config.runtime, "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def build_image(tag: str, runtime: str = "podman", packages: Sequence[str] = ("python3", "python3-pytest"),
                suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian") -> float:
    """Build `tag` from Debian packages (debootstrap minbase, then `import`) unless it exists; seconds spent.

    No registry is contacted: the root tree comes from the Debian mirror. Needs
    root and `debootstrap`.
    """
    if subprocess.run([runtime, "image", "inspect", tag], capture_output=True).returncode == 0:
        return 0.0
    if shutil.which("debootstrap") is None:
        raise SandboxUnavailable("building an image needs debootstrap: `apt-get install -y debootstrap`")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cm-image-") as tmp:
        tree = Path(tmp) / "root"
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(tree), mirror],
            check=True, capture_output=True,
        )
        archive = Path(tmp) / "root.tar"
        subprocess.run(["tar", "-C", str(tree), "-cf", str(archive), "."], check=True, capture_output=True)
        subprocess.run([runtime, "import", str(archive), tag], check=True, capture_output=True)
    return time.perf_counter() - began
