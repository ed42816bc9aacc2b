#!/usr/bin/python3
"""The PyTorch-eager baseline of bench/fwd_bwd_bench: the same model, batch and training step.

Reads the model that fwd_bwd_bench wrote (config.json + safetensors, parsed here by hand so nothing
beyond Debian's python3-torch and python3-numpy is needed) and its batch file, builds the same
Llama architecture with frozen base weights and LoRA adapters, and trains step for step with the
runner's loss and optimizer:

  loss  = sum over every token of -log p(target) / total tokens of the step
  optim = torch.optim.AdamW(lr 1e-4, betas (0.9, 0.95), eps 1e-12, weight_decay 0)

Two ways to lay out micro-batches under the same token budget (--micro_batch_tokens):

  padded  sequences in the given order, greedily grouped while count * longest <= budget, right-
          padded to the longest of the group; attention with a causal + key-padding mask, logits
          and loss over every position with padding ignored (what a plain HF-style loop does).
  packed  sequences in the given order, greedily concatenated while the sum of lengths <= budget;
          linears run over the packed tokens, attention runs per sequence (matmul + softmax: 1.13
          has no scaled_dot_product_attention, and a block-diagonal mask over the whole pack would
          spend budget² work on masked-out blocks).

A sequence longer than the budget always forms a micro-batch alone, as in the runner.

Prints human-readable lines and one JSON line (starts with '{') per run; tokens_per_s counts real,
unpadded tokens. The FLOP convention is bench/README.md's and matches fwd_bwd_bench.cc.

Use Debian's interpreter: /usr/bin/python3 bench/torch_eager.py --model_dir ... --batch ...
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

import numpy as np

# The same OpenMP wait policy tinkerd runs with (runner/util/cpu_environment.h), set before
# torch loads libgomp, so that the comparison measures the code, not the threads' spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Loading.


def _to_tensor(raw, dtype, shape):
    """A safetensors payload as a float32 tensor (the compute dtype of the benchmark)."""
    if dtype == "F32":
        arr = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F16":
        arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        # bfloat16 is the top half of a float32: widen by shifting the bits up.
        arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"unsupported safetensors dtype {dtype}")
    return torch.from_numpy(arr.copy()).reshape(shape)


def load_safetensors_file(path):
    """safetensors: u64 LE header length, a JSON header {name: {dtype, shape, data_offsets}}, then
    the data block; offsets are relative to the start of the data block."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = _to_tensor(blob[base + begin : base + end], info["dtype"], info["shape"])
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: load each shard named in the weight map once
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_safetensors_file(os.path.join(model_dir, name)))
    return weights


