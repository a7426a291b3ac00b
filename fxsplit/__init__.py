"""fxsplit: a torch.compile backend that splits Dynamo graphs for piecewise CUDA/HIP graph capture.

``torch.compile(model, backend="fxsplit")`` marks the regions a runner needs eager (attention input
preparation, the sparse top-k indexer, attention, capture-unsafe ops), splits the graph there, and
runs the remaining pieces captured.
"""

from importlib.metadata import PackageNotFoundError, version

from fxsplit import counters, presets, runners
from fxsplit.backend import Backend, plans
from fxsplit.config import Config
from fxsplit.distributed import RankMismatchError
from fxsplit.explain import explain
from fxsplit.plan import Piece, SplitPlan
from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER, region
from fxsplit.runtime.binding import BindingError
from fxsplit.runtime.captured import CaptureRefusedError, VerifyError
from fxsplit.runtime.emulator import CaptureError
from fxsplit.runtime.output_lifetime import StaleOutputError

try:
    __version__ = version("fxsplit")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "ATTENTION",
    "ATTN_PREP",
    "SPARSE_INDEXER",
    "Backend",
    "BindingError",
    "CaptureError",
    "CaptureRefusedError",
    "Config",
    "Piece",
    "RankMismatchError",
    "SplitPlan",
    "StaleOutputError",
    "VerifyError",
    "counters",
    "explain",
    "plans",
    "presets",
    "region",
    "runners",
]
