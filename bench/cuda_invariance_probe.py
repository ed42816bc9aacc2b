#!/usr/bin/env python3
"""tinkerd CUDA batch-invariance probe (GEMM row invariance, GEMM timing,
SDPA prefill-vs-decode, row reductions).  torch only.  Writes $OUT/probe.txt."""
import os, sys, time, statistics, inspect, traceback, glob, ctypes

T0 = time.time()
BUDGET = float(os.environ.get("PROBE_BUDGET_S", "200"))
OUT = os.environ.get("OUT", "/tmp/probe_out")
os.makedirs(OUT, exist_ok=True)
_f = open(os.path.join(OUT, "probe.txt"), "w", buffering=1)


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    _f.write(s + "\n")


def elapsed():
    return time.time() - T0


def over(frac=1.0):
    return elapsed() > BUDGET * frac


import torch
import torch.nn.functional as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = DEV == "cpu"  # CPU dry-run: shrink shapes

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
DEFAULT_BF16_RPR = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction

log("=== env ===")
log("python", sys.version.split()[0], "torch", torch.__version__, "cuda(build)", torch.version.cuda,
    "device", DEV)
if DEV == "cuda":
    p = torch.cuda.get_device_properties(0)
    log("gpu", torch.cuda.get_device_name(0), "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
        "mem_GiB", round(p.total_memory / 2**30, 1))
    try:
        log("cudnn", torch.backends.cudnn.version())
    except Exception as e:
        log("cudnn ?", e)
    # cuBLAS version via ctypes on whatever libcublas the process loaded / can find
    try:
        torch.mm(torch.ones(2, 2, device=DEV), torch.ones(2, 2, device=DEV))
        torch.cuda.synchronize()
        cands = []
        with open("/proc/self/maps") as m:
            for line in m:
                if "libcublas.so" in line and "Lt" not in line:
                    cands.append(line.split()[-1])
        cands = sorted(set(cands)) or glob.glob("/usr/local/lib/python3*/*-packages/nvidia/cu*/lib/libcublas.so*") + \
            glob.glob("/usr/local/cuda/lib64/libcublas.so*")
        for c in cands[:1]:
            lib = ctypes.CDLL(c)
            v = []
            for k in range(3):
                x = ctypes.c_int()
                lib.cublasGetProperty(k, ctypes.byref(x))
                v.append(x.value)
            log("cublas", ".".join(map(str, v)), "from", c)
        if not cands:
            log("cublas: lib not found")
    except Exception as e:
        log("cublas version ?", repr(e))
log("allow_tf32", torch.backends.cuda.matmul.allow_tf32, "default allow_bf16_reduced_precision_reduction",
    DEFAULT_BF16_RPR)
try:
    log("preferred_blas_library", torch.backends.cuda.preferred_blas_library())
except Exception as e:
    log("preferred_blas_library ?", e)

torch.manual_seed(1234)


def bits(t):
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        return t.contiguous().view(torch.int16)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    raise ValueError(t.dtype)


def rowdiff(a, b):
    """(#rows differing bitwise, max abs diff) for 2-D a,b (or 1-D: per element)."""
    if a.dim() == 1:
        a = a[:, None]
        b = b[:, None]
    d = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(-1)
    n = int(d.sum())
    mad = float((a.float() - b.float()).abs().max()) if n else 0.0
    return n, mad


def fmt(n, mad, rows):
    return "EQ" if n == 0 else f"{n}/{rows}rows(max{mad:.2g})"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ item 1
