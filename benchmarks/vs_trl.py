"""composer-mesh vs TRL GRPOTrainer on the same checkpoint, prompts, reward and hyperparameters, at two lengths.

Each side runs as its own process (start to exit is the job wall), interleaved
TRL, ours, TRL, ours, ...: a 4-layer Qwen3 made with transformers (the
project's tiny ChatML tokenizer) and warm-started with a few seconds of SFT on
the answer *format* only (an answer of another problem, independent of the
prompt, like the demo's warm start), so rewards differ within a group from
step 1; conversational prompts `a+b` from one JSONL file in file order, one
reward function (TRL's signature, called by both sides once per generate call
over all its completions), G completions per prompt, DAPO token-mean loss,
clip 0.2, beta 0, T = 1, AdamW at a constant LR, fp32 on CPU. Repeat r uses
seed r on both sides. Ours runs grpo.toml's placement, the trainer and the
generator in processes of their own beside the controller's;
`--placement colocated` runs both actors in one process, as TRL generates
in its training process (figures of both: docs/tasks.md). Two workloads, each with its own warm-started model:

- short: the answer is the sum (2-3 tokens with the end token), reward 1 for
  the exact sum, 0.2 for any digits; 16 new tokens at most.
- long: the answer is the 136 digits of a, a+b, a+2b, ... mod 10 (one token
  each), reward the fraction of digits right at their position; 144 new
  tokens at most. Its warm start puts the loss on the digits only, not on an
  end token, so the model does not learn to stop: a completion runs to the
  144-token cap (truncated, as TRL's and ours treat any completion that hits
  the cap), which makes the long workload >= 128 new tokens per completion.

Held-out: 20 of the 100 `a+b` problems never appear in the training file;
the parent scores greedy completions of them (the same HF `generate` and
reward for both sides) with the warm-started model (before) and with each
run's final weights (after: TRL's saved model, composer-mesh's `hf/` export).

    python benchmarks/vs_trl.py --quick      # needs the bench extra: pip install '.[bench]'

Prints a table per workload and side (median s/step over steps 2.., p10-p90,
nominal generation throughput = prompts x G x max new tokens / median step,
an upper bound since EOS can end a completion early; mean completion length;
job wall; held-out gain per repeat; reward by step) and our step's breakdown
(trainer step, weight sync, the rest: generation, rewards, the controller),
and ends with one JSON line: step_time_ratio (ours / TRL), job_wall_ratio,
heldout_gain_delta (mean gain ours - TRL) and heldout_seed_noise (the
standard deviation of one side's gain over repeats, pooled over both sides;
null with one repeat) for the short workload, the same keys suffixed `_long`
for the long one. That both sides see the same prompt token ids is by
construction (both apply the tokenizer's chat template to the same messages)
and not asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REWARD = '''
def correct(completions, answer, **kwargs):
    """1 for the exact sum, 0.2 for any digits, else 0 (conversational completions)."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"].strip() if isinstance(c, list) else c.strip()
        out.append(1.0 if text == a else 0.2 if text[:1].isdigit() else 0.0)
    return out


def sequence(completions, answer, **kwargs):
    """Fraction of the answer's digits the completion has at the same position (conversational completions)."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"].strip() if isinstance(c, list) else c.strip()
        out.append(sum(x == y for x, y in zip(text, a)) / len(a))
    return out
'''


HELDOUT = [(a, b) for a in range(10) for b in range(10) if (7 * a + 3 * b) % 5 == 0]  # 20 problems never trained
LONG_DIGITS = 136


def progression(start: int, step: int) -> str:
    """The long answer: LONG_DIGITS digits (one token each) of start, start + step, ... mod 10."""
    return "".join(str((start + step * i) % 10) for i in range(LONG_DIGITS))


@dataclass(frozen=True)
class Workload:
    """One task of the head-to-head: prompts `a+b`, its answer, its reward and its warm-start format.

    short: the sum (2-3 tokens with the end token); long: the digits of a, a+b, a+2b, ... mod 10
    (LONG_DIGITS tokens, warm-started without an end token), so each completion is >= 128 new tokens.
    """

    name: str
    reward: str
    new_tokens: int
    max_seq_len: int
    # warm-start SFT steps x rows
    warm_steps: int
    warm_batch: int

    def answer(self, a: int, b: int) -> str:
        return str(a + b) if self.name == "short" else progression(a, b)

    def format_only(self, rng: random.Random) -> str:
        """A warm-start target in the answer's format, independent of the problem."""
        return str(rng.randint(0, 18)) if self.name == "short" else progression(rng.randint(0, 9), rng.randint(1, 9))


