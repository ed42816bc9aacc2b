"""TrainingClient: one model's calls, numbered, pipelined, retried exactly-once.

Every call that touches a model's training state carries (model_id, seq_id). The client fixes a
call's seq_id when the call is made and resends that seq_id with the identical payload on every
retry, so the server applies it once and a retry after a lost reply gets the stored result. Calls
return concurrent.futures.Future objects: several may be in flight, and the server applies them
in seq_id order whatever order they arrive in.
"""

import concurrent.futures
import dataclasses
import queue
import threading
from typing import Iterable, Mapping

import grpc
import numpy as np

from tinkerd.errors import TinkerdError, from_rpc
from tinkerd.tensors import from_tensor, loss_fn as make_loss_fn
from tinkerd.v1 import tinkerd_pb2 as pb


@dataclasses.dataclass
class ForwardBackwardOutput:
    logprobs: list[np.ndarray]  # per datum, float32 [T]: log p(target_t | tokens <= t)
    metrics: dict[str, float]   # "name:reduction": loss:sum, num_tokens:sum, ...

    @staticmethod
    def from_proto(reply: pb.ForwardBackwardOutput) -> "ForwardBackwardOutput":
        return ForwardBackwardOutput([from_tensor(o.logprobs) for o in reply.outputs],
                                     dict(reply.metrics))


@dataclasses.dataclass
class OptimStepOutput:
    step: int
    grad_norm: float      # after normalization, before clipping
    learning_rate: float
    denominator: float    # what the summed gradient was divided by
    clipped: bool
    skipped: bool         # non-finite norm: nothing applied
    num_tokens: int
    num_sequences: int
    metrics: dict[str, float]

    @staticmethod
    def from_proto(reply: pb.OptimStepResponse) -> "OptimStepOutput":
        return OptimStepOutput(reply.step, reply.grad_norm, reply.learning_rate,
                               reply.denominator, reply.clipped, reply.skipped, reply.num_tokens,
                               reply.num_sequences, dict(reply.metrics))


_END = object()  # closes a TrajectoryStream's queue


class TrajectoryStream:
    """A StreamForwardBackward call fed one datum at a time, as trajectories finish.

    The server applies the whole stream as one forward_backward, atomically, once `finish()`
    closes it; `cancel()` (or an exception in the producer) discards it and nothing is applied.
    Its seq_id is taken when it is opened, so calls made on the TrainingClient afterwards are
    applied after it, and they wait on the server until it is finished. Streams are not retried:
    the client does not keep their datums. Not thread-safe: one producer writes.
    """

    def __init__(self, connection, header: pb.StreamHeader, data: Iterable | None = None):
        self.seq_id = header.seq_id
        self._queue: queue.Queue | None = None
        self._producer_error: BaseException | None = None
        if data is None:
            self._queue = queue.Queue()
            data = iter(self._queue.get, _END)
        self._call = connection.stub.StreamForwardBackward.future(
            self._messages(header, data), timeout=connection.deadline,
            metadata=connection.metadata)
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._call.add_done_callback(self._done)

    def _messages(self, header, data):
        yield pb.StreamForwardBackwardMessage(header=header)
        try:
            for d in data:
                yield pb.StreamForwardBackwardMessage(datum=d)
        except BaseException as error:  # gRPC cancels the call; result() re-raises this
            self._producer_error = error
            raise

    def _done(self, call) -> None:
        self._end_queue()  # gRPC's thread reading the queue must not wait for datums any more
        try:
            self.future.set_result(ForwardBackwardOutput.from_proto(call.result()))
        except grpc.FutureCancelledError:
            self.future.set_exception(TinkerdError(grpc.StatusCode.CANCELLED, "stream cancelled"))
        except grpc.RpcError as error:
            self.future.set_exception(self._producer_error or from_rpc(error))
        except BaseException as error:  # a reply that does not convert: finish() must not hang
            self.future.set_exception(error)

    def _end_queue(self) -> None:
        if self._queue is not None:
            self._queue.put(_END)

    def write(self, datum: pb.Datum) -> None:
        if self._queue is None:
            raise RuntimeError("this stream reads an iterable; write() is for open_stream()")
        self._queue.put(datum)

    def finish(self) -> ForwardBackwardOutput:
        """Closes the stream and waits for the server's result (raises TinkerdError)."""
        self._end_queue()
        return self.future.result()

    def cancel(self) -> None:
        """Discards the stream: nothing of it is applied."""
        self._call.cancel()
        self._end_queue()


