"""`composer-mesh export`: a run's DCP checkpoint -> a complete HF directory that transformers loads and vLLM serves.

The run is made the way the trainer makes one: the model built from `hf_path`
by `[model]` alone (flavour "auto"), trained a few AdamW steps (weights move
away from the start), saved by the trainer's `Checkpointer` (DCP), and its
`[model]` recorded in `<run>/model.json`. The export runs as the CLI command
in a fresh process. vLLM's OpenAI server is started on the export with
`vllm serve` defaults (no `--runner`; only a KV-cache size for the CPU box).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.checkpoint import Checkpointer
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.hf.export import record_run_model
from test_models_byo import DENSE, save_random  # the sibling module's user checkpoint maker

REPO = Path(__file__).resolve().parents[2]
STEP = 3
TOL = 1e-4
pytestmark = pytest.mark.timeout(900)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "composer_mesh.mesh.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@torch.no_grad()
def _titan_logits(model, tokens_BL):
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    return model(tokens_BL, positions_BL, attention_masks(model, positions_BL))


# A user's Qwen3, not the project's assets: 4 layers, RoPE theta 1e4, eps 1e-5, 1024 positions; the tiny tokenizer.
USER_MODEL = dict(DENSE, vocab_size=2048, max_position_embeddings=1024, bos_token_id=0, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def base(tiny_assets, tmp_path_factory):
    from transformers import AutoTokenizer

    base_dir = save_random(tmp_path_factory.mktemp("user") / "qwen3", "qwen3", USER_MODEL, seed=5)
    AutoTokenizer.from_pretrained(tiny_assets.tokenizer_dir).save_pretrained(base_dir)
    return base_dir


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """A run directory with checkpoints of steps 2 and 3, and the trained model."""
    run_dir = tmp_path_factory.mktemp("run")
    model_cfg = ModelConfig(hf_path=str(base), device="cpu")
    model = build_model(model_cfg, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpointer = Checkpointer(CheckpointConfig(), run_dir / "checkpoints")
    gen = torch.Generator().manual_seed(0)
    positions_BL = torch.arange(16).expand(2, 16)
    for step in range(1, STEP + 1):
        tokens_BL = torch.randint(0, 2048, (2, 17), generator=gen)
        logits_BLV = model(tokens_BL[:, :-1], positions_BL, attention_masks(model, positions_BL))
        loss = torch.nn.functional.cross_entropy(logits_BLV.flatten(0, 1), tokens_BL[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= 2:
            checkpointer.save(step, model, optimizer, {"step": step})
    record_run_model(run_dir, model_cfg, run_dir / "checkpoints")
    return run_dir, model.eval()


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    run_dir, _ = run
    out = tmp_path_factory.mktemp("export") / "hf"
    done = _cli("export", str(run_dir), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported step {STEP}" in done.stdout
    return out


@pytest.mark.slow
def test_export_gives_the_trained_logits_in_transformers(run, exported, base):
    from transformers import AutoModelForCausalLM

    _, model = run
    tokens_BL = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_BLV = hf(tokens_BL).logits
        start_BLV = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(tokens_BL).logits
    trained_BLV = _titan_logits(model, tokens_BL)
    assert (hf_BLV - trained_BLV).abs().max() < TOL
    assert (start_BLV - trained_BLV).abs().max() > 1e-2  # the trained weights, not the starting checkpoint


@pytest.mark.slow
def test_export_directory_is_complete(exported, base):
    from transformers import AutoTokenizer, GenerationConfig

    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    start = json.loads((base / "config.json").read_text())  # the user's config.json, all of it, carried over
    assert {k: v for k, v in config.items() if k != "torch_dtype"} == start
    assert GenerationConfig.from_pretrained(exported).eos_token_id == 2
    tok = AutoTokenizer.from_pretrained(exported)
    chat = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert sorted(p.name for p in exported.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]


@pytest.mark.slow
def test_export_of_an_older_step_and_bad_requests(run, tmp_path, capsys):
    from composer_mesh.mesh.cli import main  # in this process: the same command, without another interpreter start

    run_dir, _ = run
    assert main(["export", str(run_dir), "--step", "2", "--dtype", "bfloat16", str(tmp_path / "s2")]) == 0
    assert "exported step 2" in capsys.readouterr().out
    config = json.loads((tmp_path / "s2" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "s2" / "model.safetensors").values()} == {torch.bfloat16}
    assert main(["export", str(run_dir), "--step", "7", str(tmp_path / "s7")]) == 1
    err = capsys.readouterr().err
    assert "no complete checkpoint of step 7" in err and "complete steps: [2, 3]" in err
    assert not (tmp_path / "s7").exists()
    assert main(["export", str(run_dir), str(tmp_path / "s2")]) == 2  # not empty now: nothing overwritten
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 1
    assert "model.json not found" in capsys.readouterr().err


@pytest.mark.parametrize("flavour, architecture", [("dense_dir", "Qwen3ForCausalLM"),
                                                     ("moe_dir", "Qwen3MoeForCausalLM")])
def test_built_assets_are_servable_directories(tiny_assets, flavour, architecture):
    """The assets carry what an export does (vLLM needs `architectures` to serve them as a chat model)."""
    from transformers import AutoTokenizer, GenerationConfig

    hf_dir = getattr(tiny_assets, flavour)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["dtype"] == config["torch_dtype"] == "float32"
    assert GenerationConfig.from_pretrained(hf_dir).eos_token_id == config["eos_token_id"] == 2
    assert AutoTokenizer.from_pretrained(hf_dir).chat_template


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def vllm_server(exported, tmp_path_factory, vllm_openai_server):
    """`python -m vllm.entrypoints.openai.api_server --model EXPORT` on loopback (one per module)."""
    server = vllm_openai_server(exported, tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield server.wait()
    finally:
        server.stop()


@pytest.mark.slow
def test_vllm_serves_the_export_as_a_chat_model(vllm_server, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, models = vllm_server
    assert models["data"][0]["max_model_len"] == 1024  # the user's max_position_embeddings
    name = models["data"][0]["id"]
    chat = _post(f"{url}/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 6, "temperature": 0,
    })
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 6 and chat["choices"][0]["finish_reason"] == "length"

    # The served weights are the export's: greedy continuation equal to transformers' on the same prompt.
    tok = AutoTokenizer.from_pretrained(exported)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(prompt):]
    assert chat["choices"][0]["message"]["content"] == tok.decode(ids, skip_special_tokens=True)
