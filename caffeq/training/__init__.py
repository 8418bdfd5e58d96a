"""The pieces of fine-tuning (caffeq.finetune runs them; caffeq.sensitivity shares the feeding):

- ste.py: binary weights with a straight-through estimator, as torch parametrizations, and the
  module state (latent weights) they train;
- batchnorm.py: exact BatchNorm statistics re-estimation;
- feeding.py: datasets per epoch, loaders, batches to module inputs, the score blob, Caffe's
  accuracy rule.
"""
from ..errors import CaffeqError


class FinetuneError(CaffeqError):
    """A bad fine-tuning request (flags, data, model)."""
