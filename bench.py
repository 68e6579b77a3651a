"""bench.py -- time scalerl.py on random-weight models of real shapes, built from a config (no download).

    python bench.py --shape qwen2-0.5b -- --steps 3 --prompts-per-step 8 --generations-per-prompt 8 \\
        --max-new-tokens 512 --length-control truncate --no-zero-variance-filter
Everything after `--` is passed to scalerl.py. The model gets random weights and scalerl's character tokenizer,
so rewards are meaningless (use --no-zero-variance-filter, or every all-zero group is filtered out and nothing
is trained); the numbers to read are the times, the throughputs and the memory.
"""
import argparse
import json
import os
import sys
import tempfile

import scalerl

SHAPES = {  # name: (architecture, config)
    "qwen2-0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=32768, rope_theta=1e6)),
    "llama-135m": ("Llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                                 max_position_embeddings=2048)),
}


def build(shape, path):
    import torch
    import transformers
    arch, conf = SHAPES[shape]
    config = getattr(transformers, f"{arch}Config")(**conf, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    scalerl.save_atomically(model, scalerl.make_char_tokenizer(), path)
    return sum(p.numel() for p in model.parameters())


def main():
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description="time scalerl.py on a random-weight model of a real shape")
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, args.shape)
        n = build(args.shape, path)
        print(f"bench: {args.shape}, {n / 1e6:.0f}M parameters (random weights)", flush=True)
        cfg = scalerl.parse_args(["--model", path, "--out", os.path.join(tmp, "run"), *rest])
        rows = scalerl.run(cfg)[1:]
    timed = rows[1:] or rows  # the first step includes warm-up (kernels, allocator)
    base = rows[0] if len(rows) > 1 else {"gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
    tot = lambda k: sum(r[k] for r in timed)  # noqa: E731
    diff = lambda k: timed[-1][k] - base[k]  # noqa: E731  (cumulative counters)
    summary = {"shape": args.shape, "engine": cfg.engine, "params_m": n / 1e6, "steps_timed": len(timed),
               "step_s": tot("step_seconds") / len(timed), "gen_s": tot("gen_seconds") / len(timed),
               "train_s": tot("train_seconds") / len(timed), "sync_s": tot("sync_seconds") / len(timed),
               "sync_frac_of_step": tot("sync_seconds") / tot("step_seconds"),
               "gen_tokens_per_s": diff("gen_tokens") / tot("gen_seconds"),
               "train_tokens_per_s": diff("train_tokens") / tot("train_seconds"),
               "model_tflops_per_s": diff("flops") / 1e12 / tot("step_seconds"),
               "gpu_peak_gb": max(r.get("gpu_peak_gb", 0.0) for r in rows)}
    print("bench:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
