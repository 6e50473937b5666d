"""`[env]`: verifiable tasks, the sandbox that runs model-written code, the tool loop.

`task` picks the environment the generators drive: the CPU demo task (tiny
arithmetic with a fixed answer format), feature deletion on local Python
repositories, the multi-turn tool loop over such repositories, the coding
tool loop over a union of sources (generated micro-repositories, local
repositories, SWE instances), a prompt dataset
scored by TRL-style reward functions (`dataset`), or a user's environment
factory (`plugin`). docs/tasks.md shows each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed process tree (see docs/envs.md for what enforces each)."""

    wall_timeout_s: float = option(20.0, doc="wall-clock limit; the whole process tree is killed after it", gt=0.0)
    cpu_time_s: int = option(10, doc="RLIMIT_CPU seconds per process (SIGXCPU, then SIGKILL)", ge=1)
    address_space_mb: int = option(1024, doc="RLIMIT_AS per process in MiB", ge=64)
    file_size_mb: int = option(16, doc="RLIMIT_FSIZE: largest file (and stdout/stderr) a process may write, MiB", ge=1)
    max_processes: int = option(32, doc="RLIMIT_NPROC for the sandbox's private uid", ge=1)
    max_open_files: int = option(256, doc="RLIMIT_NOFILE", ge=16)
    output_tail_chars: int = option(4000, doc="characters of stdout/stderr kept in results", ge=0)
    root_dir: str = option("", doc="where private work directories are made ('' = the system temp dir)")
    memory_mb: int = option(2048, doc="cgroup memory limit for the whole process tree, MiB (OOM kill beyond it)", ge=64)
    cpu_cores: float = option(1.0, doc="cgroup CPU quota for the whole process tree, in cores", gt=0.0)
    tmpfs_mb: int = option(64, doc="size cap of the writable /tmp tmpfs inside the sandbox, MiB", ge=1)
    expose_paths: tuple[str, ...] = option(
        (), doc="extra host paths bound read-only into the sandbox's root (besides /usr and the interpreter)"
    )
    env_passthrough: tuple[str, ...] = option(
        ("LANG", "LC_ALL"), doc="host environment variables copied in (names only; never put secrets here)"
    )
    uid_base: int = option(200_000, doc="first of the private uids given to sandboxes", ge=1000)
    uid_count: int = option(100_000, doc="how many private uids to draw from", ge=1)
    bwrap_binary: str = option("bwrap", doc="bubblewrap binary that builds the namespaces and the minimal root")
    slow_answer_s: float = option(
        0.0,
        doc="a repository grade taking longer than this many seconds earns 0 (reason slow_answer); 0 = no cap "
        "(wall_timeout_s still bounds what one grade can cost)",
        ge=0.0,
    )
    pool_size: int = option(
        0,
        doc="warm sandbox workers started ahead for grading (envs.pool; a grade leases two); "
        "0 = a cold sandbox per run",
        ge=0,
        le=64,
    )
    pool_wait_s: float = option(
        1.0, doc="how long a grade waits for a free warm worker before it runs cold instead", ge=0.0
    )
    grade_cache: int = option(
        4096,
        doc="grades kept per process by the content of everything a grade reads (the task's tree, the agent's "
        "files, the tests, these limits): an identical submission of the same task is judged once "
        "(envs.grade_cache); 0 = judge every time",
        ge=0,
    )


# task sources of [env] task = "coding" (besides the named [[env.coding.variants]])
CODING_SOURCES = ("micro", "repos", "swe")


def _check_train_left(section: str, heldout_fraction: float, validation_fraction: float) -> None:
    """The held-out and validation shares of one split hash must leave a train share."""
    if heldout_fraction + validation_fraction >= 1.0:
        raise ValueError(f"{section}.heldout_fraction + validation_fraction = "
                         f"{heldout_fraction + validation_fraction:g} leaves no train split")


