"""The CPU demo task: shaped reward against a reference written from its definition, splits, solver, episodes."""

from __future__ import annotations

import dataclasses
import hashlib
import random

import pytest

from composer_mesh.configs.loader import loads_config
from composer_mesh.configs.records import ErrorKind
from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.envs.base import assistant
from composer_mesh.envs.demo import DemoEnv, Problem, make_problem, prompt_messages, score, solve, split_of

CONFIG = DemoTaskConfig(ops=("add", "sub", "mul", "max", "reverse"), max_operand=9, heldout_fraction=0.25)


def reference_reward(reply: str, answer: str, numeric: bool, fmt: float, scale: float) -> float:
    """Independent restatement: 0 malformed (well-formed: a line `ANSWER: <value>`, exactly one space after the
    colon, surrounding whitespace allowed); 1 exact; else fmt + (1 - fmt) * 0.5 * closeness."""
    lines = [ln.strip() for ln in reply.splitlines()]
    value = next((ln[len("ANSWER: "):] for ln in lines if ln.startswith("ANSWER: ")), None)
    if not value or any(c.isspace() for c in value):
        return 0.0
    if numeric:
        try:
            got = int(value)
        except ValueError:
            return 0.0
        if str(got) != value:
            return 0.0
        if value == answer:
            return 1.0
        return fmt + (1 - fmt) * 0.5 * max(0.0, 1 - abs(got - int(answer)) / scale)
    if not value.isalpha():
        return 0.0
    if value == answer:
        return 1.0
    same = sum(1 for i in range(min(len(value), len(answer))) if value[i] == answer[i])
    return fmt + (1 - fmt) * 0.5 * same / max(len(value), len(answer))


def test_reward_matches_reference_on_random_replies():
    rng = random.Random(0)
    for seed in range(400):
        p = make_problem(seed, CONFIG)
        numeric = p.op != "reverse"
        candidates = [
            f"ANSWER: {p.answer}",
            f"ANSWER: {int(p.answer) + rng.randint(-8, 8)}" if numeric else f"ANSWER: {p.answer[::-1]}x",
            f"ANSWER:{rng.choice(['', ' ', '  ', chr(9)])}{rng.randint(-20, 90)}",
            f"  ANSWER: {p.answer}  \n",
            "ANSWER: " + "".join(rng.choice("abcxyz") for _ in range(3)),
            rng.choice(["", "42", "answer: 3", "ANSWER 3", "ANSWER: 3 4", "The answer is 7"]),
            f"thinking...\nANSWER: {p.answer}\n",
        ]
        for reply in candidates:
            got = score(reply, p, CONFIG).reward
            want = reference_reward(reply, p.answer, numeric, CONFIG.format_reward, CONFIG.closeness_scale)
            assert got == pytest.approx(want, abs=1e-12), (p.text, reply)


def test_reward_is_ordered_malformed_wrong_close_exact():
    p = Problem("add", 4, 3)
    r = [score(s, p, CONFIG).reward for s in ("7", "ANSWER: 40", "ANSWER: 9", "ANSWER: 8", "ANSWER: 7")]
    assert r[0] == 0.0 < r[1] == CONFIG.format_reward < r[2] < r[3] < r[4] == 1.0
    assert score("ANSWER:  7", p, CONFIG).reward == score("ANSWER:7", p, CONFIG).reward == 0.0  # one space exactly


def test_splits_are_disjoint_deterministic_and_cover_the_space():
    train = {make_problem(s, CONFIG, "train").text for s in range(3000)}
    held = {make_problem(s, CONFIG, "heldout").text for s in range(3000)}
    assert train.isdisjoint(held)
    assert all(split_of(Problem.parse(t), CONFIG) == "heldout" for t in held)
    assert [make_problem(s, CONFIG).text for s in range(50)] == [make_problem(s, CONFIG).text for s in range(50)]
    numeric = DemoTaskConfig(ops=("add",), max_operand=9, heldout_fraction=0.2)
    all_train = {make_problem(s, numeric, "train").text for s in range(5000)}
    all_held = {make_problem(s, numeric, "heldout").text for s in range(5000)}
    assert len(all_train) + len(all_held) == 100  # every a+b with a, b in 0..9, each in one split
    assert 10 <= len(all_held) <= 30


def _reference_bin(key: str, heldout: float, validation: float) -> str:
    """The split rule written out: the first 8 bytes of sha256(key), big-endian, as a fraction of 2**64."""
    u = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / float(1 << 64)
    return "heldout" if u < heldout else ("validation" if u < heldout + validation else "train")


