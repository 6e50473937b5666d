"""Trace replay: frozen agent traces → budgeted multi-teacher votes → preference pairs.

Entry points: `replay.pipeline.run_replay` (the `composer-mesh replay` run),
`replay.pipeline.replay_states` (an async step for an actor), `replay.hints`
(error sites → hints, shared with envs/ and the trainer), `replay.teachers.TeacherClient`,
`replay.server.TeacherServer` (`composer-mesh serve-teachers`). See docs/replay.md.
"""

if __name__ == "replay":  # the checkout's folder imported by its own name: not the installed package
    raise ImportError("import composer_mesh.replay, not replay: the packages install as composer_mesh.* "
                      "(python3 -m mesh.bootstrap setup; docs/installation.md)")