@dataclass(frozen=True)
class DemoTaskConfig:
    """The fast CPU demo task: tiny problems, answer as `ANSWER: <result>`."""

    ops: tuple[str, ...] = option(("add",), doc="problem kinds: add, sub, mul, max, reverse")
    max_operand: int = option(9, doc="operands are drawn from 0..max_operand", ge=1, le=999)
    word_length: int = option(3, doc="letters in a reverse problem", ge=1, le=12)
    heldout_fraction: float = option(0.2, doc="share of the problem space kept for evaluation", ge=0.0, lt=1.0)
    validation_fraction: float = option(
        0.0, doc="share of the problem space carved out of train for choosing settings ([trainer] eval_split)",
        ge=0.0, lt=1.0,
    )
    max_turns: int = option(2, doc="assistant attempts per episode (feedback after a failed attempt)", ge=1)
    episode_reward: Literal["last", "mean"] = option(
        "last",
        doc="multi-turn episodes: the last attempt's reward, or the mean over max_turns attempts "
        "(attempts after an exact one count as exact, so a retry earns less than a first-time answer)",
        choices=("last", "mean"),
    )
    format_reward: float = option(0.2, doc="reward for a well-formed but wrong answer", ge=0.0, le=1.0)
    closeness_scale: float = option(
        5.0, doc="numeric answers: credit falls linearly to the format reward at this distance", gt=0.0
    )
    warm_start_steps: int = option(
        0,
        doc="train: start RL from a base model made by this many SFT steps on format-only examples "
        "(answers independent of the problem, envs.demo.format_examples); 0 = the raw weights",
        ge=0,
    )
    warm_start_examples: int = option(512, doc="format-only conversations the warm start draws from", ge=1)
    warm_start_lr: float = option(3e-3, doc="AdamW learning rate of the warm start", gt=0.0)

    def __post_init__(self) -> None:
        _check_train_left("env.demo", self.heldout_fraction, self.validation_fraction)


@dataclass(frozen=True)
class FeatureDeletionConfig:
    """Tasks generated from a local Python repository with a passing pytest suite."""

    repos: tuple[str, ...] = option((), doc="paths of the local repositories to generate tasks from")
    max_tasks: int = option(8, doc="tasks to generate per repository (after verification)", ge=1)
    functions_per_task: int = option(1, doc="functions deleted per task (>1: a feature of related functions)", ge=1, le=4)
    min_body_statements: int = option(2, doc="only delete functions with at least this many statements", ge=1)
    seed: int = option(0, doc="order in which candidate functions are tried")
    heldout_fraction: float = option(
        0.25, doc="share of tasks (by a hash of the task name) kept for evaluation", ge=0.0, lt=1.0
    )


# the micro knobs a `[[env.coding.variants]]` table may override (each unset key keeps [env.coding]'s value)
VARIANT_KNOBS = ("functions_per_task", "statements_per_body", "kinds", "ops_per_kind", "distractor_files",
                 "failing_visible_test", "hidden_tests_per_function", "namings", "docstring", "heldout_fraction",
                 "validation_fraction", "heldout_by")
VARIANT_SHAPES = ("micro", "swe")


