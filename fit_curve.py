"""Fit, compare and extrapolate sigmoidal compute-performance curves (Khatri et al. 2025, arXiv 2510.13786).

The ScaleRL paper (Khatri et al. 2025) summarises an RL run by fitting

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

to the validation pass rate R against training compute C. A is the asymptote (how high the recipe
can go), B the scaling exponent and C_mid the compute at which half of the gain A - R0 is reached
(together: how efficiently it gets there). R0, the pass rate before training, is fixed, not fitted.

Fitting procedure. Fitting A, B and C_mid at once is ill-conditioned, so the paper searches A on a
grid (step 0.005) and C_mid on a grid (100 values), fits B by least squares (scipy's curve_fit) for
every (A, C_mid) pair and keeps the pair with the lowest squared error, with no refinement after.
Here the grids are: A from the lowest fitted y (rounded down to the step) up to 1.0, C_mid
log-spaced from a tenth of the smallest to 100x the largest fitted x.
  - Default ("grid+refine"): the per-pair fit of B is a minimum over a dense grid of 100 log-spaced
    B values, evaluated for all pairs at once (see `grid_fit`); the winning grid point is then refined
    locally with scipy over all three parameters, so A and C_mid are not held to their grids. One
    fit of 200 points takes milliseconds, so a bootstrap over the evaluation points is practical.
  - --paper-grid: the paper's procedure as described: a least-squares fit of B (curve_fit's, made for
    all pairs at once, see `fit_b`) for every (A, C_mid) pair on the same grids, lowest error wins, A
    and C_mid stay on their grids. That is 100 fits of B per A value (12,500 for the paper's Table 1
    curve sampled 200 times), a second or two per fit, so the bootstrap is off unless --bootstrap N is
    given (each resample is one more fit).

Leaving out the start of a run. The paper leaves out about the first epoch (~1.5k of its 100k
GPU-hours), where the pass rate rises almost linearly. --exclude-first-epoch does that: it drops the
evaluations logged while the first epoch was running (scalerl.py's `epoch` field < 2). Without it,
this project's default leaves out the first 1.5% of the fitted x-range (a fixed fraction modelled on
the paper's 1.5k of 100k GPU-hours, not the paper's rule); --exclude-below X sets the threshold
instead. Both rules may be combined: a point is left out if either leaves it out.

A curve per task. A scalerl.py run whose held-out prompts are of several tasks (the math and code rows of one
--data file) logs each task's pass rate beside the overall one (val_pass_rate_math, val_pass_rate_code). With the
default --y, each of those columns is fitted too, a line (and a curve) "RUN [task]" after the run's own, as the
paper's per-domain curves. --shared-a compares the runs' overall curves only.

Usage:
    python fit_curve.py runs/baseline                       # a run directory holding metrics.jsonl
    python fit_curve.py runs/a/metrics.jsonl runs/b --x flops --plot curves.png --log-x
    python fit_curve.py runs/a runs/b --shared-a            # A fixed to the mean, compare B
    python fit_curve.py runs/a --fit-until 50 --json        # fit up to 50 device-hours, check the rest
    python fit_curve.py runs/a --exclude-first-epoch        # leave out the first epoch, as the paper
    python fit_curve.py runs/a --paper-grid                 # the paper's grid fit, no refinement
    python fit_curve.py results.csv --x gpu_hours --y pass_rate --r0 0.3 --bootstrap 2000

From Python (e.g. a live prediction of the asymptote at each evaluation of a training run):
    fit_rows(rows, x="device_hours", y="val_pass_rate", *, r0=None, exclude_below=None,
             exclude_first_epoch=False, fit_until=None, bootstrap=200, ci=0.95, seed=0, fixed_a=None,
             paper_grid=False, name="rows", where=None, progress=None) -> dict
rows: dicts as in metrics.jsonl (only those with `y` are points). Returns the dict the CLI prints
with --json, less "run" and "path", plus "observed": A, B, C_mid, R0, A_ci (None without bootstrap
or with fixed_a), B_ci, C_mid_ci, method, sse, n_points, at_grid_edge (non-empty: the data do not
pin those parameters down yet), ... Raises NotEnoughPoints (fewer than 4 usable points) or InputError
(bad rows); both are ValueErrors.
"""
import argparse
import csv
import json
import os
import sys
import time

if __name__ == "__main__":
    # The fit's matrix-vector products are small, so BLAS threads only add overhead (a bootstrap ran
    # 3-4x slower with them on a busy 2-core machine). Must precede the numpy import; script use only.
    for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit

