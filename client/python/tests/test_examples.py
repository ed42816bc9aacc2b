"""The examples run against a real tinkerd and do what they promise."""

import os
import re
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run_example(name, server, *args):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name),
                           f"--target={server.target}", *args],
                          capture_output=True, text=True, timeout=600, env=os.environ.copy())


def test_rl_example_raises_the_reward_with_the_ratio_at_one(server, tmp_path):
    png = tmp_path / "reward.png"
    run = run_example("rl.py", server, "--steps=20", f"--png={png}")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = re.findall(r"reward (\d\.\d+) .* ratio (\d\.\d+)", run.stdout)
    assert len(steps) == 20
    rewards = [float(r) for r, _ in steps]
    assert max(rewards[:3]) < 0.65 and min(rewards[-3:]) > 0.9, run.stdout
    # The sampler is the trainer's weights: p_train / p_sample is 1 to float32 rounding.
    assert all(abs(float(ratio) - 1.0) < 1e-3 for _, ratio in steps), run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_example_lowers_the_loss(server):
    run = run_example("sft.py", server, "--steps=8")
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"loss/token (\d+\.\d+)  grad", run.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, run.stdout
