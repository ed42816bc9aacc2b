"""One channel to one tinkerd, the retry policy every unary call goes through, and model
management (create, inspect, delete, checkpoints, samplers)."""

import concurrent.futures
import random
import time
from typing import Callable

import grpc

from tinkerd.errors import TinkerdError, from_rpc
from tinkerd.v1 import tinkerd_pb2 as pb
from tinkerd.v1 import tinkerd_pb2_grpc as pb_grpc

# Retried: the server did not take the call (down, restarting, draining) or asked for patience
# (a full queue or sampler). Everything else is an answer and is returned at once.
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def is_size_refusal(error: grpc.RpcError) -> bool:
    # gRPC reports an oversized message as RESOURCE_EXHAUSTED too; a retry would fail the same way.
    return "message larger than max" in (error.details() or "")


class Connection:
    """A channel to one server, shared by every client made from it. Thread-safe.

    Connects lazily: an unreachable server shows up as UNAVAILABLE on the first call, after its
    retries. Every unary call is attempted up to `max_attempts` times with jittered exponential
    backoff; each attempt has its own `deadline` (seconds), generous by default because a
    pipelined request waits on the server for its predecessors. Training calls' futures run on a
    pool of `max_workers` threads (each call's retry loop on one of them) and sampling calls' on
    a pool of their own, so that calls held on the server behind an open stream never keep the
    samples that the stream's producer waits for from running.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls: bool = False, root_certs: bytes | None = None,
                 client_cert: bytes | None = None, client_key: bytes | None = None,
                 max_attempts: int = 8, initial_backoff: float = 0.05, max_backoff: float = 2.0,
                 deadline: float = 600.0, max_message_bytes: int = 256 << 20,
                 max_workers: int = 32, channel: grpc.Channel | None = None):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key go together (mutual TLS)")
        self.max_attempts = max_attempts
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.deadline = deadline
        self.metadata = (("x-api-key", api_key),) if api_key else ()
        if channel is None:
            options = [("grpc.max_send_message_length", max_message_bytes),
                       ("grpc.max_receive_message_length", max_message_bytes)]
            if tls:
                creds = grpc.ssl_channel_credentials(root_certs, client_key, client_cert)
                channel = grpc.secure_channel(target, creds, options)
            else:
                channel = grpc.insecure_channel(target, options)
        self.channel = channel
        self.stub = pb_grpc.TinkerdStub(channel)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers,
                                                              thread_name_prefix="tinkerd")
        self.sampling_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="tinkerd-sample")

    def close(self) -> None:
        """Waits for the calls in flight, then closes the channel."""
        self.executor.shutdown(wait=True)
        self.sampling_executor.shutdown(wait=True)
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, rpc: Callable, request):
        """Sends `request` through `rpc` (a stub method), the identical request on every attempt:
        that is what keeps a mutating call exactly-once. Raises TinkerdError."""
        backoff = self.initial_backoff
        for attempt in range(1, self.max_attempts + 1):
            try:
                return rpc(request, timeout=self.deadline, metadata=self.metadata)
            except grpc.RpcError as error:
                if (error.code() not in RETRIED or is_size_refusal(error)
                        or attempt == self.max_attempts):
                    raise from_rpc(error) from None
            time.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.max_backoff)
        raise AssertionError("unreachable")

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self.executor.submit(fn, *args)

    def submit_sampling(self, fn, *args) -> concurrent.futures.Future:
        return self.sampling_executor.submit(fn, *args)

    # Models.

    def create_model(self, *, lora_rank: int = 32, lora_alpha: float = 0.0,
                     train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                     full_finetune: bool = False, loss_reduction: str = "token_mean",
                     seed: int = 0, base_model: str = "") -> pb.ModelInfo:
        """A new model: a LoRA adapter on the base model, or every weight with full_finetune.
        `base_model`: which of the server's bases (its served name; empty: the default).

        Creation has no idempotency key: a retry after a lost reply makes a second model.
        """
        lora = pb.LoraConfig(rank=lora_rank, alpha=lora_alpha, train_attn=train_attn,
                             train_mlp=train_mlp, train_unembed=train_unembed)
        request = pb.CreateModelRequest(lora=lora, full_finetune=full_finetune,
                                        loss_reduction=loss_reduction, seed=seed,
                                        base_model=base_model)
        return self.call(self.stub.CreateModel, request)

    def get_info(self, model_id: str) -> pb.ModelInfo:
        return self.call(self.stub.GetInfo, pb.ModelRef(model_id=model_id))

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self.call(self.stub.ListModels, pb.ListModelsRequest()).models)

    def delete_model(self, model_id: str) -> None:
        self.call(self.stub.DeleteModel, pb.ModelRef(model_id=model_id))

    def training_client(self, model_id: str, next_seq_id: int | None = None):
        """A TrainingClient for an existing model. `next_seq_id` defaults to the server's (from
        GetInfo), which is right for a fresh model and for resuming once nothing is in flight."""
        from tinkerd.training import TrainingClient
        if next_seq_id is None:
            next_seq_id = self.get_info(model_id).next_seq_id
        return TrainingClient(self, model_id, next_seq_id)

    def create_training_client(self, **create_model_args):
        """create_model, then a TrainingClient for it."""
        info = self.create_model(**create_model_args)
        return self.training_client(info.model_id, info.next_seq_id)

    def create_model_from_state(self, path: str, with_optimizer: bool = True):
        """A new model from a tinker://<model>/weights/<name> checkpoint; its TrainingClient."""
        request = pb.CreateModelFromStateRequest(path=path, with_optimizer=with_optimizer)
        info = self.call(self.stub.CreateModelFromState, request)
        return self.training_client(info.model_id, info.next_seq_id)

    # Checkpoints.

    def list_checkpoints(self, model_id: str) -> list[pb.CheckpointInfo]:
        request = pb.ListCheckpointsRequest(model_id=model_id)
        return list(self.call(self.stub.ListCheckpoints, request).checkpoints)

    def delete_checkpoint(self, path: str) -> None:
        self.call(self.stub.DeleteCheckpoint, pb.DeleteCheckpointRequest(path=path))

    # Sampling.

    def sampling_client(self, *, sampler_id: str = "", model_id: str = "", base_model: str = ""):
        """What samples: a sampler, else a model's weights at each request, else a base model
        (`base_model`, a served name; empty: the default)."""
        from tinkerd.sampling import SamplingClient
        return SamplingClient(self, sampler_id=sampler_id, model_id=model_id,
                              base_model=base_model)

    def create_sampling_client(self, *, model_id: str = "", path: str = "", base_model: str = ""):
        """A sampler frozen now from a model (between two of its jobs), from a
        tinker://<model>/sampler_weights/<name> export, or from a base model (neither;
        `base_model` names it, empty the default)."""
        info = self.call(self.stub.CreateSampler, pb.CreateSamplerRequest(
            model_id=model_id, path=path, base_model=base_model))
        return self.sampling_client(sampler_id=info.sampler_id)

    def health(self) -> bool:
        """grpc.health.v1 Check for the whole server: True when it is SERVING."""
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check")
        # HealthCheckRequest{service: ""} encodes to no bytes; the reply's field 1 is the status
        # enum, SERVING = 1 (grpc/health/v1/health.proto), encoded as the bytes 08 01.
        reply = self.call(check, b"")
        return reply == b"\x08\x01"


__all__ = ["Connection", "TinkerdError"]
