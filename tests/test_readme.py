"""README.md is a newcomer's first page: short, and everything it names exists.

At most 900 words; every relative link and every repository path it quotes in
backticks is a file or folder of this checkout; every `composer-mesh` command
it shows is one the CLI has (subcommand and action); the two quick-start
commands are bootstrap targets.
"""

from __future__ import annotations

import re
from pathlib import Path

from composer_mesh.mesh.bootstrap import TARGETS
from composer_mesh.mesh.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
TOP = ("actors", "mesh", "titan_ext", "losses", "replay", "envs", "configs", "tests", "docs", "benchmarks", "notebooks")


def test_readme_is_at_most_900_words():
    words = len(re.findall(r"\S+", README))
    assert words <= 900, words


def test_every_link_and_quoted_path_exists():
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", README) if not t.startswith(("http", "#"))]
    quoted = [q for q in re.findall(r"`([^`\s]+)`", README) if q.split("/")[0] in TOP and "/" in q]
    assert links and quoted
    missing = [p for p in links + quoted if not (REPO / p.rstrip("/").split("::")[0]).exists()]
    assert not missing, missing


def test_every_command_shown_exists():
    parser = build_parser()
    commands = re.findall(r"composer-mesh ([a-z-]+)(?: ([a-z-]+))?", README)
    assert commands
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, action in commands:
        assert name in subparsers.choices, name
        sub = subparsers.choices[name]
        actions = [a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"]
        if actions and action and not action.startswith("-"):
            assert action in actions[0].choices, (name, action)
    targets = set(re.findall(r"python3 -m mesh\.bootstrap (\w+)", README))
    assert {"main", "test"} <= targets <= set(TARGETS), targets
