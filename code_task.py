"""A built-in code task for --model runs, with nothing to download: function-writing problems in HumanEval's format
(the prompt shows a signature and a docstring; the row's tests are `def check(candidate)` with an entry point, whose
expected values the reference implementation computes), from families with knobs of their own: arithmetic,
conditionals, strings, lists, dicts and small loops, from one-liners to about ten lines. A family's held-out problems
take knob values that no trained problem of that family takes, so held-out and trained problems differ by their
parameters as well as by their text. Graded by --reward code (sandbox.py).

    python code_task.py OUT_DIR       # OUT_DIR/train.jsonl and OUT_DIR/val.jsonl, then:
    python scalerl.py --model DIR --data OUT_DIR/train.jsonl --val-data OUT_DIR/val.jsonl --instruction '' \\
        --max-new-tokens 160

bench.py --real-model DIR --task code (or mix, with the sums of docs/real-model.md) runs the study of
docs/real-model.md on it. Standard library only."""
import itertools
import json
import os
import random
import sys

PROMPT = "Write a Python function `{signature}`. {doc} Reply with one ```python code block."


def family(category, name, params, signature, doc, body, inputs):
    """One family of problems: a problem for each combination of `params` (knob: values), its function `name` (a
    format string of the knobs), `signature` and docstring `doc`, the reference `body`, and `inputs(knobs, rng)` the
    argument tuples its tests call the function with."""
    return dict(category=category, name=name, params=params, signature=signature, doc=doc, body=body, inputs=inputs)


def ints(rng, n, lo=-20, hi=20):
    return [rng.randint(lo, hi) for _ in range(n)]


WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "grass", "eagle", "north", "sugar", "maple",
         "ocean", "amber", "crane", "delta", "ivory", "otter", "umbra", "zebra"]
