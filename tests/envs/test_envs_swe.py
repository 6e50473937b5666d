"""SWE-style instances (envs/swe.py) and the container backend (envs/container.py).

A tiny instance is made here: a git repository whose `add` subtracts, a gold
patch that fixes it, and a test_patch adding the failing test. It is graded
through the local bubblewrap backend and through real podman with an image
built from Debian packages (built once per session; cached in podman's store).
A second instance (`swe_shapes.py`: a class method, parametrized, class and
unittest tests) is graded against patches that forge pytest's verdict.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from composer_mesh.configs.loader import from_dict
from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, SandboxConfig, SweConfig
from composer_mesh.configs.schema import JobConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.base import assistant
from composer_mesh.envs.container import ContainerBackend, build_image
from composer_mesh.envs.factory import check_task, env_factory
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox, SandboxUnavailable
from composer_mesh.envs.swe import SweTask, load_instances
from swe_shapes import FIXED_CORE, FORGERIES, make_instance

IMAGE = "localhost/composer-mesh-swe:bookworm"
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
BASE_TEST = "from mathx import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
HIDDEN_TEST = "from mathx import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
F2P = ["tests/test_add.py::test_add"]
P2P = ["tests/test_base.py::test_zero"]


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def instance(tmp_path_factory) -> dict:
    """repos_dir with `acme__mathx` at a base commit, and the row: gold patch, test_patch, test ids."""
    repos = tmp_path_factory.mktemp("repos")
    repo = repos / "acme__mathx"
    (repo / "tests").mkdir(parents=True)
    (repo / "mathx.py").write_text(BUGGY)
    (repo / "tests" / "test_base.py").write_text(BASE_TEST)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "mathx.py").write_text(FIXED)
    patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", "mathx.py")
    (repo / "tests" / "test_add.py").write_text(HIDDEN_TEST)
    _git(repo, "add", "-N", "tests/test_add.py")
    test_patch = _git(repo, "diff")
    _git(repo, "rm", "-q", "--cached", "tests/test_add.py")
    (repo / "tests" / "test_add.py").unlink()
    # a later commit (the fix's future) that must never reach the agent
    (repo / "FUTURE.txt").write_text("from the future\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "later")
    row = {
        "instance_id": "acme__mathx-1", "repo": "acme/mathx", "base_commit": base, "patch": patch,
        "test_patch": test_patch, "problem_statement": "add(2, 3) returns -1; it should return 5.",
        "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": P2P, "version": "0.1",
        "environment_setup_commit": base, "docker_image": IMAGE,
    }
    return {"repos": repos, "row": row}


def _load(tmp_path: Path, instance: dict, rows: list, **config) -> list[SweTask]:
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    cfg = SweConfig(instances=str(path), repos_dir=str(instance["repos"]), **config)
    return load_instances(cfg, tmp_path / "store")


@pytest.fixture(scope="module")
def local_backend(tmp_path_factory) -> Sandbox:
    return Sandbox(SandboxConfig(root_dir=str(tmp_path_factory.mktemp("swe-sandbox")), wall_timeout_s=30.0))


@pytest.fixture(scope="session")
def image() -> str:
    """The Debian-package image (debootstrap minbase + python3-pytest), built once and kept in podman's store."""
    build_image(IMAGE)
    return IMAGE


def _check_instance(task: SweTask, backend: SandboxBackend) -> None:
    """Gold patch 1, no patch 0, the hidden test never in the agent's tree, an edited test a violation."""
    gold = task.grade_patch(backend, task.patch)
    assert (gold.reward, gold.reason, gold.passed, gold.total) == (1.0, "passed", 2, 2), gold.output
    empty = task.grade_patch(backend, "")
    assert (empty.reward, empty.passed, empty.total) == (0.0, 1, 2)
    assert empty.reason == "tests_failed (1/2 passed)"
    with task.workspace(backend) as ws:
        assert not (ws.path / "tests" / "test_add.py").exists()
        assert not (ws.path / "FUTURE.txt").exists() and not (ws.path / ".git").exists()
        start = manifest(ws.path)
        (ws.path / "mathx.py").write_text(FIXED)
        (ws.path / "tests" / "test_base.py").write_text("def test_zero():\n    pass\n")
        cheat = task.grade(backend, ws, start, ())
    assert cheat.reward == 0.0 and cheat.reason == "edited_tests", cheat
    with task.workspace(backend) as ws:
        start = manifest(ws.path)
        # a test file of the agent's own with the hidden test's name is replaced by the hidden one
        (ws.path / "tests" / "test_add.py").write_text("def test_add():\n    pass\n")
        forged = task.grade(backend, ws, start, ())
    assert forged.reward == 0.0 and forged.passed == 1, forged


