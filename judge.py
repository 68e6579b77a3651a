"""The two sides of the code reward's call boundary (sandbox.py runs them, each in its own process): the program's
side (serve, in C) and the tests' side (judge, in the warden A), and what crosses between them: plain data alone,
None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets and frozensets of these, exact types, at
most DEPTH deep, a message at most out_kb. A decodes every message itself (plain_in), so no object of the program's,
and no code of it, reaches the process that decides the verdict; what C sends is read as hostile. Also here: the
formats of a code row's tests (row_tests). Standard library only."""
import builtins
import contextlib
import json
import os
import select
import signal
import sys

DEPTH = 64
NO_TESTS = "no tests: 'tests', 'test' or 'test_list', or 'inputs' and 'outputs' (or 'input_output'), as strings"
CONTAINERS = (("l", list), ("t", tuple), ("s", set), ("f", frozenset), ("d", dict))
FORGED = "hack: the harness touched (a message it does not send)"


def row_tests(row):
    """(tests, entry_point, modules, inputs, outputs) of a code row; NO_TESTS where it has none; else why its tests
    are unusable. tests/test/test_list: Python that calls the program (MBPP's asserts, after its test_imports and
    test_setup_code; HumanEval's def check(candidate), called with the entry_point); modules: the standard modules
    they use unimported (MBPP's math); inputs/outputs: stdin and expected stdout (APPS); input_output: those as JSON."""
    t = next(filter(None, map(row.get, ("tests", "test", "test_list"))), None)
    t = "\n".join(t) if isinstance(t, list) and all(isinstance(s, str) for s in t) else t
    if isinstance(t, str) and t.strip():
        imports = row.get("test_imports") if isinstance(row.get("test_imports"), list) else []
        t = "\n".join([s for s in [*imports, row.get("test_setup_code")] if isinstance(s, str)] + [t])
        entry, names = row.get("entry_point"), program_names(t)
        if isinstance(names, str) or entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            return names if isinstance(names, str) else f"'entry_point' {entry!r} is not a function name"
        if names[1] and not entry:
            return "the tests define check(candidate), and the row has no 'entry_point' to call it with"
        return (t, entry if names[1] else None, names[2], None, None) if names[0] or names[1] else (
            "the tests call no function of the program: they could pass without it")
    io = row.get("input_output", row)
    with contextlib.suppress(TypeError, ValueError):
        io = json.loads(io)
    ins, outs = (io.get(k) if isinstance(io, dict) else None for k in ("inputs", "outputs"))
    if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)
            and all(isinstance(s, str) for s in ins + outs)):
        return NO_TESTS
    return None, None, [], ins, outs


def has_tests(row):
    """Whether a row has tests in one of the formats, usable or not (row_tests says why not)."""
    return row_tests(row) != NO_TESTS


def program_names(tests):
    """(the names that the tests use and neither bind nor find among the built-ins and standard modules: the
    program's; whether they define check(); the standard modules they use unimported), or why they are not Python."""
    import ast
    try:
        nodes = list(ast.walk(ast.parse(tests)))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"the tests are not Python ({type(e).__name__}: {e})"
    bound = {n.id if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) else getattr(n, "arg", None)
             if isinstance(n, ast.arg) else getattr(n, "name", None) for n in nodes}
    bound |= {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    free = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound - set(dir(builtins))
    return free - sys.stdlib_module_names, any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in nodes), \
        sorted(free & sys.stdlib_module_names)


def plain_out(v, depth=0):
    """v as JSON of exact built-in types, or TypeError naming what is not plain data. Calls no method of v's."""
    t = type(v)
    if v is None or t is bool or t is str or t is float:
        return v
    if depth > DEPTH:
        raise TypeError(f"data nested over {DEPTH} deep")
    if t is int or t is bytes or t is complex:
        return ["i", format(v, "x")] if t is int else ["b", v.hex()] if t is bytes else ["c", v.real, v.imag]
    for tag, kind in CONTAINERS:
        if t is kind:  # (a dict: its keys and values, one after another)
            items = v if t is not dict else (x for pair in v.items() for x in pair)
            return [tag, *[plain_out(x, depth + 1) for x in items]]
    raise TypeError(f"a {t.__name__}" if t.__module__ == "builtins" else f"a {t.__module__}.{t.__qualname__}")


