"""composer-mesh vs TRL GRPOTrainer on the same checkpoint, prompts, reward and hyperparameters.

Each side runs as its own process (start to exit is the job wall), interleaved
TRL, ours, TRL, ours, ...: a 4-layer Qwen3 made with transformers (the
project's tiny ChatML tokenizer) and warm-started with a few seconds of SFT on
the answer *format* only (a number of one or two digits, independent of the
problem, like the demo's warm start), so rewards differ within a group from
step 1; conversational prompts `a+b` from one JSONL file in file order, one
reward function (envs.dataset's TRL signature), G completions per prompt,
DAPO token-mean loss, clip 0.2, beta 0, T = 1, AdamW at a constant LR, fp32 on
CPU. Repeat r uses seed r on both sides.

Held-out: 20 of the 100 `a+b` problems never appear in the training file;
the parent scores greedy completions of them (the same HF `generate` and
reward for both sides) with the warm-started model (before) and with each
run's final weights (after: TRL's saved model, composer-mesh's `hf/` export).

    python benchmarks/vs_trl.py --quick      # needs the bench extra: pip install '.[bench]'

Prints a table per side (median s/step over steps 2.., p10-p90, nominal
generation throughput = prompts x G x max new tokens / median step, an upper
bound since EOS can end a completion early; job wall; held-out gain per
repeat; reward by step) and ends with one JSON line: step_time_ratio
(ours / TRL), job_wall_ratio, heldout_gain_delta (mean gain ours - TRL) and
heldout_seed_noise (the standard deviation of one side's gain over repeats,
pooled over both sides; null with one repeat). That both sides see the same
prompt token ids is by construction (both apply the tokenizer's chat template
to the same messages) and not asserted.
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


HELDOUT = [(a, b) for a in range(10) for b in range(10) if (7 * a + 3 * b) % 5 == 0]  # 20 problems never trained


def make_task(root: Path, n_rows: int) -> None:
    """The warm-started checkpoint, the prompt file, the held-out file and the reward module under `root`."""
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
    warm_start(model, tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    train_pairs = [(a, b) for a in range(10) for b in range(10) if (a, b) not in HELDOUT]
    with open(root / "train.jsonl", "w") as f:
        for _ in range(n_rows):
            a, b = rng.choice(train_pairs)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}) + "\n")
    (root / "bench_reward.py").write_text(REWARD)


def warm_start(model, tok, steps: int = 150, batch: int = 32) -> None:
    """SFT on the answer format only: `a+b` -> a random number 0..18 (not the sum), loss on the answer tokens."""
    import torch

    rng = random.Random(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            prompt = [{"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"}]
            head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": str(rng.randint(0, 18))}],
                                           tokenize=True, return_dict=False)
            rows.append((list(full), len(head)))
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


def heldout_reward(model_dir: Path, root: Path, new_tokens: int) -> float:
    """Mean reward of greedy completions of the held-out problems (HF generate, left-padded batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(root))
    from bench_reward import correct

    tok = AutoTokenizer.from_pretrained(root / "model")
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}"}], add_generation_prompt=True,
                                       tokenize=False) for a, b in HELDOUT]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = correct(texts, [str(a + b) for a, b in HELDOUT])
    return sum(scores) / len(scores)


