"""Code rows: the public code sets' shapes of a row's tests, read as published (row_tests), each set's own output
comparison where it is more lenient than line by line (same_output), the reference solutions a row carries
(references), the prompt with its starter code (prompt), and the program in a completion (code_block). sandbox.verdict
grades a program on its row with them. The shapes:
  Python tests     tests, test or test_list: MBPP's asserts (after its test_imports and test_setup_code), HumanEval's
                   def check(candidate) with its entry_point (and its prompt's helpers, the row's);
  stdin            inputs and outputs, or input_output as JSON (APPS, TACO): each input a run, its output compared;
  call-based       input_output with fn_name (APPS, TACO): each input a list of arguments of fn_name (a method of
                   class Solution where the starter code has one), each output its value, often wrapped in a list;
  LiveCodeBench    public_test_cases (JSON: input, output, testtype stdin or functional, a functional input one JSON
                   value a line) and private_test_cases (base64 of zlib of a pickle of that JSON: unpickled with no
                   class or function allowed, a pickle being code), func_name in metadata;
  CodeContests     public_tests, private_tests and generated_tests, each {input: [...], output: [...]}.
Standard library only."""
import ast
import base64
import builtins
import contextlib
import decimal
import io
import json
import math
import os
import pickle
import re
import sys
import zlib

