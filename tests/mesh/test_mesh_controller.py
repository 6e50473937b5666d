"""The controller on real meshes: a one-process trainer mesh and in-process generator actors.

Sync mode: every trained group was sampled by the current weights (staleness 0),
generators hold the trainer's weights after each step (digest against the
trainer's own collective export), both the policy and the hint-distillation
channels carry loss. Async mode with a deliberately slow generator: groups
older than `max_staleness` versions are dropped, never trained on; a generator
whose call fails as a dead process's would is replaced and loads the published
weights, and every generator ends holding the trainer's weights of the version
it reports.
"""

from __future__ import annotations

import threading

import pytest

from composer_mesh.actors.generator import GeneratorActor
from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup, SamplingParams
from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.configs.sections.loss import LossConfig, PolicyLossConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.configs.sections.trainer import TrainerConfig
from monarch.actor import endpoint

pytestmark = pytest.mark.slow

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)


# Set by the test once the trainer is two versions ahead; in-process actors share this module.
RELEASE = threading.Event()


class DiesOnce:
    """A generator handle whose first `generate` call fails as a dead process's would (SupervisionError)."""

    def __init__(self, actor) -> None:
        self.actor, self.died = actor, False

    def __getattr__(self, name: str):
        if name == "generate" and not self.died:
            self.died = True
            return self
        return getattr(self.actor, name)

    def call_one(self, *args, **kwargs) -> "DiesOnce":
        return self

    def get(self, timeout=None):
        from composer_mesh.actors.monarch_compat import SupervisionError

        raise SupervisionError("generator process killed (test)")


class SlowGenerator(GeneratorActor):
    """A generator whose first call samples, and returns, only after the trainer moved two versions on."""

    @endpoint
    def generate(self, requests: list[EpisodeRequest], sampling: SamplingParams | None = None) -> list[RolloutGroup]:
        version = self.version  # the weights it holds when the call starts
        if not RELEASE.wait(timeout=300):
            raise TimeoutError("the trainer never got two versions ahead")
        return self.runner.run(list(requests), self.spec.generator.group_size, sampling or SAMPLING, version)


@pytest.fixture(scope="module")
def colocated(tiny_assets, gen_spec):
    """Colocated placement on one process: the trainer and a generator actor share it."""
    from composer_mesh.configs.sections.mesh import MeshConfig
    from composer_mesh.mesh.placement import place
    from composer_mesh.titan_ext.spec import TrainerSpec

    spec = TrainerSpec(
        model=ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir)),
        trainer=TrainerConfig(steps=50, microbatches=1, max_seq_len=160),
        optimizer=OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.0),
        loss=LossConfig(alpha=1.0, beta=1.0, policy=PolicyLossConfig(dynamic_sampling=False)),
        checkpoint=CheckpointConfig(enabled=False),
    )
    placement = place(MeshConfig(placement="colocated", trainer_procs=1), spec, gen_spec)
    yield placement
    placement.stop()


@pytest.fixture(scope="module")
def trainer_mesh(colocated):
    return colocated.trainer


@pytest.fixture(scope="module")
def gen_spec(make_generator_spec):
    """Groups of 3, two turns of at most 8 tokens, episodes within the trainer's 160-token rows."""
    return make_generator_spec(max_context_tokens=160, group_size=3, max_new_tokens=8, max_turns=2)


@pytest.fixture(scope="module")
def chat(tiny_assets):
    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import ChatTokens

    return ChatTokens(AutoTokenizer.from_pretrained(str(tiny_assets.dense_dir)))


def controller_config(tmp_path, **kw):
    from composer_mesh.mesh.controller import ControllerConfig

    return ControllerConfig(
        prompts_per_step=2, max_seq_len=160, policy=PolicyLossConfig(dynamic_sampling=False),
        weight_dir=str(tmp_path / "weights"), sampling=SAMPLING, **kw,
    )


def test_sync_mode_trains_on_policy_with_hints(colocated, trainer_mesh, chat, tmp_path):
    from composer_mesh.mesh.controller import Controller
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.replay.hints import TemplateHintGenerator

    [gen] = colocated.generators
    assert gen.info.call_one().get()["pid"] == colocated.trainer_setup[0]["pid"]  # one process, two roles
    digests = []
    ctl = Controller(controller_config(tmp_path, steps=2, mode="sync"), trainer_mesh, [gen], chat,
                     hinter=TemplateHintGenerator(),
                     on_step=lambda rec: digests.append((rank0(trainer_mesh.weights_digest.call().get()),
                                                         gen.weights_digest.call_one().get())))
    start = ctl.version
    history = ctl.run()
    assert [h.step for h in history] == [start + 1, start + 2]
    for h in history:
        assert h.staleness == [0, 0] and h.groups == 2
        assert h.metrics["policy/tokens"] > 0 and h.metrics["distill/tokens"] > 0
        assert h.metrics["distill/loss"] > 0 and h.metrics["distill/hinted"] == 6.0
    assert all(t == g for t, g in digests) and digests[0][0] != digests[1][0]
    assert gen.policy_version.call_one().get() == start + 2


