"""moe.py -- a Mixture-of-Experts policy in scalerl.py (docs/moe.md): which experts route each sampled token, in
the generator and in the trainer; routing replay (R3, --routing-replay); and the two fixes an MoE needs today, its
experts under autocast in the trainer and vLLM's expert kernels reset before a push.

scalerl.py imports it where it is beside it; without it a dense model runs as before and an MoE is refused at start-up
(check_architecture). It imports nothing of scalerl.py. The names of scalerl.py's that the docstrings cite:
load_model, hf_generate, Policy, batch_tensors, VLLMEngine.
"""
import copy
import math

import numpy as np
import torch

# --------------------------------------------------------------------------------------------------
# The trainer's side (transformers): the experts under autocast; the routers' hook, which records the experts (the HF
# engine's generate), replays the generator's (--routing-replay) and compares them with the trainer's (Policy)
# --------------------------------------------------------------------------------------------------


def autocast_experts(model):
    """An MoE's experts multiplied in autocast's dtype, as its Linear layers are. transformers' default experts
    (grouped_mm) multiply in their weights' dtype, the trainer's float32: torch's grouped product is no autocast op,
    and CUDA's kernel takes bfloat16 only (float32 falls back to a loop over the experts; fake tensors, as in bench.py
    --memory, refuse it). Here the same function, the weights cast first where autocast is on (a CPU forces it with
    --dtype bfloat16); a dense model is left as it is."""
    from transformers.integrations.moe import ExpertsInterface
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        ExpertsInterface.register("grouped_mm_autocast", grouped_mm_autocast)
        model.set_experts_implementation("grouped_mm_autocast")
    return model


