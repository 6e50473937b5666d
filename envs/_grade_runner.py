"""Runs a repository's pytest suite inside a sandbox and reports outcomes it can vouch for.

Started by `envs.grading` as `python -E -s -P -B _grade_runner.py` with a JSON
request on stdin: {"nonce", "repo", "submission": [relative paths to watch],
"pytest_args": [...], "channel_fd", "callee", "plain"}. Stdlib + pytest only, no project imports.
With "callee" (every grade) it is the judge: the target modules forward to the
submission's process (`install_forwarding`) and no submission code runs here.
With "plain" (a list of test files; generated tasks whose tests are plain
functions) it runs them without pytest (`run_plain`): each module imported,
each of its `test_*` functions called with no arguments; pytest is not imported.

It reports on the fd named by `channel_fd` (a file in the host's scratch dir),
one line per event, `@@grade <nonce> <json>`; any other line there is a
violation. Events: a violation (a malformed reply of the callee, an error of
the judge's own machinery (`grader_error`), or what the audit hook saw while a
watched file was on the stack), and one final summary (per-test outcomes,
integrity of pytest's internals). A run that ends without the summary (an
`os._exit`, a kill) earns nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
import types
import warnings

_TEST_NAME = ("test_", "conftest")
_RANK = ("passed", "skipped", "failed")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_EVENTS = {
    "os.fork": "process_spawn",
    "os.forkpty": "process_spawn",
    "os.posix_spawn": "process_spawn",
    "os.spawn": "process_spawn",
    "os.exec": "process_spawn",
    "os.system": "process_spawn",
    "subprocess.Popen": "process_spawn",
    "pty.spawn": "process_spawn",
    "os.kill": "process_signal",
    "os.killpg": "process_signal",
    "socket.connect": "network",
    "socket.bind": "network",
    "socket.getaddrinfo": "network",
    "socket.gethostbyname": "network",
    "socket.sendto": "network",
    "sys.settrace": "test_runner_tamper",
    "sys.setprofile": "test_runner_tamper",
    "sys._getframe": "test_runner_tamper",
    "ctypes.dlopen": "native_code",
    "ctypes.dlsym": "native_code",
}
# Library code calls these on behalf of legitimate callers (logging and warnings
# walk frames): only a call made by the submission's own code counts.
_DIRECT_ONLY = frozenset({"sys._getframe"})
# pytest internals whose identity must not change while the suite runs.
_GUARDED = (
    ("_pytest.runner", "call_and_report"),
    ("_pytest.runner", "runtestprotocol"),
    ("_pytest.runner", "pytest_runtest_protocol"),
    ("_pytest.runner", "CallInfo.from_call"),
    ("_pytest.runner", "pytest_runtest_call"),
    ("_pytest.runner", "pytest_runtest_makereport"),
    ("_pytest.python", "pytest_pyfunc_call"),
    ("_pytest.python", "Function.runtest"),
    ("_pytest.reports", "TestReport.from_item_and_call"),
    ("_pytest.reports", "TestReport.__init__"),
    ("_pytest.main", "pytest_runtestloop"),
    ("_pytest.outcomes", "fail"),
    ("builtins", "AssertionError"),
    ("builtins", "__import__"),
    ("os", "_exit"),
)
# what the plain runner relies on (it imports no pytest)
_GUARDED_PLAIN = _GUARDED[-3:]


def _lookup(module: str, path: str) -> object:
    obj = sys.modules[module]
    for part in path.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__func__", obj)  # classmethods give a new bound method per lookup


def main() -> None:
    request = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)  # the request (and its nonce) cannot be re-read from fd 0
    os.dup2(devnull, 0)
    os.close(devnull)
    nonce = request.pop("nonce")
    repo = os.path.realpath(request["repo"])
    submission = {os.path.realpath(os.path.join(repo, p)) for p in request["submission"]}
    channel_fd = request["channel_fd"]
    dumps, write = json.dumps, os.write  # bound here, before any submission code can rebind the modules

    def emit(event: dict) -> None:
        write(channel_fd, f"@@grade {nonce} {dumps(event)}\n".encode())

    seen: set[tuple[str, str, str]] = set()

    def from_submission(direct: bool) -> str:
        """The submission file on the stack ('' if none); `direct`: only the audited call's caller counts."""
        try:  # a traceback gives the frames without sys._getframe (itself audited)
            raise RuntimeError
        except RuntimeError as exc:
            frame = exc.__traceback__.tb_frame.f_back.f_back  # past this function and the hook
        while frame is not None:
            if frame.f_code.co_filename in submission:
                return os.path.relpath(frame.f_code.co_filename, repo)
            if direct:
                return ""
            frame = frame.f_back
        return ""

    def is_test_file(path: str) -> bool:
        name = os.path.basename(path)
        return path.startswith(repo + "/") and (name.startswith(_TEST_NAME) or "/tests/" in path[len(repo):])

    def violation(kind: str, detail: str, where: str) -> None:
        if (kind, detail, where) not in seen:
            seen.add((kind, detail, where))
            emit({"violation": kind, "detail": detail, "where": where})

    def hook(event: str, args: tuple) -> None:
        kind = _EVENTS.get(event)
        if event == "open" and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            mode, flags = args[1] or "r", args[2] or 0
            writing = any(c in str(mode) for c in "wax+") or bool(flags & _WRITE_FLAGS)
            if writing and not path.startswith(repo + "/"):
                kind = "write_outside_workdir"
            elif not writing and is_test_file(path) and path not in submission:
                kind = "reads_tests"
            else:
                return
            detail = path
        elif kind is None:
            return
        else:
            detail = event
        where = from_submission(direct=event in _DIRECT_ONLY)
        if where:
            violation(kind, detail, where)

    plain = request.get("plain")
    if plain is not None and (submission or not request.get("callee")):
        raise SystemExit("the plain runner is for the split judge only (no submission code runs here)")
    if plain is None:
        # lazy: the plain runner never imports pytest (most of a cold judge's start-up); guarded ones first
        import _pytest.main  # noqa: F401
        import _pytest.outcomes  # noqa: F401
        import _pytest.python  # noqa: F401
        import _pytest.reports  # noqa: F401
        import _pytest.runner  # noqa: F401
        import pytest
    sys.path.insert(0, repo)
    os.chdir(repo)
    # after pytest's import, which overlaps the callee's start-up
    if request.get("callee"):
        install_forwarding(request["callee"], violation, repo)

    guarded = _GUARDED if plain is None else _GUARDED_PLAIN
    originals = {(m, p): _safe_lookup(m, p) for m, p in guarded}
    outcomes: dict[str, str] = {}
    collect_errors: list[str] = []

    rank = _RANK.index

    def worst(a: str, b: str) -> str:  # not builtins.max: the submission can reach builtins
        return b if rank(b) > rank(a) else a

    class Recorder:
        @staticmethod
        def pytest_runtest_logreport(report) -> None:
            # A test's outcome is the worst of its setup, call and teardown reports.
            prior = outcomes.get(report.nodeid, "passed")
            outcomes[report.nodeid] = worst(prior, report.outcome)

        @staticmethod
        def pytest_collectreport(report) -> None:
            if report.failed:
                collect_errors.append(report.nodeid)

    # nothing to watch otherwise (the judge runs no submission code): no per-event cost
    if submission:
        sys.addaudithook(hook)
    if plain is None:
        exit_code = pytest.main(list(request["pytest_args"]), plugins=[Recorder()])
    else:
        exit_code = run_plain([str(p) for p in plain], repo, outcomes, collect_errors)
    for (module, path), obj in originals.items():
        if _safe_lookup(module, path) is not obj:
            violation("test_runner_tamper", f"{module}.{path}", "")
    emit({"done": True, "exit": int(exit_code), "tests": outcomes, "collect_errors": collect_errors})


