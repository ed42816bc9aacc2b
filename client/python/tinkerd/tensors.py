"""numpy arrays to and from the wire's Tensor, and the Datum a training call sends.

The wire packs tensors little-endian as float32 or int64 (proto/tinkerd/v1/tinkerd.proto). Integer
arrays travel as int64, every other array as float32, so a float64 weight is rounded to float32 on
the way, as the server would read it anyway.
"""

from typing import Iterable, Mapping

import numpy as np

from tinkerd.v1 import tinkerd_pb2 as pb


def to_tensor(values) -> pb.Tensor:
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        dtype, packed = pb.INT64, array.astype("<i8")
    elif array.dtype.kind in "fb":
        dtype, packed = pb.FLOAT32, array.astype("<f4")
    else:
        raise TypeError(f"a tensor holds integers or reals, not {array.dtype}")
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=packed.tobytes())


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    if tensor.dtype == pb.INT64:
        array = np.frombuffer(tensor.data, dtype="<i8")
    elif tensor.dtype == pb.FLOAT32:
        array = np.frombuffer(tensor.data, dtype="<f4")
    else:
        raise ValueError(f"unknown tensor dtype {tensor.dtype}")
    return array.reshape(tuple(tensor.shape)) if tensor.shape else array


def model_input(tokens: Iterable[int]) -> pb.ModelInput:
    text = pb.EncodedTextChunk(tokens=[int(t) for t in tokens])
    return pb.ModelInput(chunks=[pb.ModelInputChunk(encoded_text=text)])


def datum(tokens: Iterable[int], **loss_fn_inputs) -> pb.Datum:
    """One example: the tokens the model reads, and per-position loss inputs of the same length.

    Position t of `tokens` predicts target_tokens[t]. cross_entropy takes target_tokens and
    weights; the RL losses take target_tokens, logprobs (the sampler's) and advantages; any loss
    may add a 0/1 mask.
    """
    return pb.Datum(model_input=model_input(tokens),
                    loss_fn_inputs={k: to_tensor(v) for k, v in loss_fn_inputs.items()})


def loss_fn(name: str, config: Mapping[str, float] | None = None) -> pb.LossFn:
    return pb.LossFn(name=name, config=dict(config or {}))
