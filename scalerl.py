"""scalerl.py -- the ScaleRL recipe in one file.

ScaleRL is the reinforcement-learning recipe for LLMs of Khatri et al., "The Art of Scaling Reinforcement
Learning Compute for LLMs" (arXiv 2510.13786, 2025); [Sec. N] refers to its sections. One update, rl_step():

  1. groups  <- G completions for each of P prompts, sampled by an in-process vLLM engine; a completion that has
                not closed its reasoning within its thinking budget is interrupted and asked to answer [Sec. 2, 4].
                Generation streams on across updates (PipelineRL-k), and no token trained on is more than k = 8
                updates older than the weights being updated [Sec. 3.1]
  2. rewards <- a verifiable, binary reward per completion [Sec. 2]
  3. batch   <- completions that did not end are left out (with --model); prompts whose G rewards are all equal are
                dropped (zero-variance filtering); advantages r - mean(group), divided by the std of the batch's
                advantages; each prompt weighs the same in the loss (prompt-level averaging) [Sec. 3.2, 4]
  4. curriculum <- a prompt whose pass rate reaches 0.9 leaves the later epochs (No-Positive-Resampling) [Sec. 3.2]
  5. update  <- one AdamW step on the CISPO loss -sg(min(rho, eps_max)) * A * log pi_train, rho = pi_train / pi_gen,
                with the LM head computed in float32 in trainer and generator alike [Sec. 3.2]
  6. push    <- the new weights go into the engine between two of its steps, while sequences decode [Sec. 3.1]

Each component can be switched to the alternative the paper ablates:
  off-policy loop        --off-policy pipeline|ppo, --max-lag 8 (0: synchronous)    admission, next_batch
  forced interruptions   --length-control interrupt|penalty|truncate                next_request, Rollouts
  truncated samples out  --mask-truncated / --no-mask-truncated                    build_batch
  zero-variance filter   --zero-variance-filter / --no-zero-variance-filter        zero_variance_keep
  advantage norm         --adv-norm batch|prompt|none                              compute_advantages
  loss aggregation       --loss-agg prompt|sample|token                            completion_weights
  No-Positive-Resampling --npr-threshold 0.9 (>= 1 disables it)                   removal_rule, next_prompts
  loss                   --loss cispo|dapo|gspo                                    cispo_loss, clipped_loss
  FP32 LM head           --lm-head-fp32 / --no-lm-head-fp32                        FP32Head, _chunk_terms

The objective, as the paper writes it [Sec. 4]. For each prompt x of the batch, G completions y_1..y_G sampled by
pi_gen (the engine's weights, at most K updates old) with binary rewards r_i:

  J(theta) = mean over x of  1 / (sum_g |y_g|)  sum_i sum_t  sg(min(rho_it, eps_max)) * A_i^norm * log pi_train(y_it)
             subject to  0 < mean_i(r_i) < 1  (zero-variance filtering)  and  pass_rate(x) < 0.9  (NPR)
  rho_it = pi_train(y_it) / pi_gen(y_it),   A_i^norm = (r_i - mean_j r_j) / std of the batch's advantages

  symbol                    where it is computed
  r_i                       score: the reward function's 0/1 for completion i
  A_i^norm                  compute_advantages: rewards - group mean, then `adv / (std + eps)` (norm "batch")
  log pi_train(y_it)        token_terms: "logp", from the float32 logits of _chunk_terms
  pi_gen(y_it)              Completion.logprobs: the engine's log-prob of each token, recorded as it sampled it
  rho_it                    policy_loss: `rho = torch.exp(logp - logp_gen)`
  sg(min(rho, eps_max))     cispo_loss: `torch.clamp(ratio.detach(), max=eps_max)`, called by policy_loss
  1 / sum_g |y_g|, mean x   completion_weights: `1 / (n_prompts * sum(g))` per token (agg "prompt")
  0 < mean r < 1            zero_variance_keep, in build_batch: a prompt whose G rewards are equal is dropped
  pass_rate(x) < 0.9        removal_rule, in update_curriculum: a prompt that reached it is not drawn again
The code minimises -J: policy_loss is -J of a micro-batch, `(weight * token_loss).sum()`, from plain tensors, one value
per trained token (logp, logp_gen, A, weight: batch_tensors); train_step's compute_gradients backpropagates it.

`python scalerl.py` trains an embedded tiny Llama (random weights, character tokenizer) on a built-in task on the
CPU; `python scalerl.py --model DIR_OR_HUB_ID --data FILE` trains a real model on a math dataset;
`torchrun --nproc-per-node 8 scalerl.py ...` shards the trainer with FSDP2 and gives each rank its own engine and its
share of every step's prompts (what the recipe defines over the batch is reduced over the ranks: all_sum, all_max).
Part I (the recipe) reads top to bottom: config, run() (the loop), rl_step, then its components in the order it calls
them. Part II is plumbing: nothing in it changes the recipe (command line, data, grading, engines, checkpoints).
"""
import argparse
import collections
import contextlib
import copy
import csv
import ctypes
import dataclasses
import datetime
import errno
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import multiprocessing
import operator
import os
import pickle
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
import urllib.parse
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import memory  # beside this file: the memory plan, the CPU engine's KV cache, the trainer's peak (section 4)
import vllm_seam  # beside this file: vLLM's internals that the engine uses, each checked at start-up (section 5)

try:  # the code reward's sandbox (--reward code), beside this file: a copy of this file alone runs all but that reward
    import sandbox
except ImportError:
    sandbox = None
try:  # an MoE's routing and experts (moe.py), beside this file: a copy of this file alone runs dense models
    import moe
except ImportError:
    moe = None


def flag(default, help, choices=None, nargs=None, above=None, at_least=None, below=None):
    """A Config field and its command-line flag (plumbing that the recipe's fields need first; Part II's parse_args
    makes the flags); a number outside its bounds (> above, >= at_least, < below) fails."""
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs, "above": above,
                                            "at_least": at_least, "below": below})


# ==================================================================================================
# PART I -- THE RECIPE: the config, run() (the loop), rl_step (the algorithm box), then its components in the order it
# calls them (sections 1-6, numbered as its arrows). Part II names it uses: State; the engines' contract; step_seed,
# RNG_*; special_ids, completion_text, find_subsequence, join_experts; Policy, as_policy, batch_tensors, micro_batches,
# even_out, mismatch_sums, FP32Head, backward_sum, memory.gpu_peak; rank, all_sum, all_max, full_tensor,
# mean_over_ranks (torchrun's: in one process the identity); setup, Guard, rollout, pass_rates, live_fit,
# save_completions.
# ==================================================================================================


@dataclass
class Recipe:
    """The recipe's settings, each a command-line flag (--prompts-per-step, ...). The components default to ScaleRL's;
    the sizes (P, G, lengths, learning rate, warm-up, evaluation) to the embedded task's, which runs on a CPU in
    minutes. Config (Part II) adds the plumbing's flags: one command line, one --help, one config.json."""
    # the recipe's components [Sec. 3, 4]
    off_policy: str = flag("pipeline", "pipeline: PipelineRL-k, generation streams on while each update's weights are "
                                     "pushed into the engine in flight (ScaleRL); ppo: PPO-off-policy-k, generate K "
                                     "batches with the same weights, then take K optimiser steps", ["pipeline", "ppo"])
    max_lag: int = flag(8, "K, the paper's k [Sec. 3.1]: no trained token is more than K updates older than the "
                         "weights it updates, i.e. the trainer runs at most K updates ahead of its data (the paper: 8; "
                         "4 did as well); 0: the synchronous loop (generate a batch, train on it, push the weights)",
                         at_least=0)
    refresh_kv: bool = flag(False, "pipeline: at each update, re-prefill the running sequences with the new weights "
                                 "(default: they keep the KV cache computed with older weights, as PipelineRL does)")
    length_control: str = flag("interrupt", "interrupt: forced interruption at a thinking budget (ScaleRL); penalty: "
                                          "DAPO overlong penalty; truncate: plain cut at --max-new-tokens",
                             ["interrupt", "penalty", "truncate"])
    think_budget: tuple = flag((0, 0), "interrupt: thinking budget drawn per completion in [LO, HI] (0 0: HI = "
                                     "--max-new-tokens - --answer-budget, LO = 5/6 HI, as the paper's 10k-12k)",
                             nargs=2)
    answer_budget: int = flag(0, "interrupt: tokens allowed after the interruption (0: --max-new-tokens / 8, "
                               "at least 2)", at_least=0)
    interruption_phrase: str = flag("Okay, time is up. Let me stop thinking and formulate a final answer now. "
                                  "</think>", "interrupt: text appended to an interrupted completion")
    think_end: str = flag("</think>", "interrupt: the marker that closes the reasoning")
    max_len: int = flag(0, "penalty: L_max, longer correct answers get -1 (0: --max-new-tokens)", at_least=0)
    cache_len: int = flag(None, "penalty: L_cache, the linear penalty zone before L_max (default: L_max / 5; 0: none, "
                                "-1 at once past L_max)", at_least=0)
    mask_truncated: bool = flag(None, "leave completions that did not end (no EOS within the limits) out of the group "
                                    "mean, the zero-variance test, the batch std and the loss (the paper's 'effective "
                                    "batch after excluding truncated samples'). Default: on with --model; off for the "
                                    "embedded model, whose random policy seldom ends: nothing would be left to learn")
    zero_variance_filter: bool = flag(True, "drop prompts whose G rewards are all equal from the loss")
    adv_norm: str = flag("batch", "advantage normalisation", ["batch", "prompt", "none"])
    loss_agg: str = flag("prompt", "loss aggregation", ["prompt", "sample", "token"])
    npr_threshold: float = flag(0.9, "No-Positive-Resampling: drop a prompt from later epochs once its pass rate (in "
                                   "steps of 1/G: with G = 16, 0.9 means 15/16) reaches this (>= 1 disables)", above=0)
    loss: str = flag("cispo", "policy loss: cispo (ScaleRL), dapo (PPO clipping with DAPO's asymmetric range), gspo "
                            "(a sequence-level ratio, clipped)", ["cispo", "dapo", "gspo"])
    eps_max: float = flag(5.0, "CISPO: truncation of the importance weight from above (the paper: 4, 5 and 8 alike)",
                          above=0)
    eps_low: float = flag(None, "DAPO/GSPO: lower clip, ratio >= 1 - eps_low (default: the loss's own, dapo 0.2, gspo "
                                "3e-4; 0: no lower clip)", at_least=0, below=1)
    eps_high: float = flag(None, "DAPO/GSPO: upper clip, ratio <= 1 + eps_high (default: dapo 0.28, gspo 4e-4)",
                           at_least=0)
    lm_head_fp32: bool = flag(True, "compute the LM head (hidden -> logits) in float32, trainer and generator")
    routing_replay: bool = flag(False, "MoE: routing replay (R3, arXiv 2510.11370): the trainer's forward routes each "
                                     "sampled token to the experts the generator routed it to (docs/moe.md)")
    # sampling, optimiser and evaluation
    steps: int = flag(None, "number of training steps (optimiser updates); default 150, with --resume the run's "
                          "own; 0: evaluate the initial weights and save them as checkpoint step 0, which --resume "
                          "continues", at_least=0)
    prompts_per_step: int = flag(32, "prompts per step, P (the paper: 48)", above=0)
    generations_per_prompt: int = flag(16, "completions sampled per prompt, G (the paper: 16); at least 2: advantages "
                                           "are centred in each group", at_least=2)
    max_new_tokens: int = flag(8, "generation limit per completion", above=0)
    temperature: float = flag(1.0, "sampling temperature (generator and trainer log-probs use it)", above=0)
    lr: float = flag(5e-4, "learning rate, constant after warm-up (the paper: 5e-7 for an 8B model)", above=0)
    warmup_steps: int = flag(10, "linear learning-rate warm-up steps (the paper: 100)", at_least=0)
    weight_decay: float = flag(0.01, "AdamW weight decay", at_least=0)
    adam_eps: float = flag(1e-15, "AdamW epsilon (the paper: 1e-15)", at_least=0)
    grad_clip: float = flag(1.0, "clip the global gradient norm to this (our choice: the paper gives none)", above=0)
    eval_every: int = flag(10, "evaluate every this many steps (and at step 0 and the last step)", above=0)
    eval_samples: int = flag(8, "samples per held-out prompt: k of mean@k (the paper: 16)", above=0)

# --------------------------------------------------------------------------------------------------
# The run: setup, then rl_step after rl_step, evaluating the held-out pass rate every --eval-every steps


def run(cfg):
    """Train for --steps updates (or continue a run with --resume), writing config.json, metrics.jsonl and the
    checkpoints to the run directory. Returns the metric rows."""
    state, cfg, guard = setup(cfg)  # Part II: data, model, engine, grader, optimiser, a resumed run's state
    with guard:                     # Part II: the records, the rules that stop a run, checkpoints, signals, clean-up
        if not cfg.resume:  # a new run: step 0 is the initial weights' held-out pass rate
            val, errors = evaluate(state, cfg, 0)
            guard.step_done({"step": 0, **state.totals, **val}, errors)
        for step in range(guard.first, cfg.steps + 1):
            t0 = time.time()
            result = rl_step(state, cfg)
            if result is None:
                rules = ", ".join(sorted(set(state.curriculum.removed.values())))  # npr: No-Positive-Resampling
                print(f"every training prompt has been removed by the curriculum ({rules}); stopping")
                break
            row, errors = guard.row(step, result, time.time() - t0), result["errors"]
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val, val_errors = evaluate(state, cfg, step)
                row, errors = {**row, **val}, errors + val_errors
                row.update(live_fit(guard.rows + [row]) if cfg.live_fit else {})  # the predicted A (Part II)
            guard.step_done(row, errors)  # recorded, the stop rules, the checkpoint cadence
            if guard.signalled():  # Ctrl-C or SIGTERM during the step: checkpoint it, say how to resume, stop
                guard.stop_here()
                break
    return guard.rows


def evaluate(state, cfg, step):
    """Held-out mean pass rate, mean@k with k = --eval-samples (the paper's mean@16) [Sec. 2], with the current weights,
    each task's beside it, and the grading errors (under torchrun rank r evaluates prompts r, r + W, ...: the mean is
    over all). Training groups in flight decode on, apart: their share of the engine's time is training compute
    (`ahead`, next row)."""
    rollouts, before = state.rollouts, state.rollouts.train_seconds
    if all_max(state.engine.version != state.version):  # PPO-off-policy-k mid-round (or asleep), on some rank: the
        while rollouts.open:  # round's groups finish with the round's weights, then every rank's engine gets the newest
            rollouts.poll()   # (the push is collective under torchrun)
        state.engine.push(state.model, state.version)
    ids = list(range(state.curriculum.rank, len(state.val_ids), state.curriculum.world))
    groups = rollout(rollouts, [state.val_ids[i] for i in ids], cfg.eval_samples, step_seed(cfg.seed, RNG_EVAL, step),
                     ids=ids)
    rollouts.ahead += rollouts.train_seconds - before
    rollouts.decoded = rollouts.steps = rollouts.seconds = 0  # the other metrics count training steps only
    correct, rewards, errors = score(state.tok, groups, [state.val[i] for i in ids], state.grader, cfg)
    save_completions(cfg, step, state.tok, [state.val[i] for i in ids], groups, correct, rewards)  # the flag's (II)
    return pass_rates(state, cfg, ids, correct), errors  # {"val_pass_rate": ..., and per task} (Part II)

# --------------------------------------------------------------------------------------------------
# One ScaleRL step: the algorithm box of the module docstring, one call per arrow, each numbered as its section


def rl_step(state, cfg):
    """One update: each call's number is its section's. Returns what happened, for the metrics row (run() times it),
    or None when no prompt is left."""
    groups, stale = next_batch(state, cfg)                                     # 1. [Sec. 3.1, 4] P complete groups
    if all_max(groups is None):  # no prompt left (under torchrun: on some rank; every rank stops)
        return None
    state.engine.sleep()  # the trainer trains now (vLLM sleep mode when idle; generators apart decode meanwhile)
    prompts, comps, idx = [g.prompt for g in groups], [g.completions for g in groups], [g.prompt_index for g in groups]
    correct, rewards, errors = score(state.tok, comps, [state.train[i] for i in idx], state.grader, cfg)  # 2. [2]
    samples, stats = build_batch(prompts, comps, correct, rewards, state.version, cfg)  # 3. [Sec. 3.2] the batch
    update_curriculum(state.curriculum, idx, correct.mean(axis=1).tolist(), cfg)  # 4. [Sec. 3.2] NPR
    update = train_step(state.policy, state.opt, state.sched, samples, cfg, state.tok.pad_token_id, state.autocast,
                        state.frozen) if all_sum(len(samples)) else {}        # 5. [Sec. 3.2] CISPO, FP32 head
    if update and not update["skipped"]:
        state.version += 1
    push_seconds = push_weights(state, cfg)                                    # 6. [Sec. 3.1] in flight
    return dict(groups=groups, rewards=rewards, errors=errors, samples=samples, stats=stats, update=update, stale=stale,
                push_seconds=push_seconds, rollout=rollout_metrics(comps, correct, rewards))

# --------------------------------------------------------------------------------------------------
# 1. Rollouts [Sec. 2, 3.1, 4]: the next batch of P complete groups (a group is one prompt's G completions) under the
#    lag bound of PipelineRL-k; groups admitted while the engine has room, streamed through it (Part II) with forced
#    length interruptions; every token keeps the generator's log-prob and the weight version that sampled it.


def next_batch(state, cfg):
    """The next update's P complete groups, oldest first, under the lag bound [Sec. 3.1]. Returns (groups, stale):
    stale counts the groups dropped for a token more than K updates old (none: admission and the wait keep the
    bound); groups is None when nothing is left to generate."""
    # The bound: the weights updated are at most K updates newer than any token trained on (group_lag <= K), the
    # paper's k seen from the data's side (the trainer runs at most k updates ahead of its data): K = k.
    stale, rollouts, engine = 0, state.rollouts, state.engine
    while True:
        within = sorted((g for g in rollouts.done if group_lag(g, state.version) <= cfg.max_lag),
                        key=lambda g: (-group_lag(g, state.version), g.key))  # among equals, the first started
        stale, rollouts.done = stale + len(rollouts.done) - len(within), within
        share = cfg.prompts_per_step // state.curriculum.world  # under torchrun: this rank's share of the P groups
        admit(state, cfg, admission(cfg, len(rollouts.open), len(rollouts.done), engine.unfinished(), engine.capacity,
                                    state.curriculum.world))
        # The wait rule. A group not in this batch must be trained at a version no later than its deadline, its
        # oldest token's version + K (in flight: its start's + K). The updates after this one take P groups each,
        # earliest deadline first, so the k-th group to fall due (k = 0, 1, ...) needs k + 1 slots up to its deadline;
        # where one would not get them, this update waits and the engine decodes on. Check it: K = 2, P = 2, trainer
        # at v, four slow groups started at v - 1 still decoding, two others complete. Train the two now, and the four
        # (deadline v + 1) have one update, 2 slots, left: the third needs 3, so the trainer waits (a rule waiting only
        # for groups due at this very update would let two of them pass the bound).
        deadlines = sorted([g.oldest + cfg.max_lag for g in within[share:]] +
                           [g.started + cfg.max_lag for g in rollouts.open.values()])
        slots = [(d - state.version) * share for d in deadlines]  # what the updates after this one, to d, can train
        wait = any(slots_to_deadline < k + 1 for k, slots_to_deadline in enumerate(slots))
        if len(within) >= share and not wait:  # (the groups just admitted decode meanwhile, where generators are apart)
            batch, rollouts.done = within[:share], within[share:]
            return batch, stale
        if not rollouts.open:
            return None, stale
        rollouts.poll()


def admission(cfg, in_flight, ready, unfinished, capacity, ranks=1):
    """How many new groups to start now. pipeline (PipelineRL-k, ScaleRL): keep the engine full (its `capacity`
    sequences decoding at once), but never hold over (K + 1) x P groups between admission and training, so that the
    updates to come can train each in time. ppo: K batches at a time, with the same weights, once the previous K are
    trained. K = 0: the synchronous loop. ranks: under torchrun each rank admits for its share of P."""
    P, K, G = cfg.prompts_per_step // ranks, cfg.max_lag, cfg.generations_per_prompt  # P: this rank's share
    if cfg.off_policy == "ppo" or K == 0:
        return 0 if in_flight or ready else P * (max(K, 1) if cfg.off_policy == "ppo" else 1)
    free = (capacity - unfinished) // G if in_flight else max(1, (capacity - unfinished) // G)
    return int(max(0, min((K + 1) * P - in_flight - ready, free)))


def admit(state, cfg, n):
    """Start n new groups: the prompts in flight at a resumed checkpoint first, then the curriculum's next ones."""
    again = [state.requeue.popleft() for _ in range(min(n, len(state.requeue)))]
    idx = [i for i in again if i not in state.curriculum.removed]
    for i in idx + next_prompts(state.curriculum, n - len(idx)):
        state.rollouts.add(("train", state.serial), state.train_ids[i], cfg.generations_per_prompt,
                           step_seed(cfg.seed, RNG_ROLLOUT, state.serial), prompt_index=i)
        state.serial += state.curriculum.world  # under torchrun rank r numbers its groups r, r + W, ...: own streams


def group_lag(g, version):
    """Updates between the weights that sampled the group's oldest token and the weights being updated."""
    if g.oldest is None:  # the group is complete: its versions no longer change
        g.oldest = min(v for c in g.completions for v, m in zip(c.versions, c.mask) if m)
    return version - g.oldest


@dataclass
class Completion:
    tokens: list          # generated token ids, EOS included when the completion stopped by itself
    logprobs: list        # generator's log pi_gen(token) of each, at the sampling temperature
    finished: bool        # stopped with EOS (False: hit a length limit, i.e. truncated)
    mask: list            # 1 = sampled by the policy, 0 = injected (the interruption phrase)
    versions: list        # weight version (optimiser updates so far) that sampled each token
    interrupted: bool = False
    experts: object = None  # MoE: the experts routing each token's predicting position [tokens, layers, k] (-1: none)
    verdict: str = None   # the reward's word on it (score), where it gives one: code's 'passed', why not, 'hack: ...'


@dataclass
class Group:
    """One prompt and its G completions while they are being generated."""
    key: tuple            # ("train", serial) or ("eval", seed, i)
    prompt: list          # prompt token ids
    completions: list
    budgets: list         # each completion's thinking budget
    seeds: list           # each completion's request seeds (first piece, continuation)
    prompt_index: int = None  # a training group's prompt (its index in the training set); None for evaluation
    left: int = 0         # completions not yet complete
    oldest: int = None    # the oldest weight version of its sampled tokens, once complete (see group_lag)
    started: int = 0      # the engine's weight version when it started: none of its tokens is older