def test_loader_reads_swe_gym_and_r2e_rows(tmp_path, instance):
    row = instance["row"]
    r2e = {
        "repo_name": "acme/mathx", "commit_hash": "HEAD", "docker_image": IMAGE,
        "problem_statement": "fix add", "expected_output_json": json.dumps({F2P[0]: "PASSED", P2P[0]: "PASSED"}),
    }
    swe, r2 = _load(tmp_path, instance, [row, "\n", r2e])
    assert (swe.name, swe.template, swe.backend, swe.image) == ("acme__mathx-1", "acme__mathx-1", "container", IMAGE)
    assert swe.tests == (*F2P, *P2P) and "add(2, 3)" in swe.prompt() and "```diff" in swe.prompt(tools=False)
    assert swe.reference_files() == {"mathx.py": FIXED}
    assert (r2.name, r2.base_commit, r2.tests) == ("acme__mathx-HEAD", "HEAD^", (F2P[0], P2P[0]))
    assert _load(tmp_path, instance, [row], runtime="local")[0].backend == "local"


@pytest.mark.parametrize(
    "rows, message",
    [
        (["{}\n", "{not json\n"], ":1: missing field 'repo' or 'repo_name'"),
        ([None, "{not json\n"], ":2: not a JSON object"),
        ([None, {"instance_id": "x", "problem_statement": ""}], ":2: missing field 'problem_statement'"),
        ([None, None], ":2: instance_id 'acme__mathx-1' repeats"),
        ([{"FAIL_TO_PASS": "tests/a.py::t"}], ":1: field 'FAIL_TO_PASS' is a string but not JSON"),
        ([{"FAIL_TO_PASS": [1]}], ":1: field 'FAIL_TO_PASS' must be a list of pytest node ids"),
        ([{"FAIL_TO_PASS": [], "PASS_TO_PASS": []}], ":1: no tests to run"),
        ([{"base_commit": "deadbeef"}], ":1: base_commit 'deadbeef' is not a commit"),
        ([{"repo": "acme/nothere"}], ":1: repository 'acme/nothere' not found under env.swe.repos_dir"),
        ([{"docker_image": ""}], ":1: no image (row fields image, image_name, docker_image) and env.swe.image"),
    ],
)
def test_loader_errors_name_the_line_and_field(tmp_path, instance, rows, message):
    rows = [instance["row"] if r is None else (r if isinstance(r, str) else instance["row"] | r) for r in rows]
    with pytest.raises(ValueError, match="instances.jsonl" + message.replace("(", r"\(").replace(")", r"\)")):
        _load(tmp_path, instance, rows)


