"""Tests of scalerl.py: every recipe component against values computed by hand or by a slow, obviously
correct reference; then the whole loop end to end on the CPU. Run: python -m pytest -q"""
import collections
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pytest
import torch

import generators
import memory
import scalerl as S
from conftest import warm_vllm_model_info

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Keep the embedded model's cache inside pytest's temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def checked(argv=(), module=S):
    """The settings a run of these flags would use, checked (parse_args only parses: setup checks)."""
    return module.config_in_force(module.parse_args(list(argv)))[0]


def small_cfg(tmp_path, **kw):
    base = dict(steps=3, prompts_per_step=8, generations_per_prompt=4, val_size=16, train_size=256,
                eval_every=2, eval_samples=2, out=str(tmp_path / "run"))
    base.update(kw)
    return S.Config(**base)


def tiny_model(tied, vocab=50, dtype=torch.float32, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                       tie_word_embeddings=tied)
    return LlamaForCausalLM(conf).to(dtype)


# ---------------------------------------------------------------------------------------------- losses
@pytest.mark.quick
def test_cispo_loss_and_gradient_by_hand():
    p_train, p_gen, adv, eps_max = [0.5, 0.2, 0.9, 0.3], [0.05, 0.4, 0.1, 0.3], [1.0, -1.0, 2.0, -0.5], 5.0
    logp = torch.tensor([math.log(p) for p in p_train], dtype=torch.float64, requires_grad=True)
    logp_gen = torch.tensor([math.log(p) for p in p_gen], dtype=torch.float64)
    loss = S.cispo_loss(logp, torch.exp(logp - logp_gen), torch.tensor(adv, dtype=torch.float64), eps_max)
    # ratios 10 (truncated to 5), 0.5, 9 (truncated to 5), 1
    w = [min(pt / pg, eps_max) for pt, pg in zip(p_train, p_gen)]
    assert w == [5.0, 0.5, 5.0, 1.0]
    expected = [-wi * a * math.log(pt) for wi, a, pt in zip(w, adv, p_train)]
    assert loss.detach().tolist() == pytest.approx(expected, abs=1e-12)
    loss.sum().backward()
    # the weight is a constant: d loss / d logp = -w * A, and every token, truncated or not, keeps a gradient
    assert logp.grad.tolist() == pytest.approx([-wi * a for wi, a in zip(w, adv)], abs=1e-12)
    assert all(g != 0 for g in logp.grad.tolist())


@pytest.mark.quick
def test_dapo_clipping_by_hand():
    eps_low, eps_high = 0.2, 0.28
    rho = [1.5, 1.5, 0.5, 0.5, 1.1]
    adv = [1.0, -1.0, -1.0, 1.0, 1.0]
    logp_gen = torch.zeros(5, dtype=torch.float64)
    logp = torch.tensor([math.log(r) for r in rho], dtype=torch.float64, requires_grad=True)
    loss = S.clipped_loss(torch.exp(logp - logp_gen), torch.tensor(adv, dtype=torch.float64), eps_low, eps_high)
    # -min(rho*A, clip(rho, 0.8, 1.28)*A) for each token, by hand
    expected = [-1.28, 1.5, 0.8, -0.5, -1.1]
    assert loss.detach().tolist() == pytest.approx(expected, abs=1e-12)
    loss.sum().backward()
    # clipped tokens (1: rho above 1+eps_high with A>0; 3: rho below 1-eps_low with A<0) have no gradient;
    # the others have d(-rho A)/d logp = -rho A
    assert logp.grad.tolist() == pytest.approx([0.0, 1.5, 0.0, -0.5, -1.1], abs=1e-12)


@pytest.mark.quick
def test_policy_loss_reports_truncated_count():
    cfg = S.Config(eps_max=2.0)
    logp = torch.log(torch.tensor([0.9, 0.5, 0.1]))
    logp_gen = torch.log(torch.tensor([0.3, 0.5, 0.1]))  # ratios 3, 1, 1
    _, metrics = S.policy_loss(logp, logp_gen, torch.ones(3), torch.ones(3), torch.tensor([0, 0, 1]), cfg)
    assert {k: (int(t), n) for k, (t, n) in metrics.items()} == {"clip_frac": (1, 3)}  # (total, count): 1 of 3 tokens


@pytest.mark.quick
def test_gspo_ratio_and_loss_by_hand():
    """GSPO: one ratio per completion, the geometric mean of its token ratios, clipped PPO-style in GSPO's narrow
    range; its gradient is s_i * grad log pi for every token of an unclipped completion, none for a clipped one."""
    el, eh = 3e-4, 4e-4
    # completion 0: token ratios e^0.0002 and e^0.0004 -> s = e^0.0003 (inside the range); completion 1: three
    # tokens with ratios e^0.003 each -> s = e^0.003, above 1 + eh (clipped when A > 0); completion 2: s = e^-0.001
    # below 1 - el with A < 0 (clipped); completion 3: the same ratio with A > 0 (not clipped: min picks s A)
    d = [0.0002, 0.0004, 0.003, 0.003, 0.003, -0.001, -0.001]
    seq = torch.tensor([0, 0, 1, 1, 1, 2, 3])
    adv = torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    logp_gen = torch.tensor([-1.0, -2.0, -0.5, -0.7, -0.9, -1.5, -1.5], dtype=torch.float64)
    logp = (logp_gen + torch.tensor(d, dtype=torch.float64)).requires_grad_()
    s = S.gspo_ratio(logp, logp_gen, seq)
    want_s = [math.exp(0.0003)] * 2 + [math.exp(0.003)] * 3 + [math.exp(-0.001)] * 2
    assert s.tolist() == pytest.approx(want_s, rel=1e-12)
    loss = S.clipped_loss(s, adv, el, eh)
    clip = lambda x: min(max(x, 1 - el), 1 + eh)  # noqa: E731
    want = [-min(si * a, clip(si) * a) for si, a in zip(want_s, adv.tolist())]
    assert loss.tolist() == pytest.approx(want, rel=1e-12)
    (loss * torch.tensor([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 1.0, 1.0], dtype=torch.float64)).sum().backward()
    # d/d logp_t of the sample-averaged loss: -A s_i / |y_i| for unclipped completions, 0 for clipped ones
    grad = [-1.0 * want_s[0] / 2] * 2 + [0.0] * 3 + [0.0, -0.5 * want_s[6]]
    assert logp.grad.tolist() == pytest.approx(grad, rel=1e-9, abs=1e-15)
    cfg = S.fill_defaults(S.Config(loss="gspo"))
    assert (cfg.eps_low, cfg.eps_high) == (el, eh)
    total, metrics = S.policy_loss(logp.detach(), logp_gen, adv, torch.ones(7, dtype=torch.float64), seq, cfg)
    assert total.item() == pytest.approx(sum(want)) and metrics["clip_frac"][0] == 4  # completions 1 and 2's tokens



@pytest.mark.quick
@pytest.mark.parametrize("loss", ["dapo", "gspo"])
def test_a_zero_clip_is_a_value_that_reaches_the_loss(loss, tmp_path):
    """--eps-low 0 and --eps-high 0 mean a clip at 1 on that side (unset is the loss's own range, dapo 0.2 / 0.28, gspo
    3e-4 / 4e-4): parsed, filled and recorded as 0, and policy_loss clips at exactly 1. By hand, one-token completions
    (a GSPO ratio is then the token's): rho 1.5 with A = 1 gives -min(1.5, 1) = -1, rho 0.5 with A = -1 gives
    -min(-0.5, -1) = 1, rho 1.2 with A = -1 gives -min(-1.2, -1) = 1.2; the first two clipped."""
    cfg = S.fill_defaults(S.parse_args(["--loss", loss, "--eps-low", "0", "--eps-high", "0"]))
    assert (cfg.eps_low, cfg.eps_high) == (0.0, 0.0)
    assert (S.fill_defaults(S.parse_args(["--loss", loss, "--eps-high", "0"])).eps_low,
            S.fill_defaults(S.parse_args(["--loss", loss])).eps_high) == ((0.2, 0.28) if loss == "dapo" else (3e-4, 4e-4))
    logp = torch.log(torch.tensor([1.5, 0.5, 1.2], dtype=torch.float64))
    total, metrics = S.policy_loss(logp, torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, -1.0, -1.0]),
                                   torch.ones(3), torch.tensor([0, 1, 2]), cfg)
    assert total.item() == pytest.approx(-1 + 1 + 1.2) and metrics["clip_frac"] == (2, 3)
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=1, loss=loss, eps_low=0.0, eps_high=0.0, eval_every=100))
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert (config["eps_low"], config["eps_high"]) == (0.0, 0.0) and len(rows) == 2

# ---------------------------------------------------------------------------------------------- aggregation
def reference_aggregate(token_losses, agg):
    """Slow, literal reading of the paper's three aggregations over nested lists [prompt][sample][token]."""
    if agg == "prompt":
        per_prompt = [sum(sum(s) for s in g) / sum(len(s) for s in g) for g in token_losses]
        return sum(per_prompt) / len(per_prompt)
    if agg == "sample":
        per_sample = [sum(s) / len(s) for g in token_losses for s in g]
        return sum(per_sample) / len(per_sample)
    flat = [t for g in token_losses for s in g for t in s]
    return sum(flat) / len(flat)


@pytest.mark.quick
@pytest.mark.parametrize("agg", ["prompt", "sample", "token"])
def test_aggregations_on_unequal_lengths(agg):
    rng = np.random.default_rng(0)
    lengths = [[1, 5], [2, 2, 9], [3]]
    token_losses = [[rng.normal(size=L).tolist() for L in g] for g in lengths]
    weights = S.completion_weights(lengths, agg)
    got = sum(w * t for gw, gl in zip(weights, token_losses) for w, s in zip(gw, gl) for t in s)
    assert got == pytest.approx(reference_aggregate(token_losses, agg), rel=1e-12)


@pytest.mark.quick
def test_aggregations_differ():
    """completion_weights' three modes really differ on unequal lengths (so the tests above can tell them apart):
    per-token losses 1 on two completions and 0 elsewhere give 1/4, 4/15 and 10/19 (by hand)."""
    losses = [[[1.0] * 1, [0.0] * 5], [[0.0] * 2, [0.0] * 2, [1.0] * 9]]  # lengths [[1, 5], [2, 2, 9]]
    lengths = [[len(t) for t in g] for g in losses]
    got = {agg: sum(w * sum(t) for gw, gl in zip(S.completion_weights(lengths, agg), losses) for w, t in zip(gw, gl))
           for agg in ["prompt", "sample", "token"]}
    # prompt: (1/6 + 9/13) / 2; sample: (1 + 0 + 0 + 0 + 1) / 5; token: 10 / 19
    assert got == pytest.approx({"prompt": (1 / 6 + 9 / 13) / 2, "sample": 2 / 5, "token": 10 / 19}, rel=1e-12)


# ---------------------------------------------------------------------------------------------- truncation
@pytest.mark.quick
def test_truncated_completions_leave_the_batch_by_hand():
    """--mask-truncated (default): a completion that did not end is out of the group mean, the zero-variance test,
    the batch std and the aggregation counts; with --no-mask-truncated it is a failure with reward 0."""
    C = lambda n, finished: S.Completion([5] * n, [-1.0] * n, finished, [1] * n, [0] * n)  # noqa: E731
    groups = [[C(2, True), C(4, True), C(6, False)],    # rewards 1, 0, 0 (truncated)
              [C(3, True), C(3, False), C(5, True)],    # rewards 0, 0 (truncated), 1
              [C(1, True), C(8, False), C(2, False)]]   # rewards 1, and two truncated: one valid, flat
    rewards = np.array([[1.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    prompts = [[1, 10], [1, 11], [1, 12]]
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, 0, S.Config(mask_truncated=True))
    # valid: group 0 -> rewards (1, 0), group 1 -> (0, 1): advantages +-0.5, batch std 0.5; group 2 has one valid
    assert stats == {"zero_variance_frac": pytest.approx(1 / 3), "active_prompts": 2, "truncated_excluded": 4}
    assert [(s.prompt[1], len(s.tokens)) for s in samples] == [(10, 2), (10, 4), (11, 3), (11, 5)]
    assert [s.advantage for s in samples] == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # prompt-level aggregation over the valid tokens only: group 0 has 6, group 1 has 8
    assert [s.weight for s in samples] == pytest.approx([1 / 12, 1 / 12, 1 / 16, 1 / 16])
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, 0, S.Config(mask_truncated=False))
    assert stats == {"zero_variance_frac": 0.0, "active_prompts": 3, "truncated_excluded": 0} and len(samples) == 9
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    np.testing.assert_allclose([s.advantage for s in samples], (centred / (centred.std() + 1e-6)).ravel())
    assert [s.weight for s in samples] == pytest.approx([1 / 36] * 3 + [1 / 33] * 3 + [1 / 33] * 3)
    # without the zero-variance filter, the group with one valid completion enters with advantage 0
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, 0,
                                   S.Config(mask_truncated=True, zero_variance_filter=False))
    assert stats["active_prompts"] == 3 and [s.advantage for s in samples][-1] == 0.0 and len(samples) == 5


@pytest.mark.quick
def test_injected_tokens_count_in_no_normaliser_by_hand():
    """Each aggregation's normaliser counts a completion's sampled tokens, sum(mask), not len(tokens): here 2 of 4
    tokens and 3 of 3 in the first group, 1 of 5 and 2 of 2 in the second (rewards 1/0 in each: both kept)."""
    C = lambda mask: S.Completion([5] * len(mask), [-1.0] * len(mask), True, mask, [0] * len(mask))  # noqa: E731
    groups = [[C([1, 0, 0, 1]), C([1, 1, 1])], [C([1, 0, 0, 0, 0]), C([1, 1])]]
    rewards = np.array([[1.0, 0.0], [0.0, 1.0]])
    want = {"prompt": [1 / (2 * 5)] * 2 + [1 / (2 * 3)] * 2,      # 2 prompts: 5 and 3 sampled tokens
            "sample": [1 / (4 * 2), 1 / (4 * 3), 1 / (4 * 1), 1 / (4 * 2)],  # 4 completions
            "token": [1 / 8] * 4}                                  # 8 sampled tokens in the batch
    for agg, w in want.items():
        samples, _ = S.build_batch([[1], [2]], groups, rewards, rewards, 0, S.Config(loss_agg=agg))
        assert [s.weight for s in samples] == pytest.approx(w, rel=1e-12), agg


@pytest.mark.quick
def test_mask_truncated_default_depends_on_the_model():
    assert S.fill_defaults(S.Config(model="org/name")).mask_truncated is True   # the paper's choice
    assert S.fill_defaults(S.Config()).mask_truncated is False  # the embedded model starts from random weights
    assert S.fill_defaults(S.Config(mask_truncated=True)).mask_truncated is True


@pytest.mark.quick
def test_masked_advantages_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    valid = np.array([[True, True, True, False], [True, True, True, True]])
    # group 0 over its 3 valid: mean 1/3, advantages 2/3, -1/3, -1/3 (and 0 for the excluded one)
    want = np.array([[2 / 3, -1 / 3, -1 / 3, 0], [0.5, 0.5, -0.5, -0.5]])
    np.testing.assert_allclose(S.compute_advantages(rewards, "none", valid), want)
    batch_std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2 + 4 * 0.25) / 7)  # over the 7 valid advantages
    np.testing.assert_allclose(S.compute_advantages(rewards, "batch", valid), want / (batch_std + 1e-6))
    group_std = np.array([[math.sqrt(2 / 9)], [0.5]])
    np.testing.assert_allclose(S.compute_advantages(rewards, "prompt", valid), want / (group_std + 1e-6))
    assert S.zero_variance_keep(np.array([[1.0, 0, 0]]), np.array([[True, False, False]])).tolist() == [False]


@pytest.mark.quick
@pytest.mark.parametrize("adv_norm", ["batch", "prompt", "none"])
@pytest.mark.parametrize("loss_agg", ["prompt", "sample", "token"])
def test_build_batch_uses_the_configured_advantages_and_aggregation(adv_norm, loss_agg):
    """The switches reach the batch: advantages and weights are exactly those of the selected modes."""
    lengths = [[2, 5, 1, 3], [4, 4, 7, 1], [3, 1, 2, 2], [6, 2, 2, 5]]
    groups = [[S.Completion([9] * n, [-1.0] * n, True, [1] * n, [0] * n) for n in g] for g in lengths]
    rewards = np.array([[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]])  # group stds differ; one flat
    samples, _ = S.build_batch([[1, i] for i in range(4)], groups, rewards, rewards, 0, S.Config(adv_norm=adv_norm,
                                                                                     loss_agg=loss_agg))
    kept = [i for i in range(4) if rewards[i].max() > rewards[i].min()]
    adv = S.compute_advantages(rewards[kept], adv_norm)
    weights = S.completion_weights([lengths[i] for i in kept], loss_agg)
    assert [s.advantage for s in samples] == adv.ravel().tolist()
    assert [s.weight for s in samples] == [w for g in weights for w in g]
    others = {m for m in ["batch", "prompt", "none"] if m != adv_norm}
    assert all(not np.allclose(S.compute_advantages(rewards[kept], m), adv) for m in others)


# ---------------------------------------------------------------------------------------------- advantages
@pytest.mark.quick
def test_advantage_normalisations_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    centred = [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]
    assert S.compute_advantages(rewards, "none").tolist() == centred
    batch_std = math.sqrt((4 * 0.25 + 3 * 0.0625 + 0.5625) / 8)  # mean of the 8 advantages is 0
    np.testing.assert_allclose(S.compute_advantages(rewards, "batch"), np.array(centred) / (batch_std + 1e-6))
    group_std = [0.5, math.sqrt(0.1875)]
    np.testing.assert_allclose(S.compute_advantages(rewards, "prompt"),
                               np.array(centred) / (np.array(group_std)[:, None] + 1e-6))


@pytest.mark.quick
def test_zero_variance_filter_drops_exactly_flat_groups():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert S.zero_variance_keep(rewards).tolist() == [False, False, True, True]
    groups = [[S.Completion([5, 2], [-1.0, -1.0], True, [1, 1], [0, 0])] * 3 for _ in range(4)]
    prompts = [[1, 10 + i] for i in range(4)]
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, 0, S.Config())
    assert sorted({tuple(s.prompt) for s in samples}) == [(1, 12), (1, 13)]
    assert stats == {"zero_variance_frac": 0.5, "active_prompts": 2, "truncated_excluded": 0}
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, 0,
                                   S.Config(mask_truncated=True, zero_variance_filter=False))
    assert len(samples) == 12 and stats["active_prompts"] == 4
    # flat groups kept without the filter carry zero advantage
    assert all(s.advantage == 0 for s in samples if s.prompt[1] in (10, 11))


# ---------------------------------------------------------------------------------------------- curriculum
def npr(threshold):
    return S.Config(npr_threshold=threshold)


@pytest.mark.quick
def test_npr_removes_prompt_from_next_epoch_only():
    cur = S.Curriculum(n_prompts=6, seed=3)
    first = S.next_prompts(cur, 4)
    epoch1 = list(cur.order)
    assert first == epoch1[:4] and sorted(epoch1) == list(range(6))
    solved, half = first[0], first[1]
    S.update_curriculum(cur, [solved, half], [0.9, 0.5], npr(0.9))
    assert cur.removed == {solved: "npr"} and cur.history == {solved: [0.9], half: [0.5]}
    S.update_curriculum(cur, [half], [0.25], npr(0.9))  # the history keeps every draw, oldest first
    assert cur.history[half] == [0.5, 0.25] and cur.removed == {solved: "npr"}
    second = S.next_prompts(cur, 4)
    assert second[:2] == epoch1[4:]          # the current epoch finishes as it was drawn
    assert cur.epoch == 2 and solved not in cur.order and sorted(cur.order) == sorted(set(range(6)) - {solved})
    assert second[2:] == cur.order[:2]


@pytest.mark.quick
def test_npr_disabled_at_threshold_one():
    cur = S.Curriculum(n_prompts=3, seed=0)
    S.update_curriculum(cur, [0, 1], [1.0, 1.0], npr(1.0))
    assert cur.removed == {}
    S.update_curriculum(cur, [0, 1, 2], [1.0, 1.0, 1.0], npr(0.9))
    assert S.next_prompts(cur, 2) == []


# ---------------------------------------------------------------------------------------------- FP32 head
@pytest.mark.quick
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_fp32_logprobs_match_float64_reference(tied):
    model = tiny_model(tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    ids = torch.randint(0, 50, (3, 11))
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, 64)
    targets = torch.randint(0, 50, (hidden.shape[0],))
    head = model.get_output_embeddings()
    got = S.token_logprobs(hidden, head, targets, temperature=0.7, fp32=True, chunk=4)["logp"]  # 33 rows, ragged
    ref = torch.log_softmax(hidden.double() @ head.weight.double().T / 0.7, -1).gather(1, targets[:, None])[:, 0]
    assert torch.allclose(got.double(), ref, atol=1e-5)
    # the gradient through the checkpointed chunks equals the float64 reference's
    coef = torch.randn(len(targets), dtype=torch.float64)
    g_got = torch.autograd.grad((got.double() * coef).sum(), head.weight, retain_graph=True)[0]
    g_ref = torch.autograd.grad((ref * coef).sum(), head.weight)[0]
    assert torch.allclose(g_got.double(), g_ref.double(), atol=1e-5)


@pytest.mark.quick
def test_fp32_head_is_more_accurate_than_bf16_head():
    model = tiny_model(False, vocab=500, dtype=torch.bfloat16)
    hidden = torch.randn(64, 64, dtype=torch.bfloat16)
    targets = torch.randint(0, 500, (64,))
    head = model.get_output_embeddings()
    ref = torch.log_softmax(hidden.double() @ head.weight.double().T, -1).gather(1, targets[:, None])[:, 0]
    err32 = (S.token_logprobs(hidden, head, targets, 1.0, fp32=True)["logp"].double() - ref).abs().max().item()
    err16 = (S.token_logprobs(hidden, head, targets, 1.0, fp32=False)["logp"].double() - ref).abs().max().item()
    assert err32 < 1e-5 < err16 and err16 > 100 * err32


def test_the_split_bf16_head_keeps_float32_accuracy_in_logprobs_and_gradients(monkeypatch):
    """--fp32-head-product split, emulated on a CPU (bf16 parts multiplied in float32: exact products, float32 sums):
    on a 150,000-token vocabulary at logits of std 4, token_logprobs' mean |log p - float64's| is at most 3e-5 (the
    H200's split measured 1.3-1.8e-5), over 100 times under the bf16 head's, and not float32's own (the split product
    ran: SplitProduct, its three products); the gradients of h and W within 3e-5 of float64's, relative. Checked by
    dropping a product: the error is then ~5e-3."""
    torch.manual_seed(0)
    V, H, n = 150_000, 256, 32
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, (16 / H) ** 0.5)
    h, y = torch.randn(n, H, requires_grad=True), torch.randint(0, V, (n,))
    hd, wd = h.detach().double().requires_grad_(), head.weight.detach().double().requires_grad_()
    ref = torch.log_softmax(hd @ wd.T, -1).gather(1, y[:, None])[:, 0]
    assert 3.8 < (hd @ wd.T).std().item() < 4.2
    calls, real = [], S.SplitProduct.apply
    monkeypatch.setattr(S.SplitProduct, "apply", lambda *a: calls.append(1) or real(*a))
    got = {mode: S.token_logprobs(h, head, y, 1.0, fp32=mode, chunk=16)["logp"] for mode in ("split", True)}
    got["bf16"] = S.token_terms((h.detach().bfloat16() @ head.weight.detach().bfloat16().T).float(), y)["logp"]
    err = {mode: (lp.double() - ref).abs().mean().item() for mode, lp in got.items()}
    assert len(calls) == 2 and err["split"] <= 3e-5 and err["split"] * 100 < err["bf16"]  # (two chunks of 16 rows)
    assert (got["split"] - got[True]).abs().mean() > 1e-6
    g_ref = torch.autograd.grad(ref.sum(), (hd, wd))
    g_got = torch.autograd.grad(got["split"].sum(), (h, head.weight))
    for a, b in zip(g_got, g_ref):
        assert ((a.double() - b).norm() / b.norm()).item() <= 3e-5


def test_trainer_and_generators_agree_with_the_split_head(default_model, monkeypatch):
    """The split head forced on a CPU: the HF engine's hook and the vLLM engine's head give the sampled tokens the
    log-probs the trainer computes with it, to 1e-6 (both through SplitProduct: counted)."""
    model, tok = default_model
    calls, real = [], S.SplitProduct.apply
    monkeypatch.setattr(S.SplitProduct, "apply", lambda *a: calls.append(a[0].shape) or real(*a))
    cfg = S.fill_defaults(S.Config(fp32_head_product="split", length_control="truncate", max_new_tokens=6))
    prompts = [tok(p).input_ids for p in ("3941:", "27:", "88516:")]
    comps, _ = S.hf_generate(model, tok, prompts, [6] * 3, 1.0, 0, "split")
    engines = [("hf", comps)]
    if importlib.util.find_spec("vllm"):
        need_vllm()
        engine = S.VLLMEngine(dataclasses.replace(cfg, engine="vllm"), S.load_tokenizer(cfg)[2], torch.device("cpu"),
                              torch.float32, 64)
        try:
            engines.append(("vllm", [c for g in S.rollout(S.Rollouts(cfg, engine, tok), prompts, 1, 3) for c in g]))
        finally:
            engine.close()
    n = len(calls)
    for name, cs in engines:
        for p, c in zip(prompts, cs):
            with torch.no_grad():
                now = S.sequence_logprobs(model, [S.Sample(p, c.tokens)], cfg, tok.pad_token_id)["logp"]
            np.testing.assert_allclose(c.logprobs, now.tolist(), atol=1e-6, err_msg=name)
    assert n >= 6 * len(engines) and len(calls) == n + 3 * len(engines)  # generation's steps, then the trainer's


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "cache")
    model, tok, _ = S.load_model(S.Config(), torch.device("cpu"))
    return model, tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_logprobs_equal_trainer_logprobs(default_model, temperature):
    model, tok = default_model
    prompts = [tok("3941:").input_ids] * 5 + [tok("12:").input_ids] * 5
    limits = [6, 2, 6, 3, 6] * 2  # each row is cut at its own limit
    comps, decoded = S.hf_generate(model, tok, prompts, limits, temperature, seed=1, fp32_head="float32")
    samples = [S.Sample(prompt=p, tokens=c.tokens) for p, c in zip(prompts, comps)]
    for c, limit in zip(comps, limits):
        assert c.finished == (c.tokens[-1] == tok.eos_token_id) and (c.finished or len(c.tokens) == limit)
        assert tok.eos_token_id not in c.tokens[:-1] and len(c.tokens) <= limit and c.mask == [1] * len(c.tokens)
    assert sum(len(c.tokens) for c in comps) <= decoded <= 6 * len(prompts)
    with torch.no_grad():
        lp = S.sequence_logprobs(model, samples, S.Config(temperature=temperature), tok.pad_token_id)["logp"]
    gen = torch.tensor([x for c in comps for x in c.logprobs])
    assert lp.shape == gen.shape and torch.allclose(lp, gen, atol=1e-5)


def test_hf_engine_samples_from_the_full_distribution(default_model):
    """No hidden top-k / top-p, and the temperature applied: first-token frequencies follow softmax(logits / T), even
    when the model ships a generation config with other sampling settings (as real models do). The embedded model's
    first-token distribution is nearly flat (T = 1 and T = 1.3 differ by 0.003 at most), so its head is scaled by 4
    here: then a chi-square test of the counts, and the mean logit of the sampled tokens (the statistic that tells
    temperatures apart), both reject sampling at T = 1 by far (chi-square p ~ 1e-10, z ~ 9) and accept T = 1.3."""
    from scipy.stats import chi2
    from transformers import GenerationConfig
    model, tok = default_model
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    prompt = tok("5:").input_ids
    n = 3000
    model.generation_config = GenerationConfig(do_sample=True, top_k=3, top_p=0.5, temperature=0.3,
                                               repetition_penalty=1.5, eos_token_id=2, pad_token_id=0)
    group, _ = S.hf_generate(model, tok, [prompt] * n, [1] * n, 1.3, seed=2, fp32_head="float32")
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / 1.3, -1).numpy()
    first = np.array([c.tokens[0] for c in group])
    counts = np.bincount(first, minlength=len(probs))
    assert n * probs.min() > 5  # every cell of the chi-square test is large enough
    stat = ((counts - n * probs) ** 2 / (n * probs)).sum()
    assert chi2.sf(stat, len(probs) - 1) > 1e-4
    lg = logits.numpy()
    mean, sd = (probs * lg).sum(), math.sqrt((probs * lg ** 2).sum() - (probs * lg).sum() ** 2)
    assert abs(lg[first].mean() - mean) < 4 * sd / math.sqrt(n)
    p1 = torch.softmax(logits, -1).numpy()  # the power of the two tests against T = 1: far beyond their bounds
    assert n * ((p1 - probs) ** 2 / probs).sum() > 60 and ((p1 * lg).sum() - mean) / (sd / math.sqrt(n)) > 7
    assert (counts > 0).sum() == len(probs)  # the tail of the vocabulary is sampled too
    # the recorded log-probs are those of the same distribution (the importance ratio's pi_gen)
    np.testing.assert_allclose([c.logprobs[0] for c in group], np.log(probs[first]), atol=1e-5)


# ---------------------------------------------------------------------------------------------- train step
@pytest.mark.quick
def test_gradient_accumulation_is_exact(default_model, tmp_path):
    """One step with tiny micro-batches gives the same update as one big micro-batch."""
    model, tok = default_model
    rng = np.random.default_rng(0)
    samples = [S.Sample(prompt=tok("1234:").input_ids[: 2 + i % 4], tokens=rng.integers(6, 18, 1 + i % 5).tolist(),
                advantage=float(rng.normal()), weight=0.05) for i in range(10)]
    for s in samples:
        s.gen_logprobs = (-2.0 + 0.1 * rng.normal(size=len(s.tokens))).tolist()
        s.mask = [1] * len(s.tokens)
    deltas = []
    for budget in (10, 10_000):
        m = copy.deepcopy(model)
        before = torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        cfg = S.Config(micro_batch_tokens=budget, grad_clip=1e9)
        S.train_step(m, opt, sched, samples, cfg, tok.pad_token_id)
        deltas.append(torch.nn.utils.parameters_to_vector(m.parameters()).detach() - before)
    assert len(S.micro_batches(samples, 10)) > 3 and len(S.micro_batches(samples, 10_000)) == 1
    assert deltas[0].abs().max() > 0
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6)


def plain_logprobs(model, s):
    """A completion's log-probs from one plain forward pass of prompt + completion (no padding, no chunks), float64."""
    logits = model(torch.tensor([s.prompt + s.tokens])).logits[0].double()
    pos = torch.arange(len(s.prompt) - 1, len(s.prompt) - 1 + len(s.tokens))
    return torch.log_softmax(logits[pos], -1).gather(1, torch.tensor(s.tokens)[:, None])[:, 0]


def hand_gradient(model, samples, eps_max):
    """The CISPO step's gradient by hand: d/d theta of sum over sampled tokens of c_t * log pi(y_t), with the constant
    c_t = -weight * A * min(rho_t, eps_max) worked out here as a number (truncated tokens keep their gradient, scaled
    by eps_max). Returns {name: gradient} (float64) and the number of truncated tokens."""
    model.zero_grad(set_to_none=True)
    total, truncated = 0.0, 0
    for s in samples:
        lp = plain_logprobs(model, s)
        for t, (x, g, m) in enumerate(zip(lp.tolist(), s.gen_logprobs, s.mask)):
            if m:
                rho = math.exp(x - g)
                truncated += rho > eps_max
                total = total + (-s.weight * s.advantage * min(rho, eps_max)) * lp[t]
    total.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, truncated


def off_policy_samples(model, tok, ratios, seed=0):
    """Six completions whose generator log-probs make rho = ratios[t % len(ratios)] at token t (some above eps_max)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(6):
        s = S.Sample(prompt=tok("4712:").input_ids, tokens=rng.integers(6, 30, 4).tolist(), mask=[1, 1, 0, 1],
             advantage=(-1.0) ** i * (1 + 0.1 * i), weight=0.05)
        with torch.no_grad():
            lp = plain_logprobs(model, s).tolist()
        s.gen_logprobs = [x - math.log(ratios[t % len(ratios)]) for t, x in enumerate(lp)]
        samples.append(s)
    return samples


@pytest.mark.quick
def test_cispo_gradient_in_train_step_by_hand(default_model):
    """train_step's CISPO gradient, truncated tokens included, equals the hand gradient: with SGD at lr 1 the weights
    move by minus it. Two of each completion's three sampled tokens have rho = 10 > eps_max = 2 (weight 2, not 0, not
    10, and no gradient through rho); the third rho = 0.5."""
    model, tok = default_model
    m = copy.deepcopy(model)
    samples = off_policy_samples(m, tok, [10.0, 0.5, 1.0, 10.0])  # (token 2 is injected: mask 0)
    want, truncated = hand_gradient(m, samples, eps_max=2.0)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    cfg = S.Config(eps_max=2.0, grad_clip=1e9)
    out = S.train_step(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), samples, cfg, tok.pad_token_id)
    assert truncated == 12 and out["clip_frac"] == pytest.approx(12 / 18)  # tokens 0 and 3 of each completion
    for n, p in m.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()).double(), want[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda e, n=n: f"{n}: {e}")
    assert max(g.abs().max().item() for g in want.values()) > 1e-2
    # a loss that dropped the truncated tokens' gradient (or kept their weight at 10) would move them otherwise
    dropped, _ = hand_gradient(m, [dataclasses.replace(s, mask=[0, 1, 0, 0]) for s in samples], eps_max=2.0)
    assert max((want[n] - dropped[n]).abs().max().item() for n in want) > 1e-3


@pytest.mark.quick
def test_grad_clip_weight_decay_and_adam_eps_reach_adamw_by_hand(default_model):
    """From the flags to the update: --grad-clip scales the gradient to norm 0.05 (the norm before clipping is
    reported), --weight-decay and --adam-eps go into AdamW's first step, worked out by hand:
    p <- p (1 - lr wd) - lr g / (|g| + eps), g the clipped gradient (Adam's bias-corrected moments are g and g^2)."""
    model, tok = default_model
    m = copy.deepcopy(model)
    samples = off_policy_samples(m, tok, [1.0])  # on-policy: rho = 1
    g, _ = hand_gradient(m, samples, eps_max=5.0)
    norm = math.sqrt(sum((x ** 2).sum().item() for x in g.values()))
    cfg = checked(["--grad-clip", "0.05", "--weight-decay", "0.5", "--adam-eps", "1e-4", "--lr", "0.05",
                        "--warmup-steps", "0", "--engine", "hf"])
    opt, sched = S.make_optimizer(m, cfg)
    before = {n: p.detach().double().clone() for n, p in m.named_parameters()}
    out = S.train_step(m, opt, sched, samples, cfg, tok.pad_token_id)
    assert norm > 0.5 and out["grad_norm"] == pytest.approx(norm, rel=1e-4)

    def adamw(clip, wd, eps):
        c = min(1.0, clip / (norm + 1e-6))
        return {n: before[n] * (1 - 0.05 * wd) - 0.05 * c * g[n] / ((c * g[n]).abs() + eps) for n in g}

    want = adamw(0.05, 0.5, 1e-4)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.detach().double(), want[n], rtol=0, atol=2e-6, msg=lambda e, n=n: f"{n}: {e}")
    for other in (adamw(1e9, 0.5, 1e-4), adamw(0.05, 0.01, 1e-4), adamw(0.05, 0.5, 1e-15)):  # each flag matters
        assert max((other[n] - want[n]).abs().max().item() for n in g) > 1e-4


@pytest.mark.quick
def test_fp32_head_in_the_trainer_under_bf16_autocast(default_model):
    """--dtype bfloat16 on CPU (autocast; the weights stay float32): with --lm-head-fp32 the trainer's log-probs are
    the float64 head's on the same hidden states (read off the final norm inside train_step) to 1e-5; without it
    they carry bf16's error (above 1e-4). Measured through train_step's mismatch metric, gen log-probs set to the
    float64 reference."""
    model, tok = default_model
    m = copy.deepcopy(model)
    rng = np.random.default_rng(3)
    prompt = tok("93:").input_ids
    samples = [S.Sample(prompt=prompt, tokens=rng.integers(6, 30, 6).tolist(), mask=[1] * 6, advantage=1.0,
                weight=0.0, gen_logprobs=[0.0] * 6) for _ in range(5)]  # one length: micro-batch order kept
    captured = []
    hook = m.model.norm.register_forward_hook(lambda mod, i, o: captured.append(o.detach()))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mismatch = {}
    try:
        for fp32 in (True, False):
            cfg = S.Config(lm_head_fp32=fp32, temperature=0.8)
            captured.clear()
            S.train_step(m, opt, sched, samples, cfg, tok.pad_token_id, torch.bfloat16)
            (h,) = captured
            logits = h[:, len(prompt) - 1:-1].double() @ m.lm_head.weight.double().T / 0.8
            ref = torch.log_softmax(logits, -1).gather(2, torch.tensor([s.tokens for s in samples])[..., None])
            refs = [dataclasses.replace(s, gen_logprobs=r[:, 0].tolist()) for s, r in zip(samples, ref)]
            mismatch[fp32] = S.train_step(m, opt, sched, refs, cfg, tok.pad_token_id, torch.bfloat16)[
                "mismatch_abs_logprob"]
    finally:
        hook.remove()
    assert mismatch[True] < 1e-5 and mismatch[False] > 1e-4, mismatch  # (measured: 1.4e-7 and 6.5e-4)


def test_dtype_bfloat16_reaches_the_trainer_and_the_hf_engine_in_a_run(tmp_path, monkeypatch):
    """--dtype bfloat16 on CPU in a run: the weights stay float32 (--param-dtype), and every train_step and every
    generate runs under bfloat16 autocast, each with the FP32 head (what they do with them: the tests above)."""
    seen = collections.defaultdict(set)
    real_train, real_generate = S.train_step, S.hf_generate
    monkeypatch.setattr(S, "train_step", lambda *a: seen["train_step"].add((a[6], a[4].lm_head_fp32)) or
                        real_train(*a))
    monkeypatch.setattr(S, "hf_generate", lambda *a: seen["hf_generate"].add((a[7], a[6])) or real_generate(*a))
    rows = S.run(small_cfg(tmp_path, dtype="bfloat16", engine="hf", steps=2, prompts_per_step=4, val_size=8,
                           eval_every=100, zero_variance_filter=False, length_control="truncate"))
    assert seen == {"train_step": {(torch.bfloat16, True)}, "hf_generate": {(torch.bfloat16, "float32")}}
    assert rows[-1]["train_tokens"] > 0
    weights = load_params(S.list_checkpoints(str(tmp_path / "run"))[-1])
    assert {p.dtype for p in weights.values()} == {torch.float32}


@pytest.mark.quick
def test_micro_batches_respect_budget():
    samples = [S.Sample(prompt=[1] * 3, tokens=[2] * L) for L in [1, 7, 2, 9, 4, 4, 30]]
    mbs = S.micro_batches(samples, 24)
    assert sorted(id(s) for mb in mbs for s in mb) == sorted(id(s) for s in samples)
    for mb in mbs:
        width = max(len(s.prompt) + len(s.tokens) for s in mb)
        assert width * len(mb) <= 24 or len(mb) == 1


# ---------------------------------------------------------------------------------------------- task
@pytest.mark.quick
def test_task_is_verifiable_uniform_and_held_out():
    train, val = S.make_task(3000, 500, seed=0)
    assert not {p for p, _, _ in train} & {p for p, _, _ in val}
    for p, a, row in train[:200]:
        assert p.endswith(":") and a == max(p[:-1]) and 3 <= len(p) - 1 <= 7 and row == {"prompt": p, "answer": a}
    for split in (train, val):
        counts = np.unique([a for _, a, _ in split], return_counts=True)[1]
        assert len(counts) == 8 and counts.max() - counts.min() <= 1  # answers 2-9, uniform
        assert S.best_constant_pass_rate([a for _, a, _ in split])[1] <= 1 / 8 + 1 / len(split)
    assert S.reward_last_digit("x7 9", "9") == 1.0
    assert S.reward_last_digit("9</think>", "9") == 0.0  # a digit in the reasoning is not the answer
    assert S.reward_last_digit("", "9") == 0.0


@pytest.mark.parametrize("task", ["hidden", "second"])
def test_the_other_tasks_are_distinct_held_out_uniform_and_verifiable(task):
    train, val = S.make_task(3000, 400, seed=1, task=task)
    assert len({p for p, _, _ in train}) == 3000 and not {p for p, _, _ in train} & {p for p, _, _ in val}
    for split in (train, val):
        counts = np.unique([a for _, a, _ in split], return_counts=True)[1]
        assert len(counts) == 8 and counts.max() - counts.min() <= 1
        assert S.best_constant_pass_rate([a for _, a, _ in split])[1] <= 0.15
    for p, a, _ in train[:300]:
        digits = p[:-1]
        assert p.endswith(":") and 3 <= len(digits) <= 7
        if task == "hidden":  # two digits hidden; the answer is at least every visible digit
            assert digits.count(".") == 2 and int(a) >= max(int(c) for c in digits if c != ".")
        else:  # the second-largest distinct digit
            assert "." not in digits and a == sorted(set(digits))[-2]
    assert S.reward_last_digit("<think>87</think>the answer is 4", "4") == 1.0  # the reward, by hand
    assert S.reward_last_digit("<think>4</think>7", "4") == 0.0


@pytest.mark.quick
def test_hidden_task_ceiling_by_hand():
    # "9..:": the visible 9 is the largest digit: certain. "0..:": the forced largest digit t is hidden, and
    # P(visible 0 | t) is proportional to 2 / (t + 1): the best guess t = 2 is right with (1/3) / sum_t 1/(t+1).
    assert S.hidden_task_ceiling(["9..:"]) == pytest.approx(1.0)
    assert S.hidden_task_ceiling(["0..:"]) == pytest.approx((1 / 3) / sum(1 / (t + 1) for t in range(2, 10)))
    assert S.hidden_task_ceiling(["9..:", "0..:"]) == pytest.approx((1 + 0.23327) / 2, abs=1e-5)
    # "2.2.:": t = 2 (both visible digits may be the forced one, or a hidden one is) against t = 3..9
    like = [2 * (t + 1.0) ** -2 + (2 if t == 2 else 0) * (t + 1.0) ** -1 for t in range(2, 10)]
    assert S.hidden_task_ceiling(["2.2.:"]) == pytest.approx(max(like) / sum(like))
    # with the answers, what the most likely answers score: "9..:" right with 9; "0..:" and "2.2.:" right with 2 only
    assert S.hidden_task_ceiling(["9..:", "0..:", "2.2.:"], ["9", "2", "3"]) == pytest.approx(2 / 3)
    assert S.hidden_task_ceiling(["0..:", "2.2.:"], ["5", "3"]) == 0
    _, val = S.make_task(100, 400, seed=0, task="hidden")
    assert 0.6 < S.hidden_task_ceiling([p for p, _, _ in val]) < 0.9  # below 1, so that the task does not saturate


# ---------------------------------------------------------------------------------------------- live fit
def sigmoid_rows(n, a=0.7, b=2.0, c_mid=0.01, r0=0.05, noise=0.01, seed=0, epoch_len=5):
    rng = np.random.default_rng(seed)
    rows = [{"step": 0, "device_hours": 0.0, "val_pass_rate": r0}]
    for k in range(1, n + 1):
        x = 0.002 * k
        rows.append({"step": k, "device_hours": x, "epoch": 1 + k // epoch_len,
                     "val_pass_rate": float(r0 + (a - r0) / (1 + (c_mid / x) ** b) + noise * rng.normal())})
    return rows


def test_live_fit_is_fit_curves_fit_and_absent_until_supported():
    import fit_curve
    rows = sigmoid_rows(40)
    got = S.live_fit(rows)
    want = fit_curve.fit_rows(rows, x="device_hours", bootstrap=100, seed=0)
    assert got == {"fit_A": want["A"], "fit_B": want["B"], "fit_C_mid": want["C_mid"], "fit_A_ci": list(want["A_ci"])}
    assert abs(got["fit_A"] - 0.7) < 0.03 and got["fit_A_ci"][0] < got["fit_A"] < got["fit_A_ci"][1]
    assert S.live_fit(rows[:4]) == {}  # three points: too few
    assert S.live_fit(sigmoid_rows(12, c_mid=1.0)) == {}  # far from bending: A at the edge of its grid


def test_live_fit_at_the_pass_rates_bound_says_so():
    """A curve that rises to 1 (as the default task can): A ends on the top of its grid, which is the pass rate's own
    bound, not a failed fit: the fields are there, marked, and the progress line shows A -> 1.00. B or C_mid on the
    edge of its grid is a failed fit: nothing."""
    import fit_curve
    rows = sigmoid_rows(40, a=1.0, noise=0.0)
    want = fit_curve.fit_rows(rows, x="device_hours", bootstrap=100, seed=0)
    assert want["at_grid_edge"] == ["A"] and want["A"] > 0.999  # (the premise)
    got = S.live_fit(rows)
    assert got == {"fit_A": want["A"], "fit_B": want["B"], "fit_C_mid": want["C_mid"], "fit_A_ci": list(want["A_ci"]),
                   "fit_A_at_bound": True}
    fields = ["reward_mean", "zero_variance_frac", "npr_removed", "lag_mean", "interrupted_frac", "truncated_frac",
              "mean_completion_tokens", "loss", "grad_norm", "step_seconds", "gen_seconds", "train_seconds",
              "sync_seconds"]
    row = {**rows[-1], **got, **dict.fromkeys(fields, 0.0), "active_prompts": 0, "lag_max": 0}
    assert f"val {rows[-1]['val_pass_rate']:.3f} (A \u2192 1.00) |" in S.progress_line(row, 40)
    assert "fit_A_at_bound" not in S.live_fit(sigmoid_rows(40, a=0.9))
    edge = sigmoid_rows(12, c_mid=1.0)
    assert fit_curve.fit_rows(edge, x="device_hours", bootstrap=0, seed=0)["at_grid_edge"] == ["B"]
    assert S.live_fit(edge) == {}


def test_a_run_that_cannot_learn_says_why(tmp_path, capsys):
    """Ten steps on under half of the prompts, the reward not rising: one line naming the cause and the flag, once;
    not for a run whose reward rises (the default run's first steps) or whose groups are flat because it has solved
    its prompts. The cause in a real run: a random policy that never ends within 2 tokens, truncation masked."""
    cfg = S.Config(prompts_per_step=8, mask_truncated=True, max_new_tokens=16, npr_threshold=0.9)
    base = {"step": 1, "active_prompts": 3, "truncated_frac": 0.1, "reward_mean": 0.3, "npr_removed": 10,
            "pool_size": 90}
    rows = lambda **kw: [{"step": 0}] + [{**base, **kw, "step": k} for k in range(1, 11)]  # noqa: E731
    assert S.stall_reason(rows(), cfg) is None  # neither cause: 3 of 8 active, rewards mixed
    assert S.stall_reason(rows(reward_mean=0.005)[:10], cfg) is None  # nine steps only
    rising = rows(reward_mean=0.0)
    for r in rising[6:]:
        r["reward_mean"] = 0.02  # the default run's first steps: flat groups, but the reward rises
    assert S.stall_reason(rising, cfg) is None
    assert S.stall_reason(rows(active_prompts=4, reward_mean=0.0), cfg) is None  # half of the prompts: not under
    assert S.stall_reason(rows(reward_mean=1.0), cfg) is None  # solved
    cause, why = S.stall_reason(rows(truncated_frac=0.94), cfg)
    assert cause == "truncated" and why.startswith("94% of the completions reach --max-new-tokens 16") \
        and "--no-mask-truncated" in why
    assert S.stall_reason(rows(truncated_frac=0.94), S.Config(prompts_per_step=8, mask_truncated=False)) is None
    assert S.stall_reason(rows(npr_removed=95, pool_size=5), cfg) == (
        "npr", "NPR has removed 95 of the 100 training prompts (--npr-threshold 0.9): add prompts, or raise the "
        "threshold")
    assert S.stall_reason(rows(reward_mean=0.005), cfg)[0] == "flat"
    S.run(small_cfg(tmp_path, engine="hf", steps=10, prompts_per_step=4, generations_per_prompt=4, val_size=4,
                    eval_samples=1, eval_every=100, max_new_tokens=2, length_control="truncate", mask_truncated=True,
                    live_fit=False))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: ")]
    assert len(lines) == 1 and "of the completions reach --max-new-tokens 2" in lines[0], lines


def test_live_fit_in_a_run_matches_its_rows(tmp_path, monkeypatch):
    """The fit logged in a run's rows is fit_curve.py's command-line fit (its file reader and options, bootstrap 100)
    of metrics.jsonl cut at that row: present exactly where that fit is supported (4+ points, no parameter at the edge
    of its grid), equal to it there. The evaluations are replaced by a sigmoid in the step (A = 0.7), so that the
    curve bends within 12 steps and fits are there to compare; the real evaluation is tested elsewhere. The clock
    moves by one second a step and stands still otherwise, so that the compute axis is the step and the fitted A the
    same on any machine (on the real clock a slow step moves the points and the fit: A 0.99 was seen under load)."""
    import fit_curve
    monkeypatch.setattr(S, "evaluate", lambda s, cfg, step: (
        {"val_pass_rate": 0.05 + 0.65 / (1 + (3 / step) ** 2) if step else 0.05}, []))
    clock, real_step = [0.0], S.rl_step
    monkeypatch.setattr(S, "time", types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic))
    monkeypatch.setattr(S, "rl_step", lambda *a: (clock.__setitem__(0, clock[0] + 1), real_step(*a))[1])
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=12, eval_every=1, train_size=32, prompts_per_step=4))
    on_disk = read_metrics(str(tmp_path / "run"))
    keys = {"fit_A", "fit_B", "fit_C_mid", "fit_A_ci"}
    fitted = [k for k, r in enumerate(on_disk) if "fit_A" in r]
    assert len(fitted) >= 4 and on_disk == rows
    for k, r in enumerate(on_disk):
        assert keys <= set(r) or not keys & set(r)  # all or nothing: never NaN, never half a fit
        path = tmp_path / f"upto{k}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in on_disk[:k + 1]))
        try:
            want = fit_curve.analyse_run(str(path), fit_curve.parse_args([str(path), "--bootstrap", "100"]))[0]
        except fit_curve.NotEnoughPoints:
            want = None
        if k in fitted:
            assert {key: r[key] for key in keys} == {"fit_A": want["A"], "fit_B": want["B"],
                                                     "fit_C_mid": want["C_mid"], "fit_A_ci": list(want["A_ci"])}
        else:
            assert want is None or want["at_grid_edge"], k
    assert rows[-1]["fit_A"] == pytest.approx(0.7, abs=1e-3)  # the curve's own A: compute is the step here


def scalerl_runs_in_process(monkeypatch, B):
    """bench.py's scalerl.py commands run by scalerl's main() in this process (a process each costs 5 s of imports);
    any other command as it is."""
    import contextlib
    real_run = subprocess.run

    def scalerl_process(cmd, **kw):
        if cmd[:2] != [sys.executable, B.SCALERL]:
            return real_run(cmd, **kw)
        with contextlib.redirect_stdout(kw["stdout"]), contextlib.redirect_stderr(kw["stdout"]):
            try:
                S.main(cmd[2:])
            except SystemExit as e:
                return subprocess.CompletedProcess(cmd, e.code)
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(B.subprocess, "run", scalerl_process)


def test_loo_runner_writes_fittable_runs_and_resumes(tmp_path, monkeypatch, capsys):
    """bench.py --loo, its main() in this process, and each run it starts is the scalerl.py command it builds, run by
    scalerl's main() in this process too (a process each cost 5 s of imports). The runs' compute axis is wall-clock
    time, which the machine's load changes, and with it every fit (under load a fit to the first part once failed):
    here the runs' clock moves one second a step, so every number in the study is the same on any machine."""
    import bench as B
    clock, real_step = [0.0], S.rl_step
    monkeypatch.setattr(S, "time", types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic))
    monkeypatch.setattr(S, "rl_step", lambda *a: (clock.__setitem__(0, clock[0] + 1), real_step(*a))[1])
    out = tmp_path / "loo"
    study = ["--loo", "--out", str(out), "--seeds", "1", "--variants", "scalerl", "loss-dapo", "--bootstrap", "20"]
    small = ["--", "--engine", "hf", "--task", "hidden", "--train-size", "32", "--prompts-per-step", "8",
             "--generations-per-prompt", "4", "--val-size", "16", "--eval-every", "1", "--eval-samples", "2"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    scalerl_runs_in_process(monkeypatch, B)

    def bench(steps):
        monkeypatch.setattr(sys, "argv", ["bench.py", *study, "--steps", str(steps), *small])
        try:
            B.main()
        except SystemExit as e:
            assert not e.code, capsys.readouterr()
        return types.SimpleNamespace(returncode=0, stdout=capsys.readouterr().out)
    p = bench(10)
    summary = json.load(open(out / "summary.json"))
    assert set(summary["variants"]) == {"scalerl", "loss-dapo"} and len(summary["runs"]) == 2
    for name, r in summary["runs"].items():
        rows = read_metrics(str(out / name))
        assert rows[-1]["step"] == 10 and 0 <= r["A"] <= 1 and r["final_val"] == rows[-1]["val_pass_rate"]
        holds = [row["step"] for k, row in enumerate(rows) if row["step"] and "val_pass_rate" in row
                 and (lambda ci: ci and ci[0] <= r["A"] <= ci[1])(S.live_fit(rows[:k + 1]).get("fit_A_ci"))]
        assert r["live_interval_first_step"] == (holds[0] if holds else None)
    assert json.load(open(out / "loss-dapo" / "seed0" / "config.json"))["loss"] == "dapo"
    import fit_curve
    a = [summary["runs"][f"{v}/seed0"]["A"] for v in ("scalerl", "loss-dapo")]  # B at the pair's mean A
    t = summary["variants"]["loss-dapo"]
    assert t["A_ci_mean"] == summary["runs"]["loss-dapo/seed0"]["A_ci"]  # one seed: its own interval
    assert t["shared_A"] == np.mean(a) and t["B_shared_A"] == fit_curve.fit_rows(
        read_metrics(str(out / "loss-dapo" / "seed0")), bootstrap=0, fixed_a=np.mean(a))["B"]
    # the seed means for the figure: with one seed, that seed's evaluations
    label, x, y = fit_curve.load_points(str(out / "means" / "scalerl.csv"), "device_hours", "val_pass_rate")
    evals = [r for r in read_metrics(str(out / "scalerl" / "seed0")) if "val_pass_rate" in r]
    assert label == "scalerl" and list(y) == [r["val_pass_rate"] for r in evals]
    assert list(x) == [r["device_hours"] for r in evals]
    mtimes = {f: os.path.getmtime(out / f / "seed0" / "metrics.jsonl") for f in ("scalerl", "loss-dapo")}
    study += ["--cuts", "0.6", "0.8"]  # the prediction from each run's first part too
    p = bench(10)  # finished runs are not run again
    assert p.returncode == 0 and p.stdout.count("finished before, skipped") == 2
    assert mtimes == {f: os.path.getmtime(out / f / "seed0" / "metrics.jsonl") for f in mtimes}
    predictions = json.load(open(out / "summary.json"))["predictions"]
    for v in ("scalerl", "loss-dapo"):
        rows = read_metrics(str(out / v / "seed0"))
        x, final = [(r["device_hours"], r["val_pass_rate"]) for r in rows if "val_pass_rate" in r][-1]
        for cut in (0.6, 0.8):  # fitted up to the cut, the curve (written out here) at the last evaluation
            f = fit_curve.fit_rows(rows, bootstrap=0, fit_until=cut * x)
            end = f["R0"] + (f["A"] - f["R0"]) / (1 + (f["C_mid"] / x) ** f["B"])
            t = predictions["table"][f"{v}@{cut:g}"]
            assert t["A"] == [f["A"], 0] and t["max_error"] == [f["extrapolation_max_abs_error"], 0]
            assert t["end_error"][0] == pytest.approx(end - final, abs=1e-12)
    assert "order at cut 0.60: " in p.stdout and (out / "predict-scalerl.png").read_bytes()[:4] == b"\x89PNG"
    del study[-3:]
    study.remove("loss-dapo")  # (a study of scalerl alone: one run to go on with, not two)
    p = bench(12)  # a longer study goes on from each run's last checkpoint
    assert p.returncode == 0 and "skipped" not in p.stdout, p.stdout
    rows = read_metrics(str(out / "scalerl" / "seed0"))
    assert [r["step"] for r in rows] == list(range(13))


# ---------------------------------------------------------------------------------------------- length control
@pytest.mark.quick
def test_next_request_by_hand():
    """Forced interruptions as a state machine: what a completion needs after each piece of generation."""
    END, EOS = [7, 8], 2  # a two-token think_end, to check the subsequence search too
    cfg = S.Config(length_control="interrupt", max_new_tokens=10)
    C = lambda tokens, finished, interrupted=False: S.Completion(tokens, [0.0] * len(tokens), finished,  # noqa
                                                                 [1] * len(tokens), [0] * len(tokens), interrupted)
    cases = [  # (completion so far, its budget, what it needs)
        (C([5, 7, 8], False), 3, "continue"),             # closed its reasoning within the budget: runs on
        (C([5, 5, 7], False), 3, "interrupt"),            # only the start of think_end within the budget
        (C([5, 7, 9, 8, 9, 9], False), 6, "interrupt"),   # never closes it (7 and 8 apart)
        (C([5, 9, EOS], True), 3, "done"),                # ended within the budget
        (C([5, EOS], True), 3, "done"),                   # ended early
        (C([5, 9, 9], False), 3, "interrupt"),            # no thinking format at all, reaches the budget
        (C([5, 7, 8, 9, 9], False), 3, "done"),           # the continuation of a closed reasoning came back
        (C([5, 9, 9, 1, 1, 4], False, True), 3, "done"),  # the answer after an interruption came back
    ]
    for c, budget, want in cases:
        assert S.next_request(c, budget, cfg, END) == want, c.tokens
    for other in ("truncate", "penalty"):  # no interruptions: one request to --max-new-tokens
        assert S.next_request(C([5, 9, 9], False), 3, S.Config(length_control=other), END) == "done"


@pytest.mark.quick
def test_overlong_penalty_at_the_boundaries():
    L, c = 10, 4  # no penalty up to L - c = 6, linear to -1 at L, -1 beyond
    assert [S.overlong_penalty(n, L, c) for n in (1, 6, 7, 8, 10, 11, 50)] == [0, 0, -0.25, -0.5, -1, -1, -1]


@pytest.mark.quick
def test_penalty_is_added_to_correct_answers_only(default_model):
    _, tok = default_model
    cfg = S.Config(length_control="penalty", max_new_tokens=10, max_len=10, cache_len=4)
    eos = tok.eos_token_id
    digits = lambda text: [tok.convert_tokens_to_ids(ch) for ch in text]  # noqa: E731
    C = lambda tokens, finished: S.Completion(tokens, [0.0] * len(tokens), finished, [1] * len(tokens),  # noqa
                                              [0] * len(tokens))
    groups = [[C(digits("7") + [eos], True),            # 2 tokens, right
               C(digits("1111117") + [eos], True),      # 8 tokens, right: -0.5
               C(digits("1111113") + [eos], True),      # 8 tokens, wrong: 0, not -0.5
               C(digits("7"), False)]]                  # cut off: no final answer, 0
    correct, reward, errors = S.score(tok, groups, [("5:", "7", {})], S.Grader(S.reward_last_digit, 0, 1.0), cfg)
    assert correct.tolist() == [[1, 1, 0, 0]] and reward.tolist() == [[1, 0.5, 0, 0]] and errors == []
    hard = S.fill_defaults(S.parse_args(["--length-control", "penalty", "--max-new-tokens", "10", "--max-len", "7",
                                         "--cache-len", "0"]))  # (0 is a value: no soft zone, -1 past L_max)
    assert hard.cache_len == 0 and S.fill_defaults(S.parse_args(["--max-len", "10"])).cache_len == 2
    _, reward, _ = S.score(tok, groups, [("5:", "7", {})], S.Grader(S.reward_last_digit, 0, 1.0), hard)
    assert reward.tolist() == [[1, 0, 0, 0]]  # 2 tokens: no penalty; 8 > L_max 7: -1



@pytest.mark.quick
def test_a_partial_credit_is_reward_not_a_pass(default_model):
    """A shaped reward (half credit for a wrong digit) is what the advantages see, but correct counts full marks only,
    and correct is what the held-out pass rate, NPR and so the fit read: by hand, rewards 1, 0.5, 0.5, 0 and correct
    1, 0, 0, 0, so the pass rate is 1/4 (0.5 were the reward read as correct)."""
    _, tok = default_model
    half = lambda text, answer, row: 1.0 if text[-1:] == answer else 0.5 if text[-1:].isdigit() else 0.0  # noqa
    digits = lambda text: [tok.convert_tokens_to_ids(ch) for ch in text] + [tok.eos_token_id]  # noqa: E731
    groups = [[S.Completion(digits(t), [0.0] * 2, True, [1] * 2, [0] * 2) for t in ("7", "3", "4", "x")]]
    correct, rewards, errors = S.score(tok, groups, [("5:", "7", {})], S.Grader(half, 0, 1.0), S.Config())
    assert rewards.tolist() == [[1, 0.5, 0.5, 0]] and correct.tolist() == [[1, 0, 0, 0]] and errors == []
    assert S.pass_rates(types.SimpleNamespace(val=[("5:", "7", {})]), S.Config(reward="digit"), [0], correct) == {
        "val_pass_rate": 0.25}
    assert S.compute_advantages(rewards, "none").tolist() == [[0.5, 0.0, 0.0, -0.5]]  # (mean 0.5)


@pytest.mark.quick
def test_hack_frac_is_the_share_of_verdicts_with_a_hacks_mark():
    """rollout_metrics' hack_frac: of the completions graded with a verdict (the code reward's), not counting grading
    errors, those whose verdict bears a hack's mark; none where no completion has a verdict (a math or digit run: no
    column), and the progress line shows it where the row has it."""
    C = lambda verdict: S.Completion([5], [0.0], True, [1], [0], verdict=verdict)  # noqa: E731
    groups = [[C("passed"), C("hack: the program ended during its tests (SystemExit)"), C(None),
               C("error: SandboxError: over the wall time")], [C("AssertionError: "), C("hack: x"), C(None), C(None)]]
    zeros = np.zeros((2, 4))
    assert S.rollout_metrics(groups, zeros, zeros)["hack_frac"] == (2, 4)
    assert S.mean_over_ranks(S.rollout_metrics([[C(None)] * 4] * 2, zeros, zeros)) == {"reward_mean": 0.0}
    row = {"step": 3, "reward_mean": 0.0, "zero_variance_frac": 0.0, "active_prompts": 0, "npr_removed": 0,
           "lag_mean": 0.0, "lag_max": 0, "interrupted_frac": 0.0, "truncated_frac": 0.0,
           "mean_completion_tokens": 1.0, "loss": 0.0, "grad_norm": 0.0, "step_seconds": 1.0, "gen_seconds": 0.5,
           "train_seconds": 0.5, "sync_seconds": 0.0}
    assert " | hack " not in S.progress_line(row, 10)
    assert S.progress_line({**row, "hack_frac": 0.5}, 10).startswith("step    3/10 | reward 0.000 | hack 0.50 | ")

@pytest.mark.quick
def test_the_stop_token_is_not_graded_when_the_tokenizer_names_another_eos():
    """SmolLM2's tokenizer converted from GGUF names <|im_start|> as its eos; the model ends at <|im_end|>, an added
    token marked special but not among all_special_ids. That stop token is left out of the text graded (and of the
    completions file): "answer: 5" scores 1 with --reward exact, where "answer: 5<|im_end|>" scored 0."""
    from tokenizers import AddedToken
    tok = S.make_char_tokenizer()
    tok.add_tokens([AddedToken("<|im_end|>", special=True)])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end not in tok.all_special_ids and end in S.special_ids(tok)
    ids = tok("answer: 5", add_special_tokens=False).input_ids
    C = lambda tokens, finished: S.Completion(tokens, [0.0] * len(tokens), finished, [1] * len(tokens),  # noqa
                                              [0] * len(tokens))
    groups = [[C(ids + [end], True), C(ids + [tok.eos_token_id], True), C(ids + [end], False)]]
    correct, _, errors = S.score(tok, groups, [("q", "5", {})], S.Grader(S.reward_exact, 0, 1.0), S.Config())
    assert correct.tolist() == [[1, 1, 0]] and errors == []

def interrupt_cfg(engine, length_control="interrupt"):
    cfg = S.Config(engine=engine, length_control=length_control, max_new_tokens=8, think_budget=(2, 3),
                   answer_budget=3, temperature=1.0, max_lag=0)
    cfg = S.validate(S.fill_defaults(cfg))
    return cfg


def make_engine(kind, cfg, model, tok):
    if kind == "vllm":
        need_vllm()
        return S.VLLMEngine(cfg, S.build_tiny_model(os.environ["XDG_CACHE_HOME"] + "/scalerl", 0, False),
                            torch.device("cpu"), torch.float32, 128)
    return S.HFEngine(model, tok, cfg, None)


@pytest.mark.quick
@pytest.mark.parametrize("text, spaced", [("123", True), ("12 ", False), ("1ok", True)])
def test_the_interruption_phrase_is_a_word_of_its_own(text, spaced, default_model):
    """Forced interruptions [Sec. 4]: after a text that does not end in whitespace the phrase goes in after a space, a
    word of its own ("so the Okay, time is up" would glue it to the last word); after whitespace, as it is."""
    model, tok = default_model
    cfg = dataclasses.replace(interrupt_cfg("hf"), think_budget=(3, 3))  # the whole text is the thinking budget

    class OnePiece:  # every request returns the text's tokens, cut to its limit, not ended
        version, capacity, queue, preemptions = 0, 10, [], 0

        def submit(self, key, ids, n, seed):
            self.queue.append((key, n))

        def step(self):
            ids, (done, self.queue) = tok(text, add_special_tokens=False).input_ids, (self.queue, [])
            return [(k, S.Completion(ids[:n], [-1.0] * len(ids[:n]), False, [1] * len(ids[:n]), [0] * len(ids[:n])))
                    for k, n in done], 0, 1

    ro = S.Rollouts(cfg, OnePiece(), tok)
    ro.add(("t", 0), tok("27:").input_ids, 1, seed=0)
    (g,) = ro.wait([("t", 0)])
    c = g.completions[0]
    want = tok((" " if spaced else "") + cfg.interruption_phrase, add_special_tokens=False).input_ids
    assert c.interrupted and tok.decode(c.tokens[:3]) == text and c.tokens[3:3 + len(want)] == want
    assert c.mask == [1] * 3 + [0] * len(want) + [1] * (len(c.tokens) - 3 - len(want))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_interruptions_with_each_engine(engine, default_model):
    model, tok = default_model
    cfg = interrupt_cfg(engine)
    eng = make_engine(engine, cfg, model, tok)
    prompts = [tok(p).input_ids for p in ["3941:", "27:", "55512:", "8:"]]
    phrase = tok(cfg.interruption_phrase, add_special_tokens=False).input_ids
    spaced = tok(" " + cfg.interruption_phrase, add_special_tokens=False).input_ids
    think_end = tok(cfg.think_end, add_special_tokens=False).input_ids
    assert len(phrase) > 20 and phrase[-1:] == think_end and tok.unk_token_id not in phrase and spaced[1:] == phrase

    def run_groups(c):  # the same requests (same seeds) with each length control
        ro = S.Rollouts(c, eng, tok)
        for i, p in enumerate(prompts):
            ro.add(("t", i), p, 6, seed=100 + i)
        groups = ro.wait([("t", i) for i in range(len(prompts))])
        assert not ro.open and not ro.done and eng.unfinished() == 0
        return groups

    plain = run_groups(interrupt_cfg(engine, "truncate"))  # one piece each, to --max-new-tokens
    n_interrupted = 0
    for g_plain, g in zip(plain, run_groups(cfg)):
        for c0, c, b in zip(g_plain.completions, g.completions, g.budgets):
            assert 2 <= b <= 3 and len(c.versions) == len(c.tokens) == len(c.logprobs) == len(c.mask)
            if not c.interrupted and c.finished and len(c.tokens) <= b:  # ended within its budget: left alone
                n = len(c.tokens)
                assert (c.tokens, c.logprobs, c.mask) == (c0.tokens[:n], c0.logprobs[:n], [1] * n)
                continue
            assert c.tokens[:b] == c0.tokens[:b] and c.logprobs[:b] == c0.logprobs[:b]
            if not c.interrupted:  # closed its reasoning within the budget: continued, no phrase
                assert S.find_subsequence(c.tokens[:b], think_end) is not None and c.mask == [1] * len(c.tokens)
                assert len(c.tokens) <= cfg.max_new_tokens
                continue
            n_interrupted += 1
            assert c.mask.index(0) == b and S.find_subsequence(c.tokens[:b], think_end) is None
            put = phrase if tok.decode(c.tokens[b - 1:b]).endswith(" ") else spaced  # a word of its own
            assert c.tokens[b:b + len(put)] == put and c.mask[b:b + len(put)] == [0] * len(put)
            answer = c.tokens[b + len(put):]
            assert 1 <= len(answer) <= cfg.answer_budget and c.mask[b + len(put):] == [1] * len(answer)
            assert c.finished == (answer[-1] == tok.eos_token_id)
    assert n_interrupted >= 12  # a random policy rarely stops within 3 tokens


def stale_samples(model, tok, seed=0):
    """Completions with generator log-probs from other ("stale") weights: a copy of `model`, perturbed."""
    rng = np.random.default_rng(seed)
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.2 * torch.randn_like(p))
    samples = []
    for i in range(6):
        x = S.Sample(prompt=tok("4712:").input_ids, tokens=rng.integers(6, 30, 3 + i).tolist(), advantage=(-1.0) ** i,
             weight=0.05, mask=[1] * (3 + i))
        with torch.no_grad():
            x.gen_logprobs = S.sequence_logprobs(old, [x], S.Config(), tok.pad_token_id)["logp"].tolist()
        samples.append(x)
    return samples


@pytest.mark.quick
@pytest.mark.parametrize("loss", ["cispo", "dapo", "gspo"])
def test_train_step_uses_the_configured_loss_and_measures_the_mismatch(loss, default_model):
    """With data from stale weights (a positive control), train_step's loss is the selected loss on the trainer's
    log-probs, and the mismatch metrics equal their definitions computed here from the two models."""
    model, tok = default_model
    samples = stale_samples(model, tok)
    cfg = S.fill_defaults(S.Config(loss=loss, eps_max=1.5))
    with torch.no_grad():
        lp = S.sequence_logprobs(model, samples, cfg, tok.pad_token_id)["logp"].double()
    gen = torch.tensor([x for s in samples for x in s.gen_logprobs], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in samples for _ in s.tokens], dtype=torch.float64)
    seq = torch.tensor([k for k, s in enumerate(samples) for _ in s.tokens])
    ratio = (lp - gen).exp()
    want = {"cispo": lambda: S.cispo_loss(lp, ratio, adv, 1.5), "dapo": lambda: S.clipped_loss(ratio, adv, 0.2, 0.28),
            "gspo": lambda: S.clipped_loss(S.gspo_ratio(lp, gen, seq), adv, 3e-4, 4e-4)}[loss]().sum().item() * 0.05
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    out = S.train_step(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), samples, cfg, tok.pad_token_id)
    assert out["loss"] == pytest.approx(want, rel=1e-4)
    d = lp - gen
    assert d.abs().mean().item() > 0.05  # the control is really off-policy
    assert out["mismatch_abs_logprob"] == pytest.approx(d.abs().mean().item(), rel=1e-4)
    assert out["mismatch_kl_k3"] == pytest.approx((d.exp() - 1 - d).mean().item(), rel=1e-4)
    if loss == "cispo":  # clip_frac, CISPO's: the tokens whose ratio is over eps_max (the mismatch's; one name)
        assert out["clip_frac"] == pytest.approx((d > math.log(1.5)).double().mean().item()) and out["clip_frac"] > 0
    assert "mismatch_trunc_frac" not in out
    others = {"cispo": S.clipped_loss(ratio, adv, 0.2, 0.28), "dapo": S.cispo_loss(lp, ratio, adv, 1.5),
              "gspo": S.cispo_loss(lp, ratio, adv, 1.5)}[loss].sum().item() * 0.05
    assert abs(others - want) > 1e-3  # the losses really differ here, so the check above tells them apart


def test_a_run_reads_its_tokenizer_and_config_once(tmp_path, monkeypatch):
    """setup reads --model's tokenizer and config.json once (load_tokenizer), and the trainer's weights load with
    them; a frozen model (the KL fork's reference) would read its own. Before, the trainer's load read both again."""
    calls, real = [], S.load_tokenizer
    monkeypatch.setattr(S, "load_tokenizer", lambda *a, **k: calls.append(a) or real(*a, **k))
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=1, eval_every=100, val_size=4, train_size=16))
    assert len(calls) == 1 and [r["step"] for r in rows] == [0, 1]


@pytest.mark.quick
def test_warmup_is_linear_then_constant(tmp_path):
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=6, warmup_steps=4, lr=1e-3, zero_variance_filter=False,
                           eval_every=100, prompts_per_step=4, val_size=8, length_control="truncate"))
    assert [r["lr"] for r in rows[1:]] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_the_switches_reach_the_components_in_a_run(tmp_path, monkeypatch):
    """A run with --loss dapo --adv-norm prompt --loss-agg token calls exactly those components."""
    seen = collections.Counter()

    def spy(name):
        real = getattr(S, name)

        def wrapped(*a, **kw):
            seen[name, tuple(x for x in a if isinstance(x, str))] += 1
            return real(*a, **kw)
        monkeypatch.setattr(S, name, wrapped)

    for name in ("clipped_loss", "cispo_loss", "compute_advantages", "completion_weights"):
        spy(name)
    S.run(small_cfg(tmp_path, engine="hf", steps=2, loss="dapo", adv_norm="prompt", loss_agg="token",
                    zero_variance_filter=False, eval_every=100))
    assert seen[("clipped_loss", ())] > 0 and not seen[("cispo_loss", ())]
    assert set(k for k in seen if k[0] != "clipped_loss") == {("compute_advantages", ("prompt",)),
                                                           ("completion_weights", ("token",))}


@pytest.mark.quick
def test_loss_ignores_injected_tokens(default_model):
    """Loss and gradient do not depend on the log-probs recorded for injected tokens (mask 0)."""
    model, tok = default_model
    rng = np.random.default_rng(1)
    base = []
    for i in range(6):
        n = 3 + i
        mask = [1] * n
        mask[1:3] = [0, 0]
        base.append(S.Sample(prompt=tok("12:").input_ids, tokens=rng.integers(6, 30, n).tolist(), mask=mask,
                     gen_logprobs=(-3.0 + 0.1 * rng.normal(size=n)).tolist(), advantage=(-1.0) ** i,
                     weight=0.1))
    results = []
    for placeholder in (0.0, 50.0, float("nan")):
        samples = copy.deepcopy(base)
        for s in samples:
            s.gen_logprobs = [x if m else placeholder for x, m in zip(s.gen_logprobs, s.mask)]
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        stats = S.train_step(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), samples, S.Config(),
                             tok.pad_token_id)
        results.append((stats, torch.nn.utils.parameters_to_vector(m.parameters()).detach()))
    (s0, p0), *rest = results
    assert s0["trained_tokens"] == sum(sum(s.mask) for s in base) and math.isfinite(s0["loss"])
    for s, p in rest:
        assert s["loss"] == s0["loss"] and s["trained_tokens"] == s0["trained_tokens"] and torch.equal(p, p0)


# ---------------------------------------------------------------------------------------------- end to end
METRIC_KEYS = ["step", "device_hours", "flops", "gen_tokens", "train_tokens", "reward_mean", "zero_variance_frac",
               "active_prompts", "npr_removed", "truncated_frac", "loss", "grad_norm", "step_seconds",
               "gen_seconds", "train_seconds", "lag_mean", "lag_max", "stale_dropped", "inflight_groups",
               "engine_batch_mean"]


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def rows_written(out):
    """The complete rows in a running run's metrics.jsonl (0 before it exists; a row being written is not counted)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return f.read().count("\n")
    except FileNotFoundError:
        return 0


def test_end_to_end_metrics_and_determinism(tmp_path):
    rows_a = S.run(small_cfg(tmp_path / "a", engine="hf"))
    rows_b = S.run(small_cfg(tmp_path / "b", engine="hf"))
    on_disk = read_metrics(str(tmp_path / "a" / "run"))
    assert on_disk == rows_a and [r["step"] for r in rows_a] == [0, 1, 2, 3]
    assert "val_pass_rate" in rows_a[0] and "val_pass_rate" in rows_a[2] and "val_pass_rate" in rows_a[3]
    assert "val_pass_rate" not in rows_a[1]
    for r in rows_a[1:]:
        assert all(k in r for k in METRIC_KEYS)
    for prev, r in zip(rows_a[1:], rows_a[2:]):
        for k in ["device_hours", "flops", "gen_tokens", "train_tokens"]:
            assert r[k] >= prev[k]
    cfg = json.load(open(tmp_path / "a" / "run" / "config.json"))
    assert cfg["prompts_per_step"] == 8 and cfg["n_params"] > 0
    # 8 prompts x 4 samples of at most 8 sampled tokens per step (interrupted ones: budget + answer budget)
    assert 0 < rows_a[1]["gen_tokens"] <= 8 * 4 * 8
    assert all(0 <= r["interrupted_frac"] <= 1 for r in rows_a[1:]) and rows_a[1]["interrupted_frac"] > 0
    assert untimed(rows_a) == untimed(rows_b)
    assert [os.path.basename(p) for p in S.list_checkpoints(str(tmp_path / "a" / "run"))] == ["step_000003"]


def test_tied_embeddings_train_and_stay_tied(tmp_path):
    s, cfg, book = S.setup(small_cfg(tmp_path, steps=2, tie_word_embeddings=True, engine="hf",
                                     zero_variance_filter=False, warmup_steps=0))
    with book:
        before = s.model.get_input_embeddings().weight.detach().clone()
        result = S.rl_step(s, cfg)
    assert result["update"]["trained_tokens"] > 0 and not result["update"]["skipped"] and s.version == 1
    assert s.model.get_output_embeddings().weight is s.model.get_input_embeddings().weight  # still one tensor
    assert not torch.equal(before, s.model.get_input_embeddings().weight)  # and it was trained


# ---------------------------------------------------------------------------------------------- vLLM engine
def need(module):
    """Tests of an optional package (vllm, wandb) skip where it is not installed, and conftest.py counts them at the
    end of the run; where SCALERL_REQUIRE_VLLM=1 (CI, which installs requirements-cpu.txt, both included) they fail."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("SCALERL_REQUIRE_VLLM") == "1":
            pytest.fail(f"{module} is not installed, and SCALERL_REQUIRE_VLLM=1 requires it")
        pytest.skip(f"{module} is not installed")


def need_vllm():
    need("vllm")
    warm_vllm_model_info()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def vllm_engine(request, tmp_path_factory):
    """A tiny model (untied or tied head) and a vLLM engine made from the same weights, shared by a module."""
    need_vllm()
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "cache")
    cfg = S.Config(tie_word_embeddings=request.param, engine="vllm", length_control="truncate", max_new_tokens=6)
    model, tok, path = S.load_model(cfg, torch.device("cpu"))
    threads = torch.get_num_threads()
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 64)
    assert torch.get_num_threads() == threads  # the trainer, in the same process, keeps its threads
    yield cfg, model, tok, engine
    engine.close()  # (a live engine's vLLM state would meet the next engine this process makes: an MoE's fails)


def engine_logprobs(engine, seq):
    """The engine's log-probs of every token of seq after the first (prompt log-probs, temperature 1)."""
    from vllm import SamplingParams
    assert engine.unfinished() == 0  # LLM.generate would consume the outputs of requests in flight
    out = engine.llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                              detokenize=False), use_tqdm=False)[0]
    return torch.tensor([d[t].logprob for t, d in zip(seq[1:], out.prompt_logprobs[1:])])


def trainer_logprobs(model, seq, pad_id, temperature=1.0):
    with torch.no_grad():
        return S.sequence_logprobs(model, [S.Sample(prompt=seq[:1], tokens=seq[1:])], S.Config(temperature=temperature),
                                   pad_id)["logp"]


def greedy(model, prompt, eos, n):
    """Slow, obvious greedy decoding with the trainer's model: argmax of the full forward pass, token by token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


def test_vllm_push_after_a_training_step(vllm_engine):
    from vllm import SamplingParams
    cfg, model0, tok, engine = vllm_engine
    model = copy.deepcopy(model0)
    seq = tok("5729:").input_ids + [tok.convert_tokens_to_ids(c) for c in "9 71"]
    assert torch.allclose(engine_logprobs(engine, seq), trainer_logprobs(model, seq, tok.pad_token_id), atol=1e-4)
    # one real training step on the engine's own samples
    prompts = [tok("3941:").input_ids, tok("27:").input_ids]
    groups = S.rollout(S.Rollouts(cfg, engine, tok), prompts, 4, seed=0)
    samples = [S.Sample(prompt=p, tokens=c.tokens, gen_logprobs=c.logprobs, mask=c.mask, advantage=(-1.0) ** j,
                weight=0.1) for p, g in zip(prompts, groups) for j, c in enumerate(g)]
    opt, sched = S.make_optimizer(model, S.Config(lr=1e-2, warmup_steps=0))
    S.train_step(model, opt, sched, samples, cfg, tok.pad_token_id)
    want = trainer_logprobs(model, seq, tok.pad_token_id)
    try:
        assert (engine_logprobs(engine, seq) - want).abs().max() > 1e-3  # before the push: the old weights
        engine.push(model, 1)
        assert torch.allclose(engine_logprobs(engine, seq), want, atol=1e-4)
        params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
        for p in prompts + [seq]:
            out = engine.llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == greedy(model, p, tok.eos_token_id, 8)
    finally:
        engine.push(model0, 0)  # leave the shared engine as it was
    assert torch.allclose(engine_logprobs(engine, seq), trainer_logprobs(model0, seq, tok.pad_token_id), atol=1e-4)


def test_vllm_push_reaches_a_tied_head_without_the_fp32_head(tmp_path):
    """--no-lm-head-fp32 on a tied model: vLLM's CPU backend packs the head's weight when it loads, and a push gives a
    tied head no weights of its own (the embedding gets them), so the engine would keep sampling from the initial head
    (the fresh mismatch grew to 3.5e-3 in 3 steps). After a push that moves every weight, the engine's log-probs are
    the trainer's."""
    need_vllm()
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    cfg = S.Config(tie_word_embeddings=True, lm_head_fp32=False, engine="vllm", length_control="truncate",
                   max_new_tokens=6)
    model, tok, path = S.load_model(cfg, torch.device("cpu"))
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 64)
    try:
        seq = tok("5729:").input_ids + [tok.convert_tokens_to_ids(c) for c in "9 71"]
        with torch.no_grad():
            for p in model.parameters():  # (the head among them: it is the embedding)
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        want = trainer_logprobs(model, seq, tok.pad_token_id)
        assert (engine_logprobs(engine, seq) - want).abs().max() > 1e-2  # before the push: the old weights
        engine.push(model, 1)
        torch.testing.assert_close(engine_logprobs(engine, seq), want, atol=1e-4, rtol=0)
    finally:
        engine.close()


def test_each_engine_samples_its_own_random_stream_without_request_seeds(tmp_path):
    """As on CUDA (--no-vllm-request-seeds), where requests carry no seed and vLLM samples from its worker's
    generator, seeded at the engine's start: rank 0's and rank 1's engines (one --seed) sample different completions for the same prompts, and rank 0's
    engine started again samples its own again. (Seeded with --seed alone, every engine drew the same noise.) The
    engines run one after another: in one process they share torch's generator, which each start seeds."""
    need_vllm()
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    cfg = S.Config(engine="vllm", length_control="truncate", max_new_tokens=6, vllm_request_seeds=False)
    _, tok, path = S.load_model(cfg, torch.device("cpu"))
    p = tok("3941:").input_ids
    samples = []
    for place in (0, 1, 0):
        engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 64, place)
        try:
            samples.append([[c.tokens for c in g] for g in S.rollout(S.Rollouts(cfg, engine, tok), [p, p], 8, 5)])
        finally:
            engine.close()
    assert samples[0] == samples[2] and samples[0] != samples[1]
    assert S.vllm_args(cfg, path, torch.device("cpu"), torch.float32, 64, 3)[0]["seed"] == S.step_seed(
        cfg.seed, S.RNG_ENGINE, 3)


@pytest.mark.quick
def test_the_cpu_kv_cache_is_sized_from_the_flags(tmp_path):
    """--vllm-kv-cache-mb 0 (the default): room for every sequence an engine decodes at once at the longest length,
    by hand (1 KiB a token, 100 tokens: one block of 128 each, and vLLM's null block): the pipeline keeps
    (K + 1) P = 3 x 8 groups of G = 4 in flight, 96 sequences, 97 blocks, 12.1 MiB, 13 whole; PPO K P, synchronous P;
    an evaluation's 100 x 2 if more; at most --vllm-max-num-seqs; shared by 2 generators; at most a quarter of the
    memory available. vllm_args gives vLLM that size; a typed size wins."""
    cfg = lambda **kw: S.Config(**{"prompts_per_step": 8, "generations_per_prompt": 4, "max_lag": 2,  # noqa: E731
                                   "eval_samples": 2, **kw})
    size = lambda c, n_val=10, available=2**40: memory.cpu_kv_cache_mb(c, 1024, 100, n_val, available=available)  # noqa: E731
    mb, line = size(cfg())
    mib = lambda seqs: math.ceil((seqs + 1) * 128 * 1024 / 2**20)  # noqa: E731
    assert mb == mib(96) == 13 and "13 MiB, for 96 sequences x 100 tokens x 1.0 KiB;" in line and "quarter" not in line
    assert size(cfg(off_policy="ppo"))[0] == mib(2 * 8 * 4) == 9
    assert size(cfg(max_lag=0))[0] == mib(8 * 4) == 5
    assert size(cfg(max_lag=0), n_val=100)[0] == mib(200) == 26
    assert size(cfg(vllm_max_num_seqs=50))[0] == mib(50) == 7
    assert size(cfg(generators=2))[0] == mib(48) == 7
    assert memory.cpu_kv_cache_mb(cfg(max_lag=0), 1024, 129, 0, available=2**40)[0] == math.ceil((32 * 2 + 1) * 128 / 1024) == 9
    mb, line = size(cfg(), available=16 * 2**20)
    assert mb == 4 and "cut to a quarter of the 0.0 GiB available" in line
    assert size(cfg(generators=2), available=16 * 2**20)[0] == 2  # the quarter split between the 2 engines
    from transformers import LlamaConfig
    path = str(tmp_path / "m")  # (vllm_args reads the model's config only)
    LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(path)
    kv = 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 KV heads of 64 / 4, float32
    assert memory.model_sizes(LlamaConfig.from_pretrained(path))["kv"] * 4 == kv
    want = memory.cpu_kv_cache_mb(cfg(), kv, 64, 0)[0]
    for c, mb in ((cfg(), want), (cfg(vllm_kv_cache_mb=7), 7)):
        assert S.vllm_args(c, path, torch.device("cpu"), torch.float32, 64)[0]["kv_cache_memory_bytes"] == mb * 2**20


def test_the_engine_admits_what_its_kv_cache_holds_at_the_mean_length(tmp_path):
    """Admission from what the KV cache holds: on --long-tail's policy (most completions end after about 10 tokens, 5%
    run to the 256-token limit) with 4 MiB of KV cache, 16 blocks of 128 tokens, vLLM's worst case (every sequence at
    the whole context, 3 blocks) admits 5 sequences, one group of 4 at a time. The engine's capacity, at the running
    mean of the finished sequences' lengths (one block), lets the pipeline's admission keep several groups decoding
    at once; and it never drops below one group, however long the mean."""
    need_vllm()
    import bench
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    bench.long_tail_model(str(tmp_path / "m"))
    cfg = S.fill_defaults(S.Config(model=str(tmp_path / "m"), engine="vllm", length_control="truncate",
                                   max_new_tokens=256, vllm_kv_cache_mb=4, generations_per_prompt=4,
                                   prompts_per_step=4, max_lag=8))
    model, tok, path = S.load_model(cfg, torch.device("cpu"))
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 262)
    try:
        worst = engine.core.vllm_config.cache_config.kv_cache_max_concurrency
        assert (engine.blocks, engine.kv_groups, int(worst)) == (16, [(128, None)], 5)  # (5 - 4) // 4 = 0 while
        # one decodes
        assert engine.capacity == 7  # the guess before any has ended: half the context, 131 tokens, 2 blocks; one
        # of the 16 is vLLM's null block
        rollouts, prompt, most = S.Rollouts(cfg, engine, tok), tok("3941:").input_ids, 0
        for k in range(80):  # admission as next_batch makes it, then an engine step
            n = S.admission(cfg, len(rollouts.open), len(rollouts.done), engine.unfinished(), engine.capacity)
            for _ in range(n):
                rollouts.add(("train", k, _), prompt, 4, k * 100 + _)
            rollouts.poll()
            most = max(most, len(rollouts.open))
        assert engine.seen and engine.mean_len < 128 and engine.capacity == 15 and most >= 3
        engine.mean_len = 10**6  # a mean beyond the cache: still one group
        assert engine.capacity == 4
    finally:
        engine.close()


def test_vllm_samples_differ_within_and_across_prompts(vllm_engine):
    cfg, model, tok, engine = vllm_engine
    p = tok("3941:").input_ids
    g1, g2 = S.rollout(S.Rollouts(cfg, engine, tok), [p, p], 8, seed=5)
    assert len({tuple(c.tokens) for c in g1}) > 1
    assert [c.tokens for c in g1] != [c.tokens for c in g2]  # each prompt gets its own random stream
    again = S.rollout(S.Rollouts(cfg, engine, tok), [p, p], 8, seed=5)
    assert [[c.tokens for c in g] for g in again] == [[c.tokens for c in g1], [c.tokens for c in g2]]
    engine.seeded = False  # as on CUDA: no seed reaches vLLM, which samples from its own generator (not repeatable)
    try:
        unseeded = [[c.tokens for c in S.rollout(S.Rollouts(cfg, engine, tok), [p], 8, seed=5)[0]] for _ in "ab"]
    finally:
        engine.seeded = True
    assert unseeded[0] != unseeded[1]
    for c in g1 + g2:  # the recorded log-probs are the trainer's log-probs of the same tokens (same weights)
        assert c.finished == (c.tokens[-1] == tok.eos_token_id) and c.versions == [engine.version] * len(c.tokens)
        lp = trainer_logprobs(model, p + c.tokens, tok.pad_token_id)[len(p) - 1:]
        assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)


def test_vllm_synchronous_run_is_on_policy_and_reproducible(tmp_path, monkeypatch):
    need_vllm()
    closed, real_close = [], S.VLLMEngine.close  # each run shuts its engine down at its end (CUDA: vLLM's allocator
    monkeypatch.setattr(S.VLLMEngine, "close", lambda self: (closed.append(self), real_close(self)))  # is per process)
    # without the zero-variance filter every step trains (and measures the mismatch on all its tokens)
    rows_a = S.run(small_cfg(tmp_path / "a", engine="vllm", zero_variance_filter=False, max_lag=0))
    assert len(closed) == 1
    rows_b = S.run(small_cfg(tmp_path / "b", engine="vllm", zero_variance_filter=False, max_lag=0))
    assert len(closed) == 2 and closed[0] is not closed[1]
    assert [r.get("reward_mean") for r in rows_a] == [r.get("reward_mean") for r in rows_b]
    assert [r.get("val_pass_rate") for r in rows_a] == [r.get("val_pass_rate") for r in rows_b]
    trained = [r for r in rows_a[1:] if r["active_prompts"] > 0]
    assert len(trained) == 3
    for r in trained:  # FP32 head on both sides, float32, the weights that sampled: importance ratios are 1
        assert r["mismatch_abs_logprob"] < 1e-5 and r["clip_frac"] == 0 and r["sync_seconds"] > 0
        assert r["lag_max"] == 0 and r["inflight_groups"] == 0 and r["stale_dropped"] == 0


@pytest.mark.heavy
def test_vllm_default_run_from_the_command_line_learns_and_its_memory_is_flat(tmp_path):
    """The default run with vLLM from the command line, 40 steps: a quiet first screen, PipelineRL-8, it learns, it is
    off-policy within the bound; and its resident memory (rss_gb) grows by under 64 MB over steps 20-40. The first ~19
    steps fill oneDNN's primitive cache (1024 kernels for the batch shapes met, about 13 MB a step here, then full);
    from step 20 it measured 1250 -> 1254 MB. Without malloc_trim (glibc keeping the memory each step frees) the same
    steps grew by 166-378 MB in four runs. (pytest's shared cache directory: vLLM inspects a model class once per
    cache, ~10 s, in a subprocess.)"""
    need_vllm()
    p = subprocess.run([sys.executable, os.path.join(HERE, "scalerl.py"), "--engine", "vllm", "--steps", "40",
                        "--lr", "2e-3", "--eval-every", "1000", "--out", str(tmp_path / "run")], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr == "" and p.stdout.startswith("scalerl: ")  # a quiet first screen: our lines only
    assert "PipelineRL-8 in one process: generation pauses while the trainer updates" in p.stdout
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == list(range(41))
    cfg = json.load(open(tmp_path / "run" / "config.json"))
    assert (cfg["engine"], cfg["off_policy"], cfg["max_lag"]) == ("vllm", "pipeline", 8)
    assert f"scalerl: vLLM's KV cache: {cfg['vllm_kv_cache_mb']} MiB, for 256 sequences x " in p.stdout  # (saved)
    # it learns: 0.08-0.09 more reward at steps 18-20 than at steps 1-3 (3 seeds), from about 0.01
    assert np.mean([r["reward_mean"] for r in rows[18:21]]) > np.mean([r["reward_mean"] for r in rows[1:4]]) + 0.05
    assert max(r["lag_max"] for r in rows[1:]) >= 1  # really off-policy: updates landed while groups were decoding
    assert any(r["inflight_groups"] > 0 for r in rows[1:]) and all(r["lag_max"] <= 8 for r in rows[1:])
    rss = [r["rss_gb"] * 1024 for r in rows[1:]]  # MB, steps 1-40
    assert len(rss) == 40 and max(rss[19:]) - rss[19] < 64, [round(x) for x in rss]


@pytest.mark.quick
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_trim_memory_reads_the_rss_and_gives_back_what_the_heap_keeps():
    """trim_memory returns the resident memory that /proc/self/status reports (VmRSS), and gives back the pages glibc
    keeps after a free: of 6400 blocks of 64 KB (under glibc's smallest mmap threshold, so in its heap), every other
    one is freed, 200 MB between blocks in use; the heap keeps their pages (a free trims only its top) until
    trim_memory."""
    import ctypes
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    vm_rss = lambda: [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")][0] \
        / 2**20  # noqa: E731 (kB -> GiB)
    assert S.trim_memory() == pytest.approx(vm_rss(), abs=0.01)
    blocks = [libc.malloc(64 * 1024) for _ in range(6400)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)  # resident
    for b in blocks[::2]:
        libc.free(b)
    kept = vm_rss()
    released = kept - S.trim_memory()
    for b in blocks[1::2]:
        libc.free(b)
    assert released > 0.17, (kept, released)  # 0.195 GiB freed, and resident until trimmed


def transformed_logits_model(family, seed=0):
    """A tiny random model of a family whose forward changes the head's logits: Gemma 2 (soft-capping, a tied head
    that vLLM's class has no lm_head for), Cohere (logit_scale, tied), Granite (1 / logits_scaling). The caps and
    scales are far from 1 so that the logits of a random model (about +-1) really change."""
    import transformers
    common = dict(vocab_size=len(S.SPECIALS) + len(S.CHARS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    conf = {"gemma2": lambda: transformers.Gemma2Config(final_logit_softcapping=0.5, sliding_window=256, **common),
            "cohere": lambda: transformers.CohereConfig(logit_scale=4.0, **common),
            "granite": lambda: transformers.GraniteConfig(logits_scaling=0.25, tie_word_embeddings=False, **common)}
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(conf[family]())


@pytest.mark.quick
@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_trainer_logprobs_are_the_models_own_with_soft_capping_and_logit_scaling(family, monkeypatch):
    """The trainer's log-probs (chunked, FP32 head) equal log_softmax(model(...).logits / T) of the model's own forward
    for families that transform their logits after the head; without logit_transform they would not (a positive
    control: the transform matters here)."""
    model = transformed_logits_model(family).eval()
    cfg = S.Config(temperature=0.7, logprob_chunk=5)
    samples = [S.Sample([1, 5, 9, 13], [20, 21, 22, 2]), S.Sample([1, 7], [30, 31, 32, 33, 34])]
    with torch.no_grad():
        got = S.sequence_logprobs(model, samples, cfg, 0)["logp"]
        want = torch.cat([torch.log_softmax(model(torch.tensor([s.prompt + s.tokens])).logits[0].float() / 0.7, -1)[
            len(s.prompt) - 1:-1].gather(1, torch.tensor(s.tokens)[:, None])[:, 0] for s in samples])
        assert (got - want).abs().max() < 1e-5
        monkeypatch.setattr(S, "logit_transform", lambda config: None)
        assert (S.sequence_logprobs(model, samples, cfg, 0)["logp"] - want).abs().max() > 1e-2


def test_gemma2_with_vllm_soft_capping_and_a_tied_head_without_lm_head(tmp_path, monkeypatch):
    """Gemma 2 with the vLLM engine: its tied head is pushed as the embedding (vLLM's class has no lm_head), the FP32
    head is the embedding's float32 copy, and the synchronous loop's log-probs, soft-capped on both sides, are the
    engine's to float rounding after every push of weights that moved (a reward by the parity of the distinct
    characters, every completion graded: groups that are not flat)."""
    need_vllm()
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: float(len(set(text)) % 2 == 0))
    real_score = S.score
    monkeypatch.setattr(S, "score", lambda tok, groups, *a: real_score(
        tok, [[dataclasses.replace(c, finished=True) for c in g] for g in groups], *a))
    path = str(tmp_path / "gemma2")
    S.save_atomically(transformed_logits_model("gemma2"), S.make_char_tokenizer(), path)
    rows = S.run(small_cfg(tmp_path, model=path, engine="vllm", max_lag=0, steps=3, eval_every=100, lr=1e-2,
                           warmup_steps=0, mask_truncated=False, length_control="truncate", max_new_tokens=6))
    assert all(r["mismatch_abs_logprob"] < 1e-5 and r["grad_norm"] > 0 for r in rows[1:])


def moe_model(family, seed=0):
    """A tiny random Mixture-of-Experts that transformers converts on load (its experts fused into 3D tensors in
    memory; Mixtral's block_sparse_moe renamed mlp): a Qwen3-MoE whose experts' width (48, padded to 64 by vLLM's CPU
    kernel) is not the embedded --moe's, and a Mixtral."""
    import transformers
    common = dict(vocab_size=len(S.SPECIALS) + len(S.CHARS), hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2)
    conf = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=6, moe_intermediate_size=48,
                                                             intermediate_size=96, **common),
            "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, intermediate_size=96, **common)}
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(conf[family]())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_pushes_reach_vllm_in_the_checkpoints_layout(tmp_path, family, monkeypatch):
    """An MoE with the vLLM engine, synchronous, every step training on groups that are not flat at a large learning
    rate (every push moves the experts): the engine's log-probs are the trainer's to float rounding on every step, as
    for a dense model. Pushed as the trainer holds them in memory, Mixtral's first push raised (vLLM has no
    'layers.0.mlp') and the Qwen3-MoE's did too (its fused experts read in another layout); pushed in the checkpoint's
    layout but with vLLM's CPU experts not packed again on the reload, the mismatch was 0.03. (The reward: the parity
    of the distinct characters, every completion graded, as in the Gemma 2 test.)"""
    need_vllm()
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: float(len(set(text)) % 2 == 0))
    real_score = S.score
    monkeypatch.setattr(S, "score", lambda tok, groups, *a: real_score(
        tok, [[dataclasses.replace(c, finished=True) for c in g] for g in groups], *a))
    path = str(tmp_path / family)
    S.save_atomically(moe_model(family), S.make_char_tokenizer(), path)
    rows = S.run(small_cfg(tmp_path, model=path, engine="vllm", max_lag=0, steps=3, eval_every=100, lr=1e-2,
                           warmup_steps=0, mask_truncated=False, zero_variance_filter=False, length_control="truncate",
                           max_new_tokens=6))
    assert all(r["mismatch_fresh_abs_logprob"] < 1e-5 and r["grad_norm"] > 0 for r in rows[1:]), [
        (r.get("mismatch_fresh_abs_logprob"), r.get("grad_norm")) for r in rows]


def test_an_architecture_the_trainer_or_vllm_cannot_run_is_refused_by_name(tmp_path, capfd):
    """Before any weight loads (the directories hold none): a model type with no causal-LM class in transformers, and
    an architecture vLLM's registry does not know (with --engine hf the same model goes on to its weights)."""
    need_vllm()
    for name, conf in (("t5", {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}),
                       ("foo", {"model_type": "llama", "architectures": ["FooForCausalLM"], "vocab_size": 80})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(conf))
        S.make_char_tokenizer().save_pretrained(str(d))
    with pytest.raises(S.ScaleRLError, match=r"T5ForConditionalGeneration \(t5\) has no causal-LM class"):
        S.run(small_cfg(tmp_path, model=str(tmp_path / "t5"), engine="hf", out=str(tmp_path / "o1")))
    with pytest.raises(S.ScaleRLError, match=r"vLLM \S+ cannot run its architecture FooForCausalLM"):
        S.run(small_cfg(tmp_path, model=str(tmp_path / "foo"), engine="vllm", out=str(tmp_path / "o2")))
    with pytest.raises(S.ScaleRLError, match="its weights"):  # the hf engine has no registry to ask: on to the weights
        S.run(small_cfg(tmp_path, model=str(tmp_path / "foo"), engine="hf", out=str(tmp_path / "o3")))
    assert not any((tmp_path / o).exists() for o in ("o1", "o2"))


def test_every_vllm_internal_is_named_and_checked_in_the_source_it_was_read_from(tmp_path):
    """vllm_seam.py: each internal of vLLM's that scalerl uses is in the installed vLLM (the version it was read from),
    found in its source without importing it; a wheel is read the same way, and one whose file lacks a method, whose
    class lacks an attribute or a field, or whose function lacks a parameter, is named for each: the check reads what
    it says it reads. (The real wheels' verdicts: docs/engines.md.)"""
    import zipfile
    import vllm_seam
    assert vllm_seam.installed_version() == vllm_seam.TESTED == "0.32.0" and vllm_seam.problems() == []
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    drop = {"v1/core/sched/scheduler.py": ("def _preempt_request(", "def _preempt_request_gone("),
            "outputs.py": ("weight_versions:", "weight_spans:"),
            "inputs/engine.py": ("cache_salt", "salt"),
            "v1/engine/core.py": ("self.scheduler", "self.sched")}
    with zipfile.ZipFile(wheel, "w") as z:
        for rel in {rel for rel, *_ in vllm_seam.INTERNALS}:
            text = vllm_seam.installed_source(rel)
            if rel in drop:
                text = text.replace(*drop[rel])
            if rel != "model_executor/layers/utils.py":  # (a file that is not there at all)
                z.writestr("vllm/" + rel, text)
    assert vllm_seam.problems(vllm_seam.wheel_source(str(wheel))) == [
        ("EngineCore.scheduler", "no attribute scheduler in EngineCore"),
        ("Scheduler._preempt_request", "no method _preempt_request in Scheduler"),
        ("CompletionOutput.weight_versions", "no field weight_versions in CompletionOutput"),
        ("tokens_input", "no parameter cache_salt in tokens_input() in vllm/inputs/engine.py"),
        ("cpu_linear", "vllm/model_executor/layers/utils.py is not there")]
    assert [n for n, _ in vllm_seam.problems(vllm_seam.wheel_source(str(wheel)), when=("moe",))] == []


def test_a_moved_vllm_internal_is_found_at_its_new_place_and_named_there(tmp_path, capsys):
    """vLLM 0.34 dropped the first model runner (vllm/v1/worker/gpu_model_runner.py): its only runner is the second,
    which 0.32 has too (v1/worker/gpu/model_runner.py). A wheel of the installed source without the first runner's
    file is that layout: an MoE's two runner internals are found where MOVED says, none is missing, and --vllm-check
    prints "moved to" that place, exit 0; with ExecuteModelState's input_batch dropped too, the batch is missing, named
    at its first place, exit 1. (The real 0.33 and 0.34 wheels' verdicts: docs/engines.md.)"""
    import zipfile
    import bench
    import vllm_seam
    moved = {"GPUModelRunner.execute_model": "vllm/v1/worker/gpu/model_runner.py, GPUModelRunner.execute_model",
             "GPUModelRunner.input_batch": "vllm/v1/worker/gpu/model_runner.py, "
                                           "GPUModelRunner.execute_model_state.input_batch"}
    assert {n: w for n, _, w in vllm_seam.places() if w} == {}  # (installed: each at its first place)
    files = {rel for rel, *_ in vllm_seam.INTERNALS} - {"v1/worker/gpu_model_runner.py"}
    for name, drop in (("vllm-0.34.0-py3-none-any.whl", None), ("vllm-0.34.1-py3-none-any.whl", "input_batch:")):
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            for rel in files | {"v1/worker/gpu/model_runner.py"}:
                text = vllm_seam.installed_source(rel)
                z.writestr("vllm/" + rel, text.replace(drop, "batch_in:") if drop and "gpu/" in rel else text)
        found = vllm_seam.places(vllm_seam.wheel_source(str(tmp_path / name)))
        status = bench.bench_vllm_check([str(tmp_path / name)])
        table = {ln.split(" | ")[0][3:].split("`")[0]: ln.split(" | ")[-1][:-2] for ln in
                 capsys.readouterr().out.splitlines() if ln.startswith("| `")}
        if drop is None:
            assert {n: w for n, why, w in found if w} == moved and not [n for n, why, _ in found if why]
            assert status == 0 and {n: c for n, c in table.items() if c != "found"} == {
                n: f"moved to {w}" for n, w in moved.items()}
        else:
            gone = "vllm/v1/worker/gpu_model_runner.py is not there"
            assert [(n, why) for n, why, _ in found if why] == [("GPUModelRunner.input_batch", gone)]
            assert status == 1 and table["GPUModelRunner.input_batch"] == gone
            assert table["GPUModelRunner.execute_model"] == f"moved to {moved['GPUModelRunner.execute_model']}"


def test_the_moe_capture_reads_each_steps_requests_from_the_runner_vllm_has():
    """vllm_seam.after_each_step records, after each execute_model, the tokens scheduled per request and the step's
    requests in its batch's order, from the model runner the engine has: the first runner's input_batch (vLLM 0.32's
    on a CPU: test_moe's engine test records through it), or, where the runner has none (MOVED: the second runner,
    0.34's only one), the batch that execute_model keeps in execute_model_state until sample_tokens clears it; a step
    that ran no model leaves none. Here the second runner is vLLM's own class (0.32 has it behind an option) with
    vLLM's ExecuteModelState, and its execute_model does what 0.34's does with the batch: the requests sorted
    (decodes first, then by length), kept, None returned."""
    need_vllm()
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState, GPUModelRunner
    import vllm_seam
    runner = object.__new__(GPUModelRunner)  # (its __init__ needs a device and a model: not run here)
    runner.execute_model_state = None

    def execute_model(scheduled):
        if scheduled.num_scheduled_tokens:  # (no tokens: it returns before any batch is made)
            order = sorted(scheduled.num_scheduled_tokens, key=lambda r: scheduled.num_scheduled_tokens[r])
            runner.execute_model_state = ExecuteModelState(types.SimpleNamespace(req_ids=order),
                                                           *[None] * (len(ExecuteModelState._fields) - 1))
    runner.execute_model, seen = execute_model, []
    vllm_seam.after_each_step(types.SimpleNamespace(model_runner=runner), lambda n, ids: seen.append((n, ids)))
    runner.execute_model(types.SimpleNamespace(num_scheduled_tokens={"0_a-1": 7, "1_a-1": 1, "0_b-2": 3}))
    runner.execute_model_state = None  # (sample_tokens)
    runner.execute_model(types.SimpleNamespace(num_scheduled_tokens={}))
    assert seen == [({"0_a-1": 7, "1_a-1": 1, "0_b-2": 3}, ["1_a-1", "0_b-2", "0_a-1"]), ({}, [])]
    assert not hasattr(runner, "input_batch")


def test_another_vllm_is_one_line_and_a_missing_internal_refused_before_any_weight_loads(tmp_path, monkeypatch, capsys):
    """Another vLLM version than the one scalerl was read against: one line naming both, and the run trains. An
    internal that is missing (here the scheduler's _preempt_request, dropped from the source read): one line naming it
    and the version it was read from, status 1, before any weight loads (load_model is never reached)."""
    need_vllm()
    import vllm
    import vllm_seam
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    rows = S.run(small_cfg(tmp_path, engine="vllm", steps=1, eval_every=100, max_lag=0, zero_variance_filter=False,
                           out=str(tmp_path / "a")))  # (unfiltered: a random policy's flat groups train)
    assert "scalerl: vLLM 0.99.0 is installed; scalerl was read against and tested with 0.32.0" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["train_tokens"] > 0
    real = vllm_seam.installed_source
    monkeypatch.setattr(vllm_seam, "installed_source", lambda rel: real(rel).replace("def _preempt_request(", "def x("))
    monkeypatch.setattr(S, "load_model", lambda *a, **kw: pytest.fail("a weight was loaded"))
    with pytest.raises(S.ScaleRLError, match=r"^vLLM 0.99.0: Scheduler._preempt_request, which scalerl uses \(the "
                                             r"preemptions column\), is missing or has changed: no method "
                                             r"_preempt_request in Scheduler \(read from vLLM 0.32.0") as e:
        S.run(small_cfg(tmp_path, engine="vllm", steps=1, out=str(tmp_path / "b")))
    assert e.value.status == 1


def test_fp32_head_is_checked_at_engine_start_and_pushed_in_float32(default_model, monkeypatch):
    """With --lm-head-fp32 the engine's LM head computes in float32 from the trainer's float32 weights: in a bfloat16
    engine its weight after a push is the trainer's head bit for bit (vLLM's own head would hold it rounded to
    bfloat16), and a vLLM that loses the head_dtype override stops the run with a clear error."""
    need_vllm()
    import vllm
    cfg = S.Config(engine="vllm")
    cfg = S.validate(S.fill_defaults(cfg))
    path = S.build_tiny_model(os.environ["XDG_CACHE_HOME"] + "/scalerl", 0, False)
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.bfloat16, 64)
    assert engine.llm.apply_model(lambda m: str(m.logits_processor.head_dtype))[0] == "torch.float32"
    model = copy.deepcopy(default_model[0])
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.add_(torch.randn_like(head) * 1e-3)  # float32 values that bfloat16 cannot hold
    assert not torch.equal(head.bfloat16().float(), head)
    engine.push(model, 1)
    got = engine.llm.apply_model(lambda m: (m.fp32_head.weight.cpu(), m.lm_head.weight.cpu()))[0]
    assert got[0].dtype == torch.float32 and torch.equal(got[0][:head.shape[0]], head.detach())
    assert got[1].dtype == torch.bfloat16 and not torch.equal(got[1][:head.shape[0]].float(), head.detach())
    # the engine's logits are the float32 product of its hidden states with that weight: its greedy token is the
    # argmax of the trainer's float32 head applied to the engine's own (bfloat16) hidden states
    hidden = engine.llm.apply_model(lambda m: m.logits_processor._apply_head(
        m.lm_head, torch.ones(1, head.shape[1], dtype=torch.bfloat16), None).cpu())[0]
    torch.testing.assert_close(hidden[0, :head.shape[0]], head.detach() @ torch.ones(head.shape[1]), rtol=1e-6,
                               atol=1e-6)
    del engine
    real = vllm.LLM
    monkeypatch.setattr(vllm, "LLM", lambda **kw: real(**{k: v for k, v in kw.items() if k != "hf_overrides"}))
    with pytest.raises(S.ScaleRLError) as e:
        S.VLLMEngine(cfg, path, torch.device("cpu"), torch.bfloat16, 64)
    assert e.value.status == 1 and "computes the LM head's logits in torch.bfloat16, not float32" in str(e.value)


def test_vllm_arguments_pin_the_path_ci_runs_also_on_cuda(vllm_engine, monkeypatch):
    """The engine arguments for a CUDA device, built without starting an engine: no async scheduling (with it, a push
    between two steps would label tokens of the batch still in flight with the new version), Model Runner V1 (vLLM
    would pick V2 wherever Triton imports), the FP32 head override, sleep mode only when nothing is in flight. vLLM
    itself must take them: EngineArgs knows every name, and the runner variable decides the runner even where
    Triton is present (a vLLM upgrade that renames or ignores one fails here)."""
    from vllm.engine.arg_utils import EngineArgs
    cuda, m = torch.device("cuda"), S.load_model(S.Config(), torch.device("cpu"))[2]  # (the engine's model)
    args = lambda cfg, device=cuda: S.vllm_args(cfg, m, device, torch.bfloat16, 64, device_bytes=2**40)  # noqa: E731
    kw, env = args(S.Config())
    assert kw["async_scheduling"] is False and env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                       "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert kw["hf_overrides"] == {"head_dtype": "float32"} and kw["dtype"] == "bfloat16"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["enable_sleep_mode"] is False  # pipeline: in flight
    assert "enforce_eager" not in kw and 0.3 - 1e-6 < kw["gpu_memory_utilization"] < 0.3  # (less the FP32 head)
    assert args(S.Config(max_lag=0))[0]["enable_sleep_mode"] is True
    assert args(S.Config(off_policy="ppo"))[0]["enable_sleep_mode"] is True
    assert "hf_overrides" not in args(S.Config(lm_head_fp32=False))[0]
    cpu_kw = args(S.Config(), torch.device("cpu"))[0]
    assert cpu_kw["async_scheduling"] is False and cpu_kw["enforce_eager"] and "enable_sleep_mode" not in cpu_kw
    for args in (kw, cpu_kw):
        assert EngineArgs(**args).async_scheduling is False  # an unknown name would raise TypeError
    import vllm.config.vllm as vllm_config
    import vllm.envs
    config = vllm_engine[3].core.vllm_config
    assert config.scheduler_config.async_scheduling is False and config.use_v2_model_runner is False
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)  # as on CUDA
    vllm.envs.disable_envs_cache()  # (a started engine caches the environment)
    try:
        assert config.use_v2_model_runner is False
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
        assert config.use_v2_model_runner is True  # without the variable, vLLM would run V2 there
    finally:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        vllm.envs.enable_envs_cache()


def test_vllm_on_a_gpu_other_than_the_first_is_refused_with_the_way_to_choose_it():
    """vLLM's in-process engine runs on the process's first visible GPU whatever --device says: cuda:N with N > 0 is
    refused before anything loads, naming CUDA_VISIBLE_DEVICES (the HF engine can take any GPU)."""
    need_vllm()
    with pytest.raises(S.ScaleRLError, match=r"--device cuda:3: .* CUDA_VISIBLE_DEVICES=3 and --device cuda"):
        checked(["--engine", "vllm", "--device", "cuda:3"])
    for ok in (["--engine", "vllm", "--device", "cuda:0"], ["--engine", "hf", "--device", "cuda:3"]):
        with pytest.raises(S.ScaleRLError, match="CUDA is not available"):  # (this machine has no GPU)
            checked(ok)


@pytest.mark.quick
def test_learning_check_measures_final_and_area_and_judges_paired_differences(tmp_path, capsys):
    """bench.py --learn's arithmetic: the area under the held-out curve by trapezoids (a run stopped early keeps its
    last value to the planned steps), and the paired verdict against a stored reference: a drop on every seed is
    WORSE, differences of both signs are within the noise, a reference made with other flags is not compared."""
    import bench
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"step": 0, "val_pass_rate": 0.0}, {"step": 5}, {"step": 10, "val_pass_rate": 0.5},
            {"step": 20, "val_pass_rate": 1.0}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final, auc = bench.learn_result(str(d), 40)  # (0 + .5) / 2 * 10 + (.5 + 1) / 2 * 10 + 1 * 20 = 30, over 40 steps
    assert final == 1.0 and auc == pytest.approx(30 / 40)
    flags, steps = bench.LEARN_ARMS["max4"]
    ref = {"arms": {"max4": {"flags": flags, "steps": steps, "seeds": {str(s): {"final": 0.7 + 0.05 * s,
                                                                                "auc": 0.4} for s in range(4)}}}}
    path = tmp_path / "reference.json"
    path.write_text(json.dumps(ref))
    worse = {"max4": {str(s): {"final": 0.7 + 0.05 * s - 0.1 - 0.01 * s, "auc": 0.4} for s in range(4)}}
    assert not bench.learn_compare(worse, str(path))
    table = capsys.readouterr().out
    assert "| max4 | final | 0.775 ± 0.065 | 0.660 ± 0.052 | -0.115 [" in table and "WORSE beyond the noise" in table
    assert "| max4 | auc | 0.400 ± 0.000 | 0.400 ± 0.000 | +0.000 [+0.000, +0.000] | 4 | within the noise |" in table
    mixed = {"max4": {str(s): {"final": 0.7 + 0.05 * s + (-0.1, 0.1)[s % 2], "auc": 0.4} for s in range(4)}}
    assert bench.learn_compare(mixed, str(path)) and "WORSE" not in capsys.readouterr().out
    ref["arms"]["max4"]["steps"] = steps + 1
    path.write_text(json.dumps(ref))
    assert bench.learn_compare(worse, str(path)) and "no reference for these flags" in capsys.readouterr().out


def test_learning_check_setting_is_the_one_it_describes(tmp_path):
    """bench.py --learn's "max4" model and data: a 2-layer Llama, hidden 64, 2 heads of 32, untied; prompts "max a b c
    d =" answered by their largest digit, 0-9 each drawn about equally, 2,000 training and 200 held out."""
    import bench
    from transformers import AutoConfig
    bench.learn_setting(str(tmp_path), 0)
    conf = AutoConfig.from_pretrained(str(tmp_path / "model"))
    assert (conf.num_hidden_layers, conf.hidden_size, conf.num_attention_heads, conf.head_dim,
            conf.intermediate_size, conf.tie_word_embeddings) == (2, 64, 2, 32, 256, False)
    for name, n in (("train", 2000), ("val", 200)):
        rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == n
        for r in rows:
            word, *digits, eq = r["prompt"].split(" ")
            assert word == "max" and eq == "=" and len(digits) == 4 and r["answer"] == max(digits)
    counts = collections.Counter(json.loads(x)["answer"] for x in (tmp_path / "train.jsonl").read_text().splitlines())
    assert sorted(counts) == list("0123456789") and max(counts.values()) < 1.3 * 200 and min(counts.values()) > 0.7 * 200
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    ids = tok("max 7 6 3 6 =", add_special_tokens=False).input_ids
    assert len(ids) == 13 and tok.unk_token_id not in ids and tok.decode(ids) == "max 7 6 3 6 ="  # one per character


# ---------------------------------------------------------------------------------------------- a real model (bench.py --real-model)
@pytest.mark.quick
def test_real_model_problems_are_every_sum_once_with_disjoint_held_out_prompts(tmp_path):
    """bench.py --real-model's task: "NAME has A THINGS and gets B more, so how many THINGS does NAME have now?",
    answered by A + B (read back from the sentence here): every A, B in 1..5 once (easy), every two-digit A in 11..59
    with B in 2..9 once (hard); REAL_VAL held out, a quarter of them hard; every other easy problem and a third as many
    hard ones trained on; no prompt in both."""
    import bench
    read = lambda p: [json.loads(x) for x in open(p)]  # noqa: E731
    sentence = r"(\w+) has (\d+) (\w+) and gets (\d) more, so how many (\w+) does (\w+) have now\?"

    def pairs(rows):
        seen = set()
        for r in rows:
            m = re.fullmatch(sentence, r["prompt"])
            assert m and m[1] == m[6] and m[3] == m[5] and r["answer"] == int(m[2]) + int(m[4])
            seen.add((m[1], m[3], int(m[2]), int(m[4])))
        assert len(seen) == len(rows)
        return seen
    easy, hard = pairs(bench.arithmetic_problems()), pairs(bench.carry_problems())
    assert len(easy) == 8 * 8 * 25 and {a for *_, a, _ in easy} == {b for *_, b in easy} == set(range(1, 6))
    assert len(hard) == 8 * 8 * 49 * 8 and {a for *_, a, _ in hard} == set(range(11, 60)) and \
        {b for *_, b in hard} == set(range(2, 10))
    assert bench.arithmetic_problems(seed=1) != bench.arithmetic_problems() and \
        sorted(map(str, bench.arithmetic_problems(seed=1))) == sorted(map(str, bench.arithmetic_problems()))
    train, val = map(read, bench.real_model_data(str(tmp_path)))
    for rows in (train, val):
        assert pairs([r for r in rows if r["kind"] == "easy"]) <= easy
        assert pairs([r for r in rows if r["kind"] == "hard"]) <= hard
    n = bench.REAL_VAL
    assert len(val) == n and sum(r["kind"] == "hard" for r in val) == n // 4
    assert sum(r["kind"] == "easy" for r in train) == 1600 - (n - n // 4)  # every other easy problem
    assert sum(r["kind"] == "hard" for r in train) == (1600 - (n - n // 4)) // 3
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}


def test_the_code_task_holds_out_knob_values_and_every_reference_passes():
    """code_task.py's problems, HumanEval's format: the prompt gives the function's signature and docstring, the tests
    are check(candidate) with the entry point, their expected values the reference's. Every family is held out, and a
    family's held-out problems take first-knob values that none of its trained ones takes (so no prompt and no
    function name is in both), and a set of 16 holds out every category; difficulty from one line to ten. Through REWARDS["code"], as a completion: every
    reference scores 1; returning None scores 0, and the always-equal object 0 with its hack's mark."""
    import code_task
    train, val = code_task.problems()
    assert len(val) == 40 and {r["family"] for r in val} == {f["name"] for f in code_task.FAMILIES}
    held16 = collections.Counter(r["category"] for r in code_task.problems(n_val=16)[1])  # the studies' held-out set
    assert sorted(held16.values()) == [2, 2, 3, 3, 3, 3] and set(held16) == {f["category"] for f in code_task.FAMILIES}
    for fam in code_task.FAMILIES:
        first = next(iter(fam["params"]))
        held = {r["knobs"][first] for r in val if r["family"] == fam["name"]}
        assert held and not held & {r["knobs"][first] for r in train if r["family"] == fam["name"]}
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}
    assert not {r["entry_point"] for r in val} & {r["entry_point"] for r in train}
    assert not [r["entry_point"] for r in train + val if r["knobs"].get("a") == r["knobs"].get("b", 0)]  # two knobs
    lines = [r["canonical_solution"].count("\n") for r in train + val]
    assert min(lines) == 1 and max(lines) >= 10
    for r in val[:2]:  # the format, read back
        sig = re.fullmatch(r"Write a Python function `(\w+)\((.*)\) -> \w+`\. (.+) Reply with one ```python code "
                           r"block\.", r["prompt"])
        assert sig and sig[1] == r["entry_point"] and r["test"].startswith("def check(candidate):\n    assert ")
    grade = lambda body, r: S.grade_one(S.REWARDS["code"], f"```python\n{r['stub']}{body}```", "", r)  # noqa: E731
    eq = "    class E:\n        def __eq__(self, other):\n            return True\n    return E()\n"
    for r in train + val:
        assert grade(r["canonical_solution"], r) == (1.0, "passed", None), r["entry_point"]
        assert grade("    return None\n", r)[0] == 0.0
        reward, verdict, _ = grade(eq, r)  # (its mark where the tests compare with ==; a float's tests subtract)
        assert reward == 0.0 and verdict == ("hack: a call returned an object (E) whose own __eq__ claims the expected"
                                             " value: AssertionError: " if "abs(" not in r["test"] else
                                             "TypeError: unsupported operand type(s) for -: 'E' and 'float'")


@pytest.mark.quick
def test_the_mix_study_holds_out_each_domain_apart(tmp_path):
    """bench.py --real-model --real-task mix: MIX_VAL held-out problems of each domain, the code task's and as many
    sums as code problems trained on (three quarters easy), each sum a chat of its own (REAL_SYSTEM, the "Answer: N"
    instruction) graded by exact, each code row by its tests; no prompt of a domain both held out and trained on.
    --real-task code: the code rows alone, MIX_VAL of them held out from every category."""
    import bench
    import code_task
    read = lambda p: [json.loads(x) for x in open(p)]  # noqa: E731
    train, val = map(read, bench.real_model_data(str(tmp_path / "mix"), "mix"))
    code = lambda rows: [r for r in rows if "test" in r]  # noqa: E731
    sums = lambda rows: [r for r in rows if "test" not in r]  # noqa: E731
    assert len(code(val)) == len(sums(val)) == bench.MIX_VAL and len(sums(train)) == len(code(train)) == 201
    assert sum(r["kind"] == "hard" for r in sums(val)) == bench.MIX_VAL // 4
    assert sum(r["kind"] == "easy" for r in sums(train)) == 201 * 3 // 4
    for r in sums(train + val):
        assert r["reward"] == "exact" and r["prompt"][0] == {"role": "system", "content": bench.REAL_SYSTEM}
        assert r["prompt"][1]["content"].endswith(' End with "Answer: N".')
    key = lambda r: json.dumps(r["prompt"])  # noqa: E731
    assert not {key(r) for r in val} & {key(r) for r in train}
    rows = S.load_rows(str(tmp_path / "mix" / "data" / "val.jsonl"), S.Config())
    assert sorted(reward for *_, reward in rows) == ["code"] * bench.MIX_VAL + ["exact"] * bench.MIX_VAL
    cfg = S.parse_args(bench.real_command("M", str(tmp_path / "mix"), 0, task="mix")[2:])
    tok = S.make_char_tokenizer()
    for r in code(val)[:2] + sums(val)[:2]:  # the study's prompts: the rows' own, nothing appended (no instruction)
        text = r["prompt"] if "test" in r else "\n\n".join(m["content"] for m in r["prompt"])
        assert S.encode_prompt(tok, r["prompt"], cfg) == tok(text).input_ids
    train, val = map(read, bench.real_model_data(str(tmp_path / "code"), "code"))
    assert len(val) == bench.MIX_VAL and len(train) == 201 and all("test" in r for r in train + val)
    # the held-out code set: every category's held-out problems, but for the largest category's, which lose those
    # past MIX_VAL (round-robin over the categories: each of the others runs out before it)
    every = collections.Counter(r["category"] for r in code_task.problems(n_val=10_000)[1])
    largest = max(every, key=every.get)
    assert 0 < sum(every.values()) - bench.MIX_VAL <= every[largest] - every.most_common(2)[1][1]
    every[largest] -= sum(every.values()) - bench.MIX_VAL
    assert collections.Counter(r["kind"] for r in val) == every


@pytest.mark.quick
def test_the_domain_summary_reads_each_domains_curve_by_hand(tmp_path, capsys):
    """bench.py's summary of a code or mix study, on two seeds' made-up rows: each domain's held-out pass rate at step
    0 and at the end, hack_frac's mean over the steps and its largest, the times, and the mean ± sd over seeds; each
    domain's curve fitted (an exact R(C) curve here: its A found), and the sums' again from the first evaluation where
    FORMAT_SHARE of them are answered; the study's 2-core hours; the figure written."""
    import bench
    import fit_curve
    curves = {"val_pass_rate_code": (0.02, 0.4, 1.5, 3e15), "val_pass_rate_exact": (0.1, 0.9, 2.0, 2e15)}
    for seed in (0, 1):
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        rows = []
        for step in range(0, 33):
            x = 1e14 * (step + 1) * (seed + 1)
            row = {"step": step, "flops": x, "gen_seconds": 2.0 + seed, "train_seconds": 1.0,
                   "hack_frac": 0.25 if step == 5 else 0.0}
            if step % 2 == 0:
                row.update({k: float(fit_curve.curve(np.array([x]), *v)[0]) for k, v in curves.items()})
                row["val_pass_rate"] = row["val_pass_rate_code"]
                done = [True, True, step >= 10 + 2 * seed]  # the sums answered: 2 of 3 up to step 8 (seed 1: 10)
                (d / "completions").mkdir(exist_ok=True)
                (d / "completions" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(
                    {"prompt": "p", "answer": 5, "completion": "Answer: 5" if ok else "5", "finished": True,
                     "reward": 1.0}) + "\n" for ok in done) + json.dumps({"prompt": "q", "answer": "", "completion":
                                                                          "", "finished": True, "reward": 0.0}) + "\n")
            rows.append(row if step else {k: v for k, v in row.items() if k not in ("hack_frac", "gen_seconds")})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hours.jsonl").write_text('{"seed": 0, "seconds": 3600, "threads": 1}\n'
                                          '{"seed": 1, "seconds": 1800, "threads": 2}\n')
    args = types.SimpleNamespace(out=str(tmp_path), real_task="mix", seed_list=[0, 1], seeds=2, bootstrap=0)
    lines, fits = bench.domain_summary(args)
    assert "the study's time: 1.00 2-core hours" in capsys.readouterr().out
    after = fits["math, after the format"]  # from the first evaluation with every sum answered: step 10, seed 1: 12
    assert [after[seed]["start"] for seed in (0, 1)] == [1e14 * 11, 1e14 * 13 * 2]
    assert after[0]["A"] == pytest.approx(curves["val_pass_rate_exact"][1], abs=0.02)
    first = [float(v) for v in lines[2].strip("| ").split(" | ")][1:]  # seed 0's row
    want = [curves[c] for c in ("val_pass_rate_code", "val_pass_rate_exact")]
    ends = [float(fit_curve.curve(np.array([x]), *w)[0]) for w in want for x in (1e14, 3.3e15)]  # steps 0 and 32
    assert first[:4] == pytest.approx(ends, abs=6e-4) and first[4:] == [round(0.25 / 32, 3), 0.25, 2.0, 1.0]
    assert lines[-1].startswith("| mean ± sd | ") and "2.5 | 1.0 |" in lines[-1]
    for domain, (_, a, _, _) in zip(("code", "math"), want):
        assert fits[domain][0]["A"] == pytest.approx(a, abs=0.02)
    assert (tmp_path / "real-model.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.quick
def test_the_sums_fit_after_their_format_starts_where_the_share_first_reaches_the_threshold(tmp_path):
    """answered_share: of an evaluation's held-out sums (code rows, whose answer is '', are not sums), the share that
    ended with an answer the grader reads; format_start: the step of the first evaluation whose share reaches the
    threshold (reaching it is enough), or None."""
    import bench
    lines = [dict(answer=5, completion="2 + 3 = 5. Answer: 5", finished=True),
             dict(answer=7, completion="3 + 4 = 8. Answer: 8", finished=True),  # wrong, but answered
             dict(answer=9, completion="4 + 5 = 9", finished=True),  # no answer line
             dict(answer=4, completion="Answer: 4 and on", finished=False),  # did not end
             dict(answer="", completion="Answer: 3", finished=True)]  # a code row, however it reads
    path = tmp_path / "step_000004.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p", "reward": 0.0, **x}) + "\n" for x in lines))
    assert bench.answered_share(str(path)) == 2 / 4
    shares = [(0, 0.2), (4, 0.85), (8, 0.9), (12, 0.95), (16, 0.7)]
    assert bench.format_start(shares, 0.9) == 8 and bench.format_start(shares, 0.8) == 4
    assert bench.format_start(shares, 0.96) is None and bench.format_start(shares[:1], 0.2) == 0


@pytest.mark.quick
def test_the_studys_hours_left_and_spent_by_hand(tmp_path, monkeypatch):
    """study_hours: each seed's steps and evaluations left (every DOMAIN_EVAL steps and step 0's, which a resumed run
    has made) at DOMAIN_COST's one-thread seconds, halved for two runs side by side on 2 cores (--steps: a finished
    seed goes on); spent_hours: what OUT/hours.jsonl records, core-hours halved."""
    import bench
    monkeypatch.setattr(bench, "DOMAIN_COST", {"code": (30.0, 90.0)})
    monkeypatch.setattr(bench, "DOMAIN_STEPS", {"code": 40})
    monkeypatch.setattr(bench, "DOMAIN_EVAL", {"code": 8})
    new = 40 * 30 + 6 * 90  # steps 1..40; evaluations at 0, 8, 16, 24, 32, 40
    resumed = 24 * 30 + 3 * 90  # from the checkpoint of step 16: steps 17..40, evaluations at 24, 32, 40
    assert bench.study_hours("code", [0, 16, 40]) == pytest.approx((new + resumed) / 2 / 3600)
    assert bench.study_hours("code", [40], steps=48) == pytest.approx((8 * 30 + 90) / 2 / 3600)  # --steps 48: on
    assert bench.spent_hours(str(tmp_path / "hours.jsonl")) is None
    (tmp_path / "hours.jsonl").write_text('{"seed": 0, "seconds": 3600, "threads": 1}\n'
                                          '{"seed": 0, "seconds": 900, "threads": 2}\n')
    assert bench.spent_hours(str(tmp_path / "hours.jsonl")) == pytest.approx((3600 + 1800) / 3600 / 2)


@pytest.mark.quick
def test_real_model_table_splits_format_and_arithmetic_by_hand(tmp_path):
    """completion_shares: a pass rate is (answered share) x (right among the answered), an answer being what the grader
    reads (a closed box or an "Answer:" line) in a completion that ended; by kind, the pass rate of each kind's
    prompts. real_table: each seed's first and last evaluation, then mean ± sd over seeds (sd with n - 1), and the
    last evaluation's pass rate by kind where the shares hold one."""
    import bench
    lines = [dict(completion="2 + 3 = 5, so \\boxed{5}", finished=True, reward=1.0),
             dict(completion="The answer is \\boxed{18}.", finished=True, reward=0.0),
             dict(completion="He has 7 + 1 = 8 pens now.", finished=True, reward=0.0),
             dict(completion="so \\boxed{5", finished=True, reward=0.0),  # the box not closed: no answer
             dict(completion="\\boxed{4} and on and on", finished=False, reward=0.0)]  # did not end: ungraded
    lines.append(dict(completion="4 + 4 = 8. Answer: 8", finished=True, reward=1.0))  # an answer line counts too
    for k, line in enumerate(lines):
        line["prompt"] = f"p{k % 3}"
    path = tmp_path / "step_000000.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert bench.completion_shares(str(path)) == (2 / 6, 3 / 6, 2 / 3)
    kinds = {"p0": "easy", "p1": "hard", "p2": "hard"}  # rewards by prompt: p0 1, 0; p1 0, 0; p2 0, 1
    assert bench.completion_shares(str(path), kinds) == (2 / 6, 3 / 6, 2 / 3, {"easy": 1 / 2, "hard": 1 / 4})
    rows = lambda g, t: [{"step": 0, "val_pass_rate": 0.1}, {"step": 1, "gen_seconds": g, "train_seconds": t},  # noqa
                         {"step": 2, "gen_seconds": g + 2, "train_seconds": t + 2, "val_pass_rate": 0.3}]
    runs = {0: (rows(10, 20), {0: (0.1, 0.2, 0.5), 2: (0.3, 0.6, 0.5)}),
            1: (rows(20, 30), {0: (0.2, 0.4, 0.5), 2: (0.5, 0.5, 1.0)})}
    table = bench.real_table(runs)
    assert table[2] == "| 0 | 0.100 | 0.300 | 0.200 | 0.600 | 0.500 | 0.500 | 11.0 | 21.0 |"
    assert table[3] == "| 1 | 0.200 | 0.500 | 0.400 | 0.500 | 0.500 | 1.000 | 21.0 | 31.0 |"
    sd = lambda a, b: abs(a - b) / math.sqrt(2)  # noqa: E731  (two values: the sample sd)
    assert table[4] == (f"| mean ± sd | 0.150 ± {sd(.1, .2):.3f} | 0.400 ± {sd(.3, .5):.3f} | 0.300 ± {sd(.2, .4):.3f} | "
                        f"0.550 ± {sd(.6, .5):.3f} | 0.500 ± 0.000 | 0.750 ± {sd(.5, 1):.3f} | 16.0 | 26.0 |")
    for seed, by in ((0, {"easy": 0.5, "hard": 0.25}), (1, {"easy": 0.7, "hard": 0.05})):
        runs[seed][1][2] = (*runs[seed][1][2], by)
    table = bench.real_table(runs)
    assert table[0].endswith("| easy, last | hard, last | generation s/step | training s/step |")
    assert table[2] == "| 0 | 0.100 | 0.300 | 0.200 | 0.600 | 0.500 | 0.500 | 0.500 | 0.250 | 11.0 | 21.0 |"
    assert table[4].endswith(f"| 0.600 ± {sd(.5, .7):.3f} | 0.150 ± {sd(.25, .05):.3f} | 16.0 | 26.0 |")


@pytest.mark.heavy
def test_real_model_study_runs_resumes_and_summarises_with_a_tiny_model(tmp_path, monkeypatch, capsys):
    """bench.py --real-model end to end on the embedded tiny model (random weights, character tokenizer, the hf
    engine, sampling near uniform at temperature 100 so that a fair share of completions end, and a reward that scores
    half of those: the text's length is even), its runs made by scalerl's main() in this process:
    each evaluation's completions file holds what the run scored (its mean is the row's held-out pass rate, each
    reward the reward function's on the text), the table is real_table of those files (with the pass rate of each kind
    of problem), each seed's held-out curve is fitted from its evaluations, its end predicted from the first half
    (and, with too few points in the first third, no prediction from it), and a rerun skips finished seeds."""
    import bench as B
    import fit_curve
    model = S.build_tiny_model(str(tmp_path / "models"), 0, False)
    parity = lambda text, answer, row=None: float(len(text) % 2 == 0)  # noqa: E731
    monkeypatch.setitem(S.REWARDS, "parity", parity)
    monkeypatch.setattr(B, "REAL_FLAGS", ["--engine", "hf", "--reward", "parity", "--reward-workers", "0",
                                          "--temperature", "100", "--prompts-per-step", "4",
                                          "--generations-per-prompt", "4", "--max-new-tokens", "16", "--eval-every",
                                          "1", "--eval-samples", "2", "--save-completions"])
    monkeypatch.setattr(B, "REAL_STEPS", 10)
    monkeypatch.setattr(B, "REAL_VAL", 16)
    scalerl_runs_in_process(monkeypatch, B)
    out = tmp_path / "real"

    def bench():
        monkeypatch.setattr(sys, "argv", ["bench.py", "--real-model", model, "--out", str(out), "--seeds", "2",
                                          "--bootstrap", "0"])
        B.main()
        return capsys.readouterr().out
    text = bench()
    runs = {}
    for seed in (0, 1):
        d = out / f"seed{seed}"
        rows = read_metrics(str(d))
        assert [r["step"] for r in rows] == list(range(11)) and json.load(open(d / "config.json"))["seed"] == seed
        files = sorted(os.listdir(d / "completions"))
        assert files == [f"step_{s:06d}.jsonl" for s in range(11)]
        for f, row in zip(files, rows):
            lines = [json.loads(x) for x in open(d / "completions" / f)]
            assert len(lines) == 16 * 2
            assert sum(x["reward"] for x in lines) / len(lines) == row["val_pass_rate"]
            assert [x["reward"] for x in lines] == [parity(x["completion"], x["answer"]) if x["finished"] else 0.0
                                                    for x in lines]
        kinds = {r["prompt"]: r["kind"] for r in map(json.loads, open(out / "data" / "val.jsonl"))}
        runs[seed] = rows, {s: B.completion_shares(str(d / "completions" / f"step_{s:06d}.jsonl"), kinds)
                            for s in (0, 10)}
    assert any(r["val_pass_rate"] for rows, _ in runs.values() for r in rows)  # (the test would be empty otherwise)
    table = B.real_table(runs)
    assert "\n".join(table) in text and "| easy, last | hard, last |" in table[0]
    summary, seen = json.load(open(out / "summary.json")), set()
    assert summary["table"] == table
    for seed, (rows, _) in runs.items():
        got, x = summary["fits"][str(seed)], [r["flops"] for r in rows]
        fit = fit_curve.fit_rows(rows, x="flops", bootstrap=0)  # every row is an evaluation here; R0: step 0's
        assert (got["A"], got["B"], got["C_mid"]) == (fit["A"], fit["B"], fit["C_mid"])
        assert got["R0"] == rows[0]["val_pass_rate"]
        assert got["final"] == rows[-1]["val_pass_rate"] and got["x_end"] == x[-1]
        for cut in B.REAL_CUTS:  # the evaluations up to the cut, fitted alone: 4 usable points or no prediction
            part = [r for r in rows if r["flops"] <= cut * x[-1]]
            predicted = got["predicted"][f"{cut:g}"]
            if sum(r["flops"] > 0 for r in part) < 4:
                assert predicted is None and f"{cut:g}" not in got["cut_fits"]
                seen.add(None)
                continue
            h = fit_curve.fit_rows(part, x="flops", bootstrap=0, exclude_below=0.015 * part[-1]["flops"])
            assert predicted == pytest.approx(fit_curve.curve(x[-1], h["R0"], h["A"], h["B"], h["C_mid"]))
            assert got["cut_fits"][f"{cut:g}"] == pytest.approx({k: h[k] for k in ("R0", "A", "B", "C_mid")})  # (drawn)
            seen.add(cut)
    assert seen == {None, 0.5}  # both branches met (the first third of these runs is too short to fit)
    assert "too few points" in text and "fitted on the first 50%: error at the end" in text
    assert (out / "real-model.png").read_bytes()[:4] == b"\x89PNG"
    mtime = os.path.getmtime(out / "seed0" / "metrics.jsonl")
    assert bench().count("finished before, skipped") == 2 and os.path.getmtime(out / "seed0" / "metrics.jsonl") == mtime


@pytest.mark.heavy
def test_gpu_check_runs_on_a_cpu_what_a_cpu_can(capsys, monkeypatch):
    """bench.py --gpu-check, the CPU's part. Through the table, each check in a process of its own as on a GPU machine:
    the engine lands on the chosen device, and the CUDA-only checks say they were skipped rather than passing. In this
    process: a completion's versions split exactly at the push. (The mismatch check measures what
    test_vllm_synchronous_run_is_on_policy_and_reproducible bounds.)"""
    need_vllm()
    import bench
    names = list(bench.GPU_CHECKS)
    rows = bench.gpu_check("cpu", only=[names[2], names[7]])
    assert [(name, result) for name, result, _ in rows] == [(names[2], "skipped"), (names[7], "skipped")], rows
    assert "needs CUDA" in rows[0][2] and "needs 2 GPUs" in rows[1][2]
    ok, measured = bench.check_engine_device("cpu")  # (in this process: a vLLM import and start less)
    assert ok and measured.startswith("weights on cpu (want cpu), CPUModelRunner, async scheduling False, CUDA graphs "
                                      "NONE;"), measured
    assert capsys.readouterr().out.count("skipped") == 2
    real_submit = S.VLLMEngine.submit  # the first seed's completion ends after 3 tokens, before the push: the check
    monkeypatch.setattr(S.VLLMEngine, "submit",  # tries the next seed and asserts on that one's
                        lambda self, key, ids, n, **kw: real_submit(self, key, ids, 3 if key == "1" else n, **kw))
    ok, measured = bench.check_two_versions("cpu")
    assert ok and measured.startswith("versions [1, 1, 1, 1, 1, 2, 2") and "(seed 2)" in measured
    ok, measured = bench.check_mismatch("cpu")  # the paired arms (a CPU seeds every request anyway): float32 rounding
    assert ok is True and "off / on" in measured and "paired: same prompts and request seeds" in measured, measured


@pytest.mark.heavy
def test_the_gpu_checks_torchrun_row_runs_on_a_cpu(tmp_path, monkeypatch):
    """bench.py --gpu-check's torchrun row, on 2 gloo ranks with a fresh cache: each rank's engine on its device, the
    model loaded before the process group (RANK_ENGINE, as setup: the embedded model is built by every rank before
    save_pretrained would write on rank 0 only); a --model run, activation checkpointing under FSDP2, saved at step 2,
    resumed from there into a branch that writes the unbroken run's rows."""
    need_vllm()
    import bench
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    warm_vllm_model_info()  # (vLLM's cache of model classes, not the model: no rank inspects them in a subprocess)
    ok, measured = bench.check_torchrun("cpu")
    assert ok is True and measured.startswith("engines on cpu; 2 ranks, --model with activation checkpointing True"
                                              ", 4 steps, resumed from step 2") and "rows equal" in measured, measured


class FakeLLM:
    """Records the calls a VLLMEngine makes to vllm.LLM in sleep mode, and the weights each reload receives."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, {n: t.clone() for n, t in kwargs["weights_iterator"]}))

    def apply_model(self, fn):
        self.calls.append(("apply_model",))


def test_sleep_discards_the_weights_and_the_steps_push_reloads_them(default_model):
    """Sleep mode (CUDA only, so with a recording stand-in for vllm.LLM): the engine sleeps at level 2 (weights
    discarded, not copied to host memory and back), and a push wakes it and is the only reload. After sleep it holds
    no version, so push_weights reloads it also when the update was skipped (the version unchanged): at that fixed
    point of the step on every rank, never when requests come (a gather on some ranks only); requests sent to an
    engine asleep are refused."""
    model = default_model[0]
    engine = object.__new__(S.VLLMEngine)
    engine.cfg, engine.llm, engine.sleeps, engine.asleep = S.Config(), FakeLLM(), True, False
    engine.live, engine.queue = {}, []
    engine.core = type("Core", (), {"model_config": type("MC", (), {"dtype": torch.float32})(),
                                    "set_weight_version": lambda self, v: None})()
    engine.push(model, 3)
    engine.sleep()
    engine.push(model, 4)  # the usual step: sleep while training, wake up for the push
    assert [c[0] for c in engine.llm.calls] == ["apply_model", "reload_weights", "apply_model", "sleep", "wake_up",
                                                "apply_model", "reload_weights", "apply_model"]  # (forget_moe_kernels,
    assert engine.llm.calls[3] == ("sleep", 2)                                                  # the push, the head)
    engine.llm.calls = []
    engine.sleep()
    assert engine.version is None
    engine.submit("k", [1, 2], 4, 0)
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        engine.flush()
    engine.queue = []
    state = types.SimpleNamespace(engine=engine, model=model, version=4,
                                  rollouts=types.SimpleNamespace(open={}, done=[]))
    S.push_weights(state, S.Config())  # an update was skipped: the version is still 4
    assert [c[0] for c in engine.llm.calls] == ["sleep", "wake_up", "apply_model", "reload_weights", "apply_model"]
    reloaded = engine.llm.calls[3][1]
    assert reloaded.keys() == model.state_dict().keys() and engine.version == 4
    assert all(torch.equal(reloaded[n], t) for n, t in model.state_dict().items())
    S.push_weights(state, S.Config())  # awake, with the version: nothing
    engine.wake()
    assert len(engine.llm.calls) == 5


def test_quiet_stderr_holds_back_noise_but_not_errors(capfd, tmp_path, monkeypatch):
    """What is held back goes to a file; an error shows it; a process killed inside the block (as by an NCCL abort in
    vLLM's start) leaves it in the named log, which stays after a normal exit too; the default file goes."""
    made, real = [], tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: made.append(real(**kw)) or made[-1])
    with S.quiet_stderr(verbose=False):
        os.write(2, b"library chatter\n")
    assert capfd.readouterr().err == "" and len(made) == 1 and not os.path.exists(made[0][1])
    log = str(tmp_path / "run" / "vllm-start.0.log")
    p = subprocess.run([sys.executable, "-c", "import os, sys, scalerl\nwith scalerl.quiet_stderr(False, sys.argv[1]):"
                        "\n    os.write(2, b'cuMem: out of memory\\n')\n    os.abort()", log], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -6 and p.stderr == "" and open(log).read() == "cuMem: out of memory\n"
    with S.quiet_stderr(False, log):
        os.write(2, b"started\n")
    assert capfd.readouterr().err == "" and open(log).read() == "started\n"
    with pytest.raises(ValueError), S.quiet_stderr(verbose=False):
        os.write(2, b"context of the error\n")
        raise ValueError("real error")
    assert capfd.readouterr().err == "context of the error\n"
    with S.quiet_stderr(verbose=True):
        os.write(2, b"shown\n")
    assert capfd.readouterr().err == "shown\n"


# ---------------------------------------------------------------------------------------------- off-policy loop
def test_vllm_update_mid_completion_gives_two_versions(vllm_engine):
    """Weights pushed between two engine steps: the running sequences go on, and their tokens carry the version
    that sampled them (vLLM's weight_versions spans)."""
    cfg, model0, tok, engine = vllm_engine
    ro = S.Rollouts(cfg, engine, tok)
    ro.add(("t", 0), tok("3941:").input_ids, 4, seed=3)
    for _ in range(3):
        ro.poll()
    assert ro.open and not ro.done  # mid-completion
    model = copy.deepcopy(model0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        engine.push(model, 1)
        (g,) = ro.wait([("t", 0)])
    finally:
        engine.push(model0, 0)
    for c in g.completions:
        if not c.finished or len(c.tokens) > 3:
            assert c.versions == [0] * 3 + [1] * (len(c.tokens) - 3), c.versions
    assert any(c.versions[0] != c.versions[-1] for c in g.completions)


def kv_reference_logprobs(models, prompt, tokens, versions, temperature, refresh):
    """Slow reference for the log-prob of each sampled token, from the weights that were live when it was sampled.
    Default (kept KV): a token sampled after an update attends to keys and values computed with the weights that
    were live when each earlier position was fed in (the prompt with the first token's weights, token t-1 with
    token t's): recomputed one token at a time with an explicit cache carried from model to model. refresh: the
    running sequences were re-prefilled at each update, so each token is a plain forward pass of its own weights."""
    from transformers import DynamicCache
    out, cache = [], DynamicCache()
    with torch.no_grad():
        for t, v in enumerate(versions):
            if refresh:
                logits = models[v](torch.tensor([prompt + tokens[:t]])).logits[0, -1]
            else:
                fed = prompt if t == 0 else tokens[t - 1:t]
                logits = models[v](torch.tensor([fed]), past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits.double() / temperature, -1)[tokens[t]].item())
    return out


@pytest.mark.parametrize("refresh", [False, True], ids=["kept-kv", "refresh-kv"])
def test_recorded_logprobs_are_those_of_the_weights_live_at_each_token(refresh, default_model, tmp_path):
    """The importance ratio's pi_gen is each token's own recorded log-prob: with updates landing mid-completion,
    they equal a slow recomputation with the weights live when each token was sampled (and differ from the
    trainer's current weights), and build_batch carries exactly them into the batch."""
    need_vllm()
    model0, tok = default_model
    cfg = S.Config(engine="vllm", length_control="truncate", max_new_tokens=12, temperature=0.8, refresh_kv=refresh)
    cfg = S.validate(S.fill_defaults(cfg))
    engine = make_engine("vllm", cfg, model0, tok)
    models = [copy.deepcopy(model0) for _ in range(3)]
    for m in models[1:]:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
    ro = S.Rollouts(cfg, engine, tok)
    prompts = [tok("3941:").input_ids, tok("275:").input_ids]
    for i, p in enumerate(prompts):
        ro.add(("t", i), p, 3, seed=7 + i)
    for version in (1, 2):  # two updates land while the sequences are decoding
        for _ in range(4):
            ro.poll()
        engine.push(models[version], version)
    groups = ro.wait([("t", 0), ("t", 1)])
    n_mixed = 0
    for p, g in zip(prompts, groups):
        for c in g.completions:
            ref = kv_reference_logprobs(models, p, c.tokens, c.versions, cfg.temperature, refresh)
            np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)
            n_mixed += len(set(c.versions)) > 1
            now = trainer_logprobs(models[2], p + c.tokens, tok.pad_token_id, cfg.temperature)[len(p) - 1:]
            assert (now - torch.tensor(c.logprobs)).abs().max() > 1e-3  # the ratio is not 1
    assert n_mixed >= 4
    rewards = np.array([[1.0, 0, 0], [0, 1.0, 0]])
    samples, _ = S.build_batch(prompts, [g.completions for g in groups], rewards, rewards, 0, cfg)
    assert [s.gen_logprobs for s in samples] == [c.logprobs for g in groups for c in g.completions]


class ScriptedEngine:
    """A fake engine for the off-policy bookkeeping: each request finishes after a scripted number of engine steps,
    with tokens labelled by the version live at each step."""
    preemptions = 0

    def __init__(self, steps_for, capacity=10**9):
        self.steps_for, self.capacity, self.version, self.live = steps_for, capacity, 0, {}

    def submit(self, key, ids, max_tokens, seed):
        self.live[key] = (self.steps_for(key), [])

    def unfinished(self):
        return len(self.live)

    def step(self):
        done, decoded = [], len(self.live)
        for key, (n, versions) in list(self.live.items()):
            versions.append(self.version)
            if len(versions) == n:
                del self.live[key]
                done.append((key, S.Completion([7] * n, [-1.0] * n, True, [1] * n, versions)))
        return done, decoded, 1

    def push(self, model, version):
        self.version = version


class FakeTok:
    """Every text encodes to [1], every token decodes to 'a'; no special tokens."""
    all_special_ids, pad_token_id = [], 0

    def decode(self, ids):
        return "a" * len(ids)

    def __call__(self, text, add_special_tokens=False):
        return type("E", (), {"input_ids": [1]})()


@pytest.mark.quick
@pytest.mark.parametrize("K,slow,steps", [(1, {2}, 3), (2, {0, 1, 2, 3}, 6), (3, {1, 5, 6}, 9)])
def test_next_batch_keeps_the_lag_bound_and_drops_nothing(K, slow, steps):
    """Groups `slow` take `steps` engine steps, the others 1, and an update follows every batch of P = 2: every group
    is trained, none more than K updates old, none dropped. With K = 1 the slow group 2 would be K + 1 = 2 updates old
    at the update after the one it is due at: the trainer waits for it there. With K = 2, four slow groups started
    together are due at the same update, two more than it can take: the trainer waits for two of them an update
    early (waiting only for the groups due now would leave two to go stale)."""
    cfg = S.Config(prompts_per_step=2, generations_per_prompt=2, max_lag=K, length_control="truncate")
    engine = ScriptedEngine(lambda key: steps if key[0][1] in slow else 1)
    ro = S.Rollouts(cfg, engine, FakeTok())
    s = S.State(None, FakeTok(), None, None, None, engine, ro, None, [], [[1]] * 100, [], [], S.Curriculum(100, 0), {})
    trained = []
    for version in range(16):
        engine.push(None, version)
        s.version = version
        groups, stale = S.next_batch(s, cfg)
        lags = [S.group_lag(g, version) for g in groups]
        assert len(groups) == 2 and max(lags) <= K and lags == sorted(lags, reverse=True) and stale == 0
        assert len(ro.open) + len(ro.done) <= (K + 1) * cfg.prompts_per_step  # admission's bound
        trained += [g.key[1] for g in groups]
    started = sorted(trained + [g.key[1] for g in [*ro.open.values(), *ro.done]])
    assert started == list(range(len(started))) and slow <= set(trained) and len(set(trained)) == len(trained)


@pytest.mark.quick
def test_admission_by_mode():
    P, G = 4, 2
    cfg = lambda **kw: S.Config(prompts_per_step=P, generations_per_prompt=G, **kw)  # noqa: E731
    assert S.admission(cfg(max_lag=0), 0, 0, 0, 100) == P           # synchronous: one batch, then nothing
    assert S.admission(cfg(max_lag=0), 3, 0, 6, 100) == 0
    assert S.admission(cfg(off_policy="ppo", max_lag=3), 0, 0, 0, 100) == 3 * P   # PPO-off-policy-k: K batches
    assert S.admission(cfg(off_policy="ppo", max_lag=3), 0, 1, 0, 100) == 0      # ... once all are trained
    assert S.admission(cfg(max_lag=2), 0, 0, 0, 100) == 3 * P       # pipeline: up to (K + 1) P ahead
    assert S.admission(cfg(max_lag=2), 5, 4, 10, 100) == 3          # ... counting those ready
    assert S.admission(cfg(max_lag=8), 10, 0, 20, 24) == 2          # ... and no more than the engine decodes at once
    assert S.admission(cfg(max_lag=8), 0, 0, 0, 1) == 1             # a group always starts when nothing runs


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_ppo_takes_k_steps_per_generated_batch(tmp_path, monkeypatch, engine):
    """PPO-off-policy-k: K batches generated with the same weights, then K optimiser steps: the first step of each
    round is on-policy (ratios 1), the later ones train on data 1, 2, ... updates old, every token of it (with vLLM
    the round's later groups are still decoding when its first batch is trained: no push may reach them)."""
    if engine == "vllm":
        need_vllm()
    # a reward a random policy gets half the time (completions that end, by parity), so that a round's first batch has
    # a gradient and the weights move before the round's later batches are trained
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: float(len(text) % 2 == 0))
    rows = S.run(small_cfg(tmp_path, engine=engine, steps=6, off_policy="ppo", max_lag=3, zero_variance_filter=False,
                           eval_every=100, lr=3e-3, warmup_steps=0))
    assert all(r["zero_variance_frac"] < 1 and r["grad_norm"] > 0 for r in (rows[1], rows[4]))
    assert [r["lag_max"] for r in rows[1:]] == [0, 1, 2, 0, 1, 2]
    for r in rows[1:]:
        if r["lag_max"] == 0:
            assert r["mismatch_abs_logprob"] < 1e-5 and r["gen_seconds"] > 0
        else:
            assert r["mismatch_abs_logprob"] > 1e-4 and r["lag_mean"] == r["lag_max"]


@pytest.mark.quick
def test_ppo_holds_the_push_while_a_group_of_the_round_is_untrained():
    """A round's groups that are still decoding (or complete but not trained) keep the round's weights: the push
    waits for the K-th update. The pipeline pushes at once."""
    cfg = S.Config(prompts_per_step=2, generations_per_prompt=2, off_policy="ppo", max_lag=2)

    for open_, done, mode, pushed in [(1, 0, "ppo", False), (0, 1, "ppo", False), (0, 0, "ppo", True),
                                      (1, 1, "pipeline", True)]:
        engine = ScriptedEngine(lambda key: 1)
        ro = S.Rollouts(dataclasses.replace(cfg, off_policy=mode), engine, FakeTok())
        ro.open = {("train", i): None for i in range(open_)}
        ro.done = [None] * done
        s = S.State(None, FakeTok(), None, None, None, engine, ro, None, [], [], [], [], S.Curriculum(4, 0), {},
                    version=1)
        S.push_weights(s, dataclasses.replace(cfg, off_policy=mode))
        assert (engine.version == 1) == pushed, (open_, done, mode)
    # under torchrun the decision is every rank's: a rank whose round is over waits for a rank still decoding (the
    # push gathers the weights on all ranks at once), as all_max tells it
    s.rollouts.open, s.rollouts.done, engine.version = {}, [], 0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(S, "all_max", lambda *v: 1.0)  # another rank has a group of the round left
        S.push_weights(s, cfg)
        assert engine.version == 0
    S.push_weights(s, cfg)
    assert engine.version == 1


@pytest.mark.quick
def test_evaluation_mid_ppo_round_lets_the_round_finish_with_its_weights():
    """An evaluation between two updates of a PPO round evaluates the newest weights, but the round's groups still
    decoding finish first, every token with the round's weights."""
    s, cfg = metrics_state(0, 0, ["yes", "no"])
    cfg = dataclasses.replace(cfg, off_policy="ppo", max_lag=2)
    s.rollouts.cfg = cfg
    s.engine.steps_for = lambda key: 4 if key[0][0] == "train" else 1
    s.rollouts.add(("train", 0), [1], 2, 0, prompt_index=0)
    s.rollouts.poll()  # one token decoded with the round's weights (version 0); three to go
    s.version = 1
    val = S.evaluate(s, cfg, 1)[0]["val_pass_rate"]
    assert val == 0.5 and s.engine.version == 1 and not s.rollouts.open
    (g,) = s.rollouts.done
    assert [c.versions for c in g.completions] == [[0, 0, 0, 0]] * 2


class CostedEngine(ScriptedEngine):
    """A ScriptedEngine whose every step costs 0.1 s per sequence decoding, on a clock of its own (`now`)."""
    now = 0.0

    def step(self):
        CostedEngine.now += 0.1 * len(self.live)
        return super().step()


@pytest.mark.quick
@pytest.mark.parametrize("evaluate_midway", [False, True])
def test_the_compute_axis_counts_training_generation_during_evaluations_and_never_the_evaluation(monkeypatch,
                                                                                               evaluate_midway):
    """The compute axis with an engine whose steps cost 0.1 s per sequence: a training group of 2 completions x 5
    steps costs 2 x 5 x 0.1 = 1.0 s of engine time whether or not an evaluation runs while it decodes. Midway (after
    1 of its 5 steps), the evaluation's 4 sequences decode 2 steps beside the group's 2: of those steps' 2 x 0.6 s,
    the group's 2 x 0.2 = 0.4 s is training (`ahead`, which the next row's device_hours counts), the evaluation's
    0.8 s is not. The synchronous loop, nothing in flight, counts nothing of its evaluation."""
    monkeypatch.setattr(S, "time", types.SimpleNamespace(time=lambda: CostedEngine.now))
    s, cfg = metrics_state(0, 0, ["yes", "no"])
    s.engine = s.rollouts.engine = CostedEngine(lambda key: 5 if key[0][0] == "train" else 2)
    s.rollouts.seconds = 0
    if not evaluate_midway:
        S.evaluate(s, cfg, 0)
        assert s.rollouts.ahead == 0  # nothing in flight
    s.rollouts.add(("train", 0), [1], 2, 0, prompt_index=0)
    s.rollouts.poll()
    first, s.rollouts.seconds = s.rollouts.seconds, 0  # the step ends: its row counts its time (all of it)
    if evaluate_midway:
        S.evaluate(s, cfg, 1)
        assert s.rollouts.ahead == pytest.approx(0.4) and s.rollouts.seconds == 0
    s.rollouts.wait([("train", 0)])
    assert first + s.rollouts.ahead + s.rollouts.seconds == pytest.approx(1.0)
    ahead = s.rollouts.ahead
    r = fake_results(*fixed_batch(), cfg, 0)
    row = S.metrics_row(s, cfg, 1, r, 0.5, S.take_counts(s, cfg, r, 0.5))
    assert row["device_hours"] == pytest.approx((0.5 + ahead) / 3600) and s.rollouts.ahead == 0


def test_npr_over_whole_epochs_in_a_run(tmp_path, monkeypatch, capsys):
    """No-Positive-Resampling in a run: a reward of 1 for every completion of the prompt whose answer is 9 (0 for the
    others) removes it after its first draw: of 8 prompts, 4 a step, epoch 1 draws all 8, epoch 2 the other 7, and
    the 16th draw opens epoch 3 without it. With every reward 1, epoch 1 removes every prompt and the run stops,
    saying why, after its 2 steps."""
    drawn = []
    real = S.update_curriculum
    monkeypatch.setattr(S, "update_curriculum", lambda cur, idx, rates, thr: (drawn.extend(idx), real(cur, idx, rates,
                                                                                                       thr))[1])
    real_score = S.score  # every completion graded, as if it had ended (a random policy seldom ends by itself)
    monkeypatch.setattr(S, "score", lambda tok, groups, *a: real_score(
        tok, [[dataclasses.replace(c, finished=True) for c in g] for g in groups], *a))
    tiny = dict(engine="hf", train_size=8, val_size=8, prompts_per_step=4, generations_per_prompt=2, eval_every=100,
                eval_samples=2, length_control="truncate", max_new_tokens=4)
    train, _ = S.make_task(8, 8, 0)  # the run's prompts (load_data: the built-in task, seed 0)
    (nine,) = [i for i, (_, a, _) in enumerate(train) if a == "9"]
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: float(answer == "9"))
    rows = S.run(small_cfg(tmp_path / "a", steps=4, **tiny))
    assert len(drawn) == 16 and sorted(drawn[:8]) == list(range(8))
    assert sorted(drawn[8:15]) == [i for i in range(8) if i != nine] and drawn[15] != nine
    assert rows[-1]["npr_removed"] == 1 and rows[-1]["pool_size"] == 7 and rows[-1]["epoch"] == 3
    assert "scalerl: NPR removes a prompt once 2 of its 2 completions pass" in capsys.readouterr().out  # (0.9 of 2)
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: 1.0)
    drawn.clear()
    rows = S.run(small_cfg(tmp_path / "b", steps=10, **tiny))
    assert [r["step"] for r in rows] == [0, 1, 2] and sorted(drawn) == list(range(8))
    assert rows[-1]["npr_removed"] == 8 and rows[-1]["pool_size"] == 0
    assert "every training prompt has been removed by the curriculum (npr); stopping" in capsys.readouterr().out


def test_pipeline_lag_bound_holds_when_training_is_slow(tmp_path, monkeypatch):
    """In one process, generation pauses while the trainer runs, so a slow trainer cannot let the generator run
    ahead: the bound holds however slow training is, and groups really span updates."""
    need_vllm()
    real = S.train_step

    def slow(*a, **kw):
        import time
        time.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(S, "train_step", slow)
    rows = S.run(small_cfg(tmp_path, engine="vllm", steps=6, prompts_per_step=4, max_lag=1, eval_every=100,
                           zero_variance_filter=False, length_control="truncate", max_new_tokens=16))
    assert all(r["lag_max"] <= 1 for r in rows[1:]) and max(r["lag_max"] for r in rows[1:]) == 1
    assert rows[1]["engine_batch_mean"] > 0  # (0 on a step whose groups were all complete already)


@pytest.mark.quick
def test_npr_threshold_in_steps_of_one_over_g():
    """A pass rate over G completions moves in steps of 1/G: the start-up line says how many of G the threshold
    means, whenever that is more than it reads, and update_curriculum removes exactly there."""
    note = lambda t, G: S.npr_note(S.Config(npr_threshold=t, generations_per_prompt=G))  # noqa: E731
    assert "once 8 of its 8 completions pass" in note(0.9, 8) and "a pass rate of 1)" in note(0.9, 8)
    assert "once 15 of its 16 completions pass" in note(0.9, 16) and "a pass rate of 0.9375)" in note(0.9, 16)
    assert note(0.875, 8) is None and note(0.9, 10) is None and note(1.0, 8) is None  # exact, or NPR off
    for t, G, need in ((0.9, 8, 8), (0.9, 16, 15), (0.9, 10, 9), (0.5, 3, 2)):
        cur = S.Curriculum(n_prompts=G + 1, seed=0)
        S.update_curriculum(cur, list(range(G + 1)), [k / G for k in range(G + 1)], npr(t))
        assert cur.removed == dict.fromkeys(range(need, G + 1), "npr"), (t, G)


@pytest.mark.quick
def test_npr_prompt_removed_while_in_flight_is_not_drawn_again():
    """With the off-policy loop, a prompt's result can arrive after the next epoch was shuffled: it is skipped there."""
    cur = S.Curriculum(n_prompts=4, seed=0)
    first = S.next_prompts(cur, 4)       # the whole first epoch is in flight
    nxt = S.next_prompts(cur, 1)         # the second epoch is shuffled before any result came back
    order2 = list(cur.order)
    solved = next(i for i in first if i != nxt[0])  # its turn in the second epoch is still to come
    S.update_curriculum(cur, [solved], [1.0], npr(0.9))
    assert S.next_prompts(cur, 2) == [i for i in order2[1:] if i != solved]


def test_evaluation_in_pipeline_mode_stays_apart(vllm_engine):
    """Evaluation groups are generated while training groups are in flight: each side gets exactly its own groups,
    and the evaluation uses the weights the engine holds now."""
    cfg, _, tok, engine = vllm_engine
    ro = S.Rollouts(cfg, engine, tok)
    for i in range(3):
        ro.add(("train", i), tok("12:").input_ids, 4, seed=i)
    ro.poll()
    evals = S.rollout(ro, [tok("3941:").input_ids, tok("27:").input_ids], 5, seed=1)
    assert [len(g) for g in evals] == [5, 5]
    assert all(c.versions == [engine.version] * len(c.tokens) for g in evals for c in g)
    train = ro.wait([("train", i) for i in range(3)])
    assert [len(g.completions) for g in train] == [4, 4, 4] and not ro.done and not ro.open


def test_the_script_ends_its_process_itself_with_the_runs_exit_status(tmp_path):
    """`python scalerl.py` ends its process once main() is done, its output flushed, without the interpreter's
    shutdown (which waited 2.5 s in native code after a vLLM engine): an atexit hook never runs, and the exit status is
    the run's (here 2, bad input, its one line on stderr). main(argv), as tests and bench.py call it, returns."""
    script = (f"import atexit, runpy, sys; atexit.register(lambda: print('shutdown ran', flush=True)); "
              f"sys.path.insert(0, {HERE!r}); "  # (as `python scalerl.py` has it: memory.py beside it)
              f"sys.argv = ['scalerl.py', '--steps', '-1']; runpy.run_path({os.path.join(HERE, 'scalerl.py')!r}, "
              "run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", "scalerl.py: error: --steps must be >= 0 (got -1)\n")


# ---------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model/dir"], "no such model directory"),
    (["--model", "./missing-model"], "no such model directory"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be > 0"),
    (["--generations-per-prompt", "1"], "--generations-per-prompt must be >= 2"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens must be > 0"),
    (["--eps-low", "1.5"], "--eps-low must be < 1"),
    (["--prompts-per-step", "5000", "--train-size", "100"], "exceeds --train-size"),
    (["--train-size", "30000"], "must be <= 20000"),
    (["--engine", "nope"], "invalid choice"),
    (["--steps", "ten"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--model", "org/name", "--tie-word-embeddings"], "embedded model only"),
    (["--engine", "hf", "--vllm-sleep"], "--vllm-sleep needs --engine vllm"),
    (["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization must be < 1"),
    (["--think-budget", "6", "4"], "need 1 <= LO <= HI < --max-new-tokens"),
    (["--think-budget", "2", "8"], "need 1 <= LO <= HI < --max-new-tokens"),
    (["--length-control", "penalty", "--max-len", "20"], "need 0 <= L_cache < L_max <= --max-new-tokens"),
    (["--length-control", "sometimes"], "invalid choice"),
    (["--resume", "auto"], "no checkpoint in --out"),
    (["--resume", "/no/such/checkpoint"], "not a checkpoint directory"),
    (["--keep-last", "0"], "--keep-last must be > 0"),
    (["--data", "d.jsonl"], "--data needs --model"),
    (["--val-data", "v.jsonl"], "--val-data needs --data"),
    (["--prompt-key", "query"], "--prompt-key needs --data"),
    (["--reward", "verify"], "invalid choice"),
    (["--reward-timeout", "0"], "--reward-timeout must be > 0"),
    (["--reward-workers", "-2"], "--reward-workers must be >= -1"),
    (["--max-lag", "-1"], "--max-lag must be >= 0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--wandb-name", "x"], "--wandb-name needs --wandb"),
    (["--model", "org/name", "--data", "d.jsonl", "--task", "hidden"], "--task chooses a built-in task"),
    (["--task", "sum"], "invalid choice"),
    (["--off-policy", "sometimes"], "invalid choice"),
    (["--engine", "hf", "--refresh-kv"], "--refresh-kv applies to sequences in flight"),
])
def test_cli_bad_input(args, message, tmp_path, monkeypatch, capfd):
    """scalerl.py's main() as the command line runs it (in this process: a new interpreter per case cost a minute;
    test_cli_out_that_is_a_file_is_refused runs the script itself)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    status, out, err = main_in_process(["--out", str(tmp_path / "o"), *args], capfd)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scalerl.py: error:") and message in lines[0], err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "cache").exists() and not (tmp_path / "o").exists()  # nothing built, nothing written


def main_in_process(argv, capfd):
    """(exit status, stdout, stderr) of scalerl.main(argv), the command line's entry point, run in this process."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        S.main(argv)
    out, err = capfd.readouterr()
    return e.value.code, out, err


def test_the_reward_receives_the_whole_data_row(tmp_path, monkeypatch):
    """A reward gets (text, answer, row): from a --data file, the row with every field, an extra column included,
    through load_data, score and the grader; in a run of the built-in task, each graded completion's own
    {"prompt", "answer"} row, of training and held-out prompts both. A reward of another signature is refused."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{k}", "answer": k, "tolerance": k % 3}) + "\n"
                            for k in range(30)))
    cfg = S.Config(data=str(path), model="unused", prompts_per_step=4, val_size=10)
    train, _ = S.load_data(cfg)
    seen = []  # (the rows name their reward, math: the table's entry grades them)
    monkeypatch.setitem(S.REWARDS, "math", lambda text, answer, row: seen.append((text, answer, row)) or 1.0)
    grader = S.Grader(S.REWARDS["math"], 0, 10.0)
    done = lambda: S.Completion([5, 6], [0.0, 0.0], True, [1, 1], [0, 0])  # noqa: E731
    unfinished = S.Completion([5, 6], [0.0, 0.0], False, [1, 1], [0, 0])  # not graded
    S.score(FakeTok(), [[done(), unfinished], [done(), done()]], train[:2], grader, S.Config())
    rows = {f"p{k}": {"problem": f"p{k}", "answer": k, "tolerance": k % 3} for k in range(30)}
    assert [(a, r) for _, a, r in seen] == [(train[0][1], rows[train[0][0]])] + [(train[1][1], rows[train[1][0]])] * 2
    graded = []
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer, row: graded.append((answer, row)) or 0.0)
    S.run(small_cfg(tmp_path, engine="hf", steps=1, val_size=8, prompts_per_step=4, length_control="truncate"))
    task_train, task_val = S.make_task(256, 8, 0)
    prompts = {p: a for p, a, _ in task_train + task_val}
    assert graded and all(row == {"prompt": row["prompt"], "answer": a} and prompts[row["prompt"]] == a
                          for a, row in graded)
    assert {row["prompt"] for _, row in graded} & {p for p, _, _ in task_val}  # held-out rows too
    assert {row["prompt"] for _, row in graded} & {p for p, _, _ in task_train}
    monkeypatch.setitem(S.REWARDS, "digit", lambda text, answer: 0.0)
    with pytest.raises(S.ScaleRLError, match="must take \\(completion_text, answer, row\\)"):
        checked([])


def test_reward_workers_and_timeout_reach_the_grader_in_a_run(tmp_path, monkeypatch):
    """--reward-workers 1 --reward-timeout 4.5 in a real run: the run's one grader has one process and that limit,
    and every completion scored (evaluations and the training step) went through that process, with the rewards that
    grading in this process gives. --reward-workers 0 (no time limit) is refused with --reward math at parse time."""
    made, graded = [], []

    class Spy(S.Grader):
        def __init__(self, fn, workers, timeout):
            super().__init__(fn, workers, timeout)
            made.append((fn, workers, timeout, len(self.procs), self.timeout))

        def _in_workers(self, items):
            out = super()._in_workers(items)
            graded.append((items, out))
            return out

    monkeypatch.setattr(S, "Grader", Spy)
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=1, reward_workers=1, reward_timeout=4.5, val_size=8,
                           prompts_per_step=4, length_control="truncate"))
    assert made == [(S.reward_last_digit, 1, 4.5, 1, 4.5)] and len(rows) == 2
    assert len(graded) == 3 and all(items for items, _ in graded)  # step 0's evaluation, step 1, its evaluation
    for items, out in graded:
        assert out == [(S.reward_last_digit(t, a), None, None) for t, a, _ in items]  # (reward, verdict, error)
    with pytest.raises(S.ScaleRLError, match="--reward-workers 0 grades in this process with no time limit"):
        checked(["--reward", "math", "--reward-workers", "0"])
    assert checked(["--reward", "math", "--reward-workers", "1"]).reward_workers == 1


BOUNDS = {  # the recipe's numeric flags: a value just out of each one's range, as specified (a fork's new flag is not
    # listed here: test_every_numeric_flag_has_a_bound reads its bound from its flag(...))
    "seed": -1, "vllm_gpu_memory_utilization": 1.0, "vllm_max_model_len": -1, "vllm_kv_cache_mb": -1,
    "train_size": -1, "val_size": -1, "reward_workers": -2, "reward_timeout": 0.0, "steps": -1,
    "prompts_per_step": 0, "generations_per_prompt": 1, "max_new_tokens": 0, "temperature": 0.0,
    "answer_budget": -1, "max_len": -1, "cache_len": -1, "eps_max": 0.0, "eps_low": 1.0, "eps_high": -0.1,
    "npr_threshold": 0.0, "logprob_chunk": 0, "max_lag": -1, "lr": 0.0, "warmup_steps": -1, "weight_decay": -0.1,
    "adam_eps": -1e-9, "grad_clip": 0.0, "micro_batch_tokens": 0, "save_every": -1, "keep_last": 0,
    "max_skipped_updates": 0, "eval_every": 0, "eval_samples": 0, "generators": -1, "vllm_max_num_seqs": -1,
    "generator_timeout": -1.0}


def numeric_fields(module=S):
    return [f for f in dataclasses.fields(module.Config) if f.type in (int, float)]


def flag_bound(f):
    """A value just out of a numeric flag's range, read from its flag(...): `above` itself, 1 (an int) or 0.1 (a
    float) below `at_least`, or `below` itself; None when it has no bound."""
    m = f.metadata
    return m["above"] if m["above"] is not None else m["below"] if m["at_least"] is None else \
        m["at_least"] - (1 if f.type is int else 0.1)


def test_every_numeric_flag_has_a_bound(module=S):
    """Every numeric flag, a fork's too, has a bound in its flag(...), and a value just out of it is refused; the
    recipe's own flags are the ones BOUNDS specifies."""
    fields = numeric_fields(module)
    assert set(BOUNDS) <= {f.name for f in fields}
    for f in fields:
        assert flag_bound(f) is not None, f"--{f.name.replace('_', '-')} has no bound in its flag(...)"
        with pytest.raises(module.ScaleRLError, match=f"--{f.name.replace('_', '-')} must be"):
            checked(module=module, argv=[f"--{f.name.replace('_', '-')}={flag_bound(f)}"])


@pytest.mark.parametrize("name,value", [(n, v) for n, v in BOUNDS.items()] + [("seed", 2**64 + 1)] +
                         [(f.name, bad) for f in numeric_fields() if f.type is float
                          for bad in ("nan", "inf", "-inf")])
def test_bad_numbers_are_refused_in_one_line(name, value):
    with pytest.raises(S.ScaleRLError) as e:
        checked([f"--{name.replace('_', '-')}={value}"])  # = form: argparse reads "-inf" as a flag
    lines = str(e.value).splitlines()
    assert e.value.status == 2 and len(lines) == 1 and lines[0].startswith("--"), lines
    assert name.replace("_", "-") in lines[0] and ("finite" in lines[0] if value in ("nan", "inf", "-inf") else True)


def test_bench_inputs_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """bench.py's inputs are checked as scalerl.py's are, before anything runs or is written: one line, exit 2, each
    (before: a traceback for each bad --script, a run in the wrong place for -- --out, a doubled prefix, a raw
    TypeError and an AssertionError for --memory, and a table of 'CUDA is not available' rows for --gpu-check)."""
    import bench as B

    def refused_by_bench(*argv):
        monkeypatch.setattr(sys, "argv", ["bench.py", *map(str, argv)])
        with pytest.raises(SystemExit) as e:
            B.main()
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("bench.py: error: "), (e.value.code, err)
        return err[0][len("bench.py: error: "):]
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "other.py").write_text("x = 1\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "x"}))
    assert refused_by_bench("--learn", "--script", tmp_path / "notes.txt").startswith(f"--script {tmp_path}/notes.txt: "
                                                                                      "not a Python file")
    assert refused_by_bench("--learn", "--script", tmp_path / "missing.py").startswith(
        f"--script {tmp_path}/missing.py: not a Python file")
    assert refused_by_bench("--learn", "--script", tmp_path / "broken.py").startswith(
        f"--script {tmp_path}/broken.py: it does not load (SyntaxError: ")
    assert refused_by_bench("--learn", "--script", tmp_path / "other.py") == (
        f"--script {tmp_path}/other.py: not a copy of scalerl.py (it has no parse_args, ScaleRLError and main)")
    assert refused_by_bench("--real-model", "m", "--out", tmp_path / "r", "--", "--out", "elsewhere", "--seed=3") == (
        "--out --seed after --: the study sets them for each of its runs (--out, --seeds and --seed-list are bench.py's "
        "own flags)")
    assert refused_by_bench("--memory", tmp_path / "nothing", "--ranks", 0) == (
        f"--memory {tmp_path}/nothing: neither a shape ({', '.join(B.SHAPES)}) nor a directory with config.json")
    assert refused_by_bench("--memory", tmp_path / "m", "--ranks", 0).startswith(
        f"--memory {tmp_path}/m: its config.json cannot be read (")
    assert refused_by_bench("--memory", "qwen2-0.5b", "--ranks", -1) == (
        "--ranks must be >= 0 (0: one process) and --seq-len >= 4 (got -1, 1024)")
    if not torch.cuda.is_available():
        assert refused_by_bench("--gpu-check") == (
            "--gpu-check: CUDA is not available on this machine; --device cpu runs what a CPU can check")
    assert not (tmp_path / "r").exists() and not os.path.exists("elsewhere")


def test_contradictory_flags_are_refused():
    """A flag that the others make moot is refused, not silently ignored (before: --fp32-head-product split with
    --no-lm-head-fp32 ran without a word)."""
    with pytest.raises(S.ScaleRLError, match="--fp32-head-product split chooses the FP32 head's product; with "
                                             "--no-lm-head-fp32 there is none"):
        checked(["--fp32-head-product", "split", "--no-lm-head-fp32"])
    assert checked(["--no-lm-head-fp32"]).fp32_head_product == "float32"  # (its default, derived: no refusal)


def test_a_copy_of_the_script_alone_refuses_the_code_reward_in_one_line(monkeypatch):
    """scalerl.py copied without sandbox.py, judge.py and code_rows.py (a fork's single file) imports and runs all but
    --reward code, which it refuses naming what is missing (before: the import of sandbox failed every run of such a
    copy)."""
    monkeypatch.setattr(S, "sandbox", None)
    with pytest.raises(S.ScaleRLError, match="code rows need sandbox.py, judge.py and code_rows.py beside scalerl"):
        S.validate(S.fill_defaults(S.Config(reward="code")))
    S.validate(S.fill_defaults(S.Config()))


def test_bad_think_budget_is_refused():
    for budget in (["-1", "4"], ["nan", "4"]):
        with pytest.raises(S.ScaleRLError) as e:
            checked(["--think-budget", *budget])
        assert e.value.status == 2 and "--think-budget" in str(e.value)


def test_cli_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "o").write_text("x")
    p = subprocess.run([sys.executable, os.path.join(HERE, "scalerl.py"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "exists and is not a directory" in p.stderr and "Traceback" not in p.stderr


def test_a_run_that_fails_before_training_leaves_no_directory(tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("the engine fell over")

    monkeypatch.setattr(S, "evaluate", broken)
    with pytest.raises(RuntimeError, match="fell over"):
        S.run(small_cfg(tmp_path, engine="hf"))
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made is left as it was
    with pytest.raises(RuntimeError):
        S.run(small_cfg(tmp_path, engine="hf", out=str(tmp_path / "mine")))
    assert (tmp_path / "mine").is_dir()


def wandb_history(path):
    """The rows logged to a W&B run file (.wandb): LevelDB-style log records (7-byte headers in 32 KiB blocks)
    holding protobuf Records, read here without the wandb service."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, buf, rows = open(path, "rb").read(), 7, b"", []  # the file starts with a 7-byte W&B header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == 0:
            pos += 32768 - pos % 32768
    return rows


def test_wandb_logging_reaches_a_stand_in_module(tmp_path, monkeypatch):
    """--wandb with a stand-in `wandb` module that records its calls (no package, no network): one init with the
    project, the name, the run's config and its directory; every metrics row logged at its step; one finish."""
    import importlib.machinery
    import types
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # (validate asks importlib whether it exists)

    class Run:
        def log(self, row, step):
            calls.append(("log", json.loads(json.dumps(row)), step))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    fake.login = lambda prompt, verify: not prompt and not verify  # (logged in, asked without a prompt or the network)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=2, eval_every=100, wandb="proj", wandb_name="nm",
                           prompts_per_step=4, val_size=8, length_control="truncate"))
    config = json.load(open(tmp_path / "run" / "config.json"))
    (kind, init), *logs, end = calls
    assert kind == "init" and init.keys() == {"project", "name", "config", "dir"}
    assert (init["project"], init["name"], init["dir"]) == ("proj", "nm", str(tmp_path / "run"))
    assert init["config"]["steps"] == 2 and init["config"]["device"] == "auto"  # (config.json: the device used)
    assert {k: v for k, v in json.loads(json.dumps(init["config"])).items() if k != "device"} == {
        k: config[k] for k in init["config"] if k != "device"}
    assert logs == [("log", r, r["step"]) for r in read_metrics(str(tmp_path / "run"))] and len(logs) == len(rows) == 3
    assert end == ("finish",)


def test_wandb_offline_logs_the_metrics_rows(tmp_path, monkeypatch):
    need("wandb")
    import glob
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = S.run(small_cfg(tmp_path, engine="hf", steps=3, wandb="scalerl-test", wandb_name="t", prompts_per_step=4,
                           val_size=8, length_control="truncate"))
    import wandb
    wandb.teardown()  # the wandb service writes the run file out when it stops: finish() alone may leave it unwritten
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "*.wandb"))
    assert wandb_history(path) == rows == read_metrics(str(tmp_path / "run")) and len(rows) == 4


def test_cli_refuses_to_overwrite_a_run(tmp_path, capfd):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "metrics.jsonl").write_text("{}\n")
    status, _, err = main_in_process(["--out", str(tmp_path / "o")], capfd)
    assert status == 2 and "already holds a run" in err and "Traceback" not in err


def test_cli_refuses_vllm_sleep_on_cpu(tmp_path, capfd):
    need_vllm()
    status, _, err = main_in_process(["--engine", "vllm", "--device", "cpu", "--vllm-sleep", "--max-lag", "0", "--out",
                                      str(tmp_path / "o")], capfd)
    assert status == 2 and "refused on CPU" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- checkpoints
TIMING = {"device_hours", "step_seconds", "gen_seconds", "train_seconds", "sync_seconds", "rss_gb"}  # (and memory)


def untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def ckpt_cfg(out, **kw):
    base = dict(engine="hf", steps=6, prompts_per_step=16, generations_per_prompt=8, val_size=16, train_size=256,
                eval_every=3, eval_samples=2, lr=2e-3, out=str(out))
    return S.Config(**{**base, **kw})


def load_params(ckpt):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(ckpt).state_dict()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_resume_is_exact(tmp_path, moe):
    """Also for the embedded MoE (--moe, smaller steps: the HF engine decodes an MoE slowly): its checkpoint is written
    in the checkpoint's layout (the experts one tensor each) and read back into the fused in-memory layout."""
    small = dict(moe=True, prompts_per_step=8, generations_per_prompt=4, val_size=8) if moe else {}
    whole = S.run(ckpt_cfg(tmp_path / "whole", **small))
    S.run(ckpt_cfg(tmp_path / "parts", steps=3, **small))
    S.run(ckpt_cfg(tmp_path / "parts", steps=6, resume="auto", **small))
    parts = read_metrics(str(tmp_path / "parts"))
    assert [r["step"] for r in parts] == list(range(7))  # no step duplicated or missing
    assert sum(r["active_prompts"] for r in whole[1:]) > 0  # the run really trained
    assert untimed(parts) == untimed(whole)  # rewards, losses, counters, curriculum, evaluations
    assert parts[4]["device_hours"] > parts[3]["device_hours"]  # the compute axis continues
    a, b = (load_params(S.list_checkpoints(str(tmp_path / d))[-1]) for d in ("whole", "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_params(S.list_checkpoints(str(tmp_path / "parts"))[0])
    assert any(not torch.equal(first[k], b[k]) for k in b)  # and the weights moved between the two parts


def test_resume_refuses_changed_flags_and_names_them(tmp_path):
    """A resumed run takes its settings from the checkpoint: a flag typed with another value is refused (status 2,
    before any compute) with its name and both values, never silently ignored. A derived setting (--answer-budget
    follows --max-new-tokens) is not named; --steps, --save-every, --keep-last and values equal to the run's pass."""
    tiny = dict(steps=1, prompts_per_step=4, generations_per_prompt=2, val_size=8, eval_samples=2, eval_every=100,
                length_control="truncate", max_new_tokens=6)
    S.run(ckpt_cfg(tmp_path, **tiny))
    before = read_metrics(str(tmp_path))
    with pytest.raises(S.ScaleRLError) as e:
        S.run(ckpt_cfg(tmp_path, **{**tiny, "steps": 2, "max_new_tokens": 16, "lr": 0.1, "resume": "auto"}))
    msg = str(e.value)
    assert e.value.status == 2 and "--max-new-tokens 16 (the run's: 6)" in msg and "--lr 0.1 (the run's: 0.002)" in msg
    named = msg.split("typed now with other values: ")[1]
    assert "--answer-budget" not in named and "--steps" not in named
    assert read_metrics(str(tmp_path)) == before  # nothing ran
    with pytest.raises(S.ScaleRLError, match=r"--seed 3 \(the run's: 0\)"):
        S.run(S.parse_args(["--resume", "auto", "--out", str(tmp_path), "--seed", "3", "--engine", "hf"]))
    rows = S.run(ckpt_cfg(tmp_path, **{**tiny, "steps": 2, "save_every": 1, "keep_last": 1, "resume": "auto"}))
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_resume_of_a_checkpoint_older_than_a_flag_compares_the_flag_with_its_default(tmp_path, monkeypatch):
    """A fork adds a flag (here --kl-coef, a new Config field) and resumes a checkpoint made before it: the flag at its
    default passes, another value is refused naming the default as the run's value (not a KeyError)."""
    tiny = dict(steps=1, prompts_per_step=4, generations_per_prompt=2, val_size=8, eval_samples=2,
                length_control="truncate", max_new_tokens=6)
    S.run(ckpt_cfg(tmp_path, **tiny))
    ckpt = S.list_checkpoints(str(tmp_path))[-1]
    forked = dataclasses.make_dataclass("Config", [("kl_coef", float, S.flag(0.0, "KL-to-reference coefficient"))],
                                        bases=(S.Config,))
    monkeypatch.setattr(S, "Config", forked)
    given = lambda **kw: S.fill_defaults(forked(**{**vars(ckpt_cfg(tmp_path, **tiny)), **kw}))  # noqa: E731
    resumed, _ = S.resumed_config(given(steps=2), ckpt)
    assert resumed.kl_coef == 0.0 and resumed.steps == 2 and resumed.max_new_tokens == 6
    with pytest.raises(S.ScaleRLError, match=r"--kl-coef 0.1 \(the run's: 0.0, the default: the checkpoint predates"):
        S.resumed_config(given(steps=2, kl_coef=0.1), ckpt)


def run_entries(out):
    """The run's own entries of OUT/checkpoints, sorted: its step_N directories (and a step_N.tmpPID being written); a
    fork's own entries there (its best, say) are not the run's."""
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_"))


def snapshot(d):
    """Every file under d, with its bytes."""
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, files in os.walk(d) for f in files}


def resume_cli(*args):
    """A resumed run's command line as resumed_config receives it: the flags typed, their defaults filled in."""
    return S.fill_defaults(S.parse_args(["--engine", "hf", *map(str, args)]))


def test_resume_writes_where_out_says_branches_and_leaves_the_original_byte_for_byte(tmp_path):
    """The run directory is --out, never the one a checkpoint's config names: --resume CKPT --out NEW branches into NEW
    (the rows up to the checkpoint's step, then its own, the same trajectory: resume is exact), a copied run resumed
    with --out COPY goes on in the copy, a checkpoint resumed without --out goes on in the run it is in; and the run
    they came from keeps every byte. Resuming a run in place from a checkpoint it went past is refused, so is
    branching into a directory that holds a run."""
    import shutil
    orig, branch, copy = tmp_path / "orig", tmp_path / "branch", tmp_path / "copy"
    rows = S.run(ckpt_cfg(orig, steps=3, save_every=1, keep_last=3))
    before, (ckpt1, _, _) = snapshot(orig), S.list_checkpoints(str(orig))
    S.run(resume_cli("--resume", ckpt1, "--out", branch, "--steps", 2))
    assert snapshot(orig) == before
    unevaluated = lambda rows: [{k: v for k, v in r.items() if k != "val_pass_rate" and not k.startswith("fit_")}  # noqa
                                for r in untimed(rows)]  # (the branch evaluates its last step, 2)
    assert unevaluated(read_metrics(str(branch))) == unevaluated(rows[:3])  # steps 0-1 copied, step 2 its own
    assert [os.path.basename(c) for c in S.list_checkpoints(str(branch))] == ["step_000002"]
    assert json.load(open(branch / "config.json"))["out"] == str(branch)
    shutil.copytree(orig, copy)
    S.run(resume_cli("--resume", "auto", "--out", copy, "--steps", 4))
    S.run(resume_cli("--resume", copy / "checkpoints" / "step_000004", "--steps", 5))  # (no --out: its run's)
    assert snapshot(orig) == before
    assert [r["step"] for r in read_metrics(str(copy))] == list(range(6)) and untimed(read_metrics(str(copy)))[:4] \
        == untimed(rows)
    with pytest.raises(S.ScaleRLError, match=f"{orig} goes on past it .checkpoint .*step_000003.; resuming it there"):
        S.run(resume_cli("--resume", ckpt1, "--steps", 5))
    with pytest.raises(S.ScaleRLError, match=f"--out {copy} already holds a run: branch"):
        S.run(resume_cli("--resume", ckpt1, "--out", copy, "--steps", 5))
    assert snapshot(orig) == before


def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch):
    """A relative --out (the default runs/<timestamp> is one) is kept absolute: resumed from elsewhere, the run goes on
    where it was, and nothing is written where the resumed command runs."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    S.run(ckpt_cfg("rel", steps=1))
    run = tmp_path / "a" / "rel"
    assert json.load(open(run / "config.json"))["out"] == str(run)
    monkeypatch.chdir(tmp_path / "b")
    S.run(resume_cli("--resume", "auto", "--out", "../a/rel", "--steps", 2))
    S.run(resume_cli("--resume", run / "checkpoints" / "step_000002", "--steps", 3))
    assert [r["step"] for r in read_metrics(str(run))] == [0, 1, 2, 3] and os.listdir(tmp_path / "b") == []


def test_out_that_cannot_be_written_is_refused_before_any_model_loads(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(S, "load_model", lambda *a, **kw: pytest.fail("a model was loaded"))
    (tmp_path / "file").write_text("x")
    status, _, err = main_in_process(["--engine", "hf", "--out", str(tmp_path / "file" / "run")], capfd)
    assert status == 2 and err.strip() == f"scalerl.py: error: --out {tmp_path / 'file' / 'run'}: " \
                                          f"{tmp_path / 'file'} is not a directory"
    monkeypatch.setattr(S.os, "access", lambda path, mode: path != str(tmp_path))  # (root writes anywhere)
    status, _, err = main_in_process(["--engine", "hf", "--out", str(tmp_path / "new" / "run")], capfd)
    assert status == 2 and err.strip() == f"scalerl.py: error: --out {tmp_path / 'new' / 'run'}: {tmp_path} is " \
                                          "not writable"
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_resume_drops_a_cut_off_last_row_and_refuses_a_broken_one_before_it(tmp_path, capsys):
    """A crash while a row is written cuts it off (each row is one write): the resumed run drops it with one line and
    goes on from the checkpoint. A broken row before the last is not a crash's: refused, naming the line."""
    S.run(ckpt_cfg(tmp_path, steps=2, save_every=1))
    path = tmp_path / "metrics.jsonl"
    good = path.read_text()
    path.write_text(good + good.splitlines()[-1][:40])  # step 2's row again, cut off, as step 3's would be
    capsys.readouterr()
    S.run(resume_cli("--resume", "auto", "--out", tmp_path, "--steps", 3))
    assert f"scalerl: {path}: its last row was cut off (the run stopped while writing it); dropped" in \
        capsys.readouterr().out.splitlines()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + [lines[1][:40]] + lines[2:]) + "\n")
    with pytest.raises(S.ScaleRLError, match=f"{path}: line 2 is not a metrics row"):
        S.run(resume_cli("--resume", "auto", "--out", tmp_path, "--steps", 4))


def test_resume_repairs_metrics_with_no_silent_gap(tmp_path, capsys):
    """The checkpoint's own row cut mid-line (the crash while writing it) comes back from the checkpoint, which keeps a
    copy; a duplicated row is dropped (no step appears twice); rows lost further back are named, once each resume.
    (Before: the file read 0, 1, 3 without a word, the notice printed twice, and a duplicate was kept.)"""
    S.run(ckpt_cfg(tmp_path, steps=2, save_every=1))
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [lines[1]]) + "\n" + lines[2][:40])  # 0, 1, 1 again, 2 cut off
    capsys.readouterr()
    S.run(resume_cli("--resume", "auto", "--out", tmp_path, "--steps", 3))
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith(f"scalerl: {path}")] == [
        f"scalerl: {path}: line 3 is step 1's second row; dropped",
        f"scalerl: {path}: its last row was cut off (the run stopped while writing it); dropped",
        f"scalerl: {path}: step 2's row, lost from it, is restored from the checkpoint"]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and json.dumps(rows[2]) == lines[2]  # the row as it was written
    path.write_text("\n".join(path.read_text().splitlines()[:1] + path.read_text().splitlines()[3:]) + "\n")  # 0, 3
    S.run(resume_cli("--resume", "auto", "--out", tmp_path, "--steps", 4))
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"scalerl: {path}")] == [
        f"scalerl: {path}: the rows of steps 1, 2 are gone; the run goes on without them"]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 3, 4]


def test_steps_on_resume_means_what_was_given(tmp_path, monkeypatch, capfd):
    """--steps given on resume is the run's new length, also when it equals the default (150); not given, the run's
    own. Below the checkpoint's step it is refused, equal to it there is nothing to do (exit 0): both before anything
    loads, and nothing in the run directory changes."""
    S.run(ckpt_cfg(tmp_path, steps=2))
    ckpt = S.list_checkpoints(str(tmp_path))[-1]
    given = lambda *a: S.resumed_config(resume_cli("--resume", "auto", "--out", tmp_path, *a), ckpt)[0]  # noqa: E731
    assert given("--steps", S.fill_defaults(S.Config()).steps).steps == 150 and given("--steps", 7).steps == 7
    monkeypatch.setattr(S, "load_model", lambda *a, **kw: pytest.fail("a model was loaded"))
    before = snapshot(tmp_path)
    cmd = ["--engine", "hf", "--resume", "auto", "--out", str(tmp_path)]
    status, out, err = main_in_process(cmd + ["--steps", "1"], capfd)
    assert status == 2 and err.strip() == "scalerl.py: error: --steps 1: the checkpoint is of step 2; a resumed " \
                                          "run goes on from there"
    for more in ([], ["--steps", "2"]):
        status, out, err = main_in_process(cmd + more, capfd)
        assert status == 0 and out.strip().splitlines()[-1] == f"scalerl: {ckpt} is step 2 of 2: nothing to do " \
                                                               "(--steps N, N > 2, goes on)" and not err
    assert snapshot(tmp_path) == before


@pytest.mark.quick
def test_an_answer_budget_that_leaves_no_thinking_budget_is_refused():
    for budget in (8, 9):
        with pytest.raises(S.ScaleRLError, match=f"--answer-budget {budget} leaves no thinking budget within "
                                                 "--max-new-tokens 8"):
            checked(["--answer-budget", str(budget), "--max-new-tokens", "8"])
    assert checked(["--answer-budget", "7", "--max-new-tokens", "8"]).think_budget == (1, 1)
    assert checked(["--answer-budget", "8", "--max-new-tokens", "8", "--length-control", "truncate"])


def test_steps_0_evaluates_and_saves_step_0_which_resume_continues_as_one_run(tmp_path):
    """--steps 0: the initial weights' evaluation and checkpoint step 0; resumed, the run is the one that ran whole."""
    whole = S.run(ckpt_cfg(tmp_path / "whole", steps=2))
    rows = S.run(ckpt_cfg(tmp_path / "parts", steps=0))
    assert [r["step"] for r in rows] == [0] and [os.path.basename(c) for c in
                                                 S.list_checkpoints(str(tmp_path / "parts"))] == ["step_000000"]
    S.run(resume_cli("--resume", "auto", "--out", tmp_path / "parts", "--steps", 2))
    assert untimed(read_metrics(str(tmp_path / "parts"))) == untimed(whole)
    assert "0: evaluate the initial weights and save them as checkpoint step 0" in S.Config.__dataclass_fields__[
        "steps"].metadata["help"]


def test_a_hub_name_without_network_fails_in_one_line_unless_it_is_cached(tmp_path, monkeypatch, capfd):
    """Without the hub (its address refuses connections here), a --model hub name not in the cache stops the run in
    one line, before any library tries (and retries) the hub; one in the cache passes, with the libraries told to
    stay offline."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # (the discard port: nothing listens)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):  # set, so that what
        monkeypatch.setenv(k, "")  # check_hub sets is undone after the test (an unset variable would stay set)
    monkeypatch.setattr(S, "load_model", lambda *a, **kw: pytest.fail("a model was loaded"))
    status, out, err = main_in_process(["--engine", "hf", "--model", "no-such-org/no-such-model", "--out",
                                        str(tmp_path / "run")], capfd)
    assert status == 2 and err.strip() == (
        f"scalerl.py: error: --model no-such-org/no-such-model: not in the local cache ({tmp_path / 'hf' / 'hub'}) "
        "and the hub (127.0.0.1) cannot be reached: download it where there is a network, or give a local path")
    (tmp_path / "hf" / "hub" / "models--org--cached" / "snapshots" / "0123").mkdir(parents=True)
    S.check_hub(S.Config(model="org/cached"))
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_the_hub_check_asks_the_hubs_api(tmp_path, monkeypatch, capfd):
    """A host that takes the connection but is not the hub (a captive portal's page) is no network: a hub name not in
    the cache is refused in the same one line as without one. An answer of the hub's API (its JSON list of models,
    asked for under /api/) lets the name through to the libraries, not told to stay offline."""
    import http.server
    import threading
    answer, asked = [], []

    class Host(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", answer[0][0])
            self.end_headers()
            self.wfile.write(answer[0][1])

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for k in ("no_proxy", "NO_PROXY"):  # (this host directly, where a proxy is set)
        monkeypatch.setenv(k, "127.0.0.1")
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.setenv(k, "")  # (set, so that what check_hub sets is undone after the test)
    try:
        answer.append(("text/html", b"<html>Sign in to use this network</html>"))
        status, out, err = main_in_process(["--engine", "hf", "--model", "no-such-org/no-such-model", "--out",
                                            str(tmp_path / "run")], capfd)
        assert status == 2 and err.splitlines() == [
            f"scalerl.py: error: --model no-such-org/no-such-model: not in the local cache ({tmp_path / 'hf' / 'hub'}) "
            "and the hub (127.0.0.1) cannot be reached: download it where there is a network, or give a local path"]
        answer[0] = ("application/json", b'[{"id": "org/model"}]')
        S.check_hub(S.Config(model="org/name"))
        assert os.environ["HF_HUB_OFFLINE"] == "" and asked and all(p.startswith("/api/") for p in asked)
    finally:
        server.shutdown()
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_trainer_state_that_would_run_code(tmp_path, capfd):
    """trainer_state.pt is loaded with weights_only: a pickle that would run code (here: create a file) is refused in
    one line, and nothing runs."""
    S.run(ckpt_cfg(tmp_path / "run", steps=1))
    ckpt = S.list_checkpoints(str(tmp_path / "run"))[-1]
    state = torch.load(ckpt + "/trainer_state.pt", weights_only=True)
    torch.save({**state, "loop": Pwn(str(tmp_path / "pwned"))}, ckpt + "/trainer_state.pt")
    status, _, err = main_in_process(["--engine", "hf", "--resume", ckpt, "--steps", "2"], capfd)
    assert status == 2 and err.strip() == f"scalerl.py: error: --resume {ckpt}: trainer_state.pt holds more than " \
        "tensors and plain data (posix.system), which this script's checkpoints never do: refused, not loaded"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_another_scripts_checkpoint_or_one_with_settings_or_state_not_as_written_is_one_line(tiny_run, tmp_path,
                                                                                              capfd):
    """A checkpoint's settings go through the command line's checks: a fork's checkpoint (a setting this script does not
    know, or one it lacks) names the settings and the script that made it; a value of the wrong type, and damaged
    parts of the training state, are named. Each one line, exit status 2, nothing written. (Before: a raw TypeError
    from Config(**saved), a traceback for 'max_lag': '8', and 'yes' for a bool accepted and written back; empty
    totals restarted the compute axis.)"""
    run = run_copy(tiny_run, tmp_path)
    ckpt = S.list_checkpoints(str(run))[-1]
    state = torch.load(ckpt + "/trainer_state.pt", weights_only=True)
    assert state["script"] == "scalerl.py"
    before = snapshot(run)

    def resumed_with(steps=("--steps", "5"), **change):
        torch.save({**state, **change}, ckpt + "/trainer_state.pt")
        return refused(["--resume", ckpt, *steps], capfd)
    config = state["config"]
    assert resumed_with(config={**config, "kl_coef": 0.1}, script="my_fork.py") == (
        f"--resume {ckpt}: made by my_fork.py: settings this script does not know: --kl-coef; resume it with my_fork.py")
    lacking = {k: v for k, v in config.items() if k not in ("prompts_per_step", "moe")}
    assert resumed_with(config=lacking, script="my_fork.py") == (
        f"--resume {ckpt}: made by my_fork.py: settings it does not have: --moe, --prompts-per-step; resume it with "
        "my_fork.py")
    assert resumed_with(config={**config, "max_lag": "8", "think_budget": 5, "lm_head_fp32": "yes"}) == (
        f"--resume {ckpt}: its settings are not as this script writes them: max_lag '8' (not int), think_budget 5 (not "
        "two integers), lm_head_fp32 'yes' (not bool); the checkpoint is damaged, or another script's")
    assert resumed_with(config={k: v for k, v in config.items() if k != "steps"}, steps=()) == (
        f"--resume {ckpt}: its settings do not say how many steps the run takes: give --steps N")
    for part, damaged in (("totals", {}), ("scheduler", {}), ("ranks", [{**state["ranks"][0], "torch_rng": None}]),
                          ("ranks", [{**state["ranks"][0], "curriculum": {}}])):
        assert resumed_with(**{part: damaged}) == (f"--resume {ckpt}: trainer_state.pt is damaged or not this "
                                                   f"script's: {part} missing or not as this script writes it")
    with open(ckpt + "/trainer_state.pt", "wb") as f:  # (the test's own changes undone: nothing else changed)
        f.write(before[os.path.relpath(ckpt, run) + "/trainer_state.pt"])
    assert snapshot(run) == before


class Pwn:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


# ---------------------------------------------------------------------------------------------- one run per directory
TINY = ["--engine", "hf", "--prompts-per-step", "2", "--generations-per-prompt", "2", "--max-new-tokens", "8",
        "--eval-samples", "1", "--val-size", "4", "--train-size", "32", "--no-live-fit"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run of 3 tiny steps with a checkpoint each (--save-every 1 --keep-last 10), made once: each test copies it."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
        S.run(S.parse_args([*TINY, "--steps", "3", "--save-every", "1", "--keep-last", "10", "--out", str(out)]))
    return out


def run_copy(run, tmp_path, name="run"):
    import shutil
    return shutil.copytree(run, tmp_path / name)


def refused(argv, capfd, status=2):
    """The one line (less its prefix) with which scalerl's main() refuses argv, with that exit status."""
    code, out, err = main_in_process([str(a) for a in argv], capfd)
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1 and lines[0].startswith("scalerl.py: error: "), (code, err)
    return lines[0][len("scalerl.py: error: "):]


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_resume_keeps_every_setting_and_the_continue_with_line_reproduces_the_run(tiny_run, tmp_path, monkeypatch,
                                                                                   capsys):
    """A run of --save-every 1 --keep-last 10 stopped by SIGTERM (here: as step 4 ends) says how to go on: that
    command, its paths quoted (the directory's name has a space), with --steps 6 added, keeps the run's --save-every
    and --keep-last: every checkpoint stays (the older ones byte for byte), one is written at each step, and
    config.json still says so."""
    run = run_copy(tiny_run, tmp_path, "my run")
    older = {k: v for k, v in snapshot(run).items() if k.startswith("checkpoints/step_")}
    signalled = S.Guard.signalled
    monkeypatch.setattr(S.Guard, "signalled", lambda self: self.done == 4 and not self.stop.append("SIGTERM"))
    S.run(S.parse_args(["--resume", "auto", "--out", str(run), "--steps", "30"]))
    monkeypatch.setattr(S.Guard, "signalled", signalled)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("SIGTERM: stopped after step 4")]
    cmd = shlex.split(line.split("continue with: ")[1])
    assert cmd == [sys.executable, os.path.join(HERE, "scalerl.py"), "--resume", "auto", "--out", str(run)]
    S.main(cmd[2:] + ["--steps", "6"])
    assert [os.path.basename(c) for c in S.list_checkpoints(str(run))] == [f"step_{k:06d}" for k in range(1, 7)]
    assert {k: v for k, v in snapshot(run).items() if k in older} == older
    config = json.load(open(run / "config.json"))
    assert (config["save_every"], config["keep_last"], config["steps"]) == (1, 10, 6)
    assert [r["step"] for r in read_metrics(str(run))] == list(range(7))


LOCK_HOLDER = """
import fcntl, os, sys, time
for path in sys.argv[1:]:  # as a run holds its directory's lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_a_run_directory_is_locked_by_its_run(tiny_run, tmp_path, capfd):
    """A run holds an exclusive flock on OUT/.lock from its first write to its exit: another process into the same
    directory (here one that holds the lock as a run does) is refused in one line naming its PID, before anything is
    written: a resume of the run, and a new run into an empty directory. The default --out names the process, so two
    runs started in the same second write apart."""
    run, empty = run_copy(tiny_run, tmp_path), tmp_path / "empty"
    empty.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, run / ".lock", empty / ".lock"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(tmp_path)
        for argv, out in ((["--resume", "auto", "--steps", "5"], run), (TINY, empty)):
            assert refused([*argv, "--out", out], capfd) == f"--out {out} is in use by process {holder.pid}, whose " \
                "run it is: one run per directory; wait for it to end, or choose another --out"
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    assert re.fullmatch(rf".*/runs/\d{{8}}-\d{{6}}-{os.getpid()}", checked(["--engine", "hf"]).out)


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_a_run_writes_nothing_into_what_is_not_its_own(tiny_run, tmp_path, capfd):
    """Refused in one line before anything is written, every file left byte for byte: a new run or a branch into a
    directory with checkpoints but no metrics.jsonl, or with files that are not a run; an --out inside a checkpoint
    (a new run, and a branch); a checkpoint outside RUN/checkpoints/ resumed without --out (its grandparent is no run
    of it)."""
    import shutil
    run, ckpts, proj = run_copy(tiny_run, tmp_path), tmp_path / "ckpts", tmp_path / "proj"
    shutil.copytree(run / "checkpoints", ckpts / "checkpoints")
    (proj / "downloads").mkdir(parents=True)
    (proj / "config.json").write_text('{"the user\'s": "own"}')
    shutil.copytree(run / "checkpoints" / "step_000003", proj / "downloads" / "step_000003")
    step2, step3 = run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000003"
    before = snapshot(tmp_path)
    for argv, message in [
            ([*TINY, "--out", ckpts], f"--out {ckpts} holds checkpoints but no metrics.jsonl, which is not a run of "
                                      "this script: a run starts in a new or empty directory"),
            (["--resume", step2, "--out", ckpts], f"--out {ckpts} holds checkpoints but no metrics.jsonl"),
            ([*TINY, "--out", proj], f"--out {proj} holds config.json, downloads, which is not a run of this script"),
            ([*TINY, "--out", step3], f"--out {step3} is inside the checkpoint {step3}: a run writes beside its "
                                      "checkpoints, never in one"),
            (["--resume", step2, "--out", step3 / "sub"], f"--out {step3 / 'sub'} is inside the checkpoint {step3}"),
            (["--resume", proj / "downloads" / "step_000003", "--steps", "5"],
             f"--resume {proj / 'downloads' / 'step_000003'}: not in a run's checkpoints directory "
             "(RUN/checkpoints/step_N), so there is no run to continue: pass --out DIR, a new directory for the run")]:
        assert refused(argv, capfd).startswith(message)
    assert snapshot(tmp_path) == before


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_a_flag_typed_on_resume_is_refused_unless_it_changes_only_the_outputs(tiny_run, tmp_path, capfd):
    """What a resumed run changes is what was typed: --prompts-per-step 32 --generations-per-prompt 16 (their
    defaults) on a 2 x 2 run are refused, so is --engine vllm on an hf run, naming the run's values, and nothing is
    written; --verbose and --save-completions, which change only the display and the outputs, are taken."""
    run = run_copy(tiny_run, tmp_path)
    before, resume = snapshot(run), ["--resume", "auto", "--out", run, "--steps", "4"]
    assert refused([*resume, "--prompts-per-step", "32", "--generations-per-prompt", "16"], capfd).endswith(
        "typed now with other values: --prompts-per-step 32 (the run's: 2), --generations-per-prompt 16 (the run's: 2)")
    if importlib.util.find_spec("vllm"):
        assert refused([*resume, "--engine", "vllm"], capfd).endswith("--engine vllm (the run's: hf)")
    assert snapshot(run) == before
    S.run(S.parse_args([*map(str, resume), "--verbose", "--save-completions"]))
    assert os.listdir(run / "completions") == ["step_000004.jsonl"]
    assert json.load(open(run / "config.json"))["save_completions"] is True


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_every_damaged_file_of_a_run_is_one_line_naming_it(tiny_run, tmp_path, capfd):
    """Resuming a run with a damaged file stops in one line (exit 2) naming the file and what is wrong, and writes
    nothing: a metrics row that is JSON but not a step ({}, [1, 2]); a trainer_state.pt truncated, empty, a plain
    pickle, in torch's legacy format, or without a key the run needs; a model.safetensors whose header is broken; a
    checkpoint's config.json that no model class reads (named as the checkpoint, not as --model)."""
    import io
    import pickle
    run = run_copy(tiny_run, tmp_path)
    ckpt = run / "checkpoints" / "step_000003"
    metrics, trainer, weights = run / "metrics.jsonl", ckpt / "trainer_state.pt", ckpt / "model.safetensors"
    rows, state, good = metrics.read_text().splitlines(), torch.load(trainer, weights_only=True), trainer.read_bytes()
    legacy, partial = io.BytesIO(), io.BytesIO()
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    torch.save({k: v for k, v in state.items() if k != "ranks"}, partial)
    unreadable = f"--resume {ckpt}: trainer_state.pt is damaged or not this script's: torch.load cannot read it ("
    for path, damage, message in [
            (metrics, "\n".join([rows[0], "{}", *rows[2:]]), f"{metrics}: line 2 is not a metrics row (JSON, but not "
                                                             "an object with an integer step)"),
            (metrics, "\n".join([*rows[:3], "[1, 2]", rows[3]]), f"{metrics}: line 4 is not a metrics row (JSON"),
            (trainer, good[:len(good) // 2], unreadable),
            (trainer, b"", unreadable),
            (trainer, pickle.dumps(state), unreadable),
            (trainer, legacy.getvalue(), unreadable),
            (trainer, partial.getvalue(), f"--resume {ckpt}: trainer_state.pt is damaged or not this script's: ranks "
                                          "missing or not as this script writes it"),
            (weights, b"\xff" * 8 + weights.read_bytes()[8:], f"--resume {ckpt}: model.safetensors is damaged "
                                                              "(Error while deserializing header"),
            (ckpt / "config.json", "{}", f"cannot load the checkpoint --resume {ckpt} (config.json): Unrecognized "
                                         "model"),
            (ckpt / "config.json", (ckpt / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": '
                                                                              '"big"'),
             f"cannot load the checkpoint --resume {ckpt} (config.json): "),  # (a TypeError inside transformers)
            (ckpt / "tokenizer.json", "{\n", f"cannot load the checkpoint --resume {ckpt} (its tokenizer: "
                                             "tokenizer.json, tokenizer_config.json): ")]:
        kept = path.read_bytes()
        path.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
        before = snapshot(run)
        assert refused(["--resume", "auto", "--out", run, "--steps", "4"], capfd).startswith(message)
        assert snapshot(run) == before
        path.write_bytes(kept)


def test_nothing_of_a_run_is_lost_to_a_failed_resume_an_incomplete_checkpoint_or_a_planted_lock(
        tiny_run, tmp_path, monkeypatch, capfd):
    """A checkpoint without trainer_state.pt (optimiser state deleted to save space) is named and refused, not written
    over by the resumed run. A resume that fails at its start (here: --wandb, not logged in; then a failure in its first
    step) leaves metrics.jsonl and config.json as they were: they are rewritten with the first row of its own. A
    .lock planted as a symbolic link is refused and the file it points to keeps its bytes. A half-written checkpoint
    (a killed writer's step_N.tmpPID) is removed by the next run in the directory once it holds it, which says so."""
    run = run_copy(tiny_run, tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / "step_000003" / "trainer_state.pt").unlink()
    before = snapshot(run)
    assert refused(["--resume", "auto", "--out", run, "--steps", "5"], capfd) == (
        f"{ckpts / 'step_000003'} is an incomplete checkpoint (no trainer_state.pt): a run in {run} would write over "
        "it; move it out of the checkpoints directory (or delete it), then run again")
    assert snapshot(run) == before
    shutil.rmtree(ckpts / "step_000003")  # rows 0-3, the newest checkpoint at step 2
    (ckpts / "step_000002.tmp4242").mkdir()  # and what a writer killed mid-write left
    (ckpts / "step_000002.tmp4242" / "model.safetensors").write_bytes(b"half")
    before = snapshot(run)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no W&B login here
    for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(k, raising=False)
    assert refused(["--resume", "auto", "--out", run, "--steps", "5", "--wandb", "proj"], capfd) == (
        "--wandb proj: not logged in to Weights & Biases: run `wandb login` (or set WANDB_API_KEY), or log offline with "
        "WANDB_MODE=offline")
    monkeypatch.setattr(S, "rl_step", lambda state, cfg: (_ for _ in ()).throw(RuntimeError("the engine died")))
    with pytest.raises(RuntimeError, match="the engine died"):
        S.run(S.parse_args(["--resume", "auto", "--out", str(run), "--steps", "5"]))
    assert f"removed {ckpts / 'step_000002.tmp4242'}, a checkpoint whose writing did not finish" in capfd.readouterr().out
    assert {k: v for k, v in snapshot(run).items() if "vllm-start" not in k} == \
        {k: v for k, v in before.items() if ".tmp4242" not in k}
    monkeypatch.undo()
    victim, new = tmp_path / "victim.txt", tmp_path / "new"
    victim.write_text("the user's own")
    new.mkdir()
    (new / ".lock").symlink_to(victim)
    assert refused([*TINY, "--out", new], capfd) == (
        f"--out {new}: .lock cannot be opened as the run's lock (Too many levels of symbolic links): a run's lock is a "
        f"plain file it makes itself; remove {new / '.lock'}")
    assert victim.read_text() == "the user's own"


def test_a_complete_checkpoint_whose_rename_was_cut_short_is_finished_never_lost(tmp_path, monkeypatch, capfd):
    """A second Ctrl-C that lands after step 1's checkpoint is written but before its rename (here: raised by the
    rename itself, once): the rename is finished on the way out, and the message names the checkpoint's writing as
    what was abandoned, with the checkpoint. A leftover step_N.tmpPID that holds a complete checkpoint (the writer
    killed between the two renames) is what --resume auto resumes, renamed into place by the run that holds the lock.
    (Before: the run said 'step 2 abandoned ... last checkpoint: none', and --resume auto found no checkpoint.)"""
    out, real = tmp_path / "run", S.finish_checkpoint
    calls = []
    monkeypatch.setattr(S, "finish_checkpoint", lambda tmp, final: real(tmp, final) if calls or calls.append(1) else (
        _ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        S.run(S.parse_args([*TINY, "--steps", "2", "--save-every", "1", "--out", str(out)]))
    step1 = out / "checkpoints" / "step_000001"
    assert f"writing the checkpoint of step 1 abandoned; 1 steps are in {out}/metrics.jsonl; last checkpoint: {step1}" \
        in capfd.readouterr().err
    assert S.list_checkpoints(str(out)) == [str(step1)] and run_entries(out) == ["step_000001"]
    monkeypatch.undo()
    os.rename(step1, step1.parent / "step_000001.tmp4242")  # killed between its two renames
    rows = S.run(S.parse_args(["--resume", "auto", "--out", str(out), "--steps", "2"]))
    assert f"{step1}: a complete checkpoint whose rename was cut short, renamed" in capfd.readouterr().out
    assert [r["step"] for r in rows] == [0, 1, 2] and [os.path.basename(c) for c in S.list_checkpoints(str(out))] == [
        "step_000001", "step_000002"]


@pytest.mark.parametrize("limit,error", [(1 << 20, "File too large"), (3 << 20, "enforce fail")])
def test_a_checkpoint_that_fills_the_disk_is_one_line_and_leaves_nothing_behind(tmp_path, limit, error):
    """A checkpoint write that runs out of room (here the file size limit, ulimit -f: 1 MiB stops the weights in
    safetensors, 3 MiB the optimiser state in torch.save; neither raises an OSError) stops the run in one line with
    what the checkpoint needs and what is free, exit 1; its temporary directory is gone and the rows are kept."""
    import resource
    out = tmp_path / "run"
    S.build_tiny_model(str(tmp_path / "cache" / "scalerl"), 0, False)  # (the model, before the limit)
    p = subprocess.run([sys.executable, os.path.join(HERE, "scalerl.py"), *TINY, "--steps", "1", "--out", str(out),
                        "--no-zero-variance-filter"],  # (an update: AdamW's moments in the checkpoint, 4.3 MB)
                       capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-2000:]
    assert re.fullmatch(rf"scalerl.py: error: cannot write checkpoint {out}/checkpoints/step_000001 \(.*{error}.*\): "
                        r"it needs about [\d.]+ GB \(the weights and AdamW's moments\), [\d.]+ GB is free there; the part "
                        r"written is removed, and the last good checkpoint is none", lines[0]), lines[0]
    assert run_entries(out) == [] and len(read_metrics(out)) == 2


def test_resume_takes_the_runs_own_values_and_a_moved_data_file(tmp_path, capfd):
    """A flag typed on resume is checked against the run's settings, not the defaults: --data (the run's own file) with
    the run's --model, --think-budget 12 14 with the run's --max-new-tokens 16. A data file that moved: the resume says
    its path is gone and how to give the new one; the new path, with the run's content (its sha256 in the checkpoint),
    is taken; another file is refused, naming both."""
    model = S.build_tiny_model(str(tmp_path / "models"), 0, False)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                            for a in range(8) for b in range(8)))
    run = tmp_path / "run"
    flags = ["--model", model, "--data", data, "--reward", "exact", "--reward-workers", "1", "--val-size", "8",
             "--max-new-tokens", "16", "--think-budget", "12", "14", "--steps", "1", *TINY[:6], "--eval-samples", "1"]
    S.run(S.parse_args([*map(str, flags), "--out", str(run)]))
    resume = ["--resume", "auto", "--out", run, "--steps", "2"]
    cfg, _ = S.config_in_force(S.parse_args([*map(str, resume), "--data", str(data), "--think-budget", "12", "14"]))
    assert cfg.data == str(data) and cfg.think_budget == (12, 14) and cfg.model == model
    moved, other = tmp_path / "moved.jsonl", tmp_path / "other.jsonl"
    data.rename(moved)
    assert refused(resume, capfd) == (f"--resume {run}/checkpoints/step_000001: the run's --data {data} is gone: if "
                                      "it moved, resume with --data NEW_PATH (its content is checked against the run's)")
    other.write_text(moved.read_text().replace('"answer": 14', '"answer": 15'))
    assert refused([*resume, "--data", other], capfd).startswith(
        f"--data {other}: not the data the run trained on ({data}, sha256 ")
    rows = S.run(S.parse_args([*map(str, resume), "--data", str(moved)]))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert json.load(open(run / "config.json"))["data"] == str(moved)


def test_messages_that_said_the_wrong_thing_say_what_to_do(tmp_path, monkeypatch, capfd):
    """The embedded model's cached copy, damaged, is named as such with the way out (the user gave no --model); a
    checkpoint without a tokenizer says so, not "install sentencepiece"; a context too short names the longest prompt
    and the --max-new-tokens that fits (which then runs); a data answer of 400 digits is written out, and an answer
    with an unclosed \\boxed{ names its line; a Ctrl-C while the model loads says what became of the directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = S.build_tiny_model(str(tmp_path / "cache" / "scalerl"), 0, False)
    config = open(os.path.join(cached, "config.json")).read()
    open(os.path.join(cached, "config.json"), "w").write("{")
    assert re.fullmatch(rf"cannot load the embedded model's cached copy {cached} \(config\.json: .*\): delete that "
                        "directory, and the next run builds it again", refused([*TINY, "--out", tmp_path / "a"], capfd))
    open(os.path.join(cached, "config.json"), "w").write(config)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(cached, ckpt)
    for name in S.TOKENIZER_FILES:
        with contextlib.suppress(FileNotFoundError):
            (ckpt / name).unlink()
    with pytest.raises(S.ScaleRLError, match=rf"cannot load --model {ckpt} \(its tokenizer\): no tokenizer: none of "
                                             "tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json"):
        S.load_tokenizer(S.Config(model=str(ckpt)))
    assert refused([*TINY, "--max-new-tokens", "300", "--out", tmp_path / "b"], capfd) == (
        "--max-new-tokens 300 leaves no room for a prompt: the model has 256 positions, prompt and completion together")
    message = refused([*TINY, "--max-new-tokens", "250", "--out", tmp_path / "b"], capfd)
    assert re.fullmatch(r"prompts \+ completions need (\d+) positions and the model has 256: the longest prompt, \d+ "
                        r"tokens \('.*'\), and \d+ of completion \(--max-new-tokens 250, and the interruption phrase\): "
                        r"lower --max-new-tokens to (\d+)", message), message
    fits = re.search(r"to (\d+)$", message).group(1)
    rows = S.run(S.parse_args([*TINY, "--max-new-tokens", fits, "--steps", "0", "--out", str(tmp_path / "c")]))
    assert rows[0]["step"] == 0
    assert S.gold_answer(10**400) == "1" + "0" * 400
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": 10**400}) + "\n" + json.dumps(
        {"prompt": "q", "answer": "so \\boxed{5"}) + "\n")
    with pytest.raises(S.ScaleRLError, match=r"line 2: 'answer' has a \\boxed\{ that is not closed \('so "):
        S.load_rows(str(data), S.Config(model="m", data=str(data)))
    monkeypatch.setattr(S, "load_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    code, _, err = main_in_process([*TINY, "--out", str(tmp_path / "e")], capfd)
    assert code == 130 and err.strip() == f"interrupted while starting: {tmp_path / 'e'}, which this run made, is " \
                                          "removed" and not (tmp_path / "e").exists()


def test_an_out_that_is_a_broken_symbolic_link_is_one_line(tmp_path, capfd):
    """--out a symbolic link to nothing, a loop of links, or a path under either: refused in one line, exit 2 (they
    were tracebacks from makedirs), nothing written."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    before = sorted(os.listdir(tmp_path))
    for out, link, target in ((tmp_path / "dangling", "dangling", tmp_path / "nowhere"),
                              (tmp_path / "loop", "loop", tmp_path / "loop"),
                              (tmp_path / "dangling" / "run", "dangling", tmp_path / "nowhere")):
        assert refused([*TINY, "--out", out], capfd) == (
            f"--out {out}: {tmp_path / link} is a symbolic link to {target}, which does not resolve (a missing target "
            "or a loop): point it at a directory, or choose another --out")
    assert sorted(os.listdir(tmp_path)) == before and not (tmp_path / "nowhere").exists()


@pytest.mark.xdist_group("tiny_run")  # (the run made once, for them all)
def test_outputs_that_cannot_be_written_are_refused_before_anything_is_written(tiny_run, tmp_path, monkeypatch,
                                                                               capfd):
    """A metrics.jsonl that cannot be written, and --save-completions where completions is a file or cannot be
    written (this process is root here: not writable is what os.access says): refused in one line before anything is
    written, so no metrics.jsonl.tmp, config.json as it was, and no empty metrics.jsonl to block a rerun. A
    metrics.jsonl that fails all the same (here its rename) stops the run in one line, exit 1, with no temporary file
    and config.json not rewritten."""
    run, other = run_copy(tiny_run, tmp_path), tmp_path / "other"
    before, resume, access, unwritable = snapshot(run), ["--resume", "auto", "--out", run, "--steps", "4"], os.access, []
    monkeypatch.setattr(S.os, "access", lambda path, mode: access(path, mode) and os.path.basename(path) not in unwritable)
    unwritable.append("metrics.jsonl")
    assert refused(resume, capfd) == f"--out {run}: {run / 'metrics.jsonl'} is not a writable file; the run cannot " \
                                     "write its rows there"
    unwritable[:] = ["completions"]
    (run / "completions").mkdir()
    assert refused([*resume, "--save-completions"], capfd) == f"--save-completions: {run / 'completions'} is not a " \
                                                               "writable directory"
    (run / "completions").rmdir()
    (run / "completions").write_text("a file")
    assert refused([*resume, "--save-completions"], capfd).startswith("--save-completions: ")
    other.mkdir()
    (other / "completions").write_text("a file")
    assert refused([*TINY, "--save-completions", "--out", other], capfd).startswith(f"--out {other} holds completions")
    (run / "completions").unlink()
    assert snapshot(run) == before and os.listdir(other) == ["completions"]
    replace = os.replace
    monkeypatch.setattr(S.os, "replace", lambda a, b: replace(a, b) if not str(b).endswith("metrics.jsonl") else
                        (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    assert refused(resume, capfd, status=1) == f"{run / 'metrics.jsonl'}: cannot write it (Permission denied)"
    assert snapshot(run) == before  # (the lock file names this process, which made the run too)


def test_bench_refuses_in_one_line_before_writing_and_names_a_failed_seeds_error(tmp_path, monkeypatch, capfd):
    """bench.py --real-model and --loo: a model that is not there, --seeds below 1 (-1 was an IndexError, 0 became
    the default), --summary-only on a missing or an empty directory: one line each, exit 2, nothing written. A seed
    whose run fails (here: too few prompts for its --prompts-per-step) stops the study with the run's own error."""
    import bench as B
    out, empty = tmp_path / "study", tmp_path / "empty"
    empty.mkdir()
    model = S.build_tiny_model(str(tmp_path / "models"), 0, False)

    def bench(*argv):
        monkeypatch.setattr(sys, "argv", ["bench.py", *map(str, argv)])
        capfd.readouterr()
        with pytest.raises(SystemExit) as e:
            B.main()
        return e.value.code, capfd.readouterr().err.strip().splitlines()
    for argv, message in [
            (["--real-model", "/no/such/model"], "--model /no/such/model: no such model directory"),
            (["--real-model", model, "--seeds", "-1"], "--seeds must be >= 1 (got -1)"),
            (["--loo", "--seeds", "0"], "--seeds must be >= 1 (got 0)"),
            (["--real-model", model, "--summary-only"], f"--summary-only: no run to summarise in {out / 'seed0'} "
                                                        "(metrics.jsonl missing or empty)"),
            (["--loo", "--summary-only"], f"--summary-only: no run to summarise in {out / 'scalerl' / 'seed0'}")]:
        for where in (out, empty):
            code, lines = bench(*argv, "--out", where)
            where_msg = message.replace(str(out), str(where))
            assert code == 2 and len(lines) == 1 and lines[0].startswith(f"bench.py: error: {where_msg}"), lines
    assert not out.exists() and os.listdir(empty) == []
    scalerl_runs_in_process(monkeypatch, B)
    monkeypatch.setattr(B, "REAL_FLAGS", ["--engine", "hf", "--reward", "exact", "--reward-workers", "0",
                                          "--prompts-per-step", "5000"])
    code, _ = bench("--real-model", model, "--out", out, "--seeds", "1")
    n_train = len(open(out / "data" / "train.jsonl").readlines())  # (what the study wrote before the seed's run)
    assert code.startswith("real-model: seed 0 failed (exit 2): scalerl.py: error: --prompts-per-step 5000 exceeds the "
                           f"{n_train} training prompts left in") and code.endswith(f"; its output is in {out / 'seed0'}.log")


def test_closing_an_engine_asleep_wakes_it_first():
    """vLLM frees, at shutdown, memory that sleep freed already (CUDA errors beside the real one): close() wakes an
    engine asleep first, whatever the wake-up raises, and only an engine asleep."""
    for asleep, fails in ((True, False), (True, True), (False, False)):
        calls = []

        def wake_up():
            calls.append("wake_up")
            if fails:
                raise RuntimeError("CUDA error")
        e = S.VLLMEngine.__new__(S.VLLMEngine)
        core = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: calls.append("shutdown")))
        e.asleep, e.llm = asleep, types.SimpleNamespace(wake_up=wake_up, llm_engine=core)
        e.close()
        assert calls == (["wake_up", "shutdown"] if asleep else ["shutdown"])
        assert not e.asleep


def test_a_silent_generator_stops_the_split_after_generator_timeout():
    """A generator alive but silent stops the run after --generator-timeout seconds (status 1, resumable); without it
    the wait is 900 s, or 0.5 s per --max-new-tokens token where that is more."""
    import queue
    split = generators.SplitEngine.__new__(generators.SplitEngine)
    split.gens = {0: generators.Generator(types.SimpleNamespace(is_alive=lambda: True, pid=1), None)}  # alive, silent
    split.results = queue.Queue()
    split.cfg, split.error = S.Config(generators=1, generator_timeout=0.2), S.ScaleRLError
    with pytest.raises(S.ScaleRLError, match=r"no word from the generators in 0.2 s \(--generator-timeout\)") as e:
        split.receive()
    assert e.value.status == 1 and e.value.resumable
    split.results.put(generators.Report(0, [], 0, 0, 0, 0, 0, 0))
    assert split.receive() == generators.Report(0, [], 0, 0, 0, 0, 0, 0)
    help_ = S.Config.__dataclass_fields__["generator_timeout"].metadata["help"]
    assert "0: 900, or 0.5 s per --max-new-tokens token" in help_
    clock = iter(range(0, 10**6, 1000))  # a clock that moves 1000 s a reading: the default waits, in two seconds
    S_time = types.SimpleNamespace(time=lambda: next(clock))
    for tokens, wait in ((8, 900), (4000, 2000)):
        split.cfg = S.Config(generators=1, max_new_tokens=tokens)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(generators, "time", S_time)
            with pytest.raises(S.ScaleRLError, match=f"no word from the generators in {wait} s"):
                split.receive()


def qwen2_params(V, H, L, I, heads, kv, tied):
    """Qwen2's parameters by hand: embedding, per layer q/k/v (with biases), o, the gated MLP and two norms, the final
    norm, and an untied head. Returns (all, one layer's)."""
    d = H // heads
    layer = (H * H + H) + 2 * (H * kv * d + kv * d) + H * H + 3 * H * I + 2 * H
    return V * H + L * layer + H + (0 if tied else V * H), layer


QWEN = {"0.5b": (151936, 896, 24, 4864, 14, 2, True), "7b": (152064, 3584, 28, 18944, 28, 4, False)}
GiB, H100 = 2**30, 79.2 * 2**30


def qwen_sizes(name):
    from transformers import Qwen2Config
    V, H, L, I, heads, kv, tied = QWEN[name]
    return memory.model_sizes(Qwen2Config(vocab_size=V, hidden_size=H, num_hidden_layers=L, intermediate_size=I,
                                     num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied))


@pytest.mark.quick
@pytest.mark.parametrize("name, ranks, checkpointing", [("0.5b", 1, True), ("7b", 8, True), ("7b", 8, False)])
def test_memory_plan_by_hand(name, ranks, checkpointing):
    """The plan's terms from the sizes by hand (float32 weights, bf16 compute, 8,192-token micro-batches, 1,024-token
    head chunks): what stays, 16 bytes a parameter over the ranks and under torchrun the whole root (embedding and an
    untied head, float32); kept for backward, each layer's float32 input and three more H-wide rows a token with
    checkpointing, else 37 H + 8 I bytes a token and layer and the layers' bf16 casts; the largest transient (the head's
    backward: 16 bytes x chunk x V, the float32 V x H weight gradient, twice for an untied sharded head, 4 H a token, a
    gathered layer; a layer's backward: 2.25 x (37 H + 8 I) a token and three layers; AdamW's step: a moment); the
    reserve, 2 GiB + 10%; the engine's share and its estimate of the KV cache (H100-class: 16,384 tokens and 1,024
    sequences profiled, the sampler's 28 bytes a row and vocabulary entry the larger)."""
    V, H, L, I, heads, kv, tied = QWEN[name]
    n, layer = qwen2_params(V, H, L, I, heads, kv, tied)
    sizes = qwen_sizes(name)
    assert (sizes["params"], sizes["layer"], sizes["L"], sizes["tied"]) == (n, layer, L, tied)
    cfg = S.fill_defaults(S.Config(model="org/name", activation_checkpointing=checkpointing))
    sharded, T = ranks > 1, 8192
    plan = memory.memory_plan(sizes, cfg, ranks, H100, 1500, sharded=sharded)
    assert plan["weights"] == plan["gradients"] == 4 * n / ranks and plan["adam"] == 8 * n / ranks
    assert plan["root"] == (4 * V * H * (1 if tied else 2) if sharded else 0)
    kept = (L + 3) * T * H * 4 if checkpointing else L * T * (37 * H + 8 * I) + L * layer * 2 + 3 * T * H * 4
    assert plan["activations"] == kept
    head = 16 * 1024 * V + 4 * V * H * (2 if sharded and not tied else 1) + 4 * T * H + 4 * layer * sharded
    phases = {"head backward": head, "AdamW step": 4 * n / ranks - kept}
    if checkpointing:
        phases["layer backward"] = 2.25 * T * (37 * H + 8 * I) + 4 * layer * (3 if sharded else 0)
    assert plan["phase"] == max(phases, key=phases.get) and plan["transient"] == pytest.approx(max(phases.values()))
    trainer = 16 * n / ranks + plan["root"] + kept + max(phases.values()) + 64 * 2**20
    assert plan["trainer"] == pytest.approx(trainer) and plan["reserve"] == pytest.approx(2 * GiB + 0.1 * trainer)
    profile = max(16384 * 2 * (3 * I + 4 * H), 28 * 1024 * V)
    assert plan["kv"] == pytest.approx(0.3 * H100 - 2 * n - 4 * V * H - profile - 1.5 * GiB)
    assert plan["kv_token"] == 2 * L * kv * (H // heads) * 2
    assert plan["left"] == pytest.approx(H100 - trainer - plan["reserve"] - 0.3 * H100)
    line = memory.plan_line(plan, cfg, H100)
    assert line.startswith("scalerl: memory plan per GPU (79.2 GiB): trainer ") and f"{plan['phase']} " in line
    # the README's 7B command (8 ranks, checkpointing) fits; without checkpointing it does not; 0.5B fits one GPU
    assert (memory.plan_error(sizes, cfg, ranks, H100, 1500, sharded) is None) == checkpointing
    # a fork whose token_terms gives a second term over the vocabulary (docs/fork.md's entropy): 16 bytes more a logit
    more = memory.memory_plan({**sizes, "terms": 2}, cfg, ranks, H100, 1500, sharded=sharded)
    assert more["trainer"] - plan["trainer"] == (16 * 1024 * V if plan["phase"] == "head backward" else
                                                 max(0, head + 16 * 1024 * V - max(phases.values())))


@pytest.mark.quick
def test_memory_plan_refusals_by_hand():
    """Each refusal names its figures and what would fit: the 7B model's resident state on one 80 GB GPU (16 bytes a
    parameter, 113.5 GiB) and the smallest number of ranks whose whole plan fits (the plan there fits, one rank fewer
    does not); its whole plan on 8 ranks without activation checkpointing; the 0.5B model's KV cache at a small share
    and a 16,000-token sequence, with the share that would hold it."""
    sizes, cfg = qwen_sizes("7b"), S.fill_defaults(S.Config(model="org/name"))
    error = memory.plan_error(sizes, cfg, 1, H100, 1500, sharded=False)
    need = int(re.search(r"use at least (\d+) ranks \(torchrun --nproc-per-node \1, by the whole plan\)",
                         error).group(1))
    assert memory.memory_plan(sizes, cfg, need, H100, 1500, True)["left"] >= 0 > \
        memory.memory_plan(sizes, cfg, need - 1, H100, 1500, True)["left"]
    assert error.startswith(f"memory plan: the trainer's weights, gradients and AdamW moments need "
                            f"{16 * sizes['params'] / GiB:.1f} GiB a GPU (7.62B parameters in float32), and ")
    assert need == 4  # by the plan of this commit: 3 ranks leave too little beside the engine's share
    whole = S.fill_defaults(S.Config(model="org/name", activation_checkpointing=False))
    error = memory.plan_error(sizes, whole, 8, H100, 1500, sharded=True)
    plan = memory.memory_plan(sizes, whole, 8, H100, 1500, True)
    assert error.startswith(f"memory plan: the trainer needs {plan['trainer'] / GiB:.1f} GiB a GPU at its peak ") and \
        error.endswith("or lower --micro-batch-tokens or --logprob-chunk, or turn on --activation-checkpointing")
    small, gpu = qwen_sizes("0.5b"), 24 * GiB
    low = S.fill_defaults(S.Config(model="org/name", vllm_gpu_memory_utilization=0.17))
    plan = memory.memory_plan(small, low, 1, gpu, 16000)
    kv = 0.17 * gpu - 2 * small["params"] - 4 * 151936 * 896 - 28 * 256 * 151936 - 1.5 * GiB  # (under 70 GiB: 256)
    assert plan["kv"] == pytest.approx(kv) and 0 < kv < 16000 * plan["kv_token"] and plan["left"] > 0
    share = 0.17 + (16000 * plan["kv_token"] - kv) / gpu
    assert memory.plan_error(small, low, 1, gpu, 16000) == (
        f"memory plan: vLLM's KV cache would hold ~{kv / GiB:.1f} GiB (an estimate: its share, less its weights, the "
        f"float32 head, the profiling peak and CUDA graphs), less than one longest prompt + completion (16000 tokens, "
        f"{16000 * plan['kv_token'] / GiB:.1f} GiB): raise --vllm-gpu-memory-utilization to {share:.2f} or more, lower "
        "--vllm-max-num-seqs, or give the engine GPUs of its own (--generators)")
    roomier = S.fill_defaults(S.Config(model="org/name", vllm_gpu_memory_utilization=share + 0.01))
    assert memory.plan_error(small, roomier, 1, gpu, 16000) is None
    hf = memory.memory_plan(small, S.fill_defaults(S.Config(model="org/name", engine="hf")), 1, gpu, 1500)
    # no share: the KV cache and float32 logits of the 200 x 8 sequences an evaluation generates at once
    assert hf["engine"] == 1600 * (1500 * 2 * 24 * 2 * 64 * 2 + 8 * 151936) and "kv" not in hf or hf["kv"] == 0


MOE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=32, num_experts_per_tok=4,
           tie_word_embeddings=False)  # a small Qwen3-MoE whose attention (8 x 128) is wider than its hidden size


@pytest.mark.quick
def test_memory_plan_of_an_moe_by_hand():
    """An MoE's sizes and what its layers keep, by hand: all its experts' parameters (32 of them, each a gated MLP of
    width 512, fused in 3D), I = the experts' width at top-k (4 x 512, not the dense intermediate_size 1536), the
    attention's width (8 heads x 128); kept for backward a token and layer 37 H + 8 I + 10 (A - H) + 5 k H + 10 E bytes
    (without checkpointing, with every layer's bf16 casts), and with it a layer's backward 2.25 x that a token and,
    beside one gathered layer, the experts' bf16 cast and its gradient. A dense model's sizes have none of it."""
    from transformers import Qwen3MoeConfig
    V, H, Ie, L, heads, kv, d, E, k = 4096, 512, 512, 4, 8, 2, 128, 32, 4
    experts = E * 3 * H * Ie
    layer = H * heads * d + 2 * H * kv * d + heads * d * H + 2 * d + E * H + experts + 2 * H
    sizes = memory.model_sizes(Qwen3MoeConfig(**MOE))
    assert sizes["params"] == 2 * V * H + L * layer + H and sizes["layer"] == layer
    assert (sizes["I"], sizes["k"], sizes["E"], sizes["experts"], sizes["A"]) == (k * Ie, k, E, experts, heads * d)
    T, kept = 8192, 37 * H + 8 * k * Ie + 10 * (heads * d - H) + 5 * k * H + 10 * E
    whole = memory.memory_plan(sizes, S.fill_defaults(S.Config(model="org/name", activation_checkpointing=False)), 1,
                               H100, 1500, sharded=False)
    assert whole["activations"] == L * T * kept + L * layer * 2 + 3 * T * H * 4
    plan = memory.memory_plan(sizes, S.fill_defaults(S.Config(model="org/name")), 2, H100, 1500, sharded=True)
    assert plan["phase"] == "layer backward" and plan["transient"] == pytest.approx(2.25 * T * kept + 3 * 4 * layer
                                                                                    + 2 * 2 * experts)
    dense = qwen_sizes("0.5b")
    assert (dense["I"], dense["k"], dense["E"], dense["experts"], dense["A"]) == (4864, 0, 0, 0, 896)


def test_an_moes_experts_multiply_in_the_autocast_dtype(tmp_path, monkeypatch):
    """A loaded MoE's experts, forced onto autocast's path on a CPU (bf16, as the trainer on CUDA): every grouped
    product takes bf16 operands (transformers' stock function multiplies the float32 master weights in float32, which
    CUDA's fast kernel and fake tensors refuse), its logits and float32 weight gradients those of transformers' eager
    experts (F.linear per expert, which autocast casts) to bf16's rounding; without autocast, float32 products and the
    stock function's logits exactly."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    vocab, path = len(S.make_char_tokenizer()), str(tmp_path / "moe")
    torch.manual_seed(0)
    S.save_atomically(AutoModelForCausalLM.from_config(Qwen3MoeConfig(**{
        **MOE, "hidden_size": 64, "moe_intermediate_size": 32, "head_dim": 16, "num_experts": 8, "num_hidden_layers": 2,
        "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})), S.make_char_tokenizer(), path)
    model = S.load_model(S.Config(model=path), torch.device("cpu"))[0]  # (as setup loads the trainer)
    stock, eager = (AutoModelForCausalLM.from_pretrained(path, experts_implementation=e)
                    for e in ("grouped_mm", "eager"))
    seen, grouped_mm = [], torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda a, b, **kw: seen.append((a.dtype, b.dtype)) or
                        grouped_mm(a, b, **kw))
    x = torch.randint(0, vocab, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        got, want = model(x).logits.float(), eager(x).logits.float()
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)} and len(seen) == 2 * 2  # gate_up and down, 2 layers
    assert (got - want).abs().max() < 2e-2 and got.std() > 0.1
    (got.square().sum() + want.square().sum()).backward()
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        g, w = model.get_parameter(name).grad, eager.get_parameter(name).grad
        assert g.dtype == torch.float32 and (g - w).norm() < 0.02 * w.norm(), name
    seen.clear()
    assert torch.equal(model(x).logits, stock(x).logits) and set(seen) == {(torch.float32, torch.float32)}
    dense = S.load_model(S.Config(model=S.build_tiny_model(str(tmp_path), 0, False)), torch.device("cpu"))[0]
    assert dense.config._experts_implementation == "eager"  # (a dense model: no experts, left as it is)


@pytest.mark.heavy
def test_memory_plan_against_the_tracker_on_small_shapes(tmp_path):
    """bench.py --memory on a small shape (the 135M Llama's, 4 layers; tied) in one process without checkpointing, and
    an untied one on 2 fake ranks with it, and the tied one with it and the split head (its parts on fake tensors take
    CUDA's path), and a small MoE (its experts' grouped product under bf16 autocast: fake tensors refuse float32 ones):
    torch's memory tracker runs the update on fake tensors, and the plan's trainer is 1 to 1.15 times its peak."""
    import bench
    from transformers import LlamaConfig, Qwen3MoeConfig
    configs = []
    for ranks, tied, argv in ((0, True, ["--no-activation-checkpointing"]), (2, False, []),
                              (0, True, ["--fp32-head-product", "split"])):
        d = tmp_path / f"{ranks}{tied}{len(argv)}"
        LlamaConfig(**{**bench.SHAPES["llama-135m"][1], "num_hidden_layers": 4, "tie_word_embeddings": tied}) \
            .save_pretrained(d)
        configs.append([str(d), ranks, 512, ["--micro-batch-tokens", "2048", *argv]])
    d = tmp_path / "moe"  # an MoE (MOE: top-4 of 32 experts, its attention wider than H), without checkpointing
    Qwen3MoeConfig(**MOE).save_pretrained(d)
    configs.append([str(d), 0, 512, ["--micro-batch-tokens", "2048", "--no-activation-checkpointing"]])
    terms = sorted(S.token_terms(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long)))  # (a fork's: the plan counts
    for (_, ranks, _, _), (peak, plan) in zip(configs, bench.memory_rows(configs)):  # each, memory.TERM_PER_LOGIT)
        assert 1 <= plan / peak <= bench.PLAN_BOUND, (ranks, plan / peak, terms)


def test_the_engine_share_leaves_room_for_the_float32_head(tmp_path):
    """On CUDA the float32 head copy is made after vLLM sized its KV cache: its bytes come off the share vLLM gets."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    cfg = S.Config(engine="vllm")
    model, _, path = S.load_model(cfg, torch.device("cpu"))
    V, H = model.config.vocab_size, model.config.hidden_size
    for fp32 in (True, False):
        kw, _ = S.vllm_args(S.Config(lm_head_fp32=fp32), path, torch.device("cuda"), torch.bfloat16, 64,
                            device_bytes=2**30)
        assert kw["gpu_memory_utilization"] == 0.3 - 4 * V * H * fp32 / 2**30


@pytest.mark.quick
def test_activation_checkpointing_gives_the_same_logprobs_and_gradients(tmp_path):
    """--activation-checkpointing (the --model default) recomputes each decoder layer in backward instead of keeping
    its activations: the trainer's log-probs and the gradients are those without it (to 1e-6), and it is on where
    the flag says (a run's setup turns it on in the model)."""
    torch.manual_seed(0)
    samples = [S.Sample(prompt=[1, 5, 7], tokens=[9, 4, 11, 2]), S.Sample(prompt=[1, 8], tokens=[6, 6, 3])]
    got = []
    for on in (False, True):
        model = tiny_model(tied=False)
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        logp = S.sequence_logprobs(model, samples, S.Config(), 0)["logp"]
        (logp * torch.arange(1.0, len(logp) + 1)).sum().backward()
        got.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = got
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert ga.keys() == gb.keys() and all(torch.allclose(ga[k], gb[k], atol=1e-6, rtol=0) for k in ga)
    assert S.fill_defaults(S.Config(model="org/name")).activation_checkpointing is True
    assert S.fill_defaults(S.Config()).activation_checkpointing is False


def test_activation_checkpointing_reaches_the_trained_model(tmp_path, monkeypatch):
    real_setup, models = S.setup, []
    monkeypatch.setattr(S, "setup", lambda cfg: (lambda made: (models.append(made[0].model), made)[1])(real_setup(cfg)))
    for on in (True, False):
        S.run(small_cfg(tmp_path / str(on), engine="hf", steps=1, activation_checkpointing=on, eval_every=100,
                        val_size=8, prompts_per_step=4, length_control="truncate"))
    assert [m.is_gradient_checkpointing for m in models] == [True, False]


@pytest.mark.quick
def test_a_checkpoints_size_and_write_time_by_hand():
    """A checkpoint holds the weights and AdamW's two moments in the param dtype (the 7B model: 91 GB in float32),
    written at 100 MB/s in the estimate that the SIGTERM line gives and that sizes the checkpoint barrier's timeout."""
    model = tiny_model(tied=False)
    n = sum(p.numel() for p in model.parameters())
    assert S.checkpoint_cost(model, S.Config()) == (12 * n, 12 * n / 100e6)
    assert S.checkpoint_cost(model, S.Config(param_dtype="bfloat16")) == (6 * n, 6 * n / 100e6)
    assert round(12 * 7_615_616_512 / 1e9) == 91


def test_resume_in_pipeline_mode_regenerates_the_groups_in_flight(tmp_path):
    """A checkpoint taken with groups in flight records their prompts; the resumed run generates them again first,
    and the counters, the curriculum and the weight version go on (continued correctly, not bit-exactly)."""
    need_vllm()
    S.run(ckpt_cfg(tmp_path, engine="vllm", steps=2, prompts_per_step=8))
    state2 = torch.load(S.list_checkpoints(str(tmp_path))[-1] + "/trainer_state.pt", weights_only=False)
    S.run(ckpt_cfg(tmp_path, engine="vllm", steps=4, prompts_per_step=8, resume="auto"))
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for k in ["flops", "gen_tokens", "device_hours"]:
        assert rows[2][k] < rows[3][k] < rows[4][k]
    state4 = torch.load(S.list_checkpoints(str(tmp_path))[-1] + "/trainer_state.pt", weights_only=False)
    (r2,), (r4,) = state2["ranks"], state4["ranks"]  # one process: one rank's loop state
    c2, c4, pending = r2["curriculum"], r4["curriculum"], r2["pending"]
    assert len(c2["history"]) == 16 and len(c4["history"]) == 32 and set(c2["history"]) < set(c4["history"])
    assert len(pending) >= 16 and c2["pos"] == 16 + len(pending)  # drawn = trained + in flight at the checkpoint
    assert set(c4["history"]) - set(c2["history"]) <= set(pending)  # the groups in flight came first
    assert c4["order"] == c2["order"] and r4["serial"] > r2["serial"]
    assert state4["totals"]["gen_tokens"] == rows[4]["gen_tokens"] and state4["step"] == 4
    assert state4["loop"]["version"] == rows[4]["step"] - sum(r["active_prompts"] == 0 for r in rows[1:])


def cli(*args, **kw):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "scalerl.py"), "--engine", "hf", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# scalerl.py's command line, with torch.save held (forever) on the trainer state of step 3's checkpoint, after saying so
HOLD_STEP_3 = """
import sys, time, torch
sys.path.insert(0, sys.argv.pop(1))
import scalerl
real = torch.save
def held(obj, path, *a, **kw):
    if "step_000003.tmp" in str(path) and "trainer_state.pt" in str(path):
        print("writing step 3", flush=True)
        time.sleep(600)
    return real(obj, path, *a, **kw)
torch.save = held
scalerl.main()
"""


def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one_and_sigterm_then_saves_one(tmp_path):
    """SIGKILL lands while step 3's checkpoint is half written (its model is in the temporary directory, its trainer
    state not: the write is held there until the kill). With --keep-last 1, step 2's checkpoint is the only other one:
    it survives whole (pruning before the new one is in place would have removed it), and the run resumes from it;
    the resumed run keeps the newest --keep-last 2 and removes the killed writer's temporary directory. SIGTERM then
    stops it after the step it is in, with a checkpoint of that step, exit status 0 and no traceback."""
    import signal
    out = tmp_path / "run"
    small = ["--prompts-per-step", "8", "--generations-per-prompt", "4", "--val-size", "8", "--eval-samples", "2",
             "--eval-every", "100"]
    p = subprocess.Popen([sys.executable, "-c", HOLD_STEP_3, HERE, "--engine", "hf", "--out", str(out), "--steps",
                          "60", "--save-every", "1", "--keep-last", "1", *small], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    caught = any("writing step 3" in line for line in p.stdout)  # (reads until that line, or the end)
    p.kill()
    p.communicate()
    assert caught, "the run ended before step 3's checkpoint was written"
    root = out / "checkpoints"
    (tmp,) = [n for n in os.listdir(root) if ".tmp" in n]
    assert tmp.startswith("step_000003.tmp") and (root / tmp / "config.json").is_file()  # the kill: mid-write
    assert not (root / tmp / "trainer_state.pt").exists() and not (root / "step_000003").exists()
    assert S.list_checkpoints(str(out)) == [str(root / "step_000002")]
    state = torch.load(root / "step_000002" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and load_params(str(root / "step_000002"))  # complete and loadable
    q = cli("--out", str(out), "--resume", "auto", "--steps", "500", "--save-every", "1", "--keep-last", "2", *small)
    hang = time.time() + 600  # (a guard against a hang, minutes, never a verdict)
    while q.poll() is None and rows_written(str(out)) < 6 and time.time() < hang:  # steps 3-5 logged
        time.sleep(0.05)
    q.send_signal(signal.SIGTERM)
    stdout, stderr = q.communicate(timeout=300)
    assert q.returncode == 0, stderr[-2000:]
    last = read_metrics(str(out))[-1]["step"]
    assert "resuming after step 2" in stdout and f"SIGTERM: stopped after step {last}" in stdout
    assert "Traceback" not in stderr and 5 <= last < 500
    assert [r["step"] for r in read_metrics(str(out))] == list(range(last + 1))
    assert run_entries(out) == [f"step_{last - 1:06d}", f"step_{last:06d}"]  # --keep-last 2, no temporary


def test_nan_skips_the_update_then_stops(tmp_path, monkeypatch):
    real = S.policy_loss
    monkeypatch.setattr(S, "policy_loss", lambda *a, **kw: (lambda loss, c: (loss * float("nan"), c))(*real(*a, **kw)))
    cfg = ckpt_cfg(tmp_path, steps=10, max_skipped_updates=2, zero_variance_filter=False)
    model0, _, _ = S.load_model(cfg, torch.device("cpu"))
    with pytest.raises(S.ScaleRLError) as e:
        S.run(cfg)
    assert e.value.status == 1 and "2 updates in a row skipped" in str(e.value)
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["skipped_updates"] for r in rows[1:]] == [1, 2]
    assert all(r["train_tokens"] == 0 for r in rows)
    assert not S.list_checkpoints(str(tmp_path))  # nothing saved from a run that went wrong


def test_a_failing_checkpoint_write_keeps_the_last_good_one(tmp_path, monkeypatch):
    real, calls = torch.save, []

    def flaky_save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(S.ScaleRLError) as e:
        S.run(ckpt_cfg(tmp_path, steps=4, save_every=1))
    assert e.value.status == 1 and "No space left on device" in str(e.value) and "step_000001" in str(e.value)
    assert [os.path.basename(c) for c in S.list_checkpoints(str(tmp_path))] == ["step_000001"]
    assert run_entries(tmp_path) == ["step_000001"]  # no half-written directory left


# ---------------------------------------------------------------------------------------------- torchrun (2 ranks)
def _on_rank(rank, world, port, fn, args):
    """One rank, as torchrun starts it: RANK and WORLD_SIZE set, a gloo process group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import datetime  # (a collective that one rank waits in alone fails in 5 minutes, not torch's 30)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        fn(rank, *args)
    finally:
        torch.distributed.destroy_process_group()
    # ended here, as scalerl.main ends a rank: a gloo worker thread still freeing a collective's tensors aborted the
    # interpreter's shutdown now and then ("terminate called without an active exception": SIGABRT, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_two_ranks(fn, *args):
    """Run fn(rank, *args) in two processes joined in a gloo group (fn: a function of this module)."""
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    torch.multiprocessing.spawn(_on_rank, args=(2, port, fn, args), nprocs=2)


def fixed_batch(flat_rank1=False):
    """Six prompts x 4 completions of mixed lengths, with injected tokens (mask 0), truncated completions and 0/1
    rewards; prompt 0 is flat (zero variance), and with flat_rank1 so are prompts 3-5 (the second rank's share).
    The first three prompts' completions are longer, so that the first rank has more micro-batches."""
    rng = np.random.default_rng(7)
    prompts, groups = [], []
    for i in range(6):
        prompts.append(rng.integers(3, 50, size=3 + i % 3).tolist())
        group = []
        for j in range(4):
            n = int(rng.integers(6, 12) if i < 3 else rng.integers(1, 5))
            mask = [int(rng.random() > 0.15) for _ in range(n)]
            group.append(S.Completion(rng.integers(3, 50, size=n).tolist(), (-rng.uniform(0.5, 4, size=n)).tolist(),
                                      bool(j != 1), mask, [j % 3] * n))  # versions 0-2: lags 1-3 at 3
        groups.append(group)
    rewards = rng.integers(0, 2, size=(6, 4)).astype(float)
    rewards[:, 0], rewards[:, 2] = 1.0, 0.0  # every group varied (completions 0 and 2 are finished)...
    rewards[0] = 1.0                         # ...but prompt 0
    if flat_rank1:
        rewards[3:] = 0.0
    return prompts, groups, rewards


DIST_CASES = [(tied, agg, norm, False, "cispo") for tied in (False, True) for agg in ("prompt", "sample", "token")
              for norm in ("batch", "prompt", "none")] + [(True, "prompt", "batch", True, loss)
                                                          for loss in ("cispo", "dapo", "gspo")]


def dist_cfg(tied, agg, norm, flat, loss):
    """Untied cases: no gradient clipping; tied ones: clipped to 0.25 (every gradient norm here is above it)."""
    return S.Config(loss_agg=agg, adv_norm=norm, loss=loss, mask_truncated=True, micro_batch_tokens=24,
                    logprob_chunk=5, grad_clip=0.25 if tied else 1e9, eps_low=0.2 if loss == "dapo" else 0.5,
                    eps_high=0.28 if loss == "dapo" else 0.5)


def one_sgd_step(policy, model, prompts, groups, rewards, cfg):
    """build_batch and train_step with SGD at lr 1: the weights move by exactly minus the gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    samples, _ = S.build_batch(prompts, groups, rewards, rewards, 0, cfg)
    before = {n: S.full_tensor(p).detach().clone() for n, p in model.named_parameters()}
    out = S.train_step(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), samples, cfg, 0)
    return out, {n: before[n] - S.full_tensor(p).detach() for n, p in model.named_parameters()}


def _grads_worker(rank, paths, out):
    from transformers import AutoConfig, AutoModelForCausalLM
    got = {}
    for case in DIST_CASES:
        if rank == 0:
            model = AutoModelForCausalLM.from_pretrained(paths[case[0]])
        else:  # as setup() does: only rank 0 loads the weights, shard() sends rank 1 its shards
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths[case[0]]))
        policy = S.shard(model, torch.device("cpu"))
        assert type(policy).__name__.startswith("FSDP") and hasattr(model.model.layers[0], "reshard")
        prompts, groups, rewards = fixed_batch(case[3])
        mine = slice(0, 3) if rank == 0 else slice(3, 6)
        got[case] = one_sgd_step(policy, model, prompts[mine], groups[mine], rewards[mine], dist_cfg(*case))
    if rank == 0:
        torch.save(got, out)


def _push_worker(rank, out):
    """push_weights and evaluate() with rank 0's engine asleep (no version) and rank 1's up to date: each push is a
    collective (as full_weights' gathers are), which rank 0 would wait in alone if it decided by its own engine."""
    s, cfg = metrics_state(0, 0, VAL_ANSWERS)
    pushes = []

    def push(model, version):
        pushes.append(S.all_sum(1.0))
        s.engine.version = version
    s.engine.push = push
    for call in (lambda: S.push_weights(s, cfg), lambda: S.evaluate(s, cfg, 1)):
        s.engine.version = None if rank == 0 else s.version
        call()
    torch.save(pushes, f"{out}.{rank}")


def _two_rank_worker(rank, paths, out):
    _grads_worker(rank, paths, out + "/got.pt")
    _metrics_worker(rank, out + "/row.pt")
    _push_worker(rank, out + "/pushes.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What the two-rank workers (the gradients, the metrics row) return, from one start of two ranks."""
    out, paths = tmp_path_factory.mktemp("two_ranks"), {}
    for tied in (False, True):
        paths[tied] = str(out / f"m{int(tied)}")
        tiny_model(tied).save_pretrained(paths[tied])
    on_two_ranks(_two_rank_worker, paths, str(out))
    return paths, out


@pytest.mark.xdist_group("two_ranks")  # (one start of the two ranks for the three)
def test_the_push_is_decided_over_all_ranks(two_ranks):
    """push_weights and evaluate() push when the engine of some rank is behind (rank 0's asleep, rank 1's up to date),
    on every rank: each rank made both pushes, and each push's collective counted both ranks."""
    out = two_ranks[1]
    assert [torch.load(out / f"pushes.pt.{r}") for r in (0, 1)] == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.xdist_group("two_ranks")  # (one start of the two ranks for the three)
def test_two_ranks_loss_and_gradients_equal_one_process(two_ranks):
    """FSDP2 over two gloo ranks, each with half the prompts (the first rank has more micro-batches, and in the `flat`
    cases the second rank has no sample at all), gives the loss, the statistics and the gradients of one process
    with the whole batch, for each aggregation and normalisation mode, tied and untied heads, with and without
    clipping, and for each loss where the second rank has only empty micro-batches."""
    paths, out = two_ranks
    got = torch.load(out / "got.pt", weights_only=False)
    from transformers import AutoModelForCausalLM
    for case in DIST_CASES:
        model = AutoModelForCausalLM.from_pretrained(paths[case[0]])
        want, want_grads = one_sgd_step(model, model, *fixed_batch(case[3]), dist_cfg(*case))
        assert want["grad_norm"] > 0.25
        out, grads = got[case]
        assert want["trained_tokens"] == out["trained_tokens"] > 0
        for k in ["loss", "grad_norm", "clip_frac", "mismatch_abs_logprob", "mismatch_kl_k3"]:
            assert out[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (case, k)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], atol=1e-6, rtol=1e-5, msg=f"{case} {name}")
        assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # gradients that can be told apart


def grade_by_answer(text, answer, row):
    return float(answer == "yes")


def fake_results(prompts, groups, rewards, cfg, stale, trained_version=3):
    """What rl_step returns for a step that trained at `trained_version`, took 0.2 s to train and 0.1 s to push."""
    samples, stats = S.build_batch(prompts, groups, rewards, rewards, trained_version, cfg)
    gs = [S.Group(("train", i), p, g, [], []) for i, (p, g) in enumerate(zip(prompts, groups))]
    return dict(groups=gs, rewards=rewards, errors=[], samples=samples, stats=stats,
                update={"trained_tokens": 5, "train_seconds": 0.2}, stale=stale,
                push_seconds=0.1, rollout=S.rollout_metrics(groups, rewards, rewards))


def metrics_state(decoded, steps, val_answers, in_flight=0, ahead=0.0, capacity=10**9, preempted=0):
    cfg = S.Config(prompts_per_step=6, generations_per_prompt=4, eval_samples=2, length_control="truncate")
    engine = ScriptedEngine(lambda key: 3, capacity)
    ro = S.Rollouts(cfg, engine, FakeTok())
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    s = S.State(lin, FakeTok(), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), None, engine, ro,
                S.Grader(grade_by_answer, 0, 10), [("p", "a", {})] * 40, [[1]] * 40,
                [("p", a, {}) for a in val_answers], [[1, 2]] * len(val_answers),
                S.Curriculum(40, 0, S.rank(), S.world()),
                {"device_hours": 0.0, "flops": 0.0, "gen_tokens": 0, "train_tokens": 0, "skipped_updates": 0})
    ro.decoded, ro.steps, ro.seconds, ro.ahead, ro.preempted = decoded, steps, 0.1, ahead, preempted  # the step's
    # engine time and its preemptions; training
    # generation beside the last evaluation
    ro.open = {("train", 100 + k): S.Group(("train", 100 + k), [1], [], [], [], left=1)  # training groups still
               for k in range(in_flight)}                                                # generating
    return s, cfg


VAL_ANSWERS = ["yes" if i % 3 == 0 else "no" for i in range(7)]  # 3 of 7 right; ranks' shares: 2/4 and 1/3
RANK_EXTRAS = [dict(stale=1, in_flight=3, decoded=50, steps=5, ahead=0.2, capacity=48, preempted=2),
               dict(stale=0, in_flight=2, decoded=30, steps=5, ahead=0.6, capacity=16, preempted=5)]


def _metrics_worker(rank, out):
    prompts, groups, rewards = fixed_batch()
    mine = slice(0, 3) if rank == 0 else slice(3, 6)
    x = RANK_EXTRAS[rank]
    s, cfg = metrics_state(x["decoded"], x["steps"], VAL_ANSWERS, x["in_flight"], x["ahead"], x["capacity"],
                           x["preempted"])
    r = fake_results(prompts[mine], groups[mine], rewards[mine], cfg, x["stale"])
    row = S.metrics_row(s, cfg, 1, r, 0.5, S.take_counts(s, cfg, r, 0.5))
    val = S.evaluate(s, cfg, 1)[0]["val_pass_rate"]
    if rank == 0:
        torch.save((row, val), out)


@pytest.mark.xdist_group("two_ranks")  # (one start of the two ranks for the three)
def test_rank_zero_metrics_and_evaluation_cover_both_ranks(two_ranks):
    """Rank 0's metrics row equals the row of one process holding both ranks' groups, lags and engine counts, and the
    held-out pass rate is over the whole set (3/7 here; either rank's share alone gives 1/2 or 1/3)."""
    row, val = torch.load(two_ranks[1] / "row.pt", weights_only=False)
    a, b = RANK_EXTRAS
    s, cfg = metrics_state(a["decoded"] + b["decoded"], a["steps"] + b["steps"], VAL_ANSWERS,
                           a["in_flight"] + b["in_flight"], capacity=a["capacity"] + b["capacity"],
                           preempted=a["preempted"] + b["preempted"])
    both = fake_results(*fixed_batch(), cfg, a["stale"] + b["stale"])
    want = S.metrics_row(s, cfg, 1, both, 0.5, S.take_counts(s, cfg, both, 0.5))
    # both devices' time: the step's 0.5 s, and the ranks' own training generation beside the last evaluation
    assert row["device_hours"] == pytest.approx(2 * (0.5 + (a["ahead"] + b["ahead"]) / 2) / 3600)
    assert want["gen_tokens"] > 0 and want["active_prompts"] == 5 and want["lag_max"] == 3
    assert want["engine_capacity"] == 64 and want["preemptions"] == 7  # both ranks' engines
    for k in want:
        if k not in ("device_hours", "train_tokens", "rss_gb"):  # (rss_gb: each process's own memory)
            assert row[k] == pytest.approx(want[k]), k
    assert val == pytest.approx(3 / 7)


@pytest.mark.quick
def test_metrics_row_by_hand():
    """One step's row against values worked out by hand (a 2 x 3 + 2 = 8-parameter model): two prompts of 3 and 2
    tokens, 4 completions each; prompt 1 is flat (dropped), completion (0, 2) and (1, 2) did not end, (0, 3) was
    interrupted (2 injected tokens)."""
    s, cfg = metrics_state(50, 5, ["yes"], in_flight=3, capacity=40, preempted=4)
    C = lambda n, finished=True, mask=None, intr=False, versions=None: S.Completion(  # noqa: E731
        [5] * n, [-1.0] * n, finished, mask or [1] * n, versions or [0] * n, intr)
    groups = [[C(4, versions=[2, 2, 1, 1]), C(2, versions=[2, 2]), C(3, False),
               C(5, True, [1, 0, 0, 1, 1], True, [1] * 5)], [C(1), C(1), C(6, False), C(2)]]
    rewards = np.array([[1.0, 0, 0, 1.0], [0.0, 0, 0, 0]])
    r = fake_results([[1, 2, 3], [4, 5]], groups, rewards, cfg, stale=1, trained_version=2)
    row = S.metrics_row(s, cfg, 1, r, 0.5, S.take_counts(s, cfg, r, 0.5))
    # lags of the trained (sampled) tokens at version 2: 0 0 1 1 | 0 0 | 2 2 2 | 1 1 1 (the two injected not counted)
    # generated tokens 4+2+3+5 + 1+1+6+2 = 24, of which 22 sampled (the mean length counts those); prompt tokens 3 + 2;
    # trained: the 4 samples of prompt 0, 4 x 3 prompt + 14 completion tokens = 26
    # flops: 2 N (prompt + generated) + 6 N trained = 2*8*(5 + 24) + 6*8*26 = 464 + 1248
    want = {"step": 1, "flops": 1712.0, "gen_tokens": 22, "train_tokens": 5, "skipped_updates": 0,
            "device_hours": 0.5 / 3600, "reward_mean": 2 / 8, "zero_variance_frac": 0.5, "active_prompts": 1,
            "truncated_excluded": 0, "npr_removed": 0, "pool_size": 40, "truncated_frac": 2 / 8,
            "interrupted_frac": 1 / 8, "mean_completion_tokens": 22 / 8, "lag_mean": 11 / 12, "lag_max": 2,
            "stale_dropped": 1, "inflight_groups": 3, "engine_batch_mean": 50 / 5, "engine_capacity": 40,
            "preemptions": 4, "step_seconds": 0.5,
            "gen_seconds": 0.1, "train_seconds": 0.2, "sync_seconds": 0.1, "loss": 0.0, "grad_norm": 0.0}
    assert {k: row[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert row["flops"] == s.totals["flops"]  # the counter goes on from the row (take_counts moved it)
    S.take_counts(s, cfg, r, 0.5)
    assert s.totals["flops"] == 2 * 1712 and s.totals["gen_tokens"] == 44  # cumulative


@pytest.mark.parametrize("tied,ranks", [(True, 1), (True, 2), (False, 1)])
def test_torchrun_hf_engine_generates_with_the_trainers_head(tmp_path, tied, ranks):
    """Under torchrun the HF engine generates with a whole replica of the model, made on the meta device: a tied head
    must be tied again there, or it keeps the memory it was given (no push fills a tied duplicate; the mismatch was
    0.19 on the tied embedded model). First step, float32, every completion trained: the trainer's log-probs are the
    generator's. (Untied on two ranks: test_two_rank_run_agrees_on_prompts_... .)"""
    out = str(tmp_path / "run")
    p = torchrun("--engine", "hf", "--tie-word-embeddings" if tied else "--no-tie-word-embeddings",
                 "--no-mask-truncated", "--no-zero-variance-filter", "--steps", "1", "--prompts-per-step", "4",
                 "--generations-per-prompt", "4", "--val-size", "4", "--eval-samples", "1", "--out", out, ranks=ranks,
                 env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr[-3000:]
    row = read_metrics(out)[1]
    assert row["train_tokens"] > 0 and row["mismatch_abs_logprob"] < 1e-5, row["mismatch_abs_logprob"]
    assert row["mismatch_fresh_abs_logprob"] == row["mismatch_abs_logprob"]  # (synchronous: every completion fresh)


# ---------------------------------------------------------------------------------------------- a run that goes wrong says so
@pytest.mark.quick
def test_fresh_mismatch_counts_the_completions_the_trained_weights_sampled_by_hand():
    """build_batch counts each token's lag from the version the batch updates; batch_tensors marks fresh the tokens of
    completions whose every sampled token has lag 0 (an injected token of another version does not count), and
    mismatch_sums gives |log pi_train - log pi_gen| over those alone, beside the mean over every token."""
    C = lambda versions, mask=None: S.Completion([5] * len(versions), [-1.0] * len(versions), True,  # noqa: E731
                                                  mask or [1] * len(versions), versions)
    groups = [[C([3, 3]), C([3, 2])], [C([3, 2, 3], [1, 0, 1]), C([2, 2])]]
    rewards = np.array([[1.0, 0.0], [1.0, 0.0]])
    samples, _ = S.build_batch([[1], [1]], groups, rewards, rewards, 3, S.Config())
    assert [x.lags for x in samples] == [[0, 0], [0, 1], [0, 1, 0], [1, 1]]
    x = S.batch_tensors(samples, 0, torch.device("cpu"))
    assert x["fresh"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]  # trained tokens: 2 + 2 + 2 (one injected) + 2
    logp = torch.tensor([-1.0, -2.0, -1.5, -1.0, -0.5, -0.7, -3.0, -2.0])
    gen = logp + torch.tensor([0.1, -0.2, 0.3, 0.3, 0.05, -0.05, 1.0, 1.0])
    m = S.mismatch_sums(logp, gen, x["fresh"])
    assert float(m["mismatch_fresh_abs_logprob"][0]) == pytest.approx(0.1 + 0.2 + 0.05 + 0.05)
    assert float(m["mismatch_fresh_abs_logprob"][1]) == 4
    assert float(m["mismatch_abs_logprob"][0]) == pytest.approx(3.0) and m["mismatch_abs_logprob"][1] == 8


def test_a_generator_whose_head_differs_is_flagged_then_stopped_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """The generator's LM head off from the trainer's (the HF engine's float32 head hook on a disturbed weight, as a
    push that missed the head would leave it): every step's fresh mismatch is over --max-fresh-mismatch; steps 1 and 2
    warn on stderr, step 3 stops the run (status 1) with its checkpoint and the flag that lets it go on, which a
    resume accepts."""
    real = S.FP32Head.__call__  # (the generator's alone: the trainer's forward runs with gradients, generate without)
    noise = torch.randn(len(S.SPECIALS) + len(S.CHARS), 128, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(S.FP32Head, "__call__", lambda self, h, b=None: real(self, h, b) + (
        0.0 if torch.is_grad_enabled() else torch.nn.functional.linear(h.float(), 0.05 * noise)))
    cfg = small_cfg(tmp_path, engine="hf", steps=6, prompts_per_step=4, val_size=4, eval_every=100,
                    mask_truncated=False, zero_variance_filter=False)
    with pytest.raises(S.ScaleRLError, match="3 steps in a row: stopped") as e:
        S.run(cfg)
    assert e.value.status == 1 and "--max-fresh-mismatch 0" in str(e.value) and "step_000003" in str(e.value)
    rows = read_metrics(cfg.out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["mismatch_fresh_abs_logprob"] > 0.1 for r in rows[1:])
    err = capsys.readouterr().err
    assert [ln.split(":")[1].strip() for ln in err.splitlines() if ln.startswith("warning: step")] == ["step 1",
                                                                                                      "step 2"]
    assert [os.path.basename(c) for c in S.list_checkpoints(cfg.out)] == ["step_000003"]
    rows = S.run(S.parse_args(["--resume", "auto", "--out", cfg.out, "--steps", "4", "--max-fresh-mismatch", "0"]))
    assert rows[-1]["step"] == 4 and rows[-1]["mismatch_fresh_abs_logprob"] > 0.1


def seed1_like_rows(vals, lag=6):
    """Metrics rows every step, an evaluation every 2 steps with the pass rates `vals`, for collapse_reason."""
    return [{"step": k, "lag_mean": lag / 2, "lag_max": lag, "mismatch_abs_logprob": 0.4,
             "mismatch_fresh_abs_logprob": 1e-6, "truncated_frac": 0.3, "active_prompts": 2.0, "lr": 3e-5,
             **({"val_pass_rate": vals[k // 2]} if k % 2 == 0 else {})} for k in range(2 * len(vals) - 1)]


@pytest.mark.quick
def test_collapse_warning_on_seed_1_not_on_healthy_noisy_runs():
    """collapse_reason on the held-out pass rates of docs/real-model.md's three seeds (evaluations every 2 steps): seed 1
    rose to 0.89 at step 10 and fell; it is named at step 16, where its last two evaluations (0.56, 0.64) are below
    0.89 by more than a third of the rise from 0.04 (0.29 > 0.283), with what the rows show; seeds 0 and 2 (a dip of
    0.19 on seed 2), a run whose small rise is noise and one that only fell from its start (a tiny model's) never are."""
    seeds = {0: "0.11 0.09 0.19 0.48 0.63 0.80 0.91 0.93 0.90 0.89 0.89 0.89 0.91 0.94 0.95 0.91 0.88",
             1: "0.04 0.33 0.55 0.66 0.75 0.89 0.83 0.56 0.64 0.68 0.39 0.75 0.63 0.60 0.19 0.14 0.16",
             2: "0.06 0.15 0.19 0.40 0.56 0.64 0.70 0.81 0.90 0.94 0.85 0.80 0.75 0.94 0.98 1.00 0.95",
             "noise": "0.10 0.18 0.12 0.20 0.11 0.19 0.10 0.17 0.09", "no rise": "0.125 0.06 0.0 0.0"}
    cfg = S.fill_defaults(S.Config(model="m", max_lag=8, max_new_tokens=64, prompts_per_step=8, data="d"))
    first = {}
    for seed, text in seeds.items():
        rows = seed1_like_rows([float(v) for v in text.split()])
        said = [(r["step"], S.collapse_reason(rows[:k + 1], cfg)) for k, r in enumerate(rows) if "val_pass_rate" in r]
        first[seed] = next((step for step, why in said if why), None)
        if seed == 1:
            why = dict(said)[16]
            assert why.startswith("the held-out pass rate fell from 0.890 (step 10) to 0.600 (steps 14 and 16)")
            for part in ("lag 3.0 updates on average, at most 6 (--max-lag 8)", "mismatch |log pi_train - log pi_gen| "
                         "0.400, 1e-06 on fresh", "30% of the completions cut at --max-new-tokens 64 and left out of "
                         "the batch (--mask-truncated)", "2.0 of 8 prompts trained on", "learning rate 3e-05 (--lr); "
                         "at a small batch --max-lag 2 held such a run on 3 seeds (docs/real-model.md)"):
                assert part in why, (part, why)
            low_lag = S.collapse_reason(rows[:17], dataclasses.replace(cfg, max_lag=2))  # (no advice to lower K)
            assert low_lag.endswith("learning rate 3e-05 (--lr)"), low_lag
    assert first == {0: None, 1: 16, 2: None, "noise": None, "no rise": None}


@pytest.mark.quick
def test_kv_capacity_counts_every_kv_cache_group_by_hand():
    """A sequence's blocks in each KV cache group, summed, and vLLM's null block aside: Gemma 2's two groups (full
    attention, and a sliding window of 4,096 tokens; blocks of 16) hold half the sequences one group would at 1,000
    tokens; at 8,192 the window's group needs 258 blocks where a full group needs 512."""
    full, window = (16, None), (16, 4096)
    assert memory.kv_capacity(1271, [full], 1000) == 1270 // 63 == 20  # ceil(1000 / 16) = 63
    assert memory.kv_capacity(1271, [full, window], 1000) == 1270 // (63 + 64) == 10  # the window's: 63 + 1
    assert memory.kv_capacity(10_000, [full, window], 8192) == 9999 // (512 + 258) == 12  # ceil(4111 / 16) + 1 = 258
    assert memory.kv_capacity(10_000, [full, full], 8192) == 9999 // 1024 == 9


def test_the_vllm_engine_counts_its_preemptions(tmp_path):
    """A KV cache of 1 MiB (4 blocks of 128 tokens, one of them vLLM's null block) and a group of 4 completions that
    all run to 200 tokens (2 blocks each: --long-tail's policy, which after ':' always loops): vLLM must preempt some and
    recompute them. The engine counts them, and Rollouts adds them to the step's count."""
    need_vllm()
    import bench
    bench.long_tail_model(str(tmp_path / "m"), p_long=1.0)
    cfg = S.fill_defaults(S.Config(model=str(tmp_path / "m"), engine="vllm", length_control="truncate",
                                   max_new_tokens=200, vllm_kv_cache_mb=1, generations_per_prompt=4, max_lag=0))
    model, tok, path = S.load_model(cfg, torch.device("cpu"))
    engine = S.VLLMEngine(cfg, path, torch.device("cpu"), torch.float32, 256)
    try:
        assert engine.kv_groups == [(128, None)] and engine.blocks == 4
        ro = S.Rollouts(cfg, engine, tok)
        (g,) = S.rollout(ro, [tok("3941:").input_ids], 4, seed=1)
        assert [len(c.tokens) for c in g] == [200] * 4  # (what forces it: 8 blocks wanted, 3 there)
        assert engine.preemptions > 0 and ro.preempted == engine.preemptions
    finally:
        engine.close()


def torchrun(*args, env=None, script=os.path.join(HERE, "scalerl.py"), cwd=None, ranks=2):
    """scalerl.py (or another script) under torchrun, two ranks (or `ranks`), each with one thread."""
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                          script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    p.stdout, p.stderr = p.communicate(timeout=600)
    return p


# scalerl.py's command line, where rank SIGNAL_RANK sends itself SIGTERM as it starts step SIGNAL_STEP: a signal that
# lands at the same point of the run on any machine (a signal sent from outside lands wherever the run is by then)
SIGNAL_AT = """
import atexit, os, signal, sys
sys.path.insert(0, {here!r})
import scalerl
atexit.register(lambda: open(os.environ["SIGNAL_STEP"] + ".shutdown" + os.environ["RANK"], "w").close())
real, calls = scalerl.rl_step, [0]
def rl_step(state, cfg):
    calls[0] += 1
    if calls[0] == int(os.environ["SIGNAL_STEP"]) and scalerl.rank() == int(os.environ["SIGNAL_RANK"]):
        os.kill(os.getpid(), signal.SIGTERM)
    return real(state, cfg)
scalerl.rl_step = rl_step
scalerl.main()
"""


@pytest.mark.heavy
def test_two_rank_run_agrees_on_prompts_counts_both_ranks_stops_on_a_signal_to_one_rank_and_resumes(tmp_path):
    """torchrun, 2 ranks, the HF engine: each rank draws only its shard of the prompts, generates with the trainer's
    newest weights (pushed into its copy of the model), records the No-Positive-Resampling history of its shard,
    rank 0's rows count both ranks' prompts and tokens, the checkpoint is a whole HF model. SIGTERM to rank 1 alone
    (it sends it itself as step 3 starts: the same step on any machine): rank 0 learns of it at the step's end, both
    save one checkpoint of step 3 and exit 0; the run resumes with 2 ranks (but not with 1), exactly: its rows and
    weights are those of the run that did not stop. Neither rank runs the
    interpreter's shutdown (there a gloo thread freeing a collective's tensors aborts the process now and then): the
    wrapper's atexit hook never runs."""
    out, P, G = str(tmp_path / "run"), 16, 8
    common = ["--engine", "hf", "--out", out, "--prompts-per-step", str(P), "--generations-per-prompt", str(G),
              "--npr-threshold", "0.1", "--val-size", "20", "--eval-every", "2", "--eval-samples", "2",
              "--no-zero-variance-filter"]  # every step trains (and moves the weights, where a group is not flat)
    (tmp_path / "signal_at.py").write_text(SIGNAL_AT.format(here=HERE))
    p = torchrun(*common, "--steps", "200", script=str(tmp_path / "signal_at.py"),
                 env={"SIGNAL_RANK": "1", "SIGNAL_STEP": "3"}, cwd=tmp_path)
    stdout, stderr = p.stdout, p.stderr
    assert p.returncode == 0, stderr[-3000:]
    assert not [f for f in os.listdir(tmp_path) if ".shutdown" in f]  # os._exit: no interpreter shutdown
    last = read_metrics(out)[-1]["step"]
    assert last == 3 and f"a signal to another rank: stopped after step {last}" in stdout
    assert [os.path.basename(c) for c in S.list_checkpoints(out)][-1:] == [f"step_{last:06d}"]  # (and a fork's own)
    assert f"torchrun --nproc-per-node 2 {os.path.join(HERE, 'scalerl.py')} --resume auto --out {out}" in stdout
    assert stdout.count("cannot stream") == stdout.count("parameters on cpu x 2 ranks") == 1  # rank 0 alone prints
    n = last + 2
    p = torchrun(*common, "--steps", str(n), "--resume", "auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming after step {last}" in p.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(n + 1))
    whole = str(tmp_path / "whole")  # the same 5 steps without the stop: resume under torchrun is exact
    assert torchrun(*[whole if a == out else a for a in common], "--steps", str(n)).returncode == 0
    assert untimed(read_metrics(whole)) == untimed(rows)
    a, b = (load_params(S.list_checkpoints(d)[-1]) for d in (whole, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(S.list_checkpoints(out)[-1] + "/trainer_state.pt", weights_only=False)
    c0, c1 = (r["curriculum"] for r in state["ranks"])
    for r, c in enumerate((c0, c1)):  # each its own shard: drawn, recorded (every prompt of n steps) and removed
        assert {i % 2 for i in c["order"]} == {i % 2 for i in c["history"]} == {r}
        assert len(c["history"]) == n * P // 2 and all(len(h) == 1 for h in c["history"].values())  # each drawn once
        assert c["removed"] == {i: "npr" for i, h in c["history"].items() if h[-1] >= 0.1}
    assert rows[-1]["npr_removed"] == len(c0["removed"]) + len(c1["removed"]) > 0  # both ranks' removals
    # each rank generates with its own whole copy of the model, which HFEngine.push fills from the shards: the
    # synchronous loop's log-probs are the trainer's only if every push copied the newest weights into it
    trained = [b for a, b in zip(rows, rows[1:]) if b["train_tokens"] > a["train_tokens"]]
    assert len(trained) == n and all(r["lag_max"] == 0 and r["mismatch_abs_logprob"] < 1e-5 for r in trained)
    # one rank decodes at most P/2 x G x 8 sampled tokens a step (think budget 6 + answer budget 2)
    steps = [b["gen_tokens"] - a["gen_tokens"] for a, b in zip(rows, rows[1:])]
    assert all(P // 2 * G * 8 < k <= P * G * 8 for k in steps), steps
    assert load_params(S.list_checkpoints(out)[-1])  # a whole model, loadable without torchrun
    with pytest.raises(S.ScaleRLError, match="had 2 ranks"):
        S.run(S.Config(out=out, resume="auto", steps=n + 1))


def test_prompts_per_step_not_a_multiple_of_the_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(S.ScaleRLError, match="multiple of the 2 ranks"):
        checked(["--prompts-per-step", "7"])


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["pipeline", "ppo", "moe"])
def test_two_rank_run_with_a_vllm_engine_per_rank(tmp_path, mode):
    """torchrun, 2 ranks, one vLLM CPU engine each. Pipeline: the ranks stream, and tokens from older weights are
    trained on. PPO-off-policy-2, with an evaluation mid-round: every token of a step has the same age, 0 or 1, and a
    step of age 0 is the synchronous loop's: every token trained on was sampled right after a push, so the trainer's
    log-probs match both engines' (the mismatch sums over both ranks' tokens). MoE: the embedded --moe, synchronous,
    stopped after step 2 and resumed: every push, each rank's experts gathered from their shards and sent in the
    checkpoint's layout, gives both engines the trainer's log-probs, before the resume and after it."""
    need_vllm()
    out = str(tmp_path / "run")
    flags = {"ppo": ["--off-policy", "ppo", "--max-lag", "2"],
             "moe": ["--moe", "--max-lag", "0", "--no-zero-variance-filter", "--lr", "1e-2"]}.get(mode, [])
    p = torchrun("--engine", "vllm", "--out", out, "--steps", "2" if mode == "moe" else "3", "--prompts-per-step", "16",
                 "--eval-every", "3", "--val-size", "16", "--eval-samples", "2", *flags)
    assert p.returncode == 0, p.stderr[-3000:]
    if mode == "moe":
        p = torchrun("--out", out, "--steps", "3", "--resume", "auto")
        assert p.returncode == 0 and "resuming after step 2" in p.stdout, p.stderr[-3000:]
    rows = read_metrics(out)
    trained = [b for a, b in zip(rows, rows[1:]) if b["train_tokens"] > a["train_tokens"]]  # (train_tokens counts
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and len(trained) >= 2  # up; a step of flat groups trains none)
    if mode == "pipeline":
        assert max(r["lag_max"] for r in trained) >= 1 and max(r["mismatch_abs_logprob"] for r in trained) > 1e-4
    elif mode == "moe":
        assert len(trained) == 3 and all(r["lag_max"] == 0 and r["mismatch_abs_logprob"] < 1e-5 for r in trained)
    else:
        assert all(r["lag_mean"] == r["lag_max"] <= 1 for r in trained)
        fresh = [r for r in trained if r["lag_max"] == 0]
        assert fresh and all(r["mismatch_abs_logprob"] < 1e-5 for r in fresh)


def test_the_splits_weights_file_is_the_checkpoints_layout(tmp_path):
    """--generators' weights file holds what save_pretrained writes for an MoE (names, layout, values), so that the
    generators' vLLM engines read it as they read the checkpoint; the float32 head beside it."""
    from safetensors.torch import load_file
    import generators
    model = moe_model("mixtral")
    model.save_pretrained(str(tmp_path / "ckpt"))
    generators.write_weights(str(tmp_path / "w.safetensors"), S.split_weights(model, torch.float32, True), 3)
    got, want = load_file(str(tmp_path / "w.safetensors")), load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert torch.equal(got.pop("fp32_head"), model.lm_head.weight)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in got


# ---------------------------------------------------------------------------------------------- generator-trainer split
def descendants(pid):
    import psutil
    return psutil.Process(pid).children(recursive=True)


def split_run_after(out, rows, *flags):
    """A split run in the background, once it has logged `rows` metrics rows, with its processes at that moment."""
    p = split_cli("--generators", 1, "--steps", 500, "--out", out, "--prompts-per-step", 8, "--val-size", 16,
                  "--eval-samples", 2, *flags)
    hang = time.time() + 600  # (a guard against a hang, minutes, never a verdict)
    while p.poll() is None and rows_written(str(out)) < rows and time.time() < hang:
        time.sleep(0.05)
    return p, descendants(p.pid)


def none_left(processes):
    """Every one of the processes gone (or a zombie, its parent gone too) within 60 s (their exit, not a pause)."""
    import psutil
    _, alive = psutil.wait_procs(processes, timeout=60)
    return not [c for c in alive if c.is_running() and c.status() != "zombie"]


def test_split_generator_labels_each_token_with_the_weights_that_sampled_it(tmp_path):
    """--generators: the generator process loads each push between two of its engine steps while its sequences go on
    decoding, and before any request sent after that push. The long completions cannot end by themselves (versions 0
    and 1 never choose EOS) and version 2 chooses EOS at once, so their ends are set by events, not by the machine's
    speed: a short request's return marks a moment when they are decoding (at least 2 tokens of version 0 each);
    the second short request, sent after push 1, is decoded with version 1, the long ones beside it; after push 2
    each long completion ends with one EOS of version 2. Each token's recorded log-prob is the slow kept-KV
    reference's with the weights live when it was sampled. (Only a stall of the trainer for the generator's 400
    engine steps could let a completion reach its length limit first.)"""
    need_vllm()
    import bench
    path = str(tmp_path / "m")
    bench.long_tail_model(path, p_long=0.0, p_stop=0.0)  # digits after digits, never EOS
    cfg = S.Config(engine="vllm", model=path, generators=1, length_control="truncate", max_new_tokens=400,
                   temperature=0.8)
    cfg = S.validate(S.fill_defaults(cfg))
    model0, tok = S.load_model(cfg, torch.device("cpu"))[:2]
    models = [model0] + [copy.deepcopy(model0) for _ in range(2)]
    for m in models[1:]:  # small moves (0.05 nats a token on average): digits stay the only tokens
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.005 * torch.randn_like(p))
    with torch.no_grad():  # version 2: EOS after every token (the head row of EOS raised for every previous token)
        models[2].lm_head.weight[tok.eos_token_id] += 50.0 / models[2].config.hidden_size ** 0.5
    engine = generators.SplitEngine(cfg, path, torch.device("cpu"), torch.float32, 512, model0, S.VLLMEngine,
                                    lambda m: S.split_weights(m, torch.float32, True), S.ScaleRLError)
    try:
        prompts, done = [tok("3941:").input_ids, tok("275:").input_ids], {}
        for i, p in enumerate(prompts):
            for j in range(3):
                engine.submit((("t", i), j), p, 400, 1000 * i + j)

        def until(key):
            while key not in done:
                done.update(engine.step()[0])
        for v in (1, 2):
            engine.submit((("short", v), 0), tok("8:").input_ids, 2, v)
            until((("short", v), 0))  # the long completions are decoding now
            engine.push(models[v], v)
        for i in range(2):
            for j in range(3):
                until((("t", i), j))
    finally:
        engine.close()
    assert done[(("short", 2), 0)].versions == [1, 1]
    for i, p in enumerate(prompts):
        for j in range(3):
            c = done[(("t", i), j)]
            assert c.finished and c.tokens[-1] == tok.eos_token_id and tok.eos_token_id not in c.tokens[:-1]
            assert c.versions == sorted(c.versions) and c.versions[-1] == 2 and c.versions.count(2) == 1, c.versions
            assert c.versions.index(1) >= 2, c.versions  # (the first short one's 2 tokens were decoded beside them)
            ref = kv_reference_logprobs(models, p, c.tokens, c.versions, cfg.temperature, refresh=False)
            np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)


def split_cli(*args, threads=None):
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return subprocess.Popen([sys.executable, os.path.join(HERE, "scalerl.py"), "--engine", "vllm", "--no-live-fit",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.heavy
def test_split_synchronous_run_writes_the_one_process_metrics_stops_on_sigterm_and_when_its_generator_dies(tmp_path):
    """With --max-lag 0 a split run is the synchronous loop with its generation in another process: the same requests
    with the same seeds, added to the engine in the same batches (what the trainer submits between two engine calls
    reaches a generator as one message), so with one thread on each side, as the one-process run has here, the same
    metrics bit for bit, but for the timing columns and the split's idle fractions. The batches are the same only
    where every request is submitted at once: a continuation after an interruption reaches a generator a message
    later than it reaches an engine in the same process, and the generator decodes on meanwhile. That changes how the
    engine's batches are composed, and with them pi_gen's float32 rounding (up to 1e-5 a token), which the updates
    carry on (with interruptions, the gradient norms of the two runs were seen to differ by a relative 1.2e-5, and
    once, under load, by 2.2e-3). So this run truncates instead of interrupting, and nothing in it depends on timing. (Another thread count changes float sums, and then sampled tokens now and then: not compared.)
    The split run goes on past the one-process run's 4 steps (nothing in those depends on --steps) until SIGTERM to its
    trainer stops it after the step it is in, as in one process: exit 0, a checkpoint, its generator gone with it.
    It resumes from that checkpoint; SIGKILL to the generator then stops the trainer with one line naming it, exit
    status 1, a checkpoint of its last completed step, and no process of the run left (the weights file in shared
    memory gone). (One test, so that the split starts twice, not four times.)"""
    import signal
    need_vllm()
    import bench
    bench.long_tail_model(str(tmp_path / "m"), p_long=0.0)  # random digits, EOS after 10 on average: rewards vary
    flags = ["--model", tmp_path / "m", "--max-lag", "0", "--prompts-per-step", 8, "--generations-per-prompt", 8,
             "--val-size", 16, "--train-size", 256, "--eval-every", 2, "--eval-samples", 2, "--lr", 1e-2,
             "--length-control", "truncate", "--max-new-tokens", 16]
    out = tmp_path / "split"
    one = split_cli(*flags, "--steps", 4, "--out", tmp_path / "one", threads=1)
    p, children = split_run_after(out, 5, *flags)  # (steps 0-4 logged)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-2000:]
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-2000:]
    one, split = read_metrics(str(tmp_path / "one")), read_metrics(str(out))
    stop = split[-1]["step"]
    assert f"SIGTERM: stopped after step {stop}" in stdout and "Traceback" not in stderr and none_left(children)
    assert [r["step"] for r in split] == list(range(stop + 1)) and stop >= 4
    assert [os.path.basename(c) for c in S.list_checkpoints(str(out))][-1] == f"step_{stop:06d}"
    assert all(r["trainer_idle_frac"] > 0 and 0 <= r["generator_idle_frac"] <= 1 for r in split[1:])
    strip = lambda rows: [{k: v for k, v in r.items() if "idle" not in k} for r in untimed(rows)]  # noqa: E731
    assert len(one) == 5
    for a, b in zip(strip(split), strip(one)):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert sum(r["active_prompts"] for r in one[1:]) > 0 and all(r["lag_max"] == 0 for r in one[1:])
    assert json.load(open(out / "config.json"))["generators"] == 1

    shm = lambda: {d for d in os.listdir("/dev/shm") if d.startswith("scalerl-")} if os.path.isdir(  # noqa: E731
        "/dev/shm") else set()
    before = shm()  # (another process's weights, left or live, are not this run's)
    p, children = split_run_after(out, stop + 3, *flags, "--resume", "auto")  # (two steps logged after resuming)
    (gen,) = [c for c in children if "generator_main" in " ".join(c.cmdline()) or "spawn_main" in " ".join(c.cmdline())]
    mine = shm() - before
    os.kill(gen.pid, signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 1 and f"resuming after step {stop}" in stdout
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("scalerl.py: error: generator 0 (pid ") and "died" in lines[0], lines
    rows = read_metrics(str(out))
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(last + 1)) and last >= stop + 2
    assert S.list_checkpoints(str(out))[-1].endswith(f"step_{last:06d}") and f"step_{last:06d}" in lines[0]
    assert none_left(children) and not shm() & mine


def test_split_generators_decode_ahead_of_the_trainer_within_the_lag_bound(tmp_path, monkeypatch, capsys):
    """The split under the pipeline (K = 1, P = 4): the trainer admits (K + 1) P groups, so while it trains a batch
    the generator decodes the next one, with the weights of the version before. Here the trainer waits, inside each
    update, until the generator has finished every group it holds (an event, not a pause), so the lags are known
    exactly whatever the machine's speed: step 1 trains groups of its own version (lag 0), every later step the
    groups sampled one update before it (lag 1, the bound), and nothing goes stale."""
    need_vllm()
    real_setup, real_step, states = S.setup, S.train_step, []

    def setup(cfg):
        made = real_setup(cfg)
        states.append(made[0])
        return made

    def train_step(*a, **kw):
        while states[0].rollouts.open:  # the groups in flight complete now, with the weights of this version
            states[0].rollouts.poll()
        return real_step(*a, **kw)

    monkeypatch.setattr(S, "setup", setup)
    monkeypatch.setattr(S, "train_step", train_step)
    rows = S.run(small_cfg(tmp_path, engine="vllm", generators=1, steps=4, prompts_per_step=4, max_lag=1,
                           eval_every=100, zero_variance_filter=False, length_control="truncate", live_fit=False))
    assert [(r["lag_max"], r["lag_mean"]) for r in rows[1:]] == [(0, 0), (1, 1), (1, 1), (1, 1)]
    assert all(r["stale_dropped"] == 0 for r in rows[1:]) and states[0].version == 4
    assert "in one process" not in capsys.readouterr().out  # (the default run's start-up line: the loop alternates)


@pytest.mark.quick
def test_split_weights_go_through_disk_when_shared_memory_has_no_room_for_two_files(tmp_path, monkeypatch, capsys):
    """--generators writes the weights to a file that a generator may still read while the next is written: shared
    memory holds it if it has room for two such files (measured: the real file, written), else a temporary directory
    on disk does, with one line saying so."""
    import shutil
    model = tiny_model(tied=True)
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    generators.write_weights(str(tmp_path / "w"), S.split_weights(model, torch.float32, True), 0)
    size = os.path.getsize(tmp_path / "w")  # weights (the tied head once) and the float32 head
    monkeypatch.setattr(generators.tempfile, "tempdir", str(disk))
    real = shutil.disk_usage
    for free, where in ((2 * size, shm), (size, disk)):
        monkeypatch.setattr(generators.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=free) if p == str(shm) else real(p))
        d = generators.weights_dir(model, torch.float32, True, str(shm))
        assert os.path.dirname(d) == str(where) and os.path.basename(d).startswith("scalerl-")
        lines = capsys.readouterr().out.splitlines()
        assert lines == [] if where == shm else len(lines) == 1 and lines[0].startswith(
            f"scalerl: {shm} has 0 MB free, less than two weights files") and lines[0].endswith(f"through {disk} instead")


def test_split_refuses_what_it_cannot_run(monkeypatch):
    """--generators: generators.py beside scalerl.py (a fork that copied scalerl.py alone has no split), a vLLM engine in
    each generator, a device (here: a core) for every process, one node."""
    need_vllm()
    have = len(os.sched_getaffinity(0))
    with monkeypatch.context() as m:
        real = importlib.util.find_spec
        m.setattr(S.importlib.util, "find_spec", lambda name, *a: None if name == "generators" else real(name, *a))
        with pytest.raises(S.ScaleRLError, match="--generators needs generators.py, the generator processes' code, "
                                                 "beside scalerl.py"):
            checked(["--generators", "1", "--device", "cpu"])
    with pytest.raises(S.ScaleRLError, match="--generators needs --engine vllm"):
        checked(["--generators", "1", "--engine", "hf"])
    with pytest.raises(S.ScaleRLError, match=f"1 trainer and {have} generator processes need {have + 1} cores"):
        checked(["--generators", str(have), "--device", "cpu"])
    assert checked(["--generators", str(have - 1), "--device", "cpu"]).generators == have - 1


# ---------------------------------------------------------------------------------------------- the README's examples
def fork_example(name, page="README.md"):
    """The code block of a page (README.md) that follows the line <!-- fork-example: NAME -->, as written there."""
    text = open(os.path.join(HERE, page)).read()
    block = text.split(f"<!-- fork-example: {name} -->", 1)[1].split("```", 2)[1]
    return block.split("\n", 1)[1]  # (the language tag's line off)


def place(text, where):
    """The lines (first, last; 0-based) of a place in scalerl.py's text, found by its structure (ast), not by its words,
    so that a forker's own lines repeating an anchor's words elsewhere leave it where it is. where: ("assign", NAME),
    a module-level assignment; ("field", CLASS, NAME); ("def", FN), the function; ("body", FN), the line after its
    docstring; ("return", FN), its last return; ("return None", FN), its last `return None`."""
    import ast
    tree, (kind, *names) = ast.parse(text), where
    if kind == "assign":
        node = next(n for n in tree.body if isinstance(n, ast.Assign) and names[0] in [getattr(t, "id", None)
                                                                                       for t in n.targets])
        return node.lineno - 1, node.end_lineno - 1
    if kind == "field":
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == names[0])
        node = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == names[1])
        return node.lineno - 1, node.end_lineno - 1
    scope, name = (tree, names[0]) if "." not in names[0] else (next(  # (Class.method: a method of a class)
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == names[0].split(".")[0]), names[0].split(".")[1])
    fn = next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name)
    if kind == "def":
        return fn.lineno - 1 - len(fn.decorator_list), fn.end_lineno - 1
    if kind == "body":
        return fn.body[0].end_lineno, fn.body[0].end_lineno
    rets = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and (kind == "return" or n.value is None or (
        isinstance(n.value, ast.Constant) and n.value.value is None))]
    node = max(rets, key=lambda n: n.lineno)
    return node.lineno - 1, node.end_lineno - 1


def fork_source(edits, text=None):
    """scalerl.py's text (this checkout's, a fork's too; or `text`) with each edit (where, lines, how: "before",
    "after", "replace", or (old, new) within the place) applied in turn, each place found anew (place). A piece whose
    lines the file holds already, as one block, is not added again: a fork that applied an example runs its test."""
    text = open(os.path.join(HERE, "scalerl.py")).read() if text is None else text
    for where, new, how in edits:
        if isinstance(how, str) and "\n".join(new).strip() and "\n".join(new) in text:
            continue  # (this fork has it: applied once, as its page says)
        lines, (first, last) = text.split("\n"), place(text, where)
        if how == "before":
            lines[first:first] = new
        elif how == "after":
            lines[last + 1:last + 1] = new
        elif how == "replace":
            lines[first:last + 1] = new
        else:
            segment = "\n".join(lines[first:last + 1])
            lines[first:last + 1] = segment.replace(*how).split("\n") if how[1] not in segment else \
                segment.split("\n")
        text = "\n".join(lines)
    return text


def forked(tmp_path, edits):
    """scalerl.py with the edits of fork_source applied, imported as a module of its own."""
    path = tmp_path / "scalerl_fork.py"
    path.write_text(fork_source(edits))
    for module in ("memory.py", "vllm_seam.py", "moe.py", "sandbox.py", "judge.py", "generators.py"):  # (as in a clone)
        shutil.copy(os.path.join(HERE, module), tmp_path)
    spec = importlib.util.spec_from_file_location("scalerl_fork", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scalerl_fork"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.quick
def test_the_readme_fork_example_reward_runs_as_written(tmp_path):
    """README, Fork it, your reward: the function beside the others and the table entry after the table, nothing
    else, make --reward number a choice that grades by the last number."""
    fork = forked(tmp_path, example_edits("reward"))
    try:
        assert checked(module=fork, argv=["--reward", "number"]).reward == "number"
        grader = fork.Grader(fork.REWARDS["number"], 0, 10.0)
        grades, errors = grader([("<think>7 and 9</think> it is 1,234", "1234", {}),
                                  ("<think>12</think> 13", "12", {}),
                                  ("<think>12</think> 13", "12", {"tolerance": 1}), ("12", "12.0", {"tolerance": "0"}),
                                  ("<think>9</think>", "9", {}), ("3", "three", {})])
        assert [r for r, _ in grades] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
        assert len(errors) == 1 and "ValueError" in errors[0]
    finally:
        sys.modules.pop("scalerl_fork")


@pytest.mark.quick
def test_the_readme_fork_example_dataset_runs_as_written(tmp_path, monkeypatch):
    """README, Fork it, your dataset: the script writes the file, and the command's flags read it: 500 training and
    100 held-out rows, answers the sums written as strings."""
    code = fork_example("data")
    script = code.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    subprocess.run([sys.executable, "-"], input=script, text=True, cwd=tmp_path, check=True)
    flags = shlex.split([ln for ln in code.split("\n") if ln.startswith("python scalerl.py")][0])[2:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(S, "hub_reachable", lambda endpoint: True)  # as where the README's hub model can be fetched
    cfg = checked(flags)
    assert cfg.reward == "math" and cfg.model == "Qwen/Qwen2.5-0.5B-Instruct"
    train, val = S.load_data(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "sums.jsonl")]
    assert len(rows) == 600 and len(val) == 100 and len(train) + len(val) <= 600
    sums = {r["prompt"]: str(r["answer"]) for r in rows}
    assert all(sums[p] == a and sums[row["prompt"]] == str(row["answer"]) for p, a, row, _ in train + val)
    assert all(str(sum(map(int, re.findall(r"\d+", p)))) == a for p, a, *_ in train + val)


@pytest.mark.quick
def test_the_readme_fork_example_loss_runs_as_written(tmp_path):
    """README, Fork it, your loss: the function after clipped_loss, the branch first in policy_loss and the choice
    added: --loss reinforce gives -sum(weight * A * log pi), and a run trains with it."""
    fork = forked(tmp_path, example_edits("loss"))
    try:
        logp, adv, w = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0.5, 0.5, 1.0])
        cfg = checked(module=fork, argv=["--loss", "reinforce", "--max-lag", "0"])
        loss, n = fork.policy_loss(logp, logp - 0.3, adv, w, torch.tensor([0, 0, 1]), cfg)
        assert n == {} and loss.item() == pytest.approx(-(0.5 * 1 * -1 + 0.5 * -1 * -2 + 1 * 2 * -0.5))
        calls, reinforce = [], fork.reinforce_loss
        fork.reinforce_loss = lambda *a: calls.append(a) or reinforce(*a)  # (policy_loss finds it by name)
        rows = fork.run(fork.Config(**{**dataclasses.asdict(small_cfg(
            tmp_path, engine="hf", steps=1, prompts_per_step=4, val_size=4, eval_samples=1,
            zero_variance_filter=False)), "loss": "reinforce", "max_lag": 0}))
        assert rows[1]["train_tokens"] > 0 and sum(len(a[0]) for a in calls) >= rows[1]["train_tokens"] > 0
    finally:
        sys.modules.pop("scalerl_fork")


def fork_page_pieces(name):
    """docs/fork.md's example NAME as its three pieces (the lines under "# 1.", "# 2.", "# 3."), and the fork of
    scalerl.py that they make: 1 after the field lm_head_fp32 of Recipe, 2 in place of the return of frozen_models or
    of token_terms, 3 before the return of policy_loss."""
    code, pieces = fork_example(name, "docs/fork.md").split("\n"), {}
    for ln in code:
        if re.match(r"# \d\. ", ln):
            pieces[ln[2]] = []
        elif ln.strip() and not ln.startswith("# run:"):
            pieces[str(len(pieces))].append(ln)
    return pieces


PAGE_PLACES = {  # the words of docs/fork.md's piece headers, "# N. FN, in place of its return:", and where they put it
    r"(\w+), after the field (\w+)": lambda m: (("field", m[1], m[2]), "after"),
    r"([\w.]+), in place of its return": lambda m: (("return", m[1]), "replace"),
    r"([\w.]+), before its return None": lambda m: (("return None", m[1]), "before"),
    r"([\w.]+), before its return": lambda m: (("return", m[1]), "before")}


def example_edits(name):
    """The edits (fork_source) that put an example where its page says: the README's reward (the function before the
    REWARDS table, its entry after it) and loss (the function before policy_loss, the branch first in its body, the
    choice added to the loss field); docs/fork.md's, each piece where its header says (PAGE_PLACES)."""
    if name in ("reward", "loss"):
        code = fork_example(name).split("\n")
        if name == "reward":
            fn, entry = code[1:code.index("")], [ln for ln in code if ln.startswith("REWARDS[")]
            assert fn[0].startswith("def reward_last_number") and len(entry) == 1
            return [(("assign", "REWARDS"), fn + [""], "before"), (("assign", "REWARDS"), entry, "after")]
        fn, branch = code[1:code.index("")], [ln for ln in code if ln.startswith("    ")][-2:]
        choices = re.search(r"choices become (\[.*\])", "\n".join(code)).group(1)
        assert fn[0].startswith("def reinforce_loss") and branch[0].strip().startswith('if cfg.loss == "reinforce"')
        return [(("def", "policy_loss"), fn + ["", ""], "before"), (("body", "policy_loss"), branch, "before"),
                (("field", "Recipe", "loss"), [], ('["cispo", "dapo", "gspo"]', choices))]
    code, edits = fork_example(name, "docs/fork.md").split("\n"), []
    for ln in code:
        if re.match(r"# \d\. ", ln):
            where, how = next(f(m) for pat, f in PAGE_PLACES.items() if (m := re.match(pat, ln[5:].rstrip(":"))))
            edits.append((where, [], how))
        elif ln.strip() and not ln.startswith("# run:"):
            edits[-1][1].append(ln)
    return edits


def forked_with_hunks(tmp_path, name):
    """forked() with the example NAME of docs/fork.md, and its number of places: the hunks of its diff against
    scalerl.py (no context lines), plus the pieces that scalerl.py holds already (a fork that applied it by hand, where
    fork_source adds nothing: all its places are those pieces)."""
    import difflib
    text, edits = open(os.path.join(HERE, "scalerl.py")).read(), example_edits(name)
    held = sum("\n".join(new) in text for _, new, _ in edits)
    fork = forked(tmp_path, edits)
    diff = difflib.unified_diff(text.split("\n"), (tmp_path / "scalerl_fork.py").read_text().split("\n"), n=0,
                                lineterm="")
    return fork, sum(ln.startswith("@@") for ln in diff) + held


@pytest.mark.quick
def test_the_fork_page_format_bonus_example_adds_to_any_reward_and_leaves_correct_alone(tmp_path):
    """docs/fork.md, a bonus on every reward: two places; its flag is bounded; score adds the bonus to the reward of
    each completion that ended with a \boxed{} after its reasoning, whichever reward graded its row (here the digit
    reward given to the grader, and a row of its own naming the exact-match reward), and correct is the reward's alone.
    By hand, with a tokenizer that has the box's characters (the embedded model's has not): a right answer boxed gets
    1 + 0.25, unboxed 1; a wrong one boxed 0.25; a box inside the reasoning only, nothing; one that did not end,
    nothing; off by default (--format-bonus 0): the rewards are the grader's."""
    fork, places = forked_with_hunks(tmp_path, "format-bonus")
    try:
        assert places == 2
        with pytest.raises(fork.ScaleRLError, match="--format-bonus must be >= 0"):
            checked(module=fork, argv=["--format-bonus", "-1"])
        tok = S.make_char_tokenizer("\\{}bx")
        C = lambda text, ended=True: (lambda ids: S.Completion(  # noqa: E731
            ids + [tok.eos_token_id] * ended, [0.0] * (len(ids) + ended), ended, [1] * (len(ids) + ended),
            [0] * (len(ids) + ended)))(tok(text, add_special_tokens=False).input_ids)
        groups = [[C("12</think> \\boxed{7}"), C("12</think> 7"), C("7</think> \\boxed{3}"), C("\\boxed{7}</think> 3"),
                   C("1</think> \\boxed{7}", ended=False)],
                  [C("3</think> \\boxed{12}"), C("3</think> answer: 12"), C("3</think> \\boxed{13}"),
                   C("3</think> 12"), C("\\boxed{12}</think>")]]
        assert tok.decode(groups[0][0].tokens[:-1]) == "12</think> \\boxed{7}"  # (the box is written)
        data = [("5:", "7", {}), ("q", "12", {}, "exact")]  # (the second row graded by its own reward)
        grader = fork.Grader(fork.reward_last_digit, 0, 1.0)
        correct, rewards, errors = fork.score(tok, groups, data, grader, checked(module=fork, argv=[
            "--format-bonus", "0.25"]))
        assert correct.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]] and errors == []
        assert rewards.tolist() == [[1.25, 1, 0.25, 0, 0], [1.25, 1, 0.25, 0, 0]]
        correct0, rewards0, _ = fork.score(tok, groups, data, grader, checked(module=fork))
        assert correct0.tolist() == correct.tolist() and rewards0.tolist() == correct.tolist()
    finally:
        sys.modules.pop("scalerl_fork")


def test_the_fork_page_kl_example_runs_as_written_in_three_places_and_under_torchrun(tmp_path):
    """docs/fork.md, the KL penalty: three hunks; its flag is bounded; policy_loss adds coef * k3 per token and logs
    the sum; in a run the kl column is 0 on the first update (the policy is still the reference) and > 0 later; a
    resumed run keeps the initial model as the reference (the same kl as the run without a break); and under
    torchrun (2 ranks, the reference sharded like the policy) it is logged the same way."""
    p = fork_page_pieces("kl")
    assert p["1"][0].strip().startswith("kl_coef: float = flag(") and len(p["2"]) == 1
    fork, hunks = forked_with_hunks(tmp_path, "kl")
    try:
        assert hunks == 3
        with pytest.raises(fork.ScaleRLError, match="--kl-coef must be >= 0"):
            checked(module=fork, argv=["--kl-coef", "-1"])
        cfg = checked(module=fork, argv=["--kl-coef", "0.5"])
        logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -0.1])
        adv, w = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0.5, 0.5, 1.0])
        loss, metrics = fork.policy_loss(logp, logp, adv, w, torch.tensor([0, 0, 1]), cfg, ref_logp=ref)
        kl = [math.exp(r - x) - (r - x) - 1 for r, x in zip(ref.tolist(), logp.tolist())]  # 0.1065, 0, 0.0703
        want = sum(wi * (-a * x + 0.5 * k) for wi, a, x, k in zip(w.tolist(), adv.tolist(), logp.tolist(), kl))
        assert loss.item() == pytest.approx(want) and sum(kl) > 0.1
        assert metrics["kl"][0].item() == pytest.approx(sum(kl))
        kw = dict(engine="hf", prompts_per_step=8, generations_per_prompt=4, val_size=4, eval_every=100,
                  eval_samples=1, length_control="truncate", zero_variance_filter=False, lr=5e-3)
        whole = fork.run(fork.Config(**kw, steps=3, kl_coef=0.5, out=str(tmp_path / "whole")))
        assert whole[1]["kl"] == 0.0 and whole[3]["kl"] > 1e-3  # (step 1's rewards are all 0 here: no move yet)
        fork.run(fork.Config(**kw, steps=2, kl_coef=0.5, out=str(tmp_path / "parts")))
        parts = fork.run(fork.Config(**kw, steps=3, kl_coef=0.5, out=str(tmp_path / "parts"), resume="auto"))
        assert parts[3]["kl"] == whole[3]["kl"]  # the checkpoint's weights as the reference would give ~0
    finally:
        sys.modules.pop("scalerl_fork")
    out = str(tmp_path / "torchrun")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(tmp_path / "scalerl_fork.py"), "--engine", "hf", "--prompts-per-step", "8",
                        "--generations-per-prompt", "4", "--val-size", "4", "--eval-every", "100", "--eval-samples",
                        "1", "--length-control", "truncate", "--no-zero-variance-filter", "--lr", "5e-3", "--steps",
                        "3", "--kl-coef", "0.5", "--out", out], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(out)
    assert rows[1]["kl"] == 0.0 and rows[3]["kl"] > 1e-3


def test_the_fork_page_entropy_example_runs_as_written_in_three_places(tmp_path):
    """docs/fork.md, the entropy bonus on the correct completions: three hunks; token_terms gives the exact entropy of
    softmax(logits) beside the same log-probs; policy_loss subtracts coef * entropy on the tokens of correct
    completions only (correctness, not the reward: the penalty's 0.5 here counts as correct) and logs their mean
    entropy as (sum, count); off by default; in a run whose every other completion is correct the column is present,
    between 0 and log(vocabulary), and it is the mean over the correct completions' tokens that the loss received."""
    p = fork_page_pieces("entropy")
    assert p["1"][0].strip().startswith("entropy_coef: float = flag(") and len(p["2"]) == 2
    fork, hunks = forked_with_hunks(tmp_path, "entropy")
    try:
        assert hunks == 3
        logits, targets = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [3.0, 0.0, 0.0]]), torch.tensor([2, 0, 1])
        terms = fork.token_terms(logits, targets)
        q = torch.softmax(logits.double(), -1)
        assert terms["entropy"].tolist() == pytest.approx((-(q * q.log()).sum(-1)).tolist())
        assert terms["logp"].tolist() == pytest.approx(S.token_terms(logits, targets)["logp"].tolist())
        logp, adv, w = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([1.0, -1.0, 0.5]), torch.tensor([0.5, 0.5, 1.0])
        correct, h = torch.tensor([1.0, 0.0, 1.0]), terms["entropy"].tolist()
        kw = dict(entropy=terms["entropy"], correct=correct, reward=torch.tensor([1.0, 0.0, 0.5]),
                  length=torch.tensor([3.0, 3.0, 2.0]))
        loss, metrics = fork.policy_loss(logp, logp, adv, w, torch.tensor([0, 1, 2]), checked(module=fork, argv=
            ["--entropy-coef", "0.1"]), **kw)
        assert loss.item() == pytest.approx(0.5 * (1 - 0.1 * h[0]) + 0.5 * -2 + 1.0 * (0.25 - 0.1 * h[2]))
        assert [float(v) for v in metrics["entropy_correct"]] == pytest.approx([h[0] + h[2], 2.0])
        loss0, metrics0 = fork.policy_loss(logp, logp, adv, w, torch.tensor([0, 1, 2]), checked(module=fork), **kw)
        assert "entropy_correct" not in metrics0 and loss0.item() == pytest.approx(0.5 - 1.0 + 0.25)
        seen, real = [], fork.policy_loss
        fork.policy_loss = lambda *a, **k: seen.append((k["correct"], k["entropy"])) or real(*a, **k)
        fork.score = lambda tok, groups, *a: (lambda r: (r, r, []))(  # every other completion right
            np.array([[float(j % 2) for j, _ in enumerate(g)] for g in groups]))
        rows = fork.run(fork.Config(engine="hf", steps=2, prompts_per_step=4, generations_per_prompt=4, val_size=4,
                                    eval_every=100, eval_samples=1, length_control="truncate", entropy_coef=0.1,
                                    out=str(tmp_path / "run")))
        vocab = len(S.SPECIALS) + len(S.CHARS)
        assert len(seen) == 2  # one micro-batch a step
        for row, (c, e) in zip(rows[1:], seen):
            mean = (e.double() * c).sum().item() / c.sum().item()  # over the correct completions' tokens
            assert 0 < c.sum() < len(c) and row["entropy_correct"] == pytest.approx(mean, rel=1e-6)
            assert 0 < row["entropy_correct"] < math.log(vocab)
    finally:
        sys.modules.pop("scalerl_fork")


def test_the_fork_page_rollout_metric_example_runs_as_written_in_one_place(tmp_path):
    """docs/fork.md, the rollout metric: one hunk; rollout_metrics gives (total, count) of the correct completions'
    lengths (by hand here); in a run the correct_tokens column is that mean over the step's completions as
    rollout_metrics received them, on the steps with a correct completion, and absent on the others."""
    assert len(fork_page_pieces("rollout-metric")["1"]) == 3
    fork, hunks = forked_with_hunks(tmp_path, "rollout-metric")
    try:
        assert hunks == 1
        c = lambda n: S.Completion([7] * n, [0.0] * n, True, [1] * n, [0] * n)  # noqa: E731
        groups, correct = [[c(3), c(5)], [c(10), c(4)]], np.array([[1.0, 0.0], [1.0, 1.0]])
        got = fork.rollout_metrics(groups, correct, correct * 0.5)
        assert got == {"reward_mean": (1.5, 4), "hack_frac": (0, 0), "correct_tokens": (3 + 10 + 4, 3)}
        seen, real = [], fork.rollout_metrics
        fork.rollout_metrics = lambda g, cor, rew: seen.append((g, cor)) or real(g, cor, rew)
        fork.score = lambda tok, groups, *a: (lambda r: (r, r, []))(  # every other completion right, as if ended
            np.array([[float((len(x.tokens) + j) % 2) for j, x in enumerate(g)] for g in groups]))
        rows = fork.run(fork.Config(engine="hf", steps=3, prompts_per_step=4, generations_per_prompt=4, val_size=4,
                                    eval_every=100, eval_samples=1, length_control="truncate", max_new_tokens=6,
                                    out=str(tmp_path / "run")))
        for row, (g, cor) in zip(rows[1:], seen):
            lengths = [len(x.tokens) for grp, ok in zip(g, cor) for x, o in zip(grp, ok) if o]
            assert row.get("correct_tokens") == (sum(lengths) / len(lengths) if lengths else None)
        assert len(seen) == 3 and any("correct_tokens" in r for r in rows[1:])
    finally:
        sys.modules.pop("scalerl_fork")


def test_the_fork_page_stabilisers_run_as_written_in_two_places_each(tmp_path):
    """docs/fork.md's two stabilisers, each in two hunks, off by default, their flags bounded. Off-policy sequence
    masking: a completion with a negative advantage whose mean log pi_gen - log pi_train over its tokens exceeds delta
    is left out (by hand: completion 0, mean 0.3 > 0.1 with A < 0; completion 1's 0.3 has A > 0; completion 2's 0.05
    is under delta); IcePop: a token whose ratio is outside [low, high] gets no gradient (by hand: ratios e^-0.9 and
    e^2 of four); each logs its share of masked tokens, and a run with it on logs the column."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.5, -3.0, -1.0])
    gen = logp + torch.tensor([0.5, 0.1, 0.3, 0.3, 0.05, 0.05])
    A, w, seq = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0]), torch.ones(6), torch.tensor([0, 0, 1, 1, 2, 2])
    for name, flags, masked in (("opsm", ["--opsm-delta", "0.1"], [1, 1, 0, 0, 0, 0]),
                                ("icepop", ["--icepop-low", "0.5", "--icepop-high", "5"], [0, 0, 0, 0, 0, 0])):
        fork, hunks = forked_with_hunks(tmp_path, name)
        try:
            assert hunks == 2
            column = f"{name}_masked"
            with pytest.raises(fork.ScaleRLError, match=f"--{flags[0][2:]} must be >= 0"):
                checked(module=fork, argv=[flags[0], "-1"])
            lp = logp.clone().requires_grad_()
            g = gen if name == "opsm" else logp + torch.tensor([0.9, 0.1, -2.0, 0.3, 0.0, 0.2])  # ratios e^-0.9, e^2
            loss, metrics = fork.policy_loss(lp, g, A, w, seq, checked(module=fork, argv=flags))
            loss.backward()
            if name == "icepop":
                masked = [1, 0, 1, 0, 0, 0]
            assert [float(x == 0) for x in lp.grad.tolist()] == masked
            assert [float(v) for v in metrics[column]] == [sum(masked), 6]
            assert column not in fork.policy_loss(logp, g, A, w, seq, checked(module=fork))[1]  # off by default
            rows = fork.run(fork.Config(**{**dataclasses.asdict(small_cfg(
                tmp_path / name, engine="hf", steps=2, prompts_per_step=4, val_size=4, eval_samples=1,
                zero_variance_filter=False, length_control="truncate")), **dict(zip(
                    [f[2:].replace("-", "_") for f in flags[::2]], map(float, flags[1::2])))}))
            trained = [r for p, r in zip(rows, rows[1:]) if r["train_tokens"] > p["train_tokens"]]
            assert trained and all(column in r for r in trained)
        finally:
            sys.modules.pop("scalerl_fork")


def test_the_fork_page_keep_best_example_runs_as_written_in_two_places(tmp_path):
    """docs/fork.md, keep the best checkpoint (a Part II fork): two places; in a run whose held-out pass rates are set
    (0.1 at step 0, then 0.3, 0.2, 0.5, ...), each new best is checkpointed and kept beside the last one (--keep-last
    1), with best pointing at it; a resumed run takes its best from the restored rows (0.6 at step 7 beats them),
    beside a forker's own entry in checkpoints/ (a complete copy of a checkpoint named best: not the run's);
    a copy of the run that followed the link (best a directory) resumes, its best left as it is."""
    fork, places = forked_with_hunks(tmp_path, "keep-best")
    try:
        assert places == 2
        vals = [0.1, 0.3, 0.2, 0.5, 0.4, 0.45, 0.2, 0.6, 0.1, 0.2]
        fork.evaluate = lambda state, cfg, step: ({"val_pass_rate": vals[step]}, [])
        kw = dict(engine="hf", val_size=4, prompts_per_step=4, generations_per_prompt=2, eval_every=1, eval_samples=1,
                  length_control="truncate", max_new_tokens=4, keep_last=1, save_every=100, live_fit=False)
        out = tmp_path / "run"
        names = lambda d=out: run_entries(d)  # noqa: E731
        fork.run(fork.Config(**kw, steps=6, out=str(out)))
        assert names() == ["step_000003", "step_000006"]  # (step 1, the first best, retired once step 3 beat it)
        assert os.readlink(out / "best") == os.path.join("checkpoints", "step_000003")
        if not (out / "checkpoints" / "best").exists():  # (the forker's own; a fork with its own keep-best has one)
            shutil.copytree(out / "checkpoints" / "step_000003", out / "checkpoints" / "best")
        fork.run(fork.Config(**kw, steps=8, out=str(out), resume="auto"))
        assert [r["step"] for r in read_metrics(str(out))] == list(range(9))  # (resumed after step 6)
        assert names() == ["step_000007", "step_000008"]
        assert os.readlink(out / "best") == os.path.join("checkpoints", "step_000007")
        assert os.path.isfile(out / "best" / "trainer_state.pt")
        assert sorted(os.listdir(out / "checkpoints")) == ["best", "step_000007", "step_000008"]
        copy = shutil.copytree(out, tmp_path / "copy")  # (links followed: best is a directory there)
        fork.run(fork.Config(**kw, steps=9, out=str(copy), resume="auto"))
        assert names(copy) == ["step_000007", "step_000009"] and not os.path.islink(copy / "best")
        assert [r["step"] for r in read_metrics(str(copy))] == list(range(10))
    finally:
        sys.modules.pop("scalerl_fork")


FORKERS_OWN = [  # a forker's own edits beside the anchors, in the words of the anchors: a format reward of their own
    # (the function before the table, a second "REWARDS = {" after it), a flag whose choices read as the loss field's,
    # a save of their own in checkpoint_due (a second return) and a note in policy_loss before its return
    (("assign", "REWARDS"), ["def reward_format(completion_text, answer, row):", '    """1 for a closed reasoning."""',
                             '    return float("</think>" in completion_text)', ""], "before"),
    (("assign", "REWARDS"), ['REWARDS = {**REWARDS, "format": reward_format}'], "after"),
    (("field", "Recipe", "lm_head_fp32"), ['    compare_loss: str = flag("cispo", "a loss to log beside the trained one",'
                                          ' ["cispo", "dapo", "gspo"])'], "after"),
    (("return", "checkpoint_due"), ["    if rows[-1].get(\"epoch\", 0) > 1e9:  # (never: a rule of mine)",
                                    "        return True"], "before"),
    (("return", "policy_loss"), ["    # a note of mine: return (weight * token_loss).sum(), metrics"], "before"),
]


def forked_project(tmp_path, names, own=()):
    """A copy of the project whose scalerl.py has the forker's own edits, then the examples NAMES one after the
    other, applied as their pages say; the quick subset run there (its own example tests included: each applies its
    example to that scalerl.py, where it finds it applied). Returns (the project, pytest's output)."""
    proj = tmp_path / "fork"
    shutil.copytree(HERE, proj, ignore=shutil.ignore_patterns(".*", "runs", "__pycache__", "*.png"))
    text = fork_source(list(own))
    for name in names:
        text = fork_source(example_edits(name), text)
    (proj / "scalerl.py").write_text(text)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "quick", "-p", "no:cacheprovider"], cwd=proj,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:]
    assert re.search(r"\d+ passed", p.stdout) and "failed" not in p.stdout.splitlines()[-1]
    return proj, p.stdout


def test_every_fork_example_at_once_beside_a_forkers_own_edits_passes_the_quick_subset(tmp_path):
    """A forker's check: the README's reward and loss and docs/fork.md's eight examples, applied one after the other
    to a copy of the project that has the forker's own edits beside the anchors (FORKERS_OWN), as their pages say; then
    `pytest -m quick` run there, its example tests included (the format bonus's finds it applied). Tests that call
    policy_loss, token_terms or rollout_metrics directly pass with the forks' terms present: a loss term is guarded by
    its flag."""
    proj, _ = forked_project(tmp_path, ("reward", "loss", "format-bonus", "kl", "entropy", "rollout-metric",
                                        "curriculum-rule", "opsm", "icepop", "keep-best"), FORKERS_OWN)
    fork = (proj / "scalerl.py").read_text()
    assert all(fork.count(s) == 1 for s in ("def reinforce_loss", "kl_coef: float", "entropy_coef: float",
                                            "drop_failed: int", '"correct_tokens"', "def reward_last_number",
                                            "opsm_delta: float", "icepop_high: float", "def reward_format",
                                            "format_bonus: float"))


def test_two_small_forks_of_a_reader_keep_the_quick_subset_green(tmp_path):
    """The reader's two forks (a format reward, and keep the best checkpoint), one after the other beside the forker's
    own edits in the anchors' words (a second "REWARDS = {", the loss field's choices in a flag of theirs): the quick
    subset passes on the forked file, the README examples' tests among it (before, an anchor's words standing twice
    failed them: the text anchors found two places)."""
    proj, out = forked_project(tmp_path, ("keep-best",), FORKERS_OWN)
    fork = (proj / "scalerl.py").read_text()
    assert "def reward_format" in fork and fork.count("best or bool(cfg.save_every)") == 1


def test_the_fork_page_head_precision_example_reaches_trainer_and_both_generators_in_one_place(tmp_path):
    """docs/fork.md, the head's precision: one hunk, in FP32Head; the trainer's log-probs are then the log-softmax of
    bf16-rounded logits (by hand here), the HF engine samples with the same log-probs as the trainer computes (its
    hook is the same class), and vLLM's head (engine_fp32_head, given a stand-in model with a logits processor) gives
    the rounded logits too."""
    fork, hunks = forked_with_hunks(tmp_path, "head-precision")
    try:
        assert hunks == 1
        torch.manual_seed(0)
        head, h = torch.nn.Linear(16, 40, bias=False), torch.randn(6, 16)
        y = torch.randint(0, 40, (6,))
        got = fork.token_logprobs(h, head, y, 1.0)["logp"]
        by_hand = torch.log_softmax((h @ head.weight.T).to(torch.bfloat16).float(), -1).gather(-1, y[:, None])[:, 0]
        assert torch.allclose(got, by_hand, atol=1e-6) and not torch.allclose(
            S.token_logprobs(h, head, y, 1.0)["logp"], by_hand, atol=1e-6)  # (the recipe's: not rounded)
        lp = types.SimpleNamespace(head_dtype=torch.float32)
        model = types.SimpleNamespace(lm_head=head, logits_processor=lp)
        assert fork.engine_fp32_head(model, split=False) == "torch.float32"
        assert torch.equal(lp._apply_head(head, h, None), (h @ head.weight.T).to(torch.bfloat16).float())
        m, tok = tiny_model(False), S.make_char_tokenizer()
        prompts = [tok("3941:", add_special_tokens=False).input_ids] * 2
        comps, _ = fork.hf_generate(m, tok, prompts, [4, 4], 1.0, seed=3, fp32_head="float32")
        samples = [S.Sample(prompts[0], c.tokens) for c in comps]
        trainer = fork.sequence_logprobs(m, samples, S.Config(), tok.pad_token_id)["logp"]
        assert torch.allclose(trainer, torch.tensor([x for c in comps for x in c.logprobs]), atol=1e-5)
    finally:
        sys.modules.pop("scalerl_fork")


def test_the_fork_page_curriculum_rule_example_runs_as_written_in_two_places(tmp_path, capsys):
    """docs/fork.md, the curriculum rule: two hunks; its flag is bounded; removal_rule removes a prompt at its third
    draw with pass rate 0 (by hand), NPR's rule still applies; in a run where every completion fails, each prompt
    leaves after 3 draws: failed_removed counts them, npr_removed stays 0, the pool shrinks by them, and a resumed run
    keeps the histories (the same rows as the run without a break)."""
    p = fork_page_pieces("curriculum-rule")
    assert p["1"][0].strip().startswith("drop_failed: int = flag(") and len(p["2"]) == 2
    fork, hunks = forked_with_hunks(tmp_path, "curriculum-rule")
    try:
        assert hunks == 2
        with pytest.raises(fork.ScaleRLError, match="--drop-failed must be >= 0"):
            checked(module=fork, argv=["--drop-failed", "-1"])
        cfg = checked(module=fork, argv=["--drop-failed", "3"])
        assert fork.removal_rule([0.0, 0.5, 0.0], cfg) is None and fork.removal_rule([0.0, 0.5, 0.0, 0.0], cfg) == \
            "failed" and fork.removal_rule([0.0, 0.0, 1.0], cfg) == "npr"
        assert fork.removal_rule([0.0] * 5, checked(module=fork, argv=[])) is None  # off by default
        fork.score = lambda tok, groups, *a: (lambda r: (r, r, []))(np.zeros((len(groups), len(groups[0]))))
        kw = dict(engine="hf", train_size=8, val_size=4, prompts_per_step=4, generations_per_prompt=2, eval_every=100,
                  eval_samples=1, length_control="truncate", max_new_tokens=4, drop_failed=3)
        rows = fork.run(fork.Config(**kw, steps=7, out=str(tmp_path / "whole")))
        # 4 prompts a step over 8: every prompt is drawn once in steps 1-2, twice by 4, three times by 6
        assert [r["failed_removed"] for r in rows[1:] if "failed_removed" in r] == [4, 8] and \
            [r["step"] for r in rows if "failed_removed" in r] == [5, 6]
        assert all(r["npr_removed"] == 0 for r in rows[1:]) and rows[6]["pool_size"] == 0
        fork.run(fork.Config(**kw, steps=4, out=str(tmp_path / "parts")))
        parts = fork.run(fork.Config(**kw, steps=7, out=str(tmp_path / "parts"), resume="auto"))
        same = lambda k: k not in TIMING | {"val_pass_rate"}  # noqa: E731
        assert [{k: v for k, v in r.items() if same(k)} for r in parts] == \
            [{k: v for k, v in r.items() if same(k)} for r in rows]  # (the first part's last step is evaluated)
        assert "removed by the curriculum (failed); stopping" in capsys.readouterr().out
    finally:
        sys.modules.pop("scalerl_fork")