@dataclass(frozen=True)
class MicroVariant:
    """One `[[env.coding.variants]]` table: a named task source made of [env.coding]'s micro knobs with some
    overridden (a key left out keeps [env.coding]'s value). `shape = "swe"` renders its tasks as SWE-style
    instances (envs.swe_mini): a package repository in git whose functions are implemented, one of them buggy, an
    issue stating a failing call, hidden tests as a test patch, graded by the SWE grader."""

    name: str = option("", doc="the source's name, as env.coding.sources and warm_start_sources name it")
    shape: str = option("micro", doc="micro: tool-loop micro tasks; swe: SWE-style mini instances of the same "
                        "templates (implemented functions, one buggy; issue, test patch, gold patch)",
                        choices=VARIANT_SHAPES)
    functions_per_task: int | None = option(None, doc="micro: functions to implement per task", ge=1, le=8)
    statements_per_body: int | None = option(None, doc="operations chained in one function body", ge=1, le=6)
    kinds: tuple[str, ...] | None = option(None, doc="operation kinds: arithmetic, strings, lists, dicts, control")
    ops_per_kind: int | None = option(None, doc="the first N operations of each kind (0 = all)", ge=0)
    distractor_files: int | None = option(None, doc="extra implemented modules the task does not touch", ge=0, le=6)
    failing_visible_test: bool | None = option(None, doc="add an implemented function with a bug to fix")
    hidden_tests_per_function: int | None = option(None, doc="graded cases per function", ge=1, le=16)
    namings: tuple[int, ...] | None = option(None, doc="naming variants tasks draw (0, 1, 2)")
    docstring: str | None = option(None, doc="words or code", choices=("words", "code", None))
    heldout_fraction: float | None = option(None, doc="share of templates held out", ge=0.0, lt=1.0)
    validation_fraction: float | None = option(None, doc="share of templates carved out of train", ge=0.0, lt=1.0)
    heldout_by: str | None = option(None, doc="template or surface", choices=("template", "surface", None))

    def overrides(self) -> dict[str, Any]:
        """The knobs this variant sets."""
        return {k: getattr(self, k) for k in VARIANT_KNOBS if getattr(self, k) is not None}


@dataclass(frozen=True)
class CodingConfig:
    """`task = "coding"`: the tool loop over a union of task sources, and the knobs of generated micro-repositories."""

    sources: tuple[str, ...] = option(
        ("micro",),
        doc="task sources: micro (generated micro-repositories), repos (feature deletion on "
        "env.feature_deletion.repos), swe (env.swe instances)",
    )
    functions_per_task: int = option(1, doc="micro: functions to implement per task", ge=1, le=8)
    statements_per_body: int = option(
        1, doc="micro: operations chained in one function body, one statement each (the last is the return)",
        ge=1, le=6,
    )
    kinds: tuple[str, ...] = option(
        ("arithmetic",), doc="micro: operation kinds: arithmetic, strings, lists, dicts, control"
    )
    ops_per_kind: int = option(3, doc="micro: the first N operations of each kind (0 = all)", ge=0)
    distractor_files: int = option(0, doc="micro: extra implemented modules the task does not touch", ge=0, le=6)
    failing_visible_test: bool = option(
        False, doc="micro: add an implemented function with a bug; its visible test fails until it is fixed"
    )
    hidden_tests_per_function: int = option(
        4, doc="micro: graded cases per function (reward = share of hidden tests passed)", ge=1, le=16
    )
    namings: tuple[int, ...] = option(
        (0, 1, 2), doc="micro: naming variants tasks draw (each a set of parameter names: 0, 1, 2)"
    )
    package: str = option("", doc="micro: put the module in this package ('' = at the repository root)")
    docstring: str = option(
        "words", doc="micro: docstrings name each operation in words, or state its Python expression (code)",
        choices=("words", "code"),
    )
    show_source: bool = option(True, doc="micro: put the target file's text in the prompt (else the agent reads it)")
    heldout_fraction: float = option(
        0.2, doc="micro: share of task templates (by a hash of the template id) kept for evaluation", ge=0.0, lt=1.0
    )
    validation_fraction: float = option(
        0.0, doc="micro: share of templates (next in the same hash) carved out of train for choosing settings "
        "([trainer] eval_split)", ge=0.0, lt=1.0,
    )
    heldout_by: str = option(
        "template", doc="micro: what the held-out hash keys on: the whole template (ops x phrasing x naming: unseen "
        "combinations) or its surface (phrasing x naming for every op: unseen surfaces, no surface predicting the op)",
        choices=("template", "surface"),
    )
    warm_start_kinds: tuple[str, ...] = option(
        (), doc="micro: the tool-loop warm start's prompts draw every operation of these kinds (train templates "
        "only: the held-out templates stay unseen); empty = the task's own operations"
    )
    partial_credit: bool = option(
        True, doc="micro: reward = the share of hidden tests passed; false = 1 only when every hidden test passes "
        "(as SWE instances are graded)"
    )
    variants: tuple[MicroVariant, ...] = option(
        (), doc="named micro task sources ([[env.coding.variants]] tables: name, shape (micro or swe), and any of "
        f"{', '.join(VARIANT_KNOBS)} overriding this section's value); sources and warm_start_sources name them"
    )
    warm_start_sources: tuple[str, ...] = option(
        (), doc="the sources the tool-loop warm start's prompts come from (train split; micro widened by "
        "warm_start_kinds); empty = sources. Two recipes that set the same warm-start keys share one base"
    )

    def __post_init__(self) -> None:
        _check_train_left("env.coding", self.heldout_fraction, self.validation_fraction)
        names = [v.name for v in self.variants]
        for i, variant in enumerate(self.variants):
            key = f"env.coding.variants[{i}]"
            if not variant.name or variant.name in CODING_SOURCES or variant.name in names[:i]:
                raise ValueError(f"{key}.name = {variant.name!r}: a variant needs a name of its own (unique, none of "
                                 f"{', '.join(CODING_SOURCES)})")
            fractions = {"heldout_fraction": self.heldout_fraction, "validation_fraction": self.validation_fraction,
                         **variant.overrides()}
            _check_train_left(key, fractions["heldout_fraction"], fractions["validation_fraction"])

    def variant(self, name: str) -> CodingConfig:
        """The micro knobs of source `name`: this section's own ("micro"), or a variant's overrides of them (its
        own variants and warm-start keys dropped, so a config is one source's)."""
        if name == "micro":
            return dataclasses.replace(self, variants=(), warm_start_sources=())
        found = next((v for v in self.variants if v.name == name), None)
        if found is None:
            raise ValueError(f"env.coding: no source {name!r}")
        return dataclasses.replace(self, variants=(), warm_start_sources=(), **found.overrides())

    def shape_of(self, name: str) -> str:
        """"micro" or "swe": how source `name`'s tasks are rendered ("micro" for this section's own)."""
        return next((v.shape for v in self.variants if v.name == name), "micro")


