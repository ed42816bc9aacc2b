"""Supervised fine-tuning against tinkerd: a LoRA learns to continue arithmetic sequences of token
ids (t_k = 64 + (start + k * stride) mod 64). Each step's forward_backward and optim_step are sent
before waiting on either: the server applies them in order, so pipelining only saves a round trip.

    python3 sft.py --target 127.0.0.1:50051
"""

import argparse
import sys
import time

import numpy as np

import tinkerd


def arithmetic_sequence(rng, length):
    start, stride = rng.integers(64), 1 + rng.integers(5)
    seq = 64 + (start + stride * np.arange(length + 1)) % 64
    weights = np.ones(length)
    weights[:2] = 0.0  # the first two tokens define the sequence: nothing to learn there
    return tinkerd.datum(seq[:-1], target_tokens=seq[1:], weights=weights)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-3)
    args = p.parse_args()
    rng = np.random.default_rng(42)
    with tinkerd.Connection(args.target) as conn:
        trainer = conn.create_training_client(lora_rank=16, train_unembed=False)
        losses = []
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            batch = [arithmetic_sequence(rng, args.seq_len) for _ in range(args.batch)]
            fb = trainer.forward_backward(batch)
            opt = trainer.optim_step(args.lr)
            out, stepped = fb.result(), opt.result()
            losses.append(out.metrics["loss:sum"] / out.metrics["num_tokens:sum"])
            secs = time.monotonic() - t0
            print(f"step {step:3d}  loss/token {losses[-1]:.4f}  grad_norm {stepped.grad_norm:.3f}"
                  f"  {args.batch * args.seq_len / secs:6.0f} tokens/s", flush=True)
    print(f"loss/token went from {losses[0]:.4f} to {losses[-1]:.4f}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