def item1():
    log("\n=== 1. GEMM row invariance: y_M = x[:M] @ W.T vs rows of y_full (M=4096) ===")
    log("cells: EQ = all M rows bitwise equal; else differing rows/M (max abs diff)")
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (151936, 1024)]
    Ms = [1, 2, 3, 8, 16, 64, 100, 128, 1000, 1024]
    Mfull = 4096
    if QUICK:
        shapes = [(256, 128), (512, 256)]
        Ms = [1, 2, 8, 64, 100]
        Mfull = 512
    configs = [("bf16", torch.bfloat16, DEFAULT_BF16_RPR, None),
               ("bf16", torch.bfloat16, not DEFAULT_BF16_RPR, None),
               ("fp32", torch.float32, DEFAULT_BF16_RPR, None)]
    if DEV == "cuda":
        configs.append(("bf16", torch.bfloat16, DEFAULT_BF16_RPR, "cublaslt"))
    tile = 1024 if not QUICK else 256
    for name, dt, rpr, blas in configs:
        if over(0.45):
            log("(item1: skipping remaining configs, time)")
            break
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = rpr
        prev_blas = None
        if blas:
            try:
                prev_blas = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library(blas)
            except Exception as e:
                log("cannot set blas", blas, e)
                continue
        log(f"\n-- {name}  bf16_reduced_precision_reduction={rpr}  blas={blas or 'default'}")
        hdr = "W(out,in)      op     " + " ".join(f"M={m:<5}" for m in Ms)
        log(hdr)
        for (o, i) in shapes:
            if blas and (o, i) not in [(4096, 4096), (151936, 1024)]:
                continue
            g = torch.Generator(device=DEV).manual_seed(o * 7 + i)
            W = (torch.randn(o, i, device=DEV, generator=g) * (1.0 / i ** 0.5)).to(dt)
            x = torch.randn(Mfull, i, device=DEV, generator=g).to(dt)
            y_full = torch.mm(x, W.t())
            y_full2 = torch.mm(x, W.t())
            rerun = rowdiff(y_full, y_full2)[0]
            for opname, op in [("mm", lambda a: torch.mm(a, W.t())), ("linear", lambda a: F.linear(a, W))]:
                cells = []
                for M in Ms:
                    yM = op(x[:M])
                    n, mad = rowdiff(yM, y_full[:M])
                    cells.append(f"{('EQ' if n == 0 else f'{n}/{M}'):<7}")
                log(f"{str((o, i)):<14} {opname:<6} " + " ".join(cells) + (f"  [rerun-M{Mfull} diff rows {rerun}]" if opname == "mm" else ""))
            # also with bias (addmm -> often cublasLt epilogue): compare x[:M]@W.T+b vs full
            b = torch.randn(o, device=DEV, generator=g).to(dt)
            yb_full = F.linear(x, W, b)
            cells = []
            for M in Ms:
                n, _ = rowdiff(F.linear(x[:M], W, b), yb_full[:M])
                cells.append(f"{('EQ' if n == 0 else f'{n}/{M}'):<7}")
            log(f"{str((o, i)):<14} {'lin+b':<6} " + " ".join(cells))
            # fixed tile tests
            A = x[:tile]
            yA = torch.mm(A, W.t())
            res = []
            for M in [1, 8, 64, 100, 1000] if not QUICK else [1, 8, 100]:
                xp = torch.zeros(tile, i, device=DEV, dtype=dt)
                xp[:M] = x[:M]
                n, mad = rowdiff(torch.mm(xp, W.t())[:M], yA[:M])
                res.append(f"padM{M}:{fmt(n, mad, M)}")
            # rows of A placed at random positions in a tile B filled with other random rows
            B = torch.randn(tile, i, device=DEV, generator=g).to(dt)
            k = 64
            idx = torch.randperm(tile, device="cpu", generator=torch.Generator().manual_seed(5))[:k].to(DEV)
            B[idx] = A[:k]
            n, mad = rowdiff(torch.mm(B, W.t())[idx], yA[:k])
            res.append(f"permuted64:{fmt(n, mad, k)}")
            # tile vs full (= M=tile column above, repeated for clarity)
            n, mad = rowdiff(yA, y_full[:tile])
            res.append(f"tile_vs_M{Mfull}:{fmt(n, mad, tile)}")
            log(f"{'':<14} tile{tile}: " + "  ".join(res))
            del W, x, y_full, y_full2, yb_full, yA, B
        if DEV == "cuda":
            torch.cuda.empty_cache()
        if blas and prev_blas is not None:
            torch.backends.cuda.preferred_blas_library(prev_blas)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = DEFAULT_BF16_RPR


