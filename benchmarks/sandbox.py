"""Episodes per second for the demo and feature-deletion tasks, and the sandbox's overhead.

    python benchmarks/sandbox.py --quick

Measures, in one run:
- demo task: episodes/s (reset + one solver reply + scoring; no sandbox involved);
- feature deletion (single-turn env, tasks from the two vendored fixture repos):
  oracle and no-op episodes/s, each episode a full grading run in a fresh
  sandbox, plus the oracle's and no-op's mean reward;
- sandbox overhead: the same command bare (`subprocess.run`) and sandboxed,
  interleaved, for `python -c pass` and for a pytest run of a fixture suite;
- grading overhead: a full sandboxed grade of the oracle (fresh workspaces,
  manifest, static checks, bwrap + seccomp + cgroups, grade runner) vs bare
  pytest of the same rebuilt repository, interleaved;
- hostile containment: hostile replies graded (single-turn replies on a textkit
  task, on a task whose tests pass callables and on one whose tests pass
  objects, new files and hostile tool arguments through the tool loop, code
  that lowers its pool worker's limits or leaves a tree past the recursion
  limit); contained = reward 0, no cgroup of this sandbox or workspace left,
  and the oracle graded after them all still earns 1;
- callable_task_oracle: the original code of every task of the `hookkit`
  fixture (tests pass callables and objects in and get callables back), min
  reward; callable_refused: its tasks the generator refused (0 expected);
- the warm pool (`envs.pool`, `pool_size` 4): micro coding tasks (`envs.micro`,
  reference answer, `grade_workspace`) graded one at a time cold and through the
  pool (median grade ms, `pool_vs_cold_ratio` = cold / pool), then
  `coding_eps_per_s`: episodes (workspace, answer, grade) per second with two
  generator threads sharing the pool (`coding_cold_fallbacks`: leases of that
  phase that found no free slot in `pool_wait_s` and ran cold; 0 = the pool
  kept up); the hostile replies again through the pool (`hostile_contained` is
  the lower of the cold and pooled shares). The sandbox root is a fresh
  directory of its own (other graders on the box do not touch it);
- SWE grades (`tests/envs/swe_shapes.py`: a one-package repository in the
  SWE-bench shape, six node ids): the gold patch graded with and without the
  negative-control canaries (`envs.swe_verdict`), interleaved, through the
  local sandbox and through podman when its image is built
  (`benchmarks/container.py` builds it), and `swe_forged_contained`: the
  share of the forged verdicts (`swe_shapes.FORGERIES`) that earn 0 locally.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from composer_mesh.configs.sections.env import (
    CodingConfig, DemoTaskConfig, FeatureDeletionConfig, SandboxConfig, SweConfig,
)
from composer_mesh.envs.container import ContainerBackend
from composer_mesh.envs.base import assistant
from composer_mesh.envs.demo import DemoEnv, solve
from composer_mesh.envs.containment import CGROUP_ROOT, CONTROLLERS
from composer_mesh.envs.feature_deletion import FeatureDeletionEnv, TaskStore, generate_tasks
from composer_mesh.envs.grading import PYTEST_ARGS, Grade
from composer_mesh.envs.micro import MicroTask, make_task
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox, SandboxUnavailable
from composer_mesh.envs.swe import SweTask, load_instances
from composer_mesh.envs.tool_loop import ToolLoopEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "envs"))
from swe_shapes import FIXED_CORE, FORGERIES, make_instance  # noqa: E402

# Module-level payloads appended to the stubbed target (see tests/envs/test_envs_hostile.py for the full corpus).
HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_tree": "import os\nfor _ in range(6):\n    if os.fork() == 0:\n        b = bytearray(900 << 20)\n        os._exit(0)\n",
    "channel_flood": "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'x' * (2 << 20))\n    except OSError:\n        pass\n",
    "unshare": "import ctypes\nctypes.CDLL(None).unshare(0x10000000)\n",
    "read_host": "print(open('/etc/hostname').read())\n",
    "exit_zero": "import os\ngetattr(os, '_ex' + 'it')(0)\n",
}
# Round 3 (issue 32), appended to a callable task's stub: forged judge replies, channel rewind, heap walk, code swap.
_OUT = "import os as _o, sys as _s\n_OUT = int(_s.argv[2])\n"
HOSTILE_CALLABLE = {
    "forged_describe_dunder": _OUT + "_o.write(_OUT, b'{\"ok\": {\"d\": [[\"__class__\", [\"value\", 1]]]}}\\n')\n",
    "forged_reply_deep_json": _OUT + "def apply_all(fn, items):\n    _o.write(_OUT, b'{\"ok\": ' + b'[' * 100000 + b']' * 100000 + b'}\\n')\n    return list(items)\n",
    "forged_callback": _OUT + "def apply_all(fn, items):\n    _o.write(_OUT, b'{\"op\": \"call\", \"handle\": 99, \"args\": [], \"kwargs\": {\"d\": []}}\\n')\n    return list(items)\n",
    "report_rewind": "import os\nfor fd in range(3, 256):\n    try:\n        os.ftruncate(fd, 0)\n        os.lseek(fd, 0, 0)\n        os.write(fd, b'@@grade 0 {}\\n')\n    except OSError:\n        pass\n",
    "heap_walk": "def apply_all(fn, items):\n    for o in __import__('gc').get_objects():\n        if hasattr(o, 'exported') and hasattr(o, 'out_fd'):\n            __import__('os').write(o.out_fd, b'{\"ok\": [2, 4, 6]}\\n')\n    return list(items)\n",
    "code_swap": "import _pytest.python as p\np.pytest_pyfunc_call.__code__ = (lambda *a, **k: True).__code__\n",
}
# Objects across the split (appended to `total_area`'s stub, which gets the test's Squares): forged object requests.
HOSTILE_OBJECT = {
    "proxy_dunder_read": _OUT + "def total_area(shapes):\n    _o.write(_OUT, b'{\"op\": \"object\", \"handle\": 0, \"action\": \"getattr\", \"args\": [\"__class__\"]}\\n')\n    return 0.0\n",
    "forged_object_handle": _OUT + "def total_area(shapes):\n    _o.write(_OUT, b'{\"op\": \"object\", \"handle\": 9999, \"action\": \"len\", \"args\": []}\\n')\n    return 0.0\n",
}
# Round 4 (issue 55), appended to the stubbed target and run at import in the callee (a warm slot in the pool): the
# zygote's limits and scheduling lowered for every later job, a tree deeper than the recursion limit for the reset.
HOSTILE_POISON = {
    "zygote_rlimits": "import os, resource\nfor r in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS):\n    try:\n"
                      "        resource.prlimit(os.getppid(), r, (64 << 20 if r == resource.RLIMIT_AS else 32,) * 2)\n"
                      "    except OSError:\n        pass\n",
    "zygote_sched": "import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, os.getppid(), 19)\n"
                    "    os.sched_setaffinity(os.getppid(), {0})\nexcept OSError:\n    pass\n",
    "deep_tree": "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n",
}
# Round 4, one message of tool calls each: arguments that once took the whole generate batch down.
HOSTILE_CALLS = {
    "nul_path": [("write_file", {"path": "m\x00.py", "content": "x"})],
    "lone_surrogate_edit": [("edit_file", {"path": "PLACEHOLDER", "old": "def", "new": "def\ud800"})],
    "deep_write_path": [("write_file", {"path": "d/" * 200 + "f.py", "content": "x"})],
    "deep_expression": [("write_file", {"path": "PLACEHOLDER", "content": "x = " + "(" * 5000 + ")" * 5000 + "\n"})],
    "many_calls": [("list_dir", {"path": "."})] * 200,
}
# New files through the tool loop (with a wrong target): modules the judge's interpreter imports.
HOSTILE_FILES = {
    "shadow_pytest_runner": {"_pytest/__init__.py": "", "_pytest/runner.py": "def pytest_runtest_protocol(item, nextitem):\n    return True\n"},
    "shadow_stdlib_json": {"json.py": "def dumps(*a, **k):\n    return '{}'\n"},
}

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "envs" / "fixtures"
IMAGE = "localhost/composer-mesh-swe:bookworm"


def demo_rate(episodes: int) -> float:
    env = DemoEnv(DemoTaskConfig(ops=("add", "sub", "mul", "reverse")))
    start = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed=seed)
        obs = env.step(assistant(solve(env.state.messages)))
        assert obs.reward == 1.0
    return episodes / (time.perf_counter() - start)


def feature_deletion(sandbox: Sandbox, pool: SandboxPool, tasks_per_repo: int, reps: int) -> dict[str, float]:
    store = TaskStore(sandbox)
    try:
        config = FeatureDeletionConfig(max_tasks=tasks_per_repo)
        start = time.perf_counter()
        tasks = [t for repo in ("textkit", "minicalc") for t in generate_tasks(FIXTURES / repo, config, sandbox, store)]
        gen_s = time.perf_counter() - start
        env = FeatureDeletionEnv(tasks, sandbox)
        out: dict[str, float] = {"tasks": len(tasks), "generate_s_per_task": gen_s / len(tasks)}
        for policy in ("oracle", "noop"):
            rewards, start = [], time.perf_counter()
            for i, task in enumerate(tasks):
                env.reset(seed=i)
                source = task.original_source() if policy == "oracle" else task.stubbed_source
                rewards.append(env.step(assistant(f"```python\n{source}```")).reward)
            out[f"{policy}_eps_per_s"] = len(tasks) / (time.perf_counter() - start)
            out[f"{policy}_mean_reward"] = sum(rewards) / len(rewards)
            out[f"{policy}_min_reward" if policy == "oracle" else f"{policy}_max_reward"] = (
                min(rewards) if policy == "oracle" else max(rewards))
        out["grade_bare_s"], out["grade_sandboxed_s"] = grading_overhead(sandbox, tasks[0], reps)
        refused: list[tuple[str, str]] = []
        callable_tasks = generate_tasks(FIXTURES / "hookkit", FeatureDeletionConfig(max_tasks=10), sandbox, store, refused)
        oracle = [t.grade_source(sandbox, t.original_source()) for t in callable_tasks]
        out["callable_tasks"], out["callable_refused"] = len(callable_tasks), len(refused)
        out["callable_task_oracle"] = min(g.reward for g in oracle)
        out["oracle_grade_s"] = statistics.median(g.grade_s for g in oracle)
        target = next(t for t in callable_tasks if t.symbols == ("apply_all",))
        shapes = next(t for t in callable_tasks if t.symbols == ("total_area",))
        out["hostile_contained_cold"], out["hostile_tried"] = hostile_contained(sandbox, tasks[0], target, shapes)
        out["hostile_contained_pool"], _ = hostile_contained(pool, tasks[0], target, shapes)
        out["hostile_contained"] = min(out["hostile_contained_cold"], out["hostile_contained_pool"])
        return out
    finally:
        store.cleanup()


def micro_episode(backend: Sandbox | SandboxPool, task: MicroTask) -> Grade:
    """One coding episode with the reference answer: the task's workspace, the answer written, the grade."""
    with task.workspace(backend) as ws:
        start = manifest(ws.path)
        for rel, text in task.reference_files().items():
            (ws.path / rel).write_text(text)
        return task.grade(backend, ws, start)


