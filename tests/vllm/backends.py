"""The backend objects the vLLM tests name in vLLM's compilation_config (by qualified name,
``"tests.vllm.backends.v1"``), each with the CPU capture emulator, and one that keeps the size
inputs it read."""

import torch

from fxsplit.size_input import argument_name
from fxsplit.vllm import VllmBackend

# The runner read from vLLM (its V1 model runner on the CPU, where V2 needs Triton).
auto = VllmBackend(capture="emulate")
v1 = VllmBackend(capture="emulate", runner="v1")
v2 = VllmBackend(capture="emulate", runner="v2")


class SizeInputsRead(VllmBackend):
    """An adapter that keeps, per graph, the ``size_input`` it compiles with (read from vLLM's
    ``dynamic_arg_dims``) beside the arguments whose leading dim vLLM marked dynamic (a symbol
    in Dynamo's graph), in ``seen``."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.seen: list[tuple[tuple[str, ...], frozenset[str]]] = []

    def build(self, gm, example_inputs, config, frame, bundle=None, *, dynamic):
        marked = frozenset(
            argument_name(node)
            for node in gm.graph.find_nodes(op="placeholder")
            if isinstance(value := node.meta.get("example_value"), torch.Tensor)
            and value.dim() > 0
            and isinstance(value.shape[0], torch.SymInt)
        )
        self.seen.append((tuple(config.size_input or ()), marked))
        return super().build(gm, example_inputs, config, frame, bundle, dynamic=dynamic)


sizes = SizeInputsRead(capture="off")
