"""The channel between a code item's two processes inside the sandbox (standard library only: it runs in the
jail, see ``sandbox_runner.py``).

The **test process** runs the item's tests; the **solution process** runs the model's code. The tests call the
solution's functions through this channel, so nothing the solution does in its own process (exit early,
monkeypatch builtins, read memory or frames, write to file descriptors) can touch the tests or their
verdict. What crosses is data, never live objects:

- ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray`` and ``list``,
  ``tuple``, ``dict``, ``set``, ``frozenset`` of those, by exact type (a subclass of ``int`` with its own
  ``__eq__`` is not an ``int`` here);
- any other object stays where it lives, and the other side gets a *reference*: the tests get a
  :class:`SolutionObject` (call it, read and set attributes, index, iterate, ``len``, ``str``; equal only to
  itself), the solution gets a callable that calls back into the tests (a ``key=`` function, say). The test
  process serves nothing but calls of the functions the tests passed.

Messages are JSON (ASCII, so lone surrogates survive) behind a 4-byte length, on a pair of pipes (imports
are a large share of a short run: no ``socket``, ``base64`` or ``struct`` here); a request carries an ``id``
and its reply the same id in ``re``, so a solution that forks or writes on the channel desynchronises it
and fails; it cannot answer a request it has not been asked.
"""

from __future__ import annotations

import binascii
import builtins
import json
import os

MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_DEPTH = 200
MAX_MESSAGE_CHARS = 2000  # of an exception message that crosses
_LENGTH_BYTES = 4


class ProtocolError(BaseException):
    """The other side sent something that is not a well-formed message in turn. A BaseException, like
    :class:`PeerGone`, so that a test's ``except Exception`` cannot swallow a broken channel."""


class PeerGone(BaseException):
    """The other process closed the channel (it exited or was killed). A BaseException so that a test's
    ``except Exception`` cannot swallow the end of the solution."""


class SolutionError(Exception):
    """An exception the other side raised whose type is not a built-in exception here."""


