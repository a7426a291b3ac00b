"""The backend objects the vLLM tests name in vLLM's compilation_config (by qualified name,
``"tests.vllm.backends.v1"``), each with the CPU capture emulator."""

from fxsplit.vllm import VllmBackend

# The runner read from vLLM (its V1 model runner on the CPU, where V2 needs Triton).
auto = VllmBackend(capture="emulate")
v1 = VllmBackend(capture="emulate", runner="v1")
v2 = VllmBackend(capture="emulate", runner="v2")
