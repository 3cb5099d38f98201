"""Training: chunked LM loss, the jitted train step, and the loop behind `experiments/train.py`.

Example:
    >>> from jmem.train import TrainConfig, train
    >>> result = train(TrainConfig(model="tiny", steps=20))
"""

from jmem.train.config import OPTIMIZERS, TrainConfig
from jmem.train.layerwise import LayerwiseFns, active_layers, make_layerwise_fns
from jmem.train.loop import TrainResult, train
from jmem.train.loss import chunked_cross_entropy, cross_entropy_sum, lm_loss_sum, lm_loss_terms, router_loss
from jmem.train.step import TrainFns, TrainState, make_train_fns

__all__ = [
    "OPTIMIZERS",
    "LayerwiseFns",
    "TrainConfig",
    "TrainFns",
    "TrainResult",
    "TrainState",
    "active_layers",
    "chunked_cross_entropy",
    "cross_entropy_sum",
    "lm_loss_sum",
    "lm_loss_terms",
    "make_layerwise_fns",
    "make_train_fns",
    "router_loss",
    "train",
]
