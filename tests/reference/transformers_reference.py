#!/usr/bin/env python3
"""tinkerd's logprobs against Hugging Face transformers' own models, in float64.

Hugging Face's code is the definition of what a model directory means: a config key tinkerd reads
differently (a RoPE threshold, a router's renormalization, a sliding window's edge) gives other
logprobs with no error. tests/numerics/model_reference_test.cc checks tinkerd against a reference
written in this repository, which shares its author's reading of each config; this checks both
readings against the library users' checkpoints come from.

For each case: a random model of one family, built and saved by transformers itself (its
config.json and safetensors as save_pretrained writes them, weights perturbed so that biases and
norms are not at their initial 0 and 1), then its float64 logprobs of a few token sequences by
transformers' eager forward. One tinkerd serves every case's directory as a base
(--compute_dtype=float64), and through the unmodified Tinker SDK:
  - the sampler's compute_logprobs, and
  - a fresh LoRA training client's forward (its adapter starts at zero, so it is the base)
must equal transformers' to within MAX_ULPS float32 ulps (the Tinker API's logprobs are float32).

Usage: transformers_reference.py TINKERD_BINARY   (tests/reference/run_reference_test.sh gets
the venv: tinker-cookbook's, which pins torch and transformers). Exit 0 when every case agreed.
TINKERD_REFERENCE_ONLY=name,name runs only those cases; TINKERD_REFERENCE_CONTROL=1 runs the
broken control alone (it must fail).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
import transformers

import tinker
from tinker import types

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

# Both sides compute in float64 from the same float32 weights, but transformers builds its RoPE
# tables in float32 whatever the model's dtype (inv_freq and position · inv_freq): the angle at
# position p carries an error up to p · 2^-24 · max inv_freq, 4e-6 rad at p = 63, which moves a
# logprob of magnitude ~5 by a few 1e-7 (measured here: at most 0.9 float32 ulps, with the next).
# The Tinker API carries logprobs as float32, so tinkerd's value arrives rounded to the nearest
# float32 (0.5 ulp). 4 float32 ulps (~2e-6 at |logprob| 5) bound both with room; a misread config
# moved them by ~2e4 ulps here (the control below).
MAX_ULPS = 4.0
VOCAB = 128


@dataclasses.dataclass
class Case:
    name: str
    config: Callable[[], transformers.PretrainedConfig]
    model: type
    # Token sequences whose logprobs are compared (each is also one training datum).
    lengths: tuple[int, ...] = (5, 24)


def llama(**kw: Any) -> transformers.LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def rope(rope_type: str, **kw: Any) -> dict:
    return {"rope_type": rope_type, "rope_theta": 10000.0, **kw}


CASES = [
    Case("llama_tied", lambda: llama(tie_word_embeddings=True), transformers.LlamaForCausalLM),
    Case("llama_linear_rope", lambda: llama(rope_parameters=rope("linear", factor=2.0)),
         transformers.LlamaForCausalLM),
    # Dynamic NTK scaling starts only once a sequence outgrows max_position_embeddings (16 here),
    # the context tinkerd serves: within it the frequencies are the plain ones. The config's
    # original_max_position_embeddings (8) is not what transformers reads for it; a reader that
    # took it as the threshold scales the 15-token sequence (the control below).
    Case("llama_dynamic_rope",
         lambda: llama(max_position_embeddings=16,
                       rope_parameters=rope("dynamic", factor=2.0,
                                            original_max_position_embeddings=8)),
         transformers.LlamaForCausalLM, lengths=(5, 15)),
    Case("llama_llama3_rope",
         lambda: llama(rope_parameters=rope("llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=16),
                       rope_theta=500000.0),
         transformers.LlamaForCausalLM, lengths=(5, 63)),
    Case("llama_yarn_rope",
         lambda: llama(rope_parameters=rope("yarn", factor=4.0,
                                            original_max_position_embeddings=16)),
         transformers.LlamaForCausalLM, lengths=(5, 63)),
    Case("mistral_sliding_window",
         lambda: transformers.MistralConfig(**{**llama().to_dict(), "sliding_window": 4,
                                               "model_type": "mistral"}),
         transformers.MistralForCausalLM),
    Case("qwen2_bias",
         lambda: transformers.Qwen2Config(**{**llama(tie_word_embeddings=True).to_dict(),
                                             "model_type": "qwen2"}),
         transformers.Qwen2ForCausalLM),
    Case("qwen3_qk_norm_head_dim",
         lambda: transformers.Qwen3Config(**{**llama().to_dict(), "head_dim": 24,
                                             "model_type": "qwen3"}),
         transformers.Qwen3ForCausalLM),
    Case("qwen3_moe",
         lambda: transformers.Qwen3MoeConfig(
             **{**llama().to_dict(), "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
         transformers.Qwen3MoeForCausalLM),
    Case("qwen2_moe_shared_expert",
         lambda: transformers.Qwen2MoeConfig(
             **{**llama().to_dict(), "model_type": "qwen2_moe", "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "mlp_only_layers": []}),
         transformers.Qwen2MoeForCausalLM),
    Case("mixtral",
         lambda: transformers.MixtralConfig(
             **{**llama().to_dict(), "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2}),
         transformers.MixtralForCausalLM),
]


def sequences(case: Case, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in case.lengths]


def build(case: Case, out: str, seed: int) -> None:
    """Writes a random model of the case's family, as transformers saves one."""
    torch.manual_seed(seed)
    config = case.config()
    config.dtype = torch.float32
    model = case.model(config).to(torch.float32)
    with torch.no_grad():
        # Off the initial point: biases 0 and norms 1 would pass a reader that drops them.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)


