"""Process harness and worker scenarios for the trainer tests (no tests of its own).

Ranks are real processes forked by a *zygote*: one helper process per pytest
session (`python test_trainer_harness.py --zygote`) that imports torch,
TorchTitan, transformers and the trainer once, then on request forks `world`
children. Each child gets torchrun-style environment variables (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), joins a real gloo
process group through `titan_ext.platform`, runs a scenario function below and
writes its output to `<out_dir>/rank{r}.log`. Forking skips ~25 s of imports per
rank on a busy 2-core box; the children are still separate processes that
the tests can SIGKILL. A failing child makes `run_ranks` raise with its log.

Batches are fixed and distinct per step (seeded by the step's data cursor), all
three channels on: packed student rows with two rollouts per row, hint rows
with the hint inserted before the response, and chosen / rejected pairs.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from composer_mesh.titan_ext.rendezvous import master_port

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve()
VOCAB = 2048
SEQ_L = 32  # packed student row length
HINT_LEN = 4
_PRELOAD = ("torch", "torch.distributed.fsdp", "transformers", "composer_mesh.titan_ext.trainer", "safetensors.torch")


# ---- launching ranks ---------------------------------------------------------------------------


class Zygote:
    """The forking helper process; one JSON request / reply per line on its stdin / stdout."""

    def __init__(self) -> None:
        # the caller's PYTHONPATH first: the ranks import the composer_mesh the test imports
        path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(HARNESS), "--zygote"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        atexit.register(self.close)

    def request(self, **message: Any) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote process died (rc {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@functools.lru_cache(maxsize=1)
def zygote() -> Zygote:
    return Zygote()


def launch(scenario: str, world: int, out_dir: Path, args: dict[str, Any]) -> list[int]:
    """Fork `world` ranks of `scenario`; returns their pids. Output goes to out_dir/rank{r}.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    reply = zygote().request(op="launch", scenario=scenario, world=world, out_dir=str(out_dir), args=args)
    return reply["pids"]


def wait_ranks(pids: list[int], out_dir: Path, timeout: float = 240) -> list[int]:
    """Exit codes of the ranks (negative: killed by that signal); on a failure or timeout
    kill the rest and raise with the failed ranks' logs."""
    codes = zygote().request(op="wait", pids=pids, timeout=timeout)["codes"]
    failed = [i for i, c in enumerate(codes) if c != 0]
    if failed:
        kill_ranks(pids)
        logs = "\n".join(f"--- rank {i} (rc {codes[i]}) ---\n{_tail(out_dir / f'rank{i}.log')}" for i in failed)
        raise AssertionError(f"ranks {failed} failed:\n{logs}")
    return codes


def run_ranks(scenario: str, world: int, out_dir: Path, args: dict[str, Any], timeout: float = 240) -> dict:
    """Launch, wait, and return rank 0's `result.json`."""
    wait_ranks(launch(scenario, world, out_dir, args), out_dir, timeout)
    return json.loads((out_dir / "result.json").read_text())