def test_async_mode_never_trains_on_stale_samples(trainer_mesh, gen_spec, chat, tmp_path):
    from monarch.actor import this_proc

    from composer_mesh.mesh.controller import Controller
    from composer_mesh.mesh.supervision import Supervisor
    from composer_mesh.actors.mesh_utils import rank0

    fast = DiesOnce(this_proc().spawn("gen_fast", GeneratorActor, gen_spec))
    slow = this_proc().spawn("gen_slow", SlowGenerator, gen_spec)
    supervisor = Supervisor(1, lambda i: this_proc().spawn(f"gen_fast_r{i}", GeneratorActor, gen_spec))
    cfg = controller_config(tmp_path, steps=6, mode="async", max_staleness=1)
    start = trainer_mesh.slice(gpus=0).policy_version.call_one().get()
    digests = {start: rank0(trainer_mesh.weights_digest.call().get())}  # the trainer's weights per version

    def on_step(rec) -> None:
        digests[rec.step] = rank0(trainer_mesh.weights_digest.call().get())
        if rec.step >= start + 2:
            RELEASE.set()

    ctl = Controller(cfg, trainer_mesh, [fast, slow], chat, on_step=on_step, supervisor=supervisor)
    history = ctl.run()
    assert [h.step for h in history] == list(range(start + 1, start + 7))
    trained = [s for h in history for s in h.staleness]
    assert len(trained) == 12 and max(trained) <= 1
    assert sum(h.dropped_stale for h in history) >= 1  # the slow generator's groups came back too old
    seeds = [s for h in history for s in h.seeds]
    assert len(set(seeds)) == len(seeds)  # the dead generator's requests were re-issued, none trained twice
    assert [r.role for r in supervisor.restarts] == ["generator"] and ctl.generators[0] is not fast
    for g in ctl.generators:  # each holds exactly the trainer's weights of the version it reports
        assert g.weights_digest.call_one().get() == digests[g.policy_version.call_one().get()]


@pytest.fixture(scope="module")
def teacher_server():
    from composer_mesh.envs.demo import solve
    from composer_mesh.replay.server import TeacherServer

    with TeacherServer(lambda model, messages, params: solve(messages)) as server:
        yield server


def replay_spec(tmp_path, server, tiny_assets, min_entropy: float):
    from composer_mesh.actors.teacher_replay import ReplaySpec
    from composer_mesh.configs.sections.replay import GatingConfig, ReplayConfig
    from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig

    teachers = TeachersConfig(
        models=tuple(TeacherSpec(name=n, model=f"local-{n}", price_in_per_mtok=1.0, price_out_per_mtok=4.0, max_tokens=16)
                     for n in ("a", "b")),
        base_url=server.url, budget_usd=0.5, max_retries=1, backoff_base_s=0.05,
    )
    replay = ReplayConfig(output_dir=str(tmp_path / "replay"), min_agree=2, concurrency=4,
                          gating=GatingConfig(enabled=True, min_entropy=min_entropy, max_margin=0.0))
    return ReplaySpec(replay, teachers, tokenizer_dir=str(tiny_assets.dense_dir))