PROG = "fit_curve.py"
A_STEP = 0.005                # grid step of A, as in the paper
N_CMID = 100                  # C_mid grid size, as in the paper (log-spaced)
CMID_SPAN = (0.1, 100.0)      # C_mid grid from x_min / 10 to x_max * 100
N_B = 100                     # B grid size (log-spaced), the inner least-squares fit of B
B_RANGE = (0.05, 20.0)        # also the bounds of B in --paper-grid's per-pair fits
EXCLUDE_FRACTION = 0.015      # default exclusion: first 1.5% of x (this project's choice, after the paper's
                              # ~1.5k of 100k GPU-h; the paper's rule is the first epoch: --exclude-first-epoch)
MIN_POINTS = 4                # fewest usable points a fit accepts
NOISE_MARGIN_A = 0.02         # the paper's noise margin on A (three seeds agreed within +-0.015)
TASK_PREFIX = "val_pass_rate_"  # scalerl.py's held-out pass rate of each task, in a run of several (math, code)


class InputError(ValueError):
    """Bad input: reported as one line on stderr, exit status 2."""


class NotEnoughPoints(InputError):
    """Fewer than MIN_POINTS usable points (e.g. early in a run): no fit yet."""


def curve(c, r0, a, b, c_mid):
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), written with expit so C -> 0 gives R0."""
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore"):
        z = b * (np.log(c_mid) - np.log(c))
    return r0 + (a - r0) * expit(-z)


def _number(value, what):
    """Convert one cell to a finite float or raise InputError naming where it came from."""
    if isinstance(value, bool) or value is None:
        raise InputError(f"{what}: {value!r} is not a number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{what}: {value!r} is not a number") from None
    if not np.isfinite(v):
        raise InputError(f"{what}: {value!r} is not a finite number")
    return v


def read_rows(path, x_col, y_col):
    """Read the rows of a metrics.jsonl, a run directory holding one, or a CSV with a header.

    Returns (label, rows, where): the run's name, the rows as dicts and, for messages, where each
    row came from ("FILE line N"). A CSV must have the x and y columns; empty cells are left out.
    """
    if os.path.isdir(path):
        label = os.path.basename(os.path.normpath(path))
        path = os.path.join(path, "metrics.jsonl")
    elif os.path.basename(path) == "metrics.jsonl":
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
    else:
        label = os.path.splitext(os.path.basename(path))[0]
    if not os.path.isfile(path):
        raise InputError(f"no such file: {path}")
    try:
        with open(path, newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    rows, where = [], []
    if path.endswith((".jsonl", ".json")) or text.lstrip().startswith("{"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise InputError(f"{path} line {n}: not valid JSON") from None
                if not isinstance(row, dict):
                    raise InputError(f"{path} line {n}: not a JSON object")
                rows.append(row)
                where.append(f"{path} line {n}")
    else:
        reader = csv.DictReader(text.splitlines())
        for col in (x_col, y_col):
            if col not in (reader.fieldnames or []):
                raise InputError(f"{path}: no column {col!r} (columns: {', '.join(reader.fieldnames or [])})")
        for r in reader:
            rows.append({k: v for k, v in r.items() if v not in ("", None)})
            where.append(f"{path} line {reader.line_num}")
    return label, rows, where


def rows_to_points(rows, x_col, y_col, where=None, name="rows", epoch=False):
    """The points (x, y) of rows, sorted by x, and with epoch=True each point's epoch (else None).

    Only rows that carry `y_col` are points (in a scalerl.py log those are the evaluation rows, the
    first at step 0). The epoch is scalerl.py's `epoch` field, the number of epochs started so far;
    the first point (the step-0 evaluation, before training) has none and counts as epoch 0.
    """
    where = where or [f"{name} row {i}" for i in range(len(rows))]
    xs, ys, epochs, missing = [], [], [], []
    for loc, row in zip(where, rows):
        if row.get(y_col) is None:
            continue
        if x_col not in row:
            raise InputError(f"{loc}: no column {x_col!r}")
        x, y = _number(row[x_col], f"{loc}, {x_col}"), _number(row[y_col], f"{loc}, {y_col}")
        if not 0.0 <= y <= 1.0:
            raise InputError(f"{loc}: {y_col} = {y} is outside [0, 1]")
        if x < 0:
            raise InputError(f"{loc}: {x_col} = {x} is negative")
        xs.append(x)
        ys.append(y)
        if epoch:
            if row.get("epoch") is None:
                missing.append((len(xs) - 1, loc))
            epochs.append(0.0 if row.get("epoch") is None else _number(row["epoch"], f"{loc}, epoch"))
    if not xs:
        raise InputError(f"{name}: no rows with {y_col!r}")
    if epoch and len(missing) == len(xs):
        raise InputError(f"{name}: no 'epoch' column, which --exclude-first-epoch needs (scalerl.py writes it "
                         "on every training row); use --exclude-below X instead")
    late = [loc for i, loc in missing if i > 0]
    if late:
        raise InputError(f"{late[0]}: no 'epoch' value; --exclude-first-epoch needs one on every evaluation "
                         "after the first (step 0)")
    order = np.argsort(xs, kind="stable")
    return np.asarray(xs)[order], np.asarray(ys)[order], np.asarray(epochs)[order] if epoch else None


def load_points(path, x_col, y_col):
    """(label, x, y) of a metrics.jsonl, a run directory holding one, or a CSV: see read_rows."""
    label, rows, where = read_rows(path, x_col, y_col)
    x, y, _ = rows_to_points(rows, x_col, y_col, where, path)
    return label, x, y


def make_grids(x, y):
    """The search grids for points x, y : A from the lowest y to 1.0 in steps of 0.005,
    C_mid log-spaced from x_min/10 to x_max*100, B log-spaced over B_RANGE.

    A starts at the lowest fitted y (rounded down to the step), not at the best: noise pushes the best
    y above the true asymptote (0.624 against A = 0.610 for the paper's Table 1 curve sampled 200 times
    with noise 0.005), and --paper-grid, which keeps A on this grid, was held above it there (A = 0.620,
    with B 28% too low to make up for it). The refined fit is the same either way.
    """
    a_lo = min(np.floor(y.min() / A_STEP) * A_STEP, 1.0)
    a_grid = np.arange(a_lo, 1.0 + A_STEP / 2, A_STEP)
    c_grid = np.geomspace(x.min() * CMID_SPAN[0], x.max() * CMID_SPAN[1], N_CMID)
    b_grid = np.geomspace(*B_RANGE, N_B)
    return a_grid, c_grid, b_grid


def curve_table(x, c_grid, b_grid):
    """S[k, i] = 1 / (1 + (C_mid / x_i)^B) for every grid pair k = (C_mid, B): the curve shape.

    R = R0 + (A - R0) * S is linear in A, so the squared error of every A follows from two
    weighted sums over S; this table is computed once per run and reused by every bootstrap sample.
    """
    z = b_grid[None, :, None] * (np.log(c_grid)[:, None, None] - np.log(x)[None, None, :])
    s = expit(-z).reshape(-1, len(x))
    return s, s * s


def error_parabola(y, w, r0, tables):
    """(D, P, Q) with, for every (C_mid, B) grid pair k, the weighted squared error at A
    sse_k(A) = D - 2 a P[k] + a^2 Q[k], a = A - R0 (R = R0 + a S is linear in a)."""
    s, s2 = tables
    d = y - r0
    return (w * d) @ d, s @ (w * d), s2 @ w


def grid_fit(y, w, r0, grids, tables, fixed_a=None):
    """Grid search: the best (A, B, C_mid) on the grids for points y with weights w.

    For each (C_mid, B) pair the error is a parabola in A: sse = D - 2 a P + a^2 Q with a = A - R0,
    so the best A on a uniform grid is the grid value nearest to the vertex P / Q. Minimising over
    the dense B grid is the per-pair least-squares fit of B; the lowest error over all pairs wins.
    """
    a_grid, c_grid, b_grid = grids
    dd, p, q = error_parabola(y, w, r0, tables)
    if fixed_a is None:
        vertex = p / np.maximum(q, 1e-300) + r0
        i = np.clip(np.rint((vertex - a_grid[0]) / A_STEP), 0, len(a_grid) - 1).astype(int)
        a = a_grid[i] - r0
    else:
        a = fixed_a - r0
    sse = dd - 2 * a * p + a * a * q
    k = int(np.argmin(sse))
    a_best = a[k] + r0 if fixed_a is None else fixed_a
    return a_best, b_grid[k % len(b_grid)], c_grid[k // len(b_grid)]


def refine(x, y, w, r0, start, grids, fixed_a=None):
    """Local least-squares refinement of the grid winner over (A, log B, log C_mid) within the grid
    bounds (A within [0, 1]); with fixed_a only B and C_mid move. Returns (A, B, C_mid)."""
    _, c_grid, b_grid = grids
    lx, sw = np.log(x), np.sqrt(w)
    free_a = fixed_a is None

    def unpack(p):
        return (p[0], p[1], p[2]) if free_a else (fixed_a, p[0], p[1])

    def residuals(p):
        a, lb, lc = unpack(p)
        return sw * (r0 + (a - r0) * expit(-np.exp(lb) * (lc - lx)) - y)

    def jacobian(p):
        a, lb, lc = unpack(p)
        b = np.exp(lb)
        z = b * (lc - lx)
        s = expit(-z)
        ds = s * (1 - s)
        cols = [s, -(a - r0) * ds * z, -(a - r0) * ds * b]
        return np.column_stack(cols if free_a else cols[1:]) * sw[:, None]

    a0, b0, c0 = start
    lo = [np.log(b_grid[0]), np.log(c_grid[0])]
    hi = [np.log(b_grid[-1]), np.log(c_grid[-1])]
    p0 = [np.log(b0), np.log(c0)]
    if free_a:
        lo, hi, p0 = [0.0] + lo, [1.0] + hi, [a0] + p0
    p0 = np.clip(p0, lo, hi)
    res = least_squares(residuals, p0, jac=jacobian, bounds=(lo, hi), method="trf")
    best = res.x if np.sum(res.fun ** 2) <= np.sum(residuals(p0) ** 2) else p0
    a, lb, lc = unpack(best)
    return float(a), float(np.exp(lb)), float(np.exp(lc))


def paper_grid_fit(x, y, w, r0, grids, tables, fixed_a=None):
    """The paper's procedure as described: for every (A, C_mid) pair on the grids, fit B by least
    squares and keep the pair with the lowest squared error; A and C_mid stay on their grids (no
    refinement). With fixed_a only C_mid is searched. Returns (A, B, C_mid).

    The per-pair fits are those scipy's curve_fit makes (the paper's tool), made for all pairs at once
    by `fit_b`: from the same start, to the same local minimum (test_fit_curve.py compares them pair
    by pair), in a fifth of the time. Weights w (bootstrap counts) weight the squared errors, as
    curve_fit's sigma = 1 / sqrt(w) does. B is bounded to B_RANGE (0.05, 20), the range of the refined
    fit's B grid: B > 0 as the paper requires, and a finite upper end keeps a pair whose C_mid lies
    outside the data from running off towards a step function. Each pair's start is its best B on the
    dense B grid (from the same tables as grid_fit) rather than curve_fit's default B = 1.
    """
    a_grid, c_grid, b_grid = grids
    a_values = a_grid if fixed_a is None else np.array([float(fixed_a)])
    dd, p, q = error_parabola(y, w, r0, tables)
    am = a_values[:, None] - r0
    sse_grid = (dd - 2 * am * p + am * am * q).reshape(len(a_values), len(c_grid), len(b_grid))
    a, c = (v.ravel() for v in np.meshgrid(a_values, c_grid, indexing="ij"))
    keep = w > 0
    b, sse = fit_b(np.log(x[keep]), y[keep], w[keep], r0, a - r0, np.log(c),
                   b_grid[np.argmin(sse_grid, axis=2)].ravel())
    k = int(np.argmin(sse))
    return float(a[k]), float(b[k]), float(c[k])


def fit_b(lx, y, w, r0, a, lc, b, iters=100):
    """For every pair k (a[k] = A - R0, lc[k] = log C_mid), the B within B_RANGE that minimises
    sum_i w_i (R0 + a[k] / (1 + exp(b (lc[k] - lx_i))) - y_i)^2, from the start b[k]: Gauss-Newton
    steps, each halved until the error does not grow, until B moves by less than 1e-10 of itself
    (what curve_fit does for one pair, here for all of them at once). Returns (B, squared error)."""
    z, a, b = lc[:, None] - lx[None, :], a[:, None], b.astype(float)

    def error(k, bk):
        s = expit(-bk[:, None] * z[k])
        r = r0 + a[k] * s - y
        return (w * r * r).sum(1), r, s

    sse, active = error(slice(None), b)[0], np.arange(len(b))
    for _ in range(iters):
        _, r, s = error(active, b[active])
        j = -a[active] * s * (1 - s) * z[active]                     # d residual / d B
        step = -(w * j * r).sum(1) / np.maximum((w * j * j).sum(1), 1e-300)
        moved, todo = np.zeros(len(active)), np.arange(len(active))
        for _ in range(40):
            if not len(todo):
                break
            k = active[todo]
            new = np.clip(b[k] + step[todo], *B_RANGE)
            new_sse = error(k, new)[0]
            ok = new_sse <= sse[k]
            moved[todo[ok]] = np.abs(new[ok] - b[k[ok]])
            b[k[ok]], sse[k[ok]] = new[ok], new_sse[ok]
            todo = todo[~ok]
            step[todo] /= 2
        active = active[moved > 1e-10 * b[active]]
        if not len(active):
            break
    return b, sse


def fit_once(x, y, w, r0, grids, tables, fixed_a=None, paper_grid=False):
    """One fit of (A, B, C_mid) to points x, y with weights w: the paper's grid fit, or (default) the
    vectorised grid search refined locally."""
    if paper_grid:
        return paper_grid_fit(x, y, w, r0, grids, tables, fixed_a)
    return refine(x, y, w, r0, grid_fit(y, w, r0, grids, tables, fixed_a), grids, fixed_a)


def grid_edges(a, b, c_mid, grids, fixed_a=None):
    """Names of the parameters that ended on the edge of their search range (not pinned down); for A:
    1.0, or the lowest fitted y (a curve that does not rise above its lowest point)."""
    a_grid, c_grid, b_grid = grids
    edges = []
    if fixed_a is None and (a >= 1.0 - A_STEP / 2 or a <= a_grid[0] + A_STEP / 2):
        edges.append("A")
    for name, v, g in (("B", b, b_grid), ("C_mid", c_mid, c_grid)):
        half_step = 0.5 * np.log(g[1] / g[0])
        if min(abs(np.log(v / g[0])), abs(np.log(v / g[-1]))) < half_step:
            edges.append(name)
    return edges


def bootstrap_intervals(x, y, r0, grids, tables, n, ci, rng, fixed_a=None, paper_grid=False, progress=None,
                        r0_residuals=None, at=None):
    """Percentile bootstrap intervals for A, B, C_mid: resample the evaluation points with
    replacement (as integer weights, so the curve table is reused) and refit each sample with the
    same method as the fit itself (fit_once). at: a compute value; the interval of each sample's
    curve there follows ("at": the prediction's interval, not the curve of the parameters' bounds).

    When R0 was measured (the step-0 evaluation) it is noisy too: given r0_residuals (the fit's
    residuals), each sample also adds one of them, drawn at random, to R0. Without this the
    intervals of C_mid are too narrow, since every sample would share the one noisy R0.
    progress: None (silent) or the run's name for progress lines on stderr when it takes long.
    """
    m, draws, r0s = len(x), [], []
    t0 = t_last = time.monotonic()
    tty = sys.stderr.isatty()
    for i in range(n):
        w = np.bincount(rng.integers(0, m, m), minlength=m).astype(float)
        r0_b = r0 if r0_residuals is None else float(np.clip(r0 + rng.choice(r0_residuals), 0.0, 1.0))
        if np.count_nonzero(w) >= MIN_POINTS:
            draws.append(fit_once(x, y, w, r0_b, grids, tables, fixed_a, paper_grid))
            r0s.append(r0_b)
        now = time.monotonic()
        every = 0.5 if tty or t_last == t0 else 10.0   # (a log: the first line after 1 s, then every 10 s)
        if progress is not None and now - t_last >= every and now - t0 >= 1.0:   # only when long
            t_last = now
            left = (now - t0) / (i + 1) * (n - i - 1)
            print(("\r" if tty else "") + f"{PROG}: bootstrap {progress}: {i + 1}/{n}, about {_duration(left)} left",
                  end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty and t_last > t0:
        print(file=sys.stderr)
    if not draws:
        return {k: None for k in ("A", "B", "C_mid", "at")}
    draws = np.array(draws)
    q = [100 * (1 - ci) / 2, 100 * (1 + ci) / 2]
    out = {k: [float(v) for v in np.percentile(draws[:, j], q)] for j, k in enumerate(("A", "B", "C_mid"))}
    if at is not None:
        out["at"] = [float(v) for v in np.percentile([curve(at, r, *d) for r, d in zip(r0s, draws)], q)]
    if fixed_a is not None:
        out["A"] = None
    return out


def _duration(seconds):
    """'42 s', '7 min', '2.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def fit_rows(rows, x="device_hours", y="val_pass_rate", *, r0=None, exclude_below=None, exclude_first_epoch=False,
             fit_until=None, bootstrap=200, ci=0.95, seed=0, fixed_a=None, paper_grid=False, name="rows",
             where=None, progress=None, predict_at=None):
    """Fit R(C) to in-memory rows (dicts as in metrics.jsonl); the CLI fits each file through this.

    x, y: the compute and performance columns; rows without y are not points. r0: the pass rate
    before training (default: y at the first point). Points left out of the fit: x < exclude_below,
    and with exclude_first_epoch those logged before the first epoch ended (epoch < 2); a point is left
    out if either rule leaves it out, and with neither the first 1.5% of the fitted x-range is.
    fit_until: fit only x <= fit_until and report the prediction error on later points. bootstrap:
    resamples for the intervals (0: none); ci, seed: their coverage and seed. fixed_a: fit with A
    fixed. paper_grid: the paper's grid fit instead of grid + refinement. name, where: what to call
    the rows, and each row, in error messages; progress: see bootstrap_intervals. predict_at: a
    compute value; the curve there ("predicted") and its bootstrap interval ("predicted_ci") follow.

    Returns a dict (see the module docstring). Raises NotEnoughPoints when fewer than 4 points are
    usable and InputError for bad rows.
    """
    xs, ys, epochs = rows_to_points(rows, x, y, where, name, epoch=exclude_first_epoch)
    r0_given = r0 is not None
    r0 = float(ys[0]) if r0 is None else float(r0)
    until = xs.max() if fit_until is None else fit_until
    in_range = xs <= until
    if not in_range.any():
        raise NotEnoughPoints(f"{name}: no points with {x} <= {until:g}")
    if exclude_below is None and not exclude_first_epoch:   # this project's default, not the paper's rule
        exclude_below = xs[0] + EXCLUDE_FRACTION * (xs[in_range].max() - xs[0])
    use = in_range & (xs > 0)
    if exclude_below is not None:
        use &= xs >= exclude_below
    why = ""
    if exclude_first_epoch:
        first_epoch = epochs < 2
        use &= ~first_epoch
        why = (f" and epoch >= 2 (--exclude-first-epoch: {np.count_nonzero(first_epoch & in_range)} of the "
               f"{np.count_nonzero(in_range)} points were logged before the first epoch ended)")
    if use.sum() < MIN_POINTS:
        lower = f"{exclude_below:g} <= " if exclude_below is not None else "0 < "
        raise NotEnoughPoints(f"{name}: {use.sum()} usable points with {lower}{x} <= {until:g}{why}; "
                              f"at least {MIN_POINTS} are needed")
    xf, yf, w = xs[use], ys[use], np.ones(use.sum())
    grids = make_grids(xf, yf)
    tables = curve_table(xf, grids[1], grids[2])
    a, b, c_mid = fit_once(xf, yf, w, r0, grids, tables, fixed_a, paper_grid)
    residuals = yf - curve(xf, r0, a, b, c_mid)
    cis = {}
    if bootstrap > 0:
        cis = bootstrap_intervals(xf, yf, r0, grids, tables, bootstrap, ci, np.random.default_rng(seed), fixed_a,
                                  paper_grid, progress, r0_residuals=None if r0_given else residuals, at=predict_at)
    result = {
        "x": x, "y": y, "method": "paper-grid" if paper_grid else "grid+refine",
        "A": a, "B": b, "C_mid": c_mid, "R0": r0,
        "A_ci": cis.get("A"), "B_ci": cis.get("B"), "C_mid_ci": cis.get("C_mid"), "ci": ci,
        "bootstrap": bootstrap, "sse": float(np.sum(residuals ** 2)),
        "n_points": int(use.sum()), "exclude_below": None if exclude_below is None else float(exclude_below),
        "exclude_first_epoch": bool(exclude_first_epoch),
        "fit_range": [float(xf.min()), float(xf.max())], "shared_a": fixed_a is not None,
        "at_grid_edge": grid_edges(a, b, c_mid, grids, fixed_a),
        "observed": [xs.tolist(), ys.tolist()],
    }
    if predict_at is not None:
        result["predicted"], result["predicted_ci"] = float(curve(predict_at, r0, a, b, c_mid)), cis.get("at")
    if fit_until is not None:
        later = xs > fit_until
        err = np.abs(curve(xs[later], r0, a, b, c_mid) - ys[later])
        result["fit_until"] = float(fit_until)
        result["n_extrapolated"] = int(later.sum())
        result["extrapolation_max_abs_error"] = float(err.max()) if later.any() else None
        result["extrapolation_mean_abs_error"] = float(err.mean()) if later.any() else None
    return result