class Rollouts:
    """Groups of G completions streamed through an engine. add() queues a prompt's G first requests; poll() runs
    one engine step, moves each finished piece on (done, continued or interrupted, see next_request) and collects
    the groups whose G completions are complete in `done`."""

    def __init__(self, cfg, engine, tok):
        self.cfg, self.engine, self.tok = cfg, engine, tok
        self.phrase = {s: tok(s + cfg.interruption_phrase, add_special_tokens=False).input_ids for s in ("", " ")}
        self.think_end = tok(cfg.think_end, add_special_tokens=False).input_ids
        self.open, self.done = {}, []  # key -> Group being generated; complete groups, in completion order
        # for the metrics: tokens decoded, engine steps, their time and its training groups' share (see evaluate), and
        # the sequences the engine preempted
        self.decoded = self.steps = self.seconds = self.train_seconds = self.ahead = self.preempted = 0

    def add(self, key, prompt, n, seed, prompt_index=None):
        """Start a group: n completions of prompt (token ids); `seed` draws the thinking budgets and request seeds."""
        lo, hi = self.cfg.think_budget if self.cfg.length_control == "interrupt" else (self.cfg.max_new_tokens,) * 2
        rng = np.random.default_rng(seed)  # request seeds base + j (first piece) and base' + j (the rest)
        seeds, budgets = (rng.integers(2**62, size=2) + np.arange(n)[:, None]).tolist(), \
            rng.integers(lo, hi + 1, size=n).tolist()
        g = Group(key, list(prompt), [Completion([], [], False, [], []) for _ in range(n)], budgets, seeds,
                  prompt_index, n, started=self.engine.version)
        self.open[key] = g
        for j in range(n):
            self.engine.submit((key, j), g.prompt, budgets[j], seeds[j][0])

    def wait(self, keys):
        """Poll until the groups `keys` are complete; take them out of `done`, in that order (others stay there)."""
        want = set(keys)
        while want - {g.key for g in self.done}:
            self.poll()
        got = {g.key: g for g in self.done if g.key in want}
        self.done = [g for g in self.done if g.key not in want]
        return [got[k] for k in keys]

    def poll(self):
        t0, left = time.time(), [(g.left, g.key[0] == "train") for g in self.open.values()]  # sequences in flight
        before = self.engine.preemptions
        pieces, decoded, steps = self.engine.step()
        dt = time.time() - t0
        self.decoded, self.steps, self.seconds = self.decoded + decoded, self.steps + steps, self.seconds + dt
        self.preempted += self.engine.preemptions - before
        self.train_seconds += dt * sum(n for n, train in left if train) / max(sum(n for n, _ in left), 1)  # evaluate
        for (key, j), p in pieces:
            g = self.open[key]
            c = g.completions[j]
            c.tokens, c.logprobs, c.mask, c.versions, c.finished = (
                c.tokens + p.tokens, c.logprobs + p.logprobs, c.mask + p.mask, c.versions + p.versions, p.finished)
            c.experts = join_experts(c.experts, p.experts)
            action = next_request(c, g.budgets[j], self.cfg, self.think_end)
            if action == "interrupt":  # the phrase was not sampled: loss mask 0, a placeholder log-prob
                phrase = self.phrase["" if self.tok.decode(c.tokens[-1:])[-1:].isspace() else " "]  # its own word
                n = len(phrase)
                c.tokens, c.logprobs, c.mask = c.tokens + phrase, c.logprobs + [0.0] * n, c.mask + [0] * n
                c.versions, c.interrupted = c.versions + [self.engine.version] * n, True
                c.experts = join_experts(c.experts, n)
            if action == "done":
                g.left -= 1
                if not g.left:
                    self.done.append(self.open.pop(key))
            else:
                more = self.cfg.answer_budget if action == "interrupt" else self.cfg.max_new_tokens - len(c.tokens)
                self.engine.submit((key, j), g.prompt + c.tokens, more, g.seeds[j][1])


def next_request(c, budget, cfg, think_end):
    """Forced length interruptions [Sec. 2, 4]: what a completion needs when a piece of it comes back."""
    at_budget = len(c.tokens) == budget  # its first request (at most its thinking budget, drawn in [LO, HI]) ran out
    if cfg.length_control != "interrupt" or c.finished or c.interrupted or not at_budget:
        return "done"  # ended by itself, answered after an interruption, or the rest of a closed reasoning
    if find_subsequence(c.tokens, think_end) is not None:
        return "continue"  # it closed its reasoning within the budget: it goes on to --max-new-tokens in all
    # It did not: the phrase is appended, and it gets --answer-budget more tokens to answer. (A model without a
    # thinking format never closes its reasoning, so every completion of it that reaches the budget is interrupted.)
    return "interrupt"

# --------------------------------------------------------------------------------------------------
# 2. Scoring [Sec. 2]: a verifiable, binary reward (the reward functions and the grading pool are in Part II)


def score(tok, groups, data, grader, cfg):
    """Correctness and reward of every completion: two arrays [n_prompts, G], and the grading errors. data: each
    group's (prompt, answer, row[, reward]) item, which its reward sees with the completion's text; a reward gives a
    number, or (number, verdict): the verdict is kept on the completion. Correct is full marks, 1 (a partial credit is
    reward, not a pass). A completion that did not end (no EOS) has no final answer: 0, ungraded. --length-control
    penalty adds the overlong penalty to the correct answers only (as the paper ablated it)."""
    specials = special_ids(tok)  # (the stop token that ends a completion is not part of the text graded)
    done = [(i, j, c, item) for i, (g, (_, *item)) in enumerate(zip(groups, data)) for j, c in enumerate(g)
            if c.finished]
    grades, errors = grader([(completion_text(tok, c.tokens, specials), *item) for _, _, c, item in done])
    rewards = np.zeros((len(groups), len(groups[0]) if groups else 0))
    for (i, j, c, _), (r, verdict) in zip(done, grades):  # (reward, verdict) of each
        rewards[i, j], c.verdict = r, verdict
    correct = (rewards >= 1).astype(float)
    pen = np.array([[overlong_penalty(len(c.tokens), cfg.max_len, cfg.cache_len) for c in g] for g in groups]) \
        if cfg.length_control == "penalty" else 0.0
    return correct, rewards + correct * pen, errors


def rollout_metrics(groups, correct, rewards):
    """What the step's completions did, {name: (total, count)}: metrics_row logs total / count, each summed over the
    ranks (no value where count is 0). groups: every drawn prompt's G Completions, the filtered too; correct, rewards:
    score's arrays [prompts, G]. A fork's metric over the rollouts goes here (docs/fork.md)."""
    verdicts = [c.verdict for g in groups for c in g if c.verdict and not c.verdict.startswith("error:")]  # code's
    hacks = sum(v.startswith("hack:") for v in verdicts)  # hack_frac: of those, the share with a hack's mark
    return {"reward_mean": (rewards.sum(), rewards.size), "hack_frac": (hacks, len(verdicts))}


def overlong_penalty(length, max_len, cache_len):
    """DAPO's soft overlong punishment (the length-control alternative the paper ablated): 0 up to
    L_max - L_cache tokens, then falling linearly to -1 at L_max, and -1 beyond (L_cache 0: -1 at once past L_max)."""
    return min(0.0, max(-1.0, (max_len - cache_len - length) / cache_len)) if cache_len else -float(length > max_len)

# --------------------------------------------------------------------------------------------------
# 3. The batch [Sec. 3.2]: truncated completions out, zero-variance filtering, advantages, aggregation


def build_batch(prompt_ids, groups, correct, rewards, version, cfg):
    """From one step's rollouts to the training batch: truncated completions out (--mask-truncated), zero-variance
    filter, advantages, aggregation weights, each completion's values for the loss (completion_values) and its tokens'
    lags from `version`, the weights it updates. Returns (samples, stats). Tokens with mask 0 (injected) and excluded
    completions count in no normaliser."""
    # valid[i, j]: completion j of prompt i is in the batch (it ended, or --no-mask-truncated keeps every one)
    valid = np.array([[c.finished or not cfg.mask_truncated for c in g] for g in groups]).reshape(rewards.shape)
    varied = zero_variance_keep(rewards, valid)  # prompts whose valid completions' rewards differ
    trained = np.flatnonzero(varied if cfg.zero_variance_filter else valid.any(axis=1))  # the prompts in the loss
    stats = {"zero_variance_frac": float(1 - varied.mean()), "active_prompts": len(trained),
             "truncated_excluded": int((~valid).sum())}
    adv = compute_advantages(rewards[trained], cfg.adv_norm, valid[trained])  # row a: prompt trained[a]
    completions = [[j for j in range(len(groups[i])) if valid[i, j]] for i in trained]  # each one's valid ones
    lengths = [[sum(groups[i][j].mask) for j in js] for i, js in zip(trained, completions)]  # sampled tokens
    weights = completion_weights(lengths, cfg.loss_agg)
    samples = []
    for a, (i, js) in enumerate(zip(trained, completions)):
        for j, w in zip(js, weights[a]):
            c = groups[i][j]
            samples.append(Sample(prompt_ids[i], c.tokens, c.logprobs, c.mask, [version - v for v in c.versions],
                                  float(adv[a, j]), w, completion_values(c, correct[i, j], rewards[i, j]), c.experts))
    return samples, stats


def zero_variance_keep(rewards, valid=None):
    """Zero-variance filtering [Sec. 3.2]: True for the prompts whose G rewards (over the `valid` completions, see
    --mask-truncated) are not all equal. A flat group has zero advantage everywhere and only dilutes the loss; it
    is dropped (the batch is not refilled). A group with fewer than two valid completions is flat."""
    valid = np.ones(rewards.shape, bool) if valid is None else valid
    return np.where(valid, rewards, -np.inf).max(axis=1) > np.where(valid, rewards, np.inf).min(axis=1)


def compute_advantages(rewards, norm, valid=None, eps=1e-6):
    """Group-centred advantages A_i = r_i - mean_j r_j [Sec. 2], normalised over the `valid` completions (others: 0):
    batch  -- divided by the std of all advantages in the batch (ScaleRL) [Sec. 3.2]
    prompt -- divided by the std of the prompt's own rewards (GRPO);   none -- as they are (Dr. GRPO).
    Population stds. Rewards are 0/1 here, +-1 in the paper: the same advantages, but with none ours are half its."""
    valid = np.ones(rewards.shape, bool) if valid is None else valid
    n = np.maximum(valid.sum(axis=1, keepdims=True), 1)
    adv = np.where(valid, rewards - (rewards * valid).sum(axis=1, keepdims=True) / n, 0.0)
    if norm == "batch":  # in one process: adv / (adv[valid].std() + eps); all_sum adds the ranks' sums
        count, total = all_sum(valid.sum(), adv[valid].sum())
        mean = total / max(count, 1)
        var = all_sum(((adv[valid] - mean) ** 2).sum()) / max(count, 1)  # the std in two passes, as numpy's
        return adv / (math.sqrt(var) + eps)
    if norm == "prompt":
        return adv / (np.sqrt((adv ** 2).sum(axis=1, keepdims=True) / n) + eps)
    return adv


def completion_weights(groups_lengths, agg):
    """Loss aggregation [Sec. 3.2] as one weight per completion, on each of its tokens, so that the loss is
    sum(weight * token_loss) however the tokens are split into micro-batches (counts over every rank's prompts):
    prompt -- per prompt: sum over its G completions / their tokens; mean over prompts (ScaleRL; the paper credits DAPO)
    sample -- per completion: mean over its tokens; mean over completions (GRPO)
    token  -- sum over all tokens / all tokens of the batch (common in DAPO implementations)"""
    n_prompts, n_samples, n_tokens = all_sum(len(groups_lengths), sum(len(g) for g in groups_lengths),
                                             sum(sum(g) for g in groups_lengths))
    if agg == "prompt":
        return [[1.0 / (n_prompts * max(sum(g), 1))] * len(g) for g in groups_lengths]
    if agg == "sample":
        return [[1.0 / (n_samples * max(L, 1)) for L in g] for g in groups_lengths]
    return [[1.0 / max(n_tokens, 1)] * len(g) for g in groups_lengths]


@dataclass
class Sample:
    """One completion of the training batch, and what the loss knows of it (batch_tensors makes the tensors)."""
    prompt: list                # prompt token ids
    tokens: list                # completion token ids
    gen_logprobs: list = None   # the generator's log pi_gen of each token
    mask: list = None           # 1 = sampled (trained on), 0 = injected (context only)
    lags: list = None           # each token's lag: updates between the weights that sampled it and those it updates
    advantage: float = 0.0      # the completion's normalised advantage
    weight: float = 0.0         # its tokens' aggregation weight (completion_weights)
    values: dict = field(default_factory=dict)  # completion_values: policy_loss gets each, repeated over its tokens
    experts: object = None      # MoE: Completion.experts, the generator's routing (R3 replays it: --routing-replay)


def completion_values(c, correct, reward):
    """What the loss knows of a completion besides its tokens, {name: number}: policy_loss receives each one under its
    name, repeated over the completion's trained tokens. A fork's per-completion value goes here (docs/fork.md)."""
    return {"correct": float(correct), "reward": float(reward), "length": sum(c.mask)}  # length: sampled tokens

# --------------------------------------------------------------------------------------------------
# 4. Curriculum [Sec. 3.2]: epochs over the training prompts, with No-Positive-Resampling (admit draws next_prompts)


@dataclass
class Curriculum:
    """Epoch-wise sampling of training prompts with No-Positive-Resampling [Sec. 3.2]. Under torchrun rank r draws,
    and records the pass rates of, the prompts r, r + W, r + 2W, ... of the W ranks' (its shard) only."""
    n_prompts: int
    seed: int
    rank: int = 0
    world: int = 1
    epoch: int = 0
    pos: int = 0
    order: list = field(default_factory=list)
    history: dict = field(default_factory=dict)  # prompt index -> its pass rate at each draw, oldest first
    removed: dict = field(default_factory=dict)  # prompt index -> the name of the rule that removed it


def update_curriculum(curriculum, indices, pass_rates, cfg):
    """Record the pass rate of each prompt just drawn, and remove the prompts that removal_rule says to."""
    for i, r in zip(indices, pass_rates):
        curriculum.history.setdefault(i, []).append(float(r))
        rule = removal_rule(curriculum.history[i], cfg)
        if rule and i not in curriculum.removed:  # removed for good: next_prompts never draws it again
            curriculum.removed[i] = rule  # metrics.jsonl counts each rule's removals: RULE_removed


def removal_rule(history, cfg):
    """Whether a prompt leaves the later epochs, from its pass rates (one per draw, oldest first): the name of the
    rule that removes it, or None. A fork's rule goes here (docs/fork.md)."""
    # No-Positive-Resampling [Sec. 3.2]: the paper does not define the history it reads; here, the last draw.
    if cfg.npr_threshold < 1.0 and history[-1] >= cfg.npr_threshold:
        return "npr"
    return None


def next_prompts(curriculum, k):
    """The next k prompt indices (fewer only when NPR has removed every prompt). Each epoch is a fresh shuffle of the
    prompts NPR has not removed; a prompt removed during an epoch is skipped if its turn in that epoch is still to
    come (with the off-policy loop its result can arrive after the next epoch has been shuffled)."""
    out, removed = [], curriculum.removed
    while len(out) < k:
        if curriculum.pos >= len(curriculum.order):
            rank, world = curriculum.rank, curriculum.world  # rank r's shard: prompts r, r + W, ...
            active = [i for i in range(rank, curriculum.n_prompts, world) if i not in removed]
            if not active:
                return out
            seed = [curriculum.seed, RNG_EPOCH, curriculum.epoch] + ([rank] if world > 1 else [])  # a shard its own
            curriculum.order = np.random.default_rng(seed).permutation(active).tolist()
            curriculum.epoch, curriculum.pos = curriculum.epoch + 1, 0
        i, curriculum.pos = curriculum.order[curriculum.pos], curriculum.pos + 1
        if i not in removed:
            out.append(i)
    return out

# --------------------------------------------------------------------------------------------------
# 5. The update [Sec. 3.2, 4]: AdamW on -J, its gradient accumulated over micro-batches; -J from plain tensors, one
#    value per trained token: the CISPO loss, and the FP32 LM head's log-probs (make_optimizer and frozen_models serve
#    setup, Part II)


def train_step(model, opt, sched, samples, cfg, pad_id, autocast_dtype=None, frozen=None):
    """One optimiser step on the batch: -J's gradient accumulated over the micro-batches (compute_gradients), clipped,
    then AdamW. Returns the update's metrics, policy_loss's and mismatch_sums' as total / count over the batch."""
    t0, peak = time.time(), memory.gpu_peak(model, opt)  # (CUDA: the memory peak)
    model.train()
    batches = even_out(micro_batches(samples, cfg.micro_batch_tokens), pad_id)  # as many on every rank (FSDP)
    loss, n_tok, metrics = compute_gradients(model, batches, cfg, pad_id, autocast_dtype, frozen)
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)).item()
    loss, n_tok = all_sum(float(loss), n_tok)  # (the whole batch's: summed over the ranks)
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    lr = opt.param_groups[0]["lr"]  # the rate of this update (the scheduler moves on after it)
    if not skipped:  # a non-finite loss or gradient would poison the weights and AdamW's moments: skip it
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, "trained_tokens": 0 if skipped else int(n_tok),
            "lr": lr, "train_seconds": time.time() - t0, **peak(), **mean_over_ranks(metrics)}


def compute_gradients(model, batches, cfg, pad_id, autocast_dtype=None, frozen=None):
    """The update's tensor part, nothing read back from the device (bench.py --memory runs it on fake tensors): for each
    micro-batch its forward pass (under autocast, without its cast cache: it would keep a bf16 copy of every layer's
    float32 weights until the backward pass), -J and its backward, the gradients accumulating. Returns -J over the
    batch (float64), the trained tokens and {name: (total, count)} of the metrics, this rank's."""
    policy, device, loss_sum, n_tok, metrics = as_policy(model), next(model.parameters()).device, 0.0, 0, {}
    for mb in batches:
        x = batch_tensors(mb, pad_id, device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None, cache_enabled=False):
            terms = policy(x, cfg)  # token_terms of the trained tokens, "logp" among them
            with torch.no_grad():
                terms.update({f"{k}_logp": as_policy(m)(x, cfg)["logp"] for k, m in (frozen or {}).items()})
        logp, routed = terms.pop("logp"), terms.pop("routing_differs", None)  # (routed: an MoE's, Policy)
        loss, mb_metrics = policy_loss(logp, x["logp_gen"], x["A"], x["weight"], x["seq"], cfg, **x["values"], **terms)
        backward_sum(loss)  # (this rank's share of the sum: under torchrun the gradient is the sum's, Part II)
        loss_sum, n_tok = loss_sum + loss.detach().double(), n_tok + len(logp)
        mismatch = mismatch_sums(logp, x["logp_gen"], x["fresh"], routed)
        for k, (total, count) in {**mb_metrics, **mismatch}.items():
            metrics[k] = (metrics.get(k, (0.0, 0))[0] + total.double(), metrics.get(k, (0.0, 0))[1] + count)
    return loss_sum, n_tok, metrics


def policy_loss(logp, logp_gen, A, weight, seq, cfg, **terms):
    """-J on a micro-batch's trained tokens, sum(weight * token_loss), and its metrics {name: (total, count)}, one value
    per trained token (batch_tensors): logp = log pi_train (with its gradient), logp_gen = log pi_gen, A = A_i^norm
    and weight of its completion, seq = its completion's number. terms: token_terms' others, NAME_logp for each of
    frozen_models', and completion_values' (correct, reward, length) repeated over the completion's tokens."""
    # rho = pi_train / pi_gen, pi_gen as the engine recorded it while sampling (not a recomputed pi_old: the engine's
    # weights can change mid-completion, so one completion can mix versions)
    rho = gspo_ratio(logp, logp_gen, seq) if cfg.loss == "gspo" else torch.exp(logp - logp_gen)
    if cfg.loss == "cispo":  # ScaleRL: -sg(min(rho, eps_max)) * A * log pi_train; every token keeps its gradient
        token_loss = cispo_loss(logp, rho, A, cfg.eps_max)
    else:  # dapo: PPO's clipped surrogate on the token's ratio; gspo: the same on one ratio per completion
        token_loss = clipped_loss(rho, A, cfg.eps_low, cfg.eps_high)
    r = rho.detach()  # clip_frac: the share of tokens whose weight CISPO truncated, or whose gradient PPO's min clipped
    clipped = r > cfg.eps_max if cfg.loss == "cispo" else ((r > 1 + cfg.eps_high) & (A > 0)) | \
        ((r < 1 - cfg.eps_low) & (A < 0))
    metrics = {"clip_frac": (clipped.sum(), len(logp))}
    # A fork's loss term goes here: token_loss = token_loss + coef * term, metrics["term"] = (term.sum(), len(term))
    return (weight * token_loss).sum(), metrics


def cispo_loss(logp, ratio, adv, eps_max):
    """CISPO token loss [Sec. 3.2]: -sg(min(rho, eps_max)) * A * log pi_train, rho = pi_train / pi_gen (`ratio`).
    Only the importance weight is truncated (from above) and it carries no gradient: every token keeps the
    REINFORCE gradient A * grad log pi, scaled by the truncated weight."""
    return -torch.clamp(ratio.detach(), max=eps_max) * adv * logp


def clipped_loss(ratio, adv, eps_low, eps_high):
    """PPO's clipped token loss, -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) (`ratio` with its gradient), the
    two losses the paper ablated: DAPO's, rho = pi_train / pi_gen, asymmetric (0.2 below, 0.28 above); GSPO's, rho
    gspo_ratio's one ratio per completion, with GSPO's own narrow range (3e-4 below, 4e-4 above). A token (a GSPO
    completion) whose clipped term is the minimum gets no gradient. GSPO averages over each sequence's tokens
    (--loss-agg sample); with ScaleRL's prompt average each token of a prompt weighs the same."""
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def gspo_ratio(logp, logp_gen, seq):
    """GSPO's sequence-level ratio (Zheng et al. 2025) s_i = exp(mean over completion i's tokens of log pi_train -
    log pi_gen), one value per token (seq numbers each token's completion), in the token form sg(s_i) * pi_train(y_t) /
    sg(pi_train(y_t)): the value s_i, the gradient s_i * grad log pi_train(y_t), so that GSPO's s_i * grad log s_i
    is the mean over the completion's tokens."""
    d = (logp - logp_gen).detach()
    n = torch.zeros_like(d).index_add_(0, seq, torch.ones_like(d))  # tokens of completion k at k (seq < len(d))
    mean = torch.zeros_like(d).index_add_(0, seq, d) / n
    return torch.exp(mean[seq] + logp - logp.detach())



def token_logprobs(hidden, head, targets, temperature, fp32=True, chunk=1024, post=None):
    """{name: tensor [N]}: token_terms of head(hidden) / T for every row of hidden [N, H], "logp" among them [Sec. 3.2,
    FP32 LM head]; post: logit_transform. Rows go `chunk` at a time, each recomputed in backward, so memory grows with
    chunk x V, not N x V (docs/engines.md). (No rows: one empty chunk, in the graph.)"""
    from torch.utils.checkpoint import checkpoint
    out, product = [], FP32Head(head.weight, fp32 == "split") if fp32 else None  # (split: W's parts made once, here)
    for s in range(0, max(hidden.shape[0], 1), chunk):
        args = (hidden[s:s + chunk], head.weight, head.bias, targets[s:s + chunk], temperature, product, post)
        grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        out.append(checkpoint(_chunk_terms, *args, use_reentrant=False) if grad else _chunk_terms(*args))
    return {k: torch.cat([p[k] for p in out]) for k in out[0]}


def _chunk_terms(h, w, b, y, temperature, product, post):
    """One chunk of token_logprobs: the LM head's logits of h [n, H], the FP32 head's product (FP32Head), or without it
    the head in the compute dtype, only its output cast to float32; then their token_terms."""
    logits = product(h, b) if product else F.linear(h, w, b).float()
    return token_terms((post(logits) if post else logits) / temperature, y)


def token_terms(logits, targets):
    """Per-token quantities of the trained tokens from their logits [N, vocabulary] (float32 with the FP32 head,
    divided by the temperature): "logp", log pi_train of each target, which the losses need, and whatever a fork adds
    here (an entropy, say: docs/fork.md). Each is a tensor [N]; policy_loss receives every one under its name."""
    return {"logp": logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)}


def make_optimizer(model, cfg):
    """AdamW with a linear warm-up to a constant learning rate [Sec. 3.2 / Appendix]."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    return opt, sched


def frozen_models(cfg, load_initial):
    """Models that the loss needs besides the policy, {name: model}, built once per run (setup): ScaleRL needs none.
    load_initial() loads the run's initial weights (also when resumed) like the policy's, frozen. A KL penalty returns
    {"ref": load_initial()} (docs/fork.md); train_step gives policy_loss each one's log-probs as NAME_logp."""
    return {}

# --------------------------------------------------------------------------------------------------
# 6. The push [Sec. 3.1]: the new weights into the engine, in flight


def push_weights(state, cfg):
    """The engine gets each update at once (pipeline: sequences in flight go on with the new weights), except in
    PPO-off-policy-k, where it waits until the round's K batches are trained: none still decoding or waiting, on any
    rank (the push is collective under torchrun). Returns the seconds it took."""
    t0, waiting = time.time(), cfg.off_policy == "ppo" and all_max(bool(state.rollouts.open or state.rollouts.done))
    if all_max(state.engine.version != state.version) and not waiting:  # behind on some rank (asleep: no version)
        state.engine.push(state.model, state.version)
    return time.time() - t0


