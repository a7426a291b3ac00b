"""fxsplit: a torch.compile backend that splits Dynamo graphs for piecewise CUDA/HIP graph capture.

``torch.compile(model, backend="fxsplit")`` marks the regions a runner needs eager (attention input
preparation, the sparse top-k indexer, attention, capture-unsafe ops), splits the graph there, and
runs the remaining pieces captured.
"""

from fxsplit import counters, runners
from fxsplit.backend import Backend, plans
from fxsplit.config import Config
from fxsplit.explain import explain
from fxsplit.plan import Piece, SplitPlan
from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER, region

__all__ = [
    "ATTENTION",
    "ATTN_PREP",
    "SPARSE_INDEXER",
    "Backend",
    "Config",
    "Piece",
    "SplitPlan",
    "counters",
    "explain",
    "plans",
    "region",
    "runners",
]