def live_fit(rows, x="device_hours"):
    """scalerl.py's prediction as a run goes on (--live-fit), as metrics-row columns: fit_rows of the evaluations so far
    against x; {} while the points cannot support one (fewer than four, or at the search range's edge before the
    curve bends). A at the pass rate's own bound, 1, is a fit, said so (fit_A_at_bound)."""
    try:
        f = fit_rows(rows, x=x, bootstrap=100, seed=0)
    except NotEnoughPoints:
        return {}
    at_bound = f["at_grid_edge"] == ["A"] and f["A"] > 0.99
    if f["at_grid_edge"] and not at_bound:
        return {}
    return {"fit_A": f["A"], "fit_B": f["B"], "fit_C_mid": f["C_mid"], "fit_A_ci": list(f["A_ci"]),
            **({"fit_A_at_bound": True} if at_bound else {})}


def task_columns(rows, y):
    """The per-task columns beside y = val_pass_rate in scalerl.py's rows (a run of math and code rows logs
    val_pass_rate_math and val_pass_rate_code, the paper's per-domain curves); none for another y."""
    return sorted({k for r in rows for k in r if k.startswith(TASK_PREFIX)}) if y + "_" == TASK_PREFIX else []


def analyse_run(path, args, fixed_a=None, n_boot=None, tasks=True):
    """Load one run and fit it with the command-line options (optionally with A fixed) via fit_rows: a list of fits,
    the overall curve's, then with `tasks` one for each task's column (task_columns), run "RUN [task]"."""
    label, rows, where = read_rows(path, args.x, args.y)
    fits = []
    for y in [args.y] + (task_columns(rows, args.y) if tasks else []):
        name = label if y == args.y else f"{label} [{y[len(TASK_PREFIX):]}]"
        fit = fit_rows(rows, args.x, y, r0=args.r0, exclude_below=args.exclude_below,
                       exclude_first_epoch=args.exclude_first_epoch, fit_until=args.fit_until,
                       bootstrap=args.bootstrap if n_boot is None else n_boot, ci=args.ci, seed=args.seed,
                       fixed_a=fixed_a, paper_grid=args.paper_grid, name=path, where=where, progress=name)
        fits.append({"run": name, "path": path, **fit})
    return fits