class SolutionObject:
    """A reference, held by the tests, to an object that lives in the solution process.

    Only what a test needs reaches across: call, attributes, items, ``len``, truth, membership, iteration,
    ``str``. Equality is identity: the solution's ``__eq__`` never runs for the tests, so an object that
    claims to equal everything equals nothing here.
    """

    __slots__ = ("_channel", "_ref", "_type", "__weakref__")

    def __init__(self, channel: Channel, ref: int, type_name: str):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def _ask(self, op: str, **fields):
        return self._channel.request(op, self, fields)

    def __call__(self, *args, **kwargs):
        return self._channel.call(self, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # protocol probes (copy, pickle, ...) stay local
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", name=name, value=value)

    def __delattr__(self, name: str) -> None:
        self._ask("delattr", name=name)

    def __getitem__(self, key):
        return self._ask("getitem", key=key)

    def __setitem__(self, key, value) -> None:
        self._ask("setitem", key=key, value=value)

    def __delitem__(self, key) -> None:
        self._ask("delitem", key=key)

    def __len__(self) -> int:
        return self._ask("len")

    def __bool__(self) -> bool:
        return _exactly(bool, self._ask("bool"), "__bool__")

    def __contains__(self, item) -> bool:
        return _exactly(bool, self._ask("contains", value=item), "__contains__")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __str__(self) -> str:
        return _exactly(str, self._ask("str"), "__str__")

    def __repr__(self) -> str:
        return f"<solution {self._type} object>"

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    __hash__ = object.__hash__


class RemoteCallable:
    """A reference, held by the solution, to a function the tests passed to it."""

    __slots__ = ("_channel", "_ref", "_type")

    def __init__(self, channel: Channel, ref: int, type_name: str):
        self._channel, self._ref, self._type = channel, ref, type_name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<test {self._type}>"


def _exactly(kind: type, value, what: str):
    if type(value) is not kind:
        raise TypeError(f"{what} of a solution object returned {type(value).__name__}, not {kind.__name__}")
    return value


_MUTABLE = (list, dict, set, bytearray)
_CONTAINERS = {"l": list, "t": tuple, "s": set, "fs": frozenset}


class Channel:
    """One end of the channel. ``tests_side`` picks how the end treats the other's objects: the tests get
    :class:`SolutionObject` references and serve only calls of their own functions; the solution gets
    :class:`RemoteCallable` references and serves every operation on its objects."""

    def __init__(self, read_fd: int, write_fd: int, tests_side: bool):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.tests_side = tests_side
        self.next_id = 1
        self.local: dict[int, object] = {}  # objects of this side the other side holds references to
        self.local_ids: dict[int, int] = {}  # id(object) -> reference, so one object keeps one reference
        self.remote: dict[int, object] = {}  # references to the other side's objects, one proxy each
        self.failed: BaseException | None = None  # set once the channel broke: no verdict can pass after it

    # --- framing ---

    def send(self, message: dict) -> None:
        body = json.dumps(message, separators=(",", ":")).encode("ascii")
        data = memoryview(len(body).to_bytes(_LENGTH_BYTES, "big") + body)
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except OSError:  # BrokenPipe: the other process is gone
            self.failed = self.failed or PeerGone()
            raise PeerGone() from None

    def receive(self) -> dict:
        try:
            return self._receive()
        except (PeerGone, ProtocolError) as exc:
            self.failed = self.failed or exc
            raise

    def _receive(self) -> dict:
        length = int.from_bytes(self._exactly(_LENGTH_BYTES), "big")
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"a message of {length} bytes")
        try:
            message = json.loads(self._exactly(length))
        except ValueError as exc:
            raise ProtocolError(f"not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise ProtocolError("a message that is not an object")
        return message

    def _exactly(self, size: int) -> bytes:
        chunks, got = [], 0
        while got < size:
            try:
                chunk = os.read(self.read_fd, min(size - got, 1 << 20))
            except OSError:
                raise PeerGone() from None
            if not chunk:
                raise PeerGone()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    # --- values ---

    def encode(self, value, depth: int = 0):
        kind = type(value)
        if value is None or kind is bool or kind is int or kind is str:
            return value
        if kind is float:
            return value if value == value and abs(value) != float("inf") else {"f": repr(value)}
        if depth > MAX_DEPTH:
            raise ValueError("a value nested too deeply to send")
        inner = depth + 1
        if kind is list:
            return {"l": [self.encode(v, inner) for v in value]}
        if kind is tuple:
            return {"t": [self.encode(v, inner) for v in value]}
        if kind is set or kind is frozenset:
            return {"s" if kind is set else "fs": [self.encode(v, inner) for v in value]}
        if kind is dict:
            return {"d": [[self.encode(k, inner), self.encode(v, inner)] for k, v in value.items()]}
        if kind is bytes or kind is bytearray:
            return {"b" if kind is bytes else "ba": binascii.b2a_base64(value, newline=False).decode("ascii")}
        if kind is complex:
            return {"c": [repr(value.real), repr(value.imag)]}
        return self._reference(value)

    def _reference(self, value) -> dict:
        own_proxy = SolutionObject if self.tests_side else RemoteCallable
        if type(value) is own_proxy and value._channel is self:
            return {"h": value._ref}  # the other side's own object, handed back
        if self.tests_side and not callable(value):
            raise TypeError(f"tests can pass data, solution objects and functions to the solution, "
                            f"not {type(value).__name__}")
        key = id(value)
        ref = self.local_ids.get(key)
        if ref is None:
            ref = self.local_ids[key] = len(self.local) + 1
            self.local[ref] = value
        name = type(value).__name__ if isinstance(type(value).__name__, str) else "object"
        return {"r": ref, "type": name[:80]}

    def decode(self, data, depth: int = 0):
        if data is None or type(data) in (bool, int, float, str):
            return data
        if type(data) is not dict or depth > MAX_DEPTH:
            raise ProtocolError("a malformed value")
        if "r" in data:  # an object of the other side
            ref, type_name = data["r"], _text(data.get("type", "object"))[:80]
            if type(ref) is not int or len(data) > 2:
                raise ProtocolError("a malformed reference")
            proxy = self.remote.get(ref)
            if proxy is None:
                kind = SolutionObject if self.tests_side else RemoteCallable
                proxy = self.remote[ref] = kind(self, ref, type_name)
            return proxy
        if len(data) != 1:
            raise ProtocolError("a malformed value")
        (key, body), inner = next(iter(data.items())), depth + 1
        if key in _CONTAINERS:
            return _CONTAINERS[key](self.decode(v, inner) for v in _list(body))
        if key == "d":
            return {self.decode(k, inner): self.decode(v, inner) for k, v in (_pair(p) for p in _list(body))}
        try:
            if key in ("b", "ba"):
                raw = binascii.a2b_base64(_text(body).encode("ascii"), strict_mode=True)
                return raw if key == "b" else bytearray(raw)
            if key == "f":
                return float(_text(body))
            if key == "c":
                real, imag = _pair(body)
                return complex(float(_text(real)), float(_text(imag)))
        except (ValueError, UnicodeEncodeError, binascii.Error) as exc:
            raise ProtocolError(f"a malformed {key!r} value: {exc}") from None
        if key == "h":  # one of our own objects, handed back
            if type(body) is not int or body not in self.local:
                raise ProtocolError(f"a reference to an unknown object {body!r}")
            return self.local[body]
        raise ProtocolError(f"an unknown value tag {key!r}")

    # --- requests ---

    def call(self, target, args: tuple, kwargs: dict):
        try:
            reply = self._request_raw("call", target, {"args": list(args), "kwargs": kwargs})
            for index, data in _items(reply.get("args")):  # the solution changed a list/dict/set argument
                if index.isdigit() and int(index) < len(args):
                    _write_back(args[int(index)], self.decode(data))
            for name, data in _items(reply.get("kwargs")):
                if name in kwargs:
                    _write_back(kwargs[name], self.decode(data))
            return self.decode(reply.get("value"))
        except (PeerGone, ProtocolError) as exc:
            self.failed = self.failed or exc
            raise

    def request(self, op: str, target, fields: dict):
        try:
            return self.decode(self._request_raw(op, target, fields).get("value"))
        except (PeerGone, ProtocolError) as exc:
            self.failed = self.failed or exc
            raise

    def _request_raw(self, op: str, target, fields: dict) -> dict:
        request_id, self.next_id = self.next_id, self.next_id + 1
        message = {"id": request_id, "op": op, "target": self._reference(target)}
        for name, value in fields.items():
            if name == "args":
                message[name] = [self.encode(v) for v in value]
            elif name == "kwargs":
                message[name] = {str(k): self.encode(v) for k, v in value.items()}
            elif name == "name":
                message[name] = str(value)
            else:
                message[name] = self.encode(value)
        self.send(message)
        while True:  # serve the other side's nested requests (callbacks) until our reply comes
            reply = self.receive()
            if "re" in reply:
                if reply["re"] != request_id:
                    raise ProtocolError(f"a reply to request {reply['re']!r} while waiting for {request_id}")
                if "raise" in reply:
                    raise exception_from(reply["raise"], op)
                return reply
            self.serve_one(reply)

    def serve_one(self, message: dict) -> None:
        """Answer one request from the other side."""
        request_id = message.get("id")
        if type(request_id) is not int or not isinstance(message.get("op"), str):
            raise ProtocolError("a request without an id or op")
        try:
            reply = {"re": request_id, **self._perform(message)}
        except (ProtocolError, PeerGone):
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the code raised goes back as a description
            reply = {"re": request_id, "raise": describe_exception(exc, message["op"])}
        self.send(reply)

    def _perform(self, message: dict) -> dict:
        raw_target = message.get("target")
        if type(raw_target) is not dict or set(raw_target) != {"h"}:
            raise ProtocolError("a request whose target is not one of our objects")
        op, target = message["op"], self.decode(raw_target)
        if self.tests_side and op != "call":  # the tests expose nothing but calls of what they passed
            raise PermissionError(f"the tests do not serve {op!r}")
        if op == "call":
            args = [self.decode(v) for v in _list(message.get("args", []))]
            raw_kwargs = message.get("kwargs", {})
            kwargs = {str(k): self.decode(v) for k, v in (raw_kwargs.items() if type(raw_kwargs) is dict else ())}
            value = target(*args, **kwargs)
            reply = {"value": self.encode(value)}
            if not self.tests_side:  # send back the new contents of mutable arguments
                changed = {str(i): self.encode(a) for i, a in enumerate(args) if type(a) in _MUTABLE}
                changed_kw = {k: self.encode(a) for k, a in kwargs.items() if type(a) in _MUTABLE}
                reply.update({"args": changed, "kwargs": changed_kw})
            return reply
        return {"value": self.encode(_OPERATIONS[op](self, target, message))}


def _operation_value(channel: Channel, message: dict):
    return channel.decode(message.get("value"))


_OPERATIONS = {
    "getattr": lambda ch, obj, m: getattr(obj, _text(m.get("name"))),
    "setattr": lambda ch, obj, m: setattr(obj, _text(m.get("name")), _operation_value(ch, m)),
    "delattr": lambda ch, obj, m: delattr(obj, _text(m.get("name"))),
    "getitem": lambda ch, obj, m: obj[ch.decode(m.get("key"))],
    "setitem": lambda ch, obj, m: obj.__setitem__(ch.decode(m.get("key")), _operation_value(ch, m)),
    "delitem": lambda ch, obj, m: obj.__delitem__(ch.decode(m.get("key"))),
    "len": lambda ch, obj, m: len(obj),
    "bool": lambda ch, obj, m: bool(obj),
    "contains": lambda ch, obj, m: _operation_value(ch, m) in obj,
    "iter": lambda ch, obj, m: iter(obj),
    "next": lambda ch, obj, m: next(obj),
    "str": lambda ch, obj, m: str(obj),
}


def describe_exception(exc: BaseException, op: str) -> dict:
    """An exception as data: its type's name, the nearest built-in exception it derives from, and a bounded
    message. A ``StopIteration`` escaping anything but ``next`` becomes a RuntimeError (as PEP 479 does for
    generators), so a solution cannot end the tests' ``map``/``filter``/``zip`` loops early by raising it."""
    if isinstance(exc, (StopIteration, StopAsyncIteration)) and op != "next":
        return {"type": "RuntimeError", "base": "RuntimeError", "message": f"the solution raised {type(exc).__name__}"}
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a broken __str__ is the solution's problem, not the channel's
        message = "<unprintable>"
    base = next((cls.__name__ for cls in type(exc).__mro__ if getattr(builtins, cls.__name__, None) is cls),
                "BaseException")
    return {"type": str(type(exc).__name__)[:80], "base": base, "message": message[:MAX_MESSAGE_CHARS]}


def exception_from(info, op: str) -> BaseException:
    """The exception to raise here for the other side's description: the built-in exception it derives from
    (so ``except ValueError`` in a test catches the solution's ``class Invalid(ValueError)``), else
    :class:`SolutionError`. Exits and interrupts (``SystemExit``, ``KeyboardInterrupt``) never cross as such,
    and ``StopIteration`` only answers ``next``."""
    if type(info) is not dict:
        return ProtocolError("a malformed exception")
    name, message = _text(info.get("type", "Exception")), _text(info.get("message", ""))
    kind = getattr(builtins, _text(info.get("base", name)), None)
    text = message if kind is not None and kind.__name__ == name else f"{name}: {message}"
    usable = isinstance(kind, type) and issubclass(kind, Exception) and kind is not StopAsyncIteration
    if usable and (kind is not StopIteration or op == "next"):
        try:
            return kind(text)
        except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs five arguments
            pass
    return SolutionError(f"{name}: {message}")


def _write_back(original, new) -> None:
    if type(original) is not type(new) or type(original) not in _MUTABLE:
        return
    if type(original) is dict or type(original) is set:
        original.clear()
        original.update(new)
    else:
        original[:] = new


def _items(value) -> list:
    if value is None:
        return []
    if type(value) is not dict:
        raise ProtocolError("a malformed argument update")
    return list(value.items())


def _list(value) -> list:
    if type(value) is not list:
        raise ProtocolError("a malformed list")
    return value


def _pair(value) -> list:
    if type(value) is not list or len(value) != 2:
        raise ProtocolError("a malformed dict entry")
    return value


def _text(value) -> str:
    if type(value) is not str:
        raise ProtocolError("a malformed string")
    return value
