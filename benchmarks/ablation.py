"""The three loss channels switched on and off: held-out reward gain, train reward gain and cost per configuration.

Every configuration runs the task's recipe (`--task demo`: `configs/demo_cpu.toml`,
the arithmetic demo with three local solver teachers that slip; `--task coding`:
`configs/coding_cpu.toml`, the main job, micro coding tasks in the tool loop
graded by hidden tests; `--task coding_hard`: `configs/coding_hard_cpu.toml`, the
hard split the base rarely passes, its base trained to read a note, semi-online
pairs) as `composer-mesh train` in a process of its own, at the
same steps, seeds and budget; only the channel weights differ. A channel
switched on trains at the task's weight (`--alpha`, `--beta`; demo 1.0 and 1.0,
coding 0.25 and 0.25, the weights docs/recipe.md measured), whatever the recipe
ships (the coding recipe ships the policy channel alone, as measured):

    policy            [loss] alpha = 0, beta = 0 (plain GRPO/DAPO)
    policy+distill    alpha = A, beta = 0
    policy+replay     alpha = 0, beta = B
    all               alpha = A, beta = B
    distill only      policy_weight = 0, alpha = A, beta = 0   (control)
    replay only       policy_weight = 0, alpha = 0, beta = B   (control)

Held-out reward (coding: pass rate) is the run's own evaluation (`[trainer]
eval_every`: greedy and sampled on the environment's held-out split, the same problems for every
seed); the gain is the last evaluation minus the one before step 1. Train
gain: mean reward of the last 20 % of steps minus the first 20 %. "At equal
wall time" is each configuration's held-out gain at its last evaluation
within the policy-only runs' mean training time. The mechanism figures are
per-step training metrics, mean of the first 20 % of steps → the last 20 %:
the chosen and rejected responses' log-likelihood per token and the margin
(preference channel), the divergence to the hinted teacher (distillation);
their curves and the train reward go to `<plot>_mechanism.png`.

    python benchmarks/ablation.py --quick   # 20 steps, 2 seeds, the four keyed configurations, 2 evaluations
    python benchmarks/ablation.py --quick --task coding   # the coding recipe, 10 steps, pass rates
    python benchmarks/ablation.py --quick --task coding_hard   # the hard split, 4 steps (its control: --task coding)
    python benchmarks/ablation.py           # the recipe's steps (90), 3 seeds, all six configurations
    python benchmarks/ablation.py --jobs 2  # the same, two runs at a time (time columns then share the cores)
    python benchmarks/ablation.py --task coding --first-seed 3   # seeds 3..5: more seeds for a table
    python benchmarks/ablation.py --task coding --seeds 9 --results runs/ablation_coding   # kept per run: resumes
    python benchmarks/ablation.py --config my.toml --override=--optimizer.lr=3e-3 --only policy all
    python benchmarks/ablation.py --split validation --seeds 2 --only policy+distill \
        --override=--loss.distill.hint_kind=reference   # choosing a setting: never on the held-out split

Prints the table of docs/recipe.md, writes a PNG of the held-out curves
(`--plot`), and ends with one JSON line: all_vs_policy_heldout_gain (gain of
all / gain of policy only; null when the policy-only gain is 0),
distill_gain_delta, preference_gain_delta (gain with the channel added to
the policy channel minus policy only), greedy_gain_all (held-out greedy gain
of all three channels), overhead_ratio (training wall time of
all / policy only), policy_gain and all_gain, the paired standard errors of
the deltas (`*_delta_se`: sd of the per-seed differences / sqrt(seeds)), the
base's figures from the evaluation before step 1 (hint_gap: hinted minus
unhinted sampled pass rate, coding_hard only; base_all_fail_share: problems
whose every sample failed; base_pass_at_k), and the per-configuration figures
(each seed's held-out gain under "seed_gains", so the tables of two commands
can be pooled; gain_per_train_hour).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer_mesh.configs.loader import load_config  # noqa: E402
from composer_mesh.mesh.metrics import read_metrics  # noqa: E402

# per-step training metrics whose first and last fifth the mechanism columns compare (absent: channel off)
MECHANISM = ("preference/chosen_logp_mean", "preference/rejected_logp_mean", "preference/margin_mean",
             "preference/weight_mean",
             "distill/divergence_mean")

# per configuration: which channels train (policy, distillation, preference)
CONFIGS: dict[str, tuple[bool, bool, bool]] = {
    "policy": (True, False, False),
    "policy+distill": (True, True, False),
    "policy+replay": (True, False, True),
    "all": (True, True, True),
    "distill only": (False, True, False),
    "replay only": (False, False, True),
}
# per task: the recipe every configuration starts from, the held-out figures its gain is read from (the
# demo's reward; the coding task's pass rate: every hidden test passed), and the weights of channels 2 and 3
# when on (docs/recipe.md; a quarter on the coding task kept the tool-call format, docs/coding.md)
class Task(NamedTuple):
    """A task's recipe, its held-out figures, and channels 2 and 3's weights where on."""

    recipe: str
    sampled: str
    greedy: str
    alpha: float
    beta: float


TASKS: dict[str, Task] = {
    "demo": Task("configs/demo_cpu.toml", "eval/heldout_sampled", "eval/heldout_greedy", 1.0, 1.0),
    "coding": Task("configs/coding_cpu.toml", "eval/heldout_sampled_pass", "eval/heldout_greedy_pass", 0.25, 0.25),
    "coding_hard": Task("configs/coding_hard_cpu.toml", "eval/heldout_sampled_pass", "eval/heldout_greedy_pass",
                        0.25, 0.25),
}
# the base's figures read off the evaluation before step 1 (coding tasks; coding_hard also samples hinted)
BASE_FIGURES = {"hint_gap": "eval/heldout_hint_gap", "all_fail_share": "eval/heldout_all_fail_share",
                "pass_at_k": "eval/heldout_pass_at_k"}
# `--split validation`: the task's validation split, carved out of train, for choosing settings without
# looking at the held-out split (the figures keep their held-out names; the JSON line says which split)
VALIDATION: dict[str, tuple[str, ...]] = {
    "demo": ("--trainer.eval_split=validation", "--env.demo.validation_fraction=0.2"),
    "coding": ("--trainer.eval_split=validation", "--env.coding.validation_fraction=0.2"),
    "coding_hard": ("--trainer.eval_split=validation",),  # its sources carve a validation band already
}
# --quick's extra overrides per task: a hard-split evaluation samples every problem twice (with and without the
# note), so --quick evaluates 6 of its 20 problems
QUICK: dict[str, tuple[str, ...]] = {"coding_hard": ("--trainer.eval_samples=6",)}
# the configurations the JSON line's keys compare (--quick runs only these)
KEYED = ("policy", "policy+distill", "policy+replay", "all")


def switches(name: str, alpha: float, beta: float) -> tuple[str, ...]:
    """The overrides of configuration `name`, channels 2 and 3 at `alpha` and `beta` where on."""
    policy, distill, replay = CONFIGS[name]
    return (*(() if policy else ("--loss.policy_weight=0",)), f"--loss.alpha={alpha if distill else 0}",
            f"--loss.beta={beta if replay else 0}")


@dataclass
class RunResult:
    """One configuration at one seed."""

    heldout: list[tuple[int, float, float, float]]  # (step, training seconds so far, sampled, greedy), step 0 first
    train_gain: float
    wall_s: float  # the whole command
    train_s: float  # sum of the steps' seconds
    tokens: float  # completion tokens generated for training
    spend_usd: float
    policy_rollouts: float  # rollouts the policy channel trained (0 for the controls)
    hinted: float
    pairs: float  # pairs trained on (preference/pairs_in_batch summed over steps)
    replayed: float  # failed turns the replay actor decided on (summary.replay.outcomes)
    pair_rate: float  # share of the replayed turns that became a pair (the rest: no majority, or the student's answer)
    # per step, in order: "reward/mean" and each MECHANISM key the run logged (absent: that channel was off)
    curves: dict[str, list[float]] = field(default_factory=dict)
    base: dict[str, float] = field(default_factory=dict)  # BASE_FIGURES the evaluation before step 1 logged
    exit_note: str = ""  # why `train` exited 3 (nothing trained, or a switched-on channel got nothing); "" = exit 0

    @property
    def mechanism(self) -> dict[str, tuple[float, float]]:
        """Per MECHANISM key logged: its mean over the first 20 % of the steps logging it, and over the last 20 %."""
        return {key: _fifths(self.curves[key]) for key in MECHANISM if self.curves.get(key)}

    def gain(self, greedy: bool = False, within_s: float | None = None) -> float:
        """Held-out reward at the last evaluation (within `within_s` of training) minus before step 1."""
        key = 3 if greedy else 2
        points = [p for p in self.heldout if within_s is None or p[1] <= within_s]
        return points[-1][key] - self.heldout[0][key]


# the runs in flight, stopped when the benchmark stops early (a failed run, Ctrl-C, SIGTERM): a killed
# benchmark leaves no training running on the box
_LIVE: set[subprocess.Popen] = set()


def run_one(recipe: Path, overrides: list[str], out: Path, name: str, seed: int, steps: int,
            eval_every: int, task: str) -> RunResult:
    """`composer-mesh train` of `recipe` with `overrides` (configuration `name`'s switches last) at `seed`; its
    figures from summary.json and metrics.jsonl."""
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", "--no-resume", str(recipe),
           f"--job.output_dir={out}", "--job.name=run", f"--job.seed={seed}", f"--trainer.steps={steps}",
           f"--trainer.eval_every={eval_every}", f"--checkpoint.every_steps={steps}", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _LIVE.add(proc)
    try:
        stdout, stderr = proc.communicate()
    finally:
        _LIVE.discard(proc)
    wall = time.perf_counter() - start
    # exit 3: the run finished and evaluated, but trained nothing or a switched-on channel got nothing (its
    # summary says which): a measured outcome of that configuration, kept with the reason
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}): {stderr[-2000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    result = read_run(Path(summary["run_dir"]), summary, task, wall)
    result.exit_note = "; ".join([summary.get("untrained", ""), *summary.get("silent_channels", {}).values()]).strip("; ")
    return result


def read_run(run_dir: Path, summary: dict, task: str, wall: float) -> RunResult:
    """A finished run's figures from its summary (the last line `train` prints; also `run_dir`/summary.json) and
    `run_dir`/metrics.jsonl."""
    sampled, greedy = TASKS[task].sampled, TASKS[task].greedy
    rows = read_metrics(run_dir / "metrics.jsonl")
    before = summary["heldout"]["before"]
    heldout, elapsed = [(0, 0.0, before[sampled], before[greedy])], 0.0
    for row in rows:
        elapsed += row["seconds"]
        if sampled in row:
            heldout.append((row["step"], elapsed, row[sampled], row[greedy]))
    first, last = _fifths([row["reward/mean"] for row in rows])
    total = lambda key: float(sum(row.get(key, 0.0) for row in rows))  # noqa: E731
    replay = summary.get("replay") or {}
    replayed = float(sum((replay.get("outcomes") or {}).values()))
    return RunResult(heldout, last - first, wall, elapsed,
                     total("rollouts/completion_tokens"), float(replay.get("spend_usd", 0.0)),
                     total("rollouts/policy"), total("distill/hinted"), total("preference/pairs_in_batch"),
                     replayed, replay.get("pairs_made", 0) / replayed if replayed else 0.0,
                     {key: [row[key] for row in rows if key in row] for key in ("reward/mean", *MECHANISM)},
                     {name: before[key] for name, key in BASE_FIGURES.items() if key in before})


def _fifths(values: list[float]) -> tuple[float, float]:
    """(mean of the first 20 % of `values`, mean of the last 20 %), at least one value each."""
    k = max(1, len(values) // 5)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def _run_name(name: str, seed: int) -> str:
    """One run's folder and --results file stem."""
    return f"{name.replace(' ', '_')}-s{seed}"


def saved_run(results: Path, key: dict, name: str, seed: int, run: Callable[[], RunResult]) -> RunResult:
    """`run()`'s result for configuration `name` at `seed`, kept in `results` (one JSON file per run, with `key`: the
    task, steps and overrides it ran with) and read back instead of running again when the key matches, so a long
    ablation stopped half-way resumes, and tables of several commands can be pooled by one (`--results`)."""
    path = results / f"{_run_name(name, seed)}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] != key:
            diff = sorted(k for k in key.keys() | saved["key"].keys() if key.get(k) != saved["key"].get(k))
            raise SystemExit(f"{path} holds a run with other {', '.join(diff)} ({saved['key']}): "
                             "remove it or pass another --results folder")
        return RunResult(**saved["result"])
    result = run()
    results.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "result": dataclasses.asdict(result)}))
    tmp.replace(path)
    return result


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired_delta(runs: list[RunResult], baseline: list[RunResult]) -> tuple[float, float]:
    """Mean and standard error (sd of the per-seed differences / sqrt(seeds)) of the held-out gain of `runs` minus
    that of `baseline`, seed by seed (both in seed order)."""
    deltas = [a.gain() - b.gain() for a, b in zip(runs, baseline, strict=True)]
    mean, sd = _mean_sd(deltas)
    return round(mean, 4), round(sd / len(deltas) ** 0.5, 4)


