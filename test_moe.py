"""Tests of an MoE's routing in scalerl.py and moe.py: the experts each engine records, the routing-mismatch column and routing
replay (R3, --routing-replay). Tiny Qwen3-MoE models built from a config. Run: python -m pytest -q test_moe.py"""
import dataclasses

import numpy as np
import pytest
import torch

import memory
import moe
import scalerl as S
from test_scalerl import need_vllm


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Keep the embedded model's cache inside pytest's temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def tiny_moe(norm=False, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    conf = Qwen3MoeConfig(vocab_size=40, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                          num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(conf).float()


def samples_of(rng, n=3, layers=2, k=2, experts=6, vocab=40):
    """n samples of random tokens, each with random generator experts (k distinct of `experts`) per token and layer."""
    out = []
    for _ in range(n):
        P, T = rng.integers(2, 5), rng.integers(2, 6)
        e = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(T)])
        out.append(S.Sample(rng.integers(3, vocab, P).tolist(), rng.integers(3, vocab, T).tolist(), [0.0] * T,
                            [1] * T, [0] * T, 1.0, 1.0, {}, e.astype(np.int16)))
    return out


@pytest.mark.quick
def test_replayed_gate_weights_by_hand():
    """replay_routing: the replayed experts (-1: the router's own), their gate weights the softmax of the trainer's
    logits over all experts taken at them, renormalised over them where the router renormalises."""
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.5, 0.0, 3.0, 1.0]])
    experts, own = torch.tensor([[3, 0], [-1, -1]]), torch.tensor([[1, 0], [2, 3]])
    w, e = moe.replay_routing(logits, experts, own, renormalise=False)
    z0, z1 = np.exp([1.0, 2.0, 0.0, -1.0]).sum(), np.exp([0.5, 0.0, 3.0, 1.0]).sum()
    assert e.tolist() == [[3, 0], [2, 3]]
    assert torch.allclose(w, torch.tensor([[np.exp(-1.0) / z0, np.exp(1.0) / z0], [np.exp(3.0) / z1, np.exp(1.0) / z1]],
                                          dtype=torch.float32))
    w, _ = moe.replay_routing(logits, experts, own, renormalise=True)
    a, b = np.exp(-1.0), np.exp(1.0)  # renormalised over the replayed pair: the softmax of their two logits
    assert torch.allclose(w[0], torch.tensor([a / (a + b), b / (a + b)], dtype=torch.float32))


@pytest.mark.parametrize("norm", [False, True])
def test_replay_reaches_the_forward(norm):
    """--routing-replay: the trainer's forward routes every completion token's predicting position to the generator's
    experts (routing_differs 0 everywhere, the metric's column 0); off, the random generator experts differ from the
    trainer's. Replaying the trainer's own routing leaves its log-probs as they are; replaying others moves them, to
    what a router patched to return those experts and gate weights gives."""
    model, rng, cfg = tiny_moe(norm), np.random.default_rng(0), S.Config()
    samples = samples_of(rng)
    x = S.batch_tensors(samples, 0, torch.device("cpu"))
    with torch.no_grad():
        off = S.as_policy(model)(x, cfg)
        on = S.as_policy(model)(x, dataclasses.replace(cfg, routing_replay=True))
    assert off["routing_differs"].shape == (len(x["seq"]), 2) and off["routing_differs"].sum() > 0
    assert on["routing_differs"].sum() == 0
    m = S.mismatch_sums(on["logp"], x["logp_gen"], x["fresh"], on["routing_differs"])
    assert m["routing_mismatch_frac"] == (0, len(x["seq"]))
    assert not torch.allclose(on["logp"], off["logp"])
    # a reference: each router's own forward patched to return the replayed experts and the gate weights by hand
    routers = [r for r in model.modules() if type(r).__name__ == "Qwen3MoeTopKRouter"]
    gen = x["experts"].long()  # [rows, positions, layers, k]
    for layer, r in enumerate(routers):
        def patched(h, r=r, layer=layer):
            logits = torch.nn.functional.linear(h.reshape(-1, r.hidden_dim), r.weight)
            p = torch.softmax(logits.float(), -1)
            own = p.topk(2, -1).indices
            e = torch.where(gen[..., layer, :].reshape(-1, 2) >= 0, gen[..., layer, :].reshape(-1, 2), own)
            w = p.gather(-1, e)
            return logits, (w / w.sum(-1, keepdim=True) if norm else w).to(logits.dtype), e
        r.forward = patched
    model.moe_routers = []  # (the hooks stay silent: the reference routes by itself)
    with torch.no_grad():
        ref = S.as_policy(model)(x, cfg)
    assert torch.allclose(on["logp"], ref["logp"], atol=1e-6)
    # replaying the trainer's own routing: the plain forward's log-probs
    model2 = tiny_moe(norm)
    own = [[] for _ in range(2)]
    hooks = [r.register_forward_hook(lambda m, i, o, layer=layer: own[layer].append(o[2]))
             for layer, r in enumerate(m for m in model2.modules() if type(m).__name__ == "Qwen3MoeTopKRouter")]
    with torch.no_grad():
        plain = S.as_policy(model2)(x, cfg)
    for h in hooks:
        h.remove()
    mine = torch.stack([o[0] for o in own], 1).view(*x["ids"].shape, 2, 2)
    for k, s in enumerate(samples):
        P = len(s.prompt)
        s.experts = mine[k, P - 1:P - 1 + len(s.tokens)].to(torch.int16).numpy()
    x2 = S.batch_tensors(samples, 0, torch.device("cpu"))
    with torch.no_grad():
        replayed = S.as_policy(model2)(x2, dataclasses.replace(cfg, routing_replay=True))
    assert torch.equal(replayed["logp"], plain["logp"]) and replayed["routing_differs"].sum() == 0


