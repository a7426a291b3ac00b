"""The CPU capture emulator: CUDA-graph semantics on the CPU, and its memory pool."""
