"""Tests of scalerl.py's data loading, prompting and rewards (--data, --reward math): a hand-written table of
answers with their verdicts, a grader that hangs or crashes, every input format and every kind of bad row, and
a tiny model trained end to end on generated arithmetic problems. Run: python -m pytest -q"""
import json
import os
import subprocess
import sys
import time

import pytest

import scalerl as S
from conftest import warm_vllm_model_info

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


# ---------------------------------------------------------------------------------------------- math reward
MATH_CASES = [  # (completion text, reference answer, verdict a careful human grader gives)
    # fractions and decimals
    ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", 1),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1),
    ("\\boxed{\\dfrac12}", "0.5", 1),
    ("\\boxed{\\dfrac{2}{4}}", "1/2", 1),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1),
    ("\\boxed{2.0}", "2", 1),
    ("\\boxed{12.0001}", "12", 0),
    ("\\boxed{\\pi}", "3.14", 0),
    ("\\boxed{0.333}", "1/3", 0),  # a rounded decimal is not the fraction
    ("\\boxed{2^{10}}", "1024", 1),
    # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1),
    ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt3}{2}", 0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1),
    ("\\boxed{\\left(1,2\\right]}", "(1,2]", 1),
    # several boxes: the last one counts
    ("first \\boxed{3}, then on reflection \\boxed{4}", "4", 1),
    ("first \\boxed{3}, then on reflection \\boxed{4}", "3", 0),
    ("Answer: 3 is wrong, so \\boxed{4}", "4", 1),
    # the reasoning is stripped up to </think>
    ("<think>maybe \\boxed{7}</think> The answer is \\boxed{8}", "8", 1),
    ("<think>maybe \\boxed{7}</think> The answer is \\boxed{8}", "7", 0),
    ("<think>it is \\boxed{7}</think> I am not sure.", "7", 0),
    ("<think>no closing tag, \\boxed{7}", "7", 1),
    # no answer at all
    ("the answer is \\boxed{12", "12", 0),
    ("the answer is \\boxed{}", "12", 0),
    ("I do not know.", "12", 0),
    ("", "12", 0),
    ("It costs 42 dollars.", "42", 0),
    # an 'answer:' line as fallback
    ("Answer: 42", "42", 1),
    ("**Final Answer:** $\\dfrac{3}{4}$", "0.75", 1),
    ("The final answer is: 19.", "19", 1),
    ("Answer: 7\nWait, let me check again.\nAnswer: 8", "8", 1),
    # thousands separators
    ("\\boxed{1,000}", "1000", 1),
    ("\\boxed{1000}", "1,000", 1),
    ("\\boxed{1{,}000{,}000}", "1000000", 1),
    # negative numbers
    ("\\boxed{-5}", "-5", 1),
    ("\\boxed{5}", "-5", 0),
    # intervals and sets
    ("\\boxed{(1, 2]}", "(1,2]", 1),
    ("\\boxed{[1,2]}", "(1,2)", 0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1),
    ("\\boxed{2, 1}", "1,2", 1),
    # units, degrees, percent
    ("\\boxed{5\\text{ cm}}", "5", 1),
    ("\\boxed{90^\\circ}", "90", 1),
    ("\\boxed{10\\%}", "10", 1),
    ("\\boxed{\\$72}", "72", 1),
    # text answers
    ("\\boxed{\\text{Paris}}", "Paris", 1),
    ("\\boxed{paris}", "Paris", 1),
    ("\\boxed{Sirap}", "Paris", 0),  # math-verify alone reads both as products of symbols: equal
    ("\\boxed{\\text{yes}}", "no", 0),
    ("\\boxed{\\text{(B)}}", "B", 1),
    ("\\boxed{C}", "B", 0),
    # expressions and equations
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1),
    ("\\boxed{x = 3}", "3", 1),
    ("\\boxed{\\infty}", "\\infty", 1),
    ("\\boxed{-\\infty}", "\\infty", 0),
    # other box spellings and surroundings
    ("\\boxed 5", "5", 1),
    ("\\fbox{6}", "6", 1),
    ("$\\boxed{3}$.", "3", 1),
]


