"""SamplingClient: sample completions and compute logprobs from a frozen policy.

What samples is a sampler (a frozen copy of a model's weights, see docs/sampling.md), else a
model's current weights at each request, else the base model. Sampling reads no training state,
so a call is retried freely; RESOURCE_EXHAUSTED (the sampler is full) is retried with backoff.
"""

import dataclasses
import random
import time
from typing import Iterable, Sequence

import grpc
import numpy as np

from tinkerd.connection import RETRIED, is_size_refusal
from tinkerd.errors import from_rpc
from tinkerd.tensors import model_input
from tinkerd.v1 import tinkerd_pb2 as pb

_STOP_REASONS = {pb.STOP_REASON_LENGTH: "length", pb.STOP_REASON_STOP: "stop"}


@dataclasses.dataclass
class SampledSequence:
    tokens: np.ndarray    # int64 [N]
    logprobs: np.ndarray  # float64 [N]: log p(token | context) under the model, at temperature 1
    stop_reason: str      # "length" (max_tokens) or "stop" (a stop sequence, kept in tokens)
    # int64 [N - 1, R, k] when routed_experts was asked: the experts of each token fed back
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None  # float64 [P], NaN at 0; when asked
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None  # [P], most likely first
    prompt_routed_experts: np.ndarray | None = None  # int64 [P, R, k]; when asked

    def routes(self, i: int) -> np.ndarray:
        """Sample i's trajectory routes, int64 [P + N - 1, R, k]: what a datum of prompt +
        tokens[:-1] sends as routed_experts (router replay, docs/sampling.md)."""
        return np.concatenate([self.prompt_routed_experts, self.sequences[i].routed_experts])

    @staticmethod
    def from_proto(reply: pb.SampleResponse, prompt_logprobs: bool,
                   topk: int, routed_experts: bool = False) -> "SampleOutput":
        width = (-1, reply.routed_layers, reply.experts_per_token)

        def routes(values):
            return np.array(values, dtype=np.int64).reshape(width) if routed_experts else None

        sequences = [SampledSequence(np.array(s.tokens, dtype=np.int64),
                                     np.array(s.logprobs, dtype=np.float64),
                                     _STOP_REASONS.get(s.stop_reason, "unspecified"),
                                     routes(s.routed_experts))
                     for s in reply.sequences]
        prompt = np.array(reply.prompt_logprobs, dtype=np.float64) if prompt_logprobs else None
        top = ([list(zip(t.tokens, t.logprobs)) for t in reply.topk_prompt_logprobs]
               if topk > 0 else None)
        return SampleOutput(sequences, prompt, top, routes(reply.prompt_routed_experts))


@dataclasses.dataclass
class SampleDelta:
    """What one sample gained since the previous delta; a sample's deltas concatenate to it."""
    index: int            # which sample, 0 <= index < num_samples
    tokens: np.ndarray    # int64
    logprobs: np.ndarray  # float64
    stop_reason: str | None  # set on the sample's last delta: "length" or "stop"


class SampleStream:
    """Iterates over SampleDelta as the server decodes them (SampleStream RPC). `cancel()`, or
    leaving the loop early, ends the call: the iteration stops and the server stops the samples
    at its next decode step. After the iteration, `prompt_logprobs` / `topk_prompt_logprobs` hold
    what was asked for. Retried (UNAVAILABLE, RESOURCE_EXHAUSTED) only until the first delta
    arrives, so no token is delivered twice. Iterate once: each iteration samples anew."""

    def __init__(self, connection, request: pb.SampleRequest):
        self._connection = connection
        self._request = request
        self._call = None
        self._cancelled = False
        self.prompt_logprobs: np.ndarray | None = None
        self.topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __iter__(self):
        conn = self._connection
        backoff, attempt, started = conn.initial_backoff, 0, False
        while not self._cancelled:
            attempt += 1
            self._call = conn.stub.SampleStream(self._request, timeout=conn.deadline,
                                                metadata=conn.metadata)
            try:
                for message in self._call:
                    started = True
                    for d in message.deltas:
                        yield SampleDelta(d.index, np.array(d.tokens, dtype=np.int64),
                                          np.array(d.logprobs, dtype=np.float64),
                                          _STOP_REASONS.get(d.stop_reason))
                    if self._request.prompt_logprobs and message.prompt_logprobs:
                        self.prompt_logprobs = np.array(message.prompt_logprobs, np.float64)
                    if message.topk_prompt_logprobs:
                        self.topk_prompt_logprobs = [list(zip(t.tokens, t.logprobs))
                                                     for t in message.topk_prompt_logprobs]
                return
            except grpc.RpcError as error:
                if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                    return
                if (started or error.code() not in RETRIED or is_size_refusal(error)
                        or attempt >= conn.max_attempts):
                    raise from_rpc(error) from None
            finally:  # a consumer that left the loop early: the server stops sampling
                self._call.cancel()
            time.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, conn.max_backoff)


