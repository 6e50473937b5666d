"""Tiny tokenizer: exact round trips, chat template, offline loading, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_mesh.titan_ext.tiny import TOKEN_IDS, TOOL_TOKENS

REPO = Path(__file__).resolve().parents[2]

SAMPLES = {
    "unicode": "Grüße, naïve café — 你好，世界！こんにちは 안녕 مرحبا שלום नमस्ते 👩‍💻👍🏽 ∑∫√∞ e\u0301 \u200b\u00a0end",
    "code": 'def f(x: int) -> str:\n\t"""Doc."""\n    if x  >= 10:   \n        return f"{x!r}"\r\n    return \'\\\\n\'\n\n\n',
    "json": json.dumps(
        {"name": "bash", "arguments": {"command": "ls -la | grep '.py'", "n": [1, 2.5e-3, None, True]}, "ü": "✓"},
        ensure_ascii=False,
        indent=2,
    ),
    "markup": "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call>  <think>x</think>",
    "spaces": "   leading and trailing   \n\n\n  ",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets.tokenizer_dir)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_exact(tokenizer, name):
    text = SAMPLES[name]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # The byte-level BPE compresses the text it was trained on (no byte-per-token fallback).
    if name in ("code", "json"):
        assert len(ids) < 0.7 * len(text.encode())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(max_size=200))
def test_round_trip_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens(tokenizer):
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == TOKEN_IDS["eos_token_id"]
    assert tokenizer.pad_token_id == TOKEN_IDS["pad_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == TOKEN_IDS["bos_token_id"]
    for token in ("<|im_start|>", "<|im_end|>", *TOOL_TOKENS):
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    # Role delimiters are special (skipped on request), tool markers stay in decoded text.
    ids = tokenizer("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"
    # Digits are split one per token (arithmetic tasks).
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]


CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "How many .py files?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls *.py"}}},
            {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
        ],
    },
    {"role": "tool", "content": "a.py\nb.py"},
    {"role": "tool", "content": "print('hi')"},
    {"role": "assistant", "content": "There are 2."},
]

EXPECTED = (
    "<|im_start|>system\nYou are a coding agent.<|im_end|>\n"
    "<|im_start|>user\nHow many .py files?<|im_end|>\n"
    "<|im_start|>assistant\nLet me look.\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls *.py"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\n<tool_response>\na.py\nb.py\n</tool_response><|im_end|>\n"
    "<|im_start|>tool\n<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThere are 2.<|im_end|>\n"
)


def test_chat_template_renders_all_roles(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED.split("<|im_start|>assistant")[0] + "<|im_start|>assistant\n"
    # A tool call without content (OpenAI style, content None) and plain {"name", "arguments"} calls.
    bare = [{"role": "assistant", "content": None, "tool_calls": [{"name": "t", "arguments": {}}]}]
    assert tokenizer.apply_chat_template(bare, tokenize=False) == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_chat_template_tools_and_assistant_mask(tokenizer):
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert json.dumps(tools[0]) in text and text.count("<|im_start|>system") == 1
    out = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert assistant_text == (
        "Let me look.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls *.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>'
        "There are 2.<|im_end|>"
    )
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "stamp.json"
    }


def test_cli_build_offline_deterministic_idempotent(tiny_assets, tmp_path):
    """In a fresh process with HF_HUB_OFFLINE=1: `composer-mesh assets build`, then transformers loads
    the tokenizer and both models from disk; the files are byte-identical to the session's build."""
    from composer_mesh.titan_ext.assets import build_assets

    script = f"""
import torch
from composer_mesh.mesh.cli import main
assert main(["assets", "build", "--cache-dir", {str(tmp_path)!r}, "--seed", "0"]) == 0
from transformers import AutoModelForCausalLM, AutoTokenizer
root = {str(tmp_path / "seed0")!r}
for d in ("tokenizer", "tiny", "tiny_moe"):
    tok = AutoTokenizer.from_pretrained(f"{{root}}/{{d}}")
    assert tok.decode(tok("hi ✓")["input_ids"]) == "hi ✓"
for d in ("tiny", "tiny_moe"):
    model = AutoModelForCausalLM.from_pretrained(f"{{root}}/{{d}}")
    out = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6), out.shape
print("offline ok")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_ENDPOINT", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    built = tmp_path / "seed0"
    assert str(built / "tiny") in result.stdout and "model.safetensors" in result.stdout
    assert result.stdout.strip().endswith("offline ok")
    assert _digests(built) == _digests(tiny_assets.root)
    mtime = (built / "tiny" / "model.safetensors").stat().st_mtime_ns
    assert build_assets(tmp_path, seed=0).dense_dir == built / "tiny"
    assert (built / "tiny" / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_other_seed_changes_weights_only(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    from composer_mesh.titan_ext.assets import build_assets

    other = build_assets(tmp_path, seed=1)
    assert _digests(other.tokenizer_dir) == _digests(tiny_assets.tokenizer_dir)
    a = load_file(tiny_assets.dense_dir / "model.safetensors")
    b = load_file(other.dense_dir / "model.safetensors")
    assert a.keys() == b.keys()
    assert not any((a[k] == b[k]).all() for k in a if k.endswith("q_proj.weight"))