def kill_ranks(pids: list[int]) -> list[int]:
    """SIGKILL every rank still alive; returns the exit codes (-9 for each one killed)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return zygote().request(op="wait", pids=pids, timeout=30)["codes"]


def _tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text[-chars:]


def _zygote_main() -> None:
    """Serve launch / wait requests until stdin closes; children run `_rank_main`."""
    import importlib

    for module in _PRELOAD:
        importlib.import_module(module)
    exited: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "launch":
            port = master_port("127.0.0.1")
            pids = []
            for rank in range(request["world"]):
                pid = os.fork()
                if pid == 0:
                    _rank_main(rank, request, port)  # never returns
                pids.append(pid)
            reply = {"pids": pids}
        else:
            deadline = time.monotonic() + request["timeout"]
            pending = [p for p in request["pids"] if p not in exited]
            while pending and time.monotonic() < deadline:
                for pid in list(pending):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        exited[pid] = os.waitstatus_to_exitcode(status)
                        pending.remove(pid)
                time.sleep(0.05)
            reply = {"codes": [exited.get(p, "timeout") for p in request["pids"]]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _rank_main(rank: int, request: dict, port: int) -> None:
    """A forked rank: environment, log file, the scenario; exits 0 or 1 (traceback in the log)."""
    code = 1
    try:
        out_dir = Path(request["out_dir"])
        log = os.open(out_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdin.close()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["world"]),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        run_scenario(request["scenario"], out_dir, request["args"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ---- the runs the tests share (one launch each per pytest session) --------------------------------

STEPS = 6
TWO_RANK_CONFIGS = {
    "fsdp_adamw": {"optimizer": "adamw"},  # dp_shard = 2: FSDP2, which is also HSDP 1x2 in TorchTitan
    "hsdp21_adamw": {"optimizer": "adamw",
                     "parallelism": {"dp_replicate": 2, "dp_shard": 1, "activation_checkpoint": "full"}},
    "fsdp_bf16_adamw": {"optimizer": "adamw",
                        "parallelism": {"param_dtype": "bfloat16", "activation_checkpoint": "selective"}},
    "fsdp_muon": {"optimizer": "muon", "save_params": True},  # last: its trainer is the one exported
}
EXPORT_BUCKET_MIB = 0.25


def _scratch(name: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"trainer_{name}_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def single_run(hf_path: str) -> dict:
    """One process, no sharding: the reference trajectories (AdamW and Muon)."""
    configs = {"single_adamw": {"optimizer": "adamw"}, "single_muon": {"optimizer": "muon"}}
    return run_ranks("trajectory", 1, _scratch("single"), {"configs": configs, "steps": STEPS, "hf_path": hf_path})


@functools.lru_cache(maxsize=None)
def two_rank_run(hf_path: str) -> tuple[dict, Path]:
    """Two gloo ranks: FSDP2 and HSDP 2x1 trajectories, FSDP Muon params, HF export of the last one."""
    out = _scratch("two_rank")
    args = {"configs": TWO_RANK_CONFIGS, "steps": STEPS, "hf_path": hf_path, "export": True,
            "bucket_mib": EXPORT_BUCKET_MIB}
    return run_ranks("trajectory", 2, out, args, timeout=420), out


@functools.lru_cache(maxsize=None)
def four_rank_run(hf_path: str) -> dict:
    """Four gloo ranks: HSDP 2x2 (two replicas, each sharded over two ranks)."""
    configs = {"hsdp22_adamw": {"optimizer": "adamw", "parallelism": {"dp_replicate": 2, "dp_shard": 2}}}
    return run_ranks("trajectory", 4, _scratch("four_rank"), {"configs": configs, "steps": STEPS, "hf_path": hf_path},
                     timeout=420)


# ---- worker side -------------------------------------------------------------------------------


def make_spec(args: dict[str, Any], out_dir: Path | None = None):
    """The TrainerSpec of a scenario: tiny flavour, three channels, DPO, Muon."""
    from composer_mesh.configs.sections.checkpoint import CheckpointConfig
    from composer_mesh.configs.sections.loss import DistillLossConfig, LossConfig, PolicyLossConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.optimizer import OptimizerConfig
    from composer_mesh.configs.sections.parallelism import ParallelismConfig
    from composer_mesh.configs.sections.trainer import TrainerConfig
    from composer_mesh.titan_ext.spec import TrainerSpec

    ckpt = args.get("checkpoint")
    return TrainerSpec(
        model=ModelConfig(flavour=args.get("flavour", "tiny"), device="cpu", seed=0, hf_path=args.get("hf_path", "")),
        parallelism=ParallelismConfig(**args.get("parallelism", {})),
        trainer=TrainerConfig(steps=args.get("steps", 5), microbatches=args.get("microbatches", 2), grad_clip=1.0,
                              export_bucket_mib=args.get("bucket_mib", 256.0),
                              dpo_reference_dtype=args.get("reference_dtype", "serving"),
                              dpo_reference_storage=args.get("reference_storage", "memory")),
        optimizer=OptimizerConfig(name=args.get("optimizer", "muon"), lr=0.02, adamw_lr=3e-3, warmup_steps=1),
        loss=LossConfig(alpha=1.0, beta=1.0, chunk_tokens=16, policy=PolicyLossConfig(**args.get("policy", {})),
                        distill=DistillLossConfig(kind=args.get("distill_kind", "jsd"), taid_alpha=0.5,
                                                  taid_adaptive=args.get("taid_adaptive", True),
                                                  **args.get("distill", {}))),
        checkpoint=CheckpointConfig(**ckpt) if ckpt else CheckpointConfig(enabled=False),
        checkpoint_dir=str(out_dir / "ckpt") if ckpt else "",
        run_dir=str(out_dir) if out_dir else "",
    )


def global_batch(cursor: int, rows: int = 4, pairs: int = 3):
    """The global batch number `cursor`: fixed, distinct per cursor, all three channels present."""
    import torch

    from composer_mesh.titan_ext.batch import IGNORE_INDEX, TrainBatch

    g = torch.Generator().manual_seed(1000 + cursor)
    docs = 2  # rollouts packed per student row
    doc_len = SEQ_L // docs
    prompt = 6
    tokens = torch.randint(3, VOCAB, (rows, SEQ_L), generator=g)
    positions = torch.arange(doc_len).repeat(docs).expand(rows, -1).clone()
    labels = torch.full((rows, SEQ_L), IGNORE_INDEX)
    policy_mask = torch.zeros(rows, SEQ_L, dtype=torch.bool)
    advantages = torch.zeros(rows, SEQ_L)
    for d in range(docs):
        lo = d * doc_len
        # position i predicts token i+1; the response is tokens [lo+prompt, lo+doc_len)
        labels[:, lo + prompt - 1 : lo + doc_len - 1] = tokens[:, lo + prompt : lo + doc_len]
        policy_mask[:, lo + prompt - 1 : lo + doc_len - 1] = True
        advantages[:, lo : lo + doc_len] = torch.randn(rows, 1, generator=g)
    generator_logprobs = torch.where(policy_mask, -7.6 + 0.1 * torch.randn(rows, SEQ_L, generator=g), 0.0)
    # Hint rows: each rollout gets HINT_LEN hint tokens before its response.
    H = SEQ_L + docs * HINT_LEN
    hint_tokens = torch.zeros(rows, H, dtype=torch.long)
    hint_positions = torch.zeros(rows, H, dtype=torch.long)
    hint_index = torch.full((rows, SEQ_L), -1)
    distill_mask = torch.zeros(rows, SEQ_L, dtype=torch.bool)
    hint_doc = doc_len + HINT_LEN
    for d in range(docs):
        lo, hlo = d * doc_len, d * hint_doc
        hint = torch.randint(3, VOCAB, (rows, HINT_LEN), generator=g)
        hint_tokens[:, hlo : hlo + hint_doc] = torch.cat(
            [tokens[:, lo : lo + prompt], hint, tokens[:, lo + prompt : lo + doc_len]], dim=1)
        hint_positions[:, hlo : hlo + hint_doc] = torch.arange(hint_doc)
        # student position lo+i (i >= prompt-1) and teacher position hlo+HINT_LEN+i predict the same token
        i = torch.arange(prompt - 1, doc_len - 1)
        hint_index[:, lo + i] = hlo + HINT_LEN + i
        distill_mask[:, lo + prompt + 1 : lo + doc_len - 1] = True  # the "error turn": most of the response
    S = 20
    state = torch.randint(3, VOCAB, (pairs, 12), generator=g)
    chosen = torch.cat([state, torch.randint(3, VOCAB, (pairs, S - 12), generator=g)], 1)
    rejected = torch.cat([state, torch.randint(3, VOCAB, (pairs, S - 12), generator=g)], 1)

    def action_labels(seq):
        lab = torch.full_like(seq, IGNORE_INDEX)
        lab[:, 11 : S - 1] = seq[:, 12:]
        return lab

    return TrainBatch(
        tokens_BL=tokens, positions_BL=positions, labels_BL=labels, policy_mask_BL=policy_mask,
        advantages_BL=advantages, generator_logprobs_BL=generator_logprobs,
        policy_tokens=int(policy_mask.sum()),
        distill_mask_BL=distill_mask, hint_tokens_BH=hint_tokens, hint_positions_BH=hint_positions,
        hint_index_BL=hint_index, distill_tokens=int(distill_mask.sum()), hinted_BL=hint_index >= 0,
        chosen_tokens_PS=chosen, chosen_positions_PS=torch.arange(S).expand(pairs, -1).clone(),
        chosen_labels_PS=action_labels(chosen),
        rejected_tokens_PS=rejected, rejected_positions_PS=torch.arange(S).expand(pairs, -1).clone(),
        rejected_labels_PS=action_labels(rejected),
        ref_chosen_logprobs_P=-7.6 * 7 + 0.5 * torch.randn(pairs, generator=g),
        ref_rejected_logprobs_P=-7.6 * 7 + 0.5 * torch.randn(pairs, generator=g),
        pairs=pairs,
    )


def train(trainer, steps: int) -> list[dict[str, float]]:
    """`steps` train steps; the batch comes from the trainer's data cursor (restored on resume)."""
    import torch.distributed as dist

    history = []
    for _ in range(steps):
        cursor = trainer.data_cursors.get("batch", 0)
        batch = global_batch(cursor).shard(dist.get_rank(), dist.get_world_size())
        trainer.data_cursors["batch"] = cursor + 1
        history.append(trainer.train_step(batch))
    return history


