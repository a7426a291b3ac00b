"""What a captured piece reads: how each input is bound, fxsplit's own static buffers, and the
parameters and buffers read by address."""