def run_trl(root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float, seed: int) -> dict:
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
        temperature=1.0, shuffle_dataset=False, save_strategy="no", logging_steps=1, seed=seed,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    data = datasets.load_dataset("json", data_files=str(root / "train.jsonl"), split="train")
    trainer = GRPOTrainer(model=str(root / "model"), reward_funcs=[correct], args=args, train_dataset=data,
                          callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    steps_s = [b - a for a, b in zip([start, *stamps], stamps)]
    trainer.save_model(str(root / "trl_final"))  # (after the clock: composer-mesh's final export is inside its wall)
    return {"step_s": steps_s, "rewards": rewards, "gen_tokens_per_step": prompts * group * new_tokens,
            "final": str(root / "trl_final")}


def run_ours(root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float, seed: int) -> dict:
    """`composer-mesh train` on the same task (called in a child by `--side ours`)."""
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
    from composer_mesh.mesh.cli import main

    rc = main(["train", "--no-resume", "--no-progress", str(recipe)])
    if rc:
        raise SystemExit(rc)
    rows = [json.loads(line) for line in (root / "runs" / "vs_trl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {"step_s": [r["seconds"] for r in rows], "rewards": [r["reward/mean"] for r in rows],
            "gen_tokens_per_step": prompts * group * new_tokens, "final": str(root / "runs" / "vs_trl" / "hf")}


def child(side: str, root: Path, steps: int, prompts: int, group: int, new_tokens: int, lr: float,
          seed: int) -> dict:
    """Run one side in a fresh process; its wall is start to exit."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--side", side, "--root", str(root), "--steps", str(steps),
           "--prompts", str(prompts), "--group", str(group), "--new-tokens", str(new_tokens), "--lr", str(lr),
           "--seed", str(seed)]
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
            "wall_s": statistics.median(r["wall_s"] for r in runs), "rewards": runs[0]["rewards"],
            "heldout_gains": [r["heldout_gain"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 steps, 4 prompts x G 4, 2 runs per side")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--side", choices=("trl", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = (a.steps, a.prompts, a.group, a.new_tokens, a.lr)
    if a.side:
        result = (run_trl if a.side == "trl" else run_ours)(Path(a.root), *shape, a.seed)
        print(json.dumps(result))
        return
    if a.quick:
        a.steps, a.repeats, a.prompts, a.group = 10, 2, 4, 4
        shape = (a.steps, a.prompts, a.group, a.new_tokens, a.lr)
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        root = Path(tmp)
        make_task(root, 64 * a.steps)
        before = heldout_reward(root / "model", root, a.new_tokens)
        runs: dict[str, list[dict]] = {"trl": [], "ours": []}
        for seed in range(a.repeats):
            for side in ("trl", "ours"):
                result = child(side, root, *shape, seed)
                result["heldout_gain"] = heldout_reward(Path(result["final"]), root, a.new_tokens) - before
                runs[side].append(result)
    figures = {side: summary(r) for side, r in runs.items()}
    print(f"held-out greedy reward of the warm-started model: {before:.3f} ({len(HELDOUT)} problems)")
    print(f"{'side':6} {'median s/step':>14} {'p10-p90':>14} {'max tok/s':>10} {'job wall s':>11} "
          f"{'held-out gain':>16}  reward by step (first repeat)")
    for side, f in figures.items():
        curve = " ".join(f"{x:.2f}" for x in f["rewards"])
        gains = " ".join(f"{g:+.3f}" for g in f["heldout_gains"])
        print(f"{side:6} {f['median_s']:14.3f} {f['p10']:6.3f}-{f['p90']:<7.3f} {f['max_tok_s']:10.0f} "
              f"{f['wall_s']:11.1f} {gains:>16}  {curve}")
    gains = {side: f["heldout_gains"] for side, f in figures.items()}
    noise = (statistics.fmean([statistics.variance(g) for g in gains.values()]) ** 0.5 if a.repeats > 1 else None)
    print(json.dumps({
        "step_time_ratio": figures["ours"]["median_s"] / figures["trl"]["median_s"],
        "job_wall_ratio": figures["ours"]["wall_s"] / figures["trl"]["wall_s"],
        "heldout_gain_delta": statistics.fmean(gains["ours"]) - statistics.fmean(gains["trl"]),
        "heldout_seed_noise": noise, "heldout_before": before, "steps": a.steps, "repeats": a.repeats,
        "ours": {k: v for k, v in figures["ours"].items() if k != "rewards"},
        "trl": {k: v for k, v in figures["trl"].items() if k != "rewards"},
    }))


if __name__ == "__main__":
    main()