def _fmt(v, ci=None, spec=".3f"):
    """'0.610 [0.605, 0.615]' style cell; spec None: a compute value (2542, 1.09e+04 style)."""
    def one(u):
        return (f"{u:.0f}" if 100 <= u < 1e6 else f"{u:.3g}") if spec is None else format(u, spec)
    return one(v) + (f" [{one(ci[0])}, {one(ci[1])}]" if ci else "")


def format_table(results, args):
    """A readable, aligned table of the fits, one line per run, with a short header and footer."""
    pct = f"{100 * args.ci:g}%"
    head = ["run", "points", "R0", "A" + (" (shared)" if args.shared_a else ""), "B", "C_mid", "SSE"]
    if args.fit_until is not None:
        head.append(f"max |err| beyond {args.fit_until:g}")
    rows = []
    for r in results:
        row = [r["run"], str(r["n_points"]), f"{r['R0']:.3f}", _fmt(r["A"], r["A_ci"]),
               _fmt(r["B"], r["B_ci"], ".2f"), _fmt(r["C_mid"], r["C_mid_ci"], None), f"{r['sse']:.3g}"]
        if args.fit_until is not None:
            e = r["extrapolation_max_abs_error"]
            row.append("no later points" if e is None else f"{e:.4f} ({r['n_extrapolated']} points)")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
    lines = [f"R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), C = {args.x}, R = {args.y}; "
             + (f"{pct} bootstrap intervals from {args.bootstrap} resamples" if args.bootstrap else "no bootstrap")
             + ("; paper-grid fit (A and C_mid on their grids, B by least squares)" if args.paper_grid else "")]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in [head] + rows]
    spread = max(r["A"] for r in results) - min(r["A"] for r in results)
    if len(results) > 1 and not args.shared_a and spread <= NOISE_MARGIN_A:
        lines.append(f"The asymptotes differ by {spread:.3f}, within the paper's {NOISE_MARGIN_A} noise margin: "
                     "compare B with --shared-a.")
    if args.shared_a and len(results) > 1:
        ranked = sorted(results, key=lambda r: -r["B"])
        lines.append(f"A fixed to {results[0]['A']:.3f} for all runs; by B (higher = more efficient): "
                     + " > ".join(f"{r['run']} ({r['B']:.2f})" for r in ranked))
    return "\n".join(lines)


