"""An RL rollout service against tinkerd: a policy learns to emit even token ids.

Each step freezes the policy into a sampler, samples a group of completions per prompt, scores
each completion by the fraction of its tokens that are even, and gives every completion its
reward minus its group's mean (group-relative advantages). Each group's trajectories are streamed
into one StreamForwardBackward as soon as the group is sampled, with the sampler's logprobs, under
the importance_sampling loss; then one optimizer step. The importance ratio p_train / p_sample
is reported with the number of trained tokens where it is not exactly 1: the sampler is the
trainer's own weights and kernels, summing in the trainer's order, so in float32 and bf16 on a
CPU with AVX2 or AVX-512 every ratio is 1.0 to the bit (docs/sampling.md).

    python3 rl.py --target 127.0.0.1:50051
"""

import argparse
import concurrent.futures
import os
import sys
import time

import numpy as np

import tinkerd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import text_plot, write_png  # noqa: E402


def reward(tokens: np.ndarray) -> float:
    return float(np.mean(tokens % 2 == 0))


def trajectory(prompt, sample, advantage):
    """The model reads prompt + completion; only completion tokens carry the advantage and the
    sampler's logprobs (advantage 0 masks the prompt out of the loss)."""
    full = np.concatenate([prompt, sample.tokens])
    n_prompt, n = len(prompt) - 1, len(full) - 1
    logprobs, advantages = np.zeros(n), np.zeros(n)
    logprobs[n_prompt:] = sample.logprobs
    advantages[n_prompt:] = advantage
    return tinkerd.datum(full[:-1], target_tokens=full[1:], logprobs=logprobs,
                         advantages=advantages)


def bar(done, total, width=24) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def train(conn, args) -> list[float]:
    trainer = conn.create_training_client(lora_rank=args.lora_rank, seed=args.seed)
    vocab = trainer.get_info().vocab_size
    rng = np.random.default_rng(args.seed)
    rewards = []
    print(f"model {trainer.model_id}: LoRA rank {args.lora_rank} on a {vocab}-token vocabulary; "
          f"{args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens per step")
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        # The policy as of now: frozen after the previous step, in the model's own order.
        sampler = trainer.save_weights_and_get_sampling_client().result()
        stream = trainer.open_stream("importance_sampling")
        prompts = {}
        for _ in range(args.prompts):
            prompt = rng.integers(0, vocab, args.prompt_tokens)
            future = sampler.sample(prompt, max_tokens=args.max_tokens, num_samples=args.group,
                                    seed=int(rng.integers(1 << 62)))
            prompts[future] = prompt
        step_rewards, sampled_logprobs, masks = [], [], []
        try:
            for future in concurrent.futures.as_completed(prompts):
                samples = future.result().sequences
                group = np.array([reward(s.tokens) for s in samples])
                step_rewards.extend(group)
                for s, a in zip(samples, group - group.mean()):
                    stream.write(trajectory(prompts[future], s, a))
                    sampled_logprobs.append(s.logprobs)
                    masks.append(a != 0)
        except BaseException:
            stream.cancel()  # nothing of a half-sampled step is trained on
            raise
        out = stream.finish()
        # p_train / p_sample on the completion tokens that were trained (advantage != 0): the
        # trainer's logprobs of a trajectory end with its completion's.
        ratios = [np.exp(train[-len(sampled):].astype(np.float64) - sampled)
                  for train, sampled, trained in zip(out.logprobs, sampled_logprobs, masks)
                  if trained]
        ratio = float(np.mean(np.concatenate(ratios))) if ratios else 1.0
        off = sum(int(np.count_nonzero(r != 1.0)) for r in ratios)
        tokens = out.metrics["num_tokens:sum"]
        if tokens > 0:
            trainer.optim_step(args.lr).result()
        sampler.delete()
        secs = time.monotonic() - t0
        rewards.append(float(np.mean(step_rewards)))
        sampled = args.prompts * args.group * args.max_tokens
        print(f"step {step:3d}/{args.steps} {bar(step, args.steps)} reward {rewards[-1]:.3f}  "
              f"loss/token {out.metrics['loss:sum'] / max(tokens, 1):+.1e}  ratio {ratio:.4f} "
              f"({off} tokens != 1)  "
              f"{sampled / secs:5.0f} sampled tok/s  {secs:4.1f} s", flush=True)
    return rewards


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_tokens", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=8, help="tokens per completion")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--png", default="rl-reward.png", help="where the reward plot is written")
    args = p.parse_args()
    with tinkerd.Connection(args.target) as conn:
        if not conn.health():
            print("tinkerd is not serving", file=sys.stderr)
            return 1
        rewards = train(conn, args)
    print("\nmean reward per step (fraction of even tokens):")
    print(text_plot(rewards))
    write_png(args.png, rewards)
    print(f"reward plot written to {os.path.abspath(args.png)}")
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    print(f"reward went from {first:.3f} (first 3 steps) to {last:.3f} (last 3)")
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main())
