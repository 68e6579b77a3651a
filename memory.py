"""memory.py -- the memory of a scalerl.py run: the memory plan, what each GPU will hold, planned from a run's
settings and its model's sizes before any weight loads (docs/benchmarks.md); the CPU engine's KV cache, sized the same
way (docs/engines.md); and the trainer's measured peak on CUDA.

scalerl.py prints the plan at start-up on CUDA with --model and refuses, in one line, a run that will not fit
(check_memory_plan); bench.py --memory checks the trainer's part against torch's memory tracker on fake tensors. The
plan reads a config (any object with scalerl.py's Config fields) and `sizes` (model_sizes: counted on the meta device
from the model's config); it imports nothing of scalerl.py.
"""
import contextlib
import math
import operator
import os

import torch

GiB = 2**30


# The plan's constants, each checked against torch's memory tracker or read in vLLM (docs/benchmarks.md):
KEPT_PER_TOKEN = (37, 8, 10, 5, 10)  # bytes a token and layer that backward keeps without checkpointing: times H, I,
# the attention's width beyond H (heads x head_dim - H) and an MoE's k x H (its rows through the experts) and E
RECOMPUTED = 2.25  # a checkpointed layer's backward: its activations recomputed and their gradients, x KEPT_PER_TOKEN
HEAD_PER_LOGIT = 16  # the head's backward: float32 logits, their gradients and softmax, bytes a token and vocab entry
TERM_PER_LOGIT = 16  # each further term that token_terms gives over the vocabulary (docs/fork.md's entropy: its float32
# log-softmax and exp kept for backward; under the tracker 12.4 bytes a logit, 14.7 with the split product)
SAMPLER_PER_LOGIT = 28  # vLLM's profiling run: the sampler's float32 logits and their sort, bytes a row and vocab entry
SMALL_TENSORS, GRAPHS = 64 * 2**20, 1.5 * GiB  # inputs, masks, step counters; vLLM's CUDA graphs and buffers


def memory_plan(sizes, cfg, ranks, device_bytes, longest=0, sharded=False):
    """What a GPU will hold, before any weight is loaded: the trainer, a reserve no simulation sees, the engine and what
    is left (docs/benchmarks.md; bench.py --memory checks the trainer's part against torch's memory tracker)."""
    plan = trainer_plan(sizes, cfg, ranks if sharded else 1, longest, sharded)
    plan["reserve"] = 2 * GiB + 0.1 * plan["trainer"]
    plan.update(engine_plan(sizes, cfg, ranks, device_bytes, longest, sharded))
    plan["left"] = device_bytes - plan["trainer"] - plan["reserve"] - plan["engine"] * (not cfg.generators)
    return plan


