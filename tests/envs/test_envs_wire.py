"""The judge's two trust boundaries without a sandbox: the report channel and the plain-data wire."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import threading
from collections import OrderedDict

import pytest

from composer_mesh.envs import _wire as wire
from composer_mesh.envs.grading import _REPORT_BYTES, read_channel

NONCE = "ab" * 16
SUMMARY = {"done": True, "exit": 0, "tests": {"t.py::a": "passed"}, "collect_errors": []}


def _channel(tmp_path, data: bytes):
    path = tmp_path / "report"
    path.write_bytes(data)
    return read_channel(path, NONCE)


def _line(event) -> bytes:
    return f"@@grade {NONCE} {json.dumps(event)}\n".encode()


def test_valid_events_parse(tmp_path):
    violation = {"violation": "network", "detail": "socket.connect", "where": "m.py"}
    assert _channel(tmp_path, _line(violation) + _line(SUMMARY)) == [violation, SUMMARY]


@pytest.mark.parametrize(
    "data",
    [
        b"@@grade " + NONCE.encode() + b" {not json\n",
        _line([1, 2]),
        _line({"done": True}),
        _line({**SUMMARY, "tests": {"t::a": "PASSED"}}),
        _line({**SUMMARY, "tests": ["t::a"]}),
        _line({**SUMMARY, "exit": "0"}),
        _line({**SUMMARY, "done": 1}),
        _line({**SUMMARY, "extra": 1}),
        _line({"violation": 1, "detail": "", "where": ""}),
        b"@@grade " + b"00" * 16 + b" " + json.dumps(SUMMARY).encode() + b"\n",  # wrong nonce
        b"stray text\n",
        b"\xff\xfe garbage \x00\n",
    ],
)
def test_malformed_lines_are_events_not_exceptions(tmp_path, data):
    events = _channel(tmp_path, data)
    assert len(events) == 1 and set(events[0]) == {"malformed"}


def test_flood_beyond_the_bound_is_one_violation(tmp_path):
    events = _channel(tmp_path, _line(SUMMARY) + b"x" * _REPORT_BYTES)
    assert events == [{"malformed": f"report channel over {_REPORT_BYTES} bytes"}]


def test_random_bytes_never_raise(tmp_path):
    rng = random.Random(0)
    for _ in range(200):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        prefix = _line(SUMMARY)[: rng.randrange(len(_line(SUMMARY)))]
        for event in _channel(tmp_path, prefix + data):
            assert event == SUMMARY or set(event) == {"malformed"}


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "float", "str", "bytes"] + (["list", "tuple", "dict", "set"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-(10**30), 10**30)
    if kind == "float":
        return rng.uniform(-1e9, 1e9)
    if kind == "str":
        return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(6)))
    if kind == "bytes":
        return rng.randbytes(rng.randrange(6))
    items = [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    hashable = [v for v in items if _hashable(v)]
    return set(hashable) if kind == "set" else {k: _random_value(rng, depth + 1) for k in hashable}


def _same(a, b) -> bool:
    """Equal and of exactly the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_round_trip_keeps_exact_types():
    rng = random.Random(1)
    for _ in range(300):
        value = _random_value(rng)
        back = wire.decode(json.loads(json.dumps(wire.encode(value))))
        assert _same(value, back), (value, back)
    assert type(wire.decode(wire.encode(True))) is bool and type(wire.decode(wire.encode(1))) is int


class _AlwaysEqual:
    def __eq__(self, other):
        return True


