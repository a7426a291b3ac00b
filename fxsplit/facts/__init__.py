"""Facts about graphs and ops, read from PyTorch's own machinery (schemas, tags,
functionalization, fake tensors): what an op is called, what it writes, what aliases what,
whether it can be captured. A leaf: the passes and the runtime both read it."""