class TrainingClient:
    """Drives one model. Thread-safe: seq_ids are handed out in the order calls are made.

    A call that fails for good still used its seq_id: one the server answered (even with an
    error) has its place in the order; one that never reached it leaves a gap that holds back
    later calls until the server gives up on it (--order_timeout_s). Once nothing is in flight,
    Connection.training_client(model_id) resumes from wherever the server stands.
    """

    def __init__(self, connection, model_id: str, next_seq_id: int = 1):
        self.connection = connection
        self.model_id = model_id
        self._next_seq_id = next_seq_id
        self._lock = threading.Lock()

    def _take_seq_id(self) -> int:  # under self._lock
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    @property
    def next_seq_id(self) -> int:
        return self._next_seq_id

    def _send(self, make_request, rpc, convert) -> concurrent.futures.Future:
        """Numbers the request and queues its call under one lock, so the pool starts a model's
        calls in seq_id order: a call never waits for a worker behind a later one of its model."""
        with self._lock:
            request = make_request(self._take_seq_id())
            return self.connection.submit(lambda: convert(self.connection.call(rpc, request)))

    def forward_backward(self, data: Iterable[pb.Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: Mapping[str, float] | None = None):
        """Accumulates the batch's summed, token-weighted gradient; optim_step normalizes.
        Future of ForwardBackwardOutput."""
        data, loss = list(data), make_loss_fn(loss_fn, loss_fn_config)
        return self._send(lambda seq_id: pb.ForwardBackwardRequest(
            model_id=self.model_id, seq_id=seq_id, data=data, loss_fn=loss),
            self.connection.stub.ForwardBackward, ForwardBackwardOutput.from_proto)

    def forward(self, data: Iterable[pb.Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None):
        """Logprobs and loss without a gradient; ordered with the model's other calls."""
        data, loss = list(data), make_loss_fn(loss_fn, loss_fn_config)
        return self._send(lambda seq_id: pb.ForwardBackwardRequest(
            model_id=self.model_id, seq_id=seq_id, data=data, loss_fn=loss),
            self.connection.stub.Forward, ForwardBackwardOutput.from_proto)

    def optim_step(self, learning_rate: float | None = None, *, beta1: float | None = None,
                   beta2: float | None = None, eps: float | None = None,
                   weight_decay: float | None = None, grad_clip_norm: float | None = None):
        """AdamW on the accumulated gradient divided by its token (or sequence) count. Unset
        parameters take Tinker's defaults. Future of OptimStepOutput."""
        adam = pb.AdamParams(learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, grad_clip_norm=grad_clip_norm)
        return self._send(lambda seq_id: pb.OptimStepRequest(
            model_id=self.model_id, seq_id=seq_id, adam_params=adam),
            self.connection.stub.OptimStep, OptimStepOutput.from_proto)

    def stream_forward_backward(self, data: Iterable[pb.Datum], loss_fn: str = "cross_entropy",
                                loss_fn_config: Mapping[str, float] | None = None):
        """Sends each datum as `data` yields it (a generator may block until its next trajectory
        is done); applied as one forward_backward when `data` is exhausted. Returns the
        TrajectoryStream: `.future` for the result, `.cancel()` to discard it."""
        return self._open(loss_fn, loss_fn_config, data)

    def open_stream(self, loss_fn: str = "cross_entropy",
                    loss_fn_config: Mapping[str, float] | None = None) -> TrajectoryStream:
        """A stream to `write()` datums into, then `finish()` or `cancel()`."""
        return self._open(loss_fn, loss_fn_config, None)

    def _open(self, loss_fn, loss_fn_config, data) -> TrajectoryStream:
        loss = make_loss_fn(loss_fn, loss_fn_config)
        with self._lock:  # opened in its seq_id's place among the model's calls
            header = pb.StreamHeader(model_id=self.model_id, seq_id=self._take_seq_id(),
                                     loss_fn=loss)
            return TrajectoryStream(self.connection, header, data)

    # Checkpoints: futures of the tinker:// path.

    def save_state(self, name: str, *, overwrite: bool = False,
                   include_accumulated: bool = False):
        return self._send(lambda seq_id: pb.SaveStateRequest(
            model_id=self.model_id, seq_id=seq_id, name=name, overwrite=overwrite,
            include_accumulated=include_accumulated), self.connection.stub.SaveState,
            lambda r: r.path)

    def load_state(self, path: str, *, with_optimizer: bool = True):
        return self._send(lambda seq_id: pb.LoadStateRequest(
            model_id=self.model_id, seq_id=seq_id, path=path, with_optimizer=with_optimizer),
            self.connection.stub.LoadState, lambda r: r.path)

    def save_weights_for_sampler(self, name: str, *, merged: bool = False,
                                 overwrite: bool = False):
        """A PEFT adapter (or, merged, full Hugging Face weights) other tools can load."""
        return self._send(lambda seq_id: pb.SaveWeightsForSamplerRequest(
            model_id=self.model_id, seq_id=seq_id, name=name, merged=merged,
            overwrite=overwrite), self.connection.stub.SaveWeightsForSampler, lambda r: r.path)

    def save_weights_and_get_sampling_client(self):
        """A sampler frozen in this model's order: after every call made before, before every
        call made after. Retried with the same seq_id, so a retry gets the same sampler."""
        return self._send(lambda seq_id: pb.CreateSamplerRequest(
            model_id=self.model_id, seq_id=seq_id), self.connection.stub.CreateSampler,
            lambda info: self.connection.sampling_client(sampler_id=info.sampler_id))

    def get_info(self) -> pb.ModelInfo:
        return self.connection.get_info(self.model_id)

    def retrieve_result(self, seq_id: int) -> pb.RetrieveResultResponse:
        """A finished call's result again, while the server's cache keeps it."""
        request = pb.RetrieveResultRequest(model_id=self.model_id, seq_id=seq_id)
        return self.connection.call(self.connection.stub.RetrieveResult, request)