def plain_in(x):
    """What plain_out wrote, as exact built-in types; ValueError (or TypeError, RecursionError) for anything else:
    the judge's side of the boundary, where a message may be forged."""
    if x is None or type(x) in (bool, str, float):
        return x
    tag, rest = (x[0], x[1:]) if type(x) is list and x and type(x[0]) is str else ("", [])
    if tag in ("i", "b") and len(rest) == 1 and type(rest[0]) is str:
        return int(rest[0], 16) if tag == "i" else bytes.fromhex(rest[0])
    if tag == "c" and len(rest) == 2 and type(rest[0]) is float and type(rest[1]) is float:
        return complex(*rest)
    if tag == "d" and len(rest) % 2 == 0:
        return dict(zip(map(plain_in, rest[::2]), map(plain_in, rest[1::2])))
    if tag in ("l", "t", "s", "f"):
        return dict(CONTAINERS)[tag](map(plain_in, rest))
    raise ValueError("not plain data")


def send(fd, message, cap=1 << 62):
    """A message: its length (8 bytes), then its JSON; over cap bytes, ValueError and nothing sent."""
    data = json.dumps(message).encode()
    if len(data) > cap:
        raise ValueError(f"over {cap >> 10} KB")
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd, cap=1 << 62):
    """The next message; EOFError where the channel is closed, ValueError where it is over cap bytes or not JSON."""
    n = int.from_bytes(read(fd, 8), "little")
    if n > cap:
        raise ValueError(f"a message of {n} bytes")
    return json.loads(read(fd, n))


