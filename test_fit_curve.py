"""Tests for fit_curve.py on synthetic runs drawn from known parameters (the paper's Table 1).

Every expected value is computed here from the generating parameters, never taken from the code.
Run: python -m pytest -q test_fit_curve.py
"""
import json
import os
import signal
import subprocess
import sys

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


def metrics_rows(x, y, epochs=None):
    """The rows of a metrics.jsonl as scalerl.py writes it: training rows, and evaluation rows with
    val_pass_rate. With epochs (one per point), every row after step 0 carries `epoch`, as scalerl.py's do;
    the training rows carry misleading values (epoch + 1), which must not matter."""
    rows = []
    for i, (c, r) in enumerate(zip(x, y)):
        step = 10 * i
        for k in range(1, 3):   # training rows: no val_pass_rate (or null); misleading other values
            rows.append({"step": step + k, "device_hours": c + k, "flops": 1e15 * (c + k),
                         "gen_tokens": 1000 * step, "train_tokens": 900 * step, "reward_mean": 0.99,
                         **({"val_pass_rate": None} if k == 2 else {}),
                         **({"epoch": int(epochs[i]) + 1} if epochs is not None else {})})
        rows.append({"step": step, "device_hours": c, "flops": 1e15 * c, "gen_tokens": 1000 * step,
                     "train_tokens": 900 * step, "reward_mean": 0.5, "val_pass_rate": r,
                     **({"epoch": int(epochs[i])} if epochs is not None and step > 0 else {})})
    return rows


def write_jsonl(path, x, y, epochs=None):
    """metrics_rows written to path, one JSON object per line."""
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in metrics_rows(x, y, epochs))


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



@pytest.mark.quick
def test_the_prediction_interval_is_the_samples_curves_at_the_point(monkeypatch):
    """fit_rows(predict_at=X): the curve of the fit at X, and its bootstrap interval: the percentiles of each resample's
    own curve at X, not the curve at the parameters' bounds. The resamples' fits are set here (fit_once replaced),
    with A and C_mid rising together, so that the predictions at X are not in the order of either parameter."""
    x, y = synthetic(0)
    fits = iter([(0.6, 2.0, 2500.0)] + [(0.5 + 0.01 * k, 1.5, 1000.0 * (1 + k % 7)) for k in range(10_000)])
    monkeypatch.setattr(fit_curve, "fit_once", lambda *a: next(fits))
    rows = [{"c": float(c), "v": float(v)} for c, v in zip(x, y)]
    r = fit_curve.fit_rows(rows, x="c", y="v", r0=R0, bootstrap=50, predict_at=30_000.0)
    assert r["predicted"] == pytest.approx(float(true_curve([30_000.0], 0.6, 2.0, 2500.0)[0]), abs=1e-12)
    draws = [true_curve([30_000.0], 0.5 + 0.01 * k, 1.5, 1000.0 * (1 + k % 7))[0] for k in range(50)]
    assert r["predicted_ci"] == pytest.approx(list(np.percentile(draws, [2.5, 97.5])), abs=1e-12)
    assert fit_curve.fit_rows(rows, x="c", y="v", r0=R0, bootstrap=0, predict_at=30_000.0)["predicted_ci"] is None

def two_recipes_sharing_a(tmp_path):
    """Table 1: batch 2048 (C_mid 10909, B 1.70) and 32k generation length (11272, 1.89) share A = 0.645."""
    recipes = {"batch2048": dict(A=0.645, B=1.70, C_mid=10909.0), "gen32k": dict(A=0.645, B=1.89, C_mid=11272.0)}
    for seed, (name, params) in enumerate(recipes.items()):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "metrics.jsonl", *synthetic(seed=10 + seed, params=params))
    return recipes, [tmp_path / name for name in recipes]


def test_shared_a_ranks_recipes_by_b(tmp_path):
    recipes, paths = two_recipes_sharing_a(tmp_path)
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


