"""SamplingClient against a real tinkerd: logprobs agree with the trainer's, samplers freeze in
order, seeds repeat, errors name their field."""

import os
import re
import subprocess
import tempfile

import grpc
import numpy as np
import pytest

import tinkerd
from conftest import REPO, Server, wait_for

PROMPT = [3, 17, 42, 8, 99, 5]


def forward_logprobs(trainer, tokens):
    """The trainer's log p(tokens[t] | tokens[:t]) for t >= 1."""
    d = tinkerd.datum(tokens[:-1], target_tokens=tokens[1:], weights=np.ones(len(tokens) - 1))
    return trainer.forward([d]).result().logprobs[0].astype(np.float64)


def test_sampled_logprobs_are_the_trainers(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=11)
    out = conn.sampling_client(model_id=trainer.model_id).sample(
        PROMPT, max_tokens=12, num_samples=3, seed=1).result()
    assert len(out.sequences) == 3
    for s in out.sequences:
        assert s.stop_reason == "length" and len(s.tokens) == 12
        expected = forward_logprobs(trainer, PROMPT + list(s.tokens))[len(PROMPT) - 1:]
        # Forward reports float32 logprobs: agreement to float32 rounding of values up to ~10.
        np.testing.assert_allclose(s.logprobs, expected, rtol=0, atol=4e-6)


def test_greedy_is_the_argmax_and_seeds_repeat(conn):
    sampler = conn.sampling_client()  # the base model
    greedy = sampler.sample(PROMPT, max_tokens=8, temperature=0.0,
                            topk_prompt_logprobs=1).result().sequences[0]
    for t, token in enumerate(greedy.tokens):
        top = sampler.sample(PROMPT + list(greedy.tokens[:t]), max_tokens=1,
                             temperature=0.0).result().sequences[0]
        assert top.tokens[0] == token
    a = sampler.sample(PROMPT, max_tokens=10, seed=123).result().sequences[0].tokens
    b = sampler.sample(PROMPT, max_tokens=10, seed=123).result().sequences[0].tokens
    c = sampler.sample(PROMPT, max_tokens=10, seed=124).result().sequences[0].tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)  # control: the seed matters


def test_compute_logprobs_matches_forward(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=12)
    logprobs = conn.sampling_client(model_id=trainer.model_id).compute_logprobs(PROMPT).result()
    assert np.isnan(logprobs[0])
    np.testing.assert_allclose(logprobs[1:], forward_logprobs(trainer, PROMPT), atol=4e-6)


def test_a_sampler_is_frozen_in_the_models_order(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=13)
    reference = conn.create_training_client(lora_rank=8, seed=13)
    d = tinkerd.datum(PROMPT[:-1], target_tokens=PROMPT[1:], weights=np.ones(len(PROMPT) - 1))
    reference.forward_backward([d])
    reference.optim_step(5e-2)
    one_step = forward_logprobs(reference, PROMPT)
    before = forward_logprobs(trainer, PROMPT)
    # Nothing awaited: the sampler is made between the two steps because of its place in line.
    trainer.forward_backward([d])
    trainer.optim_step(5e-2)
    frozen = trainer.save_weights_and_get_sampling_client()
    trainer.forward_backward([d])
    trainer.optim_step(5e-2)
    sampler = frozen.result()
    after_one = sampler.compute_logprobs(PROMPT).result()[1:]
    after_two = forward_logprobs(trainer, PROMPT)
    np.testing.assert_allclose(after_one, one_step, atol=4e-6)
    # Control: each step moved the weights, so a sampler frozen elsewhere in line would differ.
    assert not np.allclose(before, one_step, atol=1e-3)
    assert not np.allclose(after_two, one_step, atol=1e-3)
    sampler.delete()
    with pytest.raises(tinkerd.TinkerdError) as error:
        sampler.sample(PROMPT, max_tokens=1).result()
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_stop_sequences_and_bad_params(conn):
    sampler = conn.sampling_client()
    first = sampler.sample(PROMPT, max_tokens=6, temperature=0.0).result().sequences[0]
    stopped = sampler.sample(PROMPT, max_tokens=6, temperature=0.0,
                             stop=[list(first.tokens[:3])]).result().sequences[0]
    assert stopped.stop_reason == "stop"
    np.testing.assert_array_equal(stopped.tokens, first.tokens[:3])
    with pytest.raises(tinkerd.TinkerdError) as error:
        sampler.sample(PROMPT, max_tokens=0).result()
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in error.value.message