def _save_params(trainer, path: Path) -> None:
    import torch

    params = trainer.named_full_parameters()
    if os.environ["RANK"] == "0":
        torch.save(params, path)


def scenario_trajectory(out_dir: Path, args: dict[str, Any]) -> dict:
    """Train each config (parallelism + optimizer) from the same HF weights; losses, meshes, params.

    args["configs"][name] = {"parallelism": {...}, "optimizer": "adamw" | "muon", "save_params": bool};
    args["export"]: run the HF export parity on the last config's trainer.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_mesh.titan_ext.trainer import Trainer

    result: dict[str, Any] = {"history": {}, "meshes": {}}
    for name, config in args["configs"].items():
        trainer = Trainer(make_spec({**args, **config}))
        weight = trainer.model.tok_embeddings.weight
        result["meshes"][name] = list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else None
        result["history"][name] = train(trainer, args["steps"])
        if config.get("save_params"):
            _save_params(trainer, out_dir / f"params_{name}.pt")
        dist.barrier()
    if args.get("export"):
        result["export"] = export_parity(trainer, out_dir)
    return result


def scenario_resume_phase1(out_dir: Path, args: dict[str, Any]) -> dict:
    """Train until the step-3 checkpoint is complete, say so, then wait to be killed."""
    from composer_mesh.titan_ext.trainer import Trainer

    trainer = Trainer(make_spec(args, out_dir))
    train(trainer, 3)
    (out_dir / f"ready_{os.environ['RANK']}").write_text("checkpointed step 3\n")
    time.sleep(600)
    raise AssertionError("phase 1 was not killed")


def scenario_resume_phase2(out_dir: Path, args: dict[str, Any]) -> dict:
    """A fresh process: resume from the newest checkpoint and train to step 6."""
    from composer_mesh.titan_ext.trainer import Trainer

    trainer = Trainer(make_spec(args, out_dir))
    resumed_at = trainer.step
    history = train(trainer, 6 - trainer.step)
    _save_params(trainer, out_dir / "params_resumed.pt")
    return {"resumed_at": resumed_at, "cursor": trainer.data_cursors["batch"], "history": history}


def scenario_moe_ep(out_dir: Path, args: dict[str, Any]) -> dict:
    """Tiny MoE with EP: placements, train steps, and HF export parity (rank 0 checks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_mesh.titan_ext.trainer import Trainer

    trainer = Trainer(make_spec(args))
    placements = {
        name: {"mesh": list(p.device_mesh.mesh_dim_names), "placements": [repr(x) for x in p.placements]}
        for name, p in trainer.model.named_parameters() if isinstance(p, DTensor)
    }
    before = {k: v.clone() for k, v in trainer.named_full_parameters().items()}
    history = train(trainer, args["steps"])
    after = trainer.named_full_parameters()
    changed = sorted(k for k in after if not torch.equal(after[k], before[k])) if after else []
    export = export_parity(trainer, out_dir)
    # A bad token in the last row only (rank 1's share): every rank must raise, none may hang.
    bad = global_batch(7)
    bad.tokens_BL[-1, 0] = VOCAB
    try:
        trainer.train_step(bad.shard(dist.get_rank(), dist.get_world_size()))
        bad_error = None
    except ValueError as e:
        bad_error = str(e)
    dist.barrier()
    return {"placements": placements, "history": history, "changed": changed, "export": export,
            "all_params": sorted(after), "bad_error_rank0": bad_error}


def scenario_bad_input(out_dir: Path, args: dict[str, Any]) -> dict:
    """Bad batches fail with a clear error and leave weights and optimizer state as they were."""
    import dataclasses

    import torch

    from composer_mesh.titan_ext.trainer import Trainer

    trainer = Trainer(make_spec(args))
    train(trainer, 1)
    before = {k: v.clone() for k, v in trainer.named_full_parameters().items()}
    optim_before = {k: v.clone() for k, v in trainer.optimizer.state[next(iter(trainer.model.parameters()))].items()
                    if torch.is_tensor(v)}
    good = global_batch(1)
    errors = {}
    bad_batches = {
        "token_out_of_vocab": dataclasses.replace(good, tokens_BL=good.tokens_BL.clone().fill_(VOCAB)),
        "nan_advantages": dataclasses.replace(good, advantages_BL=torch.full_like(good.advantages_BL, float("nan"))),
        "dpo_without_reference": dataclasses.replace(good, ref_chosen_logprobs_P=None, ref_rejected_logprobs_P=None),
    }
    for name, batch in bad_batches.items():
        try:
            trainer.train_step(batch)
            errors[name] = None
        except (ValueError, FloatingPointError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    after = trainer.named_full_parameters()
    optim_after = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and all(
        torch.equal(v, optim_after[k]) for k, v in optim_before.items())
    metrics = trainer.train_step(good)  # and training goes on
    return {"errors": errors, "unchanged": unchanged, "step": trainer.step, "loss": metrics["loss"]}


def scenario_taid(out_dir: Path, args: dict[str, Any]) -> dict:
    """Hint distillation with TAID: t moves with the steps and is part of the checkpointed state."""
    from composer_mesh.titan_ext.trainer import Trainer

    trainer = Trainer(make_spec({**args, "distill_kind": "taid"}))
    history = train(trainer, 4)
    return {"t": [m["distill/taid_t"] for m in history], "distill": [m["distill/loss"] for m in history],
            "saved": trainer.state_dict_extra()["taid"]}


def scenario_hf_load(out_dir: Path, args: dict[str, Any]) -> dict:
    """`load_hf_into_titan` on models parallelized like the trainer's, then a gathered read-back.

    args["configs"][name] = {"flavour": ..., "parallelism": {...}}; args["hf_dirs"][flavour] = dir.
    Per config: the mesh of the weights, whether the gathered HF tensors equal the checkpoint's
    bitwise (and differed before loading), and the error a wrong-flavour checkpoint raises.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.parallelism import ParallelismConfig
    from composer_mesh.titan_ext.hf.adapters import titan_to_hf_state_dict
    from composer_mesh.titan_ext.hf.read import load_hf_into_titan, read_hf_state_dict
    from composer_mesh.titan_ext.models import init_model, resolve_model
    from composer_mesh.titan_ext.parallelize import build_parallel_dims, parallelize_model, prepare_model_config
    from composer_mesh.titan_ext.platform import detect_platform, init_process_group

    platform = detect_platform("cpu")
    init_process_group(platform)
    result: dict[str, Any] = {}
    for name, config in args["configs"].items():
        flavour, parallelism = config["flavour"], ParallelismConfig(**config["parallelism"])
        resolved = resolve_model(ModelConfig(flavour=flavour, device="cpu", seed=7), platform)
        prepare_model_config(resolved.spec.model, parallelism)
        with torch.device("meta"):
            model = resolved.spec.model.build()
        parallelize_model(model, resolved.spec, build_parallel_dims(parallelism, dist.get_world_size(), platform),
                          parallelism, platform)
        init_model(model, "cpu", 7)
        expected = read_hf_state_dict(args["hf_dirs"][flavour])
        # clones: a gathered Replicate / size-1 shard can alias the parameter that the load overwrites
        before = {k: v.clone() for k, v in titan_to_hf_state_dict(model).items()}
        wrong = next(d for f, d in args["hf_dirs"].items() if f != flavour)
        try:
            load_hf_into_titan(model, wrong)
            wrong_error = None
        except ValueError as e:
            wrong_error = str(e)
        untouched = {k: v.clone() for k, v in titan_to_hf_state_dict(model).items()}
        load_hf_into_titan(model, args["hf_dirs"][flavour])
        loaded = titan_to_hf_state_dict(model)
        result[name] = {
            "meshes": sorted({"/".join(p.device_mesh.mesh_dim_names) for p in model.parameters()
                              if isinstance(p, DTensor)}),
            "differed_before": sorted(k for k in expected if not torch.equal(before[k], expected[k])),
            "untouched_by_wrong": all(torch.equal(before[k], untouched[k]) for k in before),
            "wrong_error": wrong_error,
            "names_match": sorted(loaded) == sorted(expected),
            "mismatched": sorted(k for k in expected if not torch.equal(loaded.get(k, torch.empty(0)), expected[k])),
            "keys": sorted(expected),
        }
        dist.barrier()
    return result


def scenario_reference(out_dir: Path, args: dict[str, Any]) -> dict:
    """The frozen DPO reference in `args["reference_dtype"]`, before and after 2 steps of the policy.

    Its parameters (gathered) against the initial policy's cast like the weight export, its buffers, the
    bytes each model holds on this rank, next-token logprobs of fixed rows under both models at init, and
    whether the reference, its logprobs and the policy's gradients are as the step should leave them.
    """
    import torch
    from torch.distributed.tensor import DTensor

    from composer_mesh.losses.logprobs import chunked_token_stats
    from composer_mesh.titan_ext.trainer import Trainer

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    def local_bytes(model: torch.nn.Module) -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())

    tokens_BL = global_batch(99).tokens_BL[:2, :24]
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    # next token of each position; the last has none
    labels_BL = torch.cat([tokens_BL[:, 1:], torch.full_like(tokens_BL[:, :1], -100)], 1)

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            hidden_BLD = trainer.hidden_states(tokens_BL, positions_BL, model)
            stats = chunked_token_stats(hidden_BLD.reshape(-1, hidden_BLD.shape[-1]), trainer.head_weight(model),
                                        labels_BL.reshape(-1), want_entropy=False)
        return stats.logprobs.reshape(labels_BL.shape)[:, :-1].float()

    trainer = Trainer(make_spec(args, out_dir))
    dtype = getattr(torch, args["reference_dtype"])
    reference = trainer.reference
    # before any forward: FSDP leaves the last group unsharded after one (it does not reshard the head)
    held = {"policy": local_bytes(trainer.model), "reference": local_bytes(reference)}
    policy0 = [full(p) for p in trainer.model.parameters()]
    reference0 = [full(p) for p in reference.parameters()]
    lp_policy0, lp_reference0 = logprobs(trainer.model), logprobs(reference)
    train(trainer, 2)
    return {
        "dtypes": sorted({str(p.dtype) for p in reference.parameters()}),
        "requires_grad": any(p.requires_grad for p in reference.parameters()),
        "params_are_cast_policy": all(torch.equal(r, p.to(dtype)) for r, p in zip(reference0, policy0, strict=True)),
        "buffers_equal": all(torch.equal(full(a), full(b))
                             for a, b in zip(reference.buffers(), trainer.model.buffers(), strict=True)),
        "bytes": held,
        "lp_diff_max": float((lp_reference0 - lp_policy0).abs().max()),
        "lp_reference": lp_reference0.tolist(),
        "reference_unchanged": all(torch.equal(a, full(b)) for a, b in zip(reference0, reference.parameters())),
        "policy_moved": any(not torch.equal(p0, full(p)) for p0, p in zip(policy0, trainer.model.parameters())),
        "lp_reference_after_equal": torch.equal(logprobs(reference), lp_reference0),
        "grads_after_step": sum(p.grad is not None for p in trainer.model.parameters()),
        # the file each parameter's memory maps ("" for anonymous memory), as the kernel lists the mappings
        "storage_files": sorted({mapped_file((p.to_local() if isinstance(p, DTensor) else p).data_ptr())
                                 for p in reference.parameters() if p.numel()}),
    }


def mapped_file(address: int) -> str:
    """The file this process maps at `address` (/proc/self/maps), "" for anonymous memory (heap or mmap)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 and fields[5].startswith("/") else ""
    raise ValueError(f"address {address:#x} is not mapped")


def export_parity(trainer, out_dir: Path) -> dict:
    """Export HF buckets (collective), load them into transformers on rank 0, compare logits."""
    import torch
    import torch.distributed as dist

    tokens = global_batch(99).tokens_BL[:2, :24]
    ours = trainer.logits(tokens)  # collective forward
    buckets, bucket_bytes, hf_sd = 0, [], {}
    for bucket in trainer.export_weights():
        buckets += 1
        bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        hf_sd.update(bucket)
    if dist.get_rank() != 0:
        return {}
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # What a generator does with the buckets: HF files, loaded by transformers (which maps
    # per-expert names onto its fused expert tensors).
    export_dir = out_dir / "hf_export"
    export_dir.mkdir(exist_ok=True)
    save_file(hf_sd, export_dir / "model.safetensors", metadata={"format": "pt"})
    trainer.hf_config.save_pretrained(export_dir)
    hf_model, info = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32, output_loading_info=True)
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        start = AutoModelForCausalLM.from_pretrained(trainer.spec.model.hf_path)(tokens).logits if trainer.spec.model.hf_path else None
    return {
        "trained_vs_start": None if start is None else float((ours - start).abs().max()),
        "buckets": buckets, "bucket_bytes": bucket_bytes, "names": sorted(hf_sd),
        "missing": list(info["missing_keys"]),
        "unexpected": list(info["unexpected_keys"]),
        "max_abs_diff": float((ours - theirs).abs().max()),
        "logit_scale": float(ours.abs().max()),
    }


def run_scenario(scenario: str, out_dir: Path, args: dict[str, Any]) -> None:
    """Run `scenario_<name>` on this rank; rank 0 writes its result to out_dir/result.json."""
    import torch

    torch.set_num_threads(1)
    result = globals()[f"scenario_{scenario}"](out_dir, args)
    if os.environ["RANK"] == "0":
        tmp = out_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out_dir / "result.json")


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
