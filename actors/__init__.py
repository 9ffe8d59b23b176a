"""TreeGraft as Ray actors: a tensor-parallel target worker group, a middle-drafter actor on its own GPU,
an n-gram drafter actor on CPU, and a coordinator that owns the draft trees and drives the rounds.

The actors are thin shells over the single-process classes of `treegraft_dist`; only token ids and
tree structure (plain arrays) travel between them.
"""

from .engine import DistributedEngine
from .resources import PlacementError, Resources
from .target import TargetGroupError

__all__ = ["DistributedEngine", "PlacementError", "Resources", "TargetGroupError"]