@pytest.mark.quick
@pytest.mark.parametrize("text,answer,verdict", MATH_CASES)
def test_math_reward_table(text, answer, verdict):
    assert S.reward_math(text, answer) == verdict


@pytest.mark.quick
def test_answer_extraction_by_hand():
    assert S.last_boxed("a \\boxed{x^{2}} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert S.last_boxed("\\boxed{3} and \\boxed{4") is None  # the last box is not closed
    assert S.extract_answer("<think>\\boxed{1}</think>Final answer: $-2$.") == "-2"
    assert S.extract_answer("no answer here") is None


@pytest.mark.quick
def test_exact_reward():
    assert S.reward_exact("\\boxed{ B }", "B") == 1
    assert S.reward_exact("Answer: Paris", "Paris") == 1
    assert S.reward_exact("\\boxed{b}", "B") == 0  # case matters
    assert S.reward_exact("\\boxed{1/2}", "0.5") == 0  # no equivalence, only the string
    assert S.reward_exact("B", "B") == 0  # no final answer marked


@pytest.mark.quick
def test_reference_answers_are_normalised():
    assert [S.gold_answer(a) for a in (72, 0.5, 3.0, "  7 ")] == ["72", "0.5", "3", "7"]
    assert S.gold_answer("She sold 48/2 = 24 clips in May.\n#### 72") == "72"  # GSM8K
    assert S.gold_answer("so it is $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"  # MATH's worked solution


# ---------------------------------------------------------------------------------------------- grader
def flaky_reward(text, answer, row=None):
    """A reward function with the failures a real grader can have, for the grading processes to survive."""
    if text == "hang":
        time.sleep(600)
    if text == "raise":
        raise ValueError("bad input")
    if text == "exit":
        os._exit(3)
    return float(text == answer)


def test_a_hanging_or_failing_grader_costs_its_completion_only():
    """A hang, an exception and a dead process each cost their completion only. The grades do not depend on the
    machine's speed: the hang is graded alone under a 1 s limit (it sleeps 600 s: over any limit), the rest under a
    limit of 600 s that none of them comes near."""
    grader = S.Grader(flaky_reward, workers=2, timeout=1.0)
    try:
        assert grader([("hang", "")]) == ([(0.0, "error: grading took over 1 s")], ["grading took over 1 s"])
        grader.timeout = 600.0
        items = [("a", "a"), ("b", "c"), ("raise", ""), ("exit", ""), ("d", "d"), ("e", "e")]
        grades, errors = grader(items)
        assert grades == [(1, None), (0, None), (0, "error: ValueError: bad input"),
                          (0, "error: the grading process died"), (1, None), (1, None)]  # (reward, verdict)
        assert sorted(errors) == ["ValueError: bad input", "the grading process died"]
        assert grader([("f", "f")] * 5) == ([(1.0, None)] * 5, [])  # the killed processes were replaced
    finally:
        grader.close()
    in_process = S.Grader(flaky_reward, workers=0, timeout=1.0)
    assert in_process([("raise", ""), ("a", "a")]) == ([(0.0, "error: ValueError: bad input"), (1.0, None)],
                                                       ["ValueError: bad input"])


def test_math_grading_over_processes_agrees_with_the_table_and_survives_a_real_hang():
    """The table's verdicts from the grading processes, with a limit no case comes near (600 s: on a busy machine a
    case may take more than a second); then a real hang, alone under a 2 s limit, costs its completion only, and the
    replaced process grades on."""
    grader = S.Grader(S.reward_math, workers=2, timeout=600.0)
    hang = ("\\boxed{9^{9^{9^{9}}}}", "1")  # sympy evaluates the tower: without a time limit, it never returns
    try:
        grades, errors = grader([(t, a) for t, a, _ in MATH_CASES])
        assert grades == [(v, None) for _, _, v in MATH_CASES] and errors == []
        grader.timeout = 2.0
        assert grader([hang]) == ([(0, "error: grading took over 2 s")], ["grading took over 2 s"])
        grader.timeout = 600.0
        assert grader([MATH_CASES[0][:2]] * 3) == ([(MATH_CASES[0][2], None)] * 3, [])
    finally:
        grader.close()


# ---------------------------------------------------------------------------------------------- data files
ARITH = [{"problem": f"What is {a} + {b}?", "answer": a + b, "level": a % 3} for a in range(6) for b in range(5)]
CHAT = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Halve {2 * k + 1}."}],
         "solution": f"Half of {2 * k + 1} is $\\boxed{{\\frac{{{2 * k + 1}}}{{2}}}}$."} for k in range(7)]
GSM = [{"question": f"Tom has {k} apples and buys {k}. How many now?", "answer": f"{k}+{k}={2 * k}\n#### {2 * k}"}
       for k in range(4)]


def write_all_formats(records, root):
    """The same records as JSON Lines, a JSON array, datasets' JSON, Parquet and a save_to_disk directory."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(root, exist_ok=True)
    paths = {k: os.path.join(root, n) for k, n in [("jsonl", "d.jsonl"), ("json", "d.json"), ("hf_json", "hf.json"),
                                                    ("parquet", "d.parquet"), ("disk", "disk")]}
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(paths["json"], "w") as f:
        json.dump(records, f, indent=1)
    pq.write_table(pa.Table.from_pylist(records), paths["parquet"])
    ds = datasets.Dataset.from_list(records)
    ds.to_json(paths["hf_json"])  # JSON Lines under a .json name
    datasets.DatasetDict({"train": ds}).save_to_disk(paths["disk"])
    return paths


@pytest.mark.parametrize("records,expected", [
    (ARITH, [(f"What is {a} + {b}?", str(a + b)) for a in range(6) for b in range(5)]),
    (CHAT, [(r["prompt"], f"\\frac{{{2 * k + 1}}}{{2}}") for k, r in enumerate(CHAT)]),
    (GSM, [(r["question"], str(2 * k)) for k, r in enumerate(GSM)]),
])
def test_each_format_loads_the_same_prompts(records, expected, tmp_path):
    cfg = S.Config()
    for kind, path in write_all_formats(records, tmp_path).items():
        assert pairs(S.load_rows(path, cfg)) == expected, kind


@pytest.mark.parametrize("records", [ARITH, GSM], ids=["arith", "gsm8k"])
def test_bom_jsonl_and_csv_load_like_plain_jsonl(records, tmp_path):
    """A JSONL file with a UTF-8 byte-order mark (as spreadsheet tools write) and a CSV file (with and without a
    BOM) load to the same rows as the plain JSONL."""
    import csv
    plain = write_all_formats(records, tmp_path)["jsonl"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + open(plain, "rb").read())
    want = pairs(S.load_rows(plain, S.Config()))
    for name, encoding in (("d.csv", "utf-8"), ("excel.csv", "utf-8-sig")):
        with open(tmp_path / name, "w", encoding=encoding, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
        assert pairs(S.load_rows(str(tmp_path / name), S.Config())) == want, name
    assert pairs(S.load_rows(str(bom), S.Config())) == want and len(want) == len(records)


def test_a_bad_csv_row_is_named_with_its_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('problem,answer\n"What is\n1 + 1?",2\n,3\n')  # a quoted prompt over two lines, then no prompt
    assert S.load_rows(str(path), S.Config(skip_bad_rows=True)) == [
        ("What is\n1 + 1?", "2", {"problem": "What is\n1 + 1?", "answer": "2"}, "math")]
    with pytest.raises(S.ScaleRLError) as e:
        S.load_rows(str(path), S.Config())
    assert "line 4: empty prompt" in str(e.value)


def pairs(items):
    """(prompt, answer) of load_rows' and load_data's (prompt, answer, row, reward) items."""
    return [(p, a) for p, a, *_ in items]


def write_jsonl(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


GOOD = '{"problem": "What is 1 + 1?", "answer": 2}'
BAD_ROWS = [  # (line 2 of the file, what the error says)
    ('{"problem": "  ", "answer": 1}', "empty prompt"),
    ('{"answer": 1}', "no 'problem' field"),
    ('{"problem": "q"}', "no 'answer' field"),
    ('{"problem": "q", "answer": null}', "'answer' is null"),  # (it was reported as no 'answer' field)
    ('{"problem": "q", "answer": [1, 2]}', "'answer' is list, not a string or a number"),
    ('{"problem": "q", "answer": true}', "'answer' is bool"),
    ('{"problem": "q", "answer": NaN}', "empty or non-finite answer 'answer' (nan)"),
    ('{"problem": "q", "answer": ""}', "empty or non-finite answer"),
    ('{"problem": 5, "answer": 1}', "'problem' is int"),
    ('{"problem": [{"role": "user"}], "answer": 1}', "'problem' is list, not a string or a list of {role, content}"),
    ('{"problem": "q", "answer": 1', "invalid JSON"),
    ('[1, 2]', "not an object but list"),
]


@pytest.mark.parametrize("line,message", BAD_ROWS)
def test_each_kind_of_bad_row_is_named_with_its_line(line, message, tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, line, GOOD])
    with pytest.raises(S.ScaleRLError) as e:
        S.load_rows(path, S.Config())
    err = str(e.value)
    assert e.value.status == 2 and path in err and f"line 2: {message}" in err and "--skip-bad-rows" in err
    rows = S.load_rows(path, S.Config(skip_bad_rows=True))
    assert pairs(rows) == [("What is 1 + 1?", "2")] * 2
    assert "skipped 1 of 3 rows (first: line 2" in capsys.readouterr().err


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", None, "no such file"),
    ("d.txt", "problem,answer\nq,1\n", "unsupported format"),
    ("d.parquet", "not parquet", "not a readable Parquet file"),
    ("d.jsonl", b"\xff\xfe\x00", "cannot read"),
    ("d.json", '[{"problem": "q", "answer": 1},', "cannot read (Expecting value: line 1"),
    ("d.jsonl", "", "no usable rows"),
    ("d.jsonl", '{"query": "q", "answer": 1}\n', "no field 'prompt' (looked for prompt, problem, question, "
                                                  "question_content, description, text; found: answer, query); name "
                                                  "the field with --prompt-key"),
    ("d.jsonl", '{"problem": "q", "label": 1}\n', "no field 'answer'"),
    ("d.jsonl", '{"problem": "q", "answer": 1\n{"problem": "r"', "no row has a field; line 1: invalid JSON (Expecting"),
    ("empty_dir", "dir", "cannot load with datasets"),
])
def test_unreadable_data_gives_one_clear_error(name, content, message, tmp_path):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(S.ScaleRLError) as e:
        S.load_rows(str(path), S.Config())
    assert e.value.status == 2 and message in str(e.value)


def test_field_names_can_be_given(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"query": "q1", "label": 7, "answer": "x"}'])
    assert S.load_rows(path, S.Config(prompt_key="query", answer_key="label")) == [
        ("q1", "7", {"query": "q1", "label": 7, "answer": "x"}, "math")]  # the whole row, for the reward


def cli(*args, env=None, timeout=300):
    """Run scalerl.py from the command line."""
    return subprocess.run([sys.executable, os.path.join(HERE, "scalerl.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def broken_model(tmp_path):
    """A model directory that passes the flag check but cannot be loaded: any error of ours must come first."""
    (tmp_path / "broken_model").mkdir()
    (tmp_path / "broken_model" / "config.json").write_text("{}")
    return tmp_path / "broken_model"


def test_bad_data_stops_before_the_model_is_loaded(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"problem": "q"}'])
    r = cli("--model", broken_model(tmp_path), "--data", data, "--out", tmp_path / "run")
    assert r.returncode == 2 and f"{data}: 1 of 2 rows are unusable; line 2: no 'answer' field" in r.stderr
    assert not (tmp_path / "run").exists()


def main_lines(argv, capfd):
    """(exit status, stderr's lines) of scalerl's main(argv), the command line, run in this process."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        S.main([str(a) for a in argv])
    return e.value.code, capfd.readouterr().err.strip().splitlines()


def test_a_model_config_no_class_reads_is_named_whole_in_one_line(tmp_path, capfd):
    """A `{}` config.json: its error whole on one line (it was cut at "from one of: ", the tokenizer's), and the run
    directory made for it is gone."""
    model = broken_model(tmp_path)
    code, lines = main_lines(["--model", model, "--engine", "hf", "--out", tmp_path / "run"], capfd)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"scalerl.py: error: cannot load --model {model} (config.json): ")
    assert "Should have a `model_type` key in its config.json" in lines[0] and not (tmp_path / "run").exists()


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_tokenised(tmp_path, capfd, monkeypatch):
    """A prompt of 100,000 characters for a model of 256 positions is refused by its length in characters (no token
    covers more than 8 of them here), in one line, before the tokenizer sees it: a 50 MB line would take gigabytes."""
    import transformers
    model, seen = S.build_tiny_model(str(tmp_path / "models"), 0, False), []
    call = transformers.PreTrainedTokenizerBase.__call__
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__",
                        lambda self, text, *a, **kw: seen.append(len(text)) or call(self, text, *a, **kw))
    data = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": f"{k} + 1 =", "answer": k + 1}) for k in range(12)]
                       + [json.dumps({"problem": "7" * 100_000, "answer": 7})])
    code, lines = main_lines(["--model", model, "--data", data, "--engine", "hf", "--reward", "exact",
                              "--reward-workers", "0", "--val-size", "4", "--prompts-per-step", "2",
                              "--max-new-tokens", "8", "--out", tmp_path / "run"], capfd)
    assert code == 2 and lines == [f"scalerl.py: error: a prompt of {100_000 + len(S.Config.instruction)} characters "
                                   f"('{'7' * 40}'...) cannot fit the model's context: at most {(256 - 8) * 8} "
                                   "characters can (its positions less --max-new-tokens, times the longest token's "
                                   "characters)"]
    assert all(n < 1000 for n in seen) and not (tmp_path / "run").exists()


