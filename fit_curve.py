"""Fit, compare and extrapolate sigmoidal compute-performance curves (Khatri et al. 2025, arXiv 2510.13786).

The ScaleRL paper (Khatri et al. 2025) summarises an RL run by fitting

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

to the validation pass rate R against training compute C. A is the asymptote (how high the recipe
can go), B the scaling exponent and C_mid the compute at which half of the gain A - R0 is reached
(together: how efficiently it gets there). R0, the pass rate before training, is fixed, not fitted.

Fitting procedure (as in the paper, generalised to any data): A runs over a grid (step 0.005, from
the best observed y up to 1.0), C_mid over a log-spaced grid reaching well beyond the data, and B
is fitted by least squares for every (A, C_mid) pair; the pair with the lowest squared error wins and
is then refined locally with scipy (there A may end a little below the best observed y, which noise
pushes above the true asymptote). The grid search is vectorised (see `grid_fit`), so one fit of
200 points takes milliseconds and a bootstrap over the evaluation points is practical.

The first part of a run, where the pass rate rises almost linearly, is left out of the fit: by
default the first 1.5% of the fitted x-range, as the paper left out ~1.5k of 100k GPU-hours.

Usage:
    python fit_curve.py runs/baseline                       # a run directory holding metrics.jsonl
    python fit_curve.py runs/a/metrics.jsonl runs/b --x flops --plot curves.png --log-x
    python fit_curve.py runs/a runs/b --shared-a            # A fixed to the mean, compare B
    python fit_curve.py runs/a --fit-until 50 --json        # fit up to 50 device-hours, check the rest
    python fit_curve.py results.csv --x gpu_hours --y pass_rate --r0 0.3 --bootstrap 2000
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
B_RANGE = (0.05, 20.0)
EXCLUDE_FRACTION = 0.015      # default --exclude-below: first 1.5% of x (paper: ~1.5k of 100k GPU-h)
NOISE_MARGIN_A = 0.02         # the paper's noise margin on A (three seeds agreed within +-0.015)


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


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


def load_points(path, x_col, y_col):
    """Read (label, x, y) from a metrics.jsonl, a run directory holding one, or a CSV with a header.

    Only rows that carry `y_col` are points (in a scalerl.py log those are the evaluation rows, the
    first at step 0); other rows are ignored. Points are returned sorted by x.
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
    if path.endswith((".jsonl", ".json")) or text.lstrip().startswith("{"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise InputError(f"{path} line {n}: not valid JSON") from None
                if not isinstance(row, dict):
                    raise InputError(f"{path} line {n}: not a JSON object")
                rows.append((f"{path} line {n}", row))
    else:
        reader = csv.DictReader(text.splitlines())
        for col in (x_col, y_col):
            if col not in (reader.fieldnames or []):
                raise InputError(f"{path}: no column {col!r} (columns: {', '.join(reader.fieldnames or [])})")
        rows = [(f"{path} line {reader.line_num}", {k: v for k, v in r.items() if v not in ("", None)})
                for r in reader]
    xs, ys = [], []
    for where, row in rows:
        if row.get(y_col) is None:
            continue
        if x_col not in row:
            raise InputError(f"{where}: no column {x_col!r}")
        x, y = _number(row[x_col], f"{where}, {x_col}"), _number(row[y_col], f"{where}, {y_col}")
        if not 0.0 <= y <= 1.0:
            raise InputError(f"{where}: {y_col} = {y} is outside [0, 1]")
        if x < 0:
            raise InputError(f"{where}: {x_col} = {x} is negative")
        xs.append(x)
        ys.append(y)
    if not xs:
        raise InputError(f"{path}: no rows with {y_col!r}")
    order = np.argsort(xs, kind="stable")
    return label, np.asarray(xs)[order], np.asarray(ys)[order]


def make_grids(x, y):
    """The search grids for points x, y : A from the best y to 1.0 in steps of 0.005,
    C_mid log-spaced from x_min/10 to x_max*100, B log-spaced over B_RANGE."""
    a_lo = min(np.floor(y.max() / A_STEP) * A_STEP, 1.0)
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


def grid_fit(y, w, r0, grids, tables, fixed_a=None):
    """Grid search: the best (A, B, C_mid) on the grids for points y with weights w.

    For each (C_mid, B) pair the error is a parabola in A: sse = D - 2 a P + a^2 Q with a = A - R0,
    so the best A on a uniform grid is the grid value nearest to the vertex P / Q. Minimising over
    the dense B grid is the per-pair least-squares fit of B; the lowest error over all pairs wins.
    """
    a_grid, c_grid, b_grid = grids
    s, s2 = tables
    d = y - r0
    p, q, dd = s @ (w * d), s2 @ w, (w * d) @ d
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


def grid_edges(a, b, c_mid, grids, fixed_a=None):
    """Names of the parameters that ended on the edge of their search range (not pinned down)."""
    _, c_grid, b_grid = grids
    edges = []
    if fixed_a is None and (a >= 1.0 - A_STEP / 2 or a <= A_STEP / 2):
        edges.append("A")
    for name, v, g in (("B", b, b_grid), ("C_mid", c_mid, c_grid)):
        half_step = 0.5 * np.log(g[1] / g[0])
        if min(abs(np.log(v / g[0])), abs(np.log(v / g[-1]))) < half_step:
            edges.append(name)
    return edges


def bootstrap(x, y, r0, grids, tables, n, ci, rng, fixed_a=None, label="", r0_residuals=None):
    """Percentile bootstrap intervals for A, B, C_mid: resample the evaluation points with
    replacement (as integer weights, so the curve table is reused) and refit each sample.

    When R0 was measured (the step-0 evaluation) it is noisy too: given r0_residuals (the fit's
    residuals), each sample also adds one of them, drawn at random, to R0. Without this the
    intervals of C_mid are too narrow, since every sample would share the one noisy R0.
    """
    m, draws = len(x), []
    t0 = t_last = time.monotonic()
    tty = sys.stderr.isatty()
    for i in range(n):
        w = np.bincount(rng.integers(0, m, m), minlength=m).astype(float)
        r0_b = r0 if r0_residuals is None else float(np.clip(r0 + rng.choice(r0_residuals), 0.0, 1.0))
        if np.count_nonzero(w) >= 4:
            start = grid_fit(y, w, r0_b, grids, tables, fixed_a)
            draws.append(refine(x, y, w, r0_b, start, grids, fixed_a))
        now = time.monotonic()
        if now - t_last >= (0.5 if tty else 10.0) and now - t0 >= 1.0:   # only when it is long
            t_last = now
            print(("\r" if tty else "") + f"{PROG}: bootstrap {label}: {i + 1}/{n}",
                  end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty and t_last > t0:
        print(file=sys.stderr)
    if not draws:
        return {k: None for k in ("A", "B", "C_mid")}
    draws = np.array(draws)
    q = [100 * (1 - ci) / 2, 100 * (1 + ci) / 2]
    out = {k: [float(v) for v in np.percentile(draws[:, j], q)] for j, k in enumerate(("A", "B", "C_mid"))}
    if fixed_a is not None:
        out["A"] = None
    return out


def analyse_run(path, args, fixed_a=None, n_boot=None):
    """Load one run, fit it (optionally with A fixed), bootstrap it, check its extrapolation."""
    label, x, y = load_points(path, args.x, args.y)
    r0 = y[0] if args.r0 is None else args.r0
    fit_until = x.max() if args.fit_until is None else args.fit_until
    in_range = x <= fit_until
    if not in_range.any():
        raise InputError(f"{path}: no points with {args.x} <= {fit_until:g}")
    exclude_below = args.exclude_below
    if exclude_below is None:
        exclude_below = x[0] + EXCLUDE_FRACTION * (x[in_range].max() - x[0])
    use = in_range & (x >= exclude_below) & (x > 0)
    if use.sum() < 4:
        raise InputError(f"{path}: {use.sum()} usable points with {exclude_below:g} <= {args.x} <= "
                         f"{fit_until:g}; at least 4 are needed")
    xf, yf, w = x[use], y[use], np.ones(use.sum())
    grids = make_grids(xf, yf)
    tables = curve_table(xf, grids[1], grids[2])
    a, b, c_mid = refine(xf, yf, w, r0, grid_fit(yf, w, r0, grids, tables, fixed_a), grids, fixed_a)
    n_boot = args.bootstrap if n_boot is None else n_boot
    rng = np.random.default_rng(args.seed)
    residuals = yf - curve(xf, r0, a, b, c_mid)
    cis = {}
    if n_boot > 0:
        cis = bootstrap(xf, yf, r0, grids, tables, n_boot, args.ci, rng, fixed_a, label,
                        r0_residuals=residuals if args.r0 is None else None)
    result = {
        "run": label, "path": path, "x": args.x, "y": args.y,
        "A": a, "B": b, "C_mid": c_mid, "R0": float(r0),
        "A_ci": cis.get("A"), "B_ci": cis.get("B"), "C_mid_ci": cis.get("C_mid"), "ci": args.ci,
        "bootstrap": n_boot, "sse": float(np.sum(residuals ** 2)),
        "n_points": int(use.sum()), "exclude_below": float(exclude_below),
        "fit_range": [float(xf.min()), float(xf.max())], "shared_a": fixed_a is not None,
        "at_grid_edge": grid_edges(a, b, c_mid, grids, fixed_a),
        "observed": [x.tolist(), y.tolist()],
    }
    if args.fit_until is not None:
        later = x > fit_until
        err = np.abs(curve(x[later], r0, a, b, c_mid) - y[later])
        result["fit_until"] = float(fit_until)
        result["n_extrapolated"] = int(later.sum())
        result["extrapolation_max_abs_error"] = float(err.max()) if later.any() else None
        result["extrapolation_mean_abs_error"] = float(err.mean()) if later.any() else None
    return result


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
             + (f"{pct} bootstrap intervals from {args.bootstrap} resamples" if args.bootstrap else "no bootstrap")]
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
    p.add_argument("--y", default="val_pass_rate", help="performance column (default: val_pass_rate)")
    p.add_argument("--r0", type=float, help="pass rate before training (default: y at the first point)")
    p.add_argument("--exclude-below", type=float, metavar="X", help="leave points with x < X out of the "
                   "fit (default: the first 1.5%% of the fitted x-range, as the paper's 1.5k of 100k GPU-h)")
    p.add_argument("--fit-until", type=float, metavar="X",
                   help="fit only points with x <= X and report the prediction error on the later ones")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples (default 1000; 0: none)")
    p.add_argument("--ci", type=float, default=0.95, help="interval coverage (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--shared-a", action="store_true", help="refit all runs with A fixed to their mean; compare B")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the points and fitted curves")
    p.add_argument("--log-x", action="store_true", help="logarithmic x axis in the plot")
    args = p.parse_args(argv)
    if not 0 < args.ci < 1:
        p.error("--ci must be between 0 and 1")
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
            first = [analyse_run(path, args, n_boot=0) for path in args.runs]
            a_values = [r["A"] for r in first]
            if max(a_values) - min(a_values) > NOISE_MARGIN_A:
                print(f"{PROG}: warning: the asymptotes differ by {max(a_values) - min(a_values):.3f}, more "
                      f"than the {NOISE_MARGIN_A} noise margin; a shared A may mislead", file=sys.stderr)
            shared = float(np.mean(a_values))
            results = [analyse_run(path, args, fixed_a=shared) for path in args.runs]
        else:
            results = [analyse_run(path, args) for path in args.runs]
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