# ==================================================================================================
# PART II -- PLUMBING. Nothing below changes the recipe. A run meets it in this order, and so does the reader:
#   1. Setup                        main; setup, start_run: checks, data, model, grading pool, engine, optimiser,
#                                   Guard; tear_down
#   2. The command line             Config, parse_args, config_in_force, fill_defaults, validate, the hub check
#   3. Data                         the built-in tasks, --data's readers, prompts encoded
#   4. Models                       the embedded tiny model, loading a model and its tokenizer; the memory plan
#   5. Engines                      the contract, Hugging Face generate, in-process vLLM (the split: generators.py)
#   6. Grading and rewards          the pool of processes that runs the reward functions with a time limit; REWARDS
#   7. The trainer's forward pass   Policy, the micro-batch's tensors, the FP32 head's split-bf16 product
#   8. Metrics and the screen       Guard (the rules, the cadence, signals), Recorder (the records), metrics_row
#   9. Run directories, checkpoints the lock, checkpoints written atomically, resume
#  10. torchrun                     ranks and their sums, FSDP2's shards, the weights gathered for a push
# Beside this file: memory.py (the memory plan), moe.py (an MoE's routing: called from load_model, check_architecture,
# hf_generate, VLLMEngine's start and push, Policy.forward, batch_tensors, mismatch_sums), sandbox.py and
# judge.py (the code reward's sandbox and verdict), generators.py (the generator-trainer split). Within a section a
# function comes before those it calls, and a run's route from main through one step reads down the file (bench.py
# --route lists its jumps back) but for 8 calls into Part I, which comes first to be read in one sitting while Part II
# builds and drives it (main's run, make_optimizer, Rollouts, frozen_models, rollout's add and wait, the FP32 head's
# logits, token_logprobs), for step_seed (2), which the vLLM engine shares with the recipe, and for the Guard's call
# back to tear_down (1).
# ==================================================================================================

# --------------------------------------------------------------------------------------------------
# 1. Setup: main, then what run() calls first, setup; start_run's body is the table of contents of the sections below;
#    tear_down, the run's end however it ends (the Guard calls it)
# --------------------------------------------------------------------------------------------------


def main(argv=None, end_process=False):
    """The command line's entry point; end_process (the script, and any rank of torchrun): end the process here."""
    status = None  # the exit status, where it is not the end of a run
    try:
        run(parse_args(argv))
    except ScaleRLError as e:  # (status 0: nothing to do)
        print(f"scalerl.py: error: {e}" if e.status else f"scalerl: {e}", file=sys.stderr if e.status else sys.stdout)
        status = e.status
    except KeyboardInterrupt:  # a second SIGINT/SIGTERM abandoned the step in progress
        status = 130
    except BaseException:
        if not launched():
            raise
        traceback.print_exc()
        status = 1
    if launched() and dist.is_initialized():  # (a vLLM engine, when it shuts down, takes the process group with it)
        dist.destroy_process_group()
    if end_process or launched():
        # the process ends here, its output flushed, every file, engine and pool closed: the interpreter's shutdown
        # waited 2.5 s in native code after a vLLM engine, and under torchrun a gloo thread freeing a collective's
        # tensors aborted it there ("terminate called without an active exception", 1 of 12 resumed runs under load)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status or 0)
    if status is not None:
        sys.exit(status)


@dataclass
class State:
    """What the loop carries from step to step; setup() in Part II builds it."""
    model: object
    tok: object
    opt: object
    sched: object
    autocast: object          # the compute dtype under autocast (bfloat16 on CUDA), or None
    engine: object            # HFEngine or VLLMEngine (Part II)
    rollouts: Rollouts
    grader: object            # Grader (Part II)
    train: list               # training (prompt, answer, row) items (load_data) and their prompts' token ids
    train_ids: list
    val: list                 # held-out items, and their prompts' token ids
    val_ids: list
    curriculum: Curriculum
    totals: dict              # cumulative counters: device_hours, flops, ... (the scaling curve's x-axes)
    version: int = 0          # optimiser updates so far: the version of the trainer's weights
    serial: int = 0           # training groups started so far
    requeue: collections.deque = field(default_factory=collections.deque)  # in flight at a resumed checkpoint
    policy: object = None     # the Policy module that trains `model` (FSDP2-sharded under torchrun)
    frozen: dict = field(default_factory=dict)  # frozen_models(): the models the loss needs besides the policy
    digests: dict = field(default_factory=dict)  # sha256 of the --data and --val-data files: a resume checks a move


def setup(cfg):
    """Everything the loop needs, spending nothing on bad input: the checks, the run directory claimed, start_run."""
    cfg, resumed = config_in_force(cfg)
    if rank():  # under torchrun only rank 0 prints (errors still show)
        sys.stdout = open(os.devnull, "w")
    quiet_libraries(cfg.verbose)
    release = claim(cfg, resumed["step"] if resumed else None)
    try:
        return start_run(cfg, resumed, release)
    except BaseException as e:
        undone = release(undo=True)
        if isinstance(e, KeyboardInterrupt):  # (a Ctrl-C before the first step: nothing of the run was written)
            print(f"\ninterrupted while starting: {undone or cfg.out + ' is as it was'}", file=sys.stderr, flush=True)
        raise


def start_run(cfg, resumed, release):
    """setup() once the run directory is claimed: the sections of Part II in the order a run meets them."""
    train, val = load_data(cfg)                                         # 3. (bad data stops the run here)
    tasks = {x[3] if len(x) > 3 else cfg.reward for x in train + val}  # 6. the rewards grading them (row_reward)
    start_notes(cfg, tasks)                                             # 1. what the flags alone do not say
    device, dtype = run_device(cfg)
    tok, config, path = load_tokenizer(cfg, cfg.resume or None)         # 4. (the embedded model built first)
    train_ids, val_ids, longest = encode_prompts(tok, config, train, val, cfg)  # 3. within the model's positions
    check_memory_plan(cfg, config, device, longest)                     # 4. before any weight is loaded
    grader = Grader(REWARDS[cfg.reward], grading_workers(cfg, tasks), cfg.reward_timeout)  # 6.
    model, policy, frozen = load_trainer(cfg, device, (tok, config, path))  # 4, 10. (FSDP2 under torchrun)
    autocast = None if dtype == getattr(torch, cfg.param_dtype) else dtype
    engine = make_engine(cfg, config, path, device, dtype, longest, len(val), model, tok, autocast)  # 5.
    opt, sched = make_optimizer(model, cfg)                             # Part I, 5.
    state = State(model, tok, opt, sched, autocast, engine, Rollouts(cfg, engine, tok), grader, train, train_ids,
                  val, val_ids, Curriculum(len(train), cfg.seed, rank(), world()),
                  {"device_hours": 0.0, "flops": 0.0, "gen_tokens": 0, "train_tokens": 0, "skipped_updates": 0},
                  serial=rank(), policy=policy, frozen=frozen,
                  digests={k: file_digest(getattr(cfg, k)) for k in ("data", "val_data") if getattr(cfg, k)})
    rows = restore(resumed, state, cfg.resume) if resumed else []           # 9. a resumed run's state
    engine.push(model, state.version)  # the engine starts from exactly the trainer's weights
    ceiling = hidden_task_ceiling([p for p, *_ in val]) if not cfg.data and cfg.task == "hidden" else None
    first = resumed["step"] + 1 if resumed else 1
    return state, cfg, Guard(cfg, state, Recorder(cfg, state, rows, first, device, ceiling), first, release)  # 8.


def start_notes(cfg, tasks=None):
    """The start-up lines, and refusals, for what the flags alone do not say (docs/off-policy.md); tasks: the rows'
    rewards."""
    if cfg.reward_workers == 0 and "math" in (tasks or ()):  # (--reward math itself: validate's refusal)
        die("--reward-workers 0 grades in this process with no time limit, and math-verify can hang: rows of --data "
            "graded by math (their `reward` field) need grading processes (--reward-workers -1 or >= 1)")
    if "code" in (tasks or {cfg.reward}):
        os.environ["SCALERL_WEAK_SANDBOX"] = str(int(cfg.weak_sandbox))  # (the grading processes inherit it)
        lacks = (cfg.weak_sandbox or cfg.reward != "code") and sandbox.missing()  # (the probe: once, where it matters)
        if lacks and not cfg.weak_sandbox:
            die(f"code rows: this machine cannot isolate programs ({lacks}); --weak-sandbox runs them anyway")
        isolation = "namespaces (user, mount, network, PID, IPC, UTS), seccomp and rlimits" if not lacks else (
            f"seccomp and rlimits only, not isolated (--weak-sandbox; {lacks})")
        print(f"scalerl: code sandbox: {isolation}", flush=True)
    if cfg.engine == "hf" and cfg.off_policy == "pipeline" and cfg.max_lag > 0:
        print("scalerl: --engine hf cannot stream; running the synchronous loop (--max-lag 0)", flush=True)
        cfg.max_lag = 0
    if note := npr_note(cfg):
        print(note, flush=True)
    if cfg.off_policy == "pipeline" and cfg.max_lag > 0 and not cfg.generators:
        print(f"scalerl: PipelineRL-{cfg.max_lag} in one process: generation pauses while the trainer updates; the "
              f"groups decoding or waiting across an update are off-policy, up to {cfg.max_lag} updates (within 2 on "
              "the CPU default; more where groups pile up, as during evaluations); --generators 1 decodes in a process "
              "of its own, beside training", flush=True)


def run_device(cfg):
    """(device, compute dtype): under torchrun each rank its own GPU; bfloat16 on CUDA, float32 on a CPU (--dtype)."""
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    if launched() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)
    return device, getattr(torch, cfg.dtype) if cfg.dtype != "auto" else \
        torch.bfloat16 if device.type == "cuda" else torch.float32


def npr_note(cfg):
    """The start-up line, or None, for when G makes --npr-threshold coarser than it reads."""
    t, G = cfg.npr_threshold, cfg.generations_per_prompt
    need = math.ceil(t * G - 1e-9)  # (0.9 * 10 is 9.000000000000002)
    return None if t >= 1 or need / G <= t + 1e-9 else (f"scalerl: NPR removes a prompt once {need} of its {G} "
                                                        f"completions pass (--npr-threshold {t:g} over G = {G} "
                                                        f"completions is a pass rate of {need / G:g})")


def quiet_libraries(verbose):
    """Without --verbose, the libraries' own chatter stays off the screen: the first lines a user sees are ours."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    if verbose:
        return
    from transformers.utils import logging as hf_logging
    warnings.filterwarnings("ignore")
    sys.warnoptions.append("ignore")  # and in the Python processes this one starts (multiprocessing passes -W on)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def tear_down(state, recorder, release):
    """The run's end, however it ends: the records closed, the grading pool, the engine (after the last collective: no
    generator left, nor (CUDA) an allocator held), then the run directory's lock released (release())."""
    recorder.close()
    state.grader.close()
    state.engine.abort()
    state.engine.close()
    release()

# --------------------------------------------------------------------------------------------------
# 2. The command line: one Config, its flags and their checks (one line, status 2, before anything is spent)
# --------------------------------------------------------------------------------------------------


# what a resumed run takes from the flags typed now: its length, checkpoints, display, outputs and guard (CHANGEABLE,
# the flags a user types to change them), and its place (the checkpoint it resumes and the run directory)
CHANGEABLE = ("steps", "save_every", "keep_last", "verbose", "save_completions", "wandb", "wandb_name",
              "max_fresh_mismatch")
MAY_CHANGE = (*CHANGEABLE, "resume", "out")


def as_flags(names):
    """Config fields as the flags a user types: ("max_lag", "seed") -> "--max-lag, --seed"."""
    return ", ".join("--" + k.replace("_", "-") for k in names)


@dataclass
class Config(Recipe):
    """Every flag: the recipe's (Recipe, Part I), then the plumbing's, which do not change the recipe."""
    model: str = flag("", "HF hub id or local directory; empty = the embedded tiny Llama (CPU default)")
    engine: str = flag("auto", "rollout engine: vllm (in-process) or hf (Hugging Face generate, synchronous loop "
                             "only); auto = vllm when it is installed", ["auto", "vllm", "hf"])
    generators: int = flag(0, "the generator-trainer split [Sec. 2]: N generator processes, each with its own vLLM "
                            "engine on its own device (CUDA: the GPUs after the trainer's; CPU: each its share of "
                            "the cores), decoding while the trainer trains; 0: colocated, the engine in the trainer",
                            at_least=0)
    generator_timeout: float = flag(0.0, "--generators: stop the run when no generator has sent anything for this many "
                                         "seconds (0: 900, or 0.5 s per --max-new-tokens token where that is more: a "
                                         "long completion on a large model can rightly take that long)", at_least=0)
    out: str = flag("", "run directory, this run's alone: new or empty, or the run --resume continues (default "
                      "runs/<time>-<pid>)")
    seed: int = flag(0, "random seed (data order, sampling, the embedded model's initial weights)", at_least=0,
                     below=2**63)
    device: str = flag("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = flag("auto", "compute dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                    ["auto", "float32", "bfloat16", "float16"])
    param_dtype: str = flag("float32", "dtype of the trained weights and optimiser state", ["float32", "bfloat16"])
    tie_word_embeddings: bool = flag(False, "embedded model only: tie the input embedding and the LM head")
    moe: bool = flag(False, "embedded model only: a Mixture-of-Experts (Qwen3-MoE, 8 experts of width 256, 2 a token: "
                          "the dense Llama's active width) in place of the dense Llama")
    fp32_head_product: str = flag("auto", "the FP32 head's product: float32 operands, or split (h and W each two bf16 "
                                          "parts, three bf16 products summed in float32: float32's accuracy within "
                                          "2-3x at tensor-core speed); auto: split on CUDA",
                                  ["auto", "float32", "split"])
    activation_checkpointing: bool = flag(None, "keep only each decoder layer's input for backward and recompute the "
                                              "rest there (memory for time: about a third more compute per update). "
                                              "Default: on with --model, off for the embedded model")
    logprob_chunk: int = flag(1024, "tokens per chunk when computing log-probs (memory ~ chunk x vocab)", above=0)
    micro_batch_tokens: int = flag(8192, "padded tokens per micro-batch (gradient accumulation)", above=0)
    vllm_gpu_memory_utilization: float = flag(0.3, "vLLM on CUDA: fraction of GPU memory for the engine (weights + "
                                                 "KV cache); the trainer uses the rest", above=0, below=1)
    vllm_max_model_len: int = flag(0, "vLLM: context length (0: the longest prompt + completion)", at_least=0)
    vllm_sleep: bool = flag(None, "vLLM on CUDA: free the KV cache while training, wake before the next generation "
                                "(default: on with CUDA when nothing is in flight during training; refused on CPU)")
    vllm_request_seeds: bool = flag(None, "vLLM: a seed for every request, so that a prompt and its seed sample the "
                                        "same tokens in any batch (default: on with CPU; off with CUDA, where vLLM "
                                        "samples each seeded sequence with a generator of its own, one kernel each "
                                        "per decode step; unseeded, each engine samples from its own stream)")
    vllm_kv_cache_mb: int = flag(0, "vLLM on CPU: KV cache size in MiB (0: sized from the flags, room for what the "
                                 "engine decodes at once at the longest length, at most a quarter of the memory "
                                 "available; printed at start-up)", at_least=0)
    vllm_max_num_seqs: int = flag(0, "vLLM: sequences decoded at once, at most (0: vLLM's default, 256 on CPU and "
                                   "1024 on H100-class GPUs); more is faster per token and takes more groups in flight",
                                   at_least=0)
    task: str = flag("largest", "the built-in task, without --data: largest (the largest digit of a list), hidden (the "
                              "same with two digits hidden, so that the best possible pass rate is below 1) or "
                              "second (the second-largest distinct digit); code: largest, answered with a Python "
                              "expression that the code sandbox runs", ["largest", "hidden", "second", "code"])
    data: str = flag("", "training prompts: a .jsonl/.json/.csv/.parquet file, a datasets.save_to_disk directory or a "
                       "hub dataset NAME[:SPLIT] (needs `datasets` and network); empty = the built-in task")
    val_data: str = flag("", "held-out prompts, same formats (default: --val-size prompts split off --data)")
    prompt_key: str = flag("", "prompt field (default: the first of PROMPT_KEYS in the file; then a starter_code)")
    answer_key: str = flag("", "answer field (default: the first of answer, final_answer, ground_truth, solution)")
    skip_bad_rows: bool = flag(False, "drop malformed rows with a count instead of stopping")
    exclude_rows: str = flag("", "a `bench.py --check-data` report: the rows it names (references failing) left out")
    train_size: int = flag(0, "training prompts (0: all of --data; 4096 for the built-in task)", at_least=0)
    val_size: int = flag(0, "held-out validation prompts, never trained on (0: 200, or all of --val-data; the paper: "
                          "1,000)", at_least=0)
    system_prompt: str = flag("", "--data: system message put before each prompt")
    instruction: str = flag(" Please reason step by step, and put your final answer within \\boxed{}.",
                          "--data: appended to each prompt (default: ask for the answer in \\boxed{}; '' for none)")
    chat_template: bool = flag(True, "--data: format prompts with the model's chat template when it has one "
                                   "(--no-chat-template for base models)")
    reward: str = flag("auto", "math: the final answer checked with math-verify; exact: string match; code: the last "
                             "code block run with the row's tests in sandbox.py; digit: the last digit after the "
                             "reasoning, for the built-in tasks (auto: math with --data, code with --task code, else "
                             "digit); a --data row with a `reward` field, or with tests (code), is graded by its own; "
                             "the choices are the REWARDS table's", lambda: ["auto", *REWARDS])
    weak_sandbox: bool = flag(False, "--reward code where the machine cannot isolate programs (no user namespaces): "
                                     "run them with rlimits only, with the network and files of this user in reach")
    reward_workers: int = flag(-1, "grading processes (-1: min(16, CPUs) for math/exact, 0 for the built-in task; "
                                 "0: grade in this process, with no time limit: --reward-timeout does not apply, "
                                 "and it is refused with --reward math, whose checker can hang)", at_least=-1)
    reward_timeout: float = flag(10.0, "seconds allowed to grade one completion; over it, reward 0 and an error",
                                 above=0)
    save_every: int = flag(0, "save a checkpoint every N steps (0: only at the end and when stopped by a signal)",
                           at_least=0)
    keep_last: int = flag(2, "keep the newest K checkpoints", above=0)
    resume: str = flag("", "continue a run from a checkpoint directory, or 'auto': the newest in --out. Every setting "
                         f"comes from the checkpoint but those typed now of {as_flags(CHANGEABLE)} (--steps: to "
                         "extend a run); another flag typed with a value other than the run's is refused")
    max_skipped_updates: int = flag(3, "stop after this many non-finite updates (loss or gradient) in a row", above=0)
    max_fresh_mismatch: float = flag(0.1, "warn when mismatch_fresh_abs_logprob (trainer against generator, on the "
                                          "completions the weights being trained sampled) is over this; stop, with a "
                                          "checkpoint, after 3 such steps in a row: the generator computes something "
                                          "else than the trainer (0: no check)", at_least=0)
    live_fit: bool = flag(True, "at each evaluation, fit the scaling curve to the run so far (fit_curve.py) and log "
                                "the predicted asymptote: fit_A, fit_B, fit_C_mid, fit_A_ci")
    wandb: str = flag("", "also log every metrics row to this Weights & Biases project (needs `pip install wandb`; "
                        "WANDB_MODE=offline works without network); metrics.jsonl stays the record")
    wandb_name: str = flag("", "--wandb: the run's name (default: the --out directory's name)")
    save_completions: bool = flag(False, "write each evaluation's held-out completions, with their answers and "
                                         "rewards, to OUT/completions/step_N.jsonl")
    verbose: bool = flag(False, "show vLLM's and the libraries' own log lines and warnings (default: ours and errors)")


# Named random streams: every random draw comes from np.random.SeedSequence([seed, RNG_..., ...]).
RNG_TASK, RNG_SPLIT, RNG_EPOCH, RNG_ROLLOUT, RNG_EVAL, RNG_ENGINE = range(1, 7)


def step_seed(seed, stream, n):
    """An independent, reproducible seed for the n-th draw of a random stream (RNG_*) of a run."""
    return int(np.random.SeedSequence([seed, stream, n]).generate_state(1)[0])


class ScaleRLError(Exception):
    """Bad input (status 2, before compute is spent) or a later failure (status 1); a notebook gets the exception."""

    def __init__(self, msg, status=2, resumable=False):
        super().__init__(msg)
        self.status, self.resumable = status, resumable  # resumable: the Guard saves a checkpoint on the way out


def die(msg, status=2):
    raise ScaleRLError(msg, status)


