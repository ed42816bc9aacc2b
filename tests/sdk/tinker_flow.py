#!/usr/bin/env python3
"""End-to-end check of tinkerd's Tinker HTTP API with the unmodified, public Tinker Python SDK.

Runs against a live server (tests/sdk/run_sdk_test.sh starts one). Environment:
  TINKER_BASE_URL        http://127.0.0.1:PORT of `tinkerd --http_listen`
  TINKER_API_KEY         a key of tenant A ("alice")
  TINKERD_OTHER_API_KEY  a key of another tenant B ("bob"), for the isolation checks
  TINKERD_CHECKPOINT_ROOT the server's --checkpoint_root, to compare downloaded archives with
  TINKER_TELEMETRY=0     recommended (the SDK's telemetry is not under test here)
Optional:
  TINKER_FLOW_ONLY=a,b,h run only these checks (and what they depend on is then missing: they skip)
  TINKER_FLOW_VOCAB=N    token ids used are < N (default 256; the embedded default model has 512)
  TINKER_FLOW_LR=x       learning rate of the SFT check (default 1e-2)
  TINKER_FLOW_TIMEOUT=s  per-check timeout in seconds (default 300)
  TINKERD_PEEK_BYTES=N   the server's --http_peek_bytes (default 1 MiB, as the server's)
  TINKERD_FLOW_TOKENIZER=1 the base model has a tokenizer (run_sdk_test.sh serves one that does):
                         check t runs get_tokenizer() and stop strings
  TINKERD_FLOW_TEACHER=NAME the server serves a second base model under NAME (run_sdk_test.sh
                         serves one, "teacher"): check x samples and trains on it

Only public SDK calls are used (`tinker.ServiceClient`, training/sampling clients, `tinker.types`),
plus raw HTTP through httpx (a dependency of the SDK) for the wire-level checks. Written to run with
SDK 0.25.0 and 0.38.0: where their APIs differ (0.38 returns futures of clients), `_client()` below
accepts both. Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from typing import Any, Callable

import httpx
import numpy as np

import tinker
from tinker import types

# Newer SDKs deprecate some calls used here (load_state, get_server_capabilities on ServiceClient);
# they still work, and the deprecation is not what is under test.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

SDK_VERSION = importlib.metadata.version("tinker")
BASE_URL = os.environ.get("TINKER_BASE_URL", "").rstrip("/")
API_KEY = os.environ.get("TINKER_API_KEY", "")
OTHER_API_KEY = os.environ.get("TINKERD_OTHER_API_KEY", "")
VOCAB = int(os.environ.get("TINKER_FLOW_VOCAB", "256"))
LR = float(os.environ.get("TINKER_FLOW_LR", "1e-2"))
CHECK_TIMEOUT = float(os.environ.get("TINKER_FLOW_TIMEOUT", "300"))
RESULT_TIMEOUT = 240.0  # one SDK future; below CHECK_TIMEOUT so a hang names the call

# Tolerances. Same weights and the same code path should be bit-identical; 1e-5 on float32
# log-probabilities of magnitude ~6 allows a few ulps from a different kernel or packing.
LP_TOL = 1e-5
# Logprobs of one datum computed in a different batch (other packing / micro-batches).
LP_TOL_XBATCH = 1e-4
LOSS_REL_TOL = 1e-4


# --------------------------------------------------------------------------------------------
# Tiny check framework: one line per assertion, a per-check timeout, dependencies between checks.


class CheckFailed(AssertionError):
    pass


class Skipped(Exception):
    pass


def ok(cond: Any, msg: str) -> None:
    """Asserts `cond`, printing `ok: msg` or raising with `msg`."""
    if not cond:
        raise CheckFailed(msg)
    print(f"    ok: {msg}", flush=True)


def note(msg: str) -> None:
    print(f"    .. {msg}", flush=True)


class State:
    """What checks hand to later checks."""

    def __init__(self) -> None:
        self.model_name: str | None = None
        self.svc: Any = None  # alice's ServiceClient
        self.tc: Any = None  # alice's TrainingClient
        self.model_id: str | None = None
        self.batch: list[types.Datum] | None = None
        self.ck1: str | None = None


S = State()
RESULTS: list[tuple[str, str, str]] = []  # (name, PASS|FAIL|SKIP, detail)


def run_check(name: str, title: str, fn: Callable[[], None], needs: tuple[str, ...] = (),
              timeout: float = CHECK_TIMEOUT) -> None:
    only = [x.strip() for x in os.environ.get("TINKER_FLOW_ONLY", "").split(",") if x.strip()]
    if only and name not in only:
        return
    failed_deps = [d for d in needs if not any(n == d and r == "PASS" for n, r, _ in RESULTS)]
    print(f"\n== [{name}] {title}", flush=True)
    if failed_deps:
        RESULTS.append((name, "SKIP", f"needs {','.join(failed_deps)}"))
        print(f"SKIP [{name}] needs check(s) {', '.join(failed_deps)} to pass first", flush=True)
        return
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            fn()
            outcome["r"] = ("PASS", "")
        except Skipped as e:
            outcome["r"] = ("SKIP", str(e))
        except BaseException as e:  # noqa: BLE001 - report everything, including SDK errors
            outcome["r"] = ("FAIL", f"{type(e).__name__}: {e}")
            outcome["tb"] = traceback.format_exc()

    start = time.monotonic()
    t = threading.Thread(target=body, name=f"check-{name}", daemon=True)
    t.start()
    t.join(timeout)
    took = time.monotonic() - start
    if t.is_alive():
        RESULTS.append((name, "FAIL", f"timed out after {timeout:.0f} s"))
        print(f"FAIL [{name}] timed out after {timeout:.0f} s; stack of the stuck check:", flush=True)
        frame = sys._current_frames().get(t.ident or -1)
        if frame is not None:
            print("".join(traceback.format_stack(frame)), flush=True)
        # The stuck thread still holds SDK clients other checks would share: stop here.
        finish(aborted=True)
    status, detail = outcome["r"]
    RESULTS.append((name, status, detail))
    if status == "FAIL":
        print(outcome.get("tb", ""), flush=True)
    print(f"{status} [{name}] ({took:.1f} s){' ' + detail if detail else ''}", flush=True)


def finish(aborted: bool = False) -> None:
    print("\n== summary (tinker SDK %s, %s)" % (SDK_VERSION, BASE_URL), flush=True)
    for name, status, detail in RESULTS:
        print(f"  {status:4} {name}{'  ' + detail if detail else ''}", flush=True)
    failed = [n for n, s, _ in RESULTS if s == "FAIL"]
    if aborted:
        print("  aborted: a check timed out", flush=True)
    print("RESULT: %s" % ("FAIL" if failed or aborted else "PASS"), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # The SDK keeps background threads (heartbeats, an event loop); do not wait for them.
    os._exit(1 if failed or aborted else 0)


# --------------------------------------------------------------------------------------------
# SDK helpers that work with 0.25 (methods return clients) and 0.38 (they return futures).


def _client(x: Any) -> Any:
    """A TrainingClient/SamplingClient from what create_* returned (the client or its future)."""
    res = getattr(x, "result", None)
    return res(timeout=RESULT_TIMEOUT) if callable(res) else x


def _res(fut: Any, timeout: float = RESULT_TIMEOUT) -> Any:
    return fut.result(timeout=timeout)


def service_client(api_key: str) -> Any:
    return tinker.ServiceClient(base_url=BASE_URL, api_key=api_key)


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    inp, tgt = tokens[:-1], tokens[1:]
    w = weights if weights is not None else [1.0] * len(tgt)
    assert len(w) == len(tgt)
    return types.Datum(
        model_input=types.ModelInput.from_ints(inp),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tgt, dtype="int64", shape=[len(tgt)]),
            "weights": types.TensorData(data=w, dtype="float32", shape=[len(w)]),
        },
    )


def sft_batch() -> list[types.Datum]:
    """8 datums cycling through one fixed 5-token pattern (learnable), with non-trivial weights."""
    pattern = [11, 47, 3, 29, 101]
    out = []
    for i in range(8):
        toks = [pattern[(i + j) % len(pattern)] for j in range(17)]
        w = [1.0] * 16
        w[0] = 0.0  # weights must be applied: this target counts nothing...
        w[1] = 0.5  # ...and this one half
        out.append(datum(toks, w))
    return out


def sft_batch2() -> list[types.Datum]:
    """Another learnable batch, whose gradient points elsewhere than sft_batch's: a step on it from
    restored Adam moments (dominated by sft_batch's history) and one from reset moments differ."""
    pattern = [200, 13, 77, 150, 5, 99, 42]
    return [datum([pattern[(3 * i + j) % len(pattern)] for j in range(13)]) for i in range(6)]


def logprobs(out: Any) -> list[np.ndarray]:
    """Per-datum logprobs (float64) of a ForwardBackwardOutput."""
    res = []
    for i, rec in enumerate(out.loss_fn_outputs):
        ok_ = "logprobs" in rec
        if not ok_:
            raise CheckFailed(f"loss_fn_outputs[{i}] has no 'logprobs' (keys {sorted(rec)})")
        res.append(np.asarray(rec["logprobs"].tolist(), dtype=np.float64).reshape(-1))
    return res


def weights_of(batch: list[types.Datum]) -> list[np.ndarray]:
    return [np.asarray(d.loss_fn_inputs["weights"].tolist(), dtype=np.float64) for d in batch]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.max(np.abs(x - y))) if len(x) else 0.0 for x, y in zip(a, b))


def expected_loss(batch: list[types.Datum], lps: list[np.ndarray]) -> float:
    """Tinker cross_entropy: loss = -sum(weights * logprobs) over tokens and datums, unnormalized."""
    return float(-sum(float(np.dot(w, lp)) for w, lp in zip(weights_of(batch), lps)))


def check_output_shape(batch: list[types.Datum], out: Any, what: str) -> list[np.ndarray]:
    ok(len(out.loss_fn_outputs) == len(batch),
       f"{what}: {len(out.loss_fn_outputs)} loss_fn_outputs for {len(batch)} datums")
    lps = logprobs(out)
    bad = [i for i, (d, lp) in enumerate(zip(batch, lps)) if len(lp) != d.model_input.length]
    ok(not bad, f"{what}: every datum's logprobs has len == its number of input tokens"
       + (f" (wrong at {bad[:5]}: {[len(lps[i]) for i in bad[:5]]} vs "
          f"{[batch[i].model_input.length for i in bad[:5]]})" if bad else ""))
    ok(all(np.all(np.isfinite(lp)) and np.all(lp <= 1e-6) for lp in lps),
       f"{what}: logprobs are finite and <= 0")
    return lps


def check_loss_sum(batch: list[types.Datum], out: Any, lps: list[np.ndarray], what: str) -> float:
    ok("loss:sum" in out.metrics, f"{what}: metrics has 'loss:sum' (metrics {sorted(out.metrics)})")
    got, want = float(out.metrics["loss:sum"]), expected_loss(batch, lps)
    ok(math.isfinite(got) and abs(got - want) <= LOSS_REL_TOL * max(1.0, abs(want)),
       f"{what}: loss:sum {got:.6f} == -sum(weights*logprobs) {want:.6f} (rel tol {LOSS_REL_TOL})")
    return got