def test_hub_name_without_network_is_a_clear_error(tmp_path):
    """Offline (HF_HUB_OFFLINE), a hub dataset that is not in the cache stops the run in one line, before datasets
    is asked (which would retry)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = cli("--model", broken_model(tmp_path), "--data", "no-such-org/no-such-dataset:test", "--out",
            tmp_path / "run", env=env)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"scalerl.py: error: --data no-such-org/no-such-dataset: not in the local cache ({tmp_path / 'hf' / 'hub'}) "
        "and the hub (huggingface.co) cannot be reached: download it where there is a network, or give a local path")


# ---------------------------------------------------------------------------------------------- splits
def data_cfg(path, **kw):
    return S.Config(**{"data": path, "model": "unused", "prompts_per_step": 4, **kw})


def test_validation_split_is_seeded_disjoint_and_never_trained_on(tmp_path):
    rows = [json.dumps({"problem": f"p{k % 25}", "answer": k % 25}) for k in range(50)]  # each prompt twice
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, val = S.load_data(data_cfg(path, val_size=10))
    assert len(val) == 10 and not {p for p, *_ in train} & {p for p, *_ in val}
    assert {p for p, *_ in train} | {p for p, *_ in val} == {f"p{k}" for k in range(25)}
    assert len(train) == 50 - 2 * len({p for p, *_ in val})  # the other copy of a held-out prompt goes too
    assert S.load_data(data_cfg(path, val_size=10)) == (train, val)  # same seed, same split
    assert S.load_data(data_cfg(path, val_size=10, seed=1))[1] != val
    assert len(S.load_data(data_cfg(path, val_size=10, train_size=5))[0]) == 5


def test_training_rows_dropped_as_copies_of_held_out_prompts_are_said(tmp_path):
    """--val-data equal to --data leaves no training prompt: the refusal says the rows went as copies of held-out
    prompts (it said '0 training prompts left' alone)."""
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": f"q{i}", "answer": i}) for i in range(20)])
    with pytest.raises(S.ScaleRLError, match=r"exceeds the 0 training prompts left in .* \(20 rows dropped as copies "
                                             r"of held-out prompts\)"):
        S.load_data(S.Config(model="m", data=path, val_data=path, prompts_per_step=4))


def test_val_data_file_is_held_out(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": f"p{k}", "answer": k}) for k in range(20)])
    val_path = write_jsonl(tmp_path / "v.jsonl", [json.dumps({"problem": f"p{k}", "answer": k}) for k in (3, 30)])
    train, val = S.load_data(data_cfg(path, val_data=val_path))
    assert pairs(val) == [("p3", "3"), ("p30", "30")] and len(train) == 19 and ("p3", "3") not in pairs(train)


def test_too_little_data_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": f"p{k}", "answer": k}) for k in range(8)])
    for kw, message in [({"val_size": 8}, "--val-size 8: "), ({"val_size": 5}, "--prompts-per-step 4 exceeds the 3")]:
        with pytest.raises(S.ScaleRLError) as e:
            S.load_data(data_cfg(path, **kw))
        assert message in str(e.value)


# ---------------------------------------------------------------------------------------------- prompting
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def chat_tokenizer():
    """One token per printable character, the template's role markers as special tokens, and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(CHAT_SPECIALS + [chr(c) for c in range(32, 127)] + ["\n"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(CHAT_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.quick