def parse_args(argv=None):
    """Every Config field a flag: the Config of the flags typed, cfg.typed naming them (a resumed run changes those).
    Parsing only: setup() merges it with the defaults and a resumed checkpoint's settings and checks it, in
    config_in_force (which a notebook or bench.py calls for the settings checked without a run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                argument_default=argparse.SUPPRESS)  # (a flag not typed is not in the namespace)
    p.error = die  # argparse's own errors end in one line, status 2, too
    for f in dataclasses.fields(Config):
        option, kw = "--" + f.name.replace("_", "-"), {"help": f.metadata["help"]}
        if f.type is bool:
            p.add_argument(option, action=argparse.BooleanOptionalAction, **kw)
        elif f.metadata["nargs"]:
            p.add_argument(option, type=type(f.default[0]), nargs=f.metadata["nargs"], metavar=("LO", "HI"), **kw)
        else:
            choices = f.metadata["choices"]  # (a function: the names of a table in Part II)
            p.add_argument(option, type=f.type, choices=choices() if callable(choices) else choices, **kw)
    typed = vars(p.parse_args(argv))
    cfg = Config(**typed)
    cfg.typed = set(typed)
    return cfg


def config_in_force(cfg):
    """(the settings a run uses, checked; the checkpoint's state, or None): the one pass over the settings. The flags
    with their derived defaults, or for a resumed run the checkpoint's settings with the flags typed now, checked on
    those, not on the defaults. cfg itself is left as it was: what comes back is a new Config."""
    cfg = fill_defaults(cfg)
    if not cfg.resume:
        return validate(cfg), None
    check_resume(cfg)
    merged, resumed = resumed_config(cfg, cfg.resume)
    return validate(merged), resumed


def fill_defaults(cfg):
    """A copy of cfg with the settings whose default depends on others filled in (0, '' or 'auto': 'derive it')."""
    cfg = copy.copy(cfg)  # (its `typed` too)
    if not hasattr(cfg, "typed"):
        cfg.typed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}
    if cfg.mask_truncated is None:
        cfg.mask_truncated = bool(cfg.model)
    if cfg.activation_checkpointing is None:
        cfg.activation_checkpointing = bool(cfg.model)
    cfg.eps_low = {"gspo": 3e-4}.get(cfg.loss, 0.2) if cfg.eps_low is None else cfg.eps_low  # (0: no clip below)
    cfg.eps_high = {"gspo": 4e-4}.get(cfg.loss, 0.28) if cfg.eps_high is None else cfg.eps_high
    cfg.answer_budget = cfg.answer_budget or max(2, cfg.max_new_tokens // 8)
    if tuple(cfg.think_budget) == (0, 0):  # the paper's 10k-12k of a 14k budget, scaled
        hi = max(1, cfg.max_new_tokens - cfg.answer_budget)
        cfg.think_budget = (max(1, hi - hi // 6), hi)
    cfg.think_budget = tuple(cfg.think_budget)
    cfg.max_len = cfg.max_len or cfg.max_new_tokens
    cfg.cache_len = max(1, cfg.max_len // 5) if cfg.cache_len is None else cfg.cache_len
    if not cfg.data:
        cfg.train_size, cfg.val_size = cfg.train_size or 4096, cfg.val_size or 200
    if cfg.reward == "auto":
        cfg.reward = "math" if cfg.data else "code" if cfg.task == "code" else "digit"
    if cfg.engine == "auto":
        cfg.engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if cfg.fp32_head_product == "auto":  # (a CPU gains nothing from bfloat16 products)
        cuda = cfg.device.startswith("cuda") or cfg.device == "auto" and torch.cuda.is_available()
        cfg.fp32_head_product = "split" if cuda else "float32"
    if cfg.resume == "auto":
        found = list_checkpoints(cfg.out) or unrenamed(cfg.out) if cfg.out else []
        if not found:
            die(f"--resume auto: no checkpoint in --out {cfg.out or '(not given)'}")
        cfg.resume = found[-1]
    if cfg.steps is None and not cfg.resume:  # (resumed: the run's own, resumed_config)
        cfg.steps = 150
    # the run directory (under torchrun the launcher's pid, which every rank shares) and every local path kept absolute:
    # the run resumes from any working directory
    cfg.out = cfg.out or (run_of(cfg.resume) if cfg.resume else os.path.join(
        "runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getppid() if launched() else os.getpid()}"))
    for name in ("out", "resume", "model", "data", "val_data"):  # (a hub name stays as it is)
        if getattr(cfg, name) and (name == "out" or os.path.exists(getattr(cfg, name))):
            setattr(cfg, name, os.path.abspath(getattr(cfg, name)))
    return cfg


def check_resume(cfg):
    """What --resume names, before it is read: a checkpoint in a run (or --out, the run it branches into)."""
    check_numbers(cfg)
    if not os.path.isfile(os.path.join(cfg.resume, "trainer_state.pt")):
        die(f"--resume {cfg.resume}: not a checkpoint directory (no trainer_state.pt)")
    if "out" not in cfg.typed and os.path.basename(os.path.dirname(cfg.resume)) != "checkpoints":
        die(f"--resume {cfg.resume}: not in a run's checkpoints directory (RUN/checkpoints/step_N), so there is no run "
            "to continue: pass --out DIR, a new directory for the run")


def validate(cfg):
    """Refuse impossible settings before any model loads (status 2); the hub check last: it may wait for the network."""
    check_numbers(cfg)
    for refused, why in itertools.chain(refusals(cfg), device_refusals(cfg), out_refusals(cfg)):
        if refused:
            die(why)
    check_hub(cfg)
    return cfg


def check_numbers(cfg):
    """Each number finite (nan and inf pass every comparison the wrong way), then within the bounds its flag() gives."""
    dashed = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for f in dataclasses.fields(cfg):
        value, meta = getattr(cfg, f.name), f.metadata
        if isinstance(value, float) and not math.isfinite(value):
            die(f"{dashed(f.name)} must be a finite number (got {value})")
        for key, sign, outside in (("above", ">", operator.le), ("at_least", ">=", operator.lt),
                                   ("below", "<", operator.ge)):
            if meta.get(key) is not None and value is not None and outside(value, meta[key]):
                die(f"{dashed(f.name)} must be {sign} {meta[key]} (got {value})")


def refusals(cfg):
    """(refused, why) for each combination of flags that cannot run, lazily: a check runs only if those before pass."""
    lo, hi = cfg.think_budget
    interrupt, streaming = cfg.length_control == "interrupt", cfg.engine == "vllm" and cfg.off_policy == "pipeline" \
        and cfg.max_lag > 0
    yield interrupt and cfg.answer_budget >= cfg.max_new_tokens, (
        f"--answer-budget {cfg.answer_budget} leaves no thinking budget within --max-new-tokens {cfg.max_new_tokens}: "
        "it must be smaller")
    yield min(lo, hi) < 0 or interrupt and not 1 <= lo <= hi < cfg.max_new_tokens, (
        f"--think-budget {lo} {hi}: need 1 <= LO <= HI < --max-new-tokens ({cfg.max_new_tokens})")
    yield cfg.length_control == "penalty" and not 0 <= cfg.cache_len < cfg.max_len <= cfg.max_new_tokens, (
        f"--cache-len {cfg.cache_len} --max-len {cfg.max_len}: need 0 <= L_cache < L_max <= --max-new-tokens")
    yield cfg.reward_workers == 0 and cfg.reward == "math", (
        "--reward-workers 0 grades in this process with no time limit, and math-verify can hang (sympy never returns "
        "on some answers): --reward math needs grading processes (--reward-workers -1 or >= 1)")
    yield cfg.model and not is_hub_id(cfg.model) and not os.path.isfile(os.path.join(cfg.model, "config.json")), (
        f"--model {cfg.model}: no such model directory (a local model needs config.json)")
    yield "fp32_head_product" in getattr(cfg, "typed", ()) and not cfg.lm_head_fp32, (
        f"--fp32-head-product {cfg.fp32_head_product} chooses the FP32 head's product; with --no-lm-head-fp32 there "
        "is none")
    yield cfg.model and (cfg.tie_word_embeddings or cfg.moe), (
        f"--{'moe' if cfg.moe else 'tie-word-embeddings'} applies to the embedded model only; a --model brings its own")
    yield cfg.routing_replay and not (cfg.moe or cfg.model), "--routing-replay needs an MoE (--moe, or an MoE --model)"
    yield cfg.data and not cfg.model, (
        "--data needs --model: the embedded model's character tokenizer covers only the built-in task")
    yield cfg.data and cfg.task != "largest", "--task chooses a built-in task; it does not apply with --data"
    for name in ("val_data", "prompt_key", "answer_key", "system_prompt", "skip_bad_rows", "exclude_rows"):
        yield getattr(cfg, name) and not cfg.data, f"--{name.replace('_', '-')} needs --data"
    yield not cfg.data and cfg.train_size + cfg.val_size > MAX_TASK_PROMPTS, (
        f"--train-size + --val-size must be <= {MAX_TASK_PROMPTS} for the built-in task")
    yield not cfg.data and cfg.prompts_per_step > cfg.train_size, (
        f"--prompts-per-step {cfg.prompts_per_step} exceeds --train-size {cfg.train_size}")
    yield not accepts(REWARDS[cfg.reward], "text", "answer", {}), (  # (else an error worth 0 on every completion)
        f"--reward {cfg.reward}: {REWARDS[cfg.reward].__name__} must take (completion_text, answer, row)")
    yield (cfg.reward == "code" or cfg.exclude_rows) and sandbox is None, (
        "code rows need sandbox.py, judge.py and code_rows.py beside scalerl.py")
    yield (missing := cfg.reward == "code" and not cfg.weak_sandbox and sandbox.missing()), (  # (what it lacks, or '')
        f"--reward code: this machine cannot isolate programs ({missing}); --weak-sandbox runs them anyway")
    yield cfg.reward == "math" and importlib.util.find_spec("math_verify") is None, (
        "--reward math needs math-verify: pip install math-verify (it is in requirements.txt)")
    yield cfg.wandb and importlib.util.find_spec("wandb") is None, "--wandb needs the wandb package: pip install wandb"
    yield cfg.wandb and not wandb_logged_in(), (
        f"--wandb {cfg.wandb}: not logged in to Weights & Biases: run `wandb login` (or set WANDB_API_KEY), or log "
        "offline with WANDB_MODE=offline")
    yield cfg.wandb_name and not cfg.wandb, "--wandb-name needs --wandb"
    yield cfg.vllm_sleep and cfg.engine != "vllm", "--vllm-sleep needs --engine vllm"
    yield cfg.vllm_sleep and streaming, (
        "--vllm-sleep frees the KV cache of sequences in flight: it needs --max-lag 0 or --off-policy ppo")
    yield cfg.refresh_kv and not streaming, (
        "--refresh-kv applies to sequences in flight at an update: it needs --engine vllm, --off-policy pipeline and "
        "--max-lag > 0")


def device_refusals(cfg):
    """(refused, why) for the devices: the one asked for, torchrun's ranks and the split's generators."""
    cuda = cfg.device.startswith("cuda") or cfg.device == "auto" and torch.cuda.is_available()
    yield cfg.engine == "vllm" and not launched() and re.fullmatch(r"cuda:0*[1-9]\d*", cfg.device), (
        f"--device {cfg.device}: the vLLM engine runs on the first visible GPU; choose the GPU with "
        f"CUDA_VISIBLE_DEVICES={cfg.device[5:]} and --device cuda")
    yield cfg.device.startswith("cuda") and not torch.cuda.is_available(), (
        f"--device {cfg.device}: CUDA is not available on this machine")
    yield cfg.device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", cfg.device), (
        f"--device must be auto, cpu, cuda or cuda:N (got {cfg.device})")
    yield launched() and ":" in cfg.device, (
        f"--device {cfg.device}: under torchrun each rank takes cuda:LOCAL_RANK; pass --device cuda (or auto)")
    yield launched() and cfg.prompts_per_step % world(), (
        f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of the {world()} ranks: each rank generates "
        "and trains an equal share of every step's prompts")
    yield cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None, (
        "--engine vllm: vllm is not installed (pip install -r requirements.txt; on CPU see the README), or use "
        "--engine hf")
    yield cfg.routing_replay and cuda and cfg.engine == "vllm", (
        "--routing-replay: the vLLM engine records an MoE's experts on a CPU only (docs/moe.md); use --engine hf")
    yield cfg.vllm_sleep and not cuda, "--vllm-sleep: vLLM's sleep mode needs CUDA; it is refused on CPU"
    if cfg.generators:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        have = torch.cuda.device_count() if cuda else len(os.sched_getaffinity(0))
        yield importlib.util.find_spec("generators") is None, (
            "--generators needs generators.py, the generator processes' code, beside scalerl.py")
        yield cfg.engine != "vllm" or cfg.vllm_sleep, (
            "--generators needs --engine vllm, and no --vllm-sleep (a generator never waits for the trainer)")
        yield launched() and local != world(), (
            "--generators runs on one node for now: its weights go through shared memory")
        yield cfg.generators % world(), f"--generators {cfg.generators} must be a multiple of the {world()} ranks"
        yield local + cfg.generators > have, (
            f"--generators {cfg.generators}: {local} trainer and {cfg.generators} generator processes need "
            f"{local + cfg.generators} {'GPUs' if cuda else 'cores'}, one each; this machine has {have}")


def out_refusals(cfg):
    """(refused, why) for --out: a directory this process can write, or one it can make."""
    there = os.path.abspath(cfg.out)
    while not os.path.exists(there):
        if os.path.lexists(there):
            yield True, (f"--out {cfg.out}: {there} is a symbolic link to {os.readlink(there)}, which does not resolve "
                         "(a missing target or a loop): point it at a directory, or choose another --out")
        there = os.path.dirname(there)
    yield not os.path.isdir(there), f"--out {cfg.out}: {there} {'exists and ' * (there == cfg.out)}is not a directory"
    yield not os.access(there, os.W_OK | os.X_OK), f"--out {cfg.out}: {there} is not writable"


def accepts(fn, *args):
    """Whether fn can be called with args (its signature binds them)."""
    try:
        inspect.signature(fn).bind(*args)
        return True
    except TypeError:
        return False


def wandb_logged_in():
    """W&B credentials without asking (WANDB_API_KEY, a settings file, ~/.netrc), or a mode that needs none."""
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return True
    import wandb
    return wandb.login(prompt=False, verify=False)


def check_hub(cfg):
    """A hub name given to --model, --data or --val-data needs the hub or the local cache: offline, a name missing from
    the cache stops the run in one line (the libraries would retry for a minute); a cached one loads offline."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.expanduser("~/.cache"), "huggingface")
    hub, sets = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"), \
        os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    names = [(option, name) for option, name in (("--model", cfg.model), ("--data", cfg.data.partition(":")[0]),
                                                 ("--val-data", cfg.val_data.partition(":")[0]))
             if name and not os.path.exists(name) and (option == "--model" and is_hub_id(name) or option != "--model"
                                                        and not name.endswith((".jsonl", ".json", ".csv", ".parquet")))]
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urllib.parse.urlsplit(endpoint)
    if not names or os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "") and hub_reachable(endpoint):
        return
    for option, name in names:
        kind, flat = "models" if option == "--model" else "datasets", name.replace("/", "--")
        if not (os.path.isdir(os.path.join(hub, f"{kind}--{flat}", "snapshots")) or
                kind == "datasets" and os.path.isdir(os.path.join(sets, name.replace("/", "___")))):
            die(f"{option} {name}: not in the local cache ({hub}) and the hub ({url.hostname}) cannot be reached: "
                "download it where there is a network, or give a local path")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def hub_reachable(endpoint):
    """Whether the hub's API answers (a proxy or captive portal that takes the connection answers no JSON list)."""
    import http.client
    import urllib.request
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/api/models?limit=1", timeout=3.0) as answer:
            return isinstance(json.loads(answer.read(1 << 20)), list)
    except (OSError, ValueError, http.client.HTTPException):  # no network, an HTTP error, not JSON, not HTTP
        return False


def is_hub_id(name):
    """'org/name' that is not an existing path is a hub id; anything path-like must exist locally."""
    return not os.path.exists(name) and re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) is not None

# --------------------------------------------------------------------------------------------------
# 3. Data: the built-in tasks, or --data read from a file, a directory or the hub; prompts encoded
# --------------------------------------------------------------------------------------------------


# Tasks: "what is the largest digit of this list?"  Prompt "3941:", answer "9". Answers cycle through 2-9, so they are
# exactly uniform and the best constant answer scores 1/8 (skewed answers would reward always giving the most common
# digit). 0 and 1 are left out because too few distinct lists have them as their largest digit. "hidden": the same
# lists with two digits hidden behind "." ("3.4.:"), so that some answers cannot be known: the best possible pass rate
# is below 1 (hidden_task_ceiling). "second": the second-largest distinct digit ("3941:" -> "4"), answers 1-8. "code":
# "largest" answered with a Python expression ("9", "4+5", "max(3,9,4,1)": TASK_CHARS) that reward_code's sandbox runs.
CHARS = "0123456789: " + "".join(sorted(set(Config.interruption_phrase.replace("</think>", "")) - set("0123456789: ")))
TASK_CHARS = {"code": "()+x"}
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<think>", "</think>"]
MAX_TASK_PROMPTS = 20_000  # 8 answers x 3,019 distinct lists of length 3-7 whose largest digit is 2


def load_data(cfg):
    """(train, val) lists of (prompt, answer, row) items: the built-in task, or --data with its held-out part [Sec. 2].
    A training prompt equal to a held-out one is dropped, so validation prompts are never trained on."""
    if not cfg.data:
        return make_task(cfg.train_size, cfg.val_size, cfg.seed, cfg.task)
    rows = load_rows(cfg.data, cfg)
    rows = [rows[i] for i in np.random.default_rng([cfg.seed, RNG_SPLIT]).permutation(len(rows))]
    if cfg.val_data:
        val, train = load_rows(cfg.val_data, cfg)[:cfg.val_size or None], rows
    else:
        n_val = cfg.val_size or 200
        if n_val >= len(rows):
            die(f"--val-size {n_val}: {cfg.data} has only {len(rows)} usable rows")
        val, train = rows[:n_val], rows[n_val:]
    held, before = {json.dumps(p, sort_keys=True) for p, *_ in val}, len(train)
    train = [item for item in train if json.dumps(item[0], sort_keys=True) not in held]
    copies, train = before - len(train), train[:cfg.train_size or len(train)]
    if len(train) < cfg.prompts_per_step:
        die(f"--prompts-per-step {cfg.prompts_per_step} exceeds the {len(train)} training prompts left in {cfg.data}"
            + (f" ({copies} rows dropped as copies of held-out prompts)" if copies else ""))
    return train, val


def make_task(n_train, n_val, seed, task="largest"):
    """(train, val): lists of (prompt_text, answer, row) items, all prompts distinct, none shared between them."""
    rng = np.random.default_rng([seed, RNG_TASK])
    seen, items = set(), []
    while len(items) < n_train + n_val:
        k, length = len(items) % 8, int(rng.integers(3, 8))
        if task == "second":  # digits up to the answer, and one larger digit at another position
            answer, top = 1 + k, int(rng.integers(2 + k, 10))
            digits = rng.integers(0, answer + 1, size=length)
            digits[rng.permutation(length)[:2]] = [top, answer]
        else:  # digits up to the answer, which one position holds
            answer = top = 2 + k
            digits = rng.integers(0, top + 1, size=length)
            digits[rng.integers(0, length)] = top
        prompt = "".join(map(str, digits))
        if task == "hidden":  # two digits hidden
            hide = set(rng.permutation(length)[:2].tolist())
            prompt = "".join("." if i in hide else c for i, c in enumerate(prompt))
        if prompt + ":" not in seen:
            seen.add(prompt + ":")
            items.append((prompt + ":", str(answer)))
    code = {"expression": True, "inputs": [""]} if task == "code" else {}
    items = [(p, a, {"prompt": p, "answer": a, **code, **({"outputs": [a]} if code else {})}) for p, a in items]
    return items[n_val:], items[:n_val]


def hidden_task_ceiling(prompts, answers=None):
    """The best pass rate any policy can expect on "hidden" prompts: the mean posterior probability of the most likely
    answer under make_task's generator (P(visible digits | t): m (t+1)^-V for the forced digit hidden, (t+1)^-(V-1) for
    each visible t, 0 past a visible digit above t); with the answers, what those answers score on these prompts."""
    total = 0.0
    for k, p in enumerate(prompts):
        visible = [int(c) for c in p.rstrip(":") if c != "."]
        m, v = p.count("."), len(visible)
        like = np.array([0.0 if max(visible) > t else m * (t + 1.0) ** -v + visible.count(t) * (t + 1.0) ** -(v - 1)
                         for t in range(2, 10)])
        total += like.max() / like.sum() if answers is None else float(2 + like.argmax() == int(answers[k]))
    return total / len(prompts)


# Datasets: --data FILE|DIR|NAME. Rows become (prompt, answer, row, reward) items; a prompt is a string or a list of
# chat messages, an answer a string, the row the whole record (for the reward), the reward the name in REWARDS that
# grades the row (row_reward: math and code rows may share a run). Every check runs before a model is loaded.
PROMPT_KEYS = ("prompt", "problem", "question", "question_content", "description", "text")
ANSWER_KEYS = ("answer", "final_answer", "ground_truth", "solution")


def load_rows(path, cfg):
    """(prompt, answer, row, reward) items of one source (row_reward; a code row's answer ''); bad rows stop the run."""
    left_out = sandbox.code_rows.named_rows(cfg.exclude_rows, path, die) if cfg.exclude_rows else ()
    records = [(where, r) for where, r in read_records(path) if where not in left_out]
    keys = set().union(*(r for _, r in records if isinstance(r, dict)))
    if records and not keys:  # no row is an object with a field (broken JSON, say): what the first row is
        die(f"{path}: no row has a field; {records[0][0]}: {row_problem(records[0][1], 'prompt', 'answer')}")
    pk = cfg.prompt_key or next((k for k in PROMPT_KEYS if k in keys), PROMPT_KEYS[0])
    ak = cfg.answer_key or next((k for k in ANSWER_KEYS if k in keys), ANSWER_KEYS[0])
    rewards = [row_reward(r, "math" if cfg.reward == "auto" else cfg.reward) for _, r in records]  # (auto: --data's)
    for key, option, known in ((pk, "--prompt-key", PROMPT_KEYS),
                               (ak if set(rewards) - {"code"} else None, "--answer-key", ANSWER_KEYS)):
        if records and key and key not in keys:
            die(f"{path}: no field '{key}' (looked for {', '.join(known) if key in known else key}; found: "
                f"{', '.join(sorted(keys))}); name the field with {option}")
    rows, bad = [], []
    for (where, r), reward in zip(records, rewards):
        rk = cfg.prompt_key or next((k for k in PROMPT_KEYS if isinstance(r, dict) and k in r), pk)  # (sets mixed)
        if problem := row_problem(r, rk, None if reward == "code" else ak, reward):
            bad.append(f"{where}: {problem}")
        else:
            rows.append((sandbox.code_rows.prompt(r, r[rk]), "", r, reward) if reward == "code" else
                        (r[rk], gold_answer(r[ak]), r, reward))
    if bad and not cfg.skip_bad_rows:
        die(f"{path}: {len(bad)} of {len(records)} rows are unusable; " + "; ".join(bad[:5])
            + ("; ..." if len(bad) > 5 else "") + ". Fix them, or pass --skip-bad-rows to drop them")
    if bad:
        print(f"{path}: skipped {len(bad)} of {len(records)} rows (first: {bad[0]})", file=sys.stderr)
    if not rows:
        die(f"{path}: no usable rows (fields found: {sorted(keys)})")
    return rows


