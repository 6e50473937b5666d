"""`[env] task = "dataset"` and `"plugin"` without a mesh: TRL reward conventions, order, splits and errors.

Reward functions are written here to TRL GRPOTrainer's documented signature
(`reward(completions, prompts=..., **columns) -> list[float | None]`, standard
format = strings, conversational = message lists; None skipped in the weighted
sum). Files are made in the formats `datasets` reads (JSONL, Parquet).
"""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from composer_mesh.configs.sections.env import DatasetTaskConfig, EnvConfig, PluginConfig
from composer_mesh.envs.base import assistant
from composer_mesh.envs.dataset import DatasetEnv, combine, load_task
from composer_mesh.envs.factory import check_task, env_factory

USER_MODULE = '''
def exact(completions, prompts, answer, **kwargs):
    return [1.0 if a in (c if isinstance(c, str) else c[0]["content"]) else 0.0 for c, a in zip(completions, answer)]

def maybe(completions, **kwargs):
    return [None if "skip" in str(c) else 0.25 for c in completions]

def seen(completions, prompts, **kwargs):
    seen.calls.append((prompts, completions, kwargs))
    return [0.0] * len(completions)
seen.calls = []

def two(completions, **kwargs):
    return [0.0, 1.0]

def as_str(completions, **kwargs):
    return ["1.0"]

def as_bool(completions, **kwargs):
    return [True]

def as_nan(completions, **kwargs):
    return [float("nan")]

def scalar(completions, **kwargs):
    return 1.0

def needs_ids(completions, completion_ids):
    return [0.0]

def no_completions(prompts):
    return [0.0]

def raises(completions, **kwargs):
    raise KeyError("boom")

def normalised(completions, answer, **kwargs):
    """Batch-normalising, as GRPO-style rewards often are: (length - batch mean) / batch std."""
    normalised.batches.append(list(answer))
    n = [float(len(c)) for c in completions]
    mean = sum(n) / len(n)
    sd = (sum((x - mean) ** 2 for x in n) / len(n)) ** 0.5 or 1.0
    return [(x - mean) / sd for x in n]
normalised.batches = []

NOT_CALLABLE = 3

def make_env(split, target=0):
    from composer_mesh.envs.demo import DemoEnv
    return DemoEnv(split=split)

def make_wrong(split):
    return "not an env"
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A user module on sys.path, and JSONL / Parquet prompt files with extra columns."""
    root = tmp_path_factory.mktemp("dataset_task")
    (root / "task_user_mod.py").write_text(USER_MODULE)
    sys.path.insert(0, str(root))
    rows = [{"prompt": f"p{i}", "answer": f"a{i}", "level": i} for i in range(10)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": f"x{i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(chat), root / "chat.parquet")
    (root / "bad.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    (root / "noprompt.jsonl").write_text('{"question": "q"}\n')
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("task_user_mod", None)


def cfg(files, **kw) -> DatasetTaskConfig:
    kw.setdefault("train_file", str(files / "train.jsonl"))
    kw.setdefault("rewards", ("task_user_mod:exact",))
    return DatasetTaskConfig(**kw)


def episode(task, split, seed, reply):
    env = DatasetEnv(task, split)
    obs = env.reset(seed=seed)
    return obs, env.step(assistant(reply))


def test_standard_format_rewards_and_columns(files):
    task = load_task(cfg(files, rewards=("task_user_mod:exact", "task_user_mod:maybe", "task_user_mod:seen"),
                         reward_weights=(2.0, 0.5, 1.0), system_prompt="Be brief."))
    obs, out = episode(task, "train", 3, "say a3")
    assert obs.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "p3"}]
    assert out.done and out.reward == pytest.approx(2.0 * 1.0 + 0.5 * 0.25)
    prompts, completions, kwargs = sys.modules["task_user_mod"].seen.calls[-1]
    assert prompts == ["p3"] and completions == ["say a3"] and kwargs == {"answer": ["a3"], "level": [3]}
    _, skipped = episode(task, "train", 4, "skip")  # maybe() -> None: left out of the sum, as TRL's nansum
    assert skipped.reward == pytest.approx(0.0) and skipped.info["rewards"][1] is None


def test_conversational_format(files):
    task = load_task(cfg(files, train_file=str(files / "chat.parquet")))
    obs, out = episode(task, "train", 1, "x1")
    assert obs.messages == [{"role": "user", "content": "q1"}]
    assert out.reward == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_matches_trl_nansum(seed):
    rng = random.Random(seed)
    for _ in range(50):
        k = rng.randint(1, 4)
        values = [None if rng.random() < 0.3 else rng.uniform(-2, 2) for _ in range(k)]
        weights = [rng.uniform(0, 3) for _ in range(k)]
        # TRL: rewards_per_func with NaN for None, (rewards * weights).nansum(dim=1)
        ref = math.fsum(w * v for v, w in zip([math.nan if v is None else v for v in values], weights) if not math.isnan(v))
        assert combine(values, weights) == pytest.approx(ref, abs=1e-12)


def test_step_many_calls_each_reward_once_over_the_batch(files):
    """TRL calls a reward function once per generate call over all its completions: a batch-normalising
    function sees the whole batch (here 4 episodes of 3 rows), not batches of one."""
    task = load_task(cfg(files, rewards=("task_user_mod:normalised", "task_user_mod:seen")))
    mod = sys.modules["task_user_mod"]
    mod.normalised.batches.clear()
    envs = [DatasetEnv(task, "train") for _ in range(4)]
    for env, seed in zip(envs, (0, 0, 1, 2)):
        env.reset(seed=seed)
    replies = ["a", "abcd", "ab", "abcdefg"]
    out = DatasetEnv.step_many(envs, [assistant(r) for r in replies])
    assert mod.normalised.batches == [["a0", "a0", "a1", "a2"]]  # one call, every completion, in order
    prompts, completions, kwargs = mod.seen.calls[-1]
    assert prompts == ["p0", "p0", "p1", "p2"] and completions == replies
    assert kwargs == {"answer": ["a0", "a0", "a1", "a2"], "level": [0, 0, 1, 2]}
    n = [1.0, 4.0, 2.0, 7.0]
    mean, sd = sum(n) / 4, (sum((x - 3.5) ** 2 for x in n) / 4) ** 0.5
    assert [o.reward for o in out] == pytest.approx([(x - mean) / sd for x in n])
    assert all(o.done for o in out) and [e.state.reward for e in envs] == [o.reward for o in out]
    # a batch's wrong-length return names the batch size
    two = load_task(cfg(files, rewards=("task_user_mod:two",)))
    bad = [DatasetEnv(two, "train") for _ in range(3)]
    for env in bad:
        env.reset(seed=0)
    with pytest.raises(ValueError, match=r"returned list of length 2; expected .* per completion \(3\)"):
        DatasetEnv.step_many(bad, [assistant("x")] * 3)


def test_episode_runner_scores_a_generate_call_in_one_reward_call(files, tiny_assets):
    """Through the production episode loop with the HF engine: 2 prompts x G 3 sampled in one generate call
    are scored by one call of the batch-normalising function, and its values are the episodes' rewards."""
    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import EpisodeRunner
    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams

    task = load_task(cfg(files, rewards=("task_user_mod:normalised",)))
    mod = sys.modules["task_user_mod"]
    mod.normalised.batches.clear()
    tok = AutoTokenizer.from_pretrained(str(tiny_assets.dense_dir))
    runner = EpisodeRunner(HFEngine(tiny_assets.dense_dir, [tok.eos_token_id]), tok,
                           lambda split: DatasetEnv(task, split), max_turns=1, max_context_tokens=200)
    groups = runner.run([EpisodeRequest(0, 4), EpisodeRequest(1, 7)], 3, SamplingParams(max_new_tokens=6, seed=3), 0)
    assert mod.normalised.batches == [["a4"] * 3 + ["a7"] * 3]
    rewards = [r.reward for g in groups for r in g.rollouts]
    assert sum(rewards) == pytest.approx(0.0, abs=1e-9)  # normalised over all 6, not each alone (all 0)


def test_order_sequential_and_shuffle(files):
    seq = load_task(cfg(files))
    assert [seq.row("train", s)["level"] for s in range(23)] == [s % 10 for s in range(23)]
    shuf = load_task(cfg(files, order="shuffle", shuffle_seed=5))
    epochs = [[shuf.row("train", e * 10 + k)["level"] for k in range(10)] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch visits every row once
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))
    again = load_task(cfg(files, order="shuffle", shuffle_seed=5))
    assert [again.row("train", s)["level"] for s in range(10)] == epochs[0]
    other = load_task(cfg(files, order="shuffle", shuffle_seed=6))
    assert [other.row("train", s)["level"] for s in range(10)] != epochs[0]


def test_heldout_by_fraction_and_by_file(files):
    task = load_task(cfg(files, heldout_fraction=0.3, shuffle_seed=1))
    train = [r["level"] for r in task.rows["train"]]
    held = [r["level"] for r in task.rows["heldout"]]
    assert len(held) == 3 and not set(train) & set(held) and sorted(train + held) == list(range(10))
    assert train == sorted(train)  # train rows keep file order
    by_file = load_task(cfg(files, heldout_file=str(files / "chat.parquet")))
    assert len(by_file.rows["train"]) == 10 and len(by_file.rows["heldout"]) == 3


@pytest.mark.parametrize(("kw", "match"), [
    ({"train_file": "/nonexistent.jsonl"}, "env.dataset.train_file = '/nonexistent.jsonl': no such file"),
    ({"train_file": "BAD"}, "env.dataset.train_file.*cannot read it as json"),
    ({"train_file": "NOPROMPT"}, "noprompt.jsonl: no column 'prompt'"),
    ({"train_file": "TXT"}, "unknown format '.txt'"),
    ({"rewards": ()}, "needs env.dataset.rewards"),
    ({"rewards": ("no_such_pkg.mod:fn",)}, r"rewards\[0\] = 'no_such_pkg.mod:fn': module 'no_such_pkg' not found"),
    ({"rewards": ("task_user_mod",)}, "expected 'package.module:function'"),
    ({"rewards": ("task_user_mod:missing",)}, "has no attribute 'missing'"),
    ({"rewards": ("task_user_mod:NOT_CALLABLE",)}, "is a int, not a function"),
    ({"rewards": ("task_user_mod:needs_ids",)}, r"rewards\[0\].*cannot be called as needs_ids"),
    ({"rewards": ("task_user_mod:no_completions",)}, "takes no 'completions' argument"),
    ({"rewards": ("task_user_mod:exact", "task_user_mod:maybe"), "reward_weights": (1.0,)}, "1 values for 2"),
    ({"heldout_fraction": 0.99}, "leaves no train row"),
])
def test_load_errors_name_the_key(files, kw, match):
    names = {"BAD": "bad.jsonl", "NOPROMPT": "noprompt.jsonl", "TXT": "train.txt"}
    if kw.get("train_file") in names:
        (files / "train.txt").write_text("x")
        kw = dict(kw, train_file=str(files / names[kw["train_file"]]))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        check_task(EnvConfig(task="dataset", dataset=cfg(files, **kw)))


@pytest.mark.parametrize(("fn", "match"), [
    ("two", "returned list of length 2; expected a list with one reward"),
    ("scalar", "returned float; expected a list"),
    ("as_str", "returned '1.0'; expected a float or None"),
    ("as_bool", "returned True"),
    ("as_nan", "returned nan"),
    ("raises", "'task_user_mod:raises' raised KeyError"),
])
def test_bad_reward_returns_are_named(files, fn, match):
    task = load_task(cfg(files, rewards=(f"task_user_mod:{fn}",)))
    with pytest.raises((ValueError, RuntimeError), match=match):
        episode(task, "train", 0, "a0")


def test_plugin_entry_point(files):
    make = env_factory(EnvConfig(task="plugin", plugin=PluginConfig("task_user_mod:make_env", {"target": 1})))
    assert make("heldout").split == "heldout"
    with pytest.raises(ValueError, match="env.plugin.entry_point.*cannot be called as make_env"):
        env_factory(EnvConfig(task="plugin", plugin=PluginConfig("task_user_mod:make_env", {"nope": 1})))
    with pytest.raises(TypeError, match="returned str, not an envs.base.Environment"):
        check_task(EnvConfig(task="plugin", plugin=PluginConfig("task_user_mod:make_wrong")))
    with pytest.raises(ValueError, match="needs env.plugin.entry_point"):
        check_task(EnvConfig(task="plugin"))


def test_json_rows_are_what_hf_datasets_reads(tmp_path):
    """.json/.jsonl files are read with the standard library; the rows equal HF datasets' `to_list()` of the
    same file (JSON lines and a JSON array; strings, ints, floats, bools, chat message lists); a key missing
    from some rows is None there (datasets refuses such a file), and a bad line is named."""
    import datasets

    from composer_mesh.envs.dataset import load_rows

    # (quarters: datasets reads an array through pandas, which keeps 10 digits of a float)
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "level": i, "score": i / 4,
             "ok": i % 2 == 0} for i in range(7)]
    lines, array = tmp_path / "rows.jsonl", tmp_path / "rows.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array.write_text(json.dumps(rows, indent=1))
    for file in (lines, array):
        ours = load_rows(str(file), "env.dataset.train_file", "prompt")
        theirs = datasets.load_dataset("json", data_files=str(file), split="train").to_list()
        assert ours == theirs and len(ours) == 7, file.name
    ragged = tmp_path / "ragged.jsonl"
    ragged.write_text('{"prompt": "a", "extra": 1}\n{"prompt": "b"}\n')
    assert load_rows(str(ragged), "k", "prompt") == [{"prompt": "a", "extra": 1}, {"prompt": "b", "extra": None}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"cannot read it as json: line 3: "):
        load_rows(str(bad), "env.dataset.train_file", "prompt")
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match="row 2 is a list, not an object"):
        load_rows(str(tmp_path / "list.jsonl"), "env.dataset.train_file", "prompt")
