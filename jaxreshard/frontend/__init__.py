"""The frontend: markers, and the jaxpr passes that cut a train step into pipeline stages."""

from jaxreshard.frontend._batch import MicroBatchWarning as MicroBatchWarning
from jaxreshard.frontend._jaxprs import PipelineSplitError as PipelineSplitError
from jaxreshard.frontend._markers import filter_grad as filter_grad
from jaxreshard.frontend._markers import filter_value_and_grad as filter_value_and_grad
from jaxreshard.frontend._markers import grad as grad
from jaxreshard.frontend._markers import stage_boundary as stage_boundary
from jaxreshard.frontend._markers import stage_candidate as stage_candidate
from jaxreshard.frontend._markers import value_and_grad as value_and_grad
from jaxreshard.frontend._scan import scan as scan

__all__ = [
    "MicroBatchWarning",
    "PipelineSplitError",
    "filter_grad",
    "filter_value_and_grad",
    "grad",
    "scan",
    "stage_boundary",
    "stage_candidate",
    "value_and_grad",
]