def read_records(path):
    """Rows of a --data source as (where, row): `where` names it for errors, `row` is a dict or what is wrong."""
    ext = os.path.splitext(path)[1]
    if os.path.isfile(path) != (ext in (".jsonl", ".json", ".parquet", ".csv")):  # another kind of file, or none
        die(f"{path}: {'no such file' if not os.path.exists(path) else 'unsupported format'}; --data takes a .jsonl, "
            ".json, .csv or .parquet file, a datasets.save_to_disk directory or a hub dataset name")
    if ext == ".csv":  # a header line, then one row per line (quoted fields may span lines)
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:
                reader = csv.DictReader(f)
                return [(f"line {reader.line_num}", row) for row in reader]
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            die(f"{path}: cannot read ({e})")
    if ext == ".parquet":
        import pyarrow.parquet as pq
        try:
            return [(f"row {i + 1}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
        except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a damaged file)
            die(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})")
    if ext in (".jsonl", ".json"):
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark, as spreadsheet tools write
                text = f.read()
            if text.lstrip().startswith("["):  # a JSON array; else JSON Lines (datasets' to_json writes those too)
                return [(f"item {i + 1}", r) for i, r in enumerate(json.loads(text))]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            die(f"{path}: cannot read ({e})")
        return [(f"line {n}", json_or_error(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:
        import datasets
    except ImportError:
        die(f"{path}: a datasets directory or hub name needs the `datasets` package (pip install datasets)")
    name, _, split = path.partition(":")  # a hub dataset may name its split: org/name:test
    try:
        ds = datasets.load_from_disk(path) if os.path.isdir(path) else \
            datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001  (datasets raises many types: missing files, no network, bad names)
        die(f"{path}: cannot load with datasets ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            die(f"{path}: holds the splits {sorted(ds)}; point --data at one of them (DIR/SPLIT)")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return [(f"row {i + 1}", r) for i, r in enumerate(ds)]


def json_or_error(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg})"


def gold_answer(answer):
    """A reference answer as text: MATH's `solution` cut to its last \\boxed{}, GSM8K's to the part after '####'."""
    if not isinstance(answer, str):  # (an int as it is: float() of a 400-digit one overflows)
        return str(answer) if isinstance(answer, int) else str(int(answer)) if answer.is_integer() else repr(answer)
    return (last_boxed(answer) if "\\boxed" in answer else answer.rpartition("####")[2]).strip()


def row_reward(row, default):
    """The reward that grades a --data row: its `reward` field where that is text, else code where it has tests in one
    of the code formats (code_rows.row_tests; usable or not: row_problem says why not), else --reward's (`default`)."""
    if isinstance(row, dict) and isinstance(row.get("reward"), str):
        return row["reward"]
    return "code" if isinstance(row, dict) and sandbox and sandbox.code_rows.has_tests(row) else default


def row_problem(row, pk, ak, reward=None):
    """Why a row cannot be used, or None. ak None: a code row (--reward code, or row_reward's), which needs tests."""
    if not isinstance(row, dict):
        return row if isinstance(row, str) else f"not an object but {type(row).__name__}"
    if reward is not None and reward not in REWARDS:
        return f"'reward' {reward!r} is none of the rewards ({', '.join(REWARDS)})"
    p, a = row.get(pk), row.get(ak)
    if p is None:
        return f"no '{pk}' field (choose another with --prompt-key)"
    if isinstance(p, list) and p and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                         isinstance(m.get("content"), str) for m in p):
        p = p[-1]["content"]
    if not isinstance(p, str):
        return f"'{pk}' is {type(p).__name__}, not a string or a list of {{role, content}} messages"
    if not p.strip():
        return f"empty prompt '{pk}'"
    if ak is None:  # a code row: its tests instead of an answer
        return "a code row needs sandbox.py and judge.py beside scalerl.py" if sandbox is None else \
            tests if isinstance(tests := sandbox.code_rows.row_tests(row), str) else None
    if a is None:
        return f"'{ak}' is null" if ak in row else f"no '{ak}' field (choose another with --answer-key)"
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        return f"'{ak}' is {type(a).__name__}, not a string or a number"
    if isinstance(a, str) and "\\boxed" in a and last_boxed(a) is None:
        return f"'{ak}' has a \\boxed{{ that is not closed ({a[-40:]!r})"
    if isinstance(a, float) and not math.isfinite(a) or not gold_answer(a):
        return f"empty or non-finite answer '{ak}' ({a!r})"
    return None


def encode_prompts(tok, config, train, val, cfg):
    """(train_ids, val_ids, the longest prompt + completion), refused in one line where the model cannot hold it."""
    positions = getattr(config, "max_position_embeddings", math.inf)
    if cfg.max_new_tokens >= positions:
        die(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt: the model has {positions} positions, "
            "prompt and completion together")
    if cfg.data:
        print(f"scalerl: {len(train)} training and {len(val)} held-out prompts read; loading {cfg.model}", flush=True)
    chars = prompt_chars(tok, config, cfg)
    ids = [encode_prompt(tok, p, cfg, chars) for p, *_ in train + val]
    k = max(range(len(ids)), key=lambda i: len(ids[i]))  # the longest prompt
    completion = cfg.max_new_tokens
    if cfg.length_control == "interrupt":  # (Rollouts puts the phrase in after a space)
        phrase = len(tok(" " + cfg.interruption_phrase, add_special_tokens=False).input_ids)
        completion = max(completion, cfg.think_budget[1] + phrase + cfg.answer_budget)
    longest, excess = len(ids[k]) + completion, len(ids[k]) + completion - positions
    phrase = ", and the interruption phrase" * (cfg.length_control == "interrupt")
    if excess > 0:
        die(f"prompts + completions need {longest} positions and the model has {positions}: the longest prompt, "
            f"{len(ids[k])} tokens ({str((train + val)[k][0])[:40]!r}), and {completion} of completion "
            f"(--max-new-tokens {cfg.max_new_tokens}{phrase}): " + (
                f"lower --max-new-tokens to {cfg.max_new_tokens - excess}" if cfg.max_new_tokens > excess else
                "that prompt alone is too long for the model: leave it out"))
    if 0 < cfg.vllm_max_model_len < longest and cfg.engine == "vllm":
        die(f"--vllm-max-model-len {cfg.vllm_max_model_len} is shorter than the longest prompt + completion "
            f"({longest})")
    return ids[:len(train)], ids[len(train):], longest


def prompt_chars(tok, config, cfg):
    """The most characters a prompt that fits the model's context can have, or None: a token covers at most as many
    characters as the longest entry of the vocabulary, so a longer text has more tokens than the positions left beside
    --max-new-tokens (a 50 MB line would take gigabytes to tokenise before the exact check, in setup)."""
    positions = getattr(config, "max_position_embeddings", None)
    return None if positions is None else max(0, positions - cfg.max_new_tokens) * max(map(len, tok.get_vocab()))


def encode_prompt(tok, prompt, cfg, chars=None):
    """Token ids of one prompt: a --data prompt through the model's chat template when it has one, the built-in task's
    as they are. A text of more than `chars` characters is refused before it is tokenised (prompt_chars)."""
    text, templated = prompt, False
    if cfg.data:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        msgs[-1]["content"] += cfg.instruction
        if cfg.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": cfg.system_prompt})
        templated = bool(cfg.chat_template and tok.chat_template)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) if templated else \
            "\n\n".join(m["content"] for m in msgs)
    if chars is not None and len(text) > chars:
        die(f"a prompt of {len(text)} characters ({text[:40]!r}...) cannot fit the model's context: at most {chars} "
            "characters can (its positions less --max-new-tokens, times the longest token's characters)")
    return tok(text, add_special_tokens=not templated).input_ids  # (a template writes its own special tokens)


# --------------------------------------------------------------------------------------------------
# 4. Models: the embedded tiny model; loading any model with its tokenizer; the memory plan, what each GPU will hold,
#    before any weight loads (memory.py: the plan, and the CPU engine's KV cache and the trainer's peak)
# --------------------------------------------------------------------------------------------------


def load_tokenizer(cfg, path=None):
    """(tokenizer, config, path) of --model or of `path` (a checkpoint), the embedded default built first."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging
    path = path or cfg.model
    if not path:
        hf_logging.disable_progress_bar()
        cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "scalerl")
        path = build_tiny_model(cache, cfg.seed, cfg.tie_word_embeddings, cfg.moe, cfg.task)
    try:  # (any error reading a user's files is a file that cannot be loaded, named as such)
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001  (a wrong type in config.json is a TypeError, bad JSON a ValueError, ...)
        cannot_load(cfg, path, e, "config.json")
    check_architecture(cfg, config, path)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        cannot_load(cfg, path, f"no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there", "its tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        cannot_load(cfg, path, e, "its tokenizer: " + ", ".join(f for f in TOKENIZER_FILES
                                                               if os.path.isfile(os.path.join(path, f))))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok, config, path


def build_tiny_model(cache_dir, seed, tied, moe=False, task="largest"):
    """Build (once) the embedded default: a 2-layer Llama with head size 32 (vLLM's CPU backend needs 32 or
    more) and the character tokenizer, saved to a cache directory and then loaded like any --model; moe: a Qwen3-MoE of
    the same shape whose MLPs are 8 experts, 2 of them a token. A task with TASK_CHARS has a model of its own."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
    extra = TASK_CHARS.get(task, "")
    name = f"tiny-{'moe' if moe else 'llama'}-v2" + f"-{task}" * bool(extra)
    path = os.path.join(cache_dir, f"{name}-seed{seed}-{'tied' if tied else 'untied'}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        shape = dict(vocab_size=len(SPECIALS) + len(CHARS + extra), hidden_size=128, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                     max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0)
        conf = Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256) if moe \
            else LlamaConfig(**shape)
        torch.manual_seed(seed)
        os.makedirs(cache_dir, exist_ok=True)
        save_atomically(AutoModelForCausalLM.from_config(conf), make_char_tokenizer(extra), path)
    return path


def make_char_tokenizer(extra=""):
    """A character-level tokenizer (one token per character of CHARS + extra, plus SPECIALS), made with `tokenizers`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS + extra))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def save_atomically(model, tok, path):
    """Write model and tokenizer to a temporary directory renamed into place: no crash or race leaves half a model."""
    from safetensors import SafetensorError
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except (OSError, RuntimeError, SafetensorError) as e:  # (a full disk, safetensors' way)
        shutil.rmtree(tmp, ignore_errors=True)
        die(f"cannot write {path} ({' '.join(str(e).split())[:160]})", 1)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)


def check_memory_plan(cfg, config, device, longest):
    """On CUDA with a model of the user's: print what each GPU will hold, and refuse in one line what will not fit (the
    plan: memory.py)."""
    if device.type == "cuda" and (cfg.resume or cfg.model):
        sizes, total = memory.model_sizes(config, token_terms), torch.cuda.get_device_properties(device).total_memory
        print(memory.plan_line(memory.memory_plan(sizes, cfg, world(), total, longest, launched()), cfg, total),
              flush=True)
        if error := memory.plan_error(sizes, cfg, world(), total, longest, launched()):
            die(error)


def load_trainer(cfg, device, loaded):
    """(model, policy, frozen): the model to train (loaded: load_tokenizer's (tok, config, path), read once), with
    activation checkpointing (before FSDP2 wraps its layers), the Policy that trains it (under torchrun: see shard) and
    frozen_models' (--model's, sharded the same way)."""
    load = lambda loaded: load_model(cfg, torch.device("cpu") if launched() else device,  # noqa: E731
                                     empty=launched() and rank() > 0, loaded=loaded)[0]
    model = load(loaded)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    init_distributed(cfg, device, model)
    wrap = lambda m: shard(m, device) if launched() else Policy(m)  # noqa: E731
    policy = wrap(model)  # (before the engine starts: it sizes itself to the memory left)
    return model, policy, frozen_models(cfg, lambda: wrap(load(None).requires_grad_(False)))


def load_model(cfg, device, path=None, empty=False, loaded=None):
    """Load (model, tokenizer, path), the embedded default too; empty: the architecture only, on the meta device;
    loaded: load_tokenizer's (tok, config, path) where the caller has them (else it is called)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    tok, config, path = loaded or load_tokenizer(cfg, path)
    try:
        if empty:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.param_dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.param_dtype))
    except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as e:
        cannot_load(cfg, path, e, "its weights")
    model = model if empty else model.to(device)
    return moe.autocast_experts(model) if moe else model, tok, path


def check_architecture(cfg, config, path):
    """A model that the trainer (a causal-LM class of transformers) or the vLLM engine has no class for, an MoE without
    moe.py, or a vLLM without an internal scalerl uses (vllm_seam.py), is refused, named, before any weight loads;
    another vLLM than the one tested is one line (vLLM's registry costs its import, which its engine pays anyway)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        die(f"{path}: its architecture {arch} ({config.model_type}) has no causal-LM class in transformers "
            f"{transformers.__version__}: the trainer cannot run it")
    if moe is None and getattr(config, "num_experts_per_tok", None):  # (its push would corrupt the experts)
        die(f"{path}: a Mixture-of-Experts ({arch}) needs moe.py, its routing and experts, beside scalerl.py")
    if cfg.engine == "vllm":
        import vllm
        cpu = cfg.device == "cpu" or cfg.device == "auto" and not torch.cuda.is_available()  # (an MoE's capture)
        other, missing = vllm_seam.check(vllm.__version__, ("always",) + ("refresh_kv",) * cfg.refresh_kv +
                                         ("moe",) * bool(cpu and getattr(config, "num_experts_per_tok", None)))
        if missing or other:
            die(missing, 1) if missing else print(other, flush=True)
        if not vllm_seam.supported(arch):
            die(f"{path}: vLLM {vllm.__version__} cannot run its architecture {arch}; use a model vLLM supports, or "
                "--engine hf")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cannot_load(cfg, path, e, part):
    """One line for a model directory that cannot be loaded: whose it is, the part, why."""
    why = " ".join(str(e).split())  # (the whole message, on one line)
    if path not in (cfg.resume, cfg.model):
        die(f"cannot load the embedded model's cached copy {path} ({part}: {why}): delete that directory, and the next "
            "run builds it again")
    die(f"cannot load {'the checkpoint --resume' if path == cfg.resume else '--model'} {path} ({part}): {why}")


# --------------------------------------------------------------------------------------------------
# 5. Engines. One contract: submit(key, token_ids, max_tokens, seed) queues a request; step() advances generation and
#    returns the requests that finished, as (key, Completion), with the tokens decoded and the engine steps taken;
#    push(model, version) loads new weights; `version` is the version it holds, `capacity` the sequences it decodes
#    at once, `preemptions` those it preempted for want of KV cache, so far; sleep() before the trainer trains.
#    HFEngine (Hugging Face generate, synchronous), VLLMEngine (in-process vLLM, streaming); with --generators N,
#    generators.py's SplitEngine (the generator-trainer split [Sec. 2, App. A.3]: N processes, a VLLMEngine each).
#    rollout and find_subsequence serve Part I's evaluate and Rollouts.
# --------------------------------------------------------------------------------------------------


def make_engine(cfg, config, path, device, dtype, longest, n_val, model, tok, autocast):
    """The run's engine; on a CPU vLLM's KV cache is sized here, and saved in config.json."""
    L = cfg.vllm_max_model_len or longest
    if cfg.engine == "vllm" and device.type == "cpu" and not cfg.vllm_kv_cache_mb:
        kv_bytes = memory.model_sizes(config)["kv"] * dtype.itemsize
        cfg.vllm_kv_cache_mb, line = memory.cpu_kv_cache_mb(cfg, kv_bytes, L, n_val, world())
        print(line, flush=True)
    if cfg.generators:  # (the split's processes: generators.py, beside this file, imports nothing of this one)
        from generators import SplitEngine
        return SplitEngine(cfg, path, device, dtype, L, model, VLLMEngine,
                           lambda m: split_weights(m, dtype, cfg.lm_head_fp32), ScaleRLError)
    if cfg.engine == "vllm":
        return VLLMEngine(cfg, path, device, dtype, L, rank())
    return HFEngine(replica(model, device) if launched() else model, tok, cfg, autocast)


def split_weights(model, dtype, fp32_head):
    """What a push of the split writes: the weights under the checkpoint's names and layout, and the float32 LM head."""
    yield from full_weights(model, dtype, checkpoint=True)
    if fp32_head:
        yield "fp32_head", full_tensor(model.get_output_embeddings().weight).float()


def rollout(rollouts, prompts, n, seed, ids=None):
    """n completions of each prompt, now, with length control; ids: the prompts' numbers, which choose their streams."""
    keys = [("eval", seed, i) for i in (range(len(prompts)) if ids is None else ids)]
    for k, p in zip(keys, prompts):
        rollouts.add(k, p, n, step_seed(seed, RNG_ROLLOUT, k[2]))
    return [g.completions for g in rollouts.wait(keys)]


def find_subsequence(seq, sub):
    """Index of the first occurrence of sub in seq, or None."""
    return next((i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub), None)


class HFEngine:
    """Engine 'hf': Hugging Face `generate` on the trainer's model, or under torchrun a replica that push() updates. It
    cannot stream: step() generates what was submitted since the last step in one call (the synchronous loop or PPO)."""

    def __init__(self, model, tok, cfg, autocast_dtype):
        self.model, self.tok, self.cfg, self.autocast = model, tok, cfg, autocast_dtype
        self.queue, self.version, self.capacity, self.preemptions = [], 0, math.inf, 0

    def submit(self, key, ids, max_tokens, seed):
        self.queue.append((key, list(ids), max_tokens, seed))

    def unfinished(self):
        return len(self.queue)

    def step(self):
        reqs, self.queue = self.queue, []
        if not reqs:
            return [], 0, 0
        seed = int(np.random.SeedSequence([s for *_, s in reqs]).generate_state(1)[0])
        comps, decoded = hf_generate(self.model, self.tok, [r[1] for r in reqs], [r[2] for r in reqs],
                                     self.cfg.temperature, seed, self.cfg.lm_head_fp32 and self.cfg.fp32_head_product,
                                     self.autocast)
        for c in comps:
            c.versions = [self.version] * len(c.tokens)
        return [(r[0], c) for r, c in zip(reqs, comps)], decoded, 1

    def push(self, model, version):
        if model is not None and model is not self.model:
            mine = self.model.state_dict()
            for name, t in full_weights(model, next(self.model.parameters()).dtype):
                mine[name].copy_(t)
        self.version = version

    def abort(self):
        self.queue = []

    def close(self):
        pass

    def sleep(self):
        pass


def hf_generate(model, tok, prompts, max_tokens, temperature, seed, fp32_head, autocast_dtype=None):
    """Hugging Face `generate` on prompts, each cut at its own token limit, plain sampling at T (as the ratio assumes),
    recording log_softmax(logits / T) of each sampled token: a Completion each, and the tokens decoded."""
    from transformers import GenerationConfig, LogitsProcessorList
    recorded, last = [], {}

    def record(input_ids, scores):
        if "lp" in last:  # the token sampled at the previous step is now the last input id
            recorded.append(last["lp"].gather(1, input_ids[:, -1:]).squeeze(1))
        scores = scores.float() / temperature
        last["lp"] = torch.log_softmax(scores, dim=-1)
        return scores

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pad, eos = tok.pad_token_id, tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(max_tokens),
                               pad_token_id=pad, eos_token_id=eos)
    head = model.get_output_embeddings()
    fp32 = FP32Head(head.weight, fp32_head == "split") if fp32_head else None  # (its logits recomputed so)
    hook = head.register_forward_hook(lambda m, i, o: fp32(i[0], m.bias)) if fp32 else None
    was_training, shipped = model.training, model.generation_config
    model.eval()
    # generate fills the settings gen_cfg leaves unset (repetition_penalty, min_p, ...) from the model's own
    # generation config: in its place, gen_cfg alone decides how to sample
    model.generation_config = gen_cfg
    routes = []  # an MoE's experts, each forward's and layer's (moe.route_hook), and its layers
    L = moe.set_routing(model, routes) if moe else 0
    torch.manual_seed(seed)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([record]))
    finally:
        model.train(was_training)
        model.generation_config = shipped
        if moe:
            moe.set_routing(model, None)
        if hook:
            hook.remove()
    recorded.append(last["lp"].gather(1, seqs[:, -1:]).squeeze(1))
    gen, lps = seqs[:, width:].tolist(), torch.stack(recorded, 1).tolist()
    ends = [t.index(eos) + 1 if eos in t else len(t) for t in gen]  # after EOS come pad tokens
    cuts = [min(k, m) for k, m in zip(ends, max_tokens)]
    routes = moe.generated_experts(routes, L, len(prompts)) if L else None  # [rows, tokens, L, k]
    comps = [Completion(t[:k], lp[:k], eos in t[:k], [1] * k, [], experts=routes[i, :k] if L else None)
             for i, (t, lp, k) in enumerate(zip(gen, lps, cuts))]
    return comps, sum(ends)


class VLLMEngine:
    """Engine 'vllm': one vllm.LLM in this process, from the trainer's weights, driven through its step-level API, so
    that requests are added and weights pushed between any two engine steps while others decode. Its log-probs are
    after temperature scaling ("processed"), the ratio's; with --lm-head-fp32 its head computes in float32 like the
    trainer's [Sec. 3.2]. Each token is labelled with the weight version that sampled it (weight_versions spans)."""

    def __init__(self, cfg, path, device, dtype, max_model_len, place=0):
        kw, env = vllm_args(cfg, path, device, dtype, max_model_len, place)
        os.environ.update(env)
        self.sleeps = kw.get("enable_sleep_mode", False)
        quiet_libraries(cfg.verbose)  # (again in a generator process of the split, whose engine this is)
        log = os.path.join(cfg.out, f"vllm-start.{place}.log") if cfg.out else None
        if log and not cfg.verbose:  # (a hard crash in vLLM's start, a signal, leaves this line last on the screen)
            print(f"scalerl: starting vLLM; what it prints goes to {log}", flush=True)
        with quiet_stderr(cfg.verbose, log):  # its start-up warnings come from C++ too (NUMA binding, Triton)
            gc.freeze()  # vLLM freezes the heap once started; until then its import and start collect garbage over
            import vllm  # all of it (twice in full loading the model): frozen now, they skip what we hold
            self.llm = vllm.LLM(**kw)
        split = cfg.fp32_head_product == "split"
        head = self.llm.apply_model(lambda m: engine_fp32_head(m, split))[0] if cfg.lm_head_fp32 else None
        if cfg.lm_head_fp32 and head != "torch.float32":
            die("--lm-head-fp32: " + (f"this vLLM ({vllm.__version__}) computes the LM head's logits in {head}, not "
                                      "float32: it does not honour hf_overrides head_dtype for this model. Use a vLLM "
                                      "that does (0.32 does)" if head else "this vLLM model has no lm_head and "
                                      "logits_processor to give a float32 head") + ", or pass --no-lm-head-fp32", 1)
        # each weight push logs that rotary embeddings got no weights: they have none to get (their cache is computed)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda r: not r.getMessage().startswith("RotaryEmbedding: Failed to load weights"))
        self.core, self.cfg, self.asleep, self.serial, self.live = self.llm.llm_engine, cfg, False, 0, {}
        self.queue = []  # submitted, not yet sent to the engine
        self.blocks, self.kv_groups, self.max_seqs = vllm_seam.kv_cache(self.llm)  # its blocks; each group's block
        self.preemptions = 0  # sequences vLLM preempted (to recompute) for room   # size and sliding window
        vllm_seam.count_preemptions(self.llm, self)
        self.mean_len, self.seen = max_model_len / 2, 0  # sequences' mean length, a guess until some have ended
        self.version = 0
        self.core.set_weight_version("0")
        self.seeded = device.type == "cpu" if cfg.vllm_request_seeds is None else cfg.vllm_request_seeds
        self.routes = moe.capture_routing(self.llm) if moe and kw.get("enforce_eager") else None  # MoE: experts (CPU)

    @property
    def capacity(self):
        """Sequences to decode at once: what the KV cache holds at the running mean length of the finished sequences.
        vLLM preempts (and recomputes) one when its blocks run out (`preemptions`): the worst case, every sequence at
        the whole context, would admit one group at a time at the paper's lengths."""
        fit = memory.kv_capacity(self.blocks, self.kv_groups, self.mean_len) if self.blocks else self.max_seqs
        return max(self.cfg.generations_per_prompt, min(self.max_seqs, fit))

    def submit(self, key, ids, max_tokens, seed):
        self.queue.append((key, tuple(ids), max_tokens, seed))

    def unfinished(self):
        """Sequences queued or decoding (ended ones stop counting, though their request returns them with its last)."""
        return len(self.queue) + self.core.get_num_unfinished_requests()

    def step(self):
        """One engine step (a token for each running sequence): the requests finished, their tokens, and 1 step."""
        self.flush()
        done, decoded = [], 0
        for out in self.core.step():
            if not out.finished:  # (final outputs only: none come before the end)
                continue
            keys, prompt = self.live.pop(out.request_id)
            for c in out.outputs:
                versions = [int(s.version) for s in c.weight_versions for _ in range(s.start, s.end)]
                tokens = list(c.token_ids)
                experts = None if self.routes is None else np.int16(self.routes.pop((out.request_id, c.index)))
                done.append((keys[c.index], Completion(tokens, [lp[t].logprob for t, lp in zip(tokens, c.logprobs)],
                                                       c.finish_reason == "stop", [1] * len(tokens), versions, False,
                                                       experts)))
                decoded += len(tokens)
                self.seen += 1  # the running mean of sequence lengths (the last 256 or so weigh most)
                self.mean_len += (prompt + len(tokens) - self.mean_len) / min(self.seen, 256)
        return done, decoded, 1

    def flush(self):
        """Send the queued requests. Completions of one prompt with one limit and consecutive seeds (a group's) go as
        one request with n = their number, seeded first seed + i as before: vLLM prepares it once, a cost per request
        as large as the decoding (profiled on the built-in task at 32 x 16 completions of 4 tokens)."""
        from vllm import SamplingParams
        batches, last = [], {}  # a batch: one request's completions, of consecutive seeds
        for key, ids, max_tokens, seed in self.queue:
            batch = last.get((ids, max_tokens))
            if batch is None or batch[2] + len(batch[3]) != seed:
                batch = last[ids, max_tokens] = [ids, max_tokens, seed, []]
                batches.append(batch)
            batch[3].append(key)
        if batches and self.asleep:
            raise RuntimeError("the engine's weights were discarded by sleep, and no push has reloaded them")
        for ids, max_tokens, seed, keys in batches:
            rid, self.serial = str(self.serial), self.serial + 1
            params = SamplingParams(n=len(keys), temperature=self.cfg.temperature, top_p=1.0, top_k=0,
                                    max_tokens=max_tokens, logprobs=0, seed=seed if self.seeded else None,
                                    detokenize=False, output_kind=vllm_seam.final_only())
            # the cache salt keeps prefix-cache blocks computed with older weights from being reused by new requests
            self.core.add_request(rid, vllm_seam.tokens(ids, self.version), params)
            self.live[rid] = keys, len(ids)
        self.queue = []

    def push(self, model, version):
        """Load the trainer's weights [Sec. 3.1] under their Hugging Face names, all in one `reload_weights` call as an
        iterator (part of a layer would leave it wrong), then the float32 head. Running sequences keep their KV cache,
        computed with older weights, as PipelineRL does; --refresh-kv re-prefills them."""
        self.wake()
        head = (lambda: full_tensor(model.get_output_embeddings().weight).detach().float()) \
            if self.cfg.lm_head_fp32 else None
        self.load(full_weights(model, self.core.model_config.dtype, checkpoint=True), head, version)

    def load(self, weights, head, version):
        """push's work, from an iterator of (name, tensor) and a function returning the float32 head (or None)."""
        if moe:
            self.llm.apply_model(moe.forget_moe_kernels)
        vllm_seam.reload_weights(self.llm, weights)
        if head is not None:
            w = head()
            self.llm.apply_model(lambda m: m.fp32_head.load(w))
        else:
            self.llm.apply_model(repack_tied_head)
        self.version = version
        self.core.set_weight_version(str(version))
        if self.cfg.refresh_kv and self.live:  # (it preempts every running sequence: not for want of room, not counted)
            before = self.preemptions
            vllm_seam.reprefill(self.llm)
            self.preemptions = before

    def abort(self):
        """Drop every request in flight."""
        self.core.abort_request(list(self.live))
        self.live, self.queue = {}, []
        if self.routes is not None:  # (the rows of the requests dropped)
            self.routes.clear()

    def close(self):
        """Shut the engine down (under torchrun it takes the process group with it: it goes last); asleep, it is woken
        first, else its shutdown frees what sleep freed and vLLM prints CUDA errors beside the real one."""
        if self.asleep:
            with contextlib.suppress(Exception):
                self.llm.wake_up()
            self.asleep = False
        vllm_seam.shutdown(self.llm)

    def sleep(self):
        """vLLM sleep mode (CUDA, nothing in flight): while training, free the KV cache and discard the weights (level
        2; level 1 would copy them to host memory and back, only for the next push to overwrite them). The engine then
        holds no version, so the step's push_weights reloads it, on every rank at the same point of the step, also
        after a skipped update (a reload when requests come would gather the weights on the ranks that have some)."""
        if self.sleeps and not self.asleep and not self.live and not self.queue:
            self.llm.sleep(level=2)
            self.asleep, self.version = True, None

    def wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def vllm_args(cfg, path, device, dtype, max_model_len, place=0, device_bytes=None):
    """(vllm.LLM's arguments, the environment it needs); sleep mode where VLLMEngine.sleep can use it."""
    kw = dict(model=path, tokenizer=path, dtype=str(dtype).removeprefix("torch."),
              seed=step_seed(cfg.seed, RNG_ENGINE, place),
              max_model_len=max_model_len, logprobs_mode="processed_logprobs", use_tqdm_on_load=cfg.verbose,
              async_scheduling=False, max_num_seqs=cfg.vllm_max_num_seqs or None)
    if cfg.lm_head_fp32:
        kw["hf_overrides"] = {"head_dtype": "float32"}
    if launched():  # one engine per rank, on cuda:LOCAL_RANK, each generating its own prompts (as TRL colocates)
        kw["distributed_executor_backend"] = "external_launcher"
    from transformers import AutoConfig
    conf = AutoConfig.from_pretrained(path)
    if device.type == "cpu":  # eager: compiling took 49 s for a 10% faster 135M model on 2 cores
        mb = cfg.vllm_kv_cache_mb or memory.cpu_kv_cache_mb(  # (setup sizes it, says so and saves it; an engine
            cfg, memory.model_sizes(conf)["kv"] * dtype.itemsize, max_model_len, 0, world())[0]  # made alone: here)
        kw.update(enforce_eager=True, kv_cache_memory_bytes=mb * 2**20, enable_chunked_prefill=False)
    else:  # the float32 head copy (engine_fp32_head) is made after vLLM sizes its KV cache: its bytes are the share's
        head = 4 * conf.vocab_size * conf.hidden_size * cfg.lm_head_fp32
        device_bytes = device_bytes or torch.cuda.get_device_properties(device).total_memory
        kw.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization - head / device_bytes, enable_sleep_mode=
                  cfg.vllm_sleep if cfg.vllm_sleep is not None else cfg.off_policy == "ppo" or cfg.max_lag == 0)
    return kw, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}


