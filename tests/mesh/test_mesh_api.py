"""The public Python API (`mesh.api.Run`) on real local meshes: step by step with sampling and held-out
evaluation in between trains exactly as `run()` does, and a Run cleans up after itself.

Two in-process runs of the same shortened demo_cpu recipe and seed: A steps by hand and calls
`generate` and `evaluate` between the steps, B calls `run()` on processes `mesh.prespawn` started
before it (as `composer-mesh train` does): its roles run on those processes. Their training metrics and final
weights must be bitwise equal (sampling and evaluation draw from their own seeded streams). A's
`export_hf` output loads with transformers and equals B's final `hf/` weights; after `stop()`
no actor process is alive and the shared-memory weight folder is gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from test_mesh_train import RECIPE, REPO

STEPS = 2


def _recipe(tmp: Path) -> Path:
    recipe = tmp / "demo.toml"
    recipe.write_text(RECIPE.format(repo=REPO, out=tmp / "runs"))
    return recipe


def _trained(rows: list[dict]) -> list[dict]:
    """Training figures only: no wall-clock times."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "seconds"} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_assets):
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.api import Run
    from composer_mesh.mesh.prespawn import prespawn

    os.environ["COMPOSER_MESH_CACHE"] = str(tiny_assets.root.parents[1])  # the suite's assets: no rebuild
    overrides = {"trainer.steps": STEPS, "trainer.eval_every": 0, "checkpoint.every_steps": STEPS}
    tmp_a, tmp_b = tmp_path_factory.mktemp("api_a"), tmp_path_factory.mktemp("api_b")
    out: dict = {}
    with Run.from_toml(_recipe(tmp_a), overrides, resume=False) as a:
        out["records"] = [a.step()]
        out["texts"] = a.generate(["What is 2 + 3?", [{"role": "user", "content": "What is 1 + 1?"}]],
                                  max_new_tokens=6)
        out["eval"] = a.evaluate()
        out["records"].append(a.step())
        with pytest.raises(RuntimeError, match="trainer.steps = 2"):
            a.step()
        out["export"] = a.export_hf(tmp_a / "export")
        out["a_metrics"] = a.metrics
        out["summary_a"] = a.run()  # nothing left to train: finishes (final checkpoint, hf/) and summarises
        pids = json.loads((a.run_dir / "processes.json").read_text())
        weight_dir = a._launch.weight_dir
    out["pids"], out["weight_dir"] = pids, weight_dir
    # B on processes started before the Run, as `composer-mesh train` does (mesh.prespawn)
    early = prespawn(load_config(_recipe(tmp_b), overrides))
    out["early_pids"] = list(early.wait())
    # forked by the fork server ([mesh] fork_server, the default), which lives until the run's stop
    out["server_pid"] = early.server.proc.pid
    out["early_parents"] = [int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                            for p in out["early_pids"]]
    with Run(load_config(_recipe(tmp_b), overrides), resume=False, early=early) as b:
        out["summary_b"] = b.run()
        out["b_metrics"] = b.metrics
        out["pids_b"] = json.loads((b.run_dir / "processes.json").read_text())
    return out


@pytest.mark.slow
def test_stepping_with_generate_and_evaluate_trains_as_run(runs):
    from safetensors.torch import load_file

    assert [r.step for r in runs["records"]] == [1, 2]
    assert len(runs["a_metrics"]) == len(runs["b_metrics"]) == STEPS
    assert _trained(runs["a_metrics"]) == _trained(runs["b_metrics"])
    a, b = (load_file(Path(runs[k]["hf"]) / "model.safetensors") for k in ("summary_a", "summary_b"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    for key in ("steps_run", "final_step"):
        assert runs["summary_a"][key] == runs["summary_b"][key] == STEPS
    rows = [json.loads(x) for x in (Path(runs["summary_a"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert _trained(rows) == _trained(runs["a_metrics"])  # the API's metrics are the log's rows


@pytest.mark.slow
def test_prespawned_processes_run_the_roles(runs):
    # B's trainer and generator are the processes prespawn started, forked by the fork server, and it trained as
    # A did on fresh interpreters (the first test)
    pids = runs["pids_b"]
    assert len(runs["early_pids"]) == 2
    assert runs["early_parents"] == [runs["server_pid"]] * 2
    assert sorted(pids["trainer"] + pids["generator"]) == sorted(runs["early_pids"])


@pytest.mark.slow
def test_generate_evaluate_and_export(runs):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    texts = runs["texts"]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert not any("<|im_start|>" in t or "<|im_end|>" in t for t in texts)  # decoded without special tokens
    ev = runs["eval"]
    assert ev["step"] == 1.0 and ev["eval/policy_version"] == 1.0
    assert 0.0 <= ev["eval/heldout_greedy"] <= 1.0 and 0.0 <= ev["eval/heldout_sampled"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(runs["export"])  # exported after step 2: the final weights
    final = load_file(Path(runs["summary_a"]["hf"]) / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())


@pytest.mark.slow
def test_stop_removes_actors_and_shared_memory(runs):
    assert runs["weight_dir"] and not Path(runs["weight_dir"]).exists()
    pids = [p for role, ps in runs["pids"].items() if role != "controller" for p in ps]  # the controller: this test
    assert len(pids) == 3  # trainer, generator, replay
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert not alive, f"actor processes still alive after stop(): {alive}"


def test_overrides_name_the_key(tmp_path):
    from composer_mesh.configs.loader import ConfigError
    from composer_mesh.mesh.api import Run

    recipe = _recipe(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer\.stepz.*did you mean 'steps'"):
        Run.from_toml(recipe, {"trainer.stepz": 3})
    with pytest.raises(ConfigError, match=r"trainer\.steps"):
        Run.from_toml(recipe, {"trainer.steps": "many"})
    run = Run.from_toml(recipe, ["--trainer.steps=3", "--generator.max_new_tokens=4"])
    assert (run.job.trainer.steps, run.job.generator.max_new_tokens) == (3, 4)
    assert Run.from_toml(recipe, {"job.name": "x y", "loss.alpha": 0.5}).job.job.name == "x y"


@pytest.mark.slow
def test_summary_timeline_is_the_run_in_order(runs):
    """summary.json's `timeline_s`: this process's age at the end of each phase, in order; A's steps ran
    through `step()`, before its `run()`, so its timeline has no step marks."""
    b = runs["summary_b"]["timeline_s"]
    assert list(b) == ["imports", "checks", "placed", "ready", "first_step", "steps", "final"], b
    assert all(0 < x <= y for x, y in zip(list(b.values()), list(b.values())[1:])), b
    a = runs["summary_a"]["timeline_s"]
    assert list(a) == ["imports", "checks", "placed", "ready", "steps", "final"], a
    assert a["final"] < b["imports"]  # one test process: B's run started after A's ended
