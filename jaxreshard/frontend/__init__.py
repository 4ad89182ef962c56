"""The frontend: markers, and the jaxpr passes that cut a train step into pipeline stages."""

from jaxreshard.frontend._markers import grad as grad
from jaxreshard.frontend._markers import stage_boundary as stage_boundary
from jaxreshard.frontend._markers import value_and_grad as value_and_grad

__all__ = ["grad", "stage_boundary", "value_and_grad"]