def adam(lr: float) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


def train_step(tc: Any, batch: list[types.Datum], lr: float) -> tuple[Any, Any]:
    """forward_backward + optim_step submitted back to back (pipelined), then both results."""
    fb = tc.forward_backward(batch, "cross_entropy")
    op = tc.optim_step(adam(lr))
    return _res(fb), _res(op)


def forward_lps(tc: Any, batch: list[types.Datum], what: str) -> list[np.ndarray]:
    out = _res(tc.forward(batch, "cross_entropy"))
    return check_output_shape(batch, out, what)


# --------------------------------------------------------------------------------------------
# Raw HTTP.


def http(method: str, path: str, *, key: str | None = API_KEY, json_body: Any = None,
         content: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 60.0) -> httpx.Response:
    h = {"Content-Type": "application/json"} if (json_body is not None or content is not None) else {}
    if key is not None:
        h["X-API-Key"] = key
    h.update(headers or {})
    with httpx.Client(timeout=timeout) as c:
        return c.request(method, BASE_URL + path, json=json_body, content=content, headers=h)


def json_of(r: httpx.Response, what: str) -> Any:
    ok(r.content, f"{what}: HTTP {r.status_code} has a body")
    try:
        body = r.json()
    except ValueError:
        raise CheckFailed(f"{what}: body is not JSON: {r.text[:300]!r}") from None
    ctype = r.headers.get("content-type", "")
    ok(ctype.startswith("application/json"), f"{what}: Content-Type is application/json ({ctype!r})")
    return body


def expect_error(r: httpx.Response, status: int | tuple[int, ...], what: str,
                 need_detail: bool = False) -> Any:
    statuses = (status,) if isinstance(status, int) else status
    ok(r.status_code in statuses, f"{what}: HTTP {r.status_code} in {statuses} (body {r.text[:200]!r})")
    body = json_of(r, what)
    ok(isinstance(body, dict), f"{what}: the JSON body is an object")
    if need_detail:
        ok("detail" in body, f"{what}: the body has 'detail' ({body})")
    elif "detail" not in body:
        note(f"{what}: body has no 'detail' key: {body}")
    return body


def poll_future(request_id: str, what: str, key: str = API_KEY, deadline_s: float = 120) -> Any:
    """Raw retrieve_future loop as the SDK does it: try_again re-polls at once (the server long-polls),
    complete_metadata re-polls with allow_metadata_only=false. Returns the final JSON result."""
    deadline = time.monotonic() + deadline_s
    allow_meta = True
    polls = 0
    while time.monotonic() < deadline:
        polls += 1
        t0 = time.monotonic()
        r = http("POST", "/api/v1/retrieve_future", key=key,
                 json_body={"request_id": request_id, "allow_metadata_only": allow_meta},
                 timeout=45)
        if r.status_code == 408 or r.status_code >= 500:
            continue
        ok(r.status_code == 200, f"{what}: retrieve_future HTTP 200 (got {r.status_code} {r.text[:200]!r})")
        body = r.json()
        if isinstance(body, dict) and body.get("type") == "try_again":
            if time.monotonic() - t0 < 0.05 and polls > 200:
                raise CheckFailed(f"{what}: retrieve_future answers try_again without long-polling "
                                  f"({polls} polls): the SDK re-polls immediately, so it would spin")
            continue
        if isinstance(body, dict) and body.get("status") == "complete_metadata":
            allow_meta = False
            continue
        ok(not (isinstance(body, dict) and "error" in body),
           f"{what}: the future succeeded (body {str(body)[:200]})")
        return body
    raise CheckFailed(f"{what}: future {request_id} not done after {deadline_s:.0f} s")


# --------------------------------------------------------------------------------------------
# The checks.


def check_a() -> None:
    S.svc = service_client(API_KEY)
    caps = S.svc.get_server_capabilities()
    names = [m.model_name for m in caps.supported_models]
    ok(len(names) >= 1 and all(isinstance(n, str) and n for n in names),
       f"get_server_capabilities lists model(s) {names}")
    S.model_name = names[0]
    for m in caps.supported_models:
        if m.max_context_length is not None:
            ok(m.max_context_length >= 64, f"{m.model_name}: max_context_length {m.max_context_length}")
    S.tc = _client(S.svc.create_lora_training_client(base_model=S.model_name, rank=8, seed=1234))
    info = S.tc.get_info()
    S.model_id = str(info.model_id)
    ok(S.model_id and S.model_id == str(S.tc.model_id),
       f"get_info.model_id {S.model_id!r} == the training client's model_id")
    ok(info.lora_rank == 8, f"get_info.lora_rank == 8 (got {info.lora_rank})")
    ok(info.is_lora in (True, None), f"get_info.is_lora is true or absent (got {info.is_lora})")
    ok(info.model_data.model_name == S.model_name,
       f"get_info.model_data.model_name == {S.model_name!r} (got {info.model_data.model_name!r})")


def check_b() -> None:
    tc, S.batch = S.tc, sft_batch()
    losses = []
    for step in range(3):
        fb, op = train_step(tc, S.batch, LR)
        lps = check_output_shape(S.batch, fb, f"step {step + 1} forward_backward")
        losses.append(check_loss_sum(S.batch, fb, lps, f"step {step + 1}"))
        ok(isinstance(op.metrics, (dict, type(None))), f"step {step + 1} optim_step answered (metrics {op.metrics})")
    after = expected_loss(S.batch, forward_lps(tc, S.batch, "forward after 3 steps"))
    losses.append(after)
    note(f"loss:sum over the steps (lr {LR}): {[round(x, 4) for x in losses]}")
    ok(all(b < a for a, b in zip(losses, losses[1:])),
       f"the loss strictly decreases step over step: {[round(x, 4) for x in losses]}")
    ok(losses[-1] < losses[0] * 0.999, "the loss fell by more than 0.1% over 3 steps")


def check_c() -> None:
    tc, batch = S.tc, S.batch
    f1 = forward_lps(tc, batch, "forward #1")
    fb_out = _res(tc.forward_backward(batch, "cross_entropy"))
    fb = check_output_shape(batch, fb_out, "forward_backward")
    fwd_out = _res(tc.forward(batch, "cross_entropy"))
    f2 = check_output_shape(batch, fwd_out, "forward #2")
    d1 = max_diff(f1, fb)
    ok(d1 <= LP_TOL, f"forward == forward_backward logprobs (same weights): max |diff| {d1:.3g} <= {LP_TOL}")
    d2 = max_diff(f1, f2)
    ok(d2 <= LP_TOL, f"forward leaves the model unchanged (and so does forward_backward without "
       f"optim_step): max |diff| {d2:.3g}")
    check_loss_sum(batch, fwd_out, f2, "forward")
    # The forward_backward above left gradients accumulated; check d adds more, then steps.