def run_plain(files: list[str], repo: str, outcomes: dict[str, str], collect_errors: list[str]) -> int:
    """Import each test file (relative to `repo`) and call its `test_*` functions; pytest's exit code.

    A test passes when its call returns; anything it raises (an AssertionError,
    the submission's exception, a missing argument) fails it. A file that does
    not import is a collection error. Failures are printed as pytest prints its
    short summary. Only for trusted, generated test files of plain functions
    (the same contract as the generator's in-process check, `envs.micro.check_task`).
    """
    failures = []
    for rel in files:
        path = os.path.join(repo, rel)
        name = rel[:-3].replace("/", ".")
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except BaseException:
            collect_errors.append(rel)
            failures.append(f"ERROR {rel}\n{traceback.format_exc(limit=-3)}")
            continue
        for test, fn in list(vars(module).items()):
            if not (test.startswith("test") and type(fn) is types.FunctionType and fn.__module__ == name):
                continue
            node = f"{rel}::{test}"
            try:
                fn()
                outcomes[node] = "passed"
            except BaseException as exc:
                outcomes[node] = "failed"
                failures.append(f"FAILED {node} - {type(exc).__name__}: {str(exc)[:500]}")
    counts = [f"{n} {word}" for word in ("failed", "passed") if (n := sum(v == word for v in outcomes.values()))]
    print("\n".join([*failures, ", ".join(counts) or "no tests ran"]))
    return 2 if collect_errors else 1 if len(failures) else 5 if not outcomes else 0


