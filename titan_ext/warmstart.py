"""A briefly pre-trained *base* model: supervised fine-tuning of an HF checkpoint on chat conversations.

RL needs a policy that sometimes earns reward. A random-init tiny model never
writes a task's answer format, so every group has equal rewards and GRPO has
nothing to learn from. `warm_start_dir` turns an HF directory (e.g. the tiny
assets) into a base model that knows the chat template and a format, by a
short, deterministic SFT run on given conversations (loss on assistant tokens
only, AdamW, a fixed thread count, a few seconds for the tiny model). What the
base model learns is exactly what the conversations teach: the demo feeds it
format-only examples whose answers are independent of the problem
(`envs.demo.format_examples`), so the task itself is left for RL.

The SFT runs in a process of its own on kernels pinned to what every x86-64
CPU has (`titan_ext.platform.run_pinned`: ATen's baseline build, MKL's
reproducible SSE2 branch, libm without FMA, oneDNN off): the floats a CPU's
AVX2, AVX-512 or AMX kernels would round otherwise grow, over a few hundred
steps at a high rate, into another base. So the same inputs give the same
bytes on every x86-64 CPU (with the same torch and glibc); `warm_start.json`
records their sha256 for comparing bases across machines.

The result is cached under `root/<hash of source weights, conversations and
config>` (same inputs → the same directory, built once; `assets.build_once`).
A base built so can ship with the package (`data/bases/`, `ship_base`; the
main job's: `composer-mesh assets ship-base configs/coding_cpu.toml`): a warm
start with the same inputs copies it, checked by its sha256, instead of
training (the main job's 300 steps take ~8 minutes on the pinned kernels on
2 cores).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.assets import build_once
from composer_mesh.titan_ext.platform import PINNED_KERNELS, detect_platform, pin_kernels, run_pinned, torch_threads


@dataclass(frozen=True)
class WarmStartConfig:
    """SFT run size; `steps = 0` means no warm start."""

    steps: int = 60
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    # linear decay of the learning rate to 0 over `steps` (else constant)
    decay: bool = False
    # clip the gradient's global L2 norm to this before each step; 0 = no clipping
    grad_clip: float = 0.0
    # torch's intra-op threads for the run, whatever the machine's cores: how a matmul or a reduction splits
    # over threads changes its float rounding, and 300 steps at a high rate grow that into another base
    # (docs/coding.md, "Eleventh round"); with the pinned kernels, every x86-64 machine builds the same base
    threads: int = 2


def sft_rows(tokenizer: Any, conversations: Sequence[list[dict]],
             tools: list[dict] | None = None) -> list[tuple[list[int], list[bool]]]:
    """Each conversation rendered with the chat template (and `tools`' schemas) as (ids, assistant-token mask)."""
    rows = []
    for messages in conversations:
        out = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        mask = [bool(m) for m in out["assistant_masks"]]
        if not any(mask):
            raise ValueError("a warm-start conversation has no assistant tokens")
        rows.append((list(out["input_ids"]), mask))
    return rows


def sft_batch(rows: Sequence[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `[B, L]` ids and next-token labels (-100 off the assistant tokens)."""
    L = max(len(ids) for ids, _ in rows)
    tokens_BL = torch.zeros(len(rows), L, dtype=torch.long)
    labels_BL = torch.full((len(rows), L), -100, dtype=torch.long)
    for b, (ids, mask) in enumerate(rows):
        ids_T = torch.tensor(ids)
        tokens_BL[b, : len(ids)] = ids_T
        labels_BL[b, : len(ids) - 1] = torch.where(torch.tensor(mask[1:]), ids_T[1:], -100)
    return tokens_BL, labels_BL


class _HeadOnRows(torch.autograd.Function):
    """The LM head on the rows `keep_BL` selects (logits `[N, V]`), with the gradients of the head over every row
    (the others' are zero) bit for bit on CPU (tests/titan_ext/test_warmstart_format.py): the hidden states'
    through the same per-row product, the weight's through the same `[D, B*L] @ [B*L, V]` product over the
    zero-padded logit gradient (a product over the kept rows alone sums in another order). Saves the head's
    forward and input-gradient products on the prompt rows."""

    @staticmethod
    def forward(ctx: Any, hidden_BLD: torch.Tensor, weight_VD: torch.Tensor, keep_BL: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden_BLD, weight_VD, keep_BL)
        return F.linear(hidden_BLD[keep_BL], weight_VD)

    @staticmethod
    def backward(ctx: Any, grad_NV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        hidden_BLD, weight_VD, keep_BL = ctx.saved_tensors
        (B, L, D), V = hidden_BLD.shape, weight_VD.shape[0]
        grad_hidden_BLD = hidden_BLD.new_zeros(B, L, D)
        grad_hidden_BLD[keep_BL] = grad_NV @ weight_VD
        grad_BLV = grad_NV.new_zeros(B, L, V)
        grad_BLV[keep_BL] = grad_NV
        grad_weight_VD = torch.mm(hidden_BLD.reshape(-1, D).t(), grad_BLV.reshape(-1, V)).t()
        return grad_hidden_BLD, grad_weight_VD, None


def sft(model: torch.nn.Module, rows: Sequence[tuple[list[int], list[bool]]], cfg: WarmStartConfig) -> list[float]:
    """`cfg.steps` AdamW steps on batches drawn (seeded) from `rows`, on `cfg.threads` torch threads;
    returns the loss per step.

    `model` is a TorchTitan decoder. The loss is the token-mean cross entropy of the assistant tokens, with the
    very gradients of that loss over full `[B, L, V]` logits: log-softmax is per row, so only the assistant rows
    get logits (`_HeadOnRows`; a sixth of a tool-loop row, the rest is prompt). Each row is one conversation, so
    attention takes SDPA's causal path (`titan_ext.attention.attention_masks`).
    """
    # lazy: TorchTitan's attention (titan_ext.spec says why)
    from composer_mesh.titan_ext.attention import attention_masks
    from composer_mesh.titan_ext.torchtitan_compat import skip_lm_head

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / cfg.steps if cfg.decay else 1.0)
    skipped = model._skip_lm_head
    skip_lm_head(model)
    model.train()
    losses = []
    try:
        with torch_threads(cfg.threads):
            for _ in range(cfg.steps):
                pick = torch.randint(len(rows), (min(cfg.batch_size, len(rows)),), generator=gen)
                tokens_BL, labels_BL = sft_batch([rows[int(i)] for i in pick])
                positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
                hidden_BLD = model(tokens_BL, positions_BL, attention_masks(model, positions_BL))
                keep_BL = labels_BL != -100
                logits_NV = _HeadOnRows.apply(hidden_BLD, model.lm_head.weight, keep_BL)
                loss = F.cross_entropy(logits_NV.float(), labels_BL[keep_BL])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                decay.step()
                losses.append(float(loss.detach()))
    finally:
        model._skip_lm_head = skipped
    return losses


# bases shipped with the package: `<name>.safetensors` beside its card `<name>.json` (`ship_base`)
SHIPPED_BASES = Path(__file__).parent / "data" / "bases"
# where the source weights, tokenizer and caches lie: their contents are hashed instead
_PATH_FIELDS = ("hf_path", "tokenizer_path", "assets_cache_dir")


def _stamp(model_cfg: ModelConfig, src_dir: Path, conversations: Sequence[list[dict]], cfg: WarmStartConfig,
           tools: list[dict] | None) -> str:
    """The hash of everything the base's bytes depend on: the source directory's files (not where it lies, so a
    cache or a checkout can move), the model and SFT configs, the conversations, the pinned kernels, the SFT code."""
    h = hashlib.sha256()
    model = {k: v for k, v in asdict(model_cfg).items() if k not in _PATH_FIELDS}
    inputs = {"model": model, "config": asdict(cfg), "conversations": list(conversations), "kernels": PINNED_KERNELS}
    h.update(json.dumps({**inputs, **({"tools": tools} if tools else {})}, sort_keys=True).encode())
    for f in sorted(src_dir.iterdir()):
        if f.is_file() and f.name != "stamp.json":
            h.update(f.name.encode() + f.read_bytes())
    # the code that turns those inputs into bytes, every piece `sft` runs (not this module's docs: a shipped base
    # outlives an edit of them)
    for code in (WarmStartConfig, sft_rows, sft_batch, _HeadOnRows, sft, _main):
        h.update(inspect.getsource(code).encode())
    return h.hexdigest()


class WarmStartRequest(NamedTuple):
    """The inputs of one warm start (a job's: `mesh.launch.warm_start_request`)."""

    model: ModelConfig
    conversations: list[list[dict]]
    config: WarmStartConfig
    tools: list[dict] | None


def warm_start_dir(
    model_cfg: ModelConfig, conversations: Sequence[list[dict]], cfg: WarmStartConfig, root: str | Path,
    tools: list[dict] | None = None, shipped: bool = True,
) -> Path:
    """The HF directory of `model_cfg`'s model (weights and tokenizer from its `hf_path`) after SFT on
    `conversations` (rendered with `tools`' schemas when given: a tool-loop task's prompt), built once under `root`:
    a shipped base with these inputs, checked by digest (`shipped_base`; unless `shipped` is False), else trained by
    a process on the pinned kernels."""
    stamp = warm_start_stamp(model_cfg, conversations, cfg, tools)
    src_dir = Path(model_cfg.hf_path)

    def write(tmp: Path) -> None:
        found = shipped_base(stamp) if shipped else None
        if found is not None:
            weights, card = found
            shutil.copyfile(weights, tmp / "model.safetensors")
            losses, origin = [card["loss_first"], card["loss_last"]], {"shipped": weights.name}
        else:
            rows = sft_rows(AutoTokenizer.from_pretrained(src_dir), conversations, tools)
            losses, origin = _sft_pinned(dataclasses.replace(model_cfg, device="cpu"), rows, cfg, tmp), {}
        digests = {f.name: _sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
        # tokenizer and generation config travel with the weights
        for f in sorted(src_dir.iterdir()):
            if f.is_file() and not (tmp / f.name).exists() and f.name != "stamp.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "warm_start.json").write_text(json.dumps(
            {"source": str(src_dir), "config": asdict(cfg), "conversations": len(conversations),
             "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
             "sha256": digests, "kernels": PINNED_KERNELS, "torch": torch.__version__, **origin}, indent=2))

    return build_once(Path(root) / f"warm-{stamp[:16]}", stamp, write)


def warm_start_stamp(model_cfg: ModelConfig, conversations: Sequence[list[dict]], cfg: WarmStartConfig,
                     tools: list[dict] | None = None) -> str:
    """The hash naming the base `warm_start_dir` makes of these inputs (its cache key and a shipped base's)."""
    if not model_cfg.hf_path:
        raise ValueError("warm start needs model.hf_path (the weights and tokenizer to start from)")
    if not conversations:
        raise ValueError("warm start needs at least one conversation")
    return _stamp(model_cfg, Path(model_cfg.hf_path), conversations, cfg, tools)


def shipped_base(stamp: str, bases: Path | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The shipped weights (in `bases`, default `SHIPPED_BASES`) whose card records `stamp`, and the card; None when
    none matches. A base whose bytes differ from its card's sha256 raises (a damaged checkout would otherwise train
    from other weights)."""
    for card_path in sorted((SHIPPED_BASES if bases is None else bases).glob("*.json")):
        card = json.loads(card_path.read_text())
        if card.get("stamp") != stamp:
            continue
        weights = card_path.with_suffix(".safetensors")
        got = _sha256(weights) if weights.is_file() else "missing"
        if got != card["sha256"]:
            raise RuntimeError(f"shipped base {weights}: sha256 {got}, not the {card['sha256']} its card "
                               f"{card_path.name} records; restore it (`git checkout -- {weights.name}`) or rebuild "
                               "it (`composer-mesh assets ship-base RECIPE`)")
        return weights, card
    return None


def ship_base(warm_dir: Path, name: str, bases: Path | None = None) -> Path:
    """Copy the base a pinned warm start built in `warm_dir` to `<bases>/<name>.safetensors` (default
    `SHIPPED_BASES`) with its card (stamp, sha256, losses, kernels, torch): later warm starts with the same inputs
    copy it instead of training."""
    bases = SHIPPED_BASES if bases is None else bases
    info = json.loads((warm_dir / "warm_start.json").read_text())
    if "shipped" in info:
        raise ValueError(f"{warm_dir} holds a copy of a shipped base, not one trained here: rebuild it first")
    bases.mkdir(parents=True, exist_ok=True)
    weights = bases / f"{name}.safetensors"
    shutil.copyfile(warm_dir / "model.safetensors", weights)
    card = {"stamp": json.loads((warm_dir / "stamp.json").read_text())["inputs"], "sha256": _sha256(weights),
            **{k: info[k] for k in ("config", "conversations", "loss_first", "loss_last", "kernels", "torch")}}
    weights.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")
    return weights


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sft_pinned(model_cfg: ModelConfig, rows: list[tuple[list[int], list[bool]]], cfg: WarmStartConfig,
                out: Path) -> list[float]:
    """`sft` of `model_cfg`'s model on `rows`, its weights written to `out`, in a process on the pinned kernels
    (`_main` below); returns the loss per step."""
    with tempfile.TemporaryDirectory(prefix="warm-start-") as scratch:
        request, losses = Path(scratch) / "request.json", Path(scratch) / "losses.json"
        request.write_text(json.dumps({"model": asdict(model_cfg), "rows": rows, "config": asdict(cfg),
                                       "out": str(out), "losses": str(losses)}))
        run_pinned(["-m", __spec__.name, str(request)])
        return json.loads(losses.read_text())


def _main(request_path: str) -> None:
    """The pinned process of `_sft_pinned`: check the pin, build the model from its `hf_path`, SFT, save."""
    # lazy: only this process builds a model; to the controller a warm start is a path (titan_ext.spec)
    from composer_mesh.titan_ext.build import build_model
    from composer_mesh.titan_ext.hf.write import save_hf_weights
    from composer_mesh.titan_ext.models import resolve_model

    request = json.loads(Path(request_path).read_text())
    cfg, model_cfg = WarmStartConfig(**request["config"]), ModelConfig(**request["model"])
    pin_kernels()
    platform = detect_platform("cpu")
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device="cpu", platform=platform)
    losses = sft(model, [(ids, mask) for ids, mask in request["rows"]], cfg)
    save_hf_weights(model, Path(request["out"]), resolve_model(model_cfg, platform).hf_config)
    Path(request["losses"]).write_text(json.dumps(losses))


if __name__ == "__main__":
    _main(*sys.argv[1:])
