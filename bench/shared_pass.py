"""What a pass shared by many models costs against one model's pass over the same tokens: the
same 32 sequences of 64 tokens sent as one call of one model, or spread over 2, 8 and 32 models'
calls sent at once (which the scheduler joins into shared passes, --join_tokens); and 32 models'
optim_steps sent at once. Starts its own tinkerd on the embedded default model (LoRA rank 16).

    PYTHONPATH=build/client/python /usr/bin/python3 bench/shared_pass.py \
        --binary=build/server/tinkerd [--server_args=--join_tokens=0]

Prints the best of --repeats wall times per row, in milliseconds.
"""

import argparse
import re
import subprocess
import sys
import threading
import time

import numpy as np

import tinkerd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default="build/server/tinkerd")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--server_args", default="", help="more tinkerd flags, space-separated")
    args = p.parse_args()
    process = subprocess.Popen(
        [args.binary, "--listen=127.0.0.1:0", "--metrics_port=-1", "--threads=2",
         "--max_models=128"] + args.server_args.split(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        m = re.match(r"tinkerd listening on port (\d+)", line)
        if m:
            break
    else:
        raise RuntimeError("tinkerd did not start")
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    rng = np.random.default_rng(0)
    try:
        with tinkerd.Connection(f"127.0.0.1:{m.group(1)}") as conn:
            n, tokens = args.sequences, args.tokens
            trainers = [conn.create_training_client(lora_rank=16, seed=i) for i in range(n)]
            vocab = trainers[0].get_info().vocab_size

            def sequence():
                ids = rng.integers(0, vocab, tokens + 1)
                return tinkerd.datum(ids[:-1], target_tokens=ids[1:], weights=np.ones(tokens))

            for t in trainers:  # warm-up, untimed
                t.forward_backward([sequence()]).result()

            def best(run) -> float:
                times = []
                for _ in range(args.repeats):
                    t0 = time.monotonic()
                    run()
                    times.append(time.monotonic() - t0)
                return min(times) * 1e3

            print(f"# bench/shared_pass.py {' '.join(sys.argv[1:])}")
            print("| calls at once | milliseconds |")
            print("|---|---:|")
            models = 1
            while models <= n:
                per = n // models
                ms = best(lambda: [f.result() for f in [
                    t.forward_backward([sequence() for _ in range(per)])
                    for t in trainers[:models]]])
                print(f"| {models} models x {per} sequences (forward_backward) | {ms:.0f} |",
                      flush=True)
                models *= 4 if models > 1 else 2
            ms = best(lambda: [f.result() for f in [t.optim_step(1e-4) for t in trainers]])
            print(f"| {n} models' optim_step | {ms:.0f} |")
    finally:
        process.terminate()
        process.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