@contextlib.contextmanager
def quiet_stderr(verbose, log=None):
    """Hold back stderr (C++'s and Python's) inside the block, unless --verbose, in the file `log` (or a temporary one),
    so that a process killed there by a signal leaves what was printed; written out if the block raises."""
    if verbose:
        yield
        return
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
    fd, path = (os.open(log, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644), log) if log else \
        tempfile.mkstemp(prefix="scalerl-stderr-", suffix=".log")
    sys.stderr.flush()
    stderr_fd = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    except BaseException:
        os.dup2(stderr_fd, 2)
        with open(path, errors="replace") as held:
            sys.stderr.write(held.read())
        raise
    finally:
        sys.stderr.flush()
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        os.close(fd)
        if not log:
            os.remove(path)


def engine_fp32_head(model, split):
    """Inside the vLLM engine (apply_model): the FP32 LM head as the trainer computes it [Sec. 3.2], from a float32 copy
    of the head's weight or (split) its two bf16 parts (rows padded as vLLM pads the vocabulary; plain tensors, which
    sleep mode leaves). vLLM's head_dtype alone keeps the weight in the model's dtype (logits_processor.py). Returns the
    dtype vLLM computes the head's logits in (head_dtype, which hf_overrides sets to float32), or None where the model
    has no lm_head and logits_processor to give it."""
    head = getattr(model, "lm_head", None) or getattr(getattr(model, "model", None), "embed_tokens", None)  # (tied:
    if not hasattr(head, "weight"):                                                         # Gemma 2 has no lm_head)
        return None
    model.fp32_head = FP32Head(head.weight, split, copy=True)  # (a push's head: its load)
    found, dtype = vllm_seam.head_product(model, model.fp32_head)
    return str(dtype or head.weight.dtype) if found else None


def repack_tied_head(model):
    """Inside the vLLM engine (apply_model), after a push without the FP32 head: vLLM's CPU backend packs the LM head's
    weight for oneDNN when the model loads (cpu_linear), and a tied head, which shares the embedding's weight, gets no
    weights of its own in a push (the embedding does), so its pack would stay the initial weights': it is made again."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight is embed.weight:
        vllm_seam.repack_if_cpu_linear(head)


# --------------------------------------------------------------------------------------------------
# 6. Grading and rewards: the pool of processes that runs the reward functions with a time limit, then the rewards,
#    fn(completion_text, answer, row) -> float. answer: the reference answer as text (gold_answer); row: the whole
#    data row, every field as read (the built-in tasks': prompt and answer), for a reward that needs more than it.
# --------------------------------------------------------------------------------------------------


def grading_workers(cfg, tasks):
    """--reward-workers -1: none where the digit reward alone grades the rows (tasks): one regex, not a process."""
    per_rank = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return cfg.reward_workers if cfg.reward_workers >= 0 else 0 if set(tasks) == {"digit"} else min(16, per_rank)


class Grader:
    """Grades completions so that grading never stalls or kills a run: each (text, answer, row[, reward]) item goes to
    one of `workers` processes and gets `timeout` seconds; a process that overruns or dies is replaced, and that
    completion gets reward 0 and an error message, like one whose grading raised. workers=0 grades here, without a time
    limit. An item is graded by REWARDS[reward] where it names one (grade_one), else by fn."""

    def __init__(self, fn, workers, timeout):
        self.fn, self.timeout, self.ctx = fn, timeout, multiprocessing.get_context("spawn")
        self.procs = [self._spawn() for _ in range(workers)]
        for _, conn in self.procs:
            self._wait_ready(conn)

    def _spawn(self):
        conn, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_grading_worker, args=(child, self.fn), daemon=True)
        p.start()
        child.close()  # so that the worker's death reads as EOF here
        return p, conn

    def _wait_ready(self, conn):
        with contextlib.suppress(EOFError):  # (a worker that died starting: EOF)
            if conn.poll(120):
                return conn.recv()
        die("a grading process did not start (its error is above)", 1)

    def __call__(self, items):
        """(reward, verdict) of each (text, answer, row) item (or (text, answer) pair), and the error messages."""
        out = self._in_workers(items) if self.procs else [grade_one(self.fn, *item) for item in items]
        return [(r, v) for r, v, _ in out], [e for *_, e in out if e]

    def _in_workers(self, items):
        """Each item to the first free worker, due `timeout` s after it is sent, its answer collected by _collect."""
        from multiprocessing.connection import wait
        out, todo, busy = [None] * len(items), list(range(len(items)))[::-1], {}  # busy: worker -> (item, deadline)
        while todo or busy:
            for w, (_, conn) in enumerate(self.procs):
                if w not in busy and todo:
                    busy[w] = (todo.pop(), time.monotonic() + self.timeout)
                    conn.send(items[busy[w][0]])
            wait([self.procs[w][1] for w in busy], max(0.0, min(d for _, d in busy.values()) - time.monotonic()))
            for w, (i, deadline) in list(busy.items()):
                result = self._collect(w, deadline)
                if result is not None:
                    out[i] = result
                    del busy[w]
        return out

    def _collect(self, w, deadline):
        """Worker w's answer, or (0, "error: why", why) once it died or overran (it is replaced), or None while it may
        still answer. (The answer is asked for now, not before the wait: replacing a process takes time.)"""
        proc, conn = self.procs[w]
        if conn.poll():
            with contextlib.suppress(EOFError):
                return conn.recv()
            why = "the grading process died"
        elif time.monotonic() > deadline:
            why = f"grading took over {self.timeout:g} s"
        else:
            return None
        proc.kill()
        proc.join()
        conn.close()
        self.procs[w] = self._spawn()
        self._wait_ready(self.procs[w][1])
        return 0.0, f"error: {why}", why

    def close(self):
        for p, _ in self.procs:
            p.kill()
            p.join()
        self.procs = []


def _grading_worker(conn, fn):
    """A grading process: grades the (text, answer[, row]) items it receives until it is killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    conn.send(grade_one(fn, "\\boxed{0}", "0", {}))  # load the reward's dependencies, then report ready
    try:
        for item in iter(conn.recv, None):
            conn.send(grade_one(fn, *item))
    except EOFError:  # the trainer is gone
        pass


def grade_one(fn, text, answer, row=None, reward=None):
    """(reward, verdict, error or None) of a completion by REWARDS[reward] (an item's own, row_reward) or else fn, which
    gives a number or (number, verdict); an exception in it costs its completion only: 0, verdict "error: ..."."""
    try:
        r = (REWARDS[reward] if reward else fn)(text, answer, row)
        return (float(r[0]), r[1], None) if isinstance(r, tuple) else (float(r), None, None)
    except Exception as e:  # noqa: BLE001
        return 0.0, f"error: {type(e).__name__}: {e}", f"{type(e).__name__}: {e}"


def reward_last_digit(completion_text, answer, row=None):
    """The built-in tasks' binary reward [Sec. 2]: 1 if the last digit written after the reasoning is the answer."""
    digits = re.findall(r"\d", completion_text.split("</think>")[-1])
    return float(bool(digits) and digits[-1] == answer)


def last_boxed(text):
    """Content of the last \\boxed{...} or \\fbox{...}, braces nested (`\\boxed 5`: '5'); None if none or unclosed."""
    found = list(re.finditer(r"\\(?:boxed|fbox)\s*(\{?)", text))
    if not found:
        return None
    m = found[-1]
    if not m.group(1):
        rest = text[m.end():].replace("$", " ").split()
        return rest[0] if rest else None
    depth = 1
    for k in range(m.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[m.end():k].strip()
    return None


def extract_answer(text):
    """The final answer of a completion [Sec. 2]: after the reasoning (up to the last </think>, if any), the content of
    the last \\boxed{}, or else the rest of the last line with 'answer ...:' in it; None when neither."""
    text = text.rpartition("</think>")[2]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = re.findall(r"(?im)\banswer\b[^:\n]{0,12}:(.*)$", text)
    answer = lines[-1].strip(" \t*$.") if lines else ""
    return answer or None


def _plain(s):
    """A text answer without LaTeX wrapping, whitespace and final period, lower-cased: '\\text{ Paris }.' -> 'paris'."""
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s).strip(" \t$.")
    return re.sub(r"\s+", " ", s).lower()


def reward_math(completion_text, answer, row=None):
    """Math reward, binary [Sec. 2]: the extracted final answer checked against the reference with math-verify
    (the paper's verifier), so 1/2 = 0.5 = \\frac{1}{2} = \\dfrac12 and 1,000 = 1000. Word answers ('Paris',
    'yes') are compared as words, case-insensitively: math-verify would read them as products of symbols."""
    pred = extract_answer(completion_text)
    if pred is None:
        return 0.0
    if re.fullmatch(r"[a-z]{2,}( [a-z]+)*", _plain(answer)):
        return float(_plain(pred) == _plain(answer))
    from math_verify import parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its own timeouts are off: ours are on
    gold, guess = (parse(f"${s}$", parsing_timeout=None, raise_on_error=True) for s in (answer, pred))
    return float(verify(gold, guess, timeout_seconds=None, raise_on_error=True))


def reward_exact(completion_text, answer, row=None):
    """Exact-match reward: the extracted final answer equals the reference, ignoring whitespace."""
    pred = extract_answer(completion_text)
    return float(pred is not None and re.sub(r"\s+", "", pred) == re.sub(r"\s+", "", answer))


def reward_code(completion_text, answer, row):
    """Code reward, binary [Sec. 2: unit tests], (reward, verdict): the code block after the reasoning (code_rows.py:
    the last that defines what the tests call) against its row's tests in sandbox.py, judged outside the program; 1 if
    every test passed, else why not ('hack: ...': a hack's mark); a limit hit raises (0, a grading error). A row whose
    "expression" is true (--task code's) takes the answer after the reasoning as a Python expression, printed."""
    text, spec = completion_text.rpartition("</think>")[2], sandbox.code_rows.row_tests(row)
    expression = f"print(eval({text.strip()!r}))"  # (--task code's rows)
    code = expression if row.get("expression") is True else sandbox.code_rows.code_block(text, spec)
    return sandbox.verdict(code, row, spec) if code is not None else (0.0, "no code block")


REWARDS = {"digit": reward_last_digit, "math": reward_math, "exact": reward_exact, "code": reward_code}


def join_experts(a, b):
    """A completion's routed experts (Completion.experts) followed by a piece's, or by b rows of -1 (b an int: the
    injected phrase, which no routing sampled); None for a dense model."""
    if isinstance(b, int):
        b = None if a is None else np.full((b, *a.shape[1:]), -1)
    return b if a is None or b is None else np.concatenate((a, b)).astype(np.int16)


def special_ids(tok):
    """The ids of the tokenizer's special tokens, the added ones marked special among them: a tokenizer can name
    another token as its eos than the model stops at (SmolLM2's, converted from GGUF, names <|im_start|> and the model
    ends at <|im_end|>), so that the stop token would be graded as text."""
    return set(tok.all_special_ids) | {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}


def completion_text(tok, tokens, specials):
    """A completion's text as graded: a final special token (the stop token that ended it) left out."""
    return tok.decode(tokens[:-1] if tokens and tokens[-1] in specials else tokens)


# --------------------------------------------------------------------------------------------------
# 7. The trainer's forward pass: Policy (the model and its head, FSDP2's root), a micro-batch's tensors, the
#    mismatch diagnostic, and the FP32 head (FP32Head: trainer, HF engine and vLLM alike) with its split-bf16 product
# --------------------------------------------------------------------------------------------------


class Policy(torch.nn.Module):
    """The trained model, its head applied by token_logprobs inside one forward pass: FSDP2 shards this module under
    torchrun, and its root must see the head's computation to gather its weights and reduce their gradients."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, cfg):
        """token_terms of the trained tokens of x, a micro-batch's batch_tensors; an MoE's routing_differs besides."""
        used = {}  # an MoE's experts in this forward, {layer: [rows x positions, k]} (moe.route_hook)
        layers = moe.set_routing(self.model, (x.get("experts"), cfg.routing_replay, used)) if moe else 0
        hidden = self.model.get_decoder()(input_ids=x["ids"], attention_mask=x["attn"],
                                          use_cache=False).last_hidden_state
        terms = token_logprobs(hidden[x["row"], x["pos"]], self.model.get_output_embeddings(), x["targets"],
                               cfg.temperature, cfg.lm_head_fp32 and cfg.fp32_head_product, cfg.logprob_chunk,
                               logit_transform(self.model.config))
        if layers:
            terms["routing_differs"] = moe.routing_differs(x, used, layers)
        return {k: v[x["keep"]] for k, v in terms.items()}


def as_policy(model):
    return model if isinstance(model, Policy) else Policy(model)


def logit_transform(config):
    """What the model's own forward does to the head's logits, from its config, in vLLM's order (LogitsProcessor):
    soft-capping (Gemma 2, 3), then scaling (Cohere's logit_scale, Granite's 1 / logits_scaling); None for most."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return None if not cap and scale == 1.0 else lambda x: (torch.tanh(x / cap) * cap if cap else x) * scale


def sequence_logprobs(model, samples, cfg, pad_id):
    """token_terms ("logp" among them) of every completion token of `samples`, injected ones too, in sample order."""
    x = batch_tensors([dataclasses.replace(s, mask=None) for s in samples], pad_id, next(model.parameters()).device)
    return as_policy(model)(x, cfg)


def micro_batches(samples, budget):
    """Split samples, sorted by length (little padding), into micro-batches of at most `budget` padded tokens."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt) + len(samples[i].tokens))
    out, batch, width = [], [], 0
    for i in order:
        w = len(samples[i].prompt) + len(samples[i].tokens)
        if batch and max(width, w) * (len(batch) + 1) > budget:
            out.append(batch)
            batch, width = [], 0
        batch.append(samples[i])
        width = max(width, w)
    return out + [batch] if batch else out


def batch_tensors(samples, pad_id, device):
    """A micro-batch of samples as the forward pass's and policy_loss's tensors: ids and attn (right-padded); for each
    completion token its row, the position that predicts it and its id (targets); keep, the trained ones (mask 1). Per
    trained token: seq (its completion in the micro-batch), logp_gen, A, weight, fresh (its completion sampled at lag 0,
    every token) and its completion's Sample.values. Built on the host: nothing read back from the device."""
    seqs = [s.prompt + s.tokens for s in samples]
    width = max(map(len, seqs))
    tokens = [(k, t, m) for k, s in enumerate(samples) for t, m in enumerate(s.mask or [1] * len(s.tokens))]
    trained = [(k, t) for k, t, m in tokens if m]
    of = [samples[k] for k, _ in trained]  # each trained token's sample
    tensor = lambda x, dtype=torch.float32: torch.tensor(list(x), dtype=dtype, device=device)  # noqa: E731
    x = {"ids": tensor([q + [pad_id] * (width - len(q)) for q in seqs], torch.long),
            "attn": tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], torch.long),
            "row": tensor((k for k, _, _ in tokens), torch.long),
            "pos": tensor((len(samples[k].prompt) - 1 + t for k, t, _ in tokens), torch.long),
            "targets": tensor((samples[k].tokens[t] for k, t, _ in tokens), torch.long),
            "keep": tensor((i for i, (_, _, m) in enumerate(tokens) if m), torch.long),
            "seq": tensor((k for k, _ in trained), torch.long),
            "logp_gen": tensor(s.gen_logprobs[t] if s.gen_logprobs else 0.0 for s, (_, t) in zip(of, trained)),
            "A": tensor(s.advantage for s in of), "weight": tensor(s.weight for s in of),
            "fresh": tensor(s.lags is not None and not any(
                lag for lag, m in zip(s.lags, s.mask or [1] * len(s.lags)) if m) for s in of),
            "values": {name: tensor(float(s.values[name]) for s in of) for name in samples[0].values}}
    if samples[0].experts is not None:  # an MoE's: the generator's experts at each token's predicting position
        x["experts"] = moe.experts_tensor(samples, width, device)
    return x


def mismatch_sums(logp, logp_gen, fresh, routed=None):
    """Train/inference mismatch on the trained tokens, before the update: sums of |log pi_train - log pi_gen|, of the k3
    estimate of KL(pi_gen || pi_train) [Sec. 3.2] (the ratios over eps_max: CISPO's clip_frac); and
    mismatch_fresh_abs_logprob, the first over the `fresh` tokens alone, where no lag can explain one (the Guard's
    --max-fresh-mismatch). An MoE's (routed: routing_differs): the tokens routed to other experts than the
    generator's in any layer, and the (token, layer)s."""
    d, n = (logp.detach() - logp_gen).double(), len(logp)
    sums = {"mismatch_abs_logprob": (d.abs().sum(), n), "mismatch_kl_k3": ((torch.exp(d) - 1 - d).sum(), n),
            "mismatch_fresh_abs_logprob": ((d.abs() * fresh).sum(), fresh.sum())}
    if routed is not None:
        sums.update(moe.routing_sums(routed))
    return sums


class FP32Head:
    """The FP32 LM head [Sec. 3.2], one place for the trainer (token_logprobs), the HF engine's hook and vLLM's head:
    h W^T + b in float32, from float32 operands, or (split: --fp32-head-product split) from W's two bfloat16 parts
    (split_bf16), their products accumulated in float32 (SplitProduct: float32's accuracy within 2-3x, on a GPU's
    tensor cores). weight: the trainer's parameter (its gradient wanted) or, copy=True, the engine's own float32 copy
    (the parts alone, where split), which load() refreshes at each push. A fork that changes the head's precision
    changes this class alone (docs/fork.md)."""

    def __init__(self, weight, split, copy=False):
        w = weight.detach().to(torch.float32, copy=True) if copy else weight
        self.parts = split_bf16(w.detach()) if split else None
        self.weight = None if copy and split else w  # (the engine keeps the parts alone)

    def load(self, weight):
        """The engine's copy gets the trainer's float32 weight (in its first rows: the engine pads the vocabulary)."""
        for mine, new in zip(self.parts or (self.weight,), split_bf16(weight) if self.parts else (weight,)):
            mine[:new.shape[0]].copy_(new)

    def __call__(self, h, bias=None):
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.weight.float()) if self.parts is None else \
                SplitProduct.apply(h, self.weight, *self.parts)
        return logits if bias is None else logits + bias.float()


def split_bf16(x):
    """x as two bfloat16 parts, hi + lo, with hi + lo = x to about 2^-16 relative (lo is None for a bf16 x)."""
    hi = x.to(torch.bfloat16)
    return hi, None if x.dtype == torch.bfloat16 else (x - hi).to(torch.bfloat16)  # (x - hi: float32, no copy of hi)


def mm_f32(a, b):
    """a @ b of bf16 operands, accumulated and returned in float32: on a GPU's tensor cores (out_dtype); where no kernel
    has that (a CPU) in float32, exactly: the product of two bf16 numbers is exact in float32, only the sums round."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except NotImplementedError:
        return a.float() @ b.float()


def mm3(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo)(b_hi + b_lo) less a_lo b_lo (2^-16 relative): up to three bf16 products summed in float32."""
    out = mm_f32(a_hi, b_hi)
    for a, b in ((a_hi, b_lo), (a_lo, b_hi)):
        if a is not None and b is not None:
            out += mm_f32(a, b)  # (in place: two V x H float32 tensors at most, for W's gradient)
    return out


class SplitProduct(torch.autograd.Function):
    """h W^T from bf16 parts (mm3), and in backward g W and g^T h the same way (the gradient g split too): the head's
    three products on tensor cores, its error 2-3x float32's, over 1,000x under bf16's (docs/engines.md). w: the
    weight whose gradient is wanted (None in the engine); w_hi, w_lo: its parts (split_bf16), made once a forward."""

    @staticmethod
    def forward(ctx, h, w, w_hi, w_lo):
        h_hi, h_lo = split_bf16(h)
        ctx.save_for_backward(h_hi, h_lo, w_hi, w_lo)
        ctx.dtypes = h.dtype, None if w is None else w.dtype
        return mm3(h_hi, h_lo, w_hi.t(), None if w_lo is None else w_lo.t())

    @staticmethod
    def backward(ctx, g):
        h_hi, h_lo, w_hi, w_lo = ctx.saved_tensors
        g_hi, g_lo = split_bf16(g.contiguous())
        gh = mm3(g_hi, g_lo, w_hi, w_lo).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = mm3(g_hi.t(), g_lo.t(), h_hi, h_lo).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None

# --------------------------------------------------------------------------------------------------
# 8. Metrics and the screen: the step's counts and metrics row; the Recorder, which records; the Guard around it, each
#    of its parts one place a fork changes: watch (the warning and stop rules), checkpoint_due (the cadence),
#    tear_down (section 1); the progress line and the rules' reasons; the live fit, W&B and --save-completions
# --------------------------------------------------------------------------------------------------


