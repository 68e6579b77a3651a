"""pytest hooks for the test modules beside it:
- the `quick` mark: `pytest -q -m quick` runs the recipe's hand-value tests and the README's fork examples, a fork's
  check in under a minute (the whole suite is the README's `pytest -q -n 2 --dist loadgroup`, which CI runs);
- the `heavy` mark, collected first; one thread a test process (OMP_NUM_THREADS);
- under `-n --dist loadgroup`, a pytest that drops the `xdist_group` marks stops the run (pytest_collection_finish);
- a local run that skips tests for want of a package (vllm, wandb) says so at the end, with the count, instead of
  passing quietly (CI, with SCALERL_REQUIRE_VLLM=1, fails those tests);
- warm_vllm_model_info: vLLM's inspection of the model classes the tests use, made in the test process."""
import importlib.util
import os
import re

# one thread a test process (torch, oneDNN, vLLM's CPU engine, and the processes a test starts): the models here are
# tiny, a second thread gains them little, and under `pytest -n 2` (the README's command) each worker has its core
os.environ.setdefault("OMP_NUM_THREADS", "1")

NOT_INSTALLED = re.compile(r"(\w+) is not installed")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: a recipe component against hand values, or a README fork example: the "
                                       "subset `pytest -q -m quick` runs in under a minute")
    config.addinivalue_line("markers", "heavy: starts whole runs or several processes (torchrun, the script, vLLM "
                                       "engines); collected first, so that under -n no worker is left with one at the end")
    config.addinivalue_line("markers", "xdist_group(name): under pytest -n --dist loadgroup, the tests of one group run "
                                       "in one worker")


def pytest_collection_modifyitems(config, items):
    """The heavy tests first (a stable sort: the order within each kind is the files')."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_collection_finish(session):
    """Under `-n --dist loadgroup`, each worker's grouped tests carry their group in their node ids (pytest-xdist adds
    it): where a pytest ignores that (pytest 9.2 with pytest-xdist 3.8, pytest-xdist's issue 1386), the groups would
    be dropped without a word, and the sandbox's tests, which count every process of nobody's, would run beside one
    another. Stop the run instead."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getoption("loadgroup", False):
        grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
        if grouped and "@" not in grouped[0].nodeid:
            raise RuntimeError("xdist_group marks are ignored by this pytest and pytest-xdist (pytest-xdist's issue "
                               "1386): install requirements-cpu.txt's pins")


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


_WARM = set()


def warm_vllm_model_info(archs=("LlamaForCausalLM", "Gemma2ForCausalLM")):
    """vLLM inspects a model class (which interfaces it has) in a new Python process that imports vLLM, ~9 s on 2 cores,
    once per cache directory ($XDG_CACHE_HOME/vllm/modelinfos), which every test here shares. Do it in this process,
    which imports vLLM for its engines anyway, and write vLLM's cache file: two such processes fewer in the suite,
    and the first vLLM test as fast as the others. Speed only: where vLLM 0.32's registry has moved, nothing is
    written and vLLM inspects as before."""
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache in _WARM or importlib.util.find_spec("vllm") is None:
        return
    _WARM.add(cache)
    try:
        from pathlib import Path
        from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo
        for arch in archs:
            m = ModelRegistry.models[arch]
            path = Path(importlib.util.find_spec(m.module_name).origin)
            m._save_modelinfo_to_cache(_ModelInfo.from_model_cls(m.load_model_cls()), m._get_modelinfo_module_hash(path))
    except Exception:
        pass