def grouped_mm_autocast(experts, hidden, *routing):
    """transformers' grouped_mm experts function; under autocast, on a shallow copy of the experts module whose
    parameters are cast to its dtype (autograd takes each cast's gradient back to its float32 weight)."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    if torch.is_autocast_enabled(kind := hidden.device.type):
        experts, dtype = copy.copy(experts), torch.get_autocast_dtype(kind)
        experts._parameters = {n: p.to(dtype) for n, p in experts._parameters.items() if p is not None}
    return grouped_mm_experts_forward(experts, hidden, *routing)


def set_routing(model, state):
    """What an MoE's routers do in the model's next forward passes (route_hook), hooked on first use: transformers'
    *TopKRouter modules (a softmax, then the top k: Qwen2/3-MoE, Mixtral, OLMoE...), out = (logits, weights, experts).
    state: None; a list (hf_generate's record); (experts, replay, used) (Policy). Returns the MoE layers (dense: 0)."""
    if not hasattr(model, "moe_routers"):
        model.moe_routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        for layer, r in enumerate(model.moe_routers):
            r.register_forward_hook(lambda m, i, out, layer=layer: route_hook(model, m, layer, out))
    model.routing = state
    return len(model.moe_routers)


def route_hook(model, router, layer, out):
    """set_routing's hook on MoE layer `layer`'s router: out = (logits, gate weights, experts) of the forward's tokens
    (rows x positions). hf_generate's record keeps the experts; the Policy's micro-batch with the generator's experts
    (batch_tensors' "experts") replaces them by those with --routing-replay (replay_routing), and keeps those used."""
    state, (logits, weights, experts) = model.routing, out
    if isinstance(state, list):
        state.append(experts)
    elif state is not None and state[0] is not None:
        gen, replay, used = state
        if replay:
            w, experts = replay_routing(logits, gen[..., layer, :].reshape(experts.shape), experts,
                                        getattr(router, "norm_topk_prob", True))
            out = logits, w.to(weights.dtype), experts
        used[layer] = experts
        return out


def replay_routing(logits, experts, own, renormalise):
    """Routing replay (R3, arXiv 2510.11370; --routing-replay) in each MoE layer of the trainer's forward (route_hook):
    the generator's experts [N, k] (-1: none recorded, the router's own) with the gate weights the router would give
    them from the trainer's logits [N, E]: pi_train on the routing that sampled the token, the router's gradient
    kept."""
    experts = torch.where(experts >= 0, experts.long(), own)
    w = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return (w / w.sum(-1, keepdim=True) if renormalise else w), experts


def generated_experts(routes, layers, rows):
    """hf_generate's record (set_routing's list: each forward's experts, layer by layer) as each sampled token's
    experts, [rows, tokens, layers, k]: those of the last position of the forward that sampled it."""
    return torch.stack([torch.stack(routes[i:i + layers], 1).view(rows, -1, layers, routes[i].shape[-1])[:, -1]
                        for i in range(0, len(routes), layers)], 1).to(torch.int16).cpu().numpy()


def routing_differs(x, used, layers):
    """Per completion token of micro-batch x, per MoE layer: 1.0 where the experts that routed its predicting position
    in the trainer's forward (`used`) are not the set the generator's did (x["experts"]), else 0.0; NaN where the
    generator recorded none (the injected phrase; an engine that records none)."""
    if "experts" not in x:
        return torch.full((len(x["targets"]), layers), math.nan, device=x["ids"].device)
    gen = x["experts"][x["row"], x["pos"]].long()  # [tokens, layers, k]
    mine = torch.stack([used[k] for k in sorted(used)], 1).view(*x["ids"].shape, *gen.shape[1:])[x["row"], x["pos"]]
    differs = (gen.sort(-1).values != mine.sort(-1).values).any(-1).float()
    return torch.where(gen[..., 0] >= 0, differs, math.nan)


def experts_tensor(samples, width, device):
    """batch_tensors' "experts": each sample's generator experts [tokens, layers, k] at its tokens' predicting positions
    in the micro-batch's rows of `width` positions, -1 elsewhere: [rows, width, layers, k]."""
    e = torch.full((len(samples), width, *samples[0].experts.shape[1:]), -1, dtype=torch.int16)
    for k, s in enumerate(samples):
        e[k, len(s.prompt) - 1:len(s.prompt) - 1 + len(s.tokens)] = torch.from_numpy(s.experts)
    return e.to(device)


def routing_sums(routed):
    """mismatch_sums' routing columns from routing_differs' [tokens, layers]: the tokens routed to other experts than
    the generator's in any layer, and the (token, layer)s, each over the tokens with experts recorded (NaN: none; no
    data-dependent shape, for bench.py's fake tensors)."""
    known, differs = (~routed[:, 0].isnan()).sum(), routed.nan_to_num(0.0)
    return {"routing_mismatch_frac": ((differs > 0).any(-1).sum(), known),
            "routing_mismatch_layer_frac": (differs.sum(), known * routed.shape[1])}


# --------------------------------------------------------------------------------------------------
# The engine's side (vLLM 0.32, in process): the experts' kernels reset before a push, the experts recorded
# --------------------------------------------------------------------------------------------------


def forget_moe_kernels(model):
    """Inside the vLLM engine, before a push: vLLM 0.32 reprocesses an unquantized MoE layer's experts on a reload, but
    once the layer has its kernel it skips the experts' own step (unquantized_fused_moe_method.py, _setup_kernel), which
    on a CPU pads and prepacks them: the raw weights would land in the packed storage (a push of unchanged weights moved
    log-probs by 0.04), or fail to fit it. Without its kernel, a layer's reload goes as its first load went."""
    for m in model.modules():
        if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None:
            m.quant_method.moe_kernel = None


def capture_routing(llm):
    """An MoE's experts in the vLLM engine, {(request, index in it): [a [layers][k] list a token sampled]}, or None for
    a dense model. vLLM 0.32 returns them (enable_return_routed_experts) only from its model runner V2, which needs
    Triton (a CPU has none): the routers' own capture hook keeps a forward's experts (eager only), then each request's
    last row, the position that predicts the token it samples, goes under its request's id."""
    import vllm_seam  # (vLLM's internals, beside this file)
    rows, step = {}, {}

    def record(n, ids):  # after each engine step: the tokens scheduled per request, the requests in the batch's order
        ends = np.cumsum([n[r] for r in ids]) - 1
        for r, e in zip(ids, torch.stack([step[k] for k in sorted(step)], 1)[ends].tolist() if step else []):
            index, _, request = r.rpartition("-")[0].rpartition("_")  # f"{index}_{request}-{suffix}" (n > 1)
            rows.setdefault((request, int(index or 0)), []).append(e)
        step.clear()

    def install(worker):
        layers = vllm_seam.moe_layers(worker)
        for capture, layer in layers:
            capture(lambda ids, layer=layer: step.__setitem__(layer, ids))
        if layers:
            vllm_seam.after_each_step(worker, record)
        return bool(layers)
    return rows if llm.collective_rpc(install)[0] else None