WORKLOADS = {"short": Workload("short", "correct", 16, 128, 150, 32),
             "long": Workload("long", "sequence", 144, 192, 40, 16)}


def make_task(root: Path, n_rows: int, work: Workload) -> None:
    """The warm-started checkpoint, the prompt file and the reward module of `work` under `root`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    import torch

    from composer_mesh.titan_ext.assets import build_assets, default_cache_dir

    tok = AutoTokenizer.from_pretrained(build_assets(default_cache_dir(), seed=0).tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=True,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    warm_start(model, tok, work)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    train_pairs = [(a, b) for a in range(10) for b in range(10) if (a, b) not in HELDOUT]
    with open(root / "train.jsonl", "w") as f:
        for _ in range(n_rows):
            a, b = rng.choice(train_pairs)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": work.answer(a, b)}) + "\n")
    (root / "bench_reward.py").write_text(REWARD)


def warm_start(model, tok, work: Workload) -> None:
    """SFT on the answer format only (`a+b` -> an answer of another problem), loss on the answer tokens."""
    import torch

    rng = random.Random(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    batch = work.warm_batch
    for _ in range(work.warm_steps):
        rows = []
        for _ in range(batch):
            prompt = [{"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"}]
            head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": work.format_only(rng)}],
                                           tokenize=True, return_dict=False)
            # long: the loss stops after the digits (no end token), so a sampled completion is not cut short
            end = len(full) if work.name == "short" else len(head) + LONG_DIGITS
            rows.append((list(full[:end]), len(head)))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (row, n_head) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, n_head : len(row)] = torch.tensor(row[n_head:])
            mask[i, : len(row)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def heldout_reward(model_dir: Path, root: Path, work: Workload) -> float:
    """Mean reward of greedy completions of the held-out problems (HF generate, left-padded batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(root))
    reward = getattr(importlib.import_module("bench_reward"), work.reward)

    tok = AutoTokenizer.from_pretrained(root / "model")
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}"}], add_generation_prompt=True,
                                       tokenize=False) for a, b in HELDOUT]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=work.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = reward(texts, [work.answer(a, b) for a, b in HELDOUT])
    return sum(scores) / len(scores)