class SamplingClient:
    def __init__(self, connection, *, sampler_id: str = "", model_id: str = "",
                 base_model: str = ""):
        self.connection = connection
        self.sampler_id = sampler_id
        self.model_id = model_id
        self.base_model = base_model

    def sample(self, prompt: Sequence[int], *, max_tokens: int, num_samples: int = 1,
               temperature: float | None = None, top_k: int = 0, top_p: float | None = None,
               seed: int | None = None, stop: Iterable[Sequence[int]] = (),
               prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
               routed_experts: bool = False):
        """`num_samples` completions of `prompt` sharing its prefill. temperature 0 is greedy;
        a seed makes the tokens the same on every run. `routed_experts` (a mixture of experts):
        also every token's experts, for router replay (SampleOutput.routes). Future of
        SampleOutput."""
        request = self._request(prompt, max_tokens, num_samples, temperature, top_k, top_p, seed,
                                stop, prompt_logprobs, topk_prompt_logprobs)
        request.routed_experts = routed_experts
        return self.connection.submit_sampling(lambda: SampleOutput.from_proto(
            self.connection.call(self.connection.stub.Sample, request), prompt_logprobs,
            topk_prompt_logprobs, routed_experts))

    def sample_stream(self, prompt: Sequence[int], *, max_tokens: int, num_samples: int = 1,
                      temperature: float | None = None, top_k: int = 0,
                      top_p: float | None = None, seed: int | None = None,
                      stop: Iterable[Sequence[int]] = (), prompt_logprobs: bool = False,
                      topk_prompt_logprobs: int = 0) -> SampleStream:
        """The same as sample(), token by token: iterate over the returned SampleStream."""
        return SampleStream(self.connection, self._request(
            prompt, max_tokens, num_samples, temperature, top_k, top_p, seed, stop,
            prompt_logprobs, topk_prompt_logprobs))

    def compute_logprobs(self, prompt: Sequence[int]):
        """Future of float64 [P]: log p(prompt[t] | prompt[:t]), NaN at position 0."""
        request = pb.ComputeLogprobsRequest(sampler_id=self.sampler_id, model_id=self.model_id,
                                            base_model=self.base_model,
                                            prompt=model_input(prompt))
        return self.connection.submit_sampling(lambda: np.array(
            self.connection.call(self.connection.stub.ComputeLogprobs, request).logprobs,
            dtype=np.float64))

    def _request(self, prompt, max_tokens, num_samples, temperature, top_k, top_p, seed, stop,
                 prompt_logprobs, topk_prompt_logprobs) -> pb.SampleRequest:
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed,
                                   stop=[pb.EncodedTextChunk(tokens=list(s)) for s in stop])
        return pb.SampleRequest(sampler_id=self.sampler_id, model_id=self.model_id,
                                base_model=self.base_model,
                                prompt=model_input(prompt), num_samples=num_samples,
                                sampling_params=params, prompt_logprobs=prompt_logprobs,
                                topk_prompt_logprobs=topk_prompt_logprobs)

    def delete(self) -> None:
        """Frees the sampler on the server (a no-op for a model's or the base model's weights)."""
        if self.sampler_id:
            self.connection.call(self.connection.stub.DeleteSampler,
                                 pb.SamplerRef(sampler_id=self.sampler_id))
