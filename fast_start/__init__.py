"""fast-start: keep an inference engine's weights resident on each GPU between engine restarts."""
from .client import Weights, fetch, load_into
from .errors import FastStartError
from .fingerprint import Fingerprint, WeightSpec

__all__ = ["WeightSpec", "Weights", "Fingerprint", "FastStartError", "fetch", "load_into"]
__version__ = "0.1.0"