def trainer_plan(sizes, cfg, ranks, longest, sharded):
    """The trainer's part: what stays (weights, gradients and AdamW's moments sharded over the ranks, and FSDP2's root,
    the embeddings and head whole after forward), what backward keeps, and the largest of three phases' transients."""
    V, H, I, L = sizes["V"], sizes["H"], sizes["I"], sizes["L"]
    params, param_bytes = sizes["params"], getattr(torch, cfg.param_dtype).itemsize
    compute_bytes = (getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16).itemsize
    tokens = max(cfg.micro_batch_tokens, longest)
    chunk_logits = min(cfg.logprob_chunk, tokens) * V
    shard = params * param_bytes / ranks
    plan = {"params": params, "weights": shard, "gradients": shard, "adam": 2 * shard,
            "root": param_bytes * V * H * (1 if sizes["tied"] else 2) * sharded}
    kept = sum(map(operator.mul, KEPT_PER_TOKEN, (H, I, sizes["A"] - H, sizes["k"] * H, sizes["E"])))
    if cfg.activation_checkpointing:  # each layer's input
        plan["activations"] = (L + 3) * tokens * H * param_bytes
    else:  # everything, and each layer's weights cast to the compute dtype
        plan["activations"] = L * tokens * kept + L * sizes["layer"] * compute_bytes * (compute_bytes < param_bytes) \
            + 3 * tokens * H * param_bytes
    gathered = sizes["layer"] * param_bytes * sharded  # one decoder layer whole (FSDP2)
    split = cfg.lm_head_fp32 and cfg.fp32_head_product == "split"  # (the FP32 head's split product)
    phases = {  # the head's backward: per chunk its logits, a float32 gradient of W (and of an untied head whole under
        # torchrun); split, W's two bf16 parts and, where W's gradient is made, the chunk's gradient and its parts
        # beside two float32 products of W's size
        "head backward": max(HEAD_PER_LOGIT * chunk_logits, (8 * chunk_logits + 8 * V * H) * split)
        + TERM_PER_LOGIT * (sizes.get("terms", 1) - 1) * chunk_logits
        + 4 * V * H * (1 + split + (sharded and not sizes["tied"])) + 4 * tokens * H + gathered * (ranks > 1),
        "AdamW step": shard - plan["activations"]}  # (a moment-sized temporary)
    if cfg.activation_checkpointing:  # a layer's activations recomputed, FSDP2's buffers of three layers, and an
        # MoE's experts cast to the compute dtype for the grouped product (autocast_experts) and that cast's gradient
        phases["layer backward"] = RECOMPUTED * tokens * kept + gathered * (1 + 2 * (ranks > 1)) \
            + 2 * sizes["experts"] * compute_bytes * (compute_bytes < param_bytes)
    if sizes.get("k"):  # an MoE's recorded experts (routing column, --routing-replay): int16, layers x k a token
        plan["routing"] = 2 * tokens * L * sizes["k"]
    plan["phase"] = max(phases, key=phases.get)
    plan["transient"] = phases[plan["phase"]]
    plan["trainer"] = sum(plan.get(k, 0) for k in ("weights", "gradients", "adam", "root", "activations", "transient",
                                                   "routing")) \
        + SMALL_TENSORS
    return plan


def engine_plan(sizes, cfg, ranks, device_bytes, longest, sharded):
    """The engine's part (an estimate, read in vLLM 0.32): a device share, claimed whole: weights, FP32 head, profiling
    peak, CUDA graphs, KV cache; hf: a replica under torchrun, the KV cache and logits of what it generates at once."""
    V, H, I, params = sizes["V"], sizes["H"], sizes["I"], sizes["params"]
    compute_bytes = (getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16).itemsize
    kv_token = sizes["kv"] * compute_bytes
    if cfg.engine == "hf":
        seqs = max(cfg.prompts_per_step * cfg.generations_per_prompt, (cfg.val_size or 200) * cfg.eval_samples) / ranks
        replica = params * getattr(torch, cfg.param_dtype).itemsize * sharded
        return {"kv_token": kv_token, "engine": replica + seqs * (longest * kv_token + 8 * V), "kv": 0.0}
    share = (0.9 if cfg.generators else cfg.vllm_gpu_memory_utilization) * device_bytes
    big = device_bytes >= 70 * GiB  # vLLM's defaults on H100-class GPUs: 16,384 tokens and 1,024 sequences a step
    seqs, tokens = cfg.vllm_max_num_seqs or (1024 if big else 256), 16384 if big else 8192
    plan = {"kv_token": kv_token, "engine": share, "engine_weights": params * compute_bytes,
            "fp32_head": 4 * V * H * cfg.lm_head_fp32, "graphs": GRAPHS,
            "profile": max(tokens * compute_bytes * (3 * I + (4 + sizes["k"]) * H), SAMPLER_PER_LOGIT * seqs * V)}
    plan["kv"] = share - sum(plan[k] for k in ("engine_weights", "fp32_head", "profile", "graphs"))
    return plan


