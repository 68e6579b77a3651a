"""memory.py -- the memory plan of scalerl.py: what each GPU will hold, planned from a run's settings and its model's
sizes before any weight loads (docs/benchmarks.md).

scalerl.py prints the plan at start-up on CUDA with --model and refuses, in one line, a run that will not fit
(check_memory_plan); bench.py --memory checks the trainer's part against torch's memory tracker on fake tensors. The
plan reads a config (any object with scalerl.py's Config fields) and `sizes` (scalerl.py's model_sizes: counted on the
meta device from the model's config); it imports nothing of scalerl.py.
"""
import operator

import torch

GiB = 2**30


# The plan's constants, each checked against torch's memory tracker or read in vLLM (docs/benchmarks.md):
KEPT_PER_TOKEN = (37, 8, 10, 5, 10)  # bytes a token and layer that backward keeps without checkpointing: times H, I,
# the attention's width beyond H (heads x head_dim - H) and an MoE's k x H (its rows through the experts) and E
RECOMPUTED = 2.25  # a checkpointed layer's backward: its activations recomputed and their gradients, x KEPT_PER_TOKEN
HEAD_PER_LOGIT = 16  # the head's backward: float32 logits, their gradients and softmax, bytes a token and vocab entry
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
    split = cfg.lm_head_fp32 and cfg.fp32_head_product == "split"  # (scalerl.py's head_product)
    phases = {  # the head's backward: per chunk its logits, a float32 gradient of W (and of an untied head whole under
        # torchrun); split, W's two bf16 parts and, where W's gradient is made, the chunk's gradient and its parts
        # beside two float32 products of W's size
        "head backward": max(HEAD_PER_LOGIT * chunk_logits, (8 * chunk_logits + 8 * V * H) * split)
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
