"""TrainingClient against a real tinkerd: ordering, exactly-once retries, streams, errors."""

import grpc
import numpy as np
import pytest

import tinkerd
from conftest import wait_for
from tinkerd.v1 import tinkerd_pb2 as pb


def batch(rng, vocab, lengths, loss="cross_entropy"):
    data = []
    for n in lengths:
        tokens = rng.integers(0, vocab, n + 1)
        inputs = {"target_tokens": tokens[1:]}
        if loss == "cross_entropy":
            inputs["weights"] = rng.uniform(0.5, 1.5, n)
        else:
            inputs["logprobs"] = -rng.uniform(0.5, 8.0, n)
            inputs["advantages"] = rng.normal(0.0, 1.0, n)
        data.append(tinkerd.datum(tokens[:-1], **inputs))
    return data


def vocab(trainer):
    return trainer.get_info().vocab_size


def test_futures_resolve_in_call_order(conn):
    """Pipelined calls (nothing awaited) give what the same calls give one at a time."""
    pipelined = conn.create_training_client(lora_rank=8, seed=5)
    one_by_one = conn.create_training_client(lora_rank=8, seed=5)
    rng = np.random.default_rng(1)
    data = batch(rng, vocab(pipelined), [7, 12, 5])

    def run(trainer, wait):
        futures = []
        for _ in range(3):
            futures.append(trainer.forward(data))
            futures.append(trainer.forward_backward(data))
            futures.append(trainer.optim_step(learning_rate=1e-2))
            if wait:
                for f in futures:
                    f.result()
        return [f.result() for f in futures]

    a, b = run(pipelined, wait=False), run(one_by_one, wait=True)
    for x, y in zip(a, b):
        if isinstance(x, tinkerd.OptimStepOutput):
            assert x == y
        else:
            assert x.metrics == y.metrics
            for lx, ly in zip(x.logprobs, y.logprobs):
                np.testing.assert_array_equal(lx, ly)
    assert [x.step for x in a[2::3]] == [1, 2, 3]
    # Control: the forwards see different weights, so a reordering would have shown.
    assert a[0].metrics["loss:sum"] != a[3].metrics["loss:sum"] != a[6].metrics["loss:sum"]


class _LostReply(grpc.RpcError):
    """What the client sees when the server's answer never arrives."""

    def result(self, timeout=None):
        raise self

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "reply lost on the way back (test interceptor)"


class DropFirstReply(grpc.UnaryUnaryClientInterceptor):
    """Lets the first call of `method` reach the server and complete, then loses its reply."""

    def __init__(self, method):
        self.method = method
        self.attempts = 0

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        if details.method.endswith("/" + self.method):
            self.attempts += 1
            if self.attempts == 1:
                outcome.result()  # the server has applied it
                return _LostReply()
        return outcome


def test_a_retried_call_is_applied_once(server):
    drop = DropFirstReply("ForwardBackward")
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), drop)
    with tinkerd.Connection(channel=channel, initial_backoff=0.001) as conn:
        trainer = conn.create_training_client(lora_rank=8, seed=6)
        reference = conn.create_training_client(lora_rank=8, seed=6)
        data = batch(np.random.default_rng(2), vocab(trainer), [9, 4])
        retried = trainer.forward_backward(data).result()
        assert drop.attempts == 2  # the call was sent again after the lost reply
        once = reference.forward_backward(data).result()
        assert retried.metrics == once.metrics
        info, ref_info = trainer.get_info(), reference.get_info()
        assert info.accumulated_tokens == ref_info.accumulated_tokens == 13
        assert info.next_seq_id == 2
        # Stepping both gives one update: the gradient was accumulated once, not twice.
        assert trainer.optim_step(1e-2).result() == reference.optim_step(1e-2).result()
        # Control: the same seq_id with another payload is refused, not applied.
        stray = pb.ForwardBackwardRequest(model_id=trainer.model_id, seq_id=1,
                                          data=batch(np.random.default_rng(3), 256, [4]),
                                          loss_fn=pb.LossFn(name="cross_entropy"))
        with pytest.raises(tinkerd.TinkerdError) as error:
            conn.call(conn.stub.ForwardBackward, stray)
        assert error.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_a_cancelled_stream_changes_nothing(conn, server):
    cancelled = conn.create_training_client(lora_rank=8, seed=7)
    untouched = conn.create_training_client(lora_rank=8, seed=7)
    rng = np.random.default_rng(4)
    data = batch(rng, vocab(cancelled), [40, 40, 40], loss="importance_sampling")
    more = batch(rng, 256, [10, 6])

    assert server.metric("tinkerd_queue_depth") == 0
    stream = cancelled.open_stream("importance_sampling")
    for d in data:
        stream.write(d)
    # The stream's header is queued, so its seq_id is taken, when the client goes away.
    wait_for(lambda: server.metric("tinkerd_queue_depth") > 0, "the stream's header")
    stream.cancel()
    with pytest.raises(tinkerd.TinkerdError) as error:
        stream.future.result()
    assert error.value.code == grpc.StatusCode.CANCELLED
    wait_for(lambda: cancelled.get_info().next_seq_id == 2, "the server to drop the stream")
    assert cancelled.get_info().accumulated_tokens == 0

    for trainer in (cancelled, untouched):
        trainer.forward_backward(more)
    assert cancelled.optim_step(1e-2).result() == untouched.optim_step(1e-2).result()

    # Control: the same stream, finished, is applied.
    finished = cancelled.stream_forward_backward(iter(data), "importance_sampling")
    assert finished.future.result().metrics["num_tokens:sum"] == 120
    assert cancelled.get_info().accumulated_tokens == 120