# ------------------------------------------------------------------ item 2
def timeit(fn, warm=5, reps=20):
    for _ in range(warm):
        fn()
    sync()
    if DEV != "cuda":
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    ts = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def item2():
    log("\n=== 2. timing bf16 (median of 20, CUDA events, ms): plain mm at M vs zero-padded 1024-row tile ===")
    tile = 1024 if not QUICK else 256
    shapes = [(4096, 4096), (14336, 4096)] if not QUICK else [(256, 128)]
    dt = torch.bfloat16
    log(f"{'W(out,in)':<14} {'M':>4} {'plain':>9} {'tile(pre-padded)':>17} {'pad+tile':>9} {'ratio tile/plain':>17} {'ratio pad+tile/plain':>21}")
    for (o, i) in shapes:
        W = (torch.randn(o, i, device=DEV) * 0.02).to(dt)
        x = torch.randn(tile, i, device=DEV).to(dt)
        buf = torch.zeros(tile, i, device=DEV, dtype=dt)
        outb = torch.empty(tile, o, device=DEV, dtype=dt)
        t_tile = timeit(lambda: torch.mm(buf, W.t(), out=outb))
        for M in [1, 8, 64]:
            xm = x[:M].contiguous()
            outm = torch.empty(M, o, device=DEV, dtype=dt)
            t_plain = timeit(lambda: torch.mm(xm, W.t(), out=outm))

            def padmm():
                buf[:M].copy_(xm)
                torch.mm(buf, W.t(), out=outb)
            t_pad = timeit(padmm)
            log(f"{str((o, i)):<14} {M:>4} {t_plain:>9.4f} {t_tile:>17.4f} {t_pad:>9.4f} {t_tile / t_plain:>17.2f} {t_pad / t_plain:>21.2f}")
        xf = torch.randn(4096 if not QUICK else 512, i, device=DEV).to(dt)
        log(f"{str((o, i)):<14} ref M=4096 plain mm: {timeit(lambda: torch.mm(xf, W.t())):.4f} ms")
        del W, x, buf, outb, xf