def _epochs(n=N_POINTS, first=10, per_epoch=40):
    """Epoch of each evaluation: none (0) at step 0, 1 for the next `first`, then per_epoch per epoch."""
    i = np.arange(n)
    return np.where(i == 0, 0, np.where(i <= first, 1, 2 + (i - first - 1) // per_epoch))


def test_exclude_first_epoch_drops_exactly_the_first_epoch(tmp_path):
    x, y = synthetic(seed=4)
    epochs = _epochs()                               # evaluations 1-10 in the first epoch, 11 on in later ones
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, x, y, epochs)
    later = epochs >= 2
    first_kept = int(np.argmax(later))
    assert first_kept == 11 and x[first_kept] > 0.015 * X_MAX   # the epoch rule differs from the default
    (r,) = fit_json(path, "--exclude-first-epoch", "--bootstrap", 0)
    assert r["n_points"] == np.count_nonzero(later) == N_POINTS - 11
    assert r["fit_range"] == [pytest.approx(x[first_kept]), pytest.approx(X_MAX)]
    assert r["exclude_first_epoch"] and r["exclude_below"] is None
    assert r["R0"] == pytest.approx(y[0])            # R0 still comes from the step-0 point
    # the same points chosen by x give the same fit: exactly the first-epoch points were dropped
    (by_x,) = fit_json(path, "--exclude-below", x[first_kept], "--bootstrap", 0)
    assert by_x["n_points"] == r["n_points"]
    for key in ("A", "B", "C_mid", "sse"):
        assert by_x[key] == pytest.approx(r[key], rel=1e-9)
    # with --exclude-below too, a point goes if either rule drops it
    for cut in (0.5 * x[first_kept], 20_000.0):
        (both,) = fit_json(path, "--exclude-first-epoch", "--exclude-below", cut, "--bootstrap", 0)
        assert both["n_points"] == np.count_nonzero(later & (x >= cut))
        assert both["exclude_below"] == cut


def test_fit_rows_equals_the_cli(tmp_path):
    x, y = synthetic(seed=5)
    rows = metrics_rows(x, y, _epochs())
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = dict(exclude_first_epoch=True, fit_until=60_000.0, bootstrap=50, seed=7)
    (cli,) = fit_json(path, "--exclude-first-epoch", "--fit-until", 60_000, "--bootstrap", 50, "--seed", 7)
    api = fit_curve.fit_rows(rows, **options)
    assert cli.pop("run") == tmp_path.name and cli.pop("path") == str(path)
    assert set(api) - {"observed"} == set(cli)
    assert api["method"] == cli["method"] == "grid+refine"
    assert api["n_points"] == cli["n_points"] == np.count_nonzero((_epochs() >= 2) & (x <= 60_000))
    for key, value in cli.items():
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            assert api[key] == pytest.approx(value, rel=1e-6), key   # BLAS threads may differ by an ulp
        else:
            assert api[key] == value, key
    lo, hi = api["A_ci"]
    assert lo <= SCALERL_8B["A"] <= hi
    np.testing.assert_allclose(api["observed"], [x, y])
    with pytest.raises(fit_curve.NotEnoughPoints, match="at least 4 are needed"):   # early in a run: no fit yet
        fit_curve.fit_rows(rows[:3 * 12], exclude_first_epoch=True, bootstrap=0)


def _on_c_mid_grid(r):
    """C_mid is one of the 100 log-spaced grid values from x_min / 10 to x_max * 100 of the fitted points."""
    lo, hi = r["fit_range"][0] / 10, r["fit_range"][1] * 100
    k = np.log(r["C_mid"] / lo) / np.log(hi / lo) * 99
    return abs(k - round(k)) < 1e-6 and 0 <= round(k) <= 99


def _on_a_grid(a):
    """The A grid starts at a multiple of 0.005 (the lowest fitted y rounded down) in steps of 0.005."""
    return abs(a / 0.005 - round(a / 0.005)) < 1e-6


def test_paper_grid_recovers_table1_parameters_on_its_grids(run_file):
    path, x, y = run_file
    (r,) = fit_json(path, "--paper-grid")
    (refined,) = fit_json(path, "--bootstrap", 0)
    assert r["method"] == "paper-grid" and refined["method"] == "grid+refine"
    assert r["bootstrap"] == 0 and r["A_ci"] is None          # --paper-grid: no bootstrap unless asked
    assert _on_a_grid(r["A"]) and _on_c_mid_grid(r)            # no refinement after the grid search
    assert not _on_a_grid(refined["A"]) and not _on_c_mid_grid(refined)
    # A: half a grid step (0.0025) for snapping to the grid, plus 0.0025 for noise (the refined fit's 95%
    # bootstrap interval of A on this run is about +-0.0008, see the first test)
    assert abs(r["A"] - SCALERL_8B["A"]) <= 0.005
    # C_mid: the grid's steps are 12% apart (up to 6% for snapping), plus ~5% noise (bootstrap interval)
    assert abs(r["C_mid"] / SCALERL_8B["C_mid"] - 1) < 0.15
    assert abs(r["B"] / SCALERL_8B["B"] - 1) < 0.15
    # B is the least-squares B for the chosen (A, C_mid): no B on a fine scan does better
    xf, yf = x[x >= 0.015 * X_MAX], y[x >= 0.015 * X_MAX]     # all > 0
    assert r["sse"] == pytest.approx(np.sum((true_curve(xf, r["A"], r["B"], r["C_mid"], r0=r["R0"]) - yf) ** 2))
    scan = np.geomspace(0.05, 20, 20001)[:, None]              # B within curve_fit's bounds
    scan_sse = np.sum((r["R0"] + (r["A"] - r["R0"]) / (1 + (r["C_mid"] / xf) ** scan) - yf) ** 2, axis=1)
    assert r["sse"] <= scan_sse.min() * (1 + 1e-9)
    assert r["sse"] >= refined["sse"]                          # the grid cannot beat the refined optimum


@pytest.mark.quick
def test_paper_grid_fits_b_as_curve_fit_does_pair_by_pair():
    # --paper-grid's fits of B, made for all (A, C_mid) pairs at once, against scipy's curve_fit (the paper's tool)
    # for 200 pairs of the grids, with bootstrap-like integer weights (sigma = 1 / sqrt(w)), each from the pair's
    # best B on the dense B grid (as paper_grid_fit starts them): never a larger error, and the same B to curve_fit's
    # own tolerance (ftol 1e-8 on the error), or, where the error hardly depends on B, the same error to 1e-6.
    import warnings
    from scipy.optimize import OptimizeWarning, curve_fit
    x, y = synthetic(seed=3)
    x, y = x[x >= 0.015 * X_MAX], y[x >= 0.015 * X_MAX]
    w = np.random.default_rng(1).integers(0, 3, len(x)).astype(float)
    lx, yk, wk = np.log(x[w > 0]), y[w > 0], w[w > 0]
    a_grid, c_grid, b_grid = fit_curve.make_grids(x, y)
    rng = np.random.default_rng(2)
    a, c = rng.choice(a_grid, 200) - R0, rng.choice(c_grid, 200)
    curve = lambda k, b: R0 + a[k] / (1 + np.exp(np.multiply.outer(b, np.log(c[k]) - lx)))  # noqa: E731
    with np.errstate(over="ignore"):
        start = np.array([b_grid[np.argmin(np.sum(wk * (curve(k, b_grid) - yk) ** 2, axis=1))] for k in range(200)])
        b, sse = fit_curve.fit_b(lx, yk, wk, R0, a, np.log(c), start.copy())
        for k in range(200):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OptimizeWarning)
                (ref,), _ = curve_fit(lambda lx_, bb: curve(k, bb), lx, yk, p0=[start[k]], sigma=1 / np.sqrt(wk),
                                      bounds=fit_curve.B_RANGE)
            ref_sse = np.sum(wk * (curve(k, ref) - yk) ** 2)
            assert sse[k] == pytest.approx(np.sum(wk * (curve(k, b[k]) - yk) ** 2), rel=1e-12)
            assert sse[k] <= ref_sse * (1 + 1e-12), k
            assert b[k] == pytest.approx(ref, rel=1e-4) or sse[k] == pytest.approx(ref_sse, rel=1e-6), k