FAMILIES = [
    # arithmetic: one line
    family("arithmetic", "add_{k}", {"k": range(1, 21)}, "(x: int) -> int", "Return x plus {k}.",
           "    return x + {k}\n", lambda p, r: [(x,) for x in ints(r, 5)]),
    family("arithmetic", "times_{k}", {"k": range(2, 16)}, "(x: int) -> int", "Return x times {k}.",
           "    return x * {k}\n", lambda p, r: [(x,) for x in ints(r, 5)]),
    family("arithmetic", "scale_{k}_add_{m}", {"k": range(2, 8), "m": range(1, 5)}, "(x: int) -> int",
           "Return {k} times x plus {m}.", "    return {k} * x + {m}\n", lambda p, r: [(x,) for x in ints(r, 5)]),
    family("arithmetic", "average_of_{n}", {"n": range(2, 7)}, "({args}) -> float",
           "Return the mean of the {n} numbers.", "    return ({sum}) / {n}\n",
           lambda p, r: [tuple(ints(r, p["n"])) for _ in range(5)]),
    family("arithmetic", "round_to_multiple_of_{k}", {"k": [2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 20, 25]},
           "(x: int) -> int", "Return the multiple of {k} nearest to x (the larger one on a tie).",
           "    return (x + {k} // 2) // {k} * {k}\n", lambda p, r: [(x,) for x in ints(r, 5, -60, 60)]),
    # conditionals
    family("conditionals", "is_divisible_by_{k}", {"k": range(2, 14)}, "(n: int) -> bool",
           "Return True if n is divisible by {k}, else False.", "    return n % {k} == 0\n",
           lambda p, r: [(p["k"] * 3,), *((x,) for x in ints(r, 4, 1, 100))]),
    family("conditionals", "clamp_{lo}_{hi}", {"lo": range(-5, 3), "hi": range(5, 12)}, "(x: int) -> int",
           "Return x, but {lo} where x is below {lo} and {hi} where x is above {hi}.",
           "    if x < {lo}:\n        return {lo}\n    if x > {hi}:\n        return {hi}\n    return x\n",
           lambda p, r: [(x,) for x in [p["lo"] - 3, p["hi"] + 2, *ints(r, 3, -10, 15)]]),
    family("conditionals", "size_label_{t}", {"t": range(3, 30, 2)}, "(n: int) -> str",
           "Return 'small' if n is below {t}, 'medium' if n is below {t2}, and 'large' otherwise.",
           "    if n < {t}:\n        return 'small'\n    if n < {t2}:\n        return 'medium'\n    return 'large'\n",
           lambda p, r: [(p["t"] - 1,), (p["t"],), (2 * p["t"],), *((x,) for x in ints(r, 3, 0, 3 * p["t"]))]),
    family("conditionals", "is_multiple_of_{a}_or_{b}", {"a": range(2, 8), "b": range(3, 10)}, "(n: int) -> bool",
           "Return True if n is a multiple of {a} or of {b}, else False.",
           "    return n % {a} == 0 or n % {b} == 0\n", lambda p, r: [(x,) for x in ints(r, 6, 1, 60)]),
    # strings
    family("strings", "last_{k}_characters", {"k": range(1, 9)}, "(s: str) -> str",
           "Return the last {k} characters of s (all of s where it is shorter).", "    return s[-{k}:]\n",
           lambda p, r: [(w,) for w in ["", "ab", *r.sample(WORDS, 3)]]),
    family("strings", "repeat_{k}_times", {"k": range(2, 10)}, "(s: str) -> str",
           "Return s repeated {k} times.", "    return s * {k}\n",
           lambda p, r: [(w,) for w in ["", *r.sample(WORDS, 4)]]),
    family("strings", "count_letter_{c}", {"c": "abdeilnorst"}, "(s: str) -> int",
           "Return how many times the letter '{c}' appears in s.", "    return s.count('{c}')\n",
           lambda p, r: [(" ".join(r.sample(WORDS, 3)),) for _ in range(5)]),
    family("strings", "join_with_{name_sep}", {"sep": ["-", "+", "/", ":", "_", ", ", " | "]}, "(words: list) -> str",
           "Return the words joined into one string with '{sep}' between them.", "    return '{sep}'.join(words)\n",
           lambda p, r: [(r.sample(WORDS, r.randint(1, 4)),) for _ in range(5)]),
    family("strings", "shout_every_{k}", {"k": range(2, 6)}, "(s: str) -> str",
           "Return s with the characters at positions {k}, {k2}, {k3}, ... (counting from 1) in upper case.",
           "    out = ''\n    for i, ch in enumerate(s):\n        out += ch.upper() if (i + 1) % {k} == 0 else ch\n"
           "    return out\n", lambda p, r: [("".join(r.sample(WORDS, 2)),) for _ in range(5)]),
    # lists
    family("lists", "first_{k}_items", {"k": range(1, 9)}, "(xs: list) -> list",
           "Return the first {k} items of xs (all of them where it is shorter).", "    return xs[:{k}]\n",
           lambda p, r: [(ints(r, r.randint(0, 10)),) for _ in range(5)]),
    family("lists", "sum_above_{k}", {"k": range(-5, 10)}, "(xs: list) -> int",
           "Return the sum of the numbers in xs that are greater than {k}.",
           "    return sum(x for x in xs if x > {k})\n", lambda p, r: [(ints(r, r.randint(0, 6)),) for _ in range(5)]),
    family("lists", "every_{k}th", {"k": range(2, 7)}, "(xs: list) -> list",
           "Return every {k}th element of xs, starting from the first.", "    return xs[::{k}]\n",
           lambda p, r: [(ints(r, r.randint(0, 12)),) for _ in range(5)]),
    family("lists", "running_max_from_{start}", {"start": range(-3, 4)}, "(xs: list) -> list",
           "Return a list whose i-th item is the largest of {start} and xs[0], ..., xs[i].",
           "    out, best = [], {start}\n    for x in xs:\n        best = max(best, x)\n        out.append(best)\n"
           "    return out\n", lambda p, r: [(ints(r, r.randint(0, 7), -9, 9),) for _ in range(5)]),
    # dicts
    family("dicts", "add_{k}_to_values", {"k": range(1, 12)}, "(d: dict) -> dict",
           "Return a new dict with the keys of d, each value increased by {k}.",
           "    return {{key: value + {k} for key, value in d.items()}}\n",
           lambda p, r: [({w: x for w, x in zip(r.sample(WORDS, r.randint(0, 4)), ints(r, 4))},) for _ in range(5)]),
    family("dicts", "keys_with_values_above_{k}", {"k": range(-4, 8)}, "(d: dict) -> list",
           "Return the keys of d whose values are greater than {k}, sorted.",
           "    return sorted(key for key, value in d.items() if value > {k})\n",
           lambda p, r: [({w: x for w, x in zip(r.sample(WORDS, r.randint(0, 5)), ints(r, 5, -9, 15))},)
                         for _ in range(5)]),
    family("dicts", "key_of_{which}_value", {"which": ["largest", "smallest"]}, "(d: dict) -> str",
           "Return the key of d whose value is the {which} (the first such key, in the dict's order).",
           "    best = None\n    for k, v in d.items():\n        if best is None or v {op} d[best]:\n"
           "            best = k\n    return best\n",
           lambda p, r: [({w: x for w, x in zip(r.sample(WORDS, 4), ints(r, 4))},) for _ in range(5)]),
    family("dicts", "count_words_longer_than_{k}", {"k": range(2, 6)}, "(text: str) -> dict",
           "Return a dict from each word of text (split on spaces) that is longer than {k} letters to how many times "
           "it appears.", "    counts = {{}}\n    for w in text.split():\n        if len(w) > {k}:\n"
           "            counts[w] = counts.get(w, 0) + 1\n    return counts\n",
           lambda p, r: [(" ".join(r.choice(WORDS + ["ox", "ant", "bee", "owl"]) for _ in range(6)),)
                         for _ in range(5)]),
    # small loops
    family("loops", "sum_of_multiples_of_{k}_below", {"k": range(2, 10)}, "(n: int) -> int",
           "Return the sum of the positive multiples of {k} that are below n.",
           "    total = 0\n    for i in range(1, n):\n        if i % {k} == 0:\n            total += i\n"
           "    return total\n",
           lambda p, r: [(0,), *((r.randint(1, 60),) for _ in range(4))]),
    family("loops", "digit_sum_times_{k}", {"k": range(1, 10)}, "(n: int) -> int",
           "Return the sum of the decimal digits of n (n >= 0), times {k}.",
           "    total = 0\n    while n > 0:\n        total += n % 10\n        n //= 10\n    return total * {k}\n",
           lambda p, r: [(0,), *((r.randint(1, 99999),) for _ in range(4))]),
    family("loops", "steps_to_one_{m}", {"m": [3, 5]}, "(n: int) -> int",
           "Starting from n (n >= 1), count the steps to reach 1, where a step halves an even number and turns an "
           "odd number x into {m} * x + 1. (Stop after 1000 steps and return -1.)",
           "    steps = 0\n    while n != 1:\n        if steps == 1000:\n            return -1\n"
           "        n = n // 2 if n % 2 == 0 else {m} * n + 1\n        steps += 1\n    return steps\n",
           lambda p, r: [(1,), *((r.randint(2, 40),) for _ in range(4))]),
    family("loops", "fizz_{a}_buzz_{b}", {"a": range(2, 6), "b": range(3, 8)}, "(n: int) -> list",
           "Return the list for 1..n of 'FizzBuzz' for multiples of both {a} and {b}, 'Fizz' for multiples of {a}, "
           "'Buzz' for multiples of {b}, and the number as a string otherwise.",
           "    out = []\n    for i in range(1, n + 1):\n        if i % {a} == 0 and i % {b} == 0:\n"
           "            out.append('FizzBuzz')\n        elif i % {a} == 0:\n            out.append('Fizz')\n"
           "        elif i % {b} == 0:\n            out.append('Buzz')\n        else:\n            out.append(str(i))\n"
           "    return out\n", lambda p, r: [(0,), *((r.randint(1, 25),) for _ in range(4))]),
]