class Guard:
    """The run's course around its records: after each step its row recorded (Recorder), the warning and stop rules
    (watch) and the checkpoint cadence (checkpoint_due); a checkpoint at the end and on SIGINT/SIGTERM after the step
    (a second signal abandons it); the tear-down (tear_down). Under torchrun every rank runs it alike."""

    def __init__(self, cfg, state, recorder, first, release=lambda undo=False: None):
        self.cfg, self.state, self.recorder, self.rows, self.first, self.out = \
            cfg, state, recorder, recorder.rows, first, cfg.out
        self.done, self.last_saved = first - 1, first - 1 if cfg.resume else -1  # (a new run: step 0 not saved yet)
        self.stop, self.handlers, self.unlogged, self.warned, self.hacks = [], {}, None, set(), []
        self.saving, self.release, self.restored = False, release, len(recorder.rows)  # saving: a checkpoint written

    def __enter__(self):

        def on_signal(signum, frame):
            if self.stop:
                raise KeyboardInterrupt
            self.stop.append(signal.Signals(signum).name)
            if self.recorder.writer:
                size, secs = checkpoint_cost(self.state.model, self.cfg)
                took = f"{secs / 60:.0f} min" if secs >= 90 else f"{secs:.0f} s"
                print(f"\n{self.stop[0]}: finishing this step, then saving a checkpoint ({size / 1e9:.1f} GB: about "
                      f"{took} at 100 MB/s; again to abandon the step)", file=sys.stderr, flush=True)

        self.handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def row(self, step, result, seconds):
        """The metrics row of a step, kept until it is logged: when a generator fails during the step's evaluation, the
        step is logged without it, and checkpointed."""
        self.unlogged = metrics_row(self.state, self.cfg, step, result, seconds,
                                    take_counts(self.state, self.cfg, result, seconds))
        self.hacks = [c.verdict for g in result["groups"] for c in g.completions if str(c.verdict).startswith("hack")]
        return self.unlogged

    def step_done(self, row, errors):
        """A step's row recorded, then the rules that may stop the run, then the checkpoint the cadence calls for."""
        self.unlogged = None
        self.recorder.log(row, errors, self.hacks)
        self.hacks = []
        if row["step"]:  # (step 0, the initial weights' evaluation: recorded and watched, not a step of training)
            self.done = row["step"]
        self.watch(row)
        if row["step"] and checkpoint_due(self.rows, self.cfg):
            self.save()

    def watch(self, row):
        """The warning and stop rules, on the rows so far: a warning once for each cause (rank 0's), a stop in one line
        (every rank alike: the rows' sums are over the ranks). A fork adds its rule here."""
        writer, cfg, step = self.recorder.writer, self.cfg, row["step"]
        cause, why = (stall_reason(self.rows, cfg) if writer else None) or (None, None)
        if cause and cause not in self.warned:
            self.warned.add(cause)
            print(f"warning: the last {STALL_STEPS} steps trained on under half of their prompts: {why}", flush=True)
        fell = collapse_reason(self.rows, cfg) if writer and "val_pass_rate" in row else None
        if fell and "collapse" not in self.warned:
            self.warned.add("collapse")
            print(f"warning: {fell}", file=sys.stderr, flush=True)
        if not step:
            return
        skipped = in_a_row(self.rows, lambda r, before: before and r["skipped_updates"] > before["skipped_updates"])
        if skipped >= cfg.max_skipped_updates:
            die(f"{skipped} updates in a row skipped for a non-finite loss or gradient norm (loss {row['loss']}, "
                f"gradient norm {row['grad_norm']}); stopping. Last checkpoint: {last_checkpoint(self.out)}", 1)
        fresh, bound = row.get("mismatch_fresh_abs_logprob"), cfg.max_fresh_mismatch
        over = in_a_row([r for r in self.rows if "mismatch_fresh_abs_logprob" in r],
                        lambda r, _: r["mismatch_fresh_abs_logprob"] > bound) if fresh is not None and bound else 0
        why = (f"the trainer's and the generator's log-probs of completions that the weights being trained sampled "
               f"differ by {fresh:.3g} (mean |log pi_train - log pi_gen|), over --max-fresh-mismatch {bound:g}: a push "
               "that missed a weight, the LM head's precision (--lm-head-fp32, --dtype) or a model whose forward "
               "differs from the engine's") if over else ""
        if 0 < over < FRESH_STEPS and writer:
            print(f"warning: step {step}: {why}; the run stops if it lasts {FRESH_STEPS} steps", file=sys.stderr,
                  flush=True)
        elif over >= FRESH_STEPS:
            raise ScaleRLError(f"step {step}: {why}, {FRESH_STEPS} steps in a row: stopped, checkpoint {self.save()}; "
                               f"to go on anyway: {resume_command(self.out)} --max-fresh-mismatch 0", 1)

    def signalled(self):
        """True when SIGINT or SIGTERM asked the run to stop (under torchrun: any rank's signal stops every rank)."""
        if all_max(bool(self.stop)) and not self.stop:
            self.stop.append("a signal to another rank")
        return bool(self.stop)

    def stop_here(self):
        """The way out on a signal, after a complete step: its checkpoint, and how to continue."""
        print(f"{self.stop[0]}: stopped after step {self.done}; checkpoint {self.save()}; continue with: "
              f"{resume_command(self.out)}", flush=True)

    def __exit__(self, kind, exc, tb):
        try:
            if kind is None and not self.stop:  # the run ended: its final checkpoint
                print(f"done: model and training state in {self.save()}, metrics in {self.out}/metrics.jsonl")
            elif getattr(exc, "resumable", False) and world() == 1:  # a generator failed: the run can go on later
                if self.unlogged:  # it failed in an evaluation: the step itself is complete
                    self.step_done(self.unlogged, [])
                exc.args = (f"{exc}; checkpoint {self.save()}; continue with: {resume_command(self.out)}",)
            elif kind is KeyboardInterrupt:
                what = f"writing the checkpoint of step {self.done}" if self.saving else f"step {self.done + 1}"
                print(f"\n{what} abandoned; {self.done} steps are in {self.out}/metrics.jsonl; last "
                      f"checkpoint: {last_checkpoint(self.out)}", file=sys.stderr)
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)
            tear_down(self.state, self.recorder, lambda: self.release(
                undo=kind is not None and len(self.rows) == self.restored))
        return False

    def save(self):
        """A checkpoint of the last step logged (the newest checkpoint, where it has one already)."""
        if self.last_saved == self.done:
            return last_checkpoint(self.out)
        self.last_saved, self.saving = self.done, True
        final = save_checkpoint(self.out, self.done, self.state, self.cfg, self.rows)
        self.saving = False
        return final


class Recorder:
    """The run's records: config.json, metrics.jsonl (and W&B), the progress line. Under torchrun every rank keeps the
    rows, rank 0 writes them."""

    def __init__(self, cfg, state, rows, first, device, ceiling=None):
        self.cfg, self.rows, self.out, self.writer = cfg, rows, cfg.out, rank() == 0
        n_params = sum(p.numel() for p in state.model.parameters())
        const, const_rate = best_constant_pass_rate([a for _, a, *_ in state.val])
        on = f"{device} x {world()} ranks" if launched() else device
        self.tracker = start_wandb(cfg, self.out) if cfg.wandb and self.writer else None
        # the rows up to a resumed checkpoint (or none) and the config in force, written with the first row of this
        # run's own (log): a start that fails before it leaves a resumed run's records as they were
        self.records = {"metrics.jsonl": "".join(json.dumps(r) + "\n" for r in rows), "config.json": json.dumps(
            {**dataclasses.asdict(cfg), "n_params": n_params, "device": str(on), "world_size": world(),
             "best_constant_answer": const, "best_constant_pass_rate": const_rate, "best_possible_pass_rate": ceiling,
             "data_sha256": state.digests}, indent=2)} if self.writer else {}
        self.metrics = None  # (metrics.jsonl, open for appending once the records are written)
        print(f"scalerl: {n_params / 1e6:.2f}M parameters on {on} | {len(state.train)} train / {len(state.val_ids)} val"
              f" prompts | best constant answer '{const}' scores {const_rate:.3f}"
              + (f" | best possible pass rate {ceiling:.3f}" if ceiling else "") + f" | writing {self.out}"
              + (f" | resuming after step {first - 1}" if cfg.resume else ""), flush=True)

    def log(self, row, errors, hacks=()):
        """Record a row: metrics.jsonl (the records first, each whole at once, with this run's first), W&B, the screen,
        the completions that could not be graded, and what the first of hack_frac's marks said (this rank's)."""
        errors = all_gather(errors)[0]
        row["reward_errors"] = len(errors)
        self.rows.append(row)
        if self.metrics is None:
            for name, text in self.records.items():
                write_atomically(os.path.join(self.out, name), text)
            self.metrics = open(os.path.join(self.out, "metrics.jsonl") if self.writer else os.devnull, "a")
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.tracker:
            self.tracker.log(row, step=row["step"])
        print(progress_line(row, self.cfg.steps) if row["step"] else f"step    0/{self.cfg.steps}{val_text(row)}",
              flush=True)
        for what, items in (("could not be graded", errors), ("bear a hack's mark", hacks)):
            if self.writer and items:  # each costs its completion only (reward 0)
                print(f"step {row['step']}: {len(items)} completions {what} (reward 0); first: {items[0]}",
                      file=sys.stderr, flush=True)

    def close(self):
        if self.metrics:
            self.metrics.close()
        if self.tracker:
            self.tracker.finish()


def best_constant_pass_rate(answers):
    """Pass rate of always giving the most common answer (none passes a code row's ''): the floor to beat to learn."""
    values, counts = np.unique(answers, return_counts=True)
    counts = counts * (values != "")
    return values[counts.argmax()], counts.max() / len(answers)


def take_counts(state, cfg, r, seconds):
    """The step's counts, summed over the ranks, taken from the run's counters: the totals (the scaling curve's axes)
    advance by them, and the rollouts' counters and the generators' idle clocks start anew for the next step."""
    rollouts = state.rollouts
    local = step_counts(state, cfg, r)
    lag_max = local.pop("lag_max")  # (a max over the ranks, not a sum)
    n = dict(zip(local, all_sum(*local.values())))  # (one reduction for them all)
    n["lag_max"] = int(all_max(lag_max))
    advance_totals(state, cfg, n, r["update"], seconds)
    n["gen_seconds"] = rollouts.seconds  # (this process's)
    if cfg.generators:  # the generators' idle fraction: with nothing to do, since the last step
        idle, period = state.engine.take_idle()
        n["generator_idle_frac"] = max(0.0, all_sum(idle) / (cfg.generators * period))
    rollouts.decoded = rollouts.steps = rollouts.seconds = rollouts.ahead = rollouts.preempted = 0
    return n


def metrics_row(state, cfg, step, r, seconds, n):
    """The metrics row of rl_step's `r` (docs/outputs.md), n its counts (take_counts): counts summed over ranks,
    per-process values their max."""
    update, removed = r["update"], removals(state.curriculum)
    row = {"step": step, **state.totals, **mean_over_ranks(r["rollout"]),
           "zero_variance_frac": n["flat"] / n["groups"], "active_prompts": int(n["active"]),
           "truncated_excluded": int(n["excluded"]), **{f"{k}_removed": v for k, v in removed.items()},
           "pool_size": len(state.train) - sum(removed.values()), "epoch": state.curriculum.epoch,
           "truncated_frac": n["truncated"] / n["completions"], "interrupted_frac": n["interrupted"] / n["completions"],
           "mean_completion_tokens": n["sampled"] / n["completions"], "loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0,
           "lr": state.sched.get_last_lr()[0], "lag_mean": n["lag_sum"] / n["lags"] if n["lags"] else 0.0,
           "lag_max": n["lag_max"],
           "stale_dropped": int(n["stale"]), "inflight_groups": int(n["in_flight"]),
           "engine_batch_mean": n["decoded"] / max(n["engine_steps"], 1),
           **({"engine_capacity": int(n["capacity"])} if n["capacity"] else {}), "preemptions": int(n["preempted"]),
           "step_seconds": seconds, "gen_seconds": n["gen_seconds"], "train_seconds": 0.0,
           "sync_seconds": r["push_seconds"],
           # every metric of the update under its own name, but those the totals count and the memory peak (below)
           **{k: v for k, v in update.items() if k not in ("skipped", "trained_tokens", "gpu_peak_gb")}}
    if cfg.generators:  # each side's idle fraction: the trainer waiting for groups, the generators with nothing to do
        row["trainer_idle_frac"] = n["gen_seconds"] / seconds
        row["generator_idle_frac"] = n["generator_idle_frac"]
    if "gpu_peak_gb" in update:
        row["gpu_peak_gb"] = all_max(update["gpu_peak_gb"])
    if (rss := trim_memory()) is not None:
        row["rss_gb"] = all_max(rss)
    return row


def trim_memory():
    """Hand the C heap's free memory back to the system (glibc keeps what a step frees: a run grew step after step,
    docs/real-model.md), then return the process's resident memory in GiB, or None where /proc cannot tell."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


def step_counts(state, cfg, r):
    """This rank's step counts, to sum over the ranks (the split's capacity: what its generators decode at once)."""
    groups, samples, stats, ro = r["groups"], r["samples"], r["stats"], state.rollouts
    comps = [c for g in groups for c in g.completions]
    lags = [lag for x in samples for lag, m in zip(x.lags, x.mask) if m]  # the trained (sampled) tokens'
    capacity = state.engine.decoding() if cfg.generators else state.engine.capacity
    return {"groups": len(groups), "completions": len(comps), "generated": sum(len(c.tokens) for c in comps),
            "sampled": sum(sum(c.mask) for c in comps), "prompt_tokens": sum(len(g.prompt) for g in groups),
            "trained_sequence_tokens": sum(len(x.prompt) + len(x.tokens) for x in samples),
            "truncated": sum(not c.finished for c in comps), "interrupted": sum(c.interrupted for c in comps),
            "flat": round(stats["zero_variance_frac"] * len(groups)), "active": stats["active_prompts"],
            "excluded": stats["truncated_excluded"], "lag_sum": sum(lags), "lags": len(lags), "stale": r["stale"],
            "lag_max": max(lags, default=0), "in_flight": len(ro.open), "decoded": ro.decoded,
            "engine_steps": ro.steps, "ahead": ro.ahead, "capacity": capacity if math.isfinite(capacity) else 0,
            "preempted": ro.preempted}


def advance_totals(state, cfg, n, update, seconds):
    """The cumulative counters, the scaling curve's axes: device_hours (every device, trainers' and generators', the
    step and the training generation beside the last evaluation: docs/outputs.md), flops, tokens, skipped updates."""
    t, N = state.totals, sum(p.numel() for p in state.model.parameters())
    t["device_hours"] += (seconds + n["ahead"] / world()) * (world() + cfg.generators) / 3600
    t["flops"] += 2 * N * (n["prompt_tokens"] + n["generated"]) + 6 * N * n["trained_sequence_tokens"]
    t["gen_tokens"] += int(n["sampled"])
    t["train_tokens"] += update.get("trained_tokens", 0)
    t["skipped_updates"] += int(update.get("skipped", False))


def removals(curriculum):
    """{rule: prompts it removed}, over the ranks (each removes from its own shard), NPR's always there."""
    removed = curriculum.removed
    rules = sorted(set(all_gather(sorted(set(removed.values())))[0]) | {"npr"})
    return dict(zip(rules, map(int, np.atleast_1d(all_sum(*(sum(v == k for v in removed.values()) for k in rules))))))


def in_a_row(rows, rule):
    """How many of the last rows, in a row, meet rule(row, the row before it or None)."""
    k = 0
    while k < len(rows) and rule(rows[-1 - k], rows[-2 - k] if k + 1 < len(rows) else None):
        k += 1
    return k


def checkpoint_due(rows, cfg):
    """The checkpoint cadence: whether the step just recorded (rows[-1]) is checkpointed: every --save-every steps."""
    return bool(cfg.save_every) and rows[-1]["step"] % cfg.save_every == 0


def pass_rates(state, cfg, ids, correct):
    """{"val_pass_rate": ...} over every rank's held-out prompts (this rank's: `ids`, graded `correct`), and where they
    are graded by several rewards (math and code rows: an item's reward is its --data row's own, or --reward) each
    reward's, "val_pass_rate_<reward>" (fit_curve.py fits each: the paper's curve per domain)."""
    rewards = [x[3] if len(x) > 3 else cfg.reward for x in state.val]
    mine, split = np.array([rewards[i] for i in ids], dtype=object), sorted(set(rewards)) * (len(set(rewards)) > 1)
    per = {f"val_pass_rate_{r}": (correct[mine == r].sum(), correct[mine == r].size) for r in split}
    return mean_over_ranks({"val_pass_rate": (correct.sum(), correct.size), **per})


def val_text(row):
    """' | val 0.512', and each task's where the row has them: ' | val 0.512 (code 0.430, math 0.594)'."""
    tasks = ", ".join(f"{k[len('val_pass_rate_'):]} {v:.3f}" for k, v in row.items() if k.startswith("val_pass_rate_"))
    return f" | val {row['val_pass_rate']:.3f}" + f" ({tasks})" * bool(tasks)


def progress_line(row, steps):
    val = val_text(row) if "val_pass_rate" in row else ""
    if row.get("fit_A_at_bound"):
        val += f" (A \u2192 {row['fit_A']:.2f})"
    elif "fit_A" in row:
        val += f" (A {row['fit_A']:.3f} [{row['fit_A_ci'][0]:.3f}, {row['fit_A_ci'][1]:.3f}])"
    val += f" | hack {row['hack_frac']:.2f}" if "hack_frac" in row else ""
    return (f"step {row['step']:>4}/{steps} | reward {row['reward_mean']:.3f}{val} | zero-var "
            f"{row['zero_variance_frac']:.2f} | active {row['active_prompts']:>3} | npr {row['npr_removed']:>4} | "
            f"lag {row['lag_mean']:.1f}/{row['lag_max']} | intr {row['interrupted_frac']:.2f} | trunc "
            f"{row['truncated_frac']:.2f} | len {row['mean_completion_tokens']:.1f} | loss {row['loss']:+.4f} | gnorm "
            f"{row['grad_norm']:.3f} | mismatch {row.get('mismatch_abs_logprob', 0.0):.1e} | "
            f"{row['step_seconds']:.2f}s (gen {row['gen_seconds']:.2f} train {row['train_seconds']:.2f} sync "
            f"{row['sync_seconds']:.2f})")


FRESH_STEPS = 3  # steps in a row over --max-fresh-mismatch that stop a run (Guard.watch)
COLLAPSE_FALL = 1 / 3  # of the rise to the best evaluation: a fall larger than that (and than 0.1) is a collapse
STALL_STEPS = 10  # steps on under half of the prompts, the reward not rising, before stall_reason names a cause


