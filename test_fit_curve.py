"""Tests for fit_curve.py on synthetic runs drawn from known parameters (the paper's Table 1).

Every expected value is computed here from the generating parameters, never taken from the code.
Run: python -m pytest -q test_fit_curve.py
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fit_curve

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fit_curve.py")
SCALERL_8B = dict(A=0.610, B=1.92, C_mid=2542.0)   # paper Table 1: ScaleRL 8B (C_mid in GPU-hours)
R0 = 0.30
NOISE = 0.005        # sampling noise of a mean@16 pass rate on 1,000 prompts is about 0.004
X_MAX = 100_000.0    # the paper's 100k GPU-hour run
N_POINTS = 200


def true_curve(c, A, B, C_mid, r0=R0):
    """The sigmoid written out directly (independently of fit_curve.curve); R(0) = R0."""
    c = np.asarray(c, dtype=float)
    out = np.full(c.shape, r0)
    pos = c > 0
    out[pos] = r0 + (A - r0) / (1.0 + (C_mid / c[pos]) ** B)
    return out


def synthetic(seed, params=SCALERL_8B, n=N_POINTS, x_max=X_MAX):
    """Evaluation points every x_max / (n - 1) compute units, the first at 0, with Gaussian noise."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0.0, x_max, n)
    return x, true_curve(x, **params) + rng.normal(0.0, NOISE, n)


def write_jsonl(path, x, y):
    """A metrics.jsonl as scalerl.py writes it: training rows, and evaluation rows with val_pass_rate."""
    with open(path, "w") as f:
        for i, (c, r) in enumerate(zip(x, y)):
            step = 10 * i
            for k in range(1, 3):   # training rows: no val_pass_rate (or null); misleading other values
                f.write(json.dumps({"step": step + k, "device_hours": c + k, "flops": 1e15 * (c + k),
                                    "gen_tokens": 1000 * step, "train_tokens": 900 * step, "reward_mean": 0.99,
                                    **({"val_pass_rate": None} if k == 2 else {})}) + "\n")
            f.write(json.dumps({"step": step, "device_hours": c, "flops": 1e15 * c, "gen_tokens": 1000 * step,
                                "train_tokens": 900 * step, "reward_mean": 0.5, "val_pass_rate": r}) + "\n")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def fit_json(*args):
    proc = run_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    x, y = synthetic(seed=1)
    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    write_jsonl(path, x, y)
    return path, x, y


def test_recovers_table1_parameters_with_covering_intervals(run_file):
    path, x, y = run_file
    (r,) = fit_json(path, "--bootstrap", 400, "--seed", 3)
    truth = SCALERL_8B
    assert abs(r["A"] - truth["A"]) < 0.01
    assert abs(r["B"] / truth["B"] - 1) < 0.15
    assert abs(r["C_mid"] / truth["C_mid"] - 1) < 0.15
    for name in ("A", "B", "C_mid"):
        lo, hi = r[name + "_ci"]
        assert lo <= truth[name] <= hi, (name, lo, hi)
    assert r["R0"] == pytest.approx(y[0])                      # default R0: the step-0 evaluation
    assert r["n_points"] == np.count_nonzero(x >= 0.015 * X_MAX)  # default: drop the first 1.5% of x
    assert r["at_grid_edge"] == []


def test_first_half_predicts_second_half(run_file):
    path, x, y = run_file
    half = X_MAX / 2
    (r,) = fit_json(path, "--fit-until", half, "--bootstrap", 0)
    later = x > half
    assert r["n_extrapolated"] == np.count_nonzero(later)
    assert r["n_points"] == np.count_nonzero((x <= half) & (x >= 0.015 * half))
    assert r["extrapolation_max_abs_error"] < 0.02
    predicted = true_curve(x[later], r["A"], r["B"], r["C_mid"], r0=r["R0"])
    assert np.max(np.abs(predicted - true_curve(x[later], **SCALERL_8B))) < 0.01
    assert r["extrapolation_max_abs_error"] == pytest.approx(np.max(np.abs(predicted - y[later])), abs=1e-9)


def test_one_fit_is_fast(run_file):
    path = str(run_file[0])
    args = fit_curve.parse_args([path, "--bootstrap", "0"])
    fit_curve.analyse_run(path, args)   # warm-up
    start = time.perf_counter()
    fit_curve.analyse_run(path, args)
    assert time.perf_counter() - start < 1.0


def test_shared_a_ranks_recipes_by_b(tmp_path):
    # Table 1: batch 2048 (C_mid 10909, B 1.70) and 32k generation length (11272, 1.89) share A = 0.645.
    recipes = {"batch2048": dict(A=0.645, B=1.70, C_mid=10909.0), "gen32k": dict(A=0.645, B=1.89, C_mid=11272.0)}
    paths = []
    for seed, (name, params) in enumerate(recipes.items()):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "metrics.jsonl", *synthetic(seed=10 + seed, params=params))
        paths.append(tmp_path / name)
    results = fit_json(*paths, "--shared-a", "--bootstrap", 100)
    assert [r["run"] for r in results] == list(recipes)
    assert all(r["shared_a"] and r["A_ci"] is None for r in results)
    assert results[0]["A"] == results[1]["A"] and abs(results[0]["A"] - 0.645) < 0.01
    fitted_order = sorted(recipes, key=lambda name: -next(r["B"] for r in results if r["run"] == name))
    assert fitted_order == sorted(recipes, key=lambda name: -recipes[name]["B"])
    for r in results:
        assert abs(r["B"] / recipes[r["run"]]["B"] - 1) < 0.15
    table = run_cli(*paths, "--shared-a", "--bootstrap", 0).stdout
    assert "gen32k (" in table and table.index("gen32k (") < table.index("batch2048 (")