def knob_values(p):
    """The format values of a family's knobs: the knobs, and what the templates derive from them."""
    n = p.get("n", 2)
    names = [f"x{i + 1}" for i in range(n)]
    return {**p, "k2": 2 * p.get("k", 0), "k3": 3 * p.get("k", 0), "t2": 2 * p.get("t", 0),
            "args": ", ".join(f"{a}: int" for a in names),
            "sum": " + ".join(names), "params": ", ".join(names), "op": ">" if p.get("which") == "largest" else "<",
            "name_sep": {"-": "dashes", "+": "plus_signs", "/": "slashes", ":": "colons", "_": "underscores",
                         ", ": "commas", " | ": "bars"}.get(p.get("sep"), "")}


def problem(fam, p, seed):
    """A row of family `fam` with knobs p: prompt, test (check(candidate) with the reference's values), entry_point,
    and the reference (canonical_solution) and family, knobs and category for the record."""
    v = knob_values(p)
    name = fam["name"].format(**{**v, **{k: f"minus_{-x}" for k, x in p.items() if isinstance(x, int) and x < 0}})
    doc, signature, body = fam["doc"].format(**v), fam["signature"].format(**v), fam["body"].format(**v)
    stub = f'def {name}{signature}:\n    """{doc}"""\n'
    reference = {}
    exec(stub + body, reference)  # (our own reference, to compute the expected values)
    lines = []
    for args in fam["inputs"](p, random.Random(seed)):
        call, want = f"candidate({', '.join(map(repr, args))})", reference[name](*args)
        lines.append(f"    assert abs({call} - {want!r}) < 1e-9" if isinstance(want, float) else
                     f"    assert {call} == {want!r}")
    return {"prompt": PROMPT.format(signature=name + signature, doc=doc),
            "test": "def check(candidate):\n" + "\n".join(lines) + "\n",
            "entry_point": name, "canonical_solution": body, "stub": stub, "family": fam["name"], "knobs": p,
            "category": fam["category"]}