def big_batch(n: int) -> list[types.Datum]:
    """n distinct short datums of lengths 3..8 input tokens, so misordered chunks are visible."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        length = 4 + i % 6
        toks = [int(x) for x in rng.integers(1, VOCAB, size=length)]
        out.append(datum(toks))
    return out


def check_d() -> None:
    tc = S.tc
    cfg = http("POST", "/api/v1/client/config", json_body={"sdk_version": SDK_VERSION}).json()
    chunk_len = int(cfg.get("fwdbwd_max_chunk_len", 1024))
    n = max(1100, min(chunk_len, 4000) + 77)
    batch = big_batch(n)
    note(f"{n} datums, fwdbwd_max_chunk_len {chunk_len}: the SDK sends "
         f"{math.ceil(n / chunk_len)} chunks at once, the first one last")
    t0 = time.monotonic()
    out = _res(tc.forward_backward(batch, "cross_entropy"))
    note(f"forward_backward of {n} datums took {time.monotonic() - t0:.1f} s")
    lps = check_output_shape(batch, out, f"chunked forward_backward")
    big_loss = check_loss_sum(batch, out, lps, "chunked forward_backward")
    # The same datums through separate, smaller forward calls (not aligned with the SDK's chunks):
    # each datum's logprobs must match the big call's, in order, and the losses must add up.
    sub_losses, sub_lps = [], []
    for lo in range(0, n, 400):
        part = batch[lo:lo + 400]
        o = _res(tc.forward(part, "cross_entropy"))
        p = check_output_shape(part, o, f"forward datums {lo}..{lo + len(part) - 1}")
        sub_losses.append(float(o.metrics["loss:sum"]))
        sub_lps.extend(p)
    d = max_diff(lps, sub_lps)
    ok(d <= LP_TOL_XBATCH, f"per-datum logprobs of the chunked call == separate forward calls, in "
       f"order: max |diff| {d:.3g} <= {LP_TOL_XBATCH}")
    total = sum(sub_losses)
    ok(abs(big_loss - total) <= LOSS_REL_TOL * max(1.0, abs(total)),
       f"loss:sum {big_loss:.4f} == sum of the separate forward calls' loss:sum {total:.4f}")
    # Apply the accumulated gradients (checks c and d): save/load need none pending.
    op = _res(tc.optim_step(adam(1e-3)))
    note(f"optim_step after the chunked call: metrics {op.metrics}")


def check_e() -> None:
    tc, batch = S.tc, S.batch
    saved = _res(tc.save_state("ck1"))
    S.ck1 = saved.path
    ok(isinstance(saved.path, str) and saved.path.startswith("tinker://"),
       f"save_state('ck1') -> {saved.path!r} is a tinker:// path")
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(saved.path)
    ok(parsed.checkpoint_type == "training" and parsed.checkpoint_id == "weights/ck1",
       f"the path has the form tinker://<run>/weights/ck1 (run {parsed.training_run_id!r})")
    ok(parsed.training_run_id == S.model_id,
       f"the run id in the path is the model id {S.model_id!r}")
    at_save = forward_lps(tc, batch, "forward right after save")

    # One more step (on another batch, so that the Adam moments matter): the weights change;
    # remember where that step leads.
    batch2 = sft_batch2()
    train_step(tc, batch2, LR)
    stepped_a = forward_lps(tc, batch, "forward after one more step")
    d = max_diff(at_save, stepped_a)
    ok(d > 100 * LP_TOL, f"that step changed the weights (max |diff| {d:.3g})")

    # load_state: weights only.
    r = _res(tc.load_state(S.ck1))
    note(f"load_state -> {r}")
    restored = forward_lps(tc, batch, "forward after load_state")
    d = max_diff(at_save, restored)
    ok(d <= LP_TOL, f"load_state restores the saved weights: max |diff| {d:.3g} <= {LP_TOL}")
    train_step(tc, batch2, LR)
    stepped_c = forward_lps(tc, batch, "forward after a step from reset moments")

    # load_state_with_optimizer: weights and Adam state, so the same step lands on the same weights.
    if not hasattr(tc, "load_state_with_optimizer"):
        note(f"SDK {SDK_VERSION} has no load_state_with_optimizer: not checked")
        return
    _res(tc.load_state_with_optimizer(S.ck1))
    restored2 = forward_lps(tc, batch, "forward after load_state_with_optimizer")
    d = max_diff(at_save, restored2)
    ok(d <= LP_TOL, f"load_state_with_optimizer restores the saved weights: max |diff| {d:.3g}")
    train_step(tc, batch2, LR)
    stepped_b = forward_lps(tc, batch, "forward after the step from restored moments")
    d = max_diff(stepped_a, stepped_b)
    ok(d <= LP_TOL_XBATCH, f"with the optimizer restored, the same step reproduces the same weights: "
       f"max |diff| {d:.3g} <= {LP_TOL_XBATCH}")
    # Reference for "Adam state starts from zero": a new client from the same checkpoint, weights
    # only, taking the same step.
    fresh = _client(S.svc.create_training_client_from_state(S.ck1))
    train_step(fresh, batch2, LR)
    stepped_fresh = forward_lps(fresh, batch, "new client from ck1 (weights only), after the step")
    d = max_diff(stepped_fresh, stepped_c)
    ok(d <= LP_TOL_XBATCH, f"load_state (weights only) starts Adam from zero, like a new client from "
       f"the checkpoint: the same step lands on the same weights (max |diff| {d:.3g})")
    d = max_diff(stepped_a, stepped_fresh)
    ok(d > 10 * LP_TOL_XBATCH, f"(the optimizer state matters for that step: restored vs reset moments "
       f"differ by max |diff| {d:.3g})")


def check_f() -> None:
    r = _res(S.tc.save_weights_for_sampler("sampler-1"))
    ok(isinstance(r.path, str) and r.path.startswith("tinker://") and "sampler_weights" in r.path,
       f"save_weights_for_sampler('sampler-1') -> {r.path!r} (tinker://, 'sampler_weights')")
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(r.path)
    ok(parsed.checkpoint_type == "sampler" and parsed.checkpoint_id == "sampler_weights/sampler-1",
       f"the path has the form tinker://<run>/sampler_weights/sampler-1")
    S.sampler_path = r.path  # type: ignore[attr-defined]


def check_r() -> None:
    """RestClient.get_checkpoint_archive_url: a URL on this server that downloads, without a key,
    the checkpoint's files as a tar archive, byte for byte what the server stored."""
    import io
    import tarfile
    rest = S.svc.create_rest_client()
    root = os.environ.get("TINKERD_CHECKPOINT_ROOT", "")
    for checkpoint_id, must_have in (("sampler_weights/sampler-1", "adapter_model.safetensors"),
                                     ("weights/ck1", "manifest.json")):
        what = f"archive of {checkpoint_id}"
        if hasattr(rest, "get_checkpoint_archive_url"):
            got = _res(rest.get_checkpoint_archive_url(S.model_id, checkpoint_id))
        else:  # SDK 0.38 dropped the call; the endpoint stays for the scripts of older ones
            body = json_of(http(
                "GET", f"/api/v1/training_runs/{S.model_id}/checkpoints/{checkpoint_id}/archive"),
                what)
            got = argparse.Namespace(url=body["url"],
                                     expires=datetime.datetime.fromisoformat(body["expires"]))
        ok(got.url.startswith(BASE_URL + "/api/v1/archives/"), f"{what}: URL on this server ({got.url})")
        left = (got.expires - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        ok(600 < left <= 900, f"{what}: expires in {left:.0f} s (15 minutes)")
        with httpx.Client(timeout=60) as c:
            r = c.get(got.url)  # no X-API-Key: the URL is the credential
        ok(r.status_code == 200, f"{what}: download HTTP {r.status_code} ({r.text[:200]!r})")
        ok(r.headers.get("content-type") == "application/x-tar", f"{what}: Content-Type application/x-tar")
        ok(int(r.headers.get("content-length", -1)) == len(r.content),
           f"{what}: {len(r.content)} bytes, as Content-Length says")
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        ok(must_have in members, f"{what}: holds {must_have} (members {sorted(members)})")
        if root:
            # The checkpoint's folder on disk (its name links to the committed version).
            import glob
            kind, name = checkpoint_id.split("/")
            links = glob.glob(os.path.join(root, "*", S.model_id, kind, name))
            ok(len(links) == 1, f"{what}: one stored checkpoint under the root ({links})")
            folder = os.path.realpath(links[0])
            stored = sorted(os.listdir(folder))
            ok(stored == sorted(members), f"{what}: every stored file is a member ({stored})")
            ok(all(open(os.path.join(folder, n), "rb").read() == data for n, data in members.items()),
               f"{what}: the members equal the stored files byte for byte")
        note(f"{what}: {len(members)} files, {len(r.content)} bytes")
    # The URL is a credential for one checkpoint: a changed token, another tenant, a bad path.
    with httpx.Client(timeout=60) as c:
        expect_error(c.get(got.url[:-1] + ("0" if got.url[-1] != "0" else "1")), 404,
                     "a token that was never given", need_detail=True)
    expect_error(http("GET", f"/api/v1/training_runs/{S.model_id}/checkpoints/weights/ck1/archive",
                      key=OTHER_API_KEY), 404, "bob asks for alice's archive", need_detail=True)
    expect_error(http("GET", f"/api/v1/training_runs/{S.model_id}/checkpoints/weights/nope/archive"),
                 404, "an archive of a checkpoint that does not exist", need_detail=True)
    expect_error(http("GET", f"/api/v1/training_runs/{S.model_id}/checkpoints/weights/..%2f..%2fx/archive"),
                 (400, 404), "an archive of a path outside the checkpoints", need_detail=True)


def sample(sc: Any, prompt: list[int], params: types.SamplingParams, n: int = 1, **kw: Any) -> Any:
    return _res(sc.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=n,
                          sampling_params=params, **kw))


def raises_promptly(fn: Callable[[], Any], what: str, within_s: float = 60) -> BaseException:
    """Runs fn in a thread; it must raise (not hang in the SDK's retries) within `within_s`."""
    outcome: "queue.Queue[tuple[str, Any]]" = queue.Queue()

    def attempt() -> None:
        try:
            outcome.put(("returned", fn()))
        except BaseException as e:  # noqa: BLE001
            outcome.put(("raised", e))

    threading.Thread(target=attempt, daemon=True).start()
    try:
        kind, val = outcome.get(timeout=within_s)
    except queue.Empty:
        raise CheckFailed(f"{what}: neither failed nor succeeded within {within_s:.0f} s") from None
    ok(kind == "raised", f"{what}: the SDK raises ({type(val).__name__}: {str(val)[:160]})")
    return val