@dataclass
class Row:
    """One configuration's runs, a seed each."""

    name: str
    runs: list[RunResult] = field(default_factory=list)

    def figure(self, f: Callable[[RunResult], float]) -> tuple[float, float]:
        """Mean and sample standard deviation of `f` over the seeds."""
        return _mean_sd([f(r) for r in self.runs])


def _mechanism(row: Row) -> dict[str, list[float]]:
    """Per MECHANISM key every seed logged: [first fifth, last fifth], means over the seeds."""
    keys = [k for k in MECHANISM if all(k in r.mechanism for r in row.runs)]
    return {k: [round(statistics.fmean(r.mechanism[k][i] for r in row.runs), 4) for i in (0, 1)] for k in keys}


def print_mechanism(rows: list[Row]) -> None:
    """The mechanism figures of the configurations that logged any: first fifth of the steps → last fifth."""
    logged = [(row.name, _mechanism(row)) for row in rows]
    logged = [(name, m) for name, m in logged if m]
    if not logged:
        return
    print("\nmechanism, mean over seeds: first 20 % of the steps -> last 20 %")
    for name, m in logged:
        print(f"{name:<16}" + "  ".join(f"{k.split('/')[1]} {a:+.3f} -> {b:+.3f}" for k, (a, b) in m.items()))


