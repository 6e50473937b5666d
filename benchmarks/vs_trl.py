"""composer-mesh vs TRL GRPOTrainer on the same checkpoint, prompts, reward and hyperparameters.

Each side runs as its own process (start to exit is the job wall), interleaved
TRL, ours, TRL, ours, ...: a 4-layer Qwen3 made with transformers (the
project's tiny ChatML tokenizer), conversational prompts `a+b` from one JSONL
file in file order, one reward function (envs.dataset's TRL signature),
G completions per prompt, DAPO token-mean loss, clip 0.2, beta 0, T = 1,
AdamW at a constant LR, fp32 on CPU.

    python benchmarks/vs_trl.py --quick      # needs the bench extra: pip install '.[bench]'

Prints a table per side (median s/step over steps 2.., p10-p90, nominal
generation throughput = prompts x G x max new tokens / median step, an upper
bound since EOS can end a completion early; job wall; reward by step) and ends
with one JSON line: step_time_ratio (ours / TRL), job_wall_ratio. Not measured
by this version: held-out before/after (heldout_gain_delta is null), and the
model is not SFT'd first, so a random model's rewards stay near 0 on both sides;
that the two sides see the same prompt token ids is by construction (both apply
the tokenizer's chat template to the same messages) and not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
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
'''


def make_task(root: Path, n_rows: int) -> None:
    """The checkpoint, the prompt file and the reward module under `root`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    import torch

    from titan_ext.assets import build_assets, default_cache_dir

    tok = AutoTokenizer.from_pretrained(build_assets(default_cache_dir(), seed=0).tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=True,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(n_rows):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}) + "\n")
    (root / "bench_reward.py").write_text(REWARD)


def run_trl(root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float) -> dict:
    """TRL GRPOTrainer in this process (called in a child by `--side trl`)."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(root))
    from bench_reward import correct

    stamps: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=str(root / "trl_out"), report_to=[], use_cpu=True, bf16=False, max_steps=steps,
        per_device_train_batch_size=prompts * group, num_generations=group, max_completion_length=new_tokens,
        learning_rate=lr, lr_scheduler_type="constant", beta=0.0, epsilon=0.2, loss_type="dapo",
        temperature=1.0, shuffle_dataset=False, save_strategy="no", logging_steps=1, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    data = datasets.load_dataset("json", data_files=str(root / "train.jsonl"), split="train")
    trainer = GRPOTrainer(model=str(root / "model"), reward_funcs=[correct], args=args, train_dataset=data,
                          callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    steps_s = [b - a for a, b in zip([start, *stamps], stamps)]
    return {"step_s": steps_s, "rewards": rewards, "gen_tokens_per_step": prompts * group * new_tokens}


def run_ours(root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float) -> dict:
    """`composer-mesh train` on the same task (called in a child by `--side ours`)."""
    recipe = root / "ours.toml"
    recipe.write_text(f'''
base = "{REPO}/configs/grpo.toml"
[job]
name = "vs_trl"
output_dir = "{root / "runs"}"
python_path = ["{root}"]
[model]
hf_path = "{root / "model"}"
[trainer]
steps = {steps}
prompts_per_step = {prompts}
max_seq_len = 128
[generator]
group_size = {group}
max_new_tokens = {new_tokens}
[optimizer]
lr = {lr}
decay_type = "linear"
decay_ratio = 0.0
[checkpoint]
enabled = false
[env]
task = "dataset"
[env.dataset]
train_file = "{root / "train.jsonl"}"
rewards = ["bench_reward:correct"]
''')
    from mesh.cli import main

    rc = main(["train", "--no-resume", "--no-progress", str(recipe)])
    if rc:
        raise SystemExit(rc)
    rows = [json.loads(line) for line in (root / "runs" / "vs_trl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {"step_s": [r["seconds"] for r in rows], "rewards": [r["reward/mean"] for r in rows],
            "gen_tokens_per_step": prompts * group * new_tokens}


def child(side: str, root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float) -> dict:
    """Run one side in a fresh process; its wall is start to exit."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--side", side, "--root", str(root), "--steps", str(steps),
           "--prompts", str(prompts), "--group", str(group), "--new-tokens", str(new_tokens), "--lr", str(lr)]
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
    return {"median_s": med, "p10": q[0], "p90": q[-1], "max_tok_s": runs[0]["gen_tokens_per_step"] / med,
            "wall_s": statistics.median(r["wall_s"] for r in runs), "rewards": runs[0]["rewards"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 steps, 1 run per side")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--side", choices=("trl", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = (a.steps, a.prompts, a.group, a.new_tokens, a.lr)
    if a.side:
        result = (run_trl if a.side == "trl" else run_ours)(Path(a.root), *shape)
        print(json.dumps(result))
        return
    if a.quick:
        a.steps, a.repeats, a.prompts, a.group = 10, 1, 4, 4
        shape = (a.steps, a.prompts, a.group, a.new_tokens, a.lr)
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        root = Path(tmp)
        make_task(root, 64 * a.steps)
        runs: dict[str, list[dict]] = {"trl": [], "ours": []}
        for _ in range(a.repeats):
            for side in ("trl", "ours"):
                runs[side].append(child(side, root, *shape))
    figures = {side: summary(r) for side, r in runs.items()}
    print(f"{'side':6} {'median s/step':>14} {'p10-p90':>14} {'max tok/s':>10} {'job wall s':>11}  reward by step")
    for side, f in figures.items():
        curve = " ".join(f"{x:.2f}" for x in f["rewards"])
        print(f"{side:6} {f['median_s']:14.3f} {f['p10']:6.3f}-{f['p90']:<7.3f} {f['max_tok_s']:10.0f} "
              f"{f['wall_s']:11.1f}  {curve}")
    print(json.dumps({
        "step_time_ratio": figures["ours"]["median_s"] / figures["trl"]["median_s"],
        "job_wall_ratio": figures["ours"]["wall_s"] / figures["trl"]["wall_s"],
        "heldout_gain_delta": None, "steps": a.steps, "repeats": a.repeats,
        "ours": {k: v for k, v in figures["ours"].items() if k != "rewards"},
        "trl": {k: v for k, v in figures["trl"].items() if k != "rewards"},
    }))


if __name__ == "__main__":
    main()