def plot_runs(results, path, log_x=False):
    """Observed points, fitted curve (solid over the fitted range, dashed beyond), A and C_mid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        colour = f"C{i % 10}"
        x, y = map(np.asarray, r["observed"])
        keep = x > 0 if log_x else np.ones(len(x), bool)
        ax.plot(x[keep], y[keep], "o", ms=3, color=colour, alpha=0.5)
        lo, hi = r["fit_range"]
        x_min = x[keep].min() if keep.any() else lo
        x_max = max(x.max(), hi) * 1.25
        space = np.geomspace if log_x else np.linspace
        pre = space(max(x_min, lo / 100 if log_x else 0.0), lo, 100)
        inside, beyond = space(lo, hi, 200), space(hi, x_max, 100)
        params = (r["R0"], r["A"], r["B"], r["C_mid"])
        ax.plot(inside, curve(inside, *params), "-", color=colour,
                label=f"{r['run']}: A={r['A']:.3f}, B={r['B']:.2f}, C_mid={_fmt(r['C_mid'], spec=None)}")
        ax.plot(pre, curve(pre, *params), "--", color=colour)
        ax.plot(beyond, curve(beyond, *params), "--", color=colour)
        ax.axhline(r["A"], color=colour, ls=":", lw=1)
        ax.axvline(r["C_mid"], color=colour, ls=":", lw=1)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(results[0]["x"])
    ax.set_ylabel(results[0]["y"])
    ax.set_title("R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B); dotted: A and C_mid")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def parse_args(argv):
    """Command-line flags; see the module docstring for examples."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="Usage" + __doc__.split("Usage")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="metrics.jsonl, a run directory holding one, or a CSV")
    p.add_argument("--x", default="device_hours", help="compute column (default: device_hours; "
                   "flops, step, gen_tokens also make sense)")
    p.add_argument("--y", default="val_pass_rate", help="performance column (default: val_pass_rate, and each "
                   "task's val_pass_rate_TASK where the rows have them)")
    p.add_argument("--r0", type=float, help="pass rate before training (default: y at the first point)")
    p.add_argument("--exclude-below", type=float, metavar="X", help="leave points with x < X out of the fit "
                   "(default, unless --exclude-first-epoch is given: the first 1.5%% of the fitted x-range, this "
                   "tool's choice modelled on the paper's ~1.5k of 100k GPU-hours)")
    p.add_argument("--exclude-first-epoch", action="store_true", help="leave out the points logged before the "
                   "first epoch ended (epoch < 2 in metrics.jsonl), the paper's rule; with --exclude-below, a point "
                   "is left out if either rule leaves it out")
    p.add_argument("--fit-until", type=float, metavar="X",
                   help="fit only points with x <= X and report the prediction error on the later ones")
    p.add_argument("--bootstrap", type=int, metavar="N", help="bootstrap resamples (default 1000, 0 with "
                   "--paper-grid, where each resample is a full paper-grid fit of a second or two; 0: none)")
    p.add_argument("--ci", type=float, default=0.95, help="interval coverage (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--shared-a", action="store_true", help="refit all runs with A fixed to their mean; compare B")
    p.add_argument("--paper-grid", action="store_true", help="fit as the paper: A and C_mid on their grids, B by "
                   "least squares for each pair, no refinement (~100 fits of B per 0.005 of A)")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the points and fitted curves")
    p.add_argument("--log-x", action="store_true", help="logarithmic x axis in the plot")
    args = p.parse_args(argv)
    if not 0 < args.ci < 1:
        p.error("--ci must be between 0 and 1")
    if args.bootstrap is None:
        args.bootstrap = 0 if args.paper_grid else 1000
    if args.bootstrap < 0:
        p.error("--bootstrap must be >= 0")
    if args.r0 is not None and not 0 <= args.r0 <= 1:
        p.error("--r0 must be within [0, 1]")
    return args


