"""Capture memory: the pool and its capture order, outputs handed out and lent, and which
memory fxsplit produced."""