def coding(sandbox: Sandbox, pool: SandboxPool, episodes: int, cold_episodes: int, threads: int = 2) -> dict[str, float]:
    """Micro-task grading: median grade ms cold and pooled (one at a time), then episodes/s with `threads` sharing the pool."""
    tasks = [make_task(CodingConfig(), "train", seed) for seed in range(episodes)]
    cold = [micro_episode(sandbox, t) for t in tasks[:cold_episodes]]
    warm = [micro_episode(pool, t) for t in tasks]
    fallbacks = pool.stats()["cold_fallbacks"]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        parallel = list(ex.map(lambda t: micro_episode(pool, t), tasks))
    eps = len(tasks) / (time.perf_counter() - start)
    # the pool kept up when no lease of the parallel phase had to fall back to a cold sandbox
    fallbacks = pool.stats()["cold_fallbacks"] - fallbacks
    cold_ms = statistics.median(g.grade_s for g in cold) * 1e3
    warm_ms = statistics.median(g.grade_s for g in warm) * 1e3
    return {
        "micro_grade_cold_ms": cold_ms, "micro_grade_pool_ms": warm_ms, "pool_vs_cold_ratio": cold_ms / warm_ms,
        "coding_eps_per_s": eps, "coding_min_reward": min(g.reward for g in cold + warm + parallel),
        "coding_cold_fallbacks": fallbacks,
    }


