"""pytest hooks for the test modules beside it:
- the `quick` mark: `pytest -q -m quick` runs the recipe's hand-value tests and the README's fork examples, a fork's
  check in under a minute (the whole suite is the README's `pytest -q`, which CI runs);
- a local run that skips tests for want of a package (vllm, wandb) says so at the end, with the count, instead of
  passing quietly (CI, with SCALERL_REQUIRE_VLLM=1, fails those tests)."""
import re

NOT_INSTALLED = re.compile(r"(\w+) is not installed")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: a recipe component against hand values, or a README fork example: the "
                                       "subset `pytest -q -m quick` runs in under a minute")


def pytest_terminal_summary(terminalreporter):
    missing = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        found = NOT_INSTALLED.search(reason)
        if found:
            missing[found.group(1)] = missing.get(found.group(1), 0) + 1
    if missing:
        terminalreporter.section("skipped for want of a package", sep="!", red=True, bold=True)
        for name, n in sorted(missing.items()):
            terminalreporter.write_line(f"{n} test{'s' * (n > 1)} skipped: {name} is not installed (install "
                                        "requirements-cpu.txt; SCALERL_REQUIRE_VLLM=1 makes them fail)", red=True)