def run_trl(root: Path, work: Workload, steps: int, prompts: int, group: int, lr: float, seed: int) -> dict:
    """TRL GRPOTrainer in this process (called in a child by `--side trl`)."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(root))
    reward = getattr(importlib.import_module("bench_reward"), work.reward)

    stamps: list[float] = []
    rewards: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs["completions/mean_length"]))

    args = GRPOConfig(
        output_dir=str(root / "trl_out"), report_to=[], use_cpu=True, bf16=False, max_steps=steps,
        per_device_train_batch_size=prompts * group, num_generations=group, max_completion_length=work.new_tokens,
        learning_rate=lr, lr_scheduler_type="constant", beta=0.0, epsilon=0.2, loss_type="dapo",
        temperature=1.0, shuffle_dataset=False, save_strategy="no", logging_steps=1, seed=seed,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    data = datasets.load_dataset("json", data_files=str(root / "train.jsonl"), split="train")
    trainer = GRPOTrainer(model=str(root / "model"), reward_funcs=[reward], args=args, train_dataset=data,
                          callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    steps_s = [b - a for a, b in zip([start, *stamps], stamps)]
    trainer.save_model(str(root / "trl_final"))  # (after the clock: composer-mesh's final export is inside its wall)
    return {"step_s": steps_s, "rewards": rewards, "completion_len": lengths,
            "gen_tokens_per_step": prompts * group * work.new_tokens, "final": str(root / "trl_final")}


def run_ours(root: Path, work: Workload, steps: int, prompts: int, group: int, lr: float, seed: int, *,
             placement: str = "disaggregated") -> dict:
    """`composer-mesh train` on the same task (called in a child by `--side ours`); `placement`: `[mesh]
    placement` (colocated: one process holds the trainer and the generator actor, as TRL's does)."""
    recipe = root / "ours.toml"
    recipe.write_text(f'''
base = "{REPO}/configs/grpo.toml"
[job]
name = "vs_trl"
seed = {seed}
output_dir = "{root / "runs"}"
python_path = ["{root}"]
[model]
hf_path = "{root / "model"}"
[trainer]
steps = {steps}
prompts_per_step = {prompts}
max_seq_len = {work.max_seq_len}
[generator]
group_size = {group}
max_new_tokens = {work.new_tokens}
[optimizer]
lr = {lr}
decay_type = "linear"
decay_ratio = 0.0
[checkpoint]
enabled = false
[mesh]
placement = "{placement}"
[env]
task = "dataset"
[env.dataset]
train_file = "{root / "train.jsonl"}"
rewards = ["bench_reward:{work.reward}"]
''')
    from composer_mesh.mesh.cli import main
    from composer_mesh.mesh.process_exit import exit_without_teardown

    # this child ends as `composer-mesh train` (`mesh.cli.entry`) does: without tearing its modules down
    exit_without_teardown()
    rc = main(["train", "--no-resume", "--no-progress", str(recipe)])
    if rc:
        raise SystemExit(rc)
    rows = [json.loads(line) for line in (root / "runs" / "vs_trl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {"step_s": [r["seconds"] for r in rows], "rewards": [r["reward/mean"] for r in rows],
            "completion_len": [r["rollouts/completion_tokens"] / (prompts * group) for r in rows],
            "train_s": [r["time/step_s"] for r in rows], "sync_s": [r["time/sync_s"] for r in rows],
            "gen_tokens_per_step": prompts * group * work.new_tokens, "final": str(root / "runs" / "vs_trl" / "hf")}


def child(side: str, root: Path, work: Workload, steps: int, prompts: int, group: int, lr: float,
          seed: int, placement: str) -> dict:
    """Run one side in a fresh process; its wall is start to exit."""
    # the child imports composer_mesh from where this process does (a worktree on PYTHONPATH or the install)
    path = os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x)
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--side", side, "--root", str(root), "--workload", work.name,
           "--steps", str(steps), "--prompts", str(prompts), "--group", str(group), "--lr", str(lr),
           "--seed", str(seed), "--placement", placement]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result | {"wall_s": wall}


def summary(runs: list[dict]) -> dict:
    steps = sorted(s for r in runs for s in r["step_s"][1:])  # the first step includes warm-up
    q = statistics.quantiles(steps, n=10) if len(steps) > 1 else steps * 9
    med = statistics.median(steps)
    out = {"median_s": med, "p10": q[0], "p90": q[-1], "max_tok_s": runs[0]["gen_tokens_per_step"] / med,
           "wall_s": statistics.median(r["wall_s"] for r in runs), "rewards": runs[0]["rewards"],
           "completion_len": statistics.fmean(x for r in runs for x in r["completion_len"]),
           "heldout_gains": [r["heldout_gain"] for r in runs]}
    if "train_s" in runs[0]:
        # ours: the trainer's step and the weight sync as the controller times them; the rest is generation
        # (rewards included) and the controller's own work
        for key in ("train_s", "sync_s"):
            out[key] = statistics.median(x for r in runs for x in r[key][1:])
        out["gen_s"] = med - out["train_s"] - out["sync_s"]
    return out