def test_config_errors_name_the_key(tmp_path, instance):
    with pytest.raises(ValueError, match=r"env\.swe\.instances = '.*missing.jsonl': no such file"):
        load_instances(SweConfig(instances=str(tmp_path / "missing.jsonl"), repos_dir=str(tmp_path)), tmp_path)
    (tmp_path / "i.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"env\.swe\.repos_dir = ''"):
        load_instances(SweConfig(instances=str(tmp_path / "i.jsonl")), tmp_path)
    with pytest.raises(ValueError, match=r"env\.swe\.runtime"):
        from_dict(JobConfig, {"env": {"swe": {"runtime": "lxc"}}})


def test_graded_through_the_local_backend(tmp_path, instance, local_backend):
    (task,) = _load(tmp_path, instance, [instance["row"]], runtime="local")
    _check_instance(task, local_backend)


def test_graded_through_the_container_backend(tmp_path, instance, image):
    (task,) = _load(tmp_path, instance, [instance["row"]])
    backend = ContainerBackend(SweConfig(image=task.image, test_timeout_s=30.0))
    assert isinstance(backend, SandboxBackend)
    _check_instance(task, backend)


def test_container_containment(image, tmp_path, monkeypatch):
    # the caller's working directory: nothing of a run may land there (conmon's `oom` file did)
    monkeypatch.chdir(tmp_path)
    backend = ContainerBackend(SweConfig(image=image, memory_mb=128, max_processes=16, tmpfs_mb=8, cpu_cores=0.5))
    with backend.workspace() as ws:
        def py(code: str, timeout_s: float = 20.0):
            return backend.run(["python3", "-c", code], ws, timeout_s=timeout_s)

        who = py("import os; s = open('/proc/self/status').read(); print(os.getuid(), os.getgid(), "
                 "[l.split()[1] for l in s.splitlines() if l.startswith(('CapEff', 'CapBnd', 'NoNewPrivs'))])")
        assert who.stdout.split("\n")[0] == "150000 150000 ['0000000000000000', '0000000000000000', '1']", who
        net = py("import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)")
        assert "Network is unreachable" in net.stderr, net
        ifaces = py("import socket; print(sorted(n for _, n in socket.if_nameindex()))")
        assert ifaces.stdout.strip() == "['lo']", ifaces
        for target in ("/usr/evil", "/etc/evil", "/evil"):
            ro = py(f"open({target!r}, 'w')")
            assert "Read-only file system" in ro.stderr, (target, ro)
        wrote = py("open('made_inside.txt', 'w').write('x'); open('/tmp/t', 'w').write('y')")
        assert wrote.ok and (ws.path / "made_inside.txt").stat().st_uid == 150000
        # the container's own cgroup limits, as the kernel holds them (cgroups v1 files, else v2)
        limits = py(
            "import os\ndef r(*ps):\n    p = next(p for p in ps if os.path.exists(p))\n    return open(p).read().split()\n"
            "q = r('/sys/fs/cgroup/cpu/cpu.cfs_quota_us', '/sys/fs/cgroup/cpu.max')\n"
            "period = r('/sys/fs/cgroup/cpu/cpu.cfs_period_us')[0] if len(q) == 1 else q[1]\n"
            "print(int(q[0]) / int(period), r('/sys/fs/cgroup/memory/memory.limit_in_bytes', '/sys/fs/cgroup/memory.max')[0], "
            "r('/sys/fs/cgroup/pids/pids.max', '/sys/fs/cgroup/pids.max')[0])"
        )
        assert limits.stdout.split() == ["0.5", str(128 << 20), "16"], limits
        tmp_cap = py("open('/tmp/big', 'wb').write(bytes(16 << 20))")
        assert "No space left on device" in tmp_cap.stderr, tmp_cap
        memory = py("x = bytearray(400 << 20); print('allocated')")
        assert memory.exit_code == 137 and "memory_limit" in memory.violations and "allocated" not in memory.stdout
        assert list(tmp_path.iterdir()) == [], "the container runtime wrote into the caller's working directory"
        forks = py("import os, time\nfor _ in range(40):\n    if os.fork() == 0:\n        time.sleep(5); os._exit(0)")
        assert "process_limit" in forks.violations, forks
        hostile = py("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nos.fork()\n"
                     "while True: time.sleep(0.01)", timeout_s=2.0)
        assert hostile.timed_out and "timeout" in hostile.violations and 2.0 <= hostile.wall_s < 10.0, hostile
        left = subprocess.run(["podman", "ps", "-aq", "--filter", "name=^cm-"], capture_output=True, text=True)
        assert left.stdout.strip() == "", "a container outlived its run"


def test_unavailable_runtime_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SandboxUnavailable, match="image 'localhost/no-such-image:x' not in local podman storage"):
        ContainerBackend(SweConfig(image="localhost/no-such-image:x"))
    with pytest.raises(SandboxUnavailable, match="no image: set env.swe.image"):
        ContainerBackend(SweConfig())
    missing = "apptainer" if shutil.which("apptainer") is None else "docker"
    with pytest.raises(SandboxUnavailable, match=f"{missing}"):
        ContainerBackend(SweConfig(runtime=missing, image=str(tmp_path / "x.sif")))