class _Str(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


@pytest.mark.parametrize(
    "value", [_AlwaysEqual(), _Str("x"), [1, _Str("x")], {"k": (_AlwaysEqual(),)}, OrderedDict(a=1), True.__class__.__mro__]
)
def test_only_exact_builtins_cross(value):
    with pytest.raises(wire.WireError):
        wire.encode(value)


@pytest.mark.parametrize("obj", [{"t": 1}, {"x": []}, {"d": [[1]]}, {"b": 5}, {"t": [], "s": []}])
def test_malformed_values_are_refused(obj):
    with pytest.raises(wire.WireError):
        wire.decode(obj)


def test_reader_bounds_and_timeouts():
    r, w = os.pipe()
    try:
        reader = wire.Reader(r)
        with pytest.raises(wire.WireError, match="no answer"):
            reader.recv(timeout_s=0.05)
        os.write(w, b"[1]\n")
        with pytest.raises(wire.WireError, match="not an object"):
            reader.recv(timeout_s=1)
        os.write(w, b'{"ok": 1}\n')
        assert reader.recv(timeout_s=1) == {"ok": 1}
    finally:
        os.close(w)
    assert reader.recv(timeout_s=1) is None  # end of stream
    os.close(r)


def test_the_wires_own_bounds_are_wire_errors_the_judge_tells_from_the_tests():
    """A message of this side's over the size bound (`TooLarge`) and an iteration past `MAX_ITEMS` are the wire's
    errors, not a ValueError of the test's object: the judge reports them as `grader_error`."""
    r, w = os.pipe()
    try:
        with pytest.raises(wire.TooLarge):
            wire.send(w, {"ok": "x" * wire.MAX_MESSAGE})
    finally:
        os.close(r), os.close(w)
    with pytest.raises(wire.WireError, match="items"):
        wire.OBJECT_OPS["iter"](range(wire.MAX_ITEMS + 1))
    assert wire.OBJECT_OPS["iter"](range(3)) == [0, 1, 2]


def test_exceptions_cross_as_builtins_only():
    assert type(wire.exception_from("ValueError", "bad")) is ValueError
    forged = wire.exception_from("SystemExit", "0")
    assert type(forged) is RuntimeError and "SystemExit" in str(forged)
    assert type(wire.exception_from(["x"], "y")) is RuntimeError


@pytest.mark.parametrize(
    "obj", [{"b": "zz"}, {"s": [[1], [2]]}, {"d": [[[1], 2]]}, {"f": [{"d": []}]}, {"c": 1}, {"c": True},
            {"o": 1}, {"r": 0}, {"i": ["m", "C", []]}],
)
def test_hostile_values_raise_only_wire_errors(obj):
    """Bad hex, unhashable members or keys, handles without a binder: WireError, never another exception."""
    with pytest.raises(wire.WireError):
        wire.decode(obj)


def test_a_deeply_nested_message_is_malformed_not_a_recursion_error():
    r, w = os.pipe()
    os.write(w, b'{"ok": ' + b"[" * 20_000 + b"]" * 20_000 + b"}\n")  # within one pipe buffer
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.Reader(r).recv(timeout_s=1)
    os.close(r), os.close(w)


def test_callables_cross_as_handles_and_call_back_nested():
    """Side A passes a callable to side B, which calls it back while A waits; results come home as plain data."""
    a_to_b, b_to_a = os.pipe(), os.pipe()
    served = []

    def b_serve(request):  # B: apply the callable it got to 3, then return a callable of its own
        fn = wire.decode(request["args"], bind=lambda h: lambda *xs: b.request(
            {"op": "call", "handle": h, "args": wire.encode(list(xs)), "kwargs": wire.encode({})})["ok"])
        served.append(fn[0](3))
        return {"ok": wire.encode(lambda x: x * 10, export=b.export)}

    b = wire.Peer(a_to_b[0], b_to_a[1], b_serve, timeout_s=5)
    a = wire.Peer(b_to_a[0], a_to_b[1], lambda req: {"ok": a.exported_fn(req["handle"])(*wire.decode(req["args"]))}, 5)
    thread = threading.Thread(target=b.serve_forever, daemon=True)
    thread.start()
    reply = a.request({"op": "call", "args": wire.encode([lambda x: x + 1], export=a.export), "kwargs": wire.encode({})})
    assert served == [4] and set(reply) == {"ok"} and reply["ok"] == {"c": 0}
    with pytest.raises(wire.WireError, match="unknown callable handle"):
        a.exported_fn(True)
    os.close(a_to_b[1])
    thread.join(5)


@pytest.mark.parametrize(
    "reply",
    [
        b'{"ok": {"d": [["__class__", ["value", 1]], ["__dict__", ["value", 2]]]}}\n',
        b'{"ok": {"d": [[1, ["function"]]]}}\n',
        b'{"ok": 5}\n',
        b'{"ok": {"b": "zz"}}\n',
        b'{"ok": {"d": []}, "warnings": "x"}\n',
        b'{"weird": 1}\n',
        b"not json\n",
        b'{"op": "call", "handle": 0, "args": [], "kwargs": {"d": []}}\n',
        b'{"ok": {"o": 0}}\n',
        b'{"ok": {"r": 5}}\n',
        b'{"ok": {"i": ["cm_forged_mod", "C", [["__class__", 1]]]}}\n',
        b'{"ok": {"i": ["sys", "flags", []]}}\n',
        b'{"op": "object", "handle": 0, "action": "getattr", "args": ["__class__"]}\n',
        b'{"op": "object", "handle": 0, "action": "__import__", "args": ["os"]}\n',
        b"",
    ],
)
def test_no_reply_to_a_description_request_raises_inside_the_judge(reply, tmp_path):
    """The judge's side (`install_forwarding`) against forged replies: a violation at most, never an exception."""
    from composer_mesh.envs import _grade_runner as runner

    to_judge, to_callee = os.pipe(), os.pipe()
    os.write(to_judge[1], reply)
    os.close(to_judge[1])  # then end of stream: the callee is gone
    seen = []
    before = list(sys.meta_path)
    try:
        callee = {"modules": ["cm_forged_mod"], "in_fd": to_judge[0], "out_fd": to_callee[1],
                  "wire": wire.__file__, "timeout_s": 2}
        runner.install_forwarding(callee, lambda kind, detail, where: seen.append(kind), str(tmp_path))
        finder = sys.meta_path[0]
        assert set(finder.described["cm_forged_mod"]) <= {"x"}  # no dunder, no non-identifier made it through
    finally:
        sys.meta_path[:] = before
        for fd in (to_judge[0], *to_callee):
            os.close(fd)
    assert set(seen) <= {"malformed_reply"}
    assert seen or reply in (b"",)  # every forged reply but a plain end of stream is named


@dataclasses.dataclass(frozen=True)
class _Token:
    kind: str
    text: str


class _Slotted:
    __slots__ = ("a", "b")


class _Plain:
    def key(self):
        return 1


def _peer(**policy) -> wire.Peer:
    r, w = os.pipe()
    return wire.Peer(r, w, lambda req: {}, 5, **policy)


def test_target_instances_cross_as_state_and_are_rebuilt_without_their_code():
    """A target module's instance leaves as its attribute state and comes back as this side's class."""
    here = {__name__}
    sender, receiver = _peer(modules=here), _peer(modules=here)
    tagged = json.loads(json.dumps(wire.encode([_Token("num", "2"), _Slotted()], export=sender.export)))
    assert tagged[0] == {"i": [__name__, "_Token", [["kind", "num"], ["text", "2"]]]}
    token, slotted = wire.decode(tagged, peer=receiver)
    assert token == _Token("num", "2") and type(slotted) is _Slotted and not hasattr(slotted, "a")
    with pytest.raises(wire.WireError):  # outside the receiver's target modules
        wire.decode(tagged, peer=_peer(modules={"other"}))


@pytest.mark.parametrize("state", [
    [["__class__", 1], ["kind", "a"], ["text", "b"]],  # a dunder
    [["kind", "a"]],  # not the dataclass's fields
    [["kind", "a"], ["text", "b"], ["extra", 1]],
    [["kind b", "a"], ["text", "b"]],  # not an identifier
    [[1, "a"], ["text", "b"]],
])
def test_rebuilt_state_names_only_plain_fields(state):
    with pytest.raises(wire.WireError):
        wire.decode({"i": [__name__, "_Token", state]}, peer=_peer(modules={__name__}))


@pytest.mark.parametrize("module,qualname", [
    ("os", "_wrap_close"), (__name__, "_peer"), (__name__, "_Token.__class__"), (__name__, "pytest"), (__name__, "nope"),
    (["x"], "_Token"), (__name__, 1),
])
def test_rebuild_only_makes_classes_of_the_target_module(module, qualname):
    with pytest.raises(wire.WireError):
        wire.decode({"i": [module, qualname, []]}, peer=_peer(modules={__name__}))


def test_state_of_a_class_this_side_lacks_is_not_plain_data():
    """The submission's own helper class (an always-equal one): `NotRebuildable`, reported as `unplain_result`."""
    with pytest.raises(wire.NotRebuildable):
        wire.decode({"i": [__name__, "_Eq", []]}, peer=_peer(modules={__name__}))


def test_slots_take_only_their_names_and_state_is_bounded():
    receiver = _peer(modules={__name__})
    with pytest.raises(wire.WireError):
        wire.decode({"i": [__name__, "_Slotted", [["c", 1]]]}, peer=receiver)
    with pytest.raises(wire.WireError):
        wire.decode({"i": [__name__, "_Token", [[f"a{i}", 1] for i in range(wire.MAX_ATTRS + 1)]]}, peer=receiver)
    assert wire.decode({"i": [__name__, "_Slotted", [["a", 1]]]}, peer=receiver).a == 1
    with pytest.raises(wire.WireError, match="shadows"):  # a method hidden by a value
        wire.decode({"i": [__name__, "_Plain", [["key", 5]]]}, peer=receiver)
    assert wire.decode({"i": [__name__, "_Plain", [["value", 2]]]}, peer=receiver).value == 2


def test_handles_resolve_only_to_their_kind_and_come_back_as_themselves():
    """A shared object and a callable get handles of their kind; an "r" tag gives the exported value back."""
    box = object()
    side = _peer(share=lambda v: v is box)
    tagged = wire.encode([box, len], export=side.export)
    assert tagged == [{"o": 0}, {"c": 1}]
    assert wire.decode([{"r": 0}, {"r": 1}], peer=side) == [box, len]
    with pytest.raises(wire.WireError):
        side.exported_fn(0)
    with pytest.raises(wire.WireError):
        side.exported_value(1, "o")
    with pytest.raises(wire.WireError):  # no proxy maker on this side: the other side may not share objects
        wire.decode({"o": 0}, peer=side)
    with pytest.raises(wire.WireError, match="cannot cross"):
        wire.encode(object(), export=side.export)


def test_a_remote_object_never_asks_about_dunders():
    """Libraries probe dunders on everything: the proxy answers those itself; plain names and operators are asked."""
    asked = []
    proxy = wire.RemoteObject(lambda *a: asked.append(a) or 7)
    for name in ("__dict__", "__globals__", "__reduce_ex__", "__array__", "__fspath__"):
        assert not hasattr(proxy, name) or name == "__reduce_ex__"
    with pytest.raises(AttributeError):
        proxy.__class__ = int
    assert (proxy.side, len(proxy), 1 + proxy, proxy == 2, hash(proxy)) == (7, 7, 7, 7, 7)
    assert asked == [("getattr", "side"), ("len",), ("radd", 1), ("eq", 2), ("hash",)]