def head_to_head(work: Workload, shape: tuple, repeats: int, tmp: Path, placement: str) -> tuple[dict, float]:
    """Both sides on `work`, interleaved, repeat r with seed r; each side's summary and the held-out
    reward of the warm-started model."""
    root = tmp / work.name
    root.mkdir()
    start = time.perf_counter()
    make_task(root, 64 * shape[0], work)
    print(f"[{work.name}] task made and warm-started in {time.perf_counter() - start:.1f} s", flush=True)
    before = heldout_reward(root / "model", root, work)
    runs: dict[str, list[dict]] = {"trl": [], "ours": []}
    for seed in range(repeats):
        for side in ("trl", "ours"):
            result = child(side, root, work, *shape, seed, placement)
            result["heldout_gain"] = heldout_reward(Path(result["final"]), root, work) - before
            runs[side].append(result)
    return {side: summary(r) for side, r in runs.items()}, before


def report(work: Workload, figures: dict, before: float, repeats: int) -> dict:
    """Print `work`'s table; its JSON figures (keys suffixed `_long` for the long workload)."""
    print(f"[{work.name}] held-out greedy reward of the warm-started model: {before:.3f} ({len(HELDOUT)} problems)")
    print(f"{'side':6} {'median s/step':>14} {'p10-p90':>14} {'max tok/s':>10} {'mean len':>9} {'job wall s':>11} "
          f"{'held-out gain':>16}  reward by step (first repeat)")
    for side, f in figures.items():
        curve = " ".join(f"{x:.2f}" for x in f["rewards"])
        gains = " ".join(f"{g:+.3f}" for g in f["heldout_gains"])
        print(f"{side:6} {f['median_s']:14.3f} {f['p10']:6.3f}-{f['p90']:<7.3f} {f['max_tok_s']:10.0f} "
              f"{f['completion_len']:9.1f} {f['wall_s']:11.1f} {gains:>16}  {curve}")
    ours = figures["ours"]
    print(f"ours per step (median): train {ours['train_s']:.3f} s, weight sync {ours['sync_s']:.3f} s, "
          f"generation and the rest {ours['gen_s']:.3f} s")
    gains = {side: f["heldout_gains"] for side, f in figures.items()}
    noise = (statistics.fmean([statistics.variance(g) for g in gains.values()]) ** 0.5 if repeats > 1 else None)
    tail = "" if work.name == "short" else f"_{work.name}"
    return {
        f"step_time_ratio{tail}": figures["ours"]["median_s"] / figures["trl"]["median_s"],
        f"job_wall_ratio{tail}": figures["ours"]["wall_s"] / figures["trl"]["wall_s"],
        f"heldout_gain_delta{tail}": statistics.fmean(gains["ours"]) - statistics.fmean(gains["trl"]),
        f"heldout_seed_noise{tail}": noise, f"heldout_before{tail}": before,
        f"ours{tail}": {k: v for k, v in figures["ours"].items() if k != "rewards"},
        f"trl{tail}": {k: v for k, v in figures["trl"].items() if k != "rewards"},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 steps, 4 prompts x G 4, 2 runs per side")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workloads", default="short,long", help="comma-separated: short (2-3 token answers), "
                   f"long ({LONG_DIGITS + 1}-token answers)")
    p.add_argument("--placement", choices=("colocated", "disaggregated"), default="disaggregated",
                   help="ours: [mesh] placement (colocated: trainer and generator in one process, as TRL)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--side", choices=("trl", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=tuple(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.steps, a.repeats, a.prompts, a.group = 10, 2, 4, 4
    shape = (a.steps, a.prompts, a.group, a.lr)
    if a.side:
        args = (Path(a.root), WORKLOADS[a.workload], *shape, a.seed)
        result = run_trl(*args) if a.side == "trl" else run_ours(*args, placement=a.placement)
        print(json.dumps(result))
        return
    figures = {"steps": a.steps, "repeats": a.repeats, "placement": a.placement}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        for name in a.workloads.split(","):
            work = WORKLOADS[name]
            figures |= report(work, *head_to_head(work, shape, a.repeats, Path(tmp), a.placement), a.repeats)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