# ------------------------------------------------------------------ item 3
def item3():
    from torch.nn.attention import sdpa_kernel, SDPBackend
    log("\n=== 3. attention: SDPA prefill (causal) row L-1 vs decode (1 query vs L keys, non-causal) ===")
    backs = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("math", SDPBackend.MATH)]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backs.append(("cudnn", SDPBackend.CUDNN_ATTENTION))
    Ls = [64, 300, 1024, 2048] if not QUICK else [64, 300]
    D = 128
    Lmax = max(Ls)

    def run(bk, q, k, v, causal, gqa=False):
        with sdpa_kernel([bk]):
            kw = {"enable_gqa": True} if gqa else {}
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

    for dname, dt in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        for hq, hkv in [(8, 8), (32, 8)]:
            gqa = hq != hkv
            g = torch.Generator(device=DEV).manual_seed(77 + hq)
            Q = torch.randn(1, hq, Lmax, D, device=DEV, generator=g).to(dt)
            K = torch.randn(1, hkv, Lmax, D, device=DEV, generator=g).to(dt)
            V = torch.randn(1, hkv, Lmax, D, device=DEV, generator=g).to(dt)
            log(f"\n-- {dname} Hq={hq} Hkv={hkv} D={D}   cells: decode==prefill[L-1]  |  prefill_L[p]==prefill_(p+1)[p] for p in P")
            for bname, bk in backs:
                if over(0.8):
                    log("(item3: time)"); return
                if bname == "flash" and dt == torch.float32:
                    continue
                line = []
                for L in Ls:
                    q = Q[:, :, :L].contiguous(); k = K[:, :, :L].contiguous(); v = V[:, :, :L].contiguous()
                    try:
                        pre = run(bk, q, k, v, True, gqa)
                        dec = run(bk, q[:, :, L - 1:L].contiguous(), k, v, False, gqa)
                    except Exception as e:
                        line.append(f"L={L}:unsupported({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                        break
                    n, mad = rowdiff(dec[0, :, 0, :], pre[0, :, L - 1, :])
                    cell = f"L={L}: dec{'EQ' if n == 0 else f'NE(heads {n}/{hq}, max{mad:.2g})'}"
                    ps = sorted({p for p in [0, 1, 63, 64, 127, 128, 255, L // 2, L - 2] if 0 <= p < L - 1})
                    bad = []
                    for p in ps:
                        try:
                            pre2 = run(bk, q[:, :, :p + 1].contiguous(), k[:, :, :p + 1].contiguous(),
                                       v[:, :, :p + 1].contiguous(), True, gqa)
                        except Exception as e:
                            bad.append(f"{p}(err {type(e).__name__})")
                            continue
                        n2, mad2 = rowdiff(pre[0, :, p, :], pre2[0, :, p, :])
                        if n2:
                            bad.append(f"{p}({mad2:.2g})")
                    cell += f" rowvsLen:{'EQ' if not bad else 'NE@' + ','.join(bad)}/{len(ps)}p"
                    line.append(cell)
                log(f"{bname:<9} " + " ; ".join(line))
            del Q, K, V

    # varlen flash via aten._flash_attention_forward (what LibTorch can call directly)
    log("\n-- varlen flash (aten._flash_attention_forward with cum_seq), bf16 H=8 D=128")
    if DEV != "cuda":
        log("skip (cpu)"); return
    try:
        dt = torch.bfloat16
        H = 8
        lens = [64, 300, 1024, 2048]
        T = sum(lens)
        g = torch.Generator(device=DEV).manual_seed(99)
        q = torch.randn(T, H, D, device=DEV, generator=g).to(dt)
        k = torch.randn(T, H, D, device=DEV, generator=g).to(dt)
        v = torch.randn(T, H, D, device=DEV, generator=g).to(dt)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=DEV, dtype=torch.int32)

        def fa(q_, k_, v_, cuq, cuk, mq, mk, causal):
            return torch.ops.aten._flash_attention_forward(q_, k_, v_, cuq, cuk, mq, mk, 0.0, causal, False)[0]

        packed = fa(q, k, v, cu, cu, max(lens), max(lens), True)
        for si, L in enumerate(lens):
            s0 = int(cu[si]); s1 = s0 + L
            one = torch.tensor([0, L], device=DEV, dtype=torch.int32)
            single = fa(q[s0:s1].contiguous(), k[s0:s1].contiguous(), v[s0:s1].contiguous(), one, one, L, L, True)
            n_pk, mad_pk = rowdiff(packed[s0:s1].reshape(L, -1), single.reshape(L, -1))
            dq = torch.tensor([0, 1], device=DEV, dtype=torch.int32)
            dec = fa(q[s1 - 1:s1].contiguous(), k[s0:s1].contiguous(), v[s0:s1].contiguous(), dq, one, 1, L, False)
            n_dec, mad_dec = rowdiff(dec.reshape(1, -1), packed[s1 - 1:s1].reshape(1, -1))
            # dense SDPA flash prefill of this sequence
            from torch.nn.attention import sdpa_kernel, SDPBackend
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                dense = F.scaled_dot_product_attention(q[s0:s1].transpose(0, 1)[None], k[s0:s1].transpose(0, 1)[None],
                                                       v[s0:s1].transpose(0, 1)[None], is_causal=True)
                ddec = F.scaled_dot_product_attention(q[s1 - 1:s1].transpose(0, 1)[None], k[s0:s1].transpose(0, 1)[None],
                                                      v[s0:s1].transpose(0, 1)[None], is_causal=False)
            dense_r = dense[0].transpose(0, 1)
            n_dn, mad_dn = rowdiff(dense_r.reshape(L, -1), packed[s0:s1].reshape(L, -1))
            n_dd, mad_dd = rowdiff(ddec[0].transpose(0, 1).reshape(1, -1), packed[s1 - 1:s1].reshape(1, -1))
            # batched decode: several sequences' last tokens in one varlen call
            log(f"L={L}: packed-vs-single {fmt(n_pk, mad_pk, L)} | varlen-decode-vs-packed[L-1] {fmt(n_dec, mad_dec, 1)}"
                f" | denseSDPAflash-prefill-vs-packed {fmt(n_dn, mad_dn, L)} | denseSDPAflash-decode-vs-packed[L-1] {fmt(n_dd, mad_dd, 1)}")
        # batched decode of all 4 sequences' last tokens in one call
        lastidx = (cu[1:] - 1).long()
        dq = torch.arange(0, len(lens) + 1, device=DEV, dtype=torch.int32)
        bdec = fa(q[lastidx].contiguous(), k, v, dq, cu, 1, max(lens), False)
        n, mad = rowdiff(bdec.reshape(len(lens), -1), packed[lastidx].reshape(len(lens), -1))
        log(f"batched varlen decode (4 seqs) vs packed prefill last rows: {fmt(n, mad, len(lens))}")
        # is decode itself invariant to batching (batched vs single decode)?
        singles = []
        for si, L in enumerate(lens):
            s0 = int(cu[si]); s1 = s0 + L
            one = torch.tensor([0, L], device=DEV, dtype=torch.int32)
            singles.append(fa(q[s1 - 1:s1].contiguous(), k[s0:s1].contiguous(), v[s0:s1].contiguous(),
                              torch.tensor([0, 1], device=DEV, dtype=torch.int32), one, 1, L, False))
        n, mad = rowdiff(bdec.reshape(len(lens), -1), torch.cat(singles).reshape(len(lens), -1))
        log(f"batched varlen decode vs single-seq decode: {fmt(n, mad, len(lens))}")
        # decode written as a 'prefill chunk' of the last 1 token with causal=True (bottom-right aligned in flash)
        res = []
        for si, L in enumerate(lens):
            s0 = int(cu[si]); s1 = s0 + L
            one = torch.tensor([0, L], device=DEV, dtype=torch.int32)
            d2 = fa(q[s1 - 1:s1].contiguous(), k[s0:s1].contiguous(), v[s0:s1].contiguous(),
                    torch.tensor([0, 1], device=DEV, dtype=torch.int32), one, 1, L, True)
            n, mad = rowdiff(d2.reshape(1, -1), packed[s1 - 1:s1].reshape(1, -1))
            res.append(f"L={L}:{fmt(n, mad, 1)}")
        log("varlen decode with causal=True (bottom-right) vs packed: " + " ".join(res))
    except Exception as e:
        log("varlen flash failed:", repr(e)[:300])
        traceback.print_exc()


# ------------------------------------------------------------------ item 4
def item4():
    log("\n=== 4. row reductions: result of rows [:R] computed alone vs rows of the R=4096 computation ===")
    Rs = [1, 8, 64, 1024, 4096] if not QUICK else [1, 8, 64]
    Rfull = 4096 if not QUICK else 64
    N = 4096 if not QUICK else 256
    V = 151936 if not QUICK else 1000
    g = torch.Generator(device=DEV).manual_seed(4)
    xs = torch.randn(Rfull, N, device=DEV, generator=g)
    for dname, dt in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        x = xs.to(dt)
        full = x.float().pow(2).mean(-1)
        cells = [f"R={R}:{'EQ' if rowdiff(x[:R].float().pow(2).mean(-1), full[:R])[0] == 0 else 'NE'}" for R in Rs]
        log(f"{dname} x.float().pow(2).mean(-1) [R,{N}]: " + " ".join(cells))
        if hasattr(F, "rms_norm"):
            w = torch.randn(N, device=DEV, generator=g).to(dt)
            fulln = F.rms_norm(x, (N,), w, 1e-6)
            cells = []
            for R in Rs:
                n, mad = rowdiff(F.rms_norm(x[:R], (N,), w, 1e-6), fulln[:R])
                cells.append(f"R={R}:{fmt(n, mad, R)}")
            log(f"{dname} F.rms_norm [R,{N}]: " + " ".join(cells))
    lg = torch.randn(Rfull, V, device=DEV, generator=g) * 3
    for dname, L in [("fp32", lg), ("bf16->fp32", lg.to(torch.bfloat16).float())]:
        full = torch.logsumexp(L, -1)
        fls = torch.log_softmax(L, -1)
        c1, c2 = [], []
        for R in Rs:
            n, mad = rowdiff(torch.logsumexp(L[:R], -1), full[:R]); c1.append(f"R={R}:{fmt(n, mad, R)}")
            n, mad = rowdiff(torch.log_softmax(L[:R], -1), fls[:R]); c2.append(f"R={R}:{fmt(n, mad, R)}")
        log(f"{dname} logsumexp [R,{V}]: " + " ".join(c1))
        log(f"{dname} log_softmax [R,{V}]: " + " ".join(c2))
        # gathered logprob = logits[t] - logsumexp vs log_softmax gather
        tgt = torch.randint(0, V, (Rfull,), device=DEV, generator=g)
        a = L.gather(1, tgt[:, None])[:, 0] - full
        b = fls.gather(1, tgt[:, None])[:, 0]
        n, mad = rowdiff(a, b)
        log(f"{dname} logits[t]-logsumexp vs log_softmax[t] (same R): {fmt(n, mad, Rfull)}")
        del fls
    del lg


for name, fn in [("item1", item1), ("item4", item4), ("item3", item3), ("item2", item2)]:
    if over(0.95):
        log(f"({name} skipped: time budget)")
        continue
    t = time.time()
    try:
        fn()
    except Exception as e:
        log(f"{name} FAILED: {repr(e)[:400]}")
        traceback.print_exc()
    log(f"[{name} took {time.time() - t:.1f}s, total {elapsed():.1f}s]")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = DEFAULT_BF16_RPR
log("done, total %.1fs" % elapsed())
_f.close()