def grading_overhead(sandbox: Sandbox, task, reps: int) -> tuple[float, float]:
    """Median seconds (bare pytest of the rebuilt repo, full sandboxed grade of the oracle), interleaved."""
    bare, graded = [], []
    with sandbox.workspace(copy_from=task.pristine) as ws:
        for _ in range(reps):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS], cwd=ws.path, capture_output=True, check=True,
                           env=os.environ | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
            bare.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert task.grade_source(sandbox, task.original_source()).reward == 1.0
            graded.append(time.perf_counter() - t)
    return statistics.median(bare), statistics.median(graded)


def hostile_contained(sandbox: Sandbox, task, callable_task, object_task) -> tuple[float, int]:
    """Share of hostile replies that earn 0 and leave nothing behind (this sandbox's cgroups, workspaces); the
    oracle graded after them all must still earn 1 (no reply poisoned what later grades run in), else 0."""
    before = set(sandbox.root.iterdir())
    replies = [(task, task.stubbed_source + "\n" + p, []) for p in (*HOSTILE.values(), *HOSTILE_POISON.values())]
    replies += [(callable_task, callable_task.stubbed_source + "\n" + p, []) for p in HOSTILE_CALLABLE.values()]
    replies += [(object_task, object_task.stubbed_source + "\n" + p, []) for p in HOSTILE_OBJECT.values()]
    wrong = callable_task.stubbed_source + "\ndef apply_all(fn, items):\n    return list(items)\n"
    replies += [(callable_task, wrong, [("write_file", {"path": p, "content": c}) for p, c in files.items()])
                for files in HOSTILE_FILES.values()]
    replies += [(callable_task, wrong, [(n, {k: callable_task.target if v == "PLACEHOLDER" else v for k, v in a.items()})
                                        for n, a in calls]) for calls in HOSTILE_CALLS.values()]
    contained = 0
    for i, (t, source, calls) in enumerate(replies):
        if calls:
            env = ToolLoopEnv([t], sandbox)
            env.reset(seed=0)
            env.step(assistant(tool_calls=[("write_file", {"path": t.target, "content": source}), *calls]))
            reward = env.step(assistant("done")).reward
        else:
            env = FeatureDeletionEnv([t], sandbox)
            env.reset(seed=i)
            reward = env.step(assistant(f"```python\n{source}```")).reward
        env.close()
        groups = [p for c in CONTROLLERS for p in (CGROUP_ROOT / c / "composer-mesh-sandbox").glob(f"{sandbox.tag}-*")]
        left = [p for p in sandbox.root.iterdir() if p not in before]
        contained += reward == 0.0 and not groups and not left  # a run's cgroup is removed only once empty
    unpoisoned = all(t.grade_source(sandbox, t.original_source()).reward == 1.0 for t in (task, callable_task))
    return contained / len(replies) if unpoisoned else 0.0, len(replies)


