"""Single-turn tasks without code: a prompt dataset scored by TRL-style reward functions.

Rows come from a local file read with HF `datasets` (.jsonl/.json, .parquet,
.csv); the prompt column is a string (TRL's *standard* format: the model sees
it as one user message, after `system_prompt` if set) or a list of chat
messages (*conversational*). Reward functions have TRL GRPOTrainer's
signature and, as TRL calls them, each is called once per generate call over
all the completions it sampled (`DatasetEnv.step_many`, which the episode
loop uses for a batch of these environments):

    reward(completions=[c, ...], prompts=[p, ...], **{column: [value, ...] for the rows' other columns})
        -> [float | None, ...]

with `c` a string (standard) or `[{"role": "assistant", "content": ...}]`
(conversational); a single `step` calls them with lists of one. Rewards combine as in TRL: the weighted sum of the
functions' values, a None skipped (all None: 0). TRL's `completion_ids` and
`trainer_state` are not passed; a function that requires them is refused at
load (docs/tasks.md).

Order: request seed `s` (the controller's `job.seed * 1_000_003 + i` for the
i-th prompt group: `i` itself when `job.seed = 0`) is position `s` in an
endless stream of epochs over the train rows: `sequential` keeps file order,
`shuffle` uses a fresh permutation per epoch from (`shuffle_seed`, epoch).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from composer_mesh.configs.sections.env import DatasetTaskConfig
from composer_mesh.envs.base import Environment, EnvironmentFault, Observation
from composer_mesh.envs.demo import Split
from composer_mesh.envs.plugin import check_call, load_callable

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(path: str, key: str, prompt_column: str) -> list[dict[str, Any]]:
    """Every row of `path` as a dict (all columns kept); errors name `key`, the file and the column."""
    file = Path(path)
    if not path or not file.is_file():
        raise FileNotFoundError(f"{key} = {path!r}: no such file")
    builder = _BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise ValueError(f"{key} = {path!r}: unknown format {file.suffix!r}; use one of {sorted(_BUILDERS)}")
    try:
        rows = _json_rows(file) if builder == "json" else _table_rows(builder, file)
    except Exception as e:  # datasets wraps parse errors in several types
        raise ValueError(f"{key} = {path!r}: cannot read it as {builder}: {str(e).splitlines()[0][:200]}") from None
    if not rows:
        raise ValueError(f"{key} = {path!r}: no rows")
    # every row has every column (both readers fill them)
    if prompt_column not in rows[0]:
        raise ValueError(f"{path}: no column {prompt_column!r} (env.dataset.prompt_column); columns: {list(rows[0])}")
    for line, row in enumerate(rows, 1):
        prompt = row[prompt_column]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
            raise ValueError(f"{path}: row {line}: {prompt_column!r} is neither a string nor a list of messages")
    return rows


def _json_rows(file: Path) -> list[dict[str, Any]]:
    """A .json/.jsonl file's rows, read with the standard library (HF datasets' import alone is ≈ 1 s on the
    run's critical path): a JSON array of objects, or one object per line (equal to datasets' rows where it reads
    the file); every row gets every column, None where it lacks one (which datasets refuses)."""
    text = file.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
        objects = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        objects = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    objects.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {number}: {e}") from None
    for number, row in enumerate(objects, 1):
        if not isinstance(row, dict):
            raise ValueError(f"row {number} is a {type(row).__name__}, not an object")
    columns = dict.fromkeys(k for row in objects for k in row)
    return [{k: row.get(k) for k in columns} for row in objects]


def _table_rows(builder: str, file: Path) -> list[dict[str, Any]]:
    """A .parquet/.csv file's rows, through HF datasets."""
    # lazy: HF datasets is heavy and only parquet and csv files need it
    import datasets

    return datasets.load_dataset(builder, data_files=str(file), split="train").to_list()


class RewardContractError(EnvironmentFault, ValueError):
    """A reward function returned what TRL's contract does not allow (a wrong length, not a float or None)."""


