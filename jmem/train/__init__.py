"""Training: chunked LM loss, the jitted train step, and the loop behind `experiments/train.py`.

Example:
    >>> from jmem.train import TrainConfig, train
    >>> result = train(TrainConfig(model="tiny", steps=20))
"""

from jmem.train.config import OPTIMIZERS, TrainConfig
from jmem.train.loop import TrainResult, train
from jmem.train.loss import chunked_cross_entropy, cross_entropy_sum, lm_loss_sum, lm_loss_terms, router_loss
from jmem.train.step import TrainFns, TrainState, make_train_fns

__all__ = [
    "OPTIMIZERS",
    "TrainConfig",
    "TrainFns",
    "TrainResult",
    "TrainState",
    "chunked_cross_entropy",
    "cross_entropy_sum",
    "lm_loss_sum",
    "lm_loss_terms",
    "make_train_fns",
    "router_loss",
    "train",
]