def test_validation_split_is_carved_out_of_train_and_never_moves_a_heldout_problem():
    base = DemoTaskConfig(ops=("add",), max_operand=9, heldout_fraction=0.2)
    carved = dataclasses.replace(base, validation_fraction=0.25)
    space = [Problem("add", a, b) for a in range(10) for b in range(10)]
    for p in space:
        assert split_of(p, carved) == _reference_bin(p.text, 0.2, 0.25)
        assert split_of(p, base) == _reference_bin(p.text, 0.2, 0.0)
        assert (split_of(p, carved) == "heldout") == (split_of(p, base) == "heldout")
    by_split = {s: {make_problem(i, carved, s).text for i in range(3000)} for s in ("train", "validation", "heldout")}
    assert by_split["heldout"] == {make_problem(i, base, "heldout").text for i in range(3000)}
    assert sum(map(len, by_split.values())) == 100 and all(by_split.values())  # disjoint, covering, none empty
    assert 10 <= len(by_split["validation"]) <= 40
    with pytest.raises(ValueError, match="no validation problem"):
        make_problem(0, base, "validation")
    with pytest.raises(ValueError, match="env.demo.heldout_fraction \\+ validation_fraction"):
        DemoTaskConfig(heldout_fraction=0.5, validation_fraction=0.5)


def test_max_problems_read_answer_and_split_like_the_others():
    ops = DemoTaskConfig(ops=("max",), max_operand=9, heldout_fraction=0.2)
    seen = {make_problem(s, ops, split).text for s in range(5000) for split in ("train", "heldout")}
    assert seen == {f"max({a},{b})" for a in range(10) for b in range(10)}
    for text in seen:
        a, b = (int(x) for x in text[4:-1].split(","))
        p = Problem.parse(text)
        assert (p.op, p.a, p.b, p.text) == ("max", a, b, text)
        assert p.answer == str(a if a >= b else b)
        assert score(f"ANSWER: {p.answer}", p, ops).reward == 1.0
    with pytest.raises(ValueError, match="not a demo problem"):
        Problem.parse("max(3 7)")


def test_solver_answers_every_problem_and_retries():
    for split in ("train", "heldout"):
        for seed in range(300):
            p = make_problem(seed, CONFIG, split)
            msgs = prompt_messages(p)
            assert score(solve(msgs), p, CONFIG).reward == 1.0
            retry = msgs + [assistant("ANSWER: oops"), {"role": "user", "content": "Format error"}]
            assert solve(retry) == solve(msgs)


def test_episode_feedback_and_error_sites():
    env = DemoEnv(DemoTaskConfig(max_turns=3))
    obs = env.reset(seed=5)
    assert [m["role"] for m in obs.messages] == ["system", "user"]
    obs = env.step(assistant("no idea"))
    assert not obs.done and obs.reward == 0.0
    (site,) = obs.error_sites
    assert site.turn == 2 and env.state.messages[site.turn]["content"] == "no idea"
    assert site.kind is ErrorKind.SYNTAX and "ANSWER" in obs.messages[0]["content"]
    wrong = int(env.problem.answer) + 1
    obs = env.step(assistant(f"ANSWER: {wrong}"))
    assert obs.error_sites[0].kind is ErrorKind.TEST_FAILURE and obs.error_sites[0].turn == 4
    assert env.problem.answer not in obs.messages[0]["content"].split("result of")[0]
    obs = env.step(assistant(solve(env.state.messages)))
    assert obs.done and obs.reward == 1.0
    assert len(env.state.error_sites) == 2
    with pytest.raises(RuntimeError, match="episode is done"):
        env.step(assistant("ANSWER: 1"))


def test_failed_attempts_carry_privileged_feedback_and_the_answer_only_in_info():
    """The teacher's privileged context: the site's feedback is the environment's message on the attempt, the
    reference (the correct answer, from `Problem`) rides in info; neither the prompt nor the feedback holds it."""
    env = DemoEnv(DemoTaskConfig(max_turns=2))
    obs = env.reset(seed=7)
    answer = env.problem.answer
    obs = env.step(assistant("ANSWER: 999999"))
    (site,) = obs.error_sites
    assert site.feedback == obs.messages[0]["content"] and site.reference == ""
    assert obs.info["reference"] == f"ANSWER: {answer}"
    assert all(f"ANSWER: {answer}" not in str(m["content"]) for m in env.state.messages)