def load_batch(path):
    """fwd_bwd_bench's batch file: magic 'TKDBATCH', int64 version (1), int64 count, then per
    sequence int64 L, L int64 tokens, L int64 targets; all little-endian."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != b"TKDBATCH":
        raise ValueError(f"{path}: not a fwd_bwd_bench batch file")
    words = np.frombuffer(blob, dtype="<i8", offset=8)
    version, count = int(words[0]), int(words[1])
    if version != 1:
        raise ValueError(f"{path}: unsupported batch version {version}")
    seqs, pos = [], 2
    for _ in range(count):
        n = int(words[pos])
        tokens = torch.from_numpy(words[pos + 1 : pos + 1 + n].astype(np.int64))
        targets = torch.from_numpy(words[pos + 1 + n : pos + 1 + 2 * n].astype(np.int64))
        seqs.append((tokens, targets))
        pos += 1 + 2 * n
    if pos != len(words):
        raise ValueError(f"{path}: {len(words) - pos} trailing words")
    return seqs


# ----------------------------------------------------------------------------------------------
# Model.


class LoRALinear(torch.nn.Module):
    """y = x Wᵀ + (alpha/r) · (x Aᵀ) Bᵀ with W frozen, A random and B zero (so step 0 is the base
    model). The scale multiplies the rank-r intermediate, not the d_out output: same result,
    fewer element-wise FLOPs."""

    def __init__(self, weight, rank, alpha, generator):
        super().__init__()
        out_f, in_f = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        bound = 1.0 / math.sqrt(in_f)
        self.lora_a = torch.nn.Parameter(
            torch.empty(rank, in_f).uniform_(-bound, bound, generator=generator)
        )
        self.lora_b = torch.nn.Parameter(torch.zeros(out_f, rank))
        self.scale = alpha / rank

    def forward(self, x):
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.lora_a) * self.scale, self.lora_b)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Llama(torch.nn.Module):
    def __init__(self, cfg, weights, rank, alpha, seed):
        super().__init__()
        for key, want in (("attention_bias", False), ("tie_word_embeddings", False)):
            if bool(cfg.get(key, False)) != want:
                raise ValueError(f"torch_eager.py supports only {key}={want}")
        if cfg.get("rope_scaling") or cfg.get("model_type", "llama") not in ("llama", "mixtral"):
            raise ValueError("torch_eager.py supports plain Llama and Mixtral (no rope_scaling)")
        if cfg.get("model_type") == "mixtral" and cfg.get("sliding_window"):
            raise ValueError("torch_eager.py supports Mixtral without a sliding window")
        self.experts = cfg.get("num_local_experts", 8) if cfg.get("model_type") == "mixtral" else 0
        self.top_k = cfg.get("num_experts_per_tok", 2)
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.layers = cfg["num_hidden_layers"]
        gen = torch.Generator().manual_seed(seed)

        def frozen(name):
            return torch.nn.Parameter(weights.pop(name), requires_grad=False)

        self.embed = frozen("model.embed_tokens.weight")
        self.final_norm = frozen("model.norm.weight")
        self.lm_head = frozen("lm_head.weight")
        self.blocks = torch.nn.ModuleList()
        for i in range(self.layers):
            p = f"model.layers.{i}."
            block = torch.nn.Module()
            block.input_norm = frozen(p + "input_layernorm.weight")
            block.post_norm = frozen(p + "post_attention_layernorm.weight")
            for proj in ("q", "k", "v", "o"):
                w = weights.pop(p + f"self_attn.{proj}_proj.weight")
                setattr(block, proj, LoRALinear(w, rank, alpha, gen))
            if self.experts:
                # Mixtral's layout: a router and per-expert w1 (gate), w3 (up), w2 (down), each
                # expert with its own adapters, as PEFT puts them on per-expert linears.
                block.router = frozen(p + "block_sparse_moe.gate.weight")
                block.experts = torch.nn.ModuleList()
                for e in range(self.experts):
                    expert = torch.nn.Module()
                    for proj, name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                        w = weights.pop(p + f"block_sparse_moe.experts.{e}.{name}.weight")
                        setattr(expert, proj, LoRALinear(w, rank, alpha, gen))
                    block.experts.append(expert)
            else:
                for proj in ("gate", "up", "down"):
                    w = weights.pop(p + f"mlp.{proj}_proj.weight")
                    setattr(block, proj, LoRALinear(w, rank, alpha, gen))
            self.blocks.append(block)

        # RoPE tables, HF convention: inv_freq over even dims, both halves share a frequency.
        theta = cfg.get("rope_theta", 10000.0)
        max_pos = cfg.get("max_position_embeddings", 2048)
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def lora_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def attend(self, q, k, v, mask):
        """q [B, L, H, hd], k/v [B, L, Hkv, hd], additive mask [B or 1, 1, g·L, L] -> [B, L, H·hd].

        GQA without copying K/V per query head: the g query heads of one KV head are stacked along
        the row axis ([Hkv, g·L, hd]), so one batched matmul per KV head serves all g of them."""
        b, n, _, hd = q.shape
        g = self.heads // self.kv_heads
        q = (q * (1.0 / math.sqrt(hd))).transpose(1, 2).reshape(b, self.kv_heads, g * n, hd)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) + mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # [B, Hkv, g·L, hd]
        return out.reshape(b, self.heads, n, hd).transpose(1, 2).reshape(b, n, self.heads * hd)

    def forward(self, input_ids, positions, attention):
        """input_ids [B, L]; positions [B or 1, L]; attention(q, k, v) -> [B, L, H·hd]."""
        b, n = input_ids.shape
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(2)  # [B or 1, L, 1, hd], broadcast over heads
        sin = self.sin[positions].unsqueeze(2)
        for blk in self.blocks:
            x = rms_norm(h, blk.input_norm, self.eps)
            q = blk.q(x).view(b, n, self.heads, self.head_dim)
            k = blk.k(x).view(b, n, self.kv_heads, self.head_dim)
            v = blk.v(x).view(b, n, self.kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            h = h + blk.o(attention(q, k, v))
            x = rms_norm(h, blk.post_norm, self.eps)
            h = h + (self.routed(blk, x) if self.experts else blk.down(F.silu(blk.gate(x)) * blk.up(x)))
        return F.linear(rms_norm(h, self.final_norm, self.eps), self.lm_head)

    def routed(self, blk, x):
        """Hugging Face's sparse MoE block: softmax router in fp32, top-k renormalized, then a
        Python loop over the experts that got tokens, each over its own rows (index_add back)."""
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(F.linear(flat, blk.router), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        mask = F.one_hot(chosen, num_classes=self.experts).permute(2, 1, 0)  # [E, k, N]
        for e in range(self.experts):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            rows = flat[token]
            ex = blk.experts[e]
            y = ex.down(F.silu(ex.gate(rows)) * ex.up(rows)) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(x.shape)


# ----------------------------------------------------------------------------------------------
# Micro-batches. Built once, before timing: a training loop's data loader would have them ready.

NEG = torch.finfo(torch.float32).min  # HF's additive mask value: exp() is 0, no inf - inf NaN


def causal_mask(n, g):
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    add = torch.zeros(n, n).masked_fill(~allowed, NEG)
    return add.repeat(g, 1).view(1, 1, g * n, n)  # rows follow the [g, L] stacking of attend()


def group(lengths, budget, cost):
    """Greedy, in the given order: a new micro-batch starts when adding the next sequence would
    make cost(group) exceed the budget; a sequence over budget on its own still runs alone."""
    groups, cur = [], []
    for i, n in enumerate(lengths):
        if cur and cost([lengths[j] for j in cur] + [n]) > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def make_padded(model, seqs, budget):
    g = model.heads // model.kv_heads
    lengths = [len(t) for t, _ in seqs]
    mbs, padded_tokens = [], 0
    for idx in group(lengths, budget, lambda ls: len(ls) * max(ls)):
        n = max(lengths[i] for i in idx)
        ids = torch.zeros(len(idx), n, dtype=torch.long)
        tgt = torch.full((len(idx), n), -100, dtype=torch.long)  # -100: ignored by cross_entropy
        valid = torch.zeros(len(idx), n, dtype=torch.bool)
        for r, i in enumerate(idx):
            t, y = seqs[i]
            ids[r, : len(t)] = t
            tgt[r, : len(t)] = y
            valid[r, : len(t)] = True
        # Causal AND key-is-real. With right padding a real query never sees a padded key anyway,
        # but the mask is what a generic padded implementation builds and pays for.
        allowed = torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0) & valid.unsqueeze(1)
        add = torch.zeros(len(idx), n, n).masked_fill(~allowed, NEG)
        mask = add.unsqueeze(1).expand(-1, g, -1, -1).reshape(len(idx), 1, g * n, n)
        positions = torch.arange(n).unsqueeze(0)

        def attention(q, k, v, mask=mask):
            return model.attend(q, k, v, mask)

        mbs.append((ids, positions, tgt.view(-1), attention))
        padded_tokens += len(idx) * n
    return mbs, padded_tokens


def make_packed(model, seqs, budget):
    g = model.heads // model.kv_heads
    lengths = [len(t) for t, _ in seqs]
    masks = {}
    mbs = []
    for idx in group(lengths, budget, sum):
        ids = torch.cat([seqs[i][0] for i in idx]).unsqueeze(0)
        tgt = torch.cat([seqs[i][1] for i in idx])
        positions = torch.cat([torch.arange(lengths[i]) for i in idx]).unsqueeze(0)  # restart per seq
        spans, start = [], 0
        for i in idx:
            n = lengths[i]
            if n not in masks:
                masks[n] = causal_mask(n, g)
            spans.append((start, start + n, masks[n]))
            start += n

        def attention(q, k, v, spans=spans):
            outs = [model.attend(q[:, s:e], k[:, s:e], v[:, s:e], m) for s, e, m in spans]
            return torch.cat(outs, dim=1)

        mbs.append((ids, positions, tgt, attention))
    return mbs, sum(lengths)


# ----------------------------------------------------------------------------------------------
# Measurement.


def matmul_gflops(n, reps):
    """Best-of-k fp32 n×n·n×n rate on this thread count: the MFU denominator, as in the C++."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def count_flops(cfg, rank, lengths):
    """bench/README.md's convention, identical to CountFlops in fwd_bwd_bench.cc."""
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // heads
    q, kv = heads * hd, cfg.get("num_key_value_heads", heads) * hd
    # A mixture of experts counts what a token uses: its top_k experts and the router.
    experts = cfg.get("num_local_experts", 8) if cfg.get("model_type") == "mixtral" else 0
    e_all, k = max(experts, 1), (cfg.get("num_experts_per_tok", 2) if experts else 1)
    attn_linear, router = d * q + 2 * d * kv + q * d, experts * d
    per_layer = attn_linear + k * 3 * d * inter + router
    matmul_params = layers * per_layer + vocab * d
    total_params = (vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
                    + layers * (attn_linear + e_all * 3 * d * inter + router + 2 * d) + d)
    attn_lora, mlp_lora = (d + q) + 2 * (d + kv) + (q + d), 2 * (d + inter) + (inter + d)
    lora_params = layers * rank * (attn_lora + e_all * mlp_lora)
    active_lora = layers * rank * (attn_lora + k * mlp_lora)
    tokens = sum(lengths)
    linear = 4.0 * matmul_params * tokens + 6.0 * active_lora * tokens
    attn = 12.0 * layers * q * sum(n * n for n in lengths)
    return dict(total_params=total_params, matmul_params=matmul_params, lora_params=lora_params,
                linear=linear, attn=attn, total=linear + attn)


