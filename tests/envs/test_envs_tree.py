"""envs/tree.py: trees a policy can make (past the recursion limit, past PATH_MAX, wide, linked) walked within
bounds and removed at any depth, compared with what os.walk / a plain listing says."""

from __future__ import annotations

import errno
import os
import random
import sys

import pytest

from composer_mesh.envs.tree import MAX_DEPTH, MAX_LINKS, TreeTooDeep, clear_dir, remove_tree, resolve, walk


def _chain(root, depth: int, name: str = "d") -> None:
    """`depth` nested directories under `root`, made by relative chdir (the path grows past PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x")
    finally:
        os.close(fd)


def test_walk_matches_os_walk_on_a_shallow_tree_and_prunes(tmp_path):
    for rel in ("a/b/c.txt", "a/d.py", "e/f/g/h.txt", "top.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    os.mkfifo(tmp_path / "fifo")
    ours = {(d, tuple(sorted(ds)), tuple(sorted(fs))) for d, ds, fs in walk(tmp_path)}
    theirs = set()
    for d, ds, fs in os.walk(tmp_path):
        # os.walk lists a symlinked directory with the directories (and never enters it); ours lists it as a file
        links = [x for x in ds if os.path.islink(os.path.join(d, x))]
        theirs.add((d, tuple(sorted(set(ds) - set(links))), tuple(sorted(fs + links))))
    assert ours == theirs
    seen = []
    for d, ds, _ in walk(tmp_path):
        seen.append(os.path.relpath(d, tmp_path))
        ds[:] = [x for x in ds if x != "e"]
    assert sorted(seen) == [".", "a", "a/b"]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, sys.getrecursionlimit() + 50])
def test_walk_refuses_a_tree_past_its_bounds_without_recursing(tmp_path, depth):
    _chain(tmp_path, depth)
    with pytest.raises(TreeTooDeep):
        for _ in walk(tmp_path):
            pass
    remove_tree(tmp_path)
    assert not tmp_path.exists()


def test_walk_refuses_a_long_path_within_the_depth_bound(tmp_path):
    _chain(tmp_path, 20, name="n" * 200)  # 20 levels, 4000 characters
    with pytest.raises(TreeTooDeep, match="characters"):
        list(walk(tmp_path))


def test_walk_accepts_a_tree_at_its_depth_bound(tmp_path):
    _chain(tmp_path, MAX_DEPTH)
    files = [os.path.join(d, f) for d, _, fs in walk(tmp_path) for f in fs]
    assert len(files) == 1 and files[0].endswith("/leaf")


def test_remove_tree_removes_deep_wide_and_linked_trees_and_never_follows_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    victim = tmp_path / "victim"
    victim.mkdir()
    _chain(victim, 3000)  # far past the recursion limit and PATH_MAX
    wide = victim / "wide"
    wide.mkdir()
    for i in range(300):
        (wide / f"d{i}").mkdir()
        (wide / f"d{i}" / "f").write_text("x")
    (victim / "to_outside").symlink_to(outside)
    (wide / "d7" / "to_outside").symlink_to(outside, target_is_directory=True)
    os.mkfifo(victim / "fifo")
    (victim / "locked").mkdir()
    (victim / "locked" / "f").write_text("x")
    os.chmod(victim / "locked", 0)
    remove_tree(victim)
    assert not victim.exists()
    assert (outside / "keep.txt").read_text() == "keep"


def test_remove_tree_takes_a_file_a_link_or_nothing(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    remove_tree(tmp_path / "l")
    assert (tmp_path / "f").exists() and not (tmp_path / "l").exists()
    remove_tree(tmp_path / "f")
    remove_tree(tmp_path / "missing")
    assert list(tmp_path.iterdir()) == []


def test_clear_dir_keeps_the_directory_and_the_kept_entries(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    (tmp_path / "g").write_text("g")
    _chain(tmp_path / "a", 1500)
    clear_dir(tmp_path, keep={tmp_path / "b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert (tmp_path / "b" / "f").read_text() == "b"


def test_resolve_is_realpath_on_ordinary_links_and_refuses_what_the_kernel_refuses(tmp_path):
    """Relative, absolute and `..` links, links to links, a missing tail: the same path as `os.path.realpath`, on
    random trees. A loop, or a chain one link longer than the kernel follows, raises ELOOP without recursing;
    a chain of exactly `MAX_LINKS` resolves (and a chain past the recursion limit is refused, not a crash)."""
    rng = random.Random(0)
    for trial in range(20):
        root = tmp_path / f"t{trial}"
        dirs = [root / "a", root / "a" / "b", root / "c"]
        for d in dirs:
            d.mkdir(parents=True)
        (root / "a" / "f.txt").write_text("x")
        names = []
        for i in range(12):
            where = rng.choice(dirs)
            target = rng.choice(["f.txt", "../c", "..", str(root / "a"), "missing/x", "b/../../c", *names[-3:]])
            link = where / f"l{i}"
            os.symlink(target, link)
            names.append(os.path.relpath(link, where))
            for query in (link, link / "f.txt", link / "nope", where / ".." / f"l{i}"):
                assert resolve(query) == os.path.realpath(query), query
    os.symlink("loop", tmp_path / "loop")
    for n, fails in ((MAX_LINKS, False), (MAX_LINKS + 1, True), (sys.getrecursionlimit() + 200, True)):
        chain = tmp_path / f"chain{n}"
        chain.mkdir()
        for i in range(n):
            os.symlink(f"c{i + 1}", chain / f"c{i}")
        if not fails:
            assert resolve(chain / "c0") == str(chain / f"c{n}")
            continue
        with pytest.raises(OSError) as info:
            resolve(chain / "c0")
        assert info.value.errno == errno.ELOOP
    with pytest.raises(OSError) as info:
        resolve(tmp_path / "loop" / "x")
    assert info.value.errno == errno.ELOOP