def test_paper_grid_weights_are_repeated_points():
    # A bootstrap resample gives each point an integer weight: the fit must equal a fit of the points
    # repeated that many times (fixed A, so that only the 100 C_mid values are searched: fast).
    x, y = synthetic(seed=6, n=60)
    x, y = x[1:], y[1:]
    w = np.random.default_rng(0).integers(0, 4, len(x)).astype(float)
    grids = fit_curve.make_grids(x, y)
    weighted = fit_curve.paper_grid_fit(x, y, w, R0, grids, fit_curve.curve_table(x, *grids[1:]), fixed_a=0.61)
    xr, yr = np.repeat(x, w.astype(int)), np.repeat(y, w.astype(int))
    repeated = fit_curve.paper_grid_fit(xr, yr, np.ones(len(xr)), R0, grids, fit_curve.curve_table(xr, *grids[1:]),
                                        fixed_a=0.61)
    assert weighted[0] == repeated[0] == 0.61 and weighted[2] == repeated[2]
    assert weighted[1] == pytest.approx(repeated[1], rel=1e-5)


def test_paper_grid_with_shared_a_bootstrap_and_fit_until(tmp_path):
    recipes, paths = two_recipes_sharing_a(tmp_path)
    until = 50_000
    results = fit_json(*paths, "--paper-grid", "--shared-a", "--bootstrap", 4, "--fit-until", until)
    shared = results[0]["A"]
    assert _on_a_grid(2 * shared)                  # the mean of the two runs' paper-grid A, each on the grid
    x = synthetic(seed=10)[0]
    for r in results:
        assert r["method"] == "paper-grid" and r["shared_a"] and r["A"] == shared
        assert r["A_ci"] is None and r["bootstrap"] == 4
        assert r["B_ci"][0] <= r["B"] <= r["B_ci"][1] and _on_c_mid_grid(r)
        assert r["n_extrapolated"] == np.count_nonzero(x > until) and r["extrapolation_max_abs_error"] < 0.03
        assert abs(r["B"] / recipes[r["run"]]["B"] - 1) < 0.15
    assert abs(shared - 0.645) <= 0.01
    assert [r["run"] for r in sorted(results, key=lambda r: -r["B"])] == ["gen32k", "batch2048"]


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
    """case -> (command-line arguments, the message expected after 'fit_curve.py: error: ')."""
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
    good_csv = tmp_path / "good.csv"   # a valid run, but no epoch column
    good_csv.write_text("x,y\n" + "".join(f"{c},{0.3 + 0.03 * c}\n" for c in range(10)))
    # 8 evaluations after step 0, the first 6 in the first epoch: 2 are left with --exclude-first-epoch
    short_epoch = tmp_path / "short_epoch.jsonl"
    write_jsonl(short_epoch, np.arange(9.0), 0.3 + 0.03 * np.arange(9.0), epochs=[0, 1, 1, 1, 1, 1, 1, 2, 2])
    # an evaluation after step 0 without `epoch` (line 6: rows 1-3 are step 0, 4-6 the first evaluation)
    no_epoch_row = tmp_path / "no_epoch_row.jsonl"
    rows = metrics_rows(np.arange(9.0), 0.3 + 0.03 * np.arange(9.0), epochs=[0, 1, 1, 2, 2, 2, 3, 3, 3])
    del rows[5]["epoch"]
    no_epoch_row.write_text("".join(json.dumps(r) + "\n" for r in rows))
    xy = ["--x", "x", "--y", "y"]
    return {
        "missing file": ([tmp_path / "nope.jsonl"], f"no such file: {tmp_path / 'nope.jsonl'}"),
        "directory without metrics.jsonl": ([tmp_path / "empty_dir"],
                                            f"no such file: {tmp_path / 'empty_dir' / 'metrics.jsonl'}"),
        # the first evaluation row is line 3 (two training rows precede it)
        "missing x column": ([good_run, "--x", "wall_clock"], f"{good_run} line 3: no column 'wall_clock'"),
        "missing y column": ([good_run, "--y", "val_accuracy"], f"{good_run}: no rows with 'val_accuracy'"),
        # default exclusion: x < 0.015 * 30 = 0.45, so x = 0 goes and 10, 20, 30 stay
        "fewer than 4 points": ([few, *xy], f"{few}: 3 usable points with 0.45 <= x <= 30; at least 4 are needed"),
        "y outside [0, 1]": ([high, *xy], f"{high} line 4: y = 1.5 is outside [0, 1]"),
        "non-numeric csv value": ([text, *xy], f"{text} line 4, y: 'abc' is not a number"),
        "non-numeric json value": ([text_json], f"{text_json} line 2, device_hours: 'soon' is not a number"),
        "invalid json": ([broken], f"{broken} line 2: not valid JSON"),
        "no epoch column": ([good_csv, *xy, "--exclude-first-epoch"],
                            f"{good_csv}: no 'epoch' column, which --exclude-first-epoch needs"),
        "evaluation without epoch": ([no_epoch_row, "--exclude-first-epoch"],
                                     f"{no_epoch_row} line 6: no 'epoch' value"),
        "first epoch leaves too few points": ([short_epoch, "--exclude-first-epoch"],
                                              f"{short_epoch}: 2 usable points with 0 < device_hours <= 8 and "
                                              "epoch >= 2 (--exclude-first-epoch: 7 of the 9 points were logged "
                                              "before the first epoch ended); at least 4 are needed"),
    }