def test_dense_model_has_no_routing_column():
    """A dense model: no hook, no routing term, mismatch_sums' columns as before."""
    from test_scalerl import tiny_model
    model, rng = tiny_model(False), np.random.default_rng(0)
    samples = [dataclasses.replace(s, experts=None) for s in samples_of(rng)]
    x = S.batch_tensors(samples, 0, torch.device("cpu"))
    with torch.no_grad():
        terms = S.as_policy(model)(x, S.Config())
    recipe = set(S.token_terms(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long)))  # ({"logp"}; a fork's own too)
    assert set(terms) == recipe and "experts" not in x and model.moe_routers == []
    assert set(S.mismatch_sums(terms["logp"], x["logp_gen"], x["fresh"])) == {
        "mismatch_abs_logprob", "mismatch_kl_k3", "mismatch_fresh_abs_logprob"}


def test_without_moe_py_a_dense_model_runs_and_an_moe_is_refused(monkeypatch):
    """A copy of scalerl.py without moe.py (a fork's single file): a dense model's forward is the same, and an MoE, whose
    push would corrupt its experts without moe.py's kernel reset, is refused at start-up in one line that names it."""
    from test_scalerl import tiny_model
    model, rng = tiny_model(False), np.random.default_rng(0)
    x = S.batch_tensors([dataclasses.replace(s, experts=None) for s in samples_of(rng)], 0, torch.device("cpu"))
    with torch.no_grad():
        with_moe = S.as_policy(model)(x, S.Config())
        monkeypatch.setattr(S, "moe", None)
        alone = S.as_policy(model)(x, S.Config())
    recipe = set(S.token_terms(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long)))  # ({"logp"}; a fork's own too)
    assert set(alone) == recipe and torch.equal(alone["logp"], with_moe["logp"])
    S.check_architecture(S.Config(engine="hf"), model.config, "dense")
    with pytest.raises(S.ScaleRLError, match=r"tiny: a Mixture-of-Experts \(Qwen3Moe\w+\) needs moe.py"):
        S.check_architecture(S.Config(engine="hf"), tiny_moe().config, "tiny")


def engine_routing_agrees(model, groups, tok):
    """Every sampled token of the groups carries experts [tokens, layers, k] (-1 rows exactly at injected tokens), and
    the trainer's forward on the same weights routes every one of them as the engine did."""
    samples = []
    for c in (c for g in groups for c in g.completions):
        assert c.experts.shape == (len(c.tokens), 2, 2) and c.experts.dtype == np.int16
        assert ((c.experts[:, 0, 0] < 0) == (np.array(c.mask) == 0)).all()
        samples.append(S.Sample(groups[0].prompt, c.tokens, c.logprobs, c.mask, [0] * len(c.tokens), 1.0, 1.0, {},
                                c.experts))
    x = S.batch_tensors(samples, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        terms = S.as_policy(model)(x, S.Config())
    routed = terms["routing_differs"]
    assert routed.shape == (sum(sum(c.mask) for g in groups for c in g.completions), 2)
    assert routed.sum() == 0, routed
    return sum(c.interrupted for g in groups for c in g.completions)


def test_hf_engine_records_routing():
    """--engine hf on the embedded MoE: each token's experts recorded during generate, as the trainer routes them."""
    cfg = S.fill_defaults(S.Config(moe=True, engine="hf", max_new_tokens=8, generations_per_prompt=4))
    model, tok, _ = S.load_model(cfg, torch.device("cpu"))
    ro = S.Rollouts(cfg, S.HFEngine(model, tok, cfg, None), tok)
    ro.add(("eval", 0, 0), tok("3941:", add_special_tokens=False).input_ids, 4, 1)
    groups = ro.wait([("eval", 0, 0)])
    engine_routing_agrees(model, groups, tok)


def test_vllm_engine_records_routing():
    """--engine vllm on the embedded MoE (CPU): each token's experts, captured in the engine (vLLM 0.32 returns none
    without its model runner V2), pieces joined across the forced interruptions, routed as the trainer routes them;
    groups of n > 1 completions map to their own requests."""
    need_vllm()
    cfg = S.fill_defaults(S.Config(moe=True, engine="vllm", max_new_tokens=8, generations_per_prompt=4))
    model, tok, path = S.load_model(cfg, torch.device("cpu"))
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 128)
    try:
        ro = S.Rollouts(cfg, engine, tok)
        keys = [("eval", 0, i) for i in range(3)]
        for i, p in enumerate(["3941:", "1234:", "777:"]):
            ro.add(keys[i], tok(p, add_special_tokens=False).input_ids, 4, i)
        groups = ro.wait(keys)
        assert sum(engine_routing_agrees(model, [g], tok) for g in groups) > 0  # (interrupted: pieces joined)
        assert engine.routes == {}  # (every request's rows taken)
    finally:
        engine.close()


def test_plan_counts_the_recorded_experts():
    """The memory plan's trainer part: an MoE's recorded experts, int16, layers x k a token of the micro-batch (the
    batch_tensors' "experts" tensor); none for a dense model, whose plan is as before."""
    from test_scalerl import tiny_model
    cfg = S.fill_defaults(S.Config(micro_batch_tokens=1000))
    dense = memory.model_sizes(tiny_model(False).config)
    moe = dict(dense, k=3)
    plain, planned = memory.trainer_plan(dense, cfg, 1, 10, False), memory.trainer_plan(moe, cfg, 1, 10, False)
    assert "routing" not in plain and planned["routing"] == 2 * 1000 * dense["L"] * 3
    others = sum(planned[k] for k in ("weights", "gradients", "adam", "root", "activations", "transient"))
    assert planned["trainer"] == others + planned["routing"] + memory.SMALL_TENSORS  # (in the trainer's total)