def check_s() -> None:
    tc = S.tc
    sc = _client(tc.save_weights_and_get_sampling_client())
    ok(sc.get_base_model() == S.model_name,
       f"save_weights_and_get_sampling_client: get_base_model() == {S.model_name!r}")
    prompt = [11, 47, 3, 29]
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    res = sample(sc, prompt, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3)
    ok(len(res.sequences) == 1, f"one sequence for num_samples=1 ({len(res.sequences)})")
    seq = res.sequences[0]
    # SDKs that know /api/v1/retrieve_futures (0.38) use it, as client/config asks: the sample
    # above was then awaited through the session's one long poll.
    if hasattr(sc, "_futures_poller"):
        ok(sc._futures_poller is not None,
           "the SDK learned that its sample finished from retrieve_futures")
    toks, lps = list(seq.tokens), np.asarray(seq.logprobs, dtype=np.float64)
    ok(len(toks) == 6 and len(lps) == 6 and seq.stop_reason == "length",
       f"greedy: 6 tokens, 6 logprobs, stop_reason 'length' ({toks}, {seq.stop_reason})")
    # The sampler's logprobs are the trainer's: Forward over prompt + sample gives the same numbers.
    full = prompt + toks
    fwd = forward_lps(tc, [datum(full)], "forward over prompt + sampled tokens")[0]
    d = float(np.max(np.abs(fwd[len(prompt) - 1:] - lps)))
    ok(d <= LP_TOL_XBATCH, f"sampled tokens' logprobs == forward's: max |diff| {d:.3g}")
    pl = res.prompt_logprobs
    ok(pl is not None and len(pl) == len(prompt) and pl[0] is None,
       f"prompt_logprobs: {len(prompt)} entries, the first None ({pl})")
    d = max(abs(pl[i] - fwd[i - 1]) for i in range(1, len(prompt)))
    ok(d <= LP_TOL_XBATCH, f"prompt_logprobs == forward's: max |diff| {d:.3g}")
    tk = res.topk_prompt_logprobs
    ok(tk is not None and len(tk) == len(prompt) and tk[0] is None
       and all(len(r) == 3 for r in tk[1:]), f"topk_prompt_logprobs: None, then 3 per position")
    ok(all(r[0][1] >= r[1][1] >= r[2][1] and r[0][1] >= pl[i] - LP_TOL for i, r in
           enumerate(tk) if r), "top-k rows are most likely first, the first >= the prompt token's")
    cl = _res(sc.compute_logprobs(types.ModelInput.from_ints(full)))
    d = max(abs(cl[i] - fwd[i - 1]) for i in range(1, len(full)))
    ok(cl[0] is None and len(cl) == len(full) and d <= LP_TOL_XBATCH,
       f"compute_logprobs(prompt + sample) == forward's: max |diff| {d:.3g}")
    # Greedy takes the most likely token: top-1 at each sampled position is the token taken.
    top1 = sample(sc, full, types.SamplingParams(max_tokens=1, temperature=0.0),
                  topk_prompt_logprobs=1).topk_prompt_logprobs
    ok([top1[i][0][0] for i in range(len(prompt), len(full))] == toks,
       "greedy: every sampled token is the argmax of its position")

    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
    a = [list(s.tokens) for s in sample(sc, prompt, seeded, n=4).sequences]
    b = [list(s.tokens) for s in sample(sc, prompt, seeded, n=4).sequences]
    ok(len(a) == 4 and a == b, f"the same seed gives the same 4 samples ({a[0]}...)")
    stop_at = toks[2]
    stopped = sample(sc, prompt, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                      stop=[stop_at])).sequences[0]
    ok(list(stopped.tokens) == toks[:toks.index(stop_at) + 1] and stopped.stop_reason == "stop",
       f"a stop token id ends the sample after it ({list(stopped.tokens)}, {stopped.stop_reason})")

    # The named export of check f holds these same weights: sampling it gives the same numbers.
    sc_path = _client(S.svc.create_sampling_client(model_path=S.sampler_path))
    res2 = sample(sc_path, prompt, greedy)
    d = float(np.max(np.abs(np.asarray(res2.sequences[0].logprobs) - lps)))
    ok(list(res2.sequences[0].tokens) == toks and d <= LP_TOL,
       f"create_sampling_client(model_path={S.sampler_path!r}) samples the same: max |diff| {d:.3g}")
    base = _client(S.svc.create_sampling_client(base_model=S.model_name))
    d = float(np.max(np.abs(np.asarray(sample(base, full, types.SamplingParams(
        max_tokens=1), include_prompt_logprobs=True).prompt_logprobs[1:]) - fwd)))
    ok(d > 100 * LP_TOL, f"the base model's sampler is another policy (max |diff| {d:.3g})")

    # A sampler is a snapshot: training on does not change it.
    train_step(tc, sft_batch(), LR)
    again = sample(sc, prompt, greedy).sequences[0]
    d = float(np.max(np.abs(np.asarray(again.logprobs) - lps)))
    ok(list(again.tokens) == toks and d == 0.0,
       f"after another training step the sampler answers exactly as before (max |diff| {d:.3g})")
    moved = _res(_client(tc.save_weights_and_get_sampling_client()).compute_logprobs(
        types.ModelInput.from_ints(full)))
    d = max(abs(moved[i] - cl[i]) for i in range(1, len(full)))
    ok(d > 100 * LP_TOL, f"while a new sampler sees the new weights (max |diff| {d:.3g})")

    # Errors reach the caller promptly, naming the field. A stop string is one when the base model
    # has no tokenizer (check t samples with them where it has one).
    if not os.environ.get("TINKERD_FLOW_TOKENIZER"):
        e = raises_promptly(lambda: sample(sc, prompt, types.SamplingParams(max_tokens=4, stop="\n")),
                            "stop strings (no tokenizer on the server)")
        ok("stop" in str(e), f"the error names sampling_params.stop")
    e = raises_promptly(lambda: sample(sc, [10**9], greedy), "a prompt token outside the vocabulary")
    ok("prompt" in str(e), "the error names the prompt")
    raises_promptly(lambda: _client(S.svc.create_sampling_client(
        model_path=f"tinker://{S.model_id}/sampler_weights/no-such-export")), "a missing export")
    if OTHER_API_KEY:
        # Tenant B cannot sample tenant A's sampler: unknown, like a made-up id.
        r = http("POST", "/api/v1/asample", key=OTHER_API_KEY, json_body={
            # The SDK has no public accessor for its sampling session id.
            "sampling_session_id": sc._sampling_session_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": 2}})
        rid = json_of(r, "tenant B's asample")["request_id"]
        body = http("POST", "/api/v1/retrieve_future", key=OTHER_API_KEY,
                    json_body={"request_id": rid, "allow_metadata_only": False}, timeout=45).json()
        ok("error" in body and "no sampler" in body["error"],
           f"tenant B's asample on tenant A's sampler fails: no sampler ({body})")
        r = http("GET", f"/api/v1/samplers/{sc._sampling_session_id}", key=OTHER_API_KEY)
        expect_error(r, 404, "tenant B's GET samplers/<A's>", need_detail=True)


def check_y() -> None:
    """SDK 0.38's inflight sampling clients (kind="inflight"): every inflight client of a model
    samples the weights of the model's latest inflight save, so an earlier client moves to a later
    save's weights; a snapshot client keeps its own."""
    import inspect
    if "kind" not in inspect.signature(S.tc.save_weights_and_get_sampling_client).parameters:
        ok(True, f"SDK {SDK_VERSION} has no inflight sampling clients (0.38 added them)")
        return
    tc = S.tc
    inp = types.ModelInput.from_ints(sft_batch()[0].model_input.to_ints())
    first = _client(tc.save_weights_and_get_sampling_client(kind="inflight"))
    snap = _client(tc.save_weights_and_get_sampling_client())
    before = _res(first.compute_logprobs(inp))
    ok(before == _res(snap.compute_logprobs(inp)),
       "an inflight client and a snapshot made at the same point agree bit for bit")
    train_step(tc, sft_batch(), LR)
    ok(_res(first.compute_logprobs(inp)) == before,
       "after a step, an inflight client keeps its weights until the next inflight save")
    second = _client(tc.save_weights_and_get_sampling_client(kind="inflight"))
    moved, new = _res(first.compute_logprobs(inp)), _res(second.compute_logprobs(inp))
    d = max(abs(moved[i] - before[i]) for i in range(1, len(before)))
    ok(moved == new and d > 100 * LP_TOL,
       f"the next inflight save moves the earlier inflight client to its weights, bit for bit as "
       f"the new client (max |diff| from before {d:.3g})")
    ok(_res(snap.compute_logprobs(inp)) == before, "a snapshot client keeps its weights")


def check_v() -> None:
    """SDK 0.38's scoring fields of a sample: prompt_logprobs_last_n, topk_sample_logprobs and
    target_prompt_logprobs (dense and sparse), each checked against the trainer's forward, and
    prompt_alt_tokens_k."""
    import inspect
    if "topk_sample_logprobs" not in inspect.signature(tinker.SamplingClient.sample).parameters:
        note(f"SDK {SDK_VERSION} has no 0.38 scoring fields: not checked")
        return
    tc = _client(S.svc.create_lora_training_client(base_model=S.model_name, rank=4, seed=3))
    train_step(tc, sft_batch(), LR)
    sc = _client(tc.save_weights_and_get_sampling_client())
    prompt = [11, 47, 3, 29, 101, 11, 47, 3]
    P, K, n = len(prompt), 2, 3
    ids = np.full((P - 1, K), -1, dtype=np.int64)
    ids[2:] = (np.arange(2, P - 1)[:, None] * 31 + np.arange(K)[None, :] * 7) % VOCAB
    ids[4, 1] = -1
    dense = types.TensorData(data=ids.reshape(-1).tolist(), dtype="int64", shape=[P - 1, K])
    res = sample(sc, prompt, types.SamplingParams(max_tokens=4, temperature=1.0, seed=5),
                 include_prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=3,
                 prompt_logprobs_last_n=n, target_prompt_logprobs=dense)
    seq = res.sequences[0]
    full = prompt + list(seq.tokens)
    fwd = forward_lps(tc, [datum(full)], "forward over prompt + sampled tokens")[0]
    pl, tk = res.prompt_logprobs, res.topk_prompt_logprobs
    ok(all(x is None for x in pl[:P - n]) and all(r is None for r in tk[:P - n]),
       f"prompt_logprobs_last_n={n}: the first {P - n} positions are None ({pl})")
    d = max(abs(pl[i] - fwd[i - 1]) for i in range(P - n, P))
    ok(d <= LP_TOL_XBATCH, f"the last {n} prompt logprobs == forward's: max |diff| {d:.3g}")
    rows = seq.topk_logprobs
    ok(rows is not None and len(rows) == len(seq.tokens) and all(len(r) == 3 for r in rows),
       f"topk_sample_logprobs=3: 3 (token, logprob) per sampled token")
    drawn = [dict(r).get(t) for r, t in zip(rows, seq.tokens)]
    ok(all(r[0][1] >= r[1][1] >= r[2][1] for r in rows) and all(
        lp is None or abs(lp - x) <= 1e-6 for lp, x in zip(drawn, seq.logprobs)),
       "rows are most likely first; a drawn token among them has its sampled logprob")
    # Forward with the ids as [P - 1, K] cross_entropy targets scores the same cells.
    tgt = np.maximum(ids, 0)
    topk = topk_datum(prompt[:-1], tgt, np.ones((P - 1, K), dtype=np.float32), sparse=False)
    want = np.asarray(_res(tc.forward([topk], "cross_entropy")).loss_fn_outputs[0]["logprobs"]
                      .to_numpy(), dtype=np.float64)
    want[ids == -1] = 0.0  # Tinker answers 0 where nothing was asked
    got = np.asarray(res.target_prompt_logprobs.to_numpy(), dtype=np.float64)
    ok(got.shape == (P - 1, K), f"target_prompt_logprobs is [{P - 1}, {K}] ({got.shape})")
    d = float(np.max(np.abs(got - want)))
    ok(d <= LP_TOL_XBATCH, f"target_prompt_logprobs == forward's top-K logprobs: max |diff| {d:.3g}")
    # Sparse: only the listed cells ask, and the answer lists the same cells.
    rows_, cols_ = np.nonzero(ids >= 0)
    crow = np.zeros(P, dtype=np.int64)
    np.add.at(crow, rows_ + 1, 1)
    sparse = types.TensorData(data=ids[rows_, cols_].tolist(), dtype="int64", shape=[P - 1, K],
                              sparse_crow_indices=np.cumsum(crow).tolist(),
                              sparse_col_indices=cols_.tolist())
    res2 = sample(sc, prompt, types.SamplingParams(max_tokens=1), target_prompt_logprobs=sparse)
    t = res2.target_prompt_logprobs
    ok(t.sparse_crow_indices == sparse.sparse_crow_indices
       and t.sparse_col_indices == sparse.sparse_col_indices,
       "a sparse request is answered sparse, in its own layout")
    d = float(np.max(np.abs(np.asarray(t.data, dtype=np.float64) - want[rows_, cols_])))
    ok(d <= LP_TOL_XBATCH, f"its values are the dense answer's cells: max |diff| {d:.3g}")
    # prompt_alt_tokens_k at temperature 0: every draw is the position's most likely token.
    alt = sample(sc, prompt, types.SamplingParams(max_tokens=1, temperature=0.0),
                 topk_prompt_logprobs=1, prompt_alt_tokens_k=2)
    pa = alt.prompt_alt_tokens
    toks = np.asarray(pa.tokens.to_numpy())
    lps = np.asarray(pa.logprobs.to_numpy(), dtype=np.float64)
    top1 = alt.topk_prompt_logprobs
    ok(toks.shape == (P - 1, 2) and all(
        int(toks[i, j]) == top1[i + 1][0][0] and abs(lps[i, j] - top1[i + 1][0][1]) <= 1e-6
        for i in range(P - 1) for j in range(2)),
       f"prompt_alt_tokens_k=2 greedy: [{P - 1}, 2] draws, each the position's top-1 token")

    # A copy of the sampling client (as a worker process unpickles it) joins the session for its
    # own request numbers, and samples what the original does.
    import pickle
    copy = pickle.loads(pickle.dumps(sc))
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    a, b = sample(sc, prompt, greedy).sequences[0], sample(copy, prompt, greedy).sequences[0]
    ok(list(a.tokens) == list(b.tokens), f"an unpickled copy samples as the original ({b.tokens})")
    ok(getattr(copy, "_cloned_sampler_id", None) == 1,
       f"the copy joined the session as its client 1 ({getattr(copy, '_cloned_sampler_id', None)})")
    sid = sc._sampling_session_id  # the SDK has no public accessor for it
    r = http("POST", "/api/v1/join_sampling_session", json_body={"sampling_session_id": sid})
    ok(json_of(r, "join_sampling_session").get("client_counter") == 2,
       f"the next join is client 2 ({r.text})")
    if OTHER_API_KEY:
        r = http("POST", "/api/v1/join_sampling_session", key=OTHER_API_KEY,
                 json_body={"sampling_session_id": sid})
        expect_error(r, 404, "another tenant's join_sampling_session", need_detail=True)


def check_u() -> None:
    rest = S.svc.create_rest_client()
    # Training runs, one a page: every run once, the flow's model among them.
    first = _res(rest.list_training_runs(limit=1, offset=0))
    total = first.cursor.total_count if first.cursor else -1
    ok(len(first.training_runs) == 1 and total >= 2,
       f"list_training_runs(limit=1): one run of {total}")
    ids = []
    for offset in range(total):
        ids += [r.training_run_id for r in _res(rest.list_training_runs(limit=1, offset=offset)).training_runs]
    ok(len(ids) == total == len(set(ids)) and S.model_id in ids,
       f"{total} pages of one hold every run once, the flow's model {S.model_id!r} among them")
    ok(_res(rest.list_training_runs(limit=5, offset=total)).training_runs == [],
       "a page past the end is empty")

    # The user's checkpoints, of every run, newest first, paged.
    listed = _res(rest.list_user_checkpoints(limit=100)).checkpoints
    paths = [c.tinker_path for c in listed]
    ok(S.ck1 in paths and S.sampler_path in paths,  # type: ignore[attr-defined]
       f"list_user_checkpoints lists ck1 and sampler-1 among {len(paths)}")
    times = [c.time for c in listed]
    ok(times == sorted(times, reverse=True), "newest first")
    paged = []
    for offset in range(len(paths)):
        paged += [c.tinker_path for c in _res(rest.list_user_checkpoints(limit=1, offset=offset)).checkpoints]
    ok(paged == paths, f"pages of one give the same {len(paths)} checkpoints in the same order")

    # Sessions: exactly one of alice's sessions made the flow's model; bob sees none of them.
    sessions = _res(rest.list_sessions(limit=100)).sessions
    made = [sid for sid in sessions if S.model_id in _res(rest.get_session(sid)).training_run_ids]
    ok(len(made) == 1, f"get_session: one of alice's {len(sessions)} sessions made the model")
    bob = service_client(OTHER_API_KEY).create_rest_client() if OTHER_API_KEY else None
    if bob is None:
        note("TINKERD_OTHER_API_KEY not set: isolation of listings not checked")
        return
    ok(not set(_res(bob.list_sessions(limit=100)).sessions) & set(sessions),
       "bob's list_sessions shows none of alice's sessions")
    ok(not set(c.tinker_path for c in _res(bob.list_user_checkpoints()).checkpoints) & set(paths),
       "bob's list_user_checkpoints shows none of alice's checkpoints")
    expect_error(http("GET", f"/api/v1/sessions/{made[0]}", key=OTHER_API_KEY), 404,
                 "bob's get_session of alice's session")


def check_p() -> None:
    # Over raw HTTP, as the SDK polls: allowed to, a server started with --http_peek_bytes=N
    # first announces a result of N bytes or more by its size; then the result comes whole.
    peek = int(os.environ.get("TINKERD_PEEK_BYTES", str(1 << 20)))
    sid = json_of(http("POST", "/api/v1/create_session",
                       json_body={"tags": [], "sdk_version": "raw", "type": "create_session"}),
                  "create_session")["session_id"]
    rid = json_of(http("POST", "/api/v1/create_model",
                       json_body={"session_id": sid, "model_seq_id": 0, "base_model": S.model_name,
                                  "lora_config": {"rank": 4}, "type": "create_model"}),
                  "create_model")["request_id"]

    def poll(allow: bool) -> httpx.Response:
        return http("POST", "/api/v1/retrieve_future", timeout=45,
                    json_body={"request_id": rid, "allow_metadata_only": allow})

    deadline = time.monotonic() + 120
    first = poll(True)
    while json_of(first, "retrieve_future").get("type") == "try_again" and time.monotonic() < deadline:
        first = poll(True)
    whole = poll(False)
    model_id = json_of(whole, "retrieve_future without the peek").get("model_id")
    ok(isinstance(model_id, str) and model_id, f"without the peek the result comes whole: {whole.text}")
    size = len(whole.content)
    if size >= peek:
        body = json_of(first, "the peek")
        ok(body == {"status": "complete_metadata", "response_payload_size": size},
           f"with the peek allowed, the {size}-byte result was announced by its size "
           f"(server threshold {peek} bytes): {body}")
    else:
        ok(first.content == whole.content,
           f"a result under the server's threshold ({peek} bytes) comes whole at once")
    json_of(http("POST", "/api/v1/unload_model", json_body={"model_id": model_id, "type": "unload_model"}),
            "unload_model")


def check_g() -> None:
    if not OTHER_API_KEY:
        raise Skipped("TINKERD_OTHER_API_KEY not set")
    # Raw: bob cannot see alice's model; alice can (positive control).
    body = {"model_id": S.model_id, "type": "get_info"}
    r = http("POST", "/api/v1/get_info", key=API_KEY, json_body=body)
    ok(r.status_code == 200 and r.json().get("model_id") == S.model_id,
       f"alice's get_info on her model: 200, model_id matches (HTTP {r.status_code})")
    expect_error(http("POST", "/api/v1/get_info", key=OTHER_API_KEY, json_body=body), 404,
                 "bob's get_info on alice's model")
    r = http("POST", "/api/v1/weights_info", key=API_KEY, json_body={"tinker_path": S.ck1})
    ok(r.status_code == 200, f"alice's weights_info on her checkpoint: HTTP 200 ({r.text[:200]!r})")
    wi = r.json()
    ok(wi.get("base_model") == S.model_name and wi.get("is_lora") is True and wi.get("lora_rank") == 8,
       f"weights_info: base_model {wi.get('base_model')!r}, is_lora {wi.get('is_lora')}, "
       f"lora_rank {wi.get('lora_rank')}")
    expect_error(http("POST", "/api/v1/weights_info", key=OTHER_API_KEY, json_body={"tinker_path": S.ck1}),
                 (403, 404), "bob's weights_info on alice's checkpoint")

    # SDK: bob's own training client cannot load alice's checkpoint, nor start from it.
    bob = service_client(OTHER_API_KEY)
    bob_tc = _client(bob.create_lora_training_client(base_model=S.model_name, rank=8, seed=5))
    ok(bob_tc.get_info().model_id != S.model_id, "bob got a model of his own")
    try:
        r = _res(bob_tc.load_state(S.ck1), 120)
        raise CheckFailed(f"bob's load_state of alice's checkpoint succeeded: {r}")
    except CheckFailed:
        raise
    except Exception as e:  # noqa: BLE001
        ok(True, f"bob's load_state of alice's checkpoint raises {type(e).__name__}: {str(e)[:160]}")
    try:
        c = _client(bob.create_training_client_from_state(S.ck1))
        raise CheckFailed(f"bob's create_training_client_from_state(alice's path) worked: {c.model_id}")
    except CheckFailed:
        raise
    except Exception as e:  # noqa: BLE001
        ok(True, f"bob's create_training_client_from_state(alice's path) raises "
           f"{type(e).__name__}: {str(e)[:160]}")
    # Alice's model is untouched by bob's attempts.
    ok(http("POST", "/api/v1/get_info", key=API_KEY, json_body=body).status_code == 200,
       "alice's model is still there")


def check_h() -> None:
    # Client config and capabilities, as the SDK reads them.
    try:  # `tinker auth login`'s check of a key (SDK 0.38's CLI)
        from tinker.cli.auth_api import SelfApiKeyResponse
    except ImportError:
        SelfApiKeyResponse = None
    if SelfApiKeyResponse is not None:
        me = SelfApiKeyResponse.model_validate(
            json_of(http("GET", "/api/v1/auth/apikey/me"), "auth/apikey/me"))
        ok(me.key_id >= 1 and me.name, f"auth/apikey/me parses as the CLI's SelfApiKeyResponse ({me})")
    r = http("POST", "/api/v1/client/config", json_body={"sdk_version": SDK_VERSION})
    ok(r.status_code == 200, f"client/config: HTTP 200 ({r.status_code})")
    cfg = json_of(r, "client/config")
    ok(cfg.get("use_pyqwest_transport") is False,
       f"client/config says use_pyqwest_transport: false ({cfg})")
    r = http("POST", "/api/v1/client/dynamic_config", json_body={"sdk_version": SDK_VERSION})
    ok(r.status_code == 200 and isinstance(json_of(r, "client/dynamic_config"), dict),
       f"client/dynamic_config: HTTP 200, a JSON object ({r.text[:200]})")
    r = http("GET", "/api/v1/get_server_capabilities")
    ok(r.status_code == 200, f"get_server_capabilities: HTTP 200 ({r.status_code})")
    models = [m.get("model_name") for m in json_of(r, "capabilities").get("supported_models", [])]
    ok(S.model_name is None or S.model_name in models, f"capabilities list {models}")
    model_name = S.model_name or models[0]

    # Errors: JSON bodies, the right codes.
    expect_error(http("POST", "/api/v1/definitely_not_an_endpoint", json_body={}), 404,
                 "unknown endpoint", need_detail=True)
    expect_error(http("GET", "/api/v1/definitely_not_an_endpoint"), 404, "unknown endpoint (GET)",
                 need_detail=True)
    expect_error(http("POST", "/api/v1/create_session", content=b'{"tags": [,,,'), 400,
                 "malformed JSON to create_session")
    good_session = {"tags": [], "user_metadata": {}, "sdk_version": SDK_VERSION, "type": "create_session"}
    expect_error(http("POST", "/api/v1/create_session", key=None, json_body=good_session), 401,
                 "create_session without X-API-Key")
    expect_error(http("POST", "/api/v1/create_session", key="tml-not-a-valid-key-0000",
                      json_body=good_session), 401, "create_session with an unknown key")
    expect_error(http("POST", "/api/v1/retrieve_future",
                      json_body={"request_id": "no-such-request-" + uuid.uuid4().hex,
                                 "allow_metadata_only": True}), 404,
                 "retrieve_future of an unknown request_id")

    # A whole model lifecycle in raw JSON: the response shapes the SDK validates.
    r = http("POST", "/api/v1/create_session", json_body=good_session)
    ok(r.status_code == 200, f"create_session: HTTP 200 ({r.text[:200]!r})")
    sid = json_of(r, "create_session").get("session_id")
    ok(isinstance(sid, str) and sid, f"create_session -> session_id {sid!r}")
    r = http("POST", "/api/v1/session_heartbeat", json_body={"session_id": sid, "type": "session_heartbeat"})
    ok(r.status_code == 200 and r.json().get("type", "session_heartbeat") == "session_heartbeat",
       f"session_heartbeat: HTTP 200 ({r.text[:100]!r})")
    tel = {"events": [{"event": "GENERIC_EVENT", "event_id": uuid.uuid4().hex, "event_name": "flow.test",
                       "event_session_index": 0, "severity": "INFO",
                       "timestamp": "2026-01-01T00:00:00Z", "event_data": {}}],
           "platform": sys.platform, "sdk_version": SDK_VERSION, "session_id": sid,
           "process_uuid": str(uuid.uuid4())}
    r = http("POST", "/api/v1/telemetry", json_body=tel)
    ok(r.status_code == 200 and r.json() == {"status": "accepted"},
       f"telemetry: exactly {{'status': 'accepted'}} ({r.status_code} {r.text[:100]!r})")
    create = {"session_id": sid, "model_seq_id": 0, "base_model": model_name,
              "lora_config": {"rank": 4, "seed": 3, "train_unembed": False, "train_mlp": True,
                              "train_attn": True},
              "type": "create_model"}
    r = http("POST", "/api/v1/create_model", json_body=create)
    ok(r.status_code == 200, f"create_model: HTTP 200 ({r.text[:200]!r})")
    fut = json_of(r, "create_model")
    ok(isinstance(fut.get("request_id"), str), f"create_model returns a future {fut}")
    res = poll_future(fut["request_id"], "create_model")
    mid = res.get("model_id")
    ok(isinstance(mid, str) and mid, f"create_model future -> model_id {mid!r}")
    again = poll_future(fut["request_id"], "create_model (second retrieval)")
    ok(again.get("model_id") == mid, "a finished future can be retrieved again, same result")
    r = http("POST", "/api/v1/create_model", json_body=create)
    if r.status_code == 200:
        dup = poll_future(r.json()["request_id"], "create_model resent")
        ok(dup.get("model_id") == mid, f"create_model resent with the same (session_id, model_seq_id) "
           f"is deduplicated: same model_id ({dup.get('model_id')!r})")
    else:
        ok(False, f"create_model resent (an SDK retry) must not fail: HTTP {r.status_code} {r.text[:200]!r}")
    r = http("POST", "/api/v1/get_info", json_body={"model_id": mid, "type": "get_info"})
    ok(r.status_code == 200, f"get_info: HTTP 200 ({r.text[:200]!r})")
    info = json_of(r, "get_info")
    ok(info.get("model_id") == mid and info.get("lora_rank") == 4
       and (info.get("model_data") or {}).get("model_name") == model_name,
       f"get_info: model_id, lora_rank 4, model_data.model_name ({info})")
    r = http("POST", "/api/v1/unload_model", json_body={"model_id": mid, "type": "unload_model"})
    ok(r.status_code == 200, f"unload_model: HTTP 200 ({r.text[:200]!r})")
    res = poll_future(json_of(r, "unload_model")["request_id"], "unload_model")
    ok(res.get("model_id") == mid, f"unload_model future -> {{'model_id': {mid!r}}} ({res})")
    expect_error(http("POST", "/api/v1/get_info", json_body={"model_id": mid, "type": "get_info"}), 404,
                 "get_info after unload_model")


def check_n() -> None:
    """sessions/search (SDK 0.38's RestClient.search_sessions): filters, paging, status, isolation."""
    if not hasattr(types, "SessionSearchRequest"):
        ok(True, f"SDK {SDK_VERSION} has no search_sessions (0.38 added it)")
        return
    tag = uuid.uuid4().hex[:8]
    clients = []
    for i, name in enumerate([f"Flow RL math {tag}", f"flow chat {tag}"]):
        svc = tinker.ServiceClient(user_metadata={"flow": tag, "i": str(i)}, display_name=name,
                                   base_url=BASE_URL, api_key=API_KEY)
        clients.append((svc, _client(svc.create_lora_training_client(
            base_model=S.model_name, rank=4, seed=i))))
    _res(clients[0][1].save_state(f"search-{tag}"))
    rest = clients[0][0].create_rest_client()
    Req = types.SessionSearchRequest

    def search(**kw: Any) -> Any:
        return _res(rest.search_sessions(Req(**kw)))

    page = search(display_name=f"rl MATH {tag}")
    ok(len(page.sessions) == 1 and page.sessions[0].display_name == f"Flow RL math {tag}"
       and page.sessions[0].user_metadata == {"flow": tag, "i": "0"}
       and page.sessions[0].status is not None and page.sessions[0].status.type == "active",
       f"display_name words match case-insensitively, one session ({page.sessions})")
    s0 = page.sessions[0]
    ok(s0.checkpoints_count == 1 and (s0.checkpoint_storage_bytes or 0) > 0,
       f"its saved state counts: {s0.checkpoints_count} checkpoint(s), "
       f"{s0.checkpoint_storage_bytes} bytes")
    first = search(user_metadata={"flow": tag}, limit=1)
    ok(len(first.sessions) == 1 and first.next_cursor is not None,
       f"limit 1 of 2: one session and a next_cursor ({first.next_cursor})")
    second = search(user_metadata={"flow": tag}, limit=1, cursor=first.next_cursor)
    ok(len(second.sessions) == 1 and second.next_cursor is None
       and second.sessions[0].session_id != first.sessions[0].session_id
       and first.sessions[0].created_at >= second.sessions[0].created_at,
       "the cursor's page holds the other, older session, and no further cursor")
    _res(clients[1][0].close("errored", detail="flow test"))
    # close(): "further operations against it will be rejected", its models' included; the other
    # session's model still trains (the control).
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}
    body = expect_error(http("POST", "/api/v1/optim_step",
                             json_body={"model_id": clients[1][1].model_id, "seq_id": 1000,
                                        "adam_params": adam}),
                        400, "optim_step on a finished session's model", need_detail=True)
    ok("finished by its client" in str(body.get("detail")),
       f"the refusal says the session was finished ({body})")
    _res(clients[0][1].optim_step(types.AdamParams(learning_rate=1e-4)))
    finished = search(user_metadata={"flow": tag},
                      statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])])
    st = finished.sessions[0].status if len(finished.sessions) == 1 else None
    ok(st is not None and st.type == "client_finished" and st.reason.type == "errored"
       and st.detail == "flow test" and "chat" in (finished.sessions[0].display_name or ""),
       f"close('errored') is found by status and reason ({st})")
    active = search(user_metadata={"flow": tag}, statuses=[types.ActiveSessionStatusQuery()])
    ok([s.display_name for s in active.sessions] == [f"Flow RL math {tag}"],
       "an active-status search leaves the finished session out")
    if OTHER_API_KEY:
        other = tinker.ServiceClient(base_url=BASE_URL, api_key=OTHER_API_KEY).create_rest_client()
        ok(not _res(other.search_sessions(Req(user_metadata={"flow": tag}))).sessions,
           "another tenant's search finds none of these sessions")
    for body, what in [({"limit": 0}, "limit 0"), ({"display_name": ""}, "an empty display_name"),
                       ({"cursor": {"last_created_at": "yesterday", "last_session_id": "x"}},
                        "a cursor time that is not RFC 3339"),
                       ({"statuses": [{"type": "sleeping"}]}, "an unknown status")]:
        expect_error(http("POST", "/api/v1/sessions/search", json_body=body), 400,
                     f"sessions/search with {what}", need_detail=True)