@pytest.mark.parametrize("which", ["wide_server", "server"])
def test_a_stream_of_1000_trajectories_equals_one_call(which, request):
    """On wide_server both calls run one micro-batch: bitwise equal in float64. On server the
    stream runs 64-token micro-batches as datums arrive while the call balances its own, so
    float64 sums are reordered: equal to 1e-12 relative (1000 terms of unit size, each rounding
    2^-53, grouped differently)."""
    server = request.getfixturevalue(which)
    exact = which == "wide_server"
    with tinkerd.Connection(server.target) as conn:
        create = lambda: conn.create_training_client(lora_rank=8, seed=8,
                                                     loss_reduction="seq_mean_token_sum")
        streamed, whole, short = create(), create(), create()
        rng = np.random.default_rng(5)
        data = batch(rng, vocab(streamed), rng.integers(1, 9, 1000), "importance_sampling")

        def rollouts():  # a producer: each trajectory is handed over as it is made
            yield from data

        a = streamed.stream_forward_backward(rollouts(), "importance_sampling").future.result()
        b = whole.forward_backward(data, "importance_sampling").result()
        # Control: a stream missing its last trajectory differs.
        short.stream_forward_backward(iter(data[:-1]), "importance_sampling").future.result()

        def same(x, y):
            if exact:
                np.testing.assert_array_equal(x, y)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=0)

        assert a.metrics.keys() == b.metrics.keys()
        same([a.metrics[k] for k in sorted(a.metrics)], [b.metrics[k] for k in sorted(b.metrics)])
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            np.testing.assert_array_equal(x, y)  # per-token values do not depend on grouping
        step_a, step_b = streamed.optim_step(1e-2).result(), whole.optim_step(1e-2).result()
        same(step_a.grad_norm, step_b.grad_norm)
        assert (step_a.num_tokens, step_a.step) == (step_b.num_tokens, step_b.step)
        assert abs(short.optim_step(1e-2).result().grad_norm - step_b.grad_norm) > 1e-9 * step_b.grad_norm
        probe = batch(rng, 256, [30])
        same(streamed.forward(probe).result().logprobs[0], whole.forward(probe).result().logprobs[0])


def test_a_failing_producer_cancels_its_stream(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=9)
    data = batch(np.random.default_rng(6), vocab(trainer), [5, 5])

    def rollouts():
        yield data[0]
        raise RuntimeError("the environment crashed")

    stream = trainer.stream_forward_backward(rollouts())
    with pytest.raises(RuntimeError, match="the environment crashed"):
        stream.future.result()
    wait_for(lambda: trainer.get_info().next_seq_id == 2, "the server to drop the stream")
    assert trainer.get_info().accumulated_tokens == 0


def test_bad_input_raises_naming_the_field(conn):
    trainer = conn.create_training_client(lora_rank=8)
    n = trainer.get_info().vocab_size
    bad = tinkerd.datum([1, 2, n], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])
    with pytest.raises(tinkerd.TinkerdError) as error:
        trainer.forward_backward([bad]).result()
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token" in error.value.message
    assert trainer.get_info().accumulated_tokens == 0
    with pytest.raises(tinkerd.TinkerdError) as error:
        conn.get_info("no-such-model")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_checkpoints_round_trip(conn):
    trainer = conn.create_training_client(lora_rank=8, seed=10)
    data = batch(np.random.default_rng(7), vocab(trainer), [12])
    trainer.forward_backward(data)
    trainer.optim_step(1e-2)
    path = trainer.save_state("after-one-step").result()
    assert path == f"tinker://{trainer.model_id}/weights/after-one-step"
    export = trainer.save_weights_for_sampler("adapter").result()
    kinds = {c.path: c.kind for c in conn.list_checkpoints(trainer.model_id)}
    assert kinds == {path: "training", export: "sampler"}
    resumed = conn.create_model_from_state(path)
    probe = batch(np.random.default_rng(8), 256, [20])
    np.testing.assert_array_equal(trainer.forward(probe).result().logprobs[0],
                                  resumed.forward(probe).result().logprobs[0])
    assert resumed.get_info().step == 1