def stall_reason(rows, cfg, n=STALL_STEPS):
    """Why the last n steps trained on under half of their prompts without their reward rising, as (cause, what to
    change); None when they did not, when the reward rose (a slow start), or when the prompts are solved."""
    last = [r for r in rows if r["step"]][-n:]
    if len(last) < n or any(r["active_prompts"] >= cfg.prompts_per_step / 2 for r in last):
        return None
    mean = lambda k, part=last: sum(r[k] for r in part) / len(part)  # noqa: E731
    if mean("reward_mean", last[n // 2:]) > mean("reward_mean", last[:n // 2]):
        return None
    if cfg.mask_truncated and mean("truncated_frac") > 0.5:
        return "truncated", (f"{mean('truncated_frac'):.0%} of the completions reach --max-new-tokens "
                             f"{cfg.max_new_tokens} and are left out of the batch (--mask-truncated), so nothing "
                             f"teaches the model to stop: raise --max-new-tokens, or pass --no-mask-truncated")
    removed, pool = last[-1]["npr_removed"], last[-1]["npr_removed"] + last[-1]["pool_size"]
    if removed > 0.9 * pool:
        return "npr", (f"NPR has removed {removed} of the {pool} training prompts (--npr-threshold "
                       f"{cfg.npr_threshold}): add prompts, or raise the threshold")
    if mean("reward_mean") < 0.01:
        return "flat", ("almost every group is flat at reward 0, so there is nothing to learn from: a stronger "
                        "--model, easier prompts, more --generations-per-prompt, or check --reward on a few "
                        "completions")
    return None


def collapse_reason(rows, cfg):
    """The warning, or None, for a held-out pass rate fallen far below its best: the last two evaluations' mean below
    the best before them by more than COLLAPSE_FALL of the rise from step 0 (itself over 0.1) and by more than 0.1."""
    ev = [r for r in rows if "val_pass_rate" in r]
    if len(ev) < 4:
        return None
    best, last = max(ev[:-2], key=lambda r: r["val_pass_rate"]), ev[-2:]
    now, top = sum(r["val_pass_rate"] for r in last) / 2, best["val_pass_rate"]
    rise = top - ev[0]["val_pass_rate"]
    if rise <= 0.1 or top - now <= max(COLLAPSE_FALL * rise, 0.1):  # (a fall from where it started is not one)
        return None
    since = [r for r in rows if r["step"] > best["step"]]
    mean = lambda k: float(np.mean([r[k] for r in since if k in r] or [np.nan]))  # noqa: E731
    return (f"the held-out pass rate fell from {top:.3f} (step {best['step']}) to {now:.3f} (steps {last[0]['step']} "
            f"and {last[1]['step']}). Since step {best['step']}: lag {mean('lag_mean'):.1f} updates on average, at "
            f"most {max(r['lag_max'] for r in since)} (--max-lag {cfg.max_lag}); mismatch |log pi_train - log pi_gen| "
            f"{mean('mismatch_abs_logprob'):.3f}, {mean('mismatch_fresh_abs_logprob'):.2g} on fresh completions; "
            f"{mean('truncated_frac'):.0%} of the completions cut at --max-new-tokens {cfg.max_new_tokens}"
            f"{' and left out of the batch (--mask-truncated)' * bool(cfg.mask_truncated)}; "
            f"{mean('active_prompts'):.1f} of {cfg.prompts_per_step} prompts trained on a step (--prompts-per-step); "
            f"learning rate {since[-1]['lr']:.2g} (--lr)"
            + "; at a small batch --max-lag 2 held such a run on 3 seeds (docs/real-model.md)" * (cfg.max_lag > 2))


def live_fit(rows):
    """The paper's prediction as the run goes on (fit_curve.live_fit: its fit of the evaluations so far, or {} while
    they cannot support one); {} without fit_curve.py beside this file, and on ranks but the first (which writes)."""
    if rank():
        return {}
    try:
        import fit_curve
    except ImportError:
        return {}
    return fit_curve.live_fit(rows)


def start_wandb(cfg, out):
    """Weights & Biases, when asked for: the config and every metrics row; metrics.jsonl stays the record."""
    import wandb
    try:
        return wandb.init(project=cfg.wandb, name=cfg.wandb_name or os.path.basename(os.path.abspath(out)),
                          config=dataclasses.asdict(cfg), dir=out)
    except Exception as e:  # noqa: BLE001  (wandb raises its own types: no network, a bad project name, ...)
        die(f"--wandb {cfg.wandb}: Weights & Biases did not start ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); WANDB_MODE=offline logs without network", 1)


def save_completions(cfg, step, tok, data, groups, correct, rewards):
    """--save-completions: one evaluation's completions, a JSON line each (docs/outputs.md), the text as graded; written
    whole (a failed write is one line). Under torchrun rank r > 0 writes its share to step_N.rank<r>.jsonl."""
    if not cfg.save_completions:
        return
    path = os.path.join(cfg.out, "completions", f"step_{step:06d}" + (f".rank{rank()}" if rank() else "") + ".jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    specials = special_ids(tok)
    write_atomically(path, "".join(json.dumps({
        "prompt": prompt, "answer": answer, "completion": completion_text(tok, c.tokens, specials),
        "finished": c.finished, "interrupted": c.interrupted, "reward": float(r), "correct": bool(ok),
        "verdict": c.verdict}) + "\n" for (prompt, answer, *_), g, oks, rs in zip(data, groups, correct, rewards)
        for c, ok, r in zip(g, oks, rs)))

# --------------------------------------------------------------------------------------------------
# 9. Run directories and checkpoints: one run a directory, its lock; checkpoints written atomically; resume, exact
#    (the synchronous loop) or with the groups in flight regenerated (the pipeline)
# --------------------------------------------------------------------------------------------------


LOCK = ".lock"  # in a run directory: the PID of the process whose run it is, which holds a flock on it while it runs


def claim(cfg, step=None):
    """Take the run directory, from its first write to the end of the process: an exclusive flock on OUT/.lock holding
    this PID. Returns release(undo): unlock; with undo, a new run or branch removes what it wrote."""
    import fcntl
    check_run_dir(cfg, step)
    if rank():
        return lambda undo=False: ""
    out, made = cfg.out, not os.path.isdir(cfg.out)
    os.makedirs(out, exist_ok=True)
    try:  # never through a link: a .lock planted as one would have the file it points to overwritten
        fd = os.open(os.path.join(out, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        die(f"--out {out}: {LOCK} cannot be opened as the run's lock ({e.strerror}): a run's lock is a plain file it "
            f"makes itself; remove {os.path.join(out, LOCK)}")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        die(f"--out {out}: {LOCK} is not a plain file; a run's lock is one it makes itself: remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        die(f"--out {out} is in use by process {holder}, whose run it is: one run per directory; wait for it to end, "
            "or choose another --out")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    root, done = os.path.join(out, "checkpoints"), unrenamed(out)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:  # a writer killed mid-write left it (the
        tmp, final = os.path.join(root, name), os.path.join(root, name.split(".")[0])  # lock held: none is alive)
        if tmp in done and not os.path.exists(final):  # complete: only its rename was cut short
            os.replace(tmp, final)
            cfg.resume = final if cfg.resume == tmp else cfg.resume
            print(f"scalerl: {final}: a complete checkpoint whose rename was cut short, renamed", flush=True)
        elif re.fullmatch(r"step_\d+\.tmp\d+", name):
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"scalerl: removed {tmp}, a checkpoint whose writing did not finish", flush=True)
    try:
        check_run_dir(cfg, step)  # (again, with the lock held and the leftovers settled)
    except ScaleRLError:
        os.close(fd)
        raise
    new_dir = not in_place(cfg)  # (check_run_dir: then the directory was new or empty)

    def release(undo=False):
        """Unlock; with undo, what it did to the directory, in words (or '')."""
        done = ""
        if undo and new_dir and made:
            shutil.rmtree(out, ignore_errors=True)
            done = f"{out}, which this run made, is removed"
        elif undo and new_dir:  # a directory the user made stays, empty again
            for path in (os.path.join(out, name) for name in os.listdir(out)):
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
            done = f"{out} is empty again"
        os.close(fd)
        return done
    return release


def check_run_dir(cfg, step=None):
    """A run directory holds one run. Refuse, before anything is written: --out in a checkpoint; a new run or branch
    into a non-empty directory; resuming in place from a checkpoint (`step`) the run went past; unwritable outputs."""
    out, there = cfg.out, cfg.out
    while there != os.path.dirname(there):  # --out and every directory above it
        if os.path.isfile(os.path.join(there, "trainer_state.pt")):
            die(f"--out {out} is inside the checkpoint {there}: a run writes beside its checkpoints, never in one; "
                "choose another directory")
        there = os.path.dirname(there)
    held = sorted(set(os.listdir(out)) - {LOCK}) if os.path.isdir(out) else []
    if incomplete := list_checkpoints(out, complete=False):
        die(f"{incomplete[0]} is an incomplete checkpoint (no trainer_state.pt): a run in {out} would write over it; "
            "move it out of the checkpoints directory (or delete it), then run again")
    if in_place(cfg):
        later = [c for c in list_checkpoints(out) if int(c.rsplit("_", 1)[1]) > step]
        if later:
            die(f"--resume {cfg.resume}: {out} goes on past it (checkpoint {later[-1]}); resuming it there would mix "
                "two runs: branch it into a new directory with --out NEW, or --resume auto")
    elif "metrics.jsonl" in held:
        die(f"--out {out} already holds a run: " + (
            f"branch {cfg.resume} into a new directory, or continue {out} with --resume auto" if cfg.resume else
            "continue it with --resume auto, or choose another directory" if list_checkpoints(out) + unrenamed(out) else
            "it has no checkpoint to continue from; remove it, or choose another directory"))
    elif held:
        die(f"--out {out} holds " + ("checkpoints but no metrics.jsonl" if "checkpoints" in held else
                                     ", ".join(held[:3]) + ", ..." * (len(held) > 3)) +
            ", which is not a run of this script: a run starts in a new or empty directory")
    metrics, completions = os.path.join(out, "metrics.jsonl"), os.path.join(out, "completions")
    if os.path.exists(metrics) and not (os.path.isfile(metrics) and os.access(metrics, os.W_OK)):
        die(f"--out {out}: {metrics} is not a writable file; the run cannot write its rows there")
    if cfg.save_completions and os.path.exists(completions) and not (
            os.path.isdir(completions) and os.access(completions, os.W_OK | os.X_OK)):
        die(f"--save-completions: {completions} is not a writable directory")


def list_checkpoints(out, complete=True):
    """Complete checkpoints in out/checkpoints, oldest first (a half-written one is still *.tmp*); complete=False: the
    incomplete ones, step_N directories without trainer_state.pt (optimiser state deleted to save space, say)."""
    root = os.path.join(out, "checkpoints")
    names = sorted(n for n in os.listdir(root) if re.fullmatch(r"step_\d+", n)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names
            if os.path.isfile(os.path.join(root, n, "trainer_state.pt")) == complete]


def unrenamed(out):
    """Complete checkpoints whose rename into place was cut short (step_N.tmpPID holding trainer_state.pt, written
    last): claim finishes the rename, and --resume auto takes them."""
    root = os.path.join(out, "checkpoints")
    return sorted(os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else [])
                  if re.fullmatch(r"step_\d+\.tmp\d+", n) and os.path.isfile(os.path.join(root, n, "trainer_state.pt")))


def run_of(ckpt):
    """The run directory a checkpoint is in: RUN/checkpoints/step_N -> RUN."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))


def last_checkpoint(out):
    """The newest complete checkpoint in out, or 'none'."""
    return (list_checkpoints(out) or ["none"])[-1]


def in_place(cfg):
    """Whether --resume continues the run in --out (OUT/checkpoints/step_N), rather than branching into it."""
    return bool(cfg.resume) and os.path.realpath(os.path.dirname(cfg.resume)) == \
        os.path.realpath(os.path.join(cfg.out, "checkpoints"))


def resume_command(out):
    """The command that continues the run in out with every setting of its own (its checkpoint's), paths quoted."""
    import shlex
    launcher = f"torchrun --nproc-per-node {world()}" if launched() else shlex.quote(sys.executable)
    return f"{launcher} {shlex.quote(os.path.abspath(__file__))} --resume auto --out {shlex.quote(out)}"


def write_atomically(path, text):
    """Write a file whole, through a temporary file renamed into place: a failed write leaves the file as it was."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        die(f"{path}: cannot write it ({e.strerror or e})", 1)


def save_checkpoint(out, step, state, cfg, rows=()):
    """Save what a run needs to continue, with its step's metrics row (rows: the run's, to its step), to a temporary
    directory renamed into place (a crash mid-write leaves the last checkpoint intact), then retire the checkpoints it
    makes redundant. Under torchrun rank 0 gathers it whole, in CPU memory."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(state.model, options=whole)
    # (an optimiser that never stepped, at step 0, has no state: torch would make one by a step at lr 0, counted)
    optimizer = get_optimizer_state_dict(state.model, state.opt, options=whole) if state.opt.state else None
    ranks = all_gather([{"curriculum": dataclasses.asdict(state.curriculum), "serial": state.serial,
                         "pending": pending_prompts(state), "torch_rng": torch.get_rng_state(),
                         "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}])[0]
    final = os.path.join(out, "checkpoints", f"step_{step:06d}")
    tmp = f"{final}.tmp{os.getpid()}"
    try:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            state.model.save_pretrained(tmp, state_dict=weights)
            state.tok.save_pretrained(tmp)
            torch.save({"step": step, "totals": dict(state.totals), "loop": {"version": state.version}, "ranks": ranks,
                        "digests": state.digests,
                        "optimizer": optimizer, "scheduler": state.sched.state_dict(),
                        "config": dataclasses.asdict(cfg), "script": os.path.basename(__file__),
                        "row": rows[-1] if rows else None},
                       os.path.join(tmp, "trainer_state.pt.tmp"))
            os.replace(os.path.join(tmp, "trainer_state.pt.tmp"), os.path.join(tmp, "trainer_state.pt"))  # complete
            finish_checkpoint(tmp, final)
            for old in retired_checkpoints(out, cfg, rows):  # (what a killed writer left: claim removed it)
                shutil.rmtree(old, ignore_errors=True)
    except KeyboardInterrupt:  # (a second Ctrl-C: a complete checkpoint is a rename away from its place, and takes it)
        if rank() == 0 and os.path.isfile(os.path.join(tmp, "trainer_state.pt")):
            finish_checkpoint(tmp, final)
        raise
    except (OSError, RuntimeError, SafetensorError) as e:  # (torch.save and safetensors wrap a full disk their way)
        shutil.rmtree(tmp, ignore_errors=True)
        size, free = checkpoint_cost(state.model, cfg)[0], shutil.disk_usage(os.path.dirname(final)).free
        why = " ".join(str(getattr(e, "strerror", None) or e).split())[:160]
        die(f"cannot write checkpoint {final} ({why}): it needs about {size / 1e9:.2g} GB (the weights and AdamW's "
            f"moments), {free / 1e9:.3g} GB is free there; the part written is removed, and the last good checkpoint "
            f"is {last_checkpoint(out)}", 1)
    if world() > 1:  # the checkpoint is complete before any rank goes on (or exits): the other ranks wait for rank 0's
        dist.barrier(group=checkpoint_group(state.model, cfg))  # write, on a group whose timeout is sized for it
    return final


def pending_prompts(state):
    """The prompts of the training groups started but not trained yet (still to regenerate after a resume, in
    flight, or complete), in the order they were started: a resumed run generates them again first."""
    rollouts = state.rollouts
    started = sorted((g for g in [*rollouts.open.values(), *rollouts.done] if g.key[0] == "train"), key=lambda g: g.key)
    return list(state.requeue) + [g.prompt_index for g in started]


def retired_checkpoints(out, cfg, rows):
    """The checkpoints a new one makes redundant, to remove: all but the newest --keep-last."""
    return list_checkpoints(out)[:-cfg.keep_last]


def finish_checkpoint(tmp, final):
    """Rename a complete checkpoint (its trainer_state.pt, written last, is there) into place."""
    if os.path.exists(final):  # (a run never writes a step twice; a directory there is not to be lost)
        raise FileExistsError(errno.EEXIST, f"{final} exists: not written over")
    os.replace(tmp, final)


def checkpoint_cost(model, cfg):
    """A checkpoint's bytes and the seconds rank 0 takes to write them at 100 MB/s (shared storage can be that slow)."""
    size = 3 * sum(p.numel() for p in model.parameters()) * getattr(torch, cfg.param_dtype).itemsize
    return size, size / 100e6


CHECKPOINT_GROUP = []  # under torchrun: the gloo group the ranks wait in while rank 0 writes a checkpoint


def checkpoint_group(model, cfg):
    """The gloo group for the barrier after a checkpoint, made once with the process group, its timeout sized for the
    write (the default group's would end a run whose 7B checkpoint writes slowly)."""
    if not CHECKPOINT_GROUP:
        seconds = max(1800.0, 4 * checkpoint_cost(model, cfg)[1])
        CHECKPOINT_GROUP.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)))
    return CHECKPOINT_GROUP[0]


RANK_STATE = {"curriculum", "serial", "pending", "torch_rng", "cuda_rng"}  # each rank's entry in trainer_state.pt
TOTALS = {"device_hours", "flops", "gen_tokens", "train_tokens", "skipped_updates"}  # the run's counters (State)


def resumed_config(cfg, ckpt):
    """The checkpoint's config, the run's every setting kept but those of MAY_CHANGE typed now; another value typed is
    refused (a data file's new path with the run's content is taken: moved_data). Returns it and the checkpoint's state,
    checked. It reads only: what is wrong stops the run in one line."""
    try:  # tensors and plain data only: a pickle that would run code is refused, not run
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        what = (re.findall(r"GLOBAL (\S+)", str(e)) or ["an object"])[0]
        die(f"--resume {ckpt}: trainer_state.pt holds more than tensors and plain data ({what}), which this script's "
            "checkpoints never do: refused, not loaded")
    except Exception as e:  # noqa: BLE001  (truncated, empty, a plain pickle, the legacy format: RuntimeError, ...)
        die(f"--resume {ckpt}: trainer_state.pt is damaged or not this script's: torch.load cannot read it "
            f"({type(e).__name__}: {' '.join(str(e).split())[:120]})")
    shape = {"step": int, "totals": dict, "loop": dict, "ranks": list, "optimizer": (dict, type(None)),
             "scheduler": dict, "config": dict}  # (what save_checkpoint writes, and restore reads)
    wrong = [k for k, kind in shape.items() if not isinstance(state, dict) or not isinstance(state.get(k, ...), kind)]
    wrong = wrong or ["loop"] * ("version" not in state["loop"]) + ["ranks"] * any(
        not isinstance(r, dict) or RANK_STATE - set(r) or not isinstance(r["curriculum"], dict) or
        {"order", "removed"} - set(r["curriculum"]) or not {"history", "pass_rate"} & set(r["curriculum"]) or  # (an
        not isinstance(r["torch_rng"], torch.Tensor)                     # older checkpoint's pass_rate: see restore)
        for r in state["ranks"]) + ["totals"] * bool(TOTALS - set(state["totals"])) + \
        ["scheduler"] * ("last_epoch" not in state["scheduler"])
    if wrong:
        die(f"--resume {ckpt}: trainer_state.pt is damaged or not this script's: {', '.join(wrong)} missing or not "
            "as this script writes it")
    from safetensors import SafetensorError, safe_open
    for name in sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors")) or ["model.safetensors"]:
        try:  # (the header only, and that it covers the file)
            with safe_open(os.path.join(ckpt, name), "pt"):
                pass
        except (OSError, SafetensorError) as e:
            die(f"--resume {ckpt}: {name} is damaged ({e}): the checkpoint cannot be loaded")
    if len(state["ranks"]) != world():
        die(f"--resume {ckpt}: the run had {len(state['ranks'])} ranks; resume it with as many (this has {world()})")
    settings = check_settings(state["config"], state.get("script"), ckpt)
    default = {f.name: f.default for f in dataclasses.fields(Config)}  # (a flag newer than the checkpoint: its default)
    moved = moved_data(cfg, settings, state.get("digests") if isinstance(state.get("digests"), dict) else {}, ckpt)
    changed = [k for k in default if k in cfg.typed and k not in MAY_CHANGE and k not in moved
               and getattr(cfg, k) != settings.get(k, default[k])]
    was = {k: settings[k] if k in settings else f"{default[k]}, the default: the checkpoint predates the flag"
           for k in changed}
    if changed:
        die(f"--resume {ckpt}: a resumed run keeps the settings of its checkpoint (all but "
            f"{as_flags(CHANGEABLE)}); typed now with other values: " + ", ".join(
                f"{as_flags([k])} {getattr(cfg, k)} (the run's: {was[k]})" for k in changed))
    step, steps = state["step"], settings.get("steps") if cfg.steps is None else cfg.steps
    if steps is None:
        die(f"--resume {ckpt}: its settings do not say how many steps the run takes: give --steps N")
    if steps < step:
        die(f"--steps {steps}: the checkpoint is of step {step}; a resumed run goes on from there")
    if steps == step:
        raise ScaleRLError(f"{ckpt} is step {step} of {steps}: nothing to do (--steps N, N > {step}, goes on)", 0)
    return Config(**{**settings, **moved, **{k: getattr(cfg, k) for k in MAY_CHANGE if k in cfg.typed}, "steps": steps,
                     "resume": ckpt, "out": cfg.out}), state


def check_settings(settings, script, ckpt):
    """A checkpoint's settings, typed as the command line types them (a flag newer than the checkpoint is left to its
    default). One line for another script's (a setting this one does not know, or lacks) and for a wrong type."""
    fields, mine = {f.name: f for f in dataclasses.fields(Config)}, os.path.basename(__file__)
    unknown, missing = sorted(set(settings) - set(fields)), sorted(set(fields) - set(settings))
    by = f"made by {script}" if script else "not made by this script"
    if unknown or script and script != mine and missing:
        die(f"--resume {ckpt}: {by}: " + "; ".join(f"{what} " + as_flags(keys)
                                                   for what, keys in (("settings this script does not know:", unknown),
                                                                      ("settings it does not have:", missing)) if keys)
            + f"; resume it with {script or 'the script that made it'}")
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), tuple: (list, tuple)}
    typed = lambda k, v: type(v) in kinds[fields[k].type] and (  # noqa: E731  (think_budget: two integers)
        fields[k].type is not tuple or len(v) == 2 and all(type(x) is int for x in v))
    wrong = [k for k, v in settings.items() if not (v is None and fields[k].default is None or typed(k, v))]
    if wrong:
        die(f"--resume {ckpt}: its settings are not as this script writes them: " + ", ".join(
            f"{k} {settings[k]!r} (not {'two integers' if fields[k].type is tuple else fields[k].type.__name__})"
            for k in wrong) + "; the checkpoint is damaged, or another script's")
    return {**settings, "think_budget": tuple(settings.get("think_budget", (0, 0)))}


def file_digest(path):
    """The sha256 of a data file (None for a directory or a hub name): what a resume checks a moved --data against."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def moved_data(cfg, settings, digests, ckpt):
    """{name: new path} of the data files typed now with another path than the run's but its content (the sha256 in the
    checkpoint): a file that moved. Another file, or a run's file gone with no new path typed, stops the resume."""
    moved = {}
    for k in ("data", "val_data"):
        old, new, name = settings.get(k) or "", getattr(cfg, k), "--" + k.replace("_", "-")
        if old and k in cfg.typed and new != old:
            if not digests.get(k):
                die(f"{name} {new}: the run read {old}, and its checkpoint predates the data's digest, so a move "
                    f"cannot be checked: put the file back at {old}")
            if file_digest(new) != digests[k]:
                die(f"{name} {new}: not the data the run trained on ({old}, sha256 {digests[k][:12]}...): a resumed "
                    "run keeps its data; give the run's file at its new path, or start a new run")
            moved[k] = new
        elif old and os.path.isabs(old) and not os.path.exists(old):
            die(f"--resume {ckpt}: the run's {name} {old} is gone: if it moved, resume with {name} NEW_PATH (its "
                "content is checked against the run's)")
    return moved


def run_rows(ckpt, step, own=None):
    """The rows of a checkpoint's run (its metrics.jsonl) up to its step: the resumed run writes them again, then its
    own, so that no step is duplicated or missing. A row cut off at the end (a crash mid-write) is dropped, a step's
    second row too; the checkpoint's own row (`own`, kept in it) comes back if the file lost it; a gap is named."""
    path = os.path.join(run_of(ckpt), "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"scalerl: no metrics.jsonl beside {ckpt}: the rows start after step {step}", flush=True)
        return []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        die(f"{path}: cannot read it ({e})")
    rows = {}
    for k, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # rows are written one write each: a crash cuts off the last one at most
            if k < len(lines):
                die(f"{path}: line {k} is not a metrics row (not JSON); the run cannot be resumed from this file")
            print(f"scalerl: {path}: its last row was cut off (the run stopped while writing it); dropped", flush=True)
            continue
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            die(f"{path}: line {k} is not a metrics row (JSON, but not an object with an integer step); the run cannot "
                "be resumed from this file")
        if row["step"] in rows:
            print(f"scalerl: {path}: line {k} is step {row['step']}'s second row; dropped", flush=True)
        rows.setdefault(row["step"], row)
    if own and step not in rows:
        rows[step] = own
        print(f"scalerl: {path}: step {step}'s row, lost from it, is restored from the checkpoint", flush=True)
    if gone := sorted(set(range(step + 1)) - set(rows)):
        print(f"scalerl: {path}: the rows of step{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} are gone; the run "
              "goes on without them", flush=True)
    return sorted((r for r in rows.values() if r["step"] <= step), key=lambda r: r["step"])


def restore(resumed, state, ckpt):
    """Put a checkpoint's state back. Returns the rows of its run up to its step (the Recorder writes them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    if resumed["optimizer"] is not None:
        set_optimizer_state_dict(state.model, state.opt, resumed["optimizer"],
                                 options=StateDictOptions(full_state_dict=launched()))
    state.sched.load_state_dict(resumed["scheduler"])
    mine = resumed["ranks"][rank()]
    cur = dict(mine["curriculum"])
    if "pass_rate" in cur:  # a checkpoint from before the history: each prompt's last pass rate, removals by NPR
        cur["history"] = {i: [r] for i, r in cur.pop("pass_rate").items()}
        cur["removed"] = dict.fromkeys(cur["removed"], "npr")
    state.curriculum.__dict__.update(cur)
    state.totals.update(resumed["totals"])
    state.version, state.serial = resumed["loop"]["version"], mine["serial"]
    state.requeue.extend(mine["pending"])
    torch.set_rng_state(mine["torch_rng"])
    if mine["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(mine["cuda_rng"])
    return run_rows(ckpt, resumed["step"], resumed.get("row"))

# --------------------------------------------------------------------------------------------------
# 10. torchrun: one process per device. FSDP2 shards the trainer; each rank has its own engine and generates its share
#     of each step's prompts; whatever the recipe defines over the batch is reduced over the ranks. Last, as a run in
#     one process calls only its identities (and shares its reductions with the sections above).
# --------------------------------------------------------------------------------------------------


def launched():
    """True under torchrun (or any launcher that sets RANK and WORLD_SIZE): the run is sharded, even on one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world():
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def rank():
    return int(os.environ["RANK"]) if launched() else 0


def init_distributed(cfg, device, model):
    """Under torchrun: join the process group (NCCL and gloo on CUDA: a 30-minute timeout) and checkpoint_group's; after
    the model is loaded (with a group, save_pretrained writes on rank 0 only: each node builds its own)."""
    if not launched():
        return
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    checkpoint_group(model, cfg)
    box = [cfg.out]  # each rank timed its own default name; rank 0's is the run's
    dist.broadcast_object_list(box, src=0)
    cfg.out = box[0]


def shard(model, device):
    """FSDP2 under torchrun. Only rank 0 has loaded the weights: it sends each, one at a time, and every rank keeps its
    shard; buffers (rotary tables) go whole. Host memory holds the model once, for any number of ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    empty = next(model.parameters()).is_meta
    whole = model.state_dict() if rank() == 0 else {}  # the loaded tensors, kept while fully_shard copies shards
    policy = fsdp_units(model)
    if empty:
        policy.to_empty(device=device)
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for b in model.buffers():
        dist.broadcast(b, src=0)
    return policy


def fsdp_units(model, mesh=None):
    """The Policy around the model, sharded by FSDP2: each decoder layer one unit, the Policy the root, holding the
    rest. mesh: the ranks' device mesh (bench.py --memory passes one made outside fake mode)."""
    from torch.distributed.fsdp import fully_shard
    for m in model.modules():
        if type(m).__name__ in (getattr(model, "_no_split_modules", None) or []):
            fully_shard(m, mesh=mesh)
    return fully_shard(Policy(model), mesh=mesh)


def replica(model, device):
    """An unsharded copy of the model for the HF engine under torchrun: a rank's generate must not wait on others."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        copy_ = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
    copy_.to_empty(device=device)
    copy_.tie_weights()  # (to_empty gave a tied head storage of its own, which no push fills: the tie made again)
    for name, b in copy_.named_buffers():
        b.copy_(model.get_buffer(name))
    return copy_


def full_weights(model, dtype, checkpoint=False):
    """(name, whole tensor in dtype) of each weight, one at a time, for a push: under torchrun each is gathered when the
    engine asks for it, every rank in the same order, so no rank holds the whole model twice (vLLM reloads by layer).
    checkpoint: under the names and in the layout of the model's checkpoint, which vLLM reads, one layer at a time:
    transformers converts some models on load (an MoE's experts fused into 3D tensors, Mixtral's modules renamed) and
    its revert_weight_conversion is what save_pretrained writes back; a state_dict() as it is in memory would corrupt
    the experts where the shapes happen to fit, and fail where they do not."""
    from transformers.core_model_loading import revert_weight_conversion
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    layer = lambda name: re.match(r"(.*?\.\d+\.)?", name).group()  # noqa: E731  ("model.layers.3.": one group)
    for _, group in itertools.groupby(((n, t) for n, t in model.state_dict().items() if n not in tied),
                                      key=lambda nt: layer(nt[0])):  # (a tied head is the embedding, pushed as such:
        whole = {n: full_tensor(t).detach().to(dtype) for n, t in group}             # vLLM's Gemma 2 has no lm_head)
        yield from (revert_weight_conversion(model, whole) if checkpoint else whole).items()


def full_tensor(t):
    """A whole tensor from a sharded one (DTensor.full_tensor gathers it: a collective, every rank in turn)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def even_out(batches, pad_id):
    """Micro-batches as many as on the rank with the most: the others get empty ones (one padding token with loss
    mask 0: no loss, no count), so that FSDP's collectives in forward and backward line up across ranks."""
    empty = Completion([pad_id], [0.0], False, [0], [0])
    filler = [Sample([pad_id], [pad_id], [0.0], [0], [0], 0.0, 0.0, completion_values(empty, 0.0, 0.0))]
    return batches + [filler] * (int(all_max(len(batches))) - len(batches))


def mean_over_ranks(pairs):
    """{name: total / count} of {name: (total, count)}, each summed over the ranks; none where the count is 0."""
    flat = np.atleast_1d(all_sum(*(float(v) for pair in pairs.values() for v in pair))).tolist() if pairs else []
    return {k: flat[2 * a] / flat[2 * a + 1] for a, k in enumerate(pairs) if flat[2 * a + 1]}


def all_sum(*values):
    """The values summed over the ranks (each holds its share of the batch), as floats: one, or a list."""
    return _reduce(values, dist.ReduceOp.SUM)


def all_max(*values):
    return _reduce(values, dist.ReduceOp.MAX)


def _reduce(values, op):
    x = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if world() > 1:
        dist.all_reduce(x, op=op)
    return x.tolist() if len(values) > 1 else x.item()


def all_gather(*lists):
    """Each list concatenated over the ranks, in rank order."""
    if world() == 1:
        return [list(x) for x in lists]
    got = [None] * world()
    dist.all_gather_object(got, [list(x) for x in lists])
    return [sum((g[k] for g in got), []) for k in range(len(lists))]


def backward_sum(loss):
    """loss.backward() for this rank's share of a sum: FSDP2 averages the ranks' gradients, so it is scaled by W."""
    (loss * world()).backward()


if __name__ == "__main__":
    main(end_process=True)