def test_coding_union_runs_a_swe_episode_in_its_container(tmp_path, instance, image):
    """`[env.coding] sources = ["swe"]`: the tool loop's tools run in the instance's image; the fix earns 1."""
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(instance["row"]) + "\n")
    swe = SweConfig(instances=str(path), repos_dir=str(instance["repos"]), test_timeout_s=30.0)
    config = EnvConfig(task="coding", coding=CodingConfig(sources=("swe",)), swe=swe,
                       sandbox=SandboxConfig(root_dir=str(tmp_path / "sandboxes")))
    make = env_factory(config)
    env = make("heldout")
    obs = env.reset(seed=0)
    assert "add(2, 3) returns -1" in obs.messages[-1]["content"]
    where = env.step(assistant(tool_calls=[("shell", {"command": "python -c 'import os, sys; print(os.getuid(), sys.executable)'"})]))
    assert where.messages[0]["content"].split()[:2] == ["150000", "/usr/bin/python3"], where.messages
    env.step(assistant(tool_calls=[("write_file", {"path": "mathx.py", "content": FIXED})]))
    done = env.step(assistant("done"))
    assert done.done and done.reward == 1.0 and (done.info["passed"], done.info["total"]) == (2, 2), done.info
    assert (done.info["source"], done.info["template"]) == ("swe", "acme__mathx-1")
    # a union with micro: seed 0 draws a micro task (graded by the local sandbox through the same router)
    union = env_factory(dataclasses.replace(config, coding=CodingConfig(sources=("micro", "swe"))))("train")
    union.reset(seed=0)
    micro = union.step(assistant("done"))
    assert micro.done and micro.info["source"] == "micro" and micro.info["total"] > 0, micro.info
    union.reset(seed=1)
    assert union.state.messages[-1]["content"].startswith("Repository `acme/mathx`")
    union.close()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"env\.coding\.sources names swe, but env\.swe\.instances = '.*empty.jsonl'"):
        env_factory(dataclasses.replace(config, swe=dataclasses.replace(swe, instances=str(empty))))
    # the pre-flight before any actor starts: the rows load and each image runs here
    check_task(config)
    with pytest.raises(ValueError, match=r"env\.swe\.instances = '.*empty.jsonl' has no row"):
        check_task(dataclasses.replace(config, swe=dataclasses.replace(swe, instances=str(empty))))
    path.write_text(json.dumps(instance["row"] | {"docker_image": ""}) + "\n")
    with pytest.raises(SandboxUnavailable, match="image 'localhost/no-such-image:x' not in local podman storage"):
        check_task(dataclasses.replace(config, swe=dataclasses.replace(swe, image="localhost/no-such-image:x")))


def test_a_run_that_reports_nothing_is_not_a_pass(tmp_path, instance, local_backend):
    """Node ids pytest cannot find, or an interpreter that is not there, give `tests_not_run`, reward 0."""
    row = instance["row"] | {"FAIL_TO_PASS": ["tests/test_gone.py::test_x"], "PASS_TO_PASS": []}
    (task,) = _load(tmp_path, instance, [row], runtime="local")
    grade = task.grade_patch(local_backend, task.patch)
    assert (grade.reward, grade.reason, grade.passed) == (0.0, "tests_not_run", 0), grade


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict:
    """repos_dir with `acme__shapes` (base and fix commits) and its row."""
    repos = tmp_path_factory.mktemp("shapes-repos")
    return {"repos": repos, "row": make_instance(repos, IMAGE)}


def _graded(task: SweTask, backend: SandboxBackend, canaries: bool = True) -> dict:
    """Grade of the fix, of no change, and of each forgery (each written over `shapes/core.py`)."""
    grades = {}
    for name, source in [("fix", FIXED_CORE), ("none", None), *FORGERIES.items()]:
        with task.workspace(backend) as ws:
            start = manifest(ws.path)
            if source is not None:
                (ws.path / "shapes" / "core.py").write_text(source)
            grades[name] = task.grade(backend, ws, start, (), canaries=canaries)
    return grades


def _check_forgeries_earn_nothing(grades: dict) -> None:
    fix, none = grades.pop("fix"), grades.pop("none")
    assert (fix.reward, fix.reason, fix.passed, fix.total) == (1.0, "passed", 6, 6), fix.output
    assert (none.reward, none.reason) == (0.0, "tests_failed (2/6 passed)"), none.output
    for name, grade in grades.items():
        assert (grade.reward, grade.reason) == (0.0, "forged_report"), (name, grade.violations, grade.output)


def test_forged_verdicts_earn_nothing_through_the_local_backend(tmp_path, shapes, local_backend):
    (task,) = _load(tmp_path, shapes, [shapes["row"]], runtime="local")
    _check_forgeries_earn_nothing(_graded(task, local_backend))
    # without the canaries every forgery but the one printed after pytest's counts is paid: the canaries catch them
    plain = _graded(task, local_backend, canaries=False)
    assert {name: g.reward for name, g in plain.items()} == {
        "fix": 1.0, "none": 0.0, **{name: 1.0 for name in FORGERIES}, "report_printed_at_exit": 0.0,
    }, {name: (g.reason, g.violations) for name, g in plain.items()}
    assert plain["report_printed_at_exit"].reason == "forged_report"


def test_forged_verdicts_earn_nothing_through_the_container_backend(tmp_path, shapes, image):
    (task,) = _load(tmp_path, shapes, [shapes["row"]])
    _check_forgeries_earn_nothing(_graded(task, ContainerBackend(SweConfig(image=task.image, test_timeout_s=60.0))))