def test_episode_ends_after_max_turns_and_rejects_non_assistant_actions():
    env = DemoEnv(DemoTaskConfig(max_turns=2))
    env.reset(seed=1)
    with pytest.raises(ValueError, match="assistant message"):
        env.step({"role": "user", "content": "hi"})
    assert not env.step(assistant("x")).done
    obs = env.step(assistant("y"))
    assert obs.done and obs.reward == 0.0 and obs.messages == []


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_episode_reward_mean_counts_every_attempt_and_pays_a_first_time_answer_most(max_turns):
    """Reference: mean over max_turns of the attempts' scores, the attempts an exact answer saved counted as 1."""
    rng = random.Random(max_turns)
    cfg = DemoTaskConfig(ops=CONFIG.ops, max_operand=9, max_turns=max_turns, episode_reward="mean")
    env, last = DemoEnv(cfg), DemoEnv(dataclasses.replace(cfg, episode_reward="last"))
    for seed in range(60):
        env.reset(seed=seed), last.reset(seed=seed)
        p, scores, obs = env.problem, [], None
        while obs is None or not obs.done:
            reply = solve(env.state.messages, slip=rng.choice([0, 0, 1, -2])) if rng.random() < 0.8 else "no"
            scores.append(score(reply, p, cfg).reward)
            obs, obs_last = env.step(assistant(reply)), last.step(assistant(reply))
        saved = max_turns - len(scores) if scores[-1] == 1.0 else 0  # attempts an exact answer made unnecessary
        expected = (sum(scores) + saved * 1.0) / max_turns
        assert obs.reward == pytest.approx(expected) and obs_last.reward == scores[-1]
        if max_turns > 1 and len(scores) > 1 and scores[-1] == 1.0:
            assert obs.reward < 1.0  # a retry earns less than a first-time answer


def test_solver_slips_to_a_near_miss():
    for seed in range(200):
        p = make_problem(seed, CONFIG)
        msgs = prompt_messages(p)
        for slip in (1, -1, 2, -2):
            r = score(solve(msgs, slip), p, CONFIG)
            assert r.kind is ErrorKind.TEST_FAILURE and r.reward > CONFIG.format_reward  # well-formed, close, wrong
            got = solve(msgs, slip).removeprefix("ANSWER: ")
            if p.op == "reverse":
                assert got[:-1] == p.answer[:-1] and (ord(got[-1]) - ord(p.answer[-1])) % 26 == slip % 26
            else:
                assert int(got) == int(p.answer) + slip


def test_solver_beats_random_replies_by_a_wide_margin():
    """The learning signal: mean reward of the solver vs replies of a random policy over the format."""
    rng = random.Random(0)
    env = DemoEnv(DemoTaskConfig(max_turns=1))
    solver, rand = [], []
    for seed in range(200):
        env.reset(seed=seed)
        solver.append(env.step(assistant(solve(env.state.messages))).reward)
        env.reset(seed=seed)
        rand.append(env.step(assistant(f"ANSWER: {rng.randint(0, 18)}")).reward)
    assert sum(solver) / 200 == 1.0
    assert 0.2 < sum(rand) / 200 < 0.6


def test_env_section_loads_and_validates():
    cfg = loads_config('[env]\ntask = "demo"\n[env.demo]\nops = ["add", "sub"]\nmax_turns = 3\n')
    assert cfg.env.demo.ops == ("add", "sub") and cfg.env.demo.max_turns == 3
    with pytest.raises(Exception, match="max_turns"):
        loads_config("[env.demo]\nmax_turns = 0\n")
    with pytest.raises(ValueError, match="unknown demo op"):
        make_problem(0, DemoTaskConfig(ops=("div",)))


def test_format_examples_teach_the_format_not_the_answers():
    """Warm-start data: well-formed replies, replayed through `DemoEnv` turn by turn (feedback text
    included), on train problems only, with answers that carry no information about the problem."""
    from composer_mesh.envs.demo import answer_range, format_examples

    cfg = DemoTaskConfig(ops=("add", "sub", "reverse"), max_operand=9, heldout_fraction=0.25)
    examples = format_examples(cfg, 600, seed=3)
    assert examples == format_examples(cfg, 600, seed=3) and examples != format_examples(cfg, 600, seed=4)
    exact = 0
    for messages in examples:
        p = Problem.parse(messages[1]["content"])
        assert messages[:2] == prompt_messages(p) and split_of(p, cfg) == "train"
        env = DemoEnv(cfg)
        env.problem = p
        replies = [m for m in messages[2:] if m["role"] == "assistant"]
        assert 1 <= len(replies) <= 2
        for k, reply in enumerate(replies):
            obs = env._answer(reply, turn=2 + 2 * k)
            assert obs.reward > 0  # well-formed
            if p.op != "reverse":
                assert answer_range(p, cfg)[0] <= int(reply["content"].split()[-1]) <= answer_range(p, cfg)[1]
            exact += obs.reward == 1.0
            if k + 1 < len(replies):  # a retry follows the env's own feedback
                assert messages[3 + 2 * k:4 + 2 * k] == obs.messages != []
    # answers drawn independently of the problem: exact about as often as chance (add 1/19, sub 1/19,
    # reverse 26^-3), far below a solver
    replies = sum(1 for m in examples for x in m if x["role"] == "assistant")
    assert exact / replies < 0.08