class GraderError(Exception):
    """The judge's own machinery failed (an argument that cannot cross, a bound of the wire): no verdict.

    Raised only after the violation `grader_error` is on the channel, so the grade is 0 whatever the
    test expects or catches (`pytest.raises(TypeError)`, `except BaseException`).
    """


def install_forwarding(callee: dict, violation, repo: str) -> None:
    """Make the task's target modules forward to the submission's process (split grading).

    callee: {"modules": [dotted names], "in_fd", "out_fd" (pipes to `_callee.py`),
    "wire": path of `_wire.py`, "timeout_s": per-message limit}. Each target module
    of the judge's tree is the task's stub (classes and helpers as the agent got
    them); when it is imported, every function the submission's module has
    replaces the stub's: a forwarder whose arguments and results cross as plain
    data, callables as handles the other side calls back (`_wire.Peer`). Instances
    of the repository's other classes (a test's `Square`) cross as handles the
    callee asks about (`serve`); instances of the target modules' classes
    come back as state, rebuilt as the stub's class. Plain values are copied;
    classes stay the stub's. Every reply is hostile data: one that breaks the
    protocol is the violation `malformed_reply`, a result that is not plain data
    `unplain_result`; both fail the call, none raises here. An error of the
    judge's own side (a test's argument that cannot cross, the handle table or a
    message bound exhausted) is `grader_error`, never an exception the test could
    expect: the violation is recorded before anything is raised.
    """
    # a pool worker imported it before any job ran (`_zygote.py`)
    wire = sys.modules.get("_composer_wire")
    if wire is None:
        spec = importlib.util.spec_from_file_location("_composer_wire", callee["wire"])
        wire = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(wire)
    warning_kinds = {c.__name__: c for c in (
        UserWarning, DeprecationWarning, PendingDeprecationWarning, RuntimeWarning, FutureWarning,
        SyntaxWarning, ImportWarning, UnicodeWarning, BytesWarning, ResourceWarning,
    )}

    def protocol_error(what: str) -> RuntimeError:
        violation("malformed_reply", what[:200], "callee")
        return RuntimeError(f"no valid answer from the submission: {what[:200]}")

    def grader_error(what: str) -> GraderError:
        violation("grader_error", what[:200], "judge")
        return GraderError(f"the grader failed, not the submission: {what[:200]}")

    def shared(value: object) -> bool:
        """An instance of a class defined in a source file of the repository (the tests' own objects)."""
        module = sys.modules.get(type(value).__module__)
        path = getattr(module, "__file__", None) if module is not None else None
        return type(path) is str and path.endswith(".py") and os.path.realpath(path).startswith(repo + "/")

    def remote(handle: int):
        """A callable of the submission's (returned or passed back), called over the wire."""
        def call(*args, **kwargs):
            return ask(outgoing({"op": "call", "handle": handle}, args, kwargs))
        call.__name__ = call.__qualname__ = f"submission_callable_{handle}"
        return call

    def outgoing(head: dict, args: tuple, kwargs: dict) -> dict:
        """A call request carrying the test's arguments. One that cannot cross (neither plain data, callable nor
        shared) or a full handle table is the grader's failure, never a TypeError the test could expect."""
        try:
            return {**head, "args": wire.encode(list(args), export=peer.export),
                    "kwargs": wire.encode(kwargs, export=peer.export)}
        except Exception as exc:
            raise grader_error(f"an argument cannot cross to the submission's process: {exc}") from None

    def serve(request: object) -> dict:
        """A request of the submission's side about a handle the judge exported; never raises.

        {"op": "call", "handle", "args", "kwargs"}: call an exported callable;
        {"op": "object", "handle", "action", "args"}: one of `_wire.OBJECT_OPS` on an
        exported object, attribute names plain identifiers (never a dunder).
        """
        try:
            if type(request) is not dict:
                raise wire.WireError("not a request")
            if request.get("op") == "object" and set(request) == {"op", "handle", "action", "args"}:
                obj, action = peer.exported_value(request["handle"], "o"), request["action"]
                args = wire.decode(request["args"], peer=peer)
                if type(action) is not str or action not in wire.OBJECT_OPS or type(args) is not list:
                    raise wire.WireError("not an object operation")
                if action in wire.NAMED_OPS and not (args and wire.plain_name(args[0])):
                    raise wire.WireError("attribute name is not a plain identifier")
                fn, args, kwargs = wire.OBJECT_OPS[action], [obj, *args], {}
            elif request.get("op") == "call" and set(request) == {"op", "handle", "args", "kwargs"}:
                fn = peer.exported_fn(request["handle"])
                args, kwargs = wire.decode(request["args"], peer=peer), wire.decode(request["kwargs"], peer=peer)
                if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                    raise wire.WireError("callback arguments are not a list and a dict of str")
            else:
                raise wire.WireError("not a callback or object request")
        except Exception as exc:
            protocol_error(f"callback: {type(exc).__name__}: {exc}")
            return {"raise": "RuntimeError", "text": "malformed callback"}
        try:
            result = fn(*args, **kwargs)
        except wire.WireError as exc:  # a bound of the wire (iterating past MAX_ITEMS), not the test's object
            grader_error(f"callback: {exc}")
            return {"raise": "RuntimeError", "text": "grader error"}
        except Exception as exc:
            # the test's callable raised: the solution sees it
            try:
                return {"raise": type(exc).__name__, "text": str(exc)[:2000]}
            except Exception:
                return {"raise": "RuntimeError", "text": "unprintable exception"}
        try:
            return {"ok": wire.encode(result, export=peer.export)}
        except Exception as exc:  # not plain data, callable nor shared, or the handle table is full
            grader_error(f"a value of the test's cannot cross to the submission's process: {exc}")
            return {"raise": "RuntimeError", "text": "grader error"}

    peer = wire.Peer(callee["in_fd"], callee["out_fd"], serve, callee["timeout_s"], share=shared,
                     modules=set(callee["modules"]), forwarder=remote)

    def ask(request: dict) -> object:
        try:
            reply = peer.request(request)
        except wire.TooLarge as exc:  # a message of ours (a request or a callback's answer) over the bound
            raise grader_error(str(exc)) from None
        except (wire.WireError, OSError) as exc:  # BrokenPipeError: the callee is gone
            raise protocol_error(str(exc)) from None
        except Exception as exc:  # any other failure of the wire on this side (MemoryError)
            raise grader_error(f"{type(exc).__name__}: {exc}") from None
        if reply is None:
            if request["op"] == "describe":  # the module did not import: the stub's functions stay
                raise RuntimeError("the submission's process ended")  # its sandbox result says why
            # never a bare RuntimeError a test could expect: the call got no answer
            raise protocol_error("the submission's process ended during the call")
        keys = set(reply)
        where = f"{request.get('module', 'callable')}.{request.get('name', request.get('handle'))}"
        if keys in ({"ok"}, {"ok", "warnings"}):
            try:
                value = wire.decode(reply["ok"], peer=peer)
            except wire.NotRebuildable as exc:
                # an instance of a class the stub does not have (the submission's own helper class)
                violation("unplain_result", str(exc)[:200], where)
                raise TypeError(f"the submission returned a {str(exc)[:100]}, not plain data") from None
            except wire.WireError as exc:
                raise protocol_error(str(exc)) from None
            emit_warnings(reply.get("warnings", []))
            return value
        if keys == {"unplain"}:  # the result was no plain value: never compared at all
            violation("unplain_result", str(reply["unplain"])[:200], where)
            raise TypeError(f"the submission returned a {str(reply['unplain'])[:100]}, not plain data")
        if keys != {"raise", "text"}:
            raise protocol_error("malformed reply")
        raise wire.exception_from(reply["raise"], reply["text"])

    def emit_warnings(caught: object) -> None:
        """Warnings the call raised in the callee, re-raised here as builtin warning categories."""
        if type(caught) is not list or not all(type(w) is list and len(w) == 2 and all(type(x) is str for x in w) for w in caught):
            raise protocol_error("malformed warnings")
        for kind, text in caught[:20]:
            warnings.warn(text[:500], warning_kinds.get(kind, UserWarning), stacklevel=4)

    def forwarder(module: str, name: str):
        def call(*args, **kwargs):
            return ask(outgoing({"op": "call", "module": module, "name": name}, args, kwargs))

        call.__name__ = call.__qualname__ = name
        call.__module__ = module
        return call

    described: dict[str, dict[str, object]] = {}
    for module in callee["modules"]:
        try:
            names = ask({"op": "describe", "module": module})
        except Exception:  # the module does not import or the callee misbehaves: tests using it fail
            names = {}
        if type(names) is not dict:
            violation("malformed_reply", "module description", "callee")
            names = {}
        overrides: dict[str, object] = {}
        for name, entry in names.items():
            # Only plain identifiers, never dunders: a forged name must not reach the module object's internals.
            if type(name) is not str or not name.isidentifier() or name.startswith("__") or type(entry) is not list or not entry:
                violation("malformed_reply", "module description", "callee")
                break
            if entry[0] == "function" and len(entry) == 1:
                overrides[name] = forwarder(module, name)
            elif entry[0] == "value" and len(entry) == 2:
                overrides[name] = entry[1]
        described[module] = overrides
    sys.meta_path.insert(0, _Forwarding(described))


class _Forwarding(importlib.abc.MetaPathFinder):
    """Finds the target modules as usual and, once a module's code ran, puts the submission's functions in."""

    def __init__(self, described: dict[str, dict[str, object]]) -> None:
        self.described = described

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.described:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _ForwardingLoader(spec.loader, self.described[fullname])
        return spec


class _ForwardingLoader(importlib.abc.Loader):
    def __init__(self, base, overrides: dict[str, object]) -> None:
        self.base, self.overrides = base, overrides

    def create_module(self, spec):
        return self.base.create_module(spec)

    def exec_module(self, module) -> None:
        self.base.exec_module(module)
        for name, value in self.overrides.items():
            # the stub's classes stay (plain data crosses, not instances)
            if not isinstance(getattr(module, name, None), type):
                setattr(module, name, value)


def _safe_lookup(module: str, path: str) -> object:
    try:
        return _lookup(module, path)
    except (AttributeError, KeyError):
        return None


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the summary is out: skip tearing the interpreter down (its cost is part of every grade)
    os._exit(0)
