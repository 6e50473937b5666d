"""`composer-mesh swe-instances REPO COMMIT...`: SWE-bench rows from a local repository's fixing commits.

Per commit (a name, or a range `A..B`): the base commit is its parent, the source part of its change the
row's `patch`, the test part its `test_patch` (`envs.swe_commits`), the commit message the problem statement;
FAIL_TO_PASS and PASS_TO_PASS come from running the test part's modules in the sandbox without and with the
fix, and the row is graded as training grades it before it is written (`envs.swe_rows`). A commit that yields
no valid row is named with the reason; the others' rows are still written. Exit codes: 0 every commit made a
row; 1 some did not; 2 nothing was tried (not a git repository, an unknown commit, no sandbox).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from composer_mesh.envs.safeguards import TEST_SIDE_RULE

NAME = "swe-instances"
HELP = ("Write SWE-bench rows (JSONL) from a local git repository's fixing commits: FAIL_TO_PASS and PASS_TO_PASS "
        "found by running the tests without and with each fix; every row graded before it is written.")
DEFAULT_OUTPUT = "swe_instances.jsonl"  # configs/swe_cpu.toml's env.swe.instances


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", help="the top folder of a local git repository; rows name it by the folder's name, "
                                     "so a recipe's env.swe.repos_dir is its parent")
    parser.add_argument("commits", nargs="+", metavar="COMMIT",
                        help="fixing commits: names (HEAD, a1b2c3d) or ranges (main~3..main: each commit of the range, "
                             "oldest first, merges left out). Each commit's parent is the row's base_commit, its "
                             "message the problem_statement; its change is split by file into test_patch (the test "
                             f"part: {TEST_SIDE_RULE}) and patch (every other file)")
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT,
                        help=f"the JSONL file written, replaced when a row is made (default {DEFAULT_OUTPUT}, "
                             "what configs/swe_cpu.toml reads)")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; the sandbox and graders load only here
    from composer_mesh.envs.sandbox import Sandbox, SandboxUnavailable
    from composer_mesh.envs.swe_commits import git_toplevel, read_fix, resolve_commits
    from composer_mesh.envs.swe_rows import RowMaker

    try:
        repo = git_toplevel(args.repo)
        commits = resolve_commits(repo, args.commits)
        sandbox = Sandbox()
    except (ValueError, SandboxUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows, refused = [], 0
    with tempfile.TemporaryDirectory(prefix="swe-instances-", dir=sandbox.root) as store:
        maker = RowMaker(repo, sandbox, Path(store))
        for i, commit in enumerate(commits, 1):
            began = time.perf_counter()
            head = f"[{i}/{len(commits)}] {commit[:12]}"
            try:
                fix = read_fix(repo, commit)
                print(f"{head} {fix.subject}: running its tests without and with the fix", flush=True)
                row = maker.make(fix)
            except ValueError as exc:
                refused += 1
                print(f"{head} refused: {exc}", flush=True)
                continue
            rows.append(row)
            print(f"{head} row {row['instance_id']}: FAIL_TO_PASS {len(json.loads(row['FAIL_TO_PASS']))}, "
                  f"PASS_TO_PASS {len(json.loads(row['PASS_TO_PASS']))}; gold patch earns 1, no patch 0 "
                  f"({time.perf_counter() - began:.1f} s)", flush=True)
    if rows:
        out = Path(args.output)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, out)
        print(f"wrote {len(rows)} row(s) to {out}; {refused} commit(s) refused. Train on them:\n"
              f"  composer-mesh train configs/swe_cpu.toml --env.swe.instances={out.resolve()} "
              f"--env.swe.repos_dir={repo.parent}")
    else:
        print(f"no row made; {args.output} left as it was", file=sys.stderr)
    return 1 if refused else 0