def swe_task(root: Path, runtime: str) -> SweTask:
    """The shapes instance (`tests/envs/swe_shapes.py`) loaded for `runtime` ("local" or "podman")."""
    repos = root / "repos"
    if not repos.exists():
        repos.mkdir(parents=True)
        (root / "instances.jsonl").write_text(json.dumps(make_instance(repos, IMAGE)) + "\n")
    config = SweConfig(instances=str(root / "instances.jsonl"), repos_dir=str(repos), runtime=runtime)
    return load_instances(config, root / f"store-{runtime}")[0]


def swe_grade(task: SweTask, backend, source: str, canaries: bool = True) -> Grade:
    """One SWE grade of `source` written over the instance's `shapes/core.py`."""
    with task.workspace(backend) as ws:
        start = manifest(ws.path)
        (ws.path / "shapes" / "core.py").write_text(source)
        return task.grade(backend, ws, start, (), canaries=canaries)


def swe(sandbox: Sandbox, root: Path, reps: int) -> dict[str, float | None]:
    """Median grade seconds of the gold patch with and without canaries (local; podman when its image exists),
    interleaved; the share of forged verdicts that earn 0 (local)."""
    out: dict[str, float | None] = {}
    backends = [("local", sandbox)]
    try:
        backends.append(("podman", ContainerBackend(SweConfig(image=IMAGE, test_timeout_s=60.0))))
    except SandboxUnavailable as exc:
        print(f"[sandbox bench] no podman figures: {exc}")
        out |= {"swe_grade_podman_s": None, "swe_grade_podman_unchecked_s": None}
    for name, backend in backends:
        task = swe_task(root, name)
        checked, plain = [], []
        for _ in range(reps):
            for canaries, times in ((True, checked), (False, plain)):
                grade = swe_grade(task, backend, FIXED_CORE, canaries)
                assert grade.reward == 1.0, grade
                times.append(grade.grade_s)
        out[f"swe_grade_{name}_s"] = statistics.median(checked)
        out[f"swe_grade_{name}_unchecked_s"] = statistics.median(plain)
    local = swe_task(root, "local")
    out["swe_forged_contained"] = sum(swe_grade(local, sandbox, src).reward == 0.0 for src in FORGERIES.values()) \
        / len(FORGERIES)
    out["swe_forged_tried"] = len(FORGERIES)
    return out


