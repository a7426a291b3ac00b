"""CUDA/HIP graphs: one capture stream and memory pool per backend and device."""
