"""What the main job's model can learn at all: SFT on the coding tasks' reference answers.

    python benchmarks/coding_ceiling.py --quick

Every loss channel teaches the policy at most what supervised learning on the
right answer teaches it: the policy channel finds right answers by sampling,
hints and pairs point at them. This benchmark gives the warm-started base of a
coding recipe (`configs/coding_cpu.toml` by default, built and cached as
`composer-mesh train` builds it) that strongest signal: AdamW SFT on the
reference `edit_file` call of train-split tasks, and reads, teacher-forced,

- `answer`: the probability of the whole reference answer (format and code),
- `op`: the probability of its operator token (`+`, `-` or `*`, the recipe's
  arithmetic ops) given the reference prefix, i.e. the task's one decision,

on train tasks and on held-out tasks (templates never trained on), before the
SFT and every `--every` steps. The base model (step 0) is the baseline; the
JSON line has each figure after minus before. A held-out `op` that falls while
the train `op` rises says the model learns features of the train templates
that do not carry over (docs/coding.md, fifth round: a split whose held-out
frames appeared in training only with other ops); one that follows the train
`op` says the split can be generalised to, and the train rise is then what any
channel can at most reach at that lr and step count (sixth round).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_mesh.configs.loader import load_config
from composer_mesh.envs.factory import env_factory
from composer_mesh.mesh.launch import model_dir
from composer_mesh.titan_ext.warmstart import sft_batch, sft_rows

OPS = ("+", "-", "*")


def reference_conversations(job, split: str, n: int, seed: int) -> tuple[list[list[dict]], list[dict]]:
    """`n` episode starts of `split` answered with the task's reference change as one `edit_file` call."""
    env, out, tools = env_factory(job.env)(split), [], []
    try:
        for i in range(n):
            obs = env.reset(seed=seed + i)
            tools = obs.info["tools"]
            ref = env.task.reference_files()[env.task.target]
            line = next(x.strip() for x in ref.splitlines() if x.strip().startswith("return "))
            args = {"path": env.task.target, "old": "pass", "new": line}
            call = {"id": "call_0", "type": "function", "function": {"name": "edit_file", "arguments": json.dumps(args)}}
            out.append([*env.state.messages, {"role": "assistant", "content": "", "tool_calls": [call]}])
    finally:
        env.close()
    return out, tools


def op_position(tok, ids: list[int], mask: list[bool]) -> int:
    """The position whose next-token prediction is the answer's operator token (its last one)."""
    return [t for t in range(len(ids) - 1) if mask[t + 1] and tok.decode([ids[t + 1]]).strip() in OPS][-1]


@torch.no_grad()
def probabilities(model, rows, op_at: list[int]) -> tuple[float, float]:
    """Mean teacher-forced probability of the answer and of its operator token (at `op_at`) over `rows`."""
    model.eval()
    answer, op = [], []
    for (ids, mask), at in zip(rows, op_at):
        x = torch.tensor([ids])
        logp_T = F.log_softmax(model(x).logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]  # [T-1]
        answer.append(logp_T[torch.tensor(mask[1:])].sum().exp().item())
        op.append(logp_T[at].exp().item())
    model.train()
    return sum(answer) / len(answer), sum(op) / len(op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/coding_cpu.toml")
    parser.add_argument("--quick", action="store_true", help="30 SFT steps, 24 tasks per split read")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-tasks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config overrides, --section.key=value without the dashes")
    args = parser.parse_args()
    steps, n_read = (30, 24) if args.quick else (args.steps, 48)
    job = load_config(args.config, overrides=[f"--{o}" for o in args.overrides])
    start = time.perf_counter()
    base = model_dir(job)
    build_s = time.perf_counter() - start
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    train, tools = reference_conversations(job, "train", args.train_tasks, 0)
    heldout, _ = reference_conversations(job, "heldout", n_read, 50_000)
    train_rows, heldout_rows = sft_rows(tok, train, tools), sft_rows(tok, heldout, tools)
    read_rows = train_rows[:n_read]
    # the operator's position in each row read: fixed, so found once
    read_op, heldout_op = ([op_position(tok, ids, mask) for ids, mask in rows] for rows in (read_rows, heldout_rows))

    def read() -> tuple[float, ...]:
        return (*probabilities(model, read_rows, read_op), *probabilities(model, heldout_rows, heldout_op))

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    table = [(0, *read())]
    for step in range(1, steps + 1):
        pick = torch.randint(len(train_rows), (args.batch_size,), generator=gen)
        tokens_BL, labels_BL = sft_batch([train_rows[int(i)] for i in pick])
        loss = F.cross_entropy(model(tokens_BL).logits.flatten(0, 1).float(), labels_BL.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == steps:
            table.append((step, *read()))
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    print(f"\n{args.config}: SFT on reference answers, lr {args.lr}, batch {args.batch_size}, "
          f"{args.train_tasks} train tasks; read on {n_read} train and {n_read} held-out tasks")
    print(f"{'step':>5} | {'train answer':>12} | {'train op':>8} | {'held-out answer':>15} | {'held-out op':>11}")
    for step, ta, to, ha, ho in table:
        print(f"{step:>5} | {ta:>12.3f} | {to:>8.3f} | {ha:>15.3f} | {ho:>11.3f}")
    first, last = table[0], table[-1]
    print(json.dumps({
        "config": args.config, "steps": steps, "lr": args.lr, "base_build_s": round(build_s, 1),
        "train_answer_before": round(first[1], 4), "train_answer_after": round(last[1], 4),
        "train_op_before": round(first[2], 4), "train_op_after": round(last[2], 4),
        "heldout_answer_before": round(first[3], 4), "heldout_answer_after": round(last[3], 4),
        "heldout_op_before": round(first[4], 4), "heldout_op_after": round(last[4], 4),
        "train_op_gain": round(last[2] - first[2], 4), "heldout_op_gain": round(last[4] - first[4], 4),
    }))


if __name__ == "__main__":
    main()