def test_jsonl_parsing_ignores_rows_without_val_pass_rate(run_file):
    path, x, y = run_file
    label, xs, ys = fit_curve.load_points(str(path), "device_hours", "val_pass_rate")
    assert label == path.parent.name
    np.testing.assert_allclose(xs, x)
    np.testing.assert_allclose(ys, y)
    _, flops, _ = fit_curve.load_points(str(path), "flops", "val_pass_rate")
    np.testing.assert_allclose(flops, 1e15 * x)


def test_directory_and_csv_give_the_same_fit(run_file, tmp_path):
    path, x, y = run_file
    csv_path = tmp_path / "run.csv"
    order = np.random.default_rng(0).permutation(len(x))   # row order must not matter
    csv_path.write_text("step,device_hours,val_pass_rate\n"
                        + "".join(f"{10 * i},{float(x[i])!r},{float(y[i])!r}\n" for i in order))
    fits = [fit_json(p, "--bootstrap", 0)[0] for p in (path, path.parent, csv_path)]
    for other in fits[1:]:
        assert other["n_points"] == fits[0]["n_points"]
        for key in ("A", "B", "C_mid", "R0", "sse"):
            assert other[key] == pytest.approx(fits[0][key], rel=1e-9)


def test_exclude_below_and_r0_flags(run_file):
    path, x, _ = run_file
    (r,) = fit_json(path, "--exclude-below", 5000, "--r0", 0.3, "--bootstrap", 0)
    assert r["n_points"] == np.count_nonzero(x >= 5000)
    assert r["R0"] == 0.3
    assert abs(r["A"] - SCALERL_8B["A"]) < 0.01


def test_grid_edge_is_reported(tmp_path):
    # A straight line never bends towards an asymptote: A is not pinned down.
    csv_path = tmp_path / "line.csv"
    csv_path.write_text("x,y\n" + "".join(f"{c},{0.3 + 0.002 * c}\n" for c in range(0, 100, 2)))
    proc = run_cli(csv_path, "--x", "x", "--y", "y", "--bootstrap", 0, "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["at_grid_edge"]
    assert "edge of the search grid" in proc.stderr


def test_plot_is_a_png(run_file, tmp_path):
    path = run_file[0]
    png = tmp_path / "curves.png"
    proc = run_cli(path, path, "--fit-until", X_MAX / 2, "--bootstrap", 0, "--plot", png, "--log-x")
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert len(data) > 0 and data[:8] == b"\x89PNG\r\n\x1a\n"


def _bad_inputs(tmp_path, good_run):
    few = tmp_path / "few.csv"
    few.write_text("x,y\n0,0.3\n10,0.4\n20,0.45\n30,0.5\n")      # 3 points after the step-0 point
    high = tmp_path / "high.csv"
    high.write_text("x,y\n0,0.3\n1,0.4\n2,1.5\n3,0.5\n4,0.55\n5,0.6\n")
    text = tmp_path / "text.csv"
    text.write_text("x,y\n0,0.3\n1,0.4\n2,abc\n3,0.5\n4,0.55\n5,0.6\n")
    text_json = tmp_path / "text.jsonl"
    text_json.write_text('{"device_hours": 0, "val_pass_rate": 0.3}\n{"device_hours": "soon", "val_pass_rate": 0.4}\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"device_hours": 0, "val_pass_rate": 0.3}\n{"device_hours": 1,\n')
    (tmp_path / "empty_dir").mkdir()
    xy = ["--x", "x", "--y", "y"]
    return {
        "missing file": [tmp_path / "nope.jsonl"],
        "directory without metrics.jsonl": [tmp_path / "empty_dir"],
        "missing x column": [good_run, "--x", "wall_clock"],
        "missing y column": [good_run, "--y", "val_accuracy"],
        "fewer than 4 points": [few, *xy],
        "y outside [0, 1]": [high, *xy],
        "non-numeric csv value": [text, *xy],
        "non-numeric json value": [text_json],
        "invalid json": [broken],
    }


@pytest.mark.parametrize("case", ["missing file", "directory without metrics.jsonl", "missing x column",
                                  "missing y column", "fewer than 4 points", "y outside [0, 1]",
                                  "non-numeric csv value", "non-numeric json value", "invalid json"])
def test_bad_input_is_one_line_error_with_status_2(case, tmp_path, run_file):
    proc = run_cli(*_bad_inputs(tmp_path, run_file[0])[case], "--bootstrap", 0)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fit_curve.py: error: "), proc.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery differs on Windows")
def test_ctrl_c_exits_without_traceback(run_file):
    proc = subprocess.Popen([sys.executable, SCRIPT, str(run_file[0]), "--bootstrap", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted" in err
