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


def gemv_runs() -> bool:
    """Whether the server's float32 products take Gemv's order here: AVX2 and FMA, or AVX-512."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def test_rl_example_raises_the_reward_with_the_ratio_at_one(float32_server, tmp_path):
    png = tmp_path / "reward.png"
    run = run_example("rl.py", float32_server, "--steps=20", f"--png={png}")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = re.findall(r"reward (\d\.\d+) .* ratio (\d\.\d+) \((\d+) tokens != 1\)", run.stdout)
    assert len(steps) == 20, run.stdout
    rewards = [float(r) for r, _, _ in steps]
    assert max(rewards[:3]) < 0.65 and min(rewards[-3:]) > 0.9, run.stdout
    # The sampler is the trainer's weights and kernels: in float32 on a CPU with AVX2 or AVX-512
    # (where every forward product takes Gemv's order) p_train / p_sample is 1.0 on every token,
    # to the bit; elsewhere 1 to float32 rounding.
    assert all(abs(float(ratio) - 1.0) < 1e-3 for _, ratio, _ in steps), run.stdout
    if gemv_runs():
        assert all(int(off) == 0 for _, _, off in steps), run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_example_lowers_the_loss(server):
    run = run_example("sft.py", server, "--steps=8")
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"loss/token (\d+\.\d+)  grad", run.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, run.stdout