# the formats of a warm-start note (the hint channel's: replay.hints reference_note, change_note, cases_note)
NOTE_FORMATS = ("reference", "change", "cases")


@dataclass(frozen=True)
class ToolLoopConfig:
    """The multi-turn tool loop over a task workspace."""

    max_turns: int = option(12, doc="assistant messages per episode before it is graded as is", ge=1)
    tool_output_chars: int = option(2000, doc="characters of a tool result shown to the model", ge=64)
    check_edits: Literal["off", "report", "revert"] = option(
        "off", choices=("off", "report", "revert"),
        doc="after each applied edit_file/write_file, run the task's visible tests (tasks that have them: micro): "
        "'report' ends the result with 'visible tests: passed' or 'failed'; 'revert' also undoes an edit they fail "
        "('failed; edit undone': each attempt starts from the same file); a failure is a test_failure error site",
    )
    shell_commands: tuple[str, ...] = option(
        ("ls", "cat", "head", "tail", "grep", "wc", "find", "diff", "echo", "python"),
        doc="programs the restricted shell tool may run (no pipes, redirection or chaining)",
    )
    tools: tuple[str, ...] = option(
        ("read_file", "write_file", "edit_file", "list_dir", "run_tests", "shell"),
        doc="tools offered (their JSON is in the system prompt: fewer tools, shorter prompts)",
    )
    warm_start_steps: int = option(
        0,
        doc="train: start RL from a base model made by this many SFT steps on tool-call format examples "
        "(well-formed calls whose code is independent of the task, envs.tool_format); 0 = the raw weights",
        ge=0,
    )
    warm_start_examples: int = option(256, doc="format-only conversations the warm start draws from", ge=1)
    warm_start_batch_size: int = option(16, doc="conversations per warm-start SFT step", ge=1)
    warm_start_seed: int = option(
        0, doc="seed of the warm start's examples and SFT: one base model for every job seed (seeds vary RL only)",
        ge=0,
    )
    step_workers: int = option(
        1, doc="episodes a generator steps at once after each turn (their sandboxed tool runs and grades overlap)",
        ge=1, le=64,
    )
    warm_start_lr: float = option(3e-3, doc="AdamW learning rate of the warm start", gt=0.0)
    warm_start_decay: bool = option(
        False, doc="decay the warm start's learning rate linearly to 0 over its steps (else constant)"
    )
    warm_start_grad_clip: float = option(
        0.0, doc="clip the warm start's gradient norm to this before each step (0 = off); without it a "
        "different set of examples can diverge at a high rate (docs/coding.md)", ge=0.0,
    )
    warm_start_note_share: float = option(
        0.0, doc="share of the warm start's conversations that hold a privileged note where the hint channel puts "
        "hints (a user message after the prompt) and whose edits write what the note shows (random code, never a "
        "solution); 0 = none, the examples as before", ge=0.0, le=1.0,
    )
    warm_start_note_formats: tuple[str, ...] = option(
        NOTE_FORMATS, doc="the hint formats those notes take, one drawn per note: reference (the files, "
        "replay.hints.reference_note), change (the written lines, or their first k: change_note), cases "
        "(assert lines of the note's code: cases_note)",
    )
    max_calls_per_message: int = option(
        16, doc="tool calls run per assistant message; each call past them gets a bad_tool_call error saying so "
        "and is not run (counted in the episode's calls_refused)", ge=1,
    )
    max_edits_per_episode: int = option(
        64, doc="edit_file/write_file calls applied per episode; each edit past them gets a bad_tool_call error "
        "saying so and is not run (counted in the episode's calls_refused)", ge=1,
    )
    max_added_files: int = option(
        5000, doc="files and directories an episode may add to its workspace (its program's included); past it the "
        "workspace is not graded: reward 0, violation large_tree (what a grade reads grows with the tree)", ge=0,
    )
    max_added_mb: int = option(
        64, doc="MiB of files an episode may add to its workspace; past it, as for max_added_files", ge=0,
    )
    grading_budget: float = option(
        4.0, doc="an episode's grading time (check_edits runs and the final grade) in multiples of [env.sandbox] "
        "wall_timeout_s: a check starts only while the time left covers it and the final grade (up to "
        "wall_timeout_s each); an edit it would have to check is refused, not run (the final grade always runs)",
        ge=1.0,
    )

    def __post_init__(self) -> None:
        unknown = [f for f in self.warm_start_note_formats if f not in NOTE_FORMATS]
        if unknown or not self.warm_start_note_formats:
            raise ValueError(f"env.tool_loop.warm_start_note_formats: {unknown or 'empty'}; formats: "
                             f"{', '.join(NOTE_FORMATS)}")