BAD_INPUT_CASES = ["missing file", "directory without metrics.jsonl", "missing x column", "missing y column",
                   "fewer than 4 points", "y outside [0, 1]", "non-numeric csv value", "non-numeric json value",
                   "invalid json", "no epoch column", "evaluation without epoch", "first epoch leaves too few points"]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_is_one_line_error_with_status_2(case, tmp_path, run_file):
    args, message = _bad_inputs(tmp_path, run_file[0])[case]
    proc = run_cli(*args, "--bootstrap", 0)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fit_curve.py: error: "), proc.stderr
    assert message in lines[0], (message, lines[0])


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery differs on Windows")
def test_ctrl_c_exits_without_traceback(run_file):
    def as_from_a_shell():  # SIGINT neither blocked nor ignored in the child, whatever this process inherited or
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # was left with by libraries that earlier tests loaded
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # (in the full suite, the child once never saw the signal)
    proc = subprocess.Popen([sys.executable, SCRIPT, str(run_file[0]), "--bootstrap", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_shell)
    assert "bootstrap" in proc.stderr.readline()  # its first progress line: the bootstrap is under way (no timing)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"no exit 60 s after SIGINT (this process: SIGINT handler {signal.getsignal(signal.SIGINT)}, "
                    f"blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])})")
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted" in err


