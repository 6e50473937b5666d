"""Tiny offline model assets, deterministic from a seed.

`build_assets(cache_dir, seed)` writes three HF-format directories that load
with `HF_HUB_OFFLINE=1` (transformers, vLLM, TorchTitan via
`titan_ext.hf.read`):

- `tokenizer/`: a byte-level BPE (2048 tokens, Qwen2-style pre-tokenizer that
  splits digits) trained on `titan_ext/data/tokenizer_corpus.txt`, with a
  ChatML chat template that renders system/user/assistant/tool turns, tool
  definitions, assistant tool calls, tool results, and `{% generation %}`
  markers for assistant-token masks;
- `tiny/`: the dense tiny Qwen3 (`tiny.TINY_SHAPES["composer_tiny"]`);
- `tiny_moe/`: the tiny Qwen3-MoE (4 experts, top-2).

`hf_dir_for(model_cfg)` / `tokenizer_dir_for(model_cfg)` name the directories
a `[model]` section resolves to (building the assets on first use), so a
generator starts from exactly the trainer's initial weights.

Weights are TorchTitan's init under the seed, converted with TorchTitan's
state-dict adapter. Same seed -> byte-identical files. A stamp of all inputs
(corpus, these sources, library versions, seed) makes the call idempotent; a
file lock and an atomic rename make concurrent callers safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import safetensors
import tokenizers
import torch
import torchtitan
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.tiny import SPECIAL_TOKENS, TINY_MAX_SEQ_LEN, TINY_VOCAB_SIZE, TOOL_TOKENS

# Bumped when the files' format changes (docs/models.md lists the formats).
ASSETS_FORMAT = 2
_PACKAGE_DIR = Path(__file__).parent
CORPUS_PATH = _PACKAGE_DIR / "data" / "tokenizer_corpus.txt"
# The code that makes the assets (titan_ext/ paths): a change to any of them rebuilds them.
_SOURCES = ("tiny.py", "torchtitan_compat.py", "models.py", "build.py", "hf/adapters.py", "hf/config.py",
            "hf/derive.py", "hf/read.py", "hf/write.py")

# Qwen2/Qwen3 pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the name and arguments within <tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not (tools and loop.first) %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in (message.tool_calls or []) %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- raise_exception('unknown chat role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class AssetPaths:
    """HF-format directories of one build (each model dir also holds the tokenizer files)."""

    root: Path
    tokenizer_dir: Path
    dense_dir: Path
    moe_dir: Path


def default_cache_dir() -> Path:
    """$COMPOSER_MESH_CACHE/assets, else ~/.cache/composer-mesh/assets."""
    root = os.environ.get("COMPOSER_MESH_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "composer-mesh") / "assets"


def _paths_under(root: Path) -> AssetPaths:
    return AssetPaths(root=root, tokenizer_dir=root / "tokenizer", dense_dir=root / "tiny", moe_dir=root / "tiny_moe")


def asset_paths(cache_dir: Path, seed: int) -> AssetPaths:
    """Where `build_assets(cache_dir, seed)` puts its files."""
    return _paths_under(Path(cache_dir) / f"seed{seed}")


def build_tokenizer(corpus_path: Path = CORPUS_PATH, vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path)], trainer)
    # Tool/think markers take the last ids and stay in decoded text (not "special").
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus yields {tok.get_vocab_size()} tokens, not {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0],
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_MAX_SEQ_LEN,
        clean_up_tokenization_spaces=False,
    )


def _input_stamp(seed: int) -> str:
    """Hash of everything the assets depend on."""
    h = hashlib.sha256()
    h.update(f"format={ASSETS_FORMAT} seed={seed}".encode())
    for lib in (torch, transformers, tokenizers, safetensors, torchtitan):
        h.update(f"{lib.__name__}={getattr(lib, '__version__', '?')}".encode())
    for name in _SOURCES:
        h.update((_PACKAGE_DIR / name).read_bytes())
    for path in (CORPUS_PATH, Path(__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()


def _stamp_matches(root: Path, stamp: str) -> bool:
    try:
        return json.loads((root / "stamp.json").read_text())["inputs"] == stamp
    except (OSError, ValueError, KeyError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_model(out_dir: Path, flavour: str, seed: int, tokenizer_dir: Path) -> None:
    # lazy: the controller reads the assets' paths and never builds a model (titan_ext.spec)
    from composer_mesh.titan_ext.build import build_model
    from composer_mesh.titan_ext.hf.write import save_hf_dir
    from composer_mesh.titan_ext.models import resolve_model
    from composer_mesh.titan_ext.platform import detect_platform

    cfg = ModelConfig(flavour=flavour, seed=seed, device="cpu")
    platform = detect_platform("cpu")
    model = build_model(cfg, device="cpu", platform=platform)
    save_hf_dir(model, out_dir, resolve_model(cfg, platform).hf_config, tokenizer_dir=tokenizer_dir)


def _write_assets(paths: AssetPaths, seed: int) -> None:
    build_tokenizer().save_pretrained(paths.tokenizer_dir)
    _write_model(paths.dense_dir, "tiny", seed, paths.tokenizer_dir)
    _write_model(paths.moe_dir, "tiny_moe", seed, paths.tokenizer_dir)


def build_once(target: Path, stamp: str, write: Callable[[Path], None]) -> Path:
    """Make `target` by `write(tmp_dir)` unless its stamp.json already records `stamp`.

    Idempotent and safe for concurrent callers: a file lock next to `target`,
    then an atomic rename of the finished directory over any stale one.
    """
    if _stamp_matches(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _stamp_matches(target, stamp):
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-build-"))
        try:
            tmp.chmod(0o755)
            write(tmp)
            (tmp / "stamp.json").write_text(json.dumps({"inputs": stamp}, indent=2) + "\n")
            stale = None
            if target.exists():
                stale = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-stale-"))
                os.replace(target, stale / "old")
            os.replace(tmp, target)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def build_assets(cache_dir: Path, seed: int = 0) -> AssetPaths:
    """Build (or reuse) the tokenizer and the tiny dense and MoE checkpoints under cache_dir/seed<N>."""
    paths = asset_paths(Path(cache_dir), seed)
    build_once(paths.root, _input_stamp(seed), lambda tmp: _write_assets(_paths_under(tmp), seed))
    return paths


TINY_FLAVOUR_DIRS = {"tiny": "dense_dir", "tiny_moe": "moe_dir"}


def cache_dir_for(model_cfg: ModelConfig) -> Path:
    """The assets cache a `[model]` section uses."""
    return Path(model_cfg.assets_cache_dir) if model_cfg.assets_cache_dir else default_cache_dir()


def hf_dir_for(model_cfg: ModelConfig) -> Path | None:
    """The HF directory holding the weights `build_model(model_cfg)` starts from.

    hf_path when set; for the tiny flavours the built assets of the config's
    seed (built on first use); None for other flavours without a checkpoint.
    Generators load this so they start from the trainer's weights.
    """
    if model_cfg.hf_path:
        return Path(model_cfg.hf_path)
    flavour = model_cfg.registry_flavour()
    if flavour in TINY_FLAVOUR_DIRS:
        paths = build_assets(cache_dir_for(model_cfg), seed=model_cfg.seed)
        return getattr(paths, TINY_FLAVOUR_DIRS[flavour])
    return None


def tokenizer_dir_for(model_cfg: ModelConfig) -> Path:
    """tokenizer_path, else hf_path, else (tiny flavours) the built tiny tokenizer."""
    if model_cfg.tokenizer_path:
        return Path(model_cfg.tokenizer_path)
    if model_cfg.hf_path:
        return Path(model_cfg.hf_path)
    if model_cfg.registry_flavour() in TINY_FLAVOUR_DIRS:
        return build_assets(cache_dir_for(model_cfg), seed=model_cfg.seed).tokenizer_dir
    raise ValueError(f"model flavour {model_cfg.flavour!r} needs model.tokenizer_path or model.hf_path")