def problems(n_val=40, per_family=12, seed=0):
    """(train, val): each family's knob combinations (at most per_family of them, drawn), split so that the values of
    its first knob in held-out problems never occur in its trained ones (a fifth of them held out, at least one);
    n_val held-out problems taken round-robin over the categories, and within a category over its families, so that
    every category is there (16 or more) and every family (40); in a drawn order."""
    rng, train, held = random.Random(seed), [], []
    for k, fam in enumerate(FAMILIES):
        knobs = list(fam["params"])
        first = list(fam["params"][knobs[0]])
        rng.shuffle(first)
        out = set(first[:max(1, round(len(first) / 5))])
        combos = [dict(zip(knobs, v)) for v in itertools.product(*(fam["params"][n] for n in knobs))]
        combos = [p for p in combos if p.get("a") != p.get("b", 0)]  # (not "a multiple of 5 or of 5")
        rng.shuffle(combos)
        rows = [problem(fam, p, seed * 1000 + k) for p in combos]
        train += [r for r, p in zip(rows, combos) if p[knobs[0]] not in out][:per_family]
        held.append([r for r, p in zip(rows, combos) if p[knobs[0]] in out])
    by_category = {}
    for fam, rows in zip(FAMILIES, held):
        by_category.setdefault(fam["category"], []).append(rows)
    streams = [[r for layer in itertools.zip_longest(*fams) for r in layer if r] for fams in by_category.values()]
    val = [r for layer in itertools.zip_longest(*streams) for r in layer if r][:n_val]
    for part in (train, val):
        rng.shuffle(part)
    return train, val


def write(out, train, val):
    os.makedirs(out, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        with open(os.path.join(out, name + ".jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python code_task.py OUT_DIR")
    tr, va = problems()
    write(sys.argv[1], tr, va)
    print(f"{len(tr)} training and {len(va)} held-out problems in {sys.argv[1]}")