def check_w() -> None:
    """copy_weights (SDK 0.38's RestClient.copy_weights): a copy loads as the source, outlives it,
    and a resend with the same X-Idempotency-Key gets the same copy."""
    svc = service_client(API_KEY)
    rest = svc.create_rest_client()
    if not hasattr(rest, "copy_weights"):
        ok(True, f"SDK {SDK_VERSION} has no copy_weights (0.38 added it)")
        return
    tag = uuid.uuid4().hex[:8]
    batch = sft_batch()
    src = _res(S.tc.save_state(f"copy-src-{tag}")).path
    want = logprobs(_res(S.tc.forward(batch, "cross_entropy")))
    copy = _res(rest.copy_weights(src, "proj-flow"))
    ok(isinstance(copy, str) and copy.startswith("tinker://") and copy.endswith(f"/copy-src-{tag}")
       and copy.split("/")[2] != src.split("/")[2],
       f"copy_weights -> a new run holding the same name ({copy})")
    _res(rest.delete_checkpoint_from_tinker_path(src))
    tc = _client(svc.create_training_client_from_state(copy))
    got = logprobs(_res(tc.forward(batch, "cross_entropy")))
    ok(all(np.array_equal(a, b) for a, b in zip(want, got)),
       "a model loaded from the copy, after the source was deleted, computes the source's "
       "logprobs bit for bit")
    src2 = _res(S.tc.save_weights_for_sampler(f"copy-smp-{tag}")).path
    body = {"source_path": src2, "destination_project_id": "proj-flow"}
    key = {"X-Idempotency-Key": str(uuid.uuid4())}
    first = http("POST", "/api/v1/copy_weights", json_body=body, headers=key)
    again = http("POST", "/api/v1/copy_weights", json_body=body, headers=key)
    ok(first.status_code == 200 and again.status_code == 200
       and first.json()["tinker_path"] == again.json()["tinker_path"]
       and "/sampler_weights/" in first.json()["tinker_path"],
       f"a resend with the same X-Idempotency-Key gets the same copy ({first.text}, {again.text})")
    expect_error(http("POST", "/api/v1/copy_weights", headers=key,
                      json_body={**body, "destination_project_id": "elsewhere"}), 400,
                 "the same X-Idempotency-Key with another request", need_detail=True)
    for bad, what in [({**body, "ttl_seconds": 60}, "a ttl under an hour"),
                      ({"source_path": src2}, "no destination"),
                      ({**body, "source_path": "tinker://nope/weights/x"}, "a bad path")]:
        expect_error(http("POST", "/api/v1/copy_weights", json_body=bad),
                     (400, 404), f"copy_weights with {what}", need_detail=True)
    if OTHER_API_KEY:
        expect_error(http("POST", "/api/v1/copy_weights", key=OTHER_API_KEY, json_body=body), 404,
                     "another tenant's copy of this checkpoint", need_detail=True)
    # Checkpoint lifetimes as the cookbook sets them: save_state and save_weights_for_sampler with
    # ttl_seconds, then the RestClient's set_checkpoint_ttl_from_tinker_path; listings say when.
    run = str(S.tc.model_id)

    def expiry(path: str) -> Any:
        listed = _res(rest.list_checkpoints(run)).checkpoints
        return next((c.expires_at for c in listed if c.tinker_path == path), "missing")

    week = _res(S.tc.save_state(f"ttl-{tag}", ttl_seconds=604800)).path
    hours = _res(S.tc.save_weights_for_sampler(f"ttl-smp-{tag}", ttl_seconds=7200)).path
    now = time.time()
    ok(expiry(week) is not None and expiry(week) != "missing"
       and abs(expiry(week).timestamp() - (now + 604800)) < 120,
       f"save_state(ttl_seconds=604800) expires in a week ({expiry(week)})")
    ok(expiry(hours) is not None and expiry(hours) != "missing"
       and abs(expiry(hours).timestamp() - (now + 7200)) < 120,
       f"save_weights_for_sampler(ttl_seconds=7200) expires in two hours ({expiry(hours)})")
    _res(rest.set_checkpoint_ttl_from_tinker_path(week, None))
    ok(expiry(week) is None, "set_checkpoint_ttl_from_tinker_path(path, None): it never expires")
    _res(rest.set_checkpoint_ttl_from_tinker_path(week, 3600))
    ok(expiry(week) is not None and abs(expiry(week).timestamp() - (time.time() + 3600)) < 120,
       f"set_checkpoint_ttl_from_tinker_path(path, 3600): an hour from now ({expiry(week)})")