def overhead(sandbox: Sandbox, argv_of, cwd_src: Path | None, reps: int) -> tuple[float, float]:
    """Median seconds (bare, sandboxed) for the same command, interleaved."""
    bare, boxed = [], []
    extra = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # both sides: no entry-point plugins
    with sandbox.workspace(copy_from=cwd_src) as ws:
        for _ in range(reps):
            t = time.perf_counter()
            subprocess.run(argv_of(sys.executable), cwd=ws.path, capture_output=True, check=True, env=os.environ | extra)
            bare.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = sandbox.run(argv_of(sandbox.python()), ws, env=extra)
            boxed.append(time.perf_counter() - t)
            assert r.ok, r.stderr
    return statistics.median(bare), statistics.median(boxed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts (about a minute on 2 cores)")
    args = parser.parse_args()
    reps, tasks_per_repo, demo_eps = (6, 2, 2000) if args.quick else (30, 8, 20000)

    # a root of its own: the containment check lists it, and other graders on the box use the default one;
    # no grade cache: every figure here is a judge's cost (repeated submissions would be lookups)
    root = tempfile.mkdtemp(prefix="sandbox-bench-")
    sandbox = Sandbox(SandboxConfig(root_dir=root, grade_cache=0))
    pool = SandboxPool(replace(sandbox.config, pool_size=4))
    demo = demo_rate(demo_eps)
    code = coding(sandbox, pool, *((24, 4) if args.quick else (60, 12)))
    fd = feature_deletion(sandbox, pool, tasks_per_repo, reps)
    swe_figures = swe(sandbox, Path(root) / "swe", max(3, reps // 2))
    pool_stats = pool.stats()
    pool.close()
    py_bare, py_box = overhead(sandbox, lambda py: [py, "-c", "pass"], None, reps)
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    pt_bare, pt_box = overhead(sandbox, lambda py: [py, *pytest_args], FIXTURES / "textkit", reps)
    shutil.rmtree(root, ignore_errors=True)

    rows = [
        ("demo episodes/s", f"{demo:,.0f}"),
        ("feature-deletion tasks (2 repos)", f"{fd['tasks']:.0f}"),
        ("  generation s/task (verify: stub + suite)", f"{fd['generate_s_per_task']:.2f}"),
        ("  oracle episodes/s  (mean reward)", f"{fd['oracle_eps_per_s']:.2f}  ({fd['oracle_mean_reward']:.2f})"),
        ("  no-op episodes/s   (mean reward)", f"{fd['noop_eps_per_s']:.2f}  ({fd['noop_mean_reward']:.2f})"),
        ("grade oracle: bare pytest / sandboxed grade ms",
         f"{fd['grade_bare_s'] * 1e3:.0f} / {fd['grade_sandboxed_s'] * 1e3:.0f}  (x{fd['grade_sandboxed_s'] / fd['grade_bare_s']:.2f})"),
        ("hostile replies contained (share): cold / pool",
         f"{fd['hostile_contained_cold']:.2f} / {fd['hostile_contained_pool']:.2f}  ({fd['hostile_tried']:.0f} tried each)"),
        ("micro task grade ms: cold / pool", f"{code['micro_grade_cold_ms']:.0f} / {code['micro_grade_pool_ms']:.0f}  (x{code['pool_vs_cold_ratio']:.1f})"),
        ("coding episodes/s (pool of 4, 2 threads; min reward, cold fallbacks)",
         f"{code['coding_eps_per_s']:.2f}  ({code['coding_min_reward']:.2f}, {code['coding_cold_fallbacks']})"),
        ("pool: warm runs, resets, failed checks, replaced, cold", " ".join(
            str(pool_stats[k]) for k in ("warm_runs", "resets", "reset_failures", "replaced", "cold_fallbacks"))),
        ("load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}"),
        ("callable tasks: oracle min reward (tasks, refused)",
         f"{fd['callable_task_oracle']:.2f}  ({fd['callable_tasks']:.0f}, {fd['callable_refused']:.0f})"),
        ("oracle grade_s (median, callable tasks)", f"{fd['oracle_grade_s']:.2f}"),
        ("SWE grade s, local: canaries on / off", f"{swe_figures['swe_grade_local_s']:.2f} / "
         f"{swe_figures['swe_grade_local_unchecked_s']:.2f}"),
        ("SWE grade s, podman: canaries on / off", "not built" if swe_figures["swe_grade_podman_s"] is None else
         f"{swe_figures['swe_grade_podman_s']:.2f} / {swe_figures['swe_grade_podman_unchecked_s']:.2f}"),
        ("SWE forged verdicts earning 0 (share)", f"{swe_figures['swe_forged_contained']:.2f}  "
         f"({swe_figures['swe_forged_tried']} tried)"),
        ("python -c pass: bare / sandboxed ms", f"{py_bare * 1e3:.0f} / {py_box * 1e3:.0f}  (+{(py_box - py_bare) * 1e3:.0f} ms)"),
        ("pytest suite:   bare / sandboxed ms", f"{pt_bare * 1e3:.0f} / {pt_box * 1e3:.0f}  (+{(pt_box - pt_bare) * 1e3:.0f} ms)"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"sandbox benchmark ({'quick' if args.quick else 'full'}, medians of {reps} interleaved runs)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(json.dumps({
        "demo_eps_per_s": round(demo, 1),
        "feature_deletion_tasks": int(fd["tasks"]),
        "feature_deletion_oracle_eps_per_s": round(fd["oracle_eps_per_s"], 3),
        "feature_deletion_noop_eps_per_s": round(fd["noop_eps_per_s"], 3),
        "oracle_mean_reward": fd["oracle_mean_reward"],
        "noop_mean_reward": fd["noop_mean_reward"],
        "oracle_min_reward": fd["oracle_min_reward"],
        "noop_max_reward": fd["noop_max_reward"],
        "grade_bare_ms": round(fd["grade_bare_s"] * 1e3, 1),
        "grade_sandboxed_ms": round(fd["grade_sandboxed_s"] * 1e3, 1),
        "grading_overhead_ratio": round(fd["grade_sandboxed_s"] / fd["grade_bare_s"], 3),
        "hostile_contained": fd["hostile_contained"],
        "hostile_contained_cold": fd["hostile_contained_cold"],
        "hostile_contained_pool": fd["hostile_contained_pool"],
        "coding_eps_per_s": round(code["coding_eps_per_s"], 2),
        "coding_min_reward": code["coding_min_reward"],
        "coding_cold_fallbacks": code["coding_cold_fallbacks"],
        "micro_grade_pool_ms": round(code["micro_grade_pool_ms"], 1),
        "micro_grade_cold_ms": round(code["micro_grade_cold_ms"], 1),
        "pool_vs_cold_ratio": round(code["pool_vs_cold_ratio"], 2),
        "pool_reset_failures": pool_stats["reset_failures"],
        "pool_cold_fallbacks": pool_stats["cold_fallbacks"],
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "hostile_tried": int(fd["hostile_tried"]),
        "callable_task_oracle": fd["callable_task_oracle"],
        "callable_tasks": int(fd["callable_tasks"]),
        "callable_refused": int(fd["callable_refused"]),
        "oracle_grade_s": round(fd["oracle_grade_s"], 3),
        "python_bare_ms": round(py_bare * 1e3, 1),
        "python_sandboxed_ms": round(py_box * 1e3, 1),
        "python_overhead_ratio": round(py_box / py_bare, 3),
        "pytest_bare_ms": round(pt_bare * 1e3, 1),
        "pytest_sandboxed_ms": round(pt_box * 1e3, 1),
        "pytest_overhead_ratio": round(pt_box / pt_bare, 3),
        **{k: v if v is None else round(v, 3) for k, v in swe_figures.items()},
    }))


if __name__ == "__main__":
    main()
