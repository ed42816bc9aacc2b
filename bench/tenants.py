"""Many tenants on one server: aggregate training tokens/s of K tenants, each training its own LoRA
model on one sequence per call, against one tenant sending the same K sequences per call; and the
spread between tenants (slowest / fastest tenant's tokens/s). Starts its own tinkerd with an API
keys file of K tenants, on the embedded default model.

    PYTHONPATH=build/client/python /usr/bin/python3 bench/tenants.py --binary=build/server/tinkerd \
        --tenants=1,4,8,16 --tokens=64 --rounds=6

Each round of a model is a forward_backward and an optim_step, sent together (pipelined); every
model runs its rounds on its own thread and connection. With --greedy_models=M the first tenant
trains M models at once, the same tokens in all as every other tenant's one model (each of its
models takes rounds / M rounds), so the spread says whether a tenant's share grows with its number
of models. Prints one Markdown table row per K.
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import tinkerd


def start_server(binary: str, keys_file: str, threads: int, extra: list[str]):
    process = subprocess.Popen(
        [binary, "--listen=127.0.0.1:0", "--metrics_port=-1", f"--api_keys_file={keys_file}",
         f"--threads={threads}", "--max_models=128"] + extra,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        m = re.match(r"tinkerd listening on port (\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, f"127.0.0.1:{m.group(1)}"
    raise RuntimeError("tinkerd did not start")


def sequence(rng, vocab: int, tokens: int):
    ids = rng.integers(0, vocab, tokens + 1)
    return tinkerd.datum(ids[:-1], target_tokens=ids[1:], weights=np.ones(tokens))


def train(target: str, key: str, rounds: int, per_call: int, tokens: int, rank: int, seed: int,
          start: threading.Barrier, depth: int = 1):
    """Trains one model, `depth` rounds in flight; returns (tokens trained, seconds from the barrier
    to the last step)."""
    with tinkerd.Connection(target, api_key=key) as conn:
        trainer = conn.create_training_client(lora_rank=rank, seed=seed)
        vocab = trainer.get_info().vocab_size
        rng = np.random.default_rng(seed)
        trainer.forward_backward([sequence(rng, vocab, tokens)]).result()  # warm-up, untimed
        trainer.optim_step(1e-4).result()
        start.wait()
        t0 = time.monotonic()
        in_flight = []
        for _ in range(rounds):
            in_flight.append(
                trainer.forward_backward([sequence(rng, vocab, tokens) for _ in range(per_call)]))
            in_flight.append(trainer.optim_step(1e-4))
            while len(in_flight) > 2 * depth:
                in_flight.pop(0).result()
        for f in in_flight:
            f.result()
        return rounds * per_call * tokens, time.monotonic() - t0


def run(target: str, keys: list[str], k: int, args) -> tuple[float, float, float]:
    """(one tenant's tokens/s with k sequences per call, k tenants' aggregate, slowest/fastest)."""
    one = train(target, keys[0], args.rounds, k, args.tokens, args.rank, 1, threading.Barrier(1))
    owners = [0] * (args.greedy_models - 1) + list(range(k))  # a model per entry
    barrier = threading.Barrier(len(owners))
    with concurrent.futures.ThreadPoolExecutor(len(owners)) as pool:
        t0 = time.monotonic()
        results = list(pool.map(
            lambda i: train(target, keys[owners[i]],
                            args.rounds // args.greedy_models if owners[i] == 0 else args.rounds,
                            1, args.tokens, args.rank, 100 + i, barrier, args.depth),
            range(len(owners))))
        wall = time.monotonic() - t0
    # A tenant's rate: its models' tokens over the time its last one took.
    tokens, seconds = [0] * k, [0.0] * k
    for owner, (n, s) in zip(owners, results):
        tokens[owner] += n
        seconds[owner] = max(seconds[owner], s)
    rates = [n / s for n, s in zip(tokens, seconds)]
    return one[0] / one[1], sum(tokens) / wall, max(rates) / min(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default="build/server/tinkerd")
    p.add_argument("--tenants", default="1,4,8,16")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--greedy_models", type=int, default=1,
                   help="models the first tenant trains at once")
    p.add_argument("--depth", type=int, default=1,
                   help="rounds each model keeps in flight (its calls queued at the server)")
    p.add_argument("--server_args", default="",
                   help="more tinkerd flags, space-separated (e.g. --join_tokens=0: calls alone)")
    args = p.parse_args()
    ks = [int(k) for k in args.tenants.split(",")]
    keys = [f"tenant-{i:03d}-key-0123456789abcdef" for i in range(max(ks))]
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        for i, key in enumerate(keys):
            f.write(f"tenant{i} {key}\n")
    process, target = start_server(args.binary, f.name, args.threads, args.server_args.split())
    try:
        print(f"# bench/tenants.py {' '.join(sys.argv[1:])}")
        print("| K tenants | one tenant, K sequences | K tenants, 1 sequence each | ratio | "
              "slowest / fastest tenant |")
        print("|---:|---:|---:|---:|---:|")
        for k in ks:
            one, many, spread = run(target, keys, k, args)
            print(f"| {k} | {one:.0f} tokens/s | {many:.0f} tokens/s | {many / one:.2f} | "
                  f"{spread:.2f} |", flush=True)
    finally:
        process.terminate()
        process.wait(60)
        os.unlink(f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