def read(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def serve(code, io, cap, calls=3, answers=4):
    """C, confined: runs the program, then sends [ready, the names it defines] (a stdin/stdout row: it ran to its
    end), or what its exception was (caught), and answers each call, ["name", args, kwargs], with [ok, result],
    [raise, built-in type, text], [limit, type], [bad, what is not plain data] or [ended, type]."""
    g, flush, ended = {"__name__": "__main__" if io else "solution", "__builtins__": builtins}, sys.stdout.flush, None
    try:
        exec(compile(code, "solution.py", "exec"), g)
    except BaseException as e:  # noqa: BLE001
        ended = None if io and type(e) is SystemExit and e.code in (None, 0) else e  # (a script's sys.exit())
    with contextlib.suppress(BaseException):
        flush()
    send(answers, ["ready", [n for n, v in list(g.items()) if type(n) is str and callable(v)] * (not io)]
         if ended is None else caught(ended, io))
    while ended is None and not io:
        name, args, kwargs = receive(calls)
        try:
            result = g[name](*plain_in(args), **plain_in(kwargs))
        except BaseException as e:  # noqa: BLE001
            send(answers, caught(e))
            ended = not isinstance(e, Exception) or None
            continue
        try:
            send(answers, ["ok", plain_out(result)], cap)
        except (TypeError, ValueError, RecursionError) as e:
            send(answers, ["bad", str(e)])


def caught(e, io=False):
    """C's message for the program's exception: a limit (MemoryError: the sandbox's memory bound); an Exception, as
    its nearest built-in type (RecursionError too: a program's own unbounded recursion fails it, as any exception
    does); anything else (SystemExit, KeyboardInterrupt, a BaseException of its own) ended the program (on a stdin
    row: it raised)."""
    if isinstance(e, MemoryError) or not (io or isinstance(e, Exception)):
        return ["limit" if isinstance(e, MemoryError) else "ended", type(e).__name__[:80]]
    with contextlib.suppress(BaseException):
        return ["raise", next(c for c in type(e).__mro__ if getattr(builtins, c.__name__, 0) is c).__name__,
                str(e)[:500]]
    return ["raise", "Exception", ""]


class Stop(BaseException):
    """A: the tests stop here (the verdict is recorded first, so catching this changes nothing)."""


def judge(spec, io, c, calls, answers, cap, cpu_s=float("inf")):
    """A: the verdict, {"passed": True}, {"why": ...} or {"error": ...}. The tests run in globals where each function
    that the program defines is a proxy (a built-in's name never is), the standard modules they use unimported are
    imported, and a HumanEval prompt's helpers are the row's; a proxy's call is a message to C."""
    marks, made, pidfd = [], [], os.pidfd_open(c)

    def stop(verdict):
        marks.append(verdict if isinstance(verdict, dict) else {"why": verdict})
        raise Stop

    def answer(when):
        """C's next message; or C's end: it exited, was killed, or lives on without its channel (then is killed)."""
        with contextlib.suppress(EOFError):
            try:
                m = receive(answers, cap)
            except (ValueError, RecursionError):
                stop(FORGED)
            return m if type(m) is list and len(m) > 1 and type(m[0]) is str else stop(FORGED)
        if not select.select([pidfd], [], [], 1.0)[0]:
            os.kill(c, signal.SIGKILL)
            stop("hack: the harness touched (the program closed its channel)")
        _, status, usage = os.wait4(c, 0)
        cpu = usage.ru_utime + usage.ru_stime >= cpu_s  # (the init of its namespace, SIGXCPU passes it by: SIGKILL)
        stop({"error": f"over the CPU time ({cpu_s} s)" if cpu else f"the program was killed by signal "
              f"{os.WTERMSIG(status)}"} if os.WIFSIGNALED(status) else
             f"the program ended with status {status >> 8}" if io and status else {"passed": True} if io else
             f"hack: the program ended {when} (its process exited)")

    def proxy(name):
        def call(*args, **kwargs):
            if marks:
                raise Stop
            try:
                payload = [name, plain_out(list(args)), plain_out(kwargs)]
            except (TypeError, RecursionError) as e:
                stop({"error": f"the row's tests pass {e} to {name}(): only plain data crosses to the program"})
            made.append(name)
            with contextlib.suppress(OSError):  # (C gone: its end is read below)
                send(calls, payload)
            m = answer("during its tests")
            try:
                if m[0] == "ok" and len(m) == 2:
                    return plain_in(m[1])
                raised = built_in(m[1], m[2]) if m[0] == "raise" and len(m) == 3 and type(m[2]) is str else None
            except (ValueError, TypeError, RecursionError, OverflowError):
                stop(FORGED)
            if raised is None:  # (a limit, not plain data, the program ended, or a forged message)
                stop(said(m, "during its tests"))
            raise raised
        return call

    failure = None
    try:
        m = answer("before its tests")
        if m[0] != "ready" or len(m) != 2 or type(m[1]) is not list:
            return said(m, "before its tests")
        if io:
            return {"passed": True}
        exported = {n for n in m[1] if type(n) is str and n.isidentifier() and not n.startswith("__")}
        if spec["entry"] and spec["entry"] not in exported:
            return {"why": f"the program defines no function {spec['entry']}()"}
        g = {"__name__": "__main__", "__builtins__": builtins, **{n: __import__(n) for n in spec["modules"]},
             **{n: proxy(n) for n in exported if not hasattr(builtins, n) and n not in spec["modules"]}}
        if spec["entry"] and spec["prompt"]:  # a HumanEval prompt: its helpers (poly, encode_cyclic) are the row's,
            with contextlib.suppress(Exception):  # its entry point (a stub there, named by some tests) the program's
                exec(compile(spec["prompt"], "prompt.py", "exec"), g)
            g[spec["entry"]] = proxy(spec["entry"])
        exec(compile(spec["tests"], "tests.py", "exec"), g)
        if spec["entry"]:
            g["check"](proxy(spec["entry"]))
    except Stop:
        pass
    except BaseException as e:  # noqa: BLE001  (an AssertionError, or the program's exception, uncaught)
        failure = f"{type(e).__name__}: {e}"[:500]
    return marks[0] if marks else {"why": failure} if failure else {"passed": True} if made else {
        "error": "the row's tests passed without calling the program"}


def built_in(name, text):
    """The program's exception, as the built-in Exception type it names (StopIteration as RuntimeError, as PEP 479
    does: a call cannot end a loop of the tests'), or None where it names none."""
    cls = getattr(builtins, name, None) if type(name) is str else None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    for base in (RuntimeError if issubclass(cls, (StopIteration, StopAsyncIteration)) else cls).__mro__:
        with contextlib.suppress(TypeError):
            return base(text)


def said(m, when):
    """A's verdict on a message of C's that is no result: a limit, not plain data, the program ended, or raised before
    its tests; anything else is forged."""
    what = m[1] if type(m[1]) is str else None
    if m[0] == "limit" and what:
        return {"error": f"the program hit a limit ({what})"}
    return {"why": {"bad": f"hack: a call returned {what}, not plain data",
                    "ended": f"hack: the program ended {when} ({what})",
                    "raise": f"the program raised {what}: {m[-1]}"[:500] if when == "before its tests" and len(m) == 3
                    else FORGED}.get(m[0], FORGED) if what else FORGED}