def test_teacher_replay_pairs_budget_and_gating(trainer_mesh, gen_spec, teacher_server, tiny_assets, tmp_path):
    from monarch.actor import this_proc

    from composer_mesh.actors.teacher_replay import TeacherReplayActor, rollout_states
    from composer_mesh.envs.demo import solve

    gen = this_proc().spawn("gen_replay", GeneratorActor, gen_spec)
    rollouts = [r for g in gen.generate.call_one([EpisodeRequest(0, 21)], SAMPLING).get() for r in g.rollouts]
    states = [s for r in rollouts for s in rollout_states(r)]
    assert len(states) == sum(len(r.error_sites) for r in rollouts) > 0

    replay = this_proc().spawn("replay_on", TeacherReplayActor, replay_spec(tmp_path / "on", teacher_server, tiny_assets, 0.0),
                               trainer_mesh)
    assert replay.add_rollouts.call_one(rollouts).get() == len(states)
    pairs = replay.next_pairs.call_one(3).get()
    assert len(pairs) == 3
    for p in pairs:  # consensus of both teachers (the solver) against the student's failed answer
        assert p.chosen["content"] == solve(list(p.context)) != p.rejected.get("content")
        assert p.agree == 2 and set(p.teachers) == {"a", "b"}
    status = replay.status.call_one().get()
    assert 0 < status["spend_usd"] <= status["budget_usd"] == 0.5
    assert status["pairs_made"] >= 3 and status["outcomes"]["pair"] == status["pairs_made"]

    # a policy that is never uncertain enough: everything is gated out, nothing is spent
    closed = this_proc().spawn("replay_off", TeacherReplayActor,
                               replay_spec(tmp_path / "off", teacher_server, tiny_assets, 1e9), trainer_mesh)
    closed.add_rollouts.call_one(rollouts).get()
    assert closed.next_pairs.call_one(2).get() == []
    off = closed.status.call_one().get()
    assert off["spend_usd"] == 0 and off["outcomes"] == {"gated_out": len(states)}

    # a bounded queue keeps the newest states
    import dataclasses

    small = dataclasses.replace(replay_spec(tmp_path / "small", teacher_server, tiny_assets, 0.0), max_queue=2)
    bounded = this_proc().spawn("replay_small", TeacherReplayActor, small, trainer_mesh)
    assert bounded.add_rollouts.call_one(rollouts).get() == 2

    # add_states; snapshot → restore into a fresh actor (what supervision does after a respawn)
    assert bounded.add_states.call_one(states[:1]).get() == 2
    snap = bounded.snapshot.call_one().get()
    assert repr(snap.queue) == repr([*states[-1:], states[0]])
    fresh = this_proc().spawn("replay_restored", TeacherReplayActor,
                              dataclasses.replace(small, replay=dataclasses.replace(
                                  small.replay, output_dir=str(tmp_path / "restored"))), trainer_mesh)
    assert fresh.restore.call_one(snap).get() == 2
    assert repr(fresh.snapshot.call_one().get()) == repr(snap)
    # set_trainer: gating scores through the mesh handed over (a restarted trainer) and still makes pairs
    replay.set_trainer.call_one(trainer_mesh).get()
    replay.add_rollouts.call_one(rollouts).get()
    before = replay.status.call_one().get()
    assert len(replay.next_pairs.call_one(before["pairs_ready"] + 1).get()) == before["pairs_ready"] + 1
    assert replay.status.call_one().get()["states_done"] > before["states_done"]  # new states were scored and replayed


def test_sync_mode_all_three_channels(trainer_mesh, gen_spec, teacher_server, tiny_assets, chat, tmp_path):
    from monarch.actor import this_proc

    from composer_mesh.actors.teacher_replay import TeacherReplayActor
    from composer_mesh.mesh.controller import Controller
    from composer_mesh.replay.hints import TemplateHintGenerator

    gen = this_proc().spawn("gen_three", GeneratorActor, gen_spec)
    replay = this_proc().spawn("replay_three", TeacherReplayActor,
                               replay_spec(tmp_path, teacher_server, tiny_assets, 0.0), trainer_mesh)
    cfg = controller_config(tmp_path, steps=2, mode="sync", pairs_per_step=2)
    history = Controller(cfg, trainer_mesh, [gen], chat, hinter=TemplateHintGenerator(), replay=replay).run()
    for h in history:
        m = h.metrics
        assert m["policy/tokens"] > 0 and m["distill/loss"] > 0
        assert m["preference/pairs"] == 2 and m["preference/loss"] > 0


def test_controller_config_is_built_from_the_recipe():
    """`ControllerConfig.from_job`: the one place the recipe's sections become controller settings."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.controller import ControllerConfig

    job = load_config("demo_cpu.toml", {"loss.alpha": 0.0, "trainer.eval_every": 5})
    cfg = ControllerConfig.from_job(job, steps=7, weight_dir="/w", state_dir="/s", replay=True)
    assert (cfg.steps, cfg.weight_dir, cfg.state_dir) == (7, "/w", "/s")
    assert (cfg.prompts_per_step, cfg.max_seq_len, cfg.mode, cfg.seed) == (8, 256, "sync", 0)
    assert cfg.policy is job.loss.policy and cfg.pairs_per_step == 8 and cfg.dpo_reference
    assert not cfg.hints and cfg.policy_channel and cfg.serving_dtype == job.generator.dtype
    assert cfg.tokens_per_request == 4 * 24 * 2 and cfg.deadline.floor_s == job.mesh.hang_floor_s
    assert (cfg.eval.every, cfg.eval.samples, cfg.eval.sampling.seed) == (5, 16, 0)
    assert ControllerConfig.from_job(job, steps=1, weight_dir="", state_dir="", replay=False).pairs_per_step == 0