def main(argv=None):
    """Fit every run, print the table (or JSON lines), draw the plot; return the exit status."""
    args = parse_args(argv)
    try:
        if args.shared_a:   # the paper: compare B at a common A when the A differ by < 0.02
            first = [analyse_run(path, args, n_boot=0, tasks=False)[0] for path in args.runs]
            a_values = [r["A"] for r in first]
            if max(a_values) - min(a_values) > NOISE_MARGIN_A:
                print(f"{PROG}: warning: the asymptotes differ by {max(a_values) - min(a_values):.3f}, more "
                      f"than the {NOISE_MARGIN_A} noise margin; a shared A may mislead", file=sys.stderr)
            shared = float(np.mean(a_values))
            results = [analyse_run(path, args, fixed_a=shared, tasks=False)[0] for path in args.runs]
        else:
            results = [fit for path in args.runs for fit in analyse_run(path, args)]
        for r in results:
            if r["at_grid_edge"]:
                print(f"{PROG}: warning: {r['run']}: {', '.join(r['at_grid_edge'])} at the edge of the "
                      "search grid; the data do not pin it down", file=sys.stderr)
            if args.fit_until is not None and not r["n_extrapolated"]:
                print(f"{PROG}: warning: {r['run']}: no points beyond --fit-until", file=sys.stderr)
        if args.json:
            for r in results:
                print(json.dumps({k: v for k, v in r.items() if k != "observed"}))
        else:
            print(format_table(results, args))
        if args.plot:
            plot_runs(results, args.plot, args.log_x)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(("\n" if sys.stderr.isatty() else "") + f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
