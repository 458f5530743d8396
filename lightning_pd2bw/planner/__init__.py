"""The planner: profiles (measured or analytic), the 2BW/Flush cost model, and the search over
width, depth, microbatch size and recomputation (PipeDream-2BW, section 3.3). ``pd2bw-plan``."""

from .cost import Candidate, Prediction, predict
from .hardware import ClusterSpec, DeviceSpec, device_spec
from .profile import LayerProfile, analytic_profile
from .search import NoPlanFits, format_table, search

__all__ = [
    "Candidate",
    "ClusterSpec",
    "DeviceSpec",
    "LayerProfile",
    "NoPlanFits",
    "Prediction",
    "analytic_profile",
    "device_spec",
    "format_table",
    "predict",
    "search",
]
