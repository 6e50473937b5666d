"""The sandbox against real attempts to escape it, checked from the host side."""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import SandboxConfig
from composer_mesh.envs.sandbox import Sandbox, SandboxUnavailable, copy_tree, processes_of, processes_with, redact


def _py(sandbox, ws, code: str, **kw):
    return sandbox.run([sandbox.python(), "-c", code], ws, **kw)


@pytest.fixture
def ws(sandbox):
    with sandbox.workspace() as w:
        yield w


def test_runs_as_private_uid_in_own_pid_namespace(sandbox, ws):
    r = _py(sandbox, ws, "import os, sys; print(os.getuid(), os.getpid(), sys.version); open('out.txt', 'w').write('x')")
    assert r.ok, r.stderr
    uid, pid, version = r.stdout.split(" ", 2)
    assert int(uid) == ws.uid and int(uid) != 0
    assert int(pid) <= 3  # PID 1 is the sandbox init; the program is its child
    assert version.strip() == sys.version  # same interpreter and stdlib as the host
    assert (ws.path / "out.txt").read_text() == "x"
    assert (ws.path / "out.txt").stat().st_uid == ws.uid


def test_no_network_even_to_a_live_host_server(sandbox, ws):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # the server is real and reachable from the host
        pass
    r = _py(sandbox, ws, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)")
    assert r.exit_code != 0
    assert "Network is unreachable" in r.stderr or "Connection refused" in r.stderr
    server.close()


def test_cannot_write_outside_the_workspace(sandbox, ws):
    marker = uuid.uuid4().hex
    targets = [f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}", str(Path(__file__).parent / marker)]
    code = "import sys\nfor t in sys.argv[1:]:\n    try:\n        open(t, 'w').write('x')\n        print('WROTE', t)\n    except OSError as e:\n        print('DENIED', t, e.errno)\n"
    r = sandbox.run([sandbox.python(), "-c", code, *targets], ws)
    # /tmp and /dev/shm are the sandbox's own capped tmpfs (gone with it); the rest does not exist or is read-only.
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["WROTE", "DENIED", "WROTE", "DENIED"], r
    for t in targets:
        assert not os.path.exists(t)


def test_home_directories_are_hidden(sandbox, ws):
    r = _py(sandbox, ws, "import os; print(*sorted(os.listdir('/root')))")
    assert r.ok, r.stderr
    # Only the top directories of re-exposed paths (the interpreter may live under /root) remain.
    exposed = {Path(os.path.realpath(p)) for p in (sys.base_prefix, sys.prefix)}
    allowed = {p.relative_to("/root").parts[0] for p in exposed if Path("/root") in p.parents}
    assert set(r.stdout.split()) <= allowed
    host_entries = set(os.listdir("/root"))
    assert host_entries - allowed == host_entries - set(r.stdout.split())  # nothing else shows


def test_environment_is_scrubbed_and_secrets_redacted(sandbox, ws, monkeypatch):
    secret = "sk-test-" + uuid.uuid4().hex
    monkeypatch.setenv("COMPOSER_TEST_API_KEY", secret)
    r = _py(sandbox, ws, "import os; print(sorted(os.environ))")
    assert r.ok and "COMPOSER_TEST_API_KEY" not in r.stdout
    assert secret not in r.stdout
    # A program that learnt the value some other way still cannot print it into our logs.
    r = sandbox.run([sandbox.python(), "-c", "import sys; print(sys.stdin.read())"], ws, stdin=secret.encode())
    assert secret not in r.stdout and "<redacted:COMPOSER_TEST_API_KEY>" in r.stdout
    assert redact(f"x {secret} y", {"COMPOSER_TEST_API_KEY": secret}) == "x <redacted:COMPOSER_TEST_API_KEY> y"


def test_wall_clock_timeout_kills_the_tree(sandbox, ws):
    marker = uuid.uuid4().hex
    code = f"import subprocess, time; subprocess.Popen(['sleep', '300', '{marker}']); time.sleep(300)"
    r = _py(sandbox, ws, code, timeout_s=2)
    assert r.timed_out and "timeout" in r.violations and r.exit_code < 0
    assert processes_with(marker) == [] and processes_of(ws.uid) == []


def test_cpu_time_limit(ws):
    r = _py(Sandbox(SandboxConfig(cpu_time_s=1)), ws, "while True: pass", timeout_s=30)
    assert "cpu_time_limit" in r.violations and not r.timed_out
    assert r.wall_s < 20


def test_memory_limit(sandbox, ws):
    r = _py(sandbox, ws, "x = bytearray(10 * 1024**3)")
    assert r.exit_code == 1 and "memory_limit" in r.violations