CHILD_ARG = "--child-killed-client"


def child_main() -> None:
    """The client that gets SIGKILLed: trains a step, saves, reports, submits work, waits forever."""
    svc = service_client(API_KEY)
    model_name = svc.get_server_capabilities().supported_models[0].model_name
    tc = _client(svc.create_lora_training_client(base_model=model_name, rank=8, seed=77))
    batch = sft_batch()
    train_step(tc, batch, LR)
    path = _res(tc.save_state("before-kill")).path
    lps = logprobs(_res(tc.forward(batch, "cross_entropy")))
    print(json.dumps({"path": path, "model_id": str(tc.model_id), "model_name": model_name,
                      "logprobs": [lp.tolist() for lp in lps]}), flush=True)
    tc.forward_backward(batch, "cross_entropy")  # in flight when the parent kills us
    tc.optim_step(adam(LR))
    print("SUBMITTED", flush=True)
    threading.Event().wait()


def check_t() -> None:
    """The server's tokenizer: get_tokenizer() loads the base model's (get_info's tokenizer_id),
    and string stops end a sample where its decoded text first contains one, the stop included,
    as the cookbook's role_colon renderer relies on."""
    if not os.environ.get("TINKERD_FLOW_TOKENIZER"):
        raise Skipped("the server's base model has no tokenizer (TINKERD_FLOW_TOKENIZER unset)")
    tok = S.tc.get_tokenizer()
    ids = tok.encode("hello world", add_special_tokens=False)
    ok(tok.decode(ids) == "hello world" and len(ids) < len("hello world"),
       f"get_tokenizer() loads the server's tokenizer: 'hello world' -> {ids} -> back")
    sc = _client(S.svc.create_sampling_client(base_model=S.model_name))
    prompt = tok.encode("User: what is two plus two?\n\nAssistant:", add_special_tokens=False)
    greedy = types.SamplingParams(max_tokens=24, temperature=0.0)
    full = list(sample(sc, prompt, greedy).sequences[0].tokens)
    ok(len(full) == 24, f"greedy without a stop: 24 tokens ({full})")

    def ascii_text(t: int) -> bool:
        s = tok.decode([t])
        return bool(s) and all(32 <= ord(c) < 127 for c in s)

    # A stop string that spans two tokens' texts (ASCII, so that decoding by prefixes here and the
    # server's matching on bytes agree), and where the definition says the sample must end.
    cut = next((i for i in range(3, len(full) - 1)
                if ascii_text(full[i]) and ascii_text(full[i + 1])), None)
    if cut is None:
        raise Skipped(f"no two ASCII tokens in a row to cut a stop string from: {full}")
    a, b = tok.decode([full[cut]]), tok.decode([full[cut + 1]])
    stop = a[-1:] + b[:2]
    want = next(k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k]))
    for form in ([stop], stop):
        params = types.SamplingParams(max_tokens=24, temperature=0.0, stop=form)
        seq = sample(sc, prompt, params).sequences[0]
        got = list(seq.tokens)
        ok(got == full[:want] and seq.stop_reason == "stop",
           f"stop={form!r}: the sample ends with the token completing the string's first "
           f"occurrence ({len(got)} of {len(full)} tokens, want {want}; {seq.stop_reason})")
        ok(stop in tok.decode(got), f"stop={form!r}: the returned tokens include the stop string")
    never = sample(sc, prompt, types.SamplingParams(max_tokens=24, temperature=0.0,
                                                    stop=["\x01never"])).sequences[0]
    ok(list(never.tokens) == full and never.stop_reason == "length",
       "a stop string the text never contains changes nothing")