def reference_logprobs(out: str, case: Case, tokens: list[int]) -> list[float]:
    """transformers' float64 logprobs of tokens[1:] given the tokens before each."""
    # Loaded afresh for each sequence: dynamic RoPE keeps the longest length it has seen in the
    # module and would apply it to the next, shorter sequence.
    # Eager attention and experts: the fused kernels (grouped_mm) take no float64.
    routed = any(k in case.model.__name__ for k in ("Moe", "Mixtral"))
    kw = {"experts_implementation": "eager"} if routed else {}
    model = case.model.from_pretrained(out, dtype=torch.float64, attn_implementation="eager", **kw)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()


def start_server(binary: str, bases: dict[str, str], tmp: str) -> tuple[subprocess.Popen, str]:
    log_path = os.path.join(tmp, "tinkerd.log")
    args = [binary, "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0", "--compute_dtype=float64",
            f"--checkpoint_root={os.path.join(tmp, 'checkpoints')}"]
    args += [f"--base_model={name}={path}" for name, path in bases.items()]
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = re.search(r"^tinkerd http listening on port (\d+)$", f.read(), re.M)
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    with open(log_path) as f:
        sys.stderr.write(f.read())
    raise SystemExit("transformers_reference: tinkerd did not start (its log is above)")


def client(x: Any) -> Any:
    res = getattr(x, "result", None)
    return res(timeout=120) if callable(res) else x


def datum(tokens: list[int]) -> types.Datum:
    tgt = tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tgt, dtype="int64", shape=[len(tgt)]),
            "weights": types.TensorData(data=[1.0] * len(tgt), dtype="float32",
                                        shape=[len(tgt)]),
        })


def max_ulps(got: list[float], want: list[float]) -> float:
    """The largest |got − want| in float32 ulps of want (inf when the lengths differ)."""
    if len(got) != len(want):
        return math.inf
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    ulp = np.spacing(np.abs(w).astype(np.float32)).astype(np.float64)
    return float(np.max(np.abs(g - w) / ulp, initial=0.0))


def check(svc: Any, name: str, seqs: list[list[int]], want: list[list[float]]) -> list[str]:
    failures = []
    sampler = client(svc.create_sampling_client(base_model=name))
    for tokens, ref in zip(seqs, want):
        got = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=120)
        d = max_ulps(got[1:], ref) if got and got[0] is None else math.inf
        line = f"{name}: compute_logprobs of {len(tokens)} tokens, {d:.3g} float32 ulps apart"
        print(("ok   " if d <= MAX_ULPS else "FAIL ") + line, flush=True)
        if not d <= MAX_ULPS:
            failures.append(line)
    trainer = client(svc.create_lora_training_client(base_model=name, rank=4))
    out = trainer.forward([datum(t) for t in seqs], "cross_entropy").result(timeout=120)
    for tokens, ref, o in zip(seqs, want, out.loss_fn_outputs):
        d = max_ulps(list(o["logprobs"].data), ref)
        line = f"{name}: LoRA forward of {len(tokens)} tokens, {d:.3g} float32 ulps apart"
        print(("ok   " if d <= MAX_ULPS else "FAIL ") + line, flush=True)
        if not d <= MAX_ULPS:
            failures.append(line)
    return failures


def misread_copy(out: str, tmp: str) -> str:
    """The broken control's reference: the model directory with dynamic RoPE's threshold taken
    from original_max_position_embeddings (8) instead of max_position_embeddings (16), the reading
    tinkerd had before this check. transformers computes its logprobs; tinkerd serves the true
    directory, and the two must then disagree."""
    bad = os.path.join(tmp, "misread")
    shutil.copytree(out, bad)
    path = os.path.join(bad, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg["max_position_embeddings"] = cfg[key]["original_max_position_embeddings"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return bad


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary = sys.argv[1]
    control = os.environ.get("TINKERD_REFERENCE_CONTROL") == "1"
    only = [s for s in os.environ.get("TINKERD_REFERENCE_ONLY", "").split(",") if s]
    cases = [c for c in CASES if not only or c.name in only]
    if control:
        cases = [c for c in CASES if c.name == "llama_dynamic_rope"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tinker {tinker.__version__ if hasattr(tinker, '__version__') else '?'}", flush=True)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="tinkerd-reference.") as tmp:
        bases, want, seqs = {}, {}, {}
        for i, case in enumerate(cases):
            out = os.path.join(tmp, case.name)
            build(case, out, seed=100 + i)
            seqs[case.name] = sequences(case, seed=200 + i)
            ref_dir = misread_copy(out, tmp) if control else out
            want[case.name] = [reference_logprobs(ref_dir, case, t) for t in seqs[case.name]]
            bases[case.name] = out
        proc, url = start_server(binary, bases, tmp)
        failures = []
        try:
            svc = tinker.ServiceClient(base_url=url, api_key="tml-reference")
            for case in cases:
                failures += check(svc, case.name, seqs[case.name], want[case.name])
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if failures:
                with open(os.path.join(tmp, "tinkerd.log")) as f:
                    tail = f.read()[-4000:]
                sys.stderr.write("----- tinkerd log (tail) -----\n" + tail + "\n")
    if control:
        # The control must fail: a threshold of 8 moves the 15-token sequence's logprobs.
        if failures:
            print(f"control failed as it must ({len(failures)} mismatches)")
            return 0
        print("FAIL control: a misread dynamic RoPE threshold went unnoticed")
        return 1
    print(f"{len(failures)} mismatches" if failures else "every case agrees with transformers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