def plan_line(plan, cfg, device_bytes):
    """The start-up line of a memory plan."""
    gb = lambda b: f"{b / GiB:.1f}"  # noqa: E731  (GiB, as gpu_peak_gb)
    p = plan
    engine = (f"engine {gb(p['engine'])} GiB{' on each generator GPU' if cfg.generators else ''} (weights "
              f"{gb(p['engine_weights'])}, float32 head {gb(p['fp32_head'])}, profiling peak {gb(p['profile'])}, CUDA "
              f"graphs {gb(p['graphs'])}, KV cache ~{gb(p['kv'])} GiB = ~{max(p['kv'], 0) / p['kv_token'] / 1e3:.0f}k "
              "tokens: an estimate)") if cfg.engine != "hf" else f"HF engine {gb(p['engine'])} GiB"
    return (f"scalerl: memory plan per GPU ({gb(device_bytes)} GiB): trainer {gb(p['trainer'])} GiB (weights "
            f"{gb(p['weights'])}, gradients {gb(p['gradients'])}, AdamW {gb(p['adam'])}"
            + (f", unsharded root {gb(p['root'])}" if p["root"] else "") + f", activations {gb(p['activations'])}"
            f"{' checkpointed' * cfg.activation_checkpointing}, {p['phase']} {gb(p['transient'])}) + reserve "
            f"{gb(p['reserve'])} | {engine} | {gb(p['left'])} GiB left")


def plan_error(sizes, cfg, ranks, device_bytes, longest, sharded=False):
    """Why the run cannot fit its GPUs by the memory plan, in one line with the figures and what would fit, or None."""
    plan = memory_plan(sizes, cfg, ranks, device_bytes, longest, sharded)
    gb = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    engine = 0 if cfg.generators else plan["engine"]
    room = device_bytes - engine - plan["reserve"]
    need = next((k for k in range(1, 4097) if memory_plan(sizes, cfg, k, device_bytes, longest, True)["left"] >= 0),
                None)
    ranks_hint = f"at least {need} ranks (torchrun --nproc-per-node {need}, by the whole plan)" if need else \
        "a smaller model"
    resident = sum(plan[k] for k in ("weights", "gradients", "adam", "root"))
    if resident > room:
        return (f"memory plan: the trainer's weights, gradients and AdamW moments"
                f"{' and its unsharded root' * bool(plan['root'])} need {gb(resident)} a GPU "
                f"({plan['params'] / 1e9:.2f}B parameters in {cfg.param_dtype}"
                f"{f' over {ranks} ranks' if ranks > 1 else ''}), and {gb(room)} is left beside the engine's "
                f"{gb(engine)} and the reserve: use {ranks_hint}, or a lower --vllm-gpu-memory-utilization")
    if plan["left"] < 0:
        return (f"memory plan: the trainer needs {gb(plan['trainer'])} a GPU at its peak (resident {gb(resident)}, "
                f"activations {gb(plan['activations'])}, {plan['phase']} {gb(plan['transient'])}) and {gb(room)} is "
                f"left beside the engine's {gb(engine)} and the reserve: use {ranks_hint}, or lower "
                "--micro-batch-tokens or --logprob-chunk" + (", or turn on --activation-checkpointing"
                                                              if not cfg.activation_checkpointing else ""))
    if cfg.engine != "hf" and plan["kv"] < longest * plan["kv_token"]:
        share = cfg.vllm_gpu_memory_utilization + (longest * plan["kv_token"] - plan["kv"]) / device_bytes
        return (f"memory plan: vLLM's KV cache would hold ~{gb(max(plan['kv'], 0))} (an estimate: its share, less its "
                f"weights, the float32 head, the profiling peak and CUDA graphs), less than one longest prompt + "
                f"completion ({longest} tokens, {gb(longest * plan['kv_token'])}): raise --vllm-gpu-memory-utilization "
                f"to {share:.2f} or more, lower --vllm-max-num-seqs, or give the engine GPUs of its own (--generators)")
    return None


# --------------------------------------------------------------------------------------------------
# The model's sizes; what the trainer's update peaked at; the CPU engine's KV cache and what a KV cache holds
# --------------------------------------------------------------------------------------------------