def train_step(model, opt, mbs, total_tokens):
    """Gradient of Σ -log p / T accumulated over the micro-batches, then one AdamW step. Returns
    the step's mean token loss."""
    loss_sum = 0.0
    for ids, positions, tgt, attention in mbs:
        logits = model(ids, positions, attention)
        nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1), reduction="sum",
                              ignore_index=-100)
        (nll / total_tokens).backward()
        loss_sum += nll.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum / total_tokens


def run_mode(mode, args, cfg, model, seqs):
    lengths = [len(t) for t, _ in seqs]
    total_tokens = sum(lengths)
    make = make_padded if mode == "padded" else make_packed
    mbs, computed_tokens = make(model, seqs, args.micro_batch_tokens)
    opt = torch.optim.AdamW(model.lora_parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                            weight_decay=0.0)
    flops = count_flops(cfg, args.lora_rank, lengths)
    mm = matmul_gflops(args.matmul_n, args.matmul_reps)
    print(f"[{mode}] {len(seqs)} sequences, {total_tokens} tokens, {len(mbs)} micro-batches, "
          f"{computed_tokens} tokens computed incl. padding; matmul {mm:.1f} GFLOP/s on "
          f"{torch.get_num_threads()} threads", flush=True)
    times, first_loss = [], None
    for step in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, mbs, total_tokens)
        dt = time.perf_counter() - t0
        if first_loss is None:
            first_loss = loss  # B = 0: the base model's loss, comparable with the runner's
        timed = step >= args.warmup_steps
        if timed:
            times.append(dt)
        print(f"[{mode}] step {step}{'' if timed else ' (warm-up)'}: {dt:.3f} s loss {loss:.6f} "
              f"{total_tokens / dt:.0f} tokens/s", flush=True)
    mm = max(mm, matmul_gflops(args.matmul_n, args.matmul_reps))  # best seen in this run
    step_s = statistics.median(times)
    achieved = flops["total"] / step_s / 1e9
    summary = {
        "bench": "torch_eager", "mode": mode, "tokens_per_s": total_tokens / step_s,
        "step_s": step_s, "mfu": achieved / mm, "matmul_gflops": mm,
        "model_gflops_per_s": achieved, "params": flops["total_params"],
        "matmul_params": flops["matmul_params"], "lora_params": flops["lora_params"],
        "tokens_per_step": total_tokens, "computed_tokens_per_step": computed_tokens,
        "sequences": len(seqs), "micro_batches": len(mbs), "flops_per_step": flops["total"],
        "attn_flops_per_step": flops["attn"], "first_loss": first_loss,
        "threads": torch.get_num_threads(), "micro_batch_tokens": args.micro_batch_tokens,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "torch": torch.__version__,
    }
    print(f"[{mode}] median step {step_s:.3f} s: {total_tokens / step_s:.1f} tokens/s, "
          f"{achieved:.1f} model GFLOP/s = {100 * achieved / mm:.1f}% of {mm:.1f} GFLOP/s matmul")
    print(json.dumps(summary), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--mode", choices=["padded", "packed", "both"], default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro_batch_tokens", type=int, default=4096)
    ap.add_argument("--lora_rank", type=int, default=32)
    ap.add_argument("--lora_alpha", type=float, default=32.0)
    ap.add_argument("--warmup_steps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--matmul_n", type=int, default=2048)
    ap.add_argument("--matmul_reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="seed of the LoRA A matrices")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup_steps < 0:
        ap.error("need --steps >= 1 and --warmup_steps >= 0")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    seqs = load_batch(args.batch)
    weights = load_weights(args.model_dir)
    for mode in (["padded", "packed"] if args.mode == "both" else [args.mode]):
        # A fresh model per mode (same weights, same A): each mode starts from step 0.
        model = Llama(cfg, dict(weights), args.lora_rank, args.lora_alpha, args.seed)
        run_mode(mode, args, cfg, model, seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