def test_prompts_are_formatted_by_hand():
    tok = chat_tokenizer()
    cfg = S.Config(data="x", system_prompt="Be exact.", instruction=" Box it.")
    text = lambda prompt, cfg: tok.decode(S.encode_prompt(tok, prompt, cfg))  # noqa: E731
    assert text("What is 2 + 2?", cfg) == "<|system|>Be exact.\n<|user|>What is 2 + 2? Box it.\n<|assistant|>"
    msgs = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi?"}]
    assert text(msgs, cfg) == "<|system|>Own.\n<|user|>Hi? Box it.\n<|assistant|>"  # its own system message stays
    assert msgs[1]["content"] == "Hi?"  # the row itself is not changed
    plain = S.Config(data="x", system_prompt="Be exact.", instruction=" Box it.", chat_template=False)
    assert text("What is 2 + 2?", plain) == "Be exact.\n\nWhat is 2 + 2? Box it."
    assert text("What is 2 + 2?", S.Config(data="x", instruction="")) == "<|user|>What is 2 + 2?\n<|assistant|>"
    assert S.encode_prompt(tok, "3941:", S.Config()) == tok("3941:").input_ids  # the built-in task: as it is


# ---------------------------------------------------------------------------------------------- end to end
def sft_arithmetic_model(path, steps=400):
    """A tiny Llama (one layer, width 64) with the chat tokenizer, taught by a few supervised steps to answer
    "\\boxed{N}": it then gets some sums right and some wrong, so --reward math has something to grade and RL
    something to train. The prompts have no instruction (--instruction ''): a third of the tokens, a third of the
    time. (400 steps: 72% of sampled answers right on 100 sums, 4 samples each, 5 s on 2 cores; after 250 steps 55%.
    Two layers of width 128 took three times as long for 52%, and with the default instruction got 16% right: a
    machine whose float sums differ could then score 0 of 32 samples.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0))
    cfg = S.Config(data="x", instruction="")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = []
        for a, b in torch.randint(0, 10, (32, 2), generator=gen).tolist():
            prompt = S.encode_prompt(tok, f"What is {a} + {b}?", cfg)
            batch.append((prompt, tok(f"\\boxed{{{a + b}}}", add_special_tokens=False).input_ids + [2]))
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in batch])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in batch])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.mark.heavy
def test_math_reward_end_to_end_on_generated_arithmetic(tmp_path):
    """The command line's entry point (main), in this process: --data, --reward math over the grading processes."""
    warm_vllm_model_info()  # (the default engine, auto, is vLLM where it is installed)
    model = str(tmp_path / "model")
    sft_arithmetic_model(model)
    rows = [json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}) for a in range(10) for b in range(10)]
    data = write_jsonl(tmp_path / "arith.jsonl", rows)
    out = tmp_path / "run"
    S.main([str(a) for a in ("--model", model, "--data", data, "--reward", "math", "--instruction", "", "--steps", 2,
                             "--prompts-per-step", 8, "--generations-per-prompt", 8, "--max-new-tokens", 16,
                             "--val-size", 16, "--eval-samples", 2, "--eval-every", 1, "--out", out)])
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["reward_errors"] == 0 for m in metrics)
    assert all(0 < m["val_pass_rate"] < 1 for m in metrics)  # the verifier accepts the model's right sums only
    assert all(0 < m["reward_mean"] < 1 and m["grad_norm"] > 0 for m in metrics[1:]) and metrics[2]["train_tokens"] > 0
    config = json.load(open(out / "config.json"))
    assert config["reward"] == "math" and config["val_size"] == 16 and config["train_size"] == 0