@pytest.mark.quick
def test_each_task_column_gets_a_curve_of_its_own(tmp_path, capsys):
    """A run of math and code rows logs val_pass_rate_math and val_pass_rate_code beside val_pass_rate (equal
    numbers of held-out prompts: the overall rate is their mean). Each task's column is fitted, after the run's own,
    and its A is the one that generated it; --shared-a fits the overall curves only."""
    tasks = {"code": dict(A=0.45, B=1.5, C_mid=8000.0, r0=0.10), "math": dict(A=0.61, B=1.92, C_mid=2542.0, r0=0.30)}
    rng, x = np.random.default_rng(5), np.linspace(0.0, X_MAX, N_POINTS)
    per = {t: true_curve(x, **p) + rng.normal(0.0, NOISE, N_POINTS) for t, p in tasks.items()}
    overall = (per["code"] + per["math"]) / 2
    rows = [{**row, **({f"val_pass_rate_{t}": float(per[t][i // 3]) for t in tasks} if "val_pass_rate" in row and
                       row["val_pass_rate"] is not None else {})} for i, row in enumerate(metrics_rows(x, overall))]
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fit_curve.main([str(tmp_path / "mixed"), "--json", "--bootstrap", "0"]) == 0
    fits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(f["run"], f["y"]) for f in fits] == [("mixed", "val_pass_rate"), ("mixed [code]", "val_pass_rate_code"),
                                                  ("mixed [math]", "val_pass_rate_math")]
    for f, t in zip(fits[1:], ["code", "math"]):
        assert abs(f["A"] - tasks[t]["A"]) < 0.01 and f["R0"] == pytest.approx(per[t][0])
    assert abs(fits[0]["A"] - (0.45 + 0.61) / 2) < 0.03  # (the mean of two sigmoids is not one: roughly their mean A)
    assert fit_curve.main([str(tmp_path / "mixed"), "--json", "--shared-a", "--bootstrap", "0"]) == 0
    assert [json.loads(line)["run"] for line in capsys.readouterr().out.splitlines()] == ["mixed"]