def model_sizes(config, token_terms=None):
    """What the memory plan needs of a model, counted on the meta device from its config; with scalerl.py's
    token_terms, how many terms it gives a token (the recipe's: the log-prob alone)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    (V, H), heads = model.get_output_embeddings().weight.shape, config.num_attention_heads
    d = getattr(config, "head_dim", None) or H // heads
    units = [m for m in model.modules() if type(m).__name__ in (getattr(model, "_no_split_modules", None) or [])]
    k = getattr(config, "num_experts_per_tok", None) or 0  # an MoE: I is its experts' width at top-k
    experts = [p for p in units[0].parameters() if p.dim() == 3] if k else []  # its experts, fused (transformers 5)
    width = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 4 * H)
    return {"params": sum(p.numel() for p in model.parameters()), "V": V, "H": H, "I": width * (k or 1), "k": k,
            "E": experts[0].shape[0] if experts else 0, "experts": sum(p.numel() for p in experts), "L": len(units),
            "A": heads * d, "layer": sum(p.numel() for p in units[0].parameters()),
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "kv": 2 * len(units) * getattr(config, "num_key_value_heads", heads) * d,
            "terms": len(token_terms(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))) if token_terms else 1}



def gpu_peak(model, opt):
    """On CUDA, before an update: a function giving gpu_peak_gb, the resident bytes (weights, AdamW's moments: this
    rank's shards) plus the update's peak above where memory stood (the idle engine counts in neither)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return dict
    torch.cuda.reset_peak_memory_stats(device)
    tensors = [*model.parameters(), *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]
    resident = sum(t.numel() * t.element_size() for t in (x.to_local() if hasattr(x, "to_local") else x
                                                          for x in tensors) if t.is_cuda)
    start = torch.cuda.memory_allocated(device)
    return lambda: {"gpu_peak_gb": (resident + torch.cuda.max_memory_allocated(device) - start) / 2**30}



CPU_KV_SHARE = 0.25  # the most of the machine's available memory that the CPU engines' KV caches take by default
CPU_KV_BLOCK = 128  # vLLM 0.32's KV cache block on CPU, in tokens (VLLMEngine reads the engine's own)


def cpu_kv_cache_mb(cfg, kv_bytes, longest, n_val, ranks=1, available=None):
    """--vllm-kv-cache-mb's default on a CPU and its start-up line: room for every sequence an engine decodes at once at
    `longest` tokens (no preemption), at most CPU_KV_SHARE of the memory available (docs/engines.md); ranks:
    torchrun's, an engine each."""
    K, P, G, engines = cfg.max_lag, cfg.prompts_per_step, cfg.generations_per_prompt, cfg.generators or ranks
    groups = (K + 1) * P if cfg.off_policy == "pipeline" else max(K, 1) * P
    seqs = min(math.ceil(max(groups * G, n_val * cfg.eval_samples) / engines), cfg.vllm_max_num_seqs or 256)
    if available is None:
        with contextlib.suppress(OSError, StopIteration, ValueError):
            with open("/proc/meminfo") as f:
                available = 1024 * int(next(ln for ln in f if ln.startswith("MemAvailable:")).split()[1])
    local = cfg.generators or int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # engines on this machine
    tokens = (seqs * math.ceil(longest / CPU_KV_BLOCK) + 1) * CPU_KV_BLOCK  # (+1: vLLM's null block)
    want, cap = tokens * kv_bytes, CPU_KV_SHARE * available / local if available else math.inf
    mb = max(1, math.ceil(min(want, cap) / 2**20))
    return mb, (f"scalerl: vLLM's KV cache: {mb} MiB{' an engine' * (engines > 1)}, for {seqs} sequences x {longest} "
                f"tokens x {kv_bytes / 1024:.1f} KiB" + (f", cut to a quarter of the {available / 2**30:.1f} GiB "
                f"available{f' over {local} engines' * (local > 1)}" if want > cap else "") +
                "; --vllm-kv-cache-mb sets it")



def kv_capacity(blocks, groups, length):
    """Sequences of `length` tokens a KV cache of `blocks` holds. groups: each KV cache group's (block size, sliding
    window or None), on one pool (CUDA's hybrid manager: Gemma 2 has 2; a CPU, 1); one block is vLLM's null block."""
    need = sum(math.ceil(length / b) if w is None else math.ceil(min(length, w - 1 + b) / b) + 1 for b, w in groups)
    return (blocks - 1) // max(need, 1)