@dataclass(frozen=True)
class DatasetTaskConfig:
    """Single-turn task from a prompt file and reward functions with TRL GRPOTrainer's signature."""

    train_file: str = option("", doc="prompt rows: a local .jsonl/.json (standard library) or .parquet/.csv (HF `datasets`) file")
    heldout_file: str = option("", doc="held-out rows from their own file ('' = split off heldout_fraction)")
    heldout_fraction: float = option(
        0.0, doc="share of train_file rows held out (the last rows after the seeded shuffle)", ge=0.0, lt=1.0
    )
    prompt_column: str = option(
        "prompt", doc="column with the prompt: a string (standard format) or a list of chat messages"
    )
    order: str = option(
        "sequential", doc="row order: file order, or a fresh seeded permutation per epoch",
        choices=("sequential", "shuffle"),
    )
    shuffle_seed: int = option(0, doc="seed of the shuffle (and of the held-out fraction's split)", ge=0)
    rewards: tuple[str, ...] = option(
        (), doc="reward functions 'package.module:function', called as reward(completions, prompts=..., **columns)"
    )
    reward_weights: tuple[float, ...] = option((), doc="one weight per reward function (empty = all 1.0)")
    system_prompt: str = option("", doc="system message put before string prompts ('' = none)")


@dataclass(frozen=True)
class PluginConfig:
    """A user's environment: `entry_point(split=..., **kwargs)` returns an `envs.base.Environment`."""

    entry_point: str = option("", doc="'package.module:make_env', importable in every actor process")
    kwargs: dict[str, Any] = option(default_factory=dict, doc="keyword arguments passed to the entry point")