def test_file_size_limit(sandbox, ws):
    cfg = SandboxConfig(file_size_mb=1)
    small = Sandbox(cfg)
    r = small.run(["/bin/sh", "-c", "yes > big.txt"], ws)
    assert "file_size_limit" in r.violations
    assert (ws.path / "big.txt").stat().st_size <= 1 << 20


def test_fork_bomb_is_contained(sandbox, ws):
    marker = uuid.uuid4().hex
    r = _py(sandbox, ws, f"import os  # {marker}\nwhile True:\n    os.fork()", timeout_s=10)
    assert r.exit_code != 0 and "process_limit" in r.violations
    assert processes_with(marker) == [] and processes_of(ws.uid) == []


def test_daemon_dies_with_the_run(sandbox, ws):
    marker = uuid.uuid4().hex
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['/bin/sleep', '300', '{marker}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent exits')\n"
    )
    r = _py(sandbox, ws, code)
    assert r.ok and "parent exits" in r.stdout
    assert processes_with(marker) == []
    assert processes_of(ws.uid) == []


def test_copy_tree_drops_symlinks_and_special_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A")
    (src / "link.py").symlink_to("/etc/passwd")
    (src / "dirlink").symlink_to("/etc")
    os.mkfifo(src / "fifo")
    copy_tree(src, dst, skip=lambda rel: rel.endswith(".skip"))
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["pkg", "pkg/a.py"]


def test_refuses_when_namespaces_are_unavailable():
    with pytest.raises(SandboxUnavailable, match="refusing to run untrusted code"):
        Sandbox(SandboxConfig(bwrap_binary="/nonexistent/bwrap"))


def test_workspaces_get_distinct_uids_released_on_cleanup():
    sb = Sandbox(SandboxConfig(uid_base=3_000_000 + 3 * (os.getpid() % 100_000), uid_count=3))  # a range of our own
    spaces = [sb.workspace() for _ in range(3)]
    assert len({w.uid for w in spaces}) == 3
    with pytest.raises(SandboxUnavailable, match="no free sandbox uid"):
        sb.workspace()
    spaces[0].cleanup()
    again = sb.workspace()
    assert again.uid == spaces[0].uid
    for w in spaces[1:] + [again]:
        w.cleanup()
    assert not any((sb.uid_locks / f"uid-{w.uid}").exists() for w in spaces)


def _own_uid_sandbox(tmp_path, offset: int) -> Sandbox:
    """A sandbox of one uid of its own and a root of its own (so a test may list it and reserve its only uid)."""
    base = 3_500_000 + 4 * (os.getpid() % 100_000) + offset
    return Sandbox(SandboxConfig(root_dir=str(tmp_path), uid_base=base, uid_count=1))