def test_tinkerctl_sample_prints_what_the_client_samples(conn, server):
    binary = os.environ.get("TINKERCTL_BINARY", os.path.join(REPO, "build/client/tinkerctl"))
    trainer = conn.create_training_client(lora_rank=8, seed=14)
    greedy = conn.sampling_client(model_id=trainer.model_id).sample(
        PROMPT, max_tokens=5, temperature=0.0).result().sequences[0]
    run = subprocess.run([binary, f"--target={server.target}", f"--model={trainer.model_id}",
                          "--temperature=0", "--max_tokens=5", "sample",
                          ",".join(map(str, PROMPT))], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    line = re.fullmatch(r"sample 0 \(length, logprob (\S+)\): ([\d,]+)\n", run.stdout)
    assert line, run.stdout
    assert line.group(2) == ",".join(map(str, greedy.tokens))
    assert abs(float(line.group(1)) - greedy.logprobs.sum()) < 1e-4
    bad = subprocess.run([binary, f"--target={server.target}", "--max_tokens=0", "sample", "1,2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "max_tokens" in bad.stderr


def test_a_streamed_sample_is_the_sample(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=15)
    sampler = conn.sampling_client(model_id=trainer.model_id)
    args = dict(max_tokens=12, num_samples=3, seed=77, prompt_logprobs=True)
    whole = sampler.sample(PROMPT, **args).result()
    stream = sampler.sample_stream(PROMPT, **args)
    deltas = list(stream)
    for i, expected in enumerate(whole.sequences):
        mine = [d for d in deltas if d.index == i]
        assert len(mine) >= 2  # the tokens came in pieces, as they were decoded
        assert [d.stop_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
        np.testing.assert_array_equal(np.concatenate([d.tokens for d in mine]), expected.tokens)
        # Decoded beside other rows in another batch: float64 rounding apart at most.
        np.testing.assert_allclose(np.concatenate([d.logprobs for d in mine]), expected.logprobs,
                                   rtol=0, atol=1e-9)
    np.testing.assert_allclose(stream.prompt_logprobs, whole.prompt_logprobs, atol=1e-9)
    with pytest.raises(tinkerd.TinkerdError) as error:
        list(sampler.sample_stream(PROMPT, max_tokens=0))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in error.value.message


def test_a_cancelled_sample_stream_stops_its_samples(conn, server):
    sampler = conn.sampling_client()
    tokens_before = server.metric("tinkerd_sampled_tokens_total")
    stream = sampler.sample_stream(PROMPT, max_tokens=1000, num_samples=4)
    first = next(iter(stream))
    assert len(first.tokens) >= 1
    stream.cancel()
    # The engine drops the request at its next step: nothing of it is running any more, and it
    # ended cancelled, not complete (a completed request would add its 4,000 tokens).
    wait_for(lambda: server.metric("tinkerd_sample_sequences_running") == 0,
             "the cancelled samples to stop")
    assert server.metric("tinkerd_sampled_tokens_total") == tokens_before
    # Leaving the loop early ends the call just the same.
    for _ in sampler.sample_stream(PROMPT, max_tokens=1000, num_samples=4):
        break
    wait_for(lambda: server.metric("tinkerd_sample_sequences_running") == 0,
             "the abandoned samples to stop")
    assert server.metric("tinkerd_sampled_tokens_total") == tokens_before
    # Control: the same request, read to its end, is counted.
    done = sum(len(d.tokens) for d in sampler.sample_stream(PROMPT, max_tokens=20, num_samples=4))
    assert done == 80
    assert server.metric("tinkerd_sampled_tokens_total") == tokens_before + 80


@pytest.fixture(scope="module")
def moe_server():
    """tinkerd on a Qwen3-MoE-shaped model written by tools/make_tiny_model."""
    model = tempfile.TemporaryDirectory(prefix="tinkerd-pytest-moe-")
    tool = os.environ.get("MAKE_TINY_MODEL", os.path.join(REPO, "build/tools/make_tiny_model"))
    subprocess.run([tool, f"--out={model.name}", "--family=qwen3_moe"], check=True,
                   stdout=subprocess.DEVNULL)
    s = Server(64, f"--base_model={model.name}")
    yield s
    s.stop()
    model.cleanup()


def test_sampled_routes_replay_through_the_trainer(moe_server):
    """Router replay: the routes a sample returns, sent back with its trajectory, give the
    trainer's own logprobs (the same routes); another expert for one token changes them."""
    with tinkerd.Connection(moe_server.target, max_attempts=3) as c:
        trainer = c.create_training_client(lora_rank=4, seed=3)
        out = c.sampling_client(model_id=trainer.model_id).sample(
            PROMPT, max_tokens=6, num_samples=2, seed=9, routed_experts=True).result()
        s = out.sequences[0]
        routes = out.routes(0)
        assert routes.shape == (len(PROMPT) + len(s.tokens) - 1, 1, 2)  # 1 routed layer, top 2
        tokens = PROMPT + list(s.tokens)

        def logprobs(replayed):
            kw = {"routed_experts": replayed} if replayed is not None else {}
            d = tinkerd.datum(tokens[:-1], target_tokens=tokens[1:],
                              weights=np.ones(len(tokens) - 1), **kw)
            return trainer.forward([d]).result().logprobs[0]

        own = logprobs(None)
        np.testing.assert_array_equal(logprobs(routes), own)
        moved = routes.copy()
        moved[3, 0, 0] = next(e for e in range(8) if e not in moved[3, 0])
        changed = logprobs(moved)
        np.testing.assert_array_equal(changed[:3], own[:3])
        assert changed[3] != own[3]
        with pytest.raises(tinkerd.TinkerdError) as error:
            logprobs(routes[:, :, :1])
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "routed_experts" in error.value.message


@pytest.fixture(scope="module")
def teacher_server():
    """tinkerd serving the embedded model (the default) and, as "teacher", another model of the
    same vocabulary written by tools/make_tiny_model."""
    model = tempfile.TemporaryDirectory(prefix="tinkerd-pytest-teacher-")
    tool = os.environ.get("MAKE_TINY_MODEL", os.path.join(REPO, "build/tools/make_tiny_model"))
    subprocess.run([tool, f"--out={model.name}", "--family=demo", "--seed=7"], check=True,
                   stdout=subprocess.DEVNULL)
    s = Server(64, "--base_model=embedded:default", f"--base_model=teacher={model.name}")
    s.teacher_dir = model.name
    yield s
    s.stop()
    model.cleanup()


def test_a_teacher_base_samples_and_trains_beside_the_default(teacher_server):
    """On-policy distillation's teacher: another base in the same server, by its name."""
    with tinkerd.Connection(teacher_server.target, max_attempts=3) as c:
        teacher = c.create_sampling_client(base_model="teacher").compute_logprobs(PROMPT).result()
        student = c.sampling_client().compute_logprobs(PROMPT).result()
        assert np.max(np.abs(teacher[1:] - student[1:])) > 1e-3  # its own weights
        np.testing.assert_array_equal(
            c.sampling_client(base_model="teacher").compute_logprobs(PROMPT).result()[1:],
            teacher[1:])
        # A fresh adapter adds nothing: a model on the teacher computes the teacher's logprobs.
        trainer = c.create_training_client(lora_rank=4, seed=3, base_model="teacher")
        assert c.get_info(trainer.model_id).base_model == teacher_server.teacher_dir
        np.testing.assert_allclose(forward_logprobs(trainer, PROMPT), teacher[1:],
                                   rtol=1e-6, atol=1e-6)  # float32 on the Forward wire
        with pytest.raises(tinkerd.TinkerdError) as error:
            c.create_model(base_model="no-such-base")
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "base_model" in error.value.message and "'teacher'" in error.value.message
