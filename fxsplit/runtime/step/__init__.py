"""One step of a compiled graph: the callable Dynamo runs, the backend's session of steps and
pools, and the per-graph facts its pieces read."""
