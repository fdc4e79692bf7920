"""The curation stage registry: stage name → ``factory(recipe, cache_dir) -> stage``.

The same ``Registry`` the losses use (``posttrain.algorithms.registry``): registering a name twice is
an error, and an unknown name gets the nearest valid one in its message. Each stage registers its
factory next to its class (``@CURATION_STAGES.register("filters")``). Stage modules are imported
only when their stage runs (``posttrain.curate.stages.STAGE_MODULES``), so a worker that runs the
filters never imports torch for the difficulty stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.algorithms.registry import Registry

if TYPE_CHECKING:
    from posttrain.curate.config import CurateRecipe

StageFactory = Callable[["CurateRecipe", "str | None"], Any]

CURATION_STAGES: Registry[StageFactory] = Registry("curation stage")