NO_TESTS = "no tests: 'tests', 'test' or 'test_list', or 'inputs' and 'outputs' (or 'input_output'), as strings"
TEST_FIELDS = ("tests", "test", "test_list", "inputs", "outputs", "input_output", "public_test_cases",
               "private_test_cases", "public_tests", "private_tests", "generated_tests")
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n`]*\n(.*?)(?:^[ \t]*\1[ \t\r]*$|\Z)", re.M | re.S)
PYTHON = {"", "python", "py", "python3", "py3"}
IMPORTS = ("from typing import *\nimport bisect, collections, functools, heapq, itertools, math, re, string, sys\n"
           "from bisect import *\nfrom collections import *\nfrom functools import *\nfrom heapq import *\n"
           "from itertools import *\nfrom math import *\n")  # (what APPS's and LiveCodeBench's graders put first)
CALLS = """import json
def same(got, want):  # (%s)
    got = list(got) if isinstance(got, tuple) else got
    return got == want or %s
for args, want in json.loads(%r):
    assert same(%s(*args), want), f"{args!r:.200}"
"""
APPS_SAME = ("APPS's call-based check: a tuple as a list; a list of one value as that value",
             "isinstance(want, list) and len(want) == 1 and (got == want[0] or isinstance(got, list) and "
             "[list(x) if isinstance(x, tuple) else x for x in got] == want[0])")


def row_tests(row):
    """The spec of a code row's tests (the shapes above), NO_TESTS where it has none, else why its tests are unusable.
    The spec: tests (Python that calls the program), entry (HumanEval's entry_point), prompt (what runs before the
    program: HumanEval's prompt, the public sets' imports), modules (standard modules the tests use unimported: MBPP's
    math), names (what the tests call of the program), fallback (built-ins or modules that the tests call: the
    program's where it defines them and the tests call nothing else of it), ins and outs (stdin runs), compare."""
    spec = dict(tests=None, entry=None, prompt=None, modules=[], names=[], fallback=[], ins=None, outs=None,
                compare="lines")
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
    try:
        cases = public_cases(row)
    except (ValueError, TypeError, KeyError, AttributeError, zlib.error, pickle.UnpicklingError, EOFError,
            RecursionError) as e:
        field = next(k for k in TEST_FIELDS if k in row)
        return f"'{field}' looks like tests, in a shape not known ({type(e).__name__}: {str(e)[:120]})"
    if cases is None:
        return NO_TESTS
    kind, fn, pairs, compare = cases
    if kind == "stdin":
        return {**spec, "ins": [p[0] for p in pairs], "outs": [p[1] for p in pairs], "compare": compare,
                "prompt": IMPORTS if compare == "decimals" or "input_output" in row else None}
    target = f"Solution().{fn}" if re.search(r"^class Solution\b", str(row.get("starter_code")), re.M) else fn
    same = APPS_SAME if compare == "apps" else ("LiveCodeBench's functional check: a tuple as a list", "False")
    tests = CALLS % (*same, json.dumps(pairs), target)
    return {**spec, "tests": tests, "names": [target.split("(")[0]], "prompt": IMPORTS}


def public_cases(row):
    """(stdin or call, the function's name, [(input, output)], how outputs compare) of a row in one of the public
    sets' shapes; None where it has none of them; an exception where a field is there in a shape not known."""
    if "public_test_cases" in row or "private_test_cases" in row:  # LiveCodeBench
        tests = [t for k in ("public_test_cases", "private_test_cases") for t in loaded(row.get(k), k)]
        kinds = {t["testtype"] for t in tests}
        if not tests or len(kinds) > 1 or kinds - {"stdin", "functional"}:
            raise ValueError(f"test types {sorted(kinds)}")
        if kinds == {"stdin"}:
            return "stdin", None, [(t["input"], t["output"]) for t in tests], "decimals"
        fn = loaded(row.get("metadata") or "{}", "metadata")["func_name"]
        return "call", fn, [([json.loads(a) for a in t["input"].split("\n") if a.strip()], json.loads(t["output"]))
                            for t in tests], "lcb"
    if any(k in row for k in ("public_tests", "private_tests", "generated_tests")):  # CodeContests
        pairs = [p for k in ("public_tests", "private_tests", "generated_tests") if row.get(k) is not None
                 for p in zip(row[k]["input"], row[k]["output"], strict=True)]
        if not pairs or not all(isinstance(s, str) for p in pairs for s in p):
            raise ValueError("no input and output strings")
        return "stdin", None, pairs, "tokens"
    io_ = row.get("input_output", row)
    if isinstance(io_, str):
        io_ = json.loads(io_)
    ins, outs = (io_.get(k) if isinstance(io_, dict) else None for k in ("inputs", "outputs"))
    if ins is None and outs is None and "input_output" not in row:
        return None
    if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)):
        raise ValueError("inputs and outputs: two lists of one length")
    if io_.get("fn_name"):  # (APPS, TACO: call-based)
        return "call", str(io_["fn_name"]), list(zip(ins, outs)), "apps"
    text = lambda s: "\n".join(s) if isinstance(s, list) and all(isinstance(x, str) for x in s) else s  # noqa: E731
    ins, outs = list(map(text, ins)), list(map(text, outs))
    if not all(isinstance(s, str) for s in ins + outs):
        raise ValueError("inputs and outputs that are not text")
    return "stdin", None, list(zip(ins, outs)), "tokens" if "input_output" in row else "lines"


def loaded(value, field):
    """A LiveCodeBench field as published: a list, JSON text, or (private tests) base64 of zlib of a pickle of JSON
    text, unpickled with no class or function allowed."""
    if isinstance(value, (list, dict)) or value is None:
        return value or []
    with contextlib.suppress(ValueError):
        return json.loads(value)
    data = zlib.decompressobj().decompress(base64.b64decode(value), 1 << 28)
    text = DataOnly(io.BytesIO(data)).load()
    if not isinstance(text, str):
        raise ValueError(f"'{field}' unpickles to {type(text).__name__}, not JSON text")
    return json.loads(text)


class DataOnly(pickle.Unpickler):
    def find_class(self, module, name):  # (a pickle that names a class or function would run it: refused)
        raise pickle.UnpicklingError(f"a pickle that names {module}.{name}: code, not data")


def same_output(got, want, how):
    """Whether a run's output is the expected one, as its set compares: lines (each line, trailing whitespace and
    trailing empty lines ignored); tokens (APPS, TACO, CodeContests: the whitespace-separated tokens in order, numbers
    within APPS's tolerance, |a - b| <= 1e-8 + 1e-5 |b|; APPS also accepts tokens out of order, which this does not);
    decimals (LiveCodeBench: line by line, a line equal once stripped or as a list of Decimals)."""
    lines = lambda s: [x.rstrip() for x in s.rstrip().splitlines()]  # noqa: E731
    if how == "lines":
        return lines(got) == lines(want)
    if how == "tokens":
        g, w = got.split(), want.split()
        return len(g) == len(w) and all(a == b or close(a, b) for a, b in zip(g, w))
    g, w = got.strip().split("\n"), want.strip().split("\n")
    return len(g) == len(w) and all(a.strip() == b.strip() or decimals(a) == decimals(b) != "?" for a, b in zip(g, w))


def close(a, b):
    with contextlib.suppress(ValueError, OverflowError):
        x, y = float(a), float(b)
        return math.isfinite(x) and math.isfinite(y) and abs(x - y) <= 1e-8 + 1e-5 * abs(y)
    return False


def decimals(line):
    try:
        return [decimal.Decimal(x) for x in line.split()]
    except decimal.InvalidOperation:
        return "?"


def references(row):
    """The reference solutions a row carries, as programs: HumanEval's canonical_solution (a body, after the prompt
    that verdict puts first), MBPP's code, APPS's and TACO's solutions (JSON text), CodeContests' Python 3 ones."""
    if isinstance(row.get("canonical_solution"), str):
        return [row["canonical_solution"]]
    if isinstance(row.get("code"), str):
        return [row["code"]]
    sols = row.get("solutions")
    if isinstance(sols, str):
        with contextlib.suppress(ValueError):
            sols = json.loads(sols)
    if isinstance(sols, dict):  # (CodeContests: language 3 is PYTHON3)
        sols = [s for lang, s in zip(sols.get("language", []), sols.get("solution", [])) if lang == 3]
    return [s for s in sols if isinstance(s, str)] if isinstance(sols, list) else []


def prompt(row, text):
    """A code row's prompt: its text, then its starter code where the set gives one (APPS, TACO, LiveCodeBench)."""
    starter = row.get("starter_code") if isinstance(text, str) else None
    return f"{text}\n\n```python\n{starter.rstrip()}\n```" if isinstance(starter, str) and starter.strip() else text


def named_rows(report, path, die):
    """The rows of `path` that a `bench.py --check-data` report names (its lines: file, row, why); die(why) where the
    report cannot be read."""
    try:
        with open(report) as f:
            named = [json.loads(line) for line in f if line.strip()]
        return {n["row"] for n in named if os.path.realpath(n["file"]) == os.path.realpath(path)}
    except (OSError, ValueError, TypeError, KeyError) as e:
        die(f"--exclude-rows {report}: not a --check-data report ({type(e).__name__}: {e})")


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
