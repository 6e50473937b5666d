"""`Environment.step` and `close`, the last line of defence (issue 55): a reply never raises out of them.

An environment that raises on what a reply says ends that episode with reward 0 and the reason `env_error`
(resources released), text it answers with is made valid UTF-8, and `close` logs rather than raises; an
`EnvironmentFault` (the environment cannot answer any reply) still stops the run. The demo task's own
answer parsing takes replies of any length.
"""

from __future__ import annotations

import logging

import pytest

from composer_mesh.configs.records import ErrorKind
from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.envs.base import Environment, EnvironmentFault, Observation, assistant
from composer_mesh.envs.demo import DemoEnv


class Parser(Environment):
    """A user's environment with the usual bug: it trusts the reply's shape (`int(content)`), echoes a file name
    that is not UTF-8 as the host read it (surrogate escapes), and fails to release what it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[str] = []

    def _start(self, seed: int | None) -> Observation:
        self.held.append("workspace")
        return Observation([{"role": "user", "content": "Give a number."}])

    def _answer(self, action: dict, turn: int) -> Observation:
        content = str(action.get("content"))
        if content == "fault":
            raise EnvironmentFault("the sandbox is gone")
        value = int(content)
        return Observation([{"role": "user", "content": f"got {value} from caf{chr(0xDCE9)}.txt"}], reward=1.0)

    def _release(self) -> None:
        self.held.clear()
        raise OSError("the disk went away")


def test_an_exception_on_a_reply_ends_the_episode_with_env_error_and_releases_it(caplog):
    env = Parser()
    env.reset(seed=0)
    with caplog.at_level(logging.ERROR):
        obs = env.step(assistant("not a number"))
    assert obs.done and obs.reward == 0.0 and env.state.done and env.state.reward == 0.0
    assert obs.info["reason"] == "env_error" and obs.info["violation_kinds"] == {"env_error": 1}
    (site,) = obs.error_sites
    assert site.kind is ErrorKind.OTHER and env.state.messages[site.turn]["role"] == "assistant"
    assert "ValueError" in site.feedback
    assert env.held == [] and "raised" in caplog.text and "releasing episode" in caplog.text
    env.close()  # its release raises again: logged, not raised


def test_answers_are_valid_utf8_text_and_a_fault_is_not_swallowed():
    env = Parser()
    env.reset(seed=0)
    obs = env.step(assistant("7"))
    assert obs.messages[0]["content"] == "got 7 from caf\\udce9.txt" and env.state.messages[-1] == obs.messages[0]
    env.reset(seed=1)
    with pytest.raises(EnvironmentFault, match="the sandbox is gone"):
        env.step(assistant("fault"))


@pytest.mark.parametrize("digits", [400, 5000])
def test_the_demo_scores_an_answer_of_any_length(digits):
    """An integer answer too long for a float (over 1e308) or for int() (over 4300 digits) is well-formed and
    as far off as can be: the format reward, a test failure, no exception."""
    config = DemoTaskConfig()
    env = DemoEnv(config)
    env.reset(seed=3)
    obs = env.step(assistant("ANSWER: " + "9" * digits))
    assert obs.reward == config.format_reward and obs.error_sites[0].kind is ErrorKind.TEST_FAILURE
