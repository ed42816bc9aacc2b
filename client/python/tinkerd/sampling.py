"""SamplingClient: sample completions and compute logprobs from a frozen policy.

What samples is a sampler (a frozen copy of a model's weights, see docs/sampling.md), else a
model's current weights at each request, else the base model. Sampling reads no training state,
so a call is retried freely; RESOURCE_EXHAUSTED (the sampler is full) is retried with backoff.
"""

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from tinkerd.tensors import model_input
from tinkerd.v1 import tinkerd_pb2 as pb

_STOP_REASONS = {pb.STOP_REASON_LENGTH: "length", pb.STOP_REASON_STOP: "stop"}


@dataclasses.dataclass
class SampledSequence:
    tokens: np.ndarray    # int64 [N]
    logprobs: np.ndarray  # float64 [N]: log p(token | context) under the model, at temperature 1
    stop_reason: str      # "length" (max_tokens) or "stop" (a stop sequence, kept in tokens)


@dataclasses.dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None  # float64 [P], NaN at 0; when asked
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None  # [P], most likely first

    @staticmethod
    def from_proto(reply: pb.SampleResponse, prompt_logprobs: bool,
                   topk: int) -> "SampleOutput":
        sequences = [SampledSequence(np.array(s.tokens, dtype=np.int64),
                                     np.array(s.logprobs, dtype=np.float64),
                                     _STOP_REASONS.get(s.stop_reason, "unspecified"))
                     for s in reply.sequences]
        prompt = np.array(reply.prompt_logprobs, dtype=np.float64) if prompt_logprobs else None
        top = ([list(zip(t.tokens, t.logprobs)) for t in reply.topk_prompt_logprobs]
               if topk > 0 else None)
        return SampleOutput(sequences, prompt, top)


class SamplingClient:
    def __init__(self, connection, *, sampler_id: str = "", model_id: str = ""):
        self.connection = connection
        self.sampler_id = sampler_id
        self.model_id = model_id

    def sample(self, prompt: Sequence[int], *, max_tokens: int, num_samples: int = 1,
               temperature: float | None = None, top_k: int = 0, top_p: float | None = None,
               seed: int | None = None, stop: Iterable[Sequence[int]] = (),
               prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0):
        """`num_samples` completions of `prompt` sharing its prefill. temperature 0 is greedy;
        a seed makes the tokens the same on every run. Future of SampleOutput."""
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed,
                                   stop=[pb.EncodedTextChunk(tokens=list(s)) for s in stop])
        request = pb.SampleRequest(sampler_id=self.sampler_id, model_id=self.model_id,
                                   prompt=model_input(prompt), num_samples=num_samples,
                                   sampling_params=params, prompt_logprobs=prompt_logprobs,
                                   topk_prompt_logprobs=topk_prompt_logprobs)
        return self.connection.submit(lambda: SampleOutput.from_proto(
            self.connection.call(self.connection.stub.Sample, request), prompt_logprobs,
            topk_prompt_logprobs))

    def compute_logprobs(self, prompt: Sequence[int]):
        """Future of float64 [P]: log p(prompt[t] | prompt[:t]), NaN at position 0."""
        request = pb.ComputeLogprobsRequest(sampler_id=self.sampler_id, model_id=self.model_id,
                                            prompt=model_input(prompt))
        return self.connection.submit(lambda: np.array(
            self.connection.call(self.connection.stub.ComputeLogprobs, request).logprobs,
            dtype=np.float64))

    def delete(self) -> None:
        """Frees the sampler on the server (a no-op for a model's or the base model's weights)."""
        if self.sampler_id:
            self.connection.call(self.connection.stub.DeleteSampler,
                                 pb.SamplerRef(sampler_id=self.sampler_id))