@dataclass(frozen=True)
class SweConfig:
    """SWE-style instances (R2E-Gym / SWE-Gym rows in a local JSONL), graded in their own container image."""

    instances: str = option("", doc="path of the local JSONL of instances (SWE-Gym or R2E-Gym row shape)")
    repos_dir: str = option(
        "", doc="directory holding one repository per row's `repo` ('owner/name' as owner__name, name or owner/name)"
    )
    runtime: Literal["podman", "docker", "apptainer", "local"] = option(
        "podman",
        doc="where instances run: a container runtime, or 'local' (the bubblewrap sandbox and this interpreter)",
        choices=("podman", "docker", "apptainer", "local"),
    )
    image: str = option("", doc="image for rows that name none (podman/docker tag, or an apptainer .sif path)")
    oci_runtime: str = option(
        "", doc="podman --runtime (e.g. 'runc'; '' = podman's default, falling back to runc where that fails)"
    )
    python: str = option("python3", doc="interpreter inside the image that runs pytest")
    plugin_autoload: bool = option(
        False, doc="let pytest load every installed plugin (tests that need one); off saves seconds per grade"
    )
    max_instances: int = option(0, doc="instances to load from the file, in file order (0 = all)", ge=0)
    heldout_fraction: float = option(
        0.25, doc="share of instances (by a hash of the instance id) kept for evaluation", ge=0.0, lt=1.0
    )
    test_timeout_s: float = option(300.0, doc="wall-clock limit of one container run (the grade's test run)", gt=0.0)
    memory_mb: int = option(2048, doc="container memory limit, MiB (swap included)", ge=64)
    cpu_cores: float = option(1.0, doc="container CPU quota, in cores", gt=0.0)
    max_processes: int = option(256, doc="container pids limit", ge=8)
    tmpfs_mb: int = option(256, doc="size cap of the container's writable /tmp, MiB", ge=1)
    uid: int = option(150_000, doc="unprivileged uid:gid the container runs as (owns the workspace)", ge=1000)


@dataclass(frozen=True)
class EnvConfig:
    """Which task generators drive, and how its code runs."""

    task: Literal["demo", "feature_deletion", "tool_loop", "coding", "dataset", "plugin"] = option(
        "demo", doc="environment for rollouts",
        choices=("demo", "feature_deletion", "tool_loop", "coding", "dataset", "plugin"),
    )
    sandbox: SandboxConfig = option(default_factory=SandboxConfig, doc="sandbox limits")
    demo: DemoTaskConfig = option(default_factory=DemoTaskConfig, doc="the CPU demo task")
    feature_deletion: FeatureDeletionConfig = option(
        default_factory=FeatureDeletionConfig, doc="feature-deletion task generation"
    )
    coding: CodingConfig = option(default_factory=CodingConfig, doc="coding task sources and micro-repository knobs")
    tool_loop: ToolLoopConfig = option(default_factory=ToolLoopConfig, doc="the multi-turn tool loop")
    dataset: DatasetTaskConfig = option(default_factory=DatasetTaskConfig, doc="prompt dataset + reward functions")
    plugin: PluginConfig = option(default_factory=PluginConfig, doc="a user's environment factory")
    swe: SweConfig = option(default_factory=SweConfig, doc="SWE-style instances and their container runtime")

    def __post_init__(self) -> None:
        # only micro tasks have visible tests to check an edit against; elsewhere the key would do nothing
        checked = self.task == "coding" and any(self.coding.shape_of(s) == "micro" and s not in ("repos", "swe")
                                                 for s in self.coding.sources)
        if self.tool_loop.check_edits != "off" and not checked:
            raise ValueError(
                f"env.tool_loop.check_edits = {self.tool_loop.check_edits!r} needs tasks with visible tests: "
                f"[env] task = \"coding\" with \"micro\" (or a micro variant) in env.coding.sources "
                f"(task is {self.task!r})"
            )
