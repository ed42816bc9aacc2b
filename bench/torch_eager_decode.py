#!/usr/bin/python3
"""The PyTorch-eager baseline of bench/sample_bench: greedy decode with a KV cache, same model,
prompts and thread count.

Reads the model and prompts.json that sample_bench wrote. A batch of B prompts (all of one length)
is prefilled in one causal forward, then decoded one token per step for every sample at once:

  cache   keys and values per layer, preallocated [B, Hkv, P + max_tokens, hd] and written in
          place at each step (no per-step concatenation);
  step    embed the B last tokens, RoPE at their position, attention of each query against the
          cached keys (GQA: the g query heads of a KV head in one matmul), MLP, final norm, the
          LM head, log_softmax (a sampler reports each token's logprob) and argmax.

decode tokens/s = B * (max_tokens - 1) / (T(max_tokens) - T(1)), as in sample_bench: the prefill and
the first token it yields are not counted. Steady decode tokens/s = B * (max_tokens - 2) / the time
after the first decode step's token, timed directly (no prefill's variance in it), also as there.
Prints readable lines and one JSON line.

Use Debian's interpreter: /usr/bin/python3 bench/torch_eager_decode.py --out_dir /tmp/tinkerd_sample
"""

import argparse
import json
import math
import os
import statistics
import sys
import time


# The same OpenMP wait policy tinkerd runs with (runner/util/cpu_environment.h), set before
# torch loads libgomp, so that the comparison measures the code, not the threads' spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_eager import load_weights, rms_norm, rotate_half  # noqa: E402


class Decoder:
    def __init__(self, cfg, w):
        if cfg.get("rope_scaling") or cfg.get("attention_bias") or cfg.get("tie_word_embeddings"):
            raise ValueError("torch_eager_decode.py supports plain untied Llama")
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w["lm_head.weight"]
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            self.layers.append(
                {k: w[p + n] for k, n in (
                    ("in", "input_layernorm.weight"), ("post", "post_attention_layernorm.weight"),
                    ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                    ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                    ("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"),
                    ("down", "mlp.down_proj.weight"))})
        theta = cfg.get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        freqs = torch.outer(torch.arange(cfg["max_position_embeddings"], dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().float(), emb.sin().float()

    def forward(self, ids, start, caches):
        """ids [B, L] at positions start..start+L-1; writes their K/V into caches; returns the
        last position's logits [B, V]."""
        b, n = ids.shape
        g = self.heads // self.kv_heads
        end = start + n
        cos = self.cos[start:end].view(1, n, 1, self.hd)
        sin = self.sin[start:end].view(1, n, 1, self.hd)
        if n > 1:  # the prompt: causal among its own positions (the cache is empty before it)
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf")).repeat(g, 1)
        h = F.embedding(ids, self.embed)
        for L, (kc, vc) in zip(self.layers, caches):
            x = rms_norm(h, L["in"], self.eps)
            q = F.linear(x, L["q"]).view(b, n, self.heads, self.hd)
            k = F.linear(x, L["k"]).view(b, n, self.kv_heads, self.hd)
            v = F.linear(x, L["v"]).view(b, n, self.kv_heads, self.hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kc[:, :, start:end] = k.transpose(1, 2)
            vc[:, :, start:end] = v.transpose(1, 2)
            qg = (q * (1.0 / math.sqrt(self.hd))).transpose(1, 2).reshape(b, self.kv_heads, g * n, self.hd)
            scores = torch.matmul(qg, kc[:, :, :end].transpose(-1, -2))
            if n > 1:
                scores = scores + mask
            out = torch.matmul(torch.softmax(scores, dim=-1), vc[:, :, :end])
            out = out.reshape(b, self.heads, n, self.hd).transpose(1, 2).reshape(b, n, -1)
            h = h + F.linear(out, L["o"])
            x = rms_norm(h, L["post"], self.eps)
            h = h + F.linear(F.silu(F.linear(x, L["gate"])) * F.linear(x, L["up"]), L["down"])
        return F.linear(rms_norm(h[:, -1], self.norm, self.eps), self.lm_head)

    def generate(self, prompts, max_tokens, marks=None):
        """Greedy; returns the tokens [B, max_tokens] and their logprobs. `marks`, when given, gets
        the time after the first decode step's token is chosen, as sample_bench's steady timing."""
        ids = torch.tensor(prompts, dtype=torch.long)
        b, p = ids.shape
        caches = [(torch.empty(b, self.kv_heads, p + max_tokens, self.hd),
                   torch.empty(b, self.kv_heads, p + max_tokens, self.hd)) for _ in self.layers]
        tokens, logprobs = [], []
        logits = self.forward(ids, 0, caches)
        for t in range(max_tokens):
            logp = torch.log_softmax(logits, dim=-1)
            nxt = torch.argmax(logp, dim=-1)
            tokens.append(nxt)
            logprobs.append(logp.gather(1, nxt.unsqueeze(1)))
            if t == 1 and marks is not None:
                marks.append(time.perf_counter())
            if t + 1 < max_tokens:
                logits = self.forward(nxt.unsqueeze(1), p + t, caches)
        return torch.stack(tokens, dim=1), torch.cat(logprobs, dim=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="/tmp/tinkerd_sample")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = os.path.join(args.out_dir, "model")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model = Decoder(cfg, load_weights(model_dir))
    with open(os.path.join(args.out_dir, "prompts.json")) as f:
        data = json.load(f)
    prompts = data["prompts"]
    result = {"threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
              "decode_tokens_per_s": {}, "steady_decode_tokens_per_s": {},
              "greedy_tokens": {}}
    with torch.no_grad():
        model.generate(prompts[:1], 4)  # warm-up
        for b in (int(x) for x in args.batches.split(",")):
            one, full, steady = [], [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                model.generate(prompts[:b], 1)
                one.append(time.perf_counter() - t0)
                marks = []
                t0 = time.perf_counter()
                tokens, _ = model.generate(prompts[:b], args.max_tokens, marks)
                t1 = time.perf_counter()
                full.append(t1 - t0)
                steady.append(t1 - marks[0])
            s = statistics.median(full) - statistics.median(one)
            tps = b * (args.max_tokens - 1) / s
            steady_tps = b * (args.max_tokens - 2) / statistics.median(steady)
            print(f"  batch {b:3d}: {tps:8.1f} tokens/s (prefill + first token "
                  f"{statistics.median(one):.3f} s, all {statistics.median(full):.3f} s); "
                  f"steps after the first: {steady_tps:.1f} tokens/s")
            result["decode_tokens_per_s"][str(b)] = tps
            result["steady_decode_tokens_per_s"][str(b)] = steady_tps
            result["greedy_tokens"][str(b)] = tokens[0].tolist()
        ttft = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            model.generate([data["long_prompt"]], 1)
            ttft.append(time.perf_counter() - t0)
        result["ttft_s"] = statistics.median(ttft)
        print(f"time to first token, {len(data['long_prompt'])}-token prompt: {result['ttft_s']:.3f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