def rl_datum(tokens: list[int], logq: list[float], adv: list[float],
             ratio_mask: list[float] | None = None) -> types.Datum:
    """An RL datum over `tokens` (input tokens[:-1], targets tokens[1:]) with the sampler's logprobs
    and advantages, and gspo's sequence_ratio_mask when given."""
    inp, tgt = tokens[:-1], tokens[1:]
    n = len(tgt)
    inputs = {
        "target_tokens": types.TensorData(data=tgt, dtype="int64", shape=[n]),
        "logprobs": types.TensorData(data=logq, dtype="float32", shape=[n]),
        "advantages": types.TensorData(data=adv, dtype="float32", shape=[n]),
    }
    if ratio_mask is not None:
        inputs["sequence_ratio_mask"] = types.TensorData(data=ratio_mask, dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(inp), loss_fn_inputs=inputs)


def check_z() -> None:
    """Tinker 0.38's losses and steps that tinker-cookbook relies on: an optim_step after a batch
    whose advantages are all 0 is a zero-gradient step (the moments of the earlier step still move
    the weights), and gspo's loss equals its definition computed here from the server's logprobs."""
    tc = _client(S.svc.create_lora_training_client(base_model=S.model_name, rank=4, seed=99))
    batch = sft_batch()
    train_step(tc, batch, 1e-2)
    before = forward_lps(tc, batch, "forward after one step")
    rng = np.random.default_rng(5)
    toks = [[int(x) for x in rng.integers(1, VOCAB, size=12)] for _ in range(3)]
    flat = [datum(t) for t in toks]
    lps = forward_lps(tc, flat, "forward of the RL datums")
    zero = [rl_datum(t, [float(x) for x in lp], [0.0] * len(lp)) for t, lp in zip(toks, lps)]
    fb = _res(tc.forward_backward(zero, "importance_sampling"))
    ok(abs(float(fb.metrics.get("loss:sum", 0.0))) == 0.0,
       f"all-zero advantages: loss:sum 0 (got {fb.metrics.get('loss:sum')})")
    try:
        _res(tc.optim_step(adam(1e-2)))
    except Exception as e:  # noqa: BLE001 - the SDK raises its own error types
        raise CheckFailed(f"optim_step after nothing valid was accumulated failed: {e}") from e
    after = forward_lps(tc, batch, "forward after the zero-gradient step")
    d = max_diff(before, after)
    ok(d > 10 * LP_TOL, f"the zero-gradient step was taken: Adam's moments moved the weights "
       f"(max |diff| {d:.3g})")

    import typing
    if "gspo" not in typing.get_args(types.LossFnType):
        note(f"SDK {SDK_VERSION} has no gspo loss: not checked")
        return
    lps = forward_lps(tc, flat, "forward before gspo")
    lo, hi = 0.98, 1.02
    expected, data = 0.0, []
    for t, lp in zip(toks, lps):
        n = len(lp)
        logq = [float(x) + float(rng.uniform(-0.05, 0.05)) for x in lp]
        adv = [0.0] * 3 + [float(rng.uniform(-1, 1)) for _ in range(n - 3)]
        mask = [0.0] * 3 + [1.0] * (n - 3)
        data.append(rl_datum(t, logq, adv, mask))
        s = math.exp(float(np.mean([lp[i] - logq[i] for i in range(3, n)])))
        expected -= sum(min(s * a, min(max(s, lo), hi) * a) for a in adv)
    fb = _res(tc.forward_backward(data, "gspo", {"clip_low_threshold": lo, "clip_high_threshold": hi}))
    got = float(fb.metrics["loss:sum"])
    ok(abs(got - expected) <= LOSS_REL_TOL * max(1.0, abs(expected)),
       f"gspo loss:sum {got:.6g} == its definition from the server's logprobs {expected:.6g}")


def topk_datum(tokens: list[int], targets: np.ndarray, weights: np.ndarray,
               sparse: bool) -> types.Datum:
    """A cross_entropy datum with [T, K] targets and weights (tinker-cookbook's off-policy
    distillation), dense, or sparse CSR as the SDK's Datum sends 2-D inputs with zero entries
    (built here with numpy: the SDK's own encoder needs torch)."""
    def tensor(a: np.ndarray, dtype: str) -> types.TensorData:
        if not sparse:
            return types.TensorData(data=a.reshape(-1).tolist(), dtype=dtype, shape=list(a.shape))
        rows, cols = np.nonzero(a)
        crow = np.zeros(a.shape[0] + 1, dtype=np.int64)
        np.add.at(crow, rows + 1, 1)
        return types.TensorData(data=a[rows, cols].tolist(), dtype=dtype, shape=list(a.shape),
                                sparse_crow_indices=np.cumsum(crow).tolist(),
                                sparse_col_indices=cols.tolist())
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": tensor(targets, "int64"),
                                       "weights": tensor(weights, "float32")})


def check_k() -> None:
    """cross_entropy with [T, K] soft targets: logprobs come back [T, K], column k equals a
    one-target forward on column k, loss:sum is -sum(w * logprobs), and a step lowers it. The
    first datum's 2-D inputs go sparse (CSR, as the SDK sends them when smaller), the second's
    dense."""
    tc = _client(S.svc.create_lora_training_client(base_model=S.model_name, rank=4, seed=7))
    rng = np.random.default_rng(11)
    K = 3
    batch, targets, weights = [], [], []
    for i, T in enumerate((14, 9)):
        toks = [int(x) for x in rng.integers(1, VOCAB, size=T)]
        tgt = rng.integers(1, VOCAB, size=(T, K)).astype(np.int64)
        tgt[:4] = 0  # prompt rows: nothing
        w = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
        w[:, K - 1] = 0.0  # a padded slot, as the cookbook pads short teacher rows
        w[:4] = 0.0
        w /= np.maximum(w.sum(axis=1, keepdims=True), np.float32(1e-30))
        batch.append(topk_datum(toks, tgt, w, sparse=(i == 0)))
        targets.append(tgt)
        weights.append(w.astype(np.float64))
    out = _res(tc.forward(batch, "cross_entropy"))
    lps = [np.asarray(rec["logprobs"].to_numpy(), dtype=np.float64) for rec in out.loss_fn_outputs]
    shapes = [lp.shape for lp in lps]
    ok(shapes == [t.shape for t in targets],
       f"logprobs shapes {shapes} == the targets' {[t.shape for t in targets]}")
    want = -sum(float((w * lp).sum()) for w, lp in zip(weights, lps))
    got = float(out.metrics["loss:sum"])
    ok(abs(got - want) <= LOSS_REL_TOL * max(1.0, abs(want)),
       f"loss:sum {got:.6g} == -sum(w * logprobs) {want:.6g}")
    col = [datum_of(d.model_input.to_ints(), t[:, 1].tolist()) for d, t in zip(batch, targets)]
    one = forward_lps(tc, col, "one-target forward on column 1")
    d = max(float(np.max(np.abs(lp[:, 1] - o))) for lp, o in zip(lps, one))
    ok(d <= LP_TOL, f"column 1 of the [T, K] logprobs is the one-target forward's (max |diff| {d:.3g})")
    _res(tc.forward_backward(batch, "cross_entropy"))
    _res(tc.optim_step(adam(1e-3)))  # small: Adam's first step moves every weight by lr
    after = float(_res(tc.forward(batch, "cross_entropy")).metrics["loss:sum"])
    ok(after < got, f"a step on the soft targets lowers their loss ({got:.5g} -> {after:.5g})")


