"""Code rows: the formats of a row's tests (row_tests), as the public code sets publish them, and the program in a
completion (code_block). sandbox.verdict grades a program on its row with them. Standard library only."""
import ast
import builtins
import contextlib
import json
import re
import sys

NO_TESTS = "no tests: 'tests', 'test' or 'test_list', or 'inputs' and 'outputs' (or 'input_output'), as strings"
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n`]*\n(.*?)(?:^[ \t]*\1[ \t\r]*$|\Z)", re.M | re.S)
PYTHON = {"", "python", "py", "python3", "py3"}


def row_tests(row):
    """The spec of a code row's tests, NO_TESTS where it has none, else why its tests are unusable. tests, test and
    test_list: Python that calls the program (MBPP's asserts, after its test_imports and test_setup_code; HumanEval's
    def check(candidate), called with the entry_point, its prompt's helpers the row's); inputs/outputs: stdin and
    expected stdout (APPS); input_output: those as JSON. The spec: tests, entry, prompt, modules (standard modules the
    tests use unimported: MBPP's math), names (what they call of the program), fallback (built-ins or modules that
    the tests call: the program's where it defines them and the tests call nothing else of it), ins, outs."""
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
