"""Python client for tinkerd's gRPC API (proto/tinkerd/v1/tinkerd.proto).

    import tinkerd
    with tinkerd.Connection("127.0.0.1:50051") as conn:
        trainer = conn.create_training_client(lora_rank=16)
        out = trainer.forward_backward([tinkerd.datum(tokens, target_tokens=t, weights=w)])
        trainer.optim_step(learning_rate=1e-3).result()

Every call that changes a model returns a concurrent.futures.Future; failures raise TinkerdError.
"""

from tinkerd.connection import Connection
from tinkerd.errors import TinkerdError
from tinkerd.sampling import (SampleDelta, SampledSequence, SampleOutput, SampleStream,
                              SamplingClient)
from tinkerd.tensors import datum, from_tensor, model_input, to_tensor
from tinkerd.training import (ForwardBackwardOutput, OptimStepOutput, TrainingClient,
                              TrajectoryStream)

__all__ = [
    "Connection", "TinkerdError", "TrainingClient", "TrajectoryStream", "SamplingClient",
    "ForwardBackwardOutput", "OptimStepOutput", "SampleOutput", "SampledSequence", "SampleDelta",
    "SampleStream", "datum",
    "model_input", "to_tensor", "from_tensor",
]