def _nest(root: Path, depth: int) -> None:
    """`depth` nested directories under `root`, made one relative step at a time (past PATH_MAX if need be)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def test_cleanup_removes_a_tree_past_the_recursion_limit_and_frees_the_uid_once(tmp_path):
    """The agent's tree is deeper than the recursion limit: cleanup removes it and frees the uid; a second
    cleanup (an episode's close after its grade) leaves alone the lock of a later workspace with the same uid."""
    sb = _own_uid_sandbox(tmp_path, 0)
    ws = sb.workspace()
    _nest(ws.path, sys.getrecursionlimit() + 200)
    ws.cleanup()
    assert not ws.path.exists() and not ws.scratch.exists()
    again = sb.workspace()
    assert again.uid == ws.uid
    ws.cleanup()
    assert (sb.uid_locks / f"uid-{again.uid}").exists()
    again.cleanup()
    assert not (sb.uid_locks / f"uid-{again.uid}").exists() and list(sb.root.iterdir()) == []


def test_a_copy_past_the_tree_bounds_is_refused_and_leaves_nothing(tmp_path):
    from composer_mesh.envs.tree import MAX_DEPTH, TreeTooDeep

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x")
    _nest(src, MAX_DEPTH + 1)
    dst = tmp_path / "dst"
    with pytest.raises(TreeTooDeep):
        copy_tree(src, dst)
    sb = _own_uid_sandbox(tmp_path / "root", 1)
    with pytest.raises(TreeTooDeep):
        sb.workspace(copy_from=src)
    assert list(sb.root.iterdir()) == []
    sb.workspace().cleanup()  # its only uid is free again


_READ_PROBE = (
    "import sys\nfor t in sys.argv[1:]:\n    try:\n        open(t, 'rb').read(1)\n        print('READ', t)\n"
    "    except OSError as e:\n        print('DENIED', t, e.errno)\n"
)


def test_minimal_root_hides_host_files(sandbox, ws):
    """Only /usr, the interpreter and the workspace exist: host config, the checkout, /root, other workspaces do not."""
    repo = Path(__file__).resolve().parents[2]
    with sandbox.workspace() as other:
        (other.path / "secret.txt").write_text("x")
        targets = ["/etc/hostname", "/etc/passwd", str(repo / "README.md"), str(repo / "envs" / "sandbox.py"),
                   "/root/.bashrc", "/root/.profile", str(other.path / "secret.txt"), "/proc/1/environ"]
        targets = [t for t in targets if os.path.exists(t)]  # each one readable from the host
        r = sandbox.run([sandbox.python(), "-c", _READ_PROBE, *targets], ws)
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["DENIED"] * len(targets) and len(targets) >= 6, r.stdout


def test_forking_tree_is_capped_by_the_cgroup_memory_limit(ws):
    """8 processes x 96 MiB (under every per-process rlimit) exceed a 256 MiB cgroup: the tree is OOM-killed."""
    sb = Sandbox(SandboxConfig(memory_mb=256, address_space_mb=1024, max_processes=16, wall_timeout_s=10))
    code = (
        "import os, time\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
        "        b = bytearray(96 << 20)\n        for i in range(0, len(b), 4096): b[i] = 1\n        time.sleep(2)\n"
        "        os._exit(0)\n    kids.append(pid)\nok = sum(os.waitpid(p, 0)[1] == 0 for p in kids)\nprint('CLEAN', ok)\n"
    )
    r = sb.run([sb.python(), "-c", code], ws)
    assert "memory_limit" in r.violations, r
    assert "CLEAN 8" not in r.stdout, r  # not every child got its 96 MiB
    assert processes_of(ws.uid) == []


def test_tmpfs_writes_beyond_the_cap_fail(ws):
    sb = Sandbox(SandboxConfig(tmpfs_mb=4, file_size_mb=64))
    code = (
        "import sys\nfor d in ('/tmp', '/dev/shm'):\n    try:\n        with open(d + '/fill', 'wb') as f:\n"
        "            for _ in range(8): f.write(b'x' * (1 << 20))\n        print('WROTE', d)\n"
        "    except OSError as e:\n        print('FULL', d, e.errno)\n"
    )
    r = sb.run([sb.python(), "-c", code], ws)
    assert r.stdout.split("\n")[:2] == ["FULL /tmp 28", "FULL /dev/shm 28"], r  # ENOSPC


_LIBC = "import ctypes; l = ctypes.CDLL(None, use_errno=True); "


@pytest.mark.parametrize(
    "what, code",
    [
        ("unshare_user", _LIBC + "print('ERRNO', l.unshare(0x10000000) and ctypes.get_errno())"),
        ("unshare_net", _LIBC + "print('ERRNO', l.unshare(0x40000000) and ctypes.get_errno())"),
        ("clone_newpid", _LIBC + "print('ERRNO', l.syscall(56, 0x20000000 | 17, 0, 0, 0, 0) < 0 and ctypes.get_errno())"),
        ("unshare_binary", "import subprocess, sys; r = subprocess.run(['/usr/bin/unshare', '-U', '-r', 'true'], capture_output=True, text=True); print('ERRNO', 1 if 'Operation not permitted' in r.stderr else r.returncode)"),
        ("mount", _LIBC + "print('ERRNO', l.mount(b'none', b'/tmp', b'tmpfs', 0, None) and ctypes.get_errno())"),
        ("ptrace", _LIBC + "print('ERRNO', l.ptrace(16, 1, 0, 0) and ctypes.get_errno())"),
        ("bpf", _LIBC + "print('ERRNO', l.syscall(321, 0, 0, 0) < 0 and ctypes.get_errno())"),
        ("keyctl", _LIBC + "print('ERRNO', l.syscall(250, 0, 0, 0, 0, 0) < 0 and ctypes.get_errno())"),
    ],
)
def test_seccomp_denies_namespaces_and_kernel_interfaces(sandbox, ws, what, code):
    r = _py(sandbox, ws, code)
    assert r.stdout.split() == ["ERRNO", "1"], (what, r)  # EPERM from the filter, not a crash or success


def test_runs_under_seccomp_without_privileges(sandbox, ws):
    status = _py(sandbox, ws, "print(open('/proc/self/status').read())").stdout
    assert "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status and "CapEff:\t0000000000000000" in status