def datum_of(inputs: list[int], targets: list[int]) -> types.Datum:
    """A cross_entropy datum with the given input tokens and [T] targets, every weight 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData(data=targets, dtype="int64", shape=[len(targets)]),
        "weights": types.TensorData(data=[1.0] * len(targets), dtype="float32",
                                    shape=[len(targets)])})


def check_i() -> None:
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), CHILD_ARG], env=env,
                            stdout=subprocess.PIPE, stderr=None, text=True)
    lines: "queue.Queue[str | None]" = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    info: dict[str, Any] | None = None
    deadline = time.monotonic() + 240
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed("the child client did not report within 240 s")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise CheckFailed(f"the child client exited early (rc {proc.wait()})")
            if line.startswith("{"):
                info = json.loads(line)
                note(f"child: model {info['model_id']}, saved {info['path']}")
            elif line == "SUBMITTED":
                break
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=30)
        ok(rc == -signal.SIGKILL, f"the child client was SIGKILLed mid-run (rc {rc})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert info is not None
    svc = S.svc or service_client(API_KEY)
    tc = _client(svc.create_training_client_from_state(info["path"]))
    gi = tc.get_info()
    ok(str(gi.model_id) != info["model_id"] and gi.lora_rank == 8,
       f"create_training_client_from_state -> new model {gi.model_id!r}, lora_rank {gi.lora_rank}")
    batch = sft_batch()
    child_lps = [np.asarray(x, dtype=np.float64) for x in info["logprobs"]]
    got = forward_lps(tc, batch, "forward of the restored client")
    d = max_diff(child_lps, got)
    ok(d <= LP_TOL, f"it has the weights the killed client saved: max |diff| {d:.3g} <= {LP_TOL}")
    fb, _ = train_step(tc, batch, LR)
    lps = check_output_shape(batch, fb, "restored client's forward_backward")
    check_loss_sum(batch, fb, lps, "restored client's forward_backward")
    after = forward_lps(tc, batch, "forward after the restored client's step")
    ok(expected_loss(batch, after) < expected_loss(batch, got),
       "the restored client trains: its loss went down after one step")
    if hasattr(svc, "create_training_client_from_state_with_optimizer"):
        tc2 = _client(svc.create_training_client_from_state_with_optimizer(info["path"]))
        d = max_diff(child_lps, forward_lps(tc2, batch, "forward of the client restored with optimizer"))
        ok(d <= LP_TOL, f"create_training_client_from_state_with_optimizer: same weights "
           f"(max |diff| {d:.3g})")


def check_x() -> None:
    teacher = os.environ.get("TINKERD_FLOW_TEACHER", "")
    if not teacher:
        raise Skipped("the server serves one base model (TINKERD_FLOW_TEACHER unset)")
    names = [m.model_name for m in S.svc.get_server_capabilities().supported_models]
    ok(names == [S.model_name, teacher],
       f"get_server_capabilities lists the default base, then the teacher ({names})")
    # On-policy distillation's teacher: a sampling client of another base, in the same server.
    prompt = [5, 17, 3, 29, 41, 7, 13]
    inp = types.ModelInput.from_ints(prompt)
    st = _client(S.svc.create_sampling_client(base_model=teacher))
    ok(st.get_base_model() == teacher, f"the teacher's sampling client: get_base_model() == {teacher!r}")
    ss = _client(S.svc.create_sampling_client(base_model=S.model_name))
    lt = np.asarray(_res(st.compute_logprobs(inp))[1:], dtype=np.float64)
    ls = np.asarray(_res(ss.compute_logprobs(inp))[1:], dtype=np.float64)
    d = float(np.max(np.abs(lt - ls)))
    ok(d > 1e-2, f"the teacher's logprobs are its own weights', not the student's: max |diff| {d:.3g}")
    # A model trained on the teacher: a fresh adapter adds nothing, so its Forward is the teacher's.
    tt = _client(S.svc.create_lora_training_client(base_model=teacher, rank=4, seed=5))
    ok(tt.get_info().model_data.model_name == teacher, f"get_info of a model on it names {teacher!r}")
    fwd = forward_lps(tt, [datum(prompt)], "forward on the teacher")[0]
    d = float(np.max(np.abs(fwd - lt)))
    ok(d <= LP_TOL_XBATCH, f"a fresh model on the teacher: forward == the teacher sampler's "
       f"compute_logprobs: max |diff| {d:.3g}")
    fb, _ = train_step(tt, [datum(prompt)], LR)
    after = forward_lps(tt, [datum(prompt)], "forward on the teacher after a step")[0]
    ok(float(np.sum(after)) > float(np.sum(fwd)),
       f"a step on the teacher raises its logprobs ({np.sum(fwd):.4f} -> {np.sum(after):.4f})")
    moved = np.asarray(_res(st.compute_logprobs(inp))[1:], dtype=np.float64)
    ok(np.array_equal(moved, lt), "the teacher's own sampler is unchanged by training a model on it")
    # A base the server does not serve: 400 naming the field and the served bases.
    r = http("POST", "/api/v1/asample", json_body={
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 1}, "num_samples": 1, "base_model": "no-such-base"})
    body = expect_error(r, 400, "asample on a base not served")
    ok("base_model" in json.dumps(body) and teacher in json.dumps(body),
       f"the error names base_model and the served bases ({body})")


def check_q() -> None:
    """save_weights_external: the adapter in Hugging Face's PEFT layout under external_weights/,
    each file downloadable by its own URL, byte for byte what the server stored; a TTL; age
    encryption refused by name."""
    tc = S.tc
    if not hasattr(tc, "save_weights_external"):
        raise Skipped(f"SDK {SDK_VERSION} has no save_weights_external")
    path = _res(tc.save_weights_external("ext-1", ttl_seconds=7200)).path
    ok(path == f"tinker://{S.model_id}/external_weights/ext-1", f"save_weights_external: {path}")
    rest = S.svc.create_rest_client()
    got = _res(rest.get_external_weights_urls(path))
    ok({"adapter_config.json", "adapter_model.safetensors"} <= set(got.urls),
       f"external_weights_urls: the PEFT adapter's files ({sorted(got.urls)})")
    left = (got.expires - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    ok(600 < left <= 900, f"the URLs expire in {left:.0f} s (15 minutes)")
    root = os.environ.get("TINKERD_CHECKPOINT_ROOT", "")
    import glob
    links = glob.glob(os.path.join(root, "*", S.model_id, "external_weights", "ext-1")) if root else []
    folder = os.path.realpath(links[0]) if len(links) == 1 else ""
    with httpx.Client(timeout=60) as c:
        for name, url in sorted(got.urls.items()):
            ok(url.startswith(BASE_URL + "/api/v1/archives/"), f"{name}: URL on this server")
            r = c.get(url)  # no X-API-Key: the URL is the credential
            ok(r.status_code == 200, f"{name}: download HTTP {r.status_code} ({r.text[:200]!r})")
            ok(int(r.headers.get("content-length", -1)) == len(r.content),
               f"{name}: {len(r.content)} bytes, as Content-Length says")
            if folder:
                ok(open(os.path.join(folder, name), "rb").read() == r.content,
                   f"{name}: the download is the stored file byte for byte")
    config = json.loads(httpx.get(got.urls["adapter_config.json"], timeout=60).content)
    ok(config.get("peft_type") == "LORA" and config.get("r") == 8,
       f"adapter_config.json: a PEFT LoRA of rank 8 ({config.get('peft_type')}, r={config.get('r')})")
    listed = {c.checkpoint_id: c for c in _res(rest.list_checkpoints(S.model_id)).checkpoints}
    entry = listed.get("external_weights/ext-1")
    ok(entry is not None and entry.checkpoint_type == "external",
       f"list_checkpoints shows it as 'external' ({entry and entry.checkpoint_type})")
    ok(entry.expires_at is not None, f"its TTL is kept: expires_at {entry.expires_at}")
    # A refused save takes its seq_id with the error: the model's next call runs at once.
    try:
        _res(tc.save_weights_external("ext-2", age_encryption_recipients=["age1qyqszqgpqyqszqgpqyqs"]))
        raise CheckFailed("an encrypted export was accepted")
    except CheckFailed:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the SDK raises for a 400
        ok("age_encryption_recipients" in str(e), f"age encryption is refused by name ({e!s:.200})")
    started = time.monotonic()
    forward_lps(tc, S.batch[:1], "a forward after the refused save")
    ok(time.monotonic() - started < 30, "the forward after the refusal ran without waiting on a "
       "missing seq_id")
    expect_error(http("GET", f"/api/v1/training_runs/{S.model_id}/checkpoints/weights/ck1/"
                      "external_weights_urls"), 400, "file URLs of a training checkpoint",
                 need_detail=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_ARG:
        child_main()
        return
    if not BASE_URL or not API_KEY:
        print("tinker_flow.py: set TINKER_BASE_URL and TINKER_API_KEY", file=sys.stderr)
        sys.exit(2)
    print(f"tinker SDK {SDK_VERSION} ({os.path.dirname(tinker.__file__)}), python "
          f"{sys.version.split()[0]}, server {BASE_URL}", flush=True)
    run_check("a", "capabilities, create_lora_training_client(rank=8), get_info", check_a)
    run_check("b", f"SFT: 3 pipelined forward_backward+optim_step steps, lr {LR}", check_b, needs=("a",))
    run_check("c", "forward == forward_backward logprobs; forward changes nothing", check_c, needs=("b",))
    run_check("d", "1,100+ datums: chunked forward_backward, out-of-order chunks", check_d, needs=("c",))
    run_check("e", "save_state / load_state / load_state_with_optimizer", check_e, needs=("d",))
    run_check("f", "save_weights_for_sampler (named)", check_f, needs=("e",))
    run_check("r", "RestClient: checkpoint archive URLs and their downloads", check_r, needs=("f",))
    run_check("s", "sampling: sample, compute_logprobs, exports, snapshots, errors", check_s,
              needs=("f",))
    run_check("u", "RestClient listings: training runs, user checkpoints, sessions, paged",
              check_u, needs=("f",))
    run_check("p", "retrieve_future's metadata-only peek", check_p, needs=("a",))
    run_check("g", "isolation between tenants", check_g, needs=("e",))
    run_check("h", "raw HTTP: config, errors, JSON shapes, a raw model lifecycle", check_h)
    run_check("i", "a SIGKILLed client; create_training_client_from_state trains on", check_i)
    run_check("z", "zero-gradient optim_step; gspo", check_z, needs=("a",))
    run_check("k", "cross_entropy with [T, K] soft targets", check_k, needs=("a",))
    run_check("v", "0.38's sample scoring: last_n, top-k of samples, target ids, alt tokens", check_v,
              needs=("a",))
    run_check("t", "the server's tokenizer; stop strings", check_t, needs=("a",))
    run_check("n", "sessions/search: filters, paging, finish status, isolation", check_n,
              needs=("a",))
    run_check("w", "copy_weights: a copy loads as its source, outlives it, once per key", check_w,
              needs=("a",))
    run_check("y", "0.38's inflight sampling clients follow the model's inflight saves", check_y,
              needs=("a",))
    run_check("x", "a second base model: the teacher samples and trains beside the default",
              check_x, needs=("a",))
    run_check("q", "save_weights_external: a PEFT adapter downloadable file by file", check_q,
              needs=("e",))
    finish()


if __name__ == "__main__":
    main()