def plot_mechanism(rows: list[Row], path: Path) -> None:
    """Per training step, mean over the seeds: the train reward of every configuration, the chosen and rejected
    log-likelihood per token of the configurations with pairs, the divergence to the hinted teacher of those with
    hints (the curves docs/recipe.md reads a channel's mechanism from)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(row: Row, key: str) -> list[float]:
        n = min(len(r.curves.get(key, [])) for r in row.runs)
        return [statistics.fmean(r.curves[key][i] for r in row.runs) for i in range(n)]

    fig, (reward, pref, dist) = plt.subplots(1, 3, figsize=(13, 3.8))
    for row in rows:
        curve = mean_curve(row, "reward/mean")
        reward.plot(range(1, len(curve) + 1), curve, label=row.name)
        for key, style in (("preference/chosen_logp_mean", "-"), ("preference/rejected_logp_mean", "--")):
            if curve := mean_curve(row, key):
                pref.plot(range(1, len(curve) + 1), curve, style, label=f"{row.name}: {key.split('/')[1][:-10]}")
        if curve := mean_curve(row, "distill/divergence_mean"):
            dist.plot(range(1, len(curve) + 1), curve, label=row.name)
    for ax, title in ((reward, "train reward"), (pref, "log-likelihood per token of the pairs"),
                      (dist, "divergence to the hinted teacher")):
        ax.set_xlabel("step")
        ax.set_title(f"{title} ({len(rows[0].runs)} seeds, mean)", fontsize=9)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows: list[Row], path: Path, split: str = "held-out") -> None:
    """Mean `split` sampled reward per evaluated step, one line per configuration (seeds shaded min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        # the steps every seed evaluated (a seed's series can miss one: plot what all of them have)
        steps = sorted(set.intersection(*({p[0] for p in r.heldout} for r in row.runs)))
        per_step = [[next(p[2] for p in r.heldout if p[0] == step) for r in row.runs] for step in steps]
        ax.plot(steps, [statistics.fmean(v) for v in per_step], marker="o", label=row.name)
        ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.12)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{split} reward (sampled)")
    ax.set_title(f"{split} reward per configuration ({len(rows[0].runs)} seeds, min-max shaded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 seeds, the four configurations of the JSON keys; demo 20 steps, coding 10, coding_hard "
                        "4 (6 problems, evaluated before step 1 and at the end); others evaluated before step 1, at "
                        "the middle and at the end")
    parser.add_argument("--task", choices=list(TASKS), default="demo",
                        help="demo: configs/demo_cpu.toml, reward; coding: configs/coding_cpu.toml, pass rate; coding_hard: "
                        "configs/coding_hard_cpu.toml, pass rate")
    parser.add_argument("--steps", type=int, help="steps per run (default: the recipe's [trainer] steps; --quick: demo 20, coding 10, coding_hard 4)")
    parser.add_argument("--seeds", type=int, help="seeds first..first+n-1 (default 3, --quick 2)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0; 3 with the default --seeds runs seeds 3, 4, 5)")
    parser.add_argument("--plot", default="runs/ablation.png",
                        help="where the held-out curves go (a PNG; its folder is made)")
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), help="run these configurations only")
    parser.add_argument("--config", type=Path,
                        help="the recipe every configuration starts from (default: the task's; a task with a "
                        "held-out split)")
    parser.add_argument("--alpha", type=float,
                        help="channel 2's weight where on (default: the task's, demo 1.0, coding 0.25)")
    parser.add_argument("--beta", type=float,
                        help="channel 3's weight where on (default: the task's, demo 1.0, coding 0.25)")
    parser.add_argument("--override", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                        help="applied to every configuration, before its channel switches (repeatable)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (a run's trainer and generator alternate, so 2 on 2 cores finish sooner; "
                        "the time columns then include the contention; not --task coding_hard: its 8 pooled "
                        "sandbox workers per run made a --quick run 3.8x slower two at a time)")
    parser.add_argument("--results", type=Path,
                        help="keep each run's figures here (a JSON file per configuration and seed) and reuse those "
                        "already there with the same task, steps and overrides: resumes a stopped ablation, and "
                        "pools seeds run by separate commands into one table")
    parser.add_argument("--split", choices=("heldout", "validation"), default="heldout",
                        help="evaluate on the held-out split (reporting) or on a validation split carved out of "
                        "train (choosing settings; the held-out problems stay unseen)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # unwinds, so the runs are stopped
    config = args.config or REPO / TASKS[args.task].recipe
    overrides = [*(VALIDATION[args.task] if args.split == "validation" else ()),
                 *(QUICK.get(args.task, ()) if args.quick else ()), *args.override]
    alpha = TASKS[args.task].alpha if args.alpha is None else args.alpha
    beta = TASKS[args.task].beta if args.beta is None else args.beta
    recipe = load_config(config, overrides)  # a bad override fails here, before any run
    steps = args.steps or ({"demo": 20, "coding": 10, "coding_hard": 4}[args.task] if args.quick else recipe.trainer.steps)
    seeds = args.seeds or (2 if args.quick else 3)
    seed_range = range(args.first_seed, args.first_seed + seeds)
    # six evaluations after step 0 (the curves); --quick only the middle and the last, which the gains read (a
    # coding evaluation is 80 sandboxed episodes: at every step, --quick --task coding took 18 min); --quick
    # --task coding_hard only the last
    eval_every = max(1, steps // (6 if not args.quick else 1 if args.task == "coding_hard" else 2))
    names = args.only or list(KEYED if args.quick else CONFIGS)
    rows = [Row(n) for n in names]
    split = "held-out" if args.split == "heldout" else "validation"
    # what a kept run (--results) must have run with to be reused
    key = {"task": args.task, "config": config.name, "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
           "steps": steps, "eval_every": eval_every, "overrides": overrides}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ablation-") as tmp:

        def one(seed: int, row: Row) -> RunResult:
            switched = [*overrides, *switches(row.name, alpha, beta)]

            def run() -> RunResult:
                return run_one(config, switched, Path(tmp) / _run_name(row.name, seed),
                               row.name, seed, steps, eval_every, args.task)

            kept = {**key, "overrides": switched}
            result = saved_run(args.results, kept, row.name, seed, run) if args.results else run()
            if row.name.endswith("only") and result.policy_rollouts:
                raise RuntimeError(f"{row.name}: the policy channel trained {result.policy_rollouts:.0f} rollouts")
            print(f"  {row.name:<15} seed {seed}: {split} sampled {result.heldout[0][2]:.3f} -> "
                  f"{result.heldout[-1][2]:.3f}, greedy {result.heldout[0][3]:.3f} -> {result.heldout[-1][3]:.3f}, "
                  f"train gain {result.train_gain:+.3f}, {result.wall_s:.0f} s"
                  + (f" (exit 3: {result.exit_note})" if result.exit_note else ""),
                  file=sys.stderr, flush=True)
            return result

        # seed-major: a partial run still compares every configuration; each run is a process of its own
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = [(row, pool.submit(one, seed, row)) for seed in seed_range for row in rows]
            try:
                for row, future in runs:
                    row.runs.append(future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # a failed run stops the ones not yet started
                for proc in list(_LIVE):  # and the ones running (each stops its own actors on SIGTERM)
                    proc.terminate()
                raise
    by = {r.name: r for r in rows}
    budget = by["policy"].figure(lambda r: r.train_s)[0] if "policy" in by else None
    print(f"\n{args.task} task, {steps} steps, seeds {seed_range[0]}..{seed_range[-1]}, {args.split} split evaluated every {eval_every} "
          "steps; mean ± sd over seeds")
    head = (f"{'configuration':<16}{split + ' sampled':>20}{split + ' greedy':>19}{'train gain':>16}"
            f"{'at equal time':>15}{'train s':>9}{'gain/h':>8}{'wall s':>8}{'tokens':>9}{'teacher $':>11}{'hinted':>8}{'pairs':>7}"
            f"{'replayed':>10}{'pair rate':>11}")
    print(head)
    figures: dict[str, dict[str, float]] = {}
    for row in rows:
        g, gg = row.figure(lambda r: r.gain()), row.figure(lambda r: r.gain(greedy=True))
        tg = row.figure(lambda r: r.train_gain)
        eq = row.figure(lambda r: r.gain(within_s=budget)) if budget else None  # without the policy-only row: none
        train_s, wall = row.figure(lambda r: r.train_s)[0], row.figure(lambda r: r.wall_s)[0]
        tokens, spend = row.figure(lambda r: r.tokens)[0], row.figure(lambda r: r.spend_usd)[0]
        hinted, pairs = row.figure(lambda r: r.hinted)[0], row.figure(lambda r: r.pairs)[0]
        replayed, pair_rate = row.figure(lambda r: r.replayed)[0], row.figure(lambda r: r.pair_rate)[0]
        at_budget = f"{eq[0]:+.3f}" if eq else "-"
        per_hour = g[0] / (train_s / 3600) if train_s else 0.0  # held-out gain per hour of training
        print(f"{row.name:<16}{f'{g[0]:+.3f} ± {g[1]:.3f}':>20}{f'{gg[0]:+.3f} ± {gg[1]:.3f}':>19}"
              f"{f'{tg[0]:+.3f} ± {tg[1]:.3f}':>16}{at_budget:>15}{train_s:>9.0f}{per_hour:>+8.2f}{wall:>8.0f}{tokens:>9.0f}"
              f"{spend:>11.4f}{hinted:>8.0f}{pairs:>7.0f}{replayed:>10.0f}{pair_rate:>11.2f}")
        figures[row.name] = {"heldout_gain": round(g[0], 4), "heldout_gain_sd": round(g[1], 4),
                             "heldout_greedy_gain": round(gg[0], 4), "train_gain": round(tg[0], 4),
                             "heldout_gain_equal_time": round(eq[0], 4) if eq else None, "train_s": round(train_s, 1),
                             "gain_per_train_hour": round(per_hour, 3),
                             "wall_s": round(wall, 1), "tokens": round(tokens, 1), "teacher_usd": round(spend, 5),
                             "replayed": round(replayed, 1), "pair_rate": round(pair_rate, 4),
                             "seed_gains": [round(r.gain(), 4) for r in row.runs],
                             "seed_greedy_gains": [round(r.gain(greedy=True), 4) for r in row.runs],
                             "exit_notes": [r.exit_note for r in row.runs if r.exit_note],
                             "mechanism": _mechanism(row)}
    print_mechanism(rows)
    plot(rows, Path(args.plot), split)
    mechanism_plot = Path(args.plot).with_name(Path(args.plot).stem + "_mechanism.png")
    plot_mechanism(rows, mechanism_plot)
    print(f"{split} curves: {args.plot}, training curves: {mechanism_plot}; {time.perf_counter() - start:.0f} s in all")

    def gain(name: str) -> float | None:
        return figures[name]["heldout_gain"] if name in figures else None

    def paired(name: str) -> tuple[float, float] | None:
        return paired_delta(by[name].runs, by["policy"].runs) if name in by and "policy" in by else None

    def base_figure(name: str) -> float | None:
        """A base figure (BASE_FIGURES) averaged over every run that logged it (the same base and problems)."""
        values = [r.base[name] for row in rows for r in row.runs if name in r.base]
        return round(statistics.fmean(values), 4) if values else None

    base = gain("policy")
    distill_delta, preference_delta = paired("policy+distill"), paired("policy+replay")
    out: dict[str, object] = {
        "policy_gain": base, "all_gain": gain("all"),
        "distill_gain_delta_se": distill_delta[1] if distill_delta else None,
        "preference_gain_delta_se": preference_delta[1] if preference_delta else None,
        "all_gain_delta": (paired("all") or (None,))[0], "all_gain_delta_se": (paired("all") or (None, None))[1],
        "hint_gap": base_figure("hint_gap"), "base_all_fail_share": base_figure("all_fail_share"),
        "base_pass_at_k": base_figure("pass_at_k"),
        "all_vs_policy_heldout_gain": (round(gain("all") / base, 4)
                                       if base not in (None, 0.0) and gain("all") is not None else None),
        "distill_gain_delta": (round(gain("policy+distill") - base, 4)
                               if base is not None and gain("policy+distill") is not None else None),
        "preference_gain_delta": (round(gain("policy+replay") - base, 4)
                                  if base is not None and gain("policy+replay") is not None else None),
        "greedy_gain_all": figures["all"]["heldout_greedy_gain"] if "all" in figures else None,
        "overhead_ratio": (round(figures["all"]["train_s"] / figures["policy"]["train_s"], 4)
                           if "all" in figures and "policy" in figures else None),
        "task": args.task, "split": args.split, "steps": steps, "seeds": seeds, "first_seed": args.first_seed,
        "overrides": args.override, "alpha": alpha, "beta": beta,
        "configs": figures,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