@dataclass(frozen=True)
class RewardFn:
    """One loaded reward function and its weight; `accepts_all` when it takes **kwargs."""

    spec: str
    fn: Callable[..., Any]
    weight: float
    params: frozenset[str]
    accepts_all: bool

    def __call__(self, prompts: list[Any], completions: list[Any],
                 columns: dict[str, list[Any]]) -> list[float | None]:
        """One value per completion; `columns` holds one list per column, aligned with `completions`. A function
        that raises or breaks TRL's contract is an `EnvironmentFault`: the user's code, which the run stops on
        (as TRL does), not an episode's zero."""
        kwargs = {"prompts": prompts, "completions": completions, **columns}
        if not self.accepts_all:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        try:
            out = self.fn(**kwargs)
        except Exception as e:
            raise EnvironmentFault(f"reward function {self.spec!r} raised {type(e).__name__}: {e}") from e
        n = len(completions)
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, (list, tuple)) else type(out).__name__
            raise RewardContractError(
                f"reward function {self.spec!r} returned {got}; expected a list with one reward per completion ({n})"
            )
        return [self._value(v) for v in out]

    def _value(self, value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
            raise RewardContractError(f"reward function {self.spec!r} returned {value!r}; expected a float or None")
        return float(value)


def load_rewards(config: DatasetTaskConfig, columns: list[str]) -> list[RewardFn]:
    """The configured reward functions, each checked to accept TRL's call with `columns`."""
    if not config.rewards:
        raise ValueError("env.task = 'dataset' needs env.dataset.rewards (one or more 'package.module:function')")
    weights = config.reward_weights or (1.0,) * len(config.rewards)
    if len(weights) != len(config.rewards):
        raise ValueError(
            f"env.dataset.reward_weights has {len(weights)} values for {len(config.rewards)} env.dataset.rewards"
        )
    out = []
    for i, (spec, weight) in enumerate(zip(config.rewards, weights)):
        key = f"env.dataset.rewards[{i}]"
        fn = load_callable(spec, key)
        supplied = ["prompts", "completions", *columns]
        params = inspect.signature(fn).parameters
        accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        check_call(fn, spec, key, 0, supplied if accepts_all else [k for k in supplied if k in params])
        if "completions" not in params and not accepts_all:
            raise ValueError(f"{key} = {spec!r}: takes no 'completions' argument (TRL's reward signature)")
        out.append(RewardFn(spec, fn, float(weight), frozenset(params), accepts_all))
    return out


def combine(values: list[float | None], weights: list[float]) -> float:
    """TRL's combination: sum of weight * value over the functions that did not return None."""
    return sum(w * v for v, w in zip(values, weights) if v is not None)


@dataclass(frozen=True)
class DatasetTask:
    """Rows of both splits and the reward functions, loaded once per process."""

    config: DatasetTaskConfig
    rows: dict[str, list[dict[str, Any]]]
    rewards: list[RewardFn]

    def row(self, split: Split, position: int) -> dict[str, Any]:
        """Row at `position` of the endless stream over `split` (see the module docstring)."""
        rows = self.rows[split]
        epoch, k = divmod(position, len(rows))
        if self.config.order == "sequential":
            return rows[k]
        return rows[_permutation(len(rows), self.config.shuffle_seed, epoch)[k]]


@lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"dataset:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def load_task(config: DatasetTaskConfig) -> DatasetTask:
    """Read the files, split off the held-out rows and load the reward functions."""
    rows = load_rows(config.train_file, "env.dataset.train_file", config.prompt_column)
    if config.heldout_file:
        heldout = load_rows(config.heldout_file, "env.dataset.heldout_file", config.prompt_column)
    else:
        n_heldout = int(round(len(rows) * config.heldout_fraction))
        if n_heldout >= len(rows):
            raise ValueError(
                f"env.dataset.heldout_fraction = {config.heldout_fraction} leaves no train row of {len(rows)}"
            )
        picked = set(_permutation(len(rows), config.shuffle_seed, -1)[len(rows) - n_heldout:])
        heldout = [r for i, r in enumerate(rows) if i in picked] or rows
        rows = [r for i, r in enumerate(rows) if i not in picked]
    columns = sorted({c for r in rows for c in r} - {config.prompt_column})
    return DatasetTask(config, {"train": rows, "heldout": heldout}, load_rewards(config, columns))


class DatasetEnv(Environment):
    """One prompt, one answer: the reward is the weighted sum of the reward functions."""

    def __init__(self, task: DatasetTask, split: Split = "train") -> None:
        super().__init__()
        self.task, self.split = task, split
        self.row: dict[str, Any] = {}
        # reward values computed for this episode's action by `step_many`, consumed by `_answer`
        self._values: list[float | None] | None = None

    def _start(self, seed: int | None) -> Observation:
        self.row = self.task.row(self.split, seed if seed is not None else random.randrange(2**31))
        prompt = self.row[self.task.config.prompt_column]
        if isinstance(prompt, str):
            system = self.task.config.system_prompt
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
        else:
            messages = [dict(m) for m in prompt]
        return Observation(messages, info={"prompt": prompt})

    @classmethod
    def step_many(cls, envs: Sequence[Environment], actions: Sequence[dict[str, Any]]) -> list[Observation] | None:
        """Step `envs` (one task) with each reward function called once over all their completions, as TRL calls
        it per generate batch (a function normalising over its batch sees the whole batch); None (step each
        on its own, which raises the usual errors) for a mix of tasks, an ended episode or a non-assistant action."""
        if not envs or any(not isinstance(e, cls) or e.task is not envs[0].task or e.state.done for e in envs):
            return None
        if any(not isinstance(a, dict) or a.get("role") != "assistant" for a in actions):
            return None
        task = envs[0].task
        column = task.config.prompt_column
        rows = [e.row for e in envs]  # type: ignore[attr-defined]
        names = list(dict.fromkeys(k for r in rows for k in r if k != column))
        columns = {k: [r.get(k) for r in rows] for k in names}
        prompts = [r[column] for r in rows]
        completions = [_completion(p, a) for p, a in zip(prompts, actions)]
        values_RN = [reward(prompts, completions, columns) for reward in task.rewards]
        for i, env in enumerate(envs):
            env._values = [values_N[i] for values_N in values_RN]  # type: ignore[attr-defined]
        return [env.step(action) for env, action in zip(envs, actions)]

    def _answer(self, action: dict[str, Any], turn: int) -> Observation:
        values, self._values = self._values, None
        if values is None:
            prompt = self.row[self.task.config.prompt_column]
            columns = {k: [v] for k, v in self.row.items() if k != self.task.config.prompt_column}
            values = [r([prompt], [_completion(prompt, action)], columns)[0] for r in self.task.rewards]
        reward = combine(values, [r.weight for r in self.task.rewards])
        return Observation([], reward=reward, done=True, info={"rewards": values})


def _completion(prompt: Any, action: dict[str, Any]) -> Any:
    """The completion as TRL passes it: a string for a string prompt, else one assistant message in a list."""
    text = str(action.get("content") or "")
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
